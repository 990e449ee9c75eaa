"""The intra-GPU MLP chain, eager and captured in a CUDA graph, against torch and stream sync.

    python benchmarks/chain_graph.py [--out DIR] [--rows 512,1024,2048] [--rounds 5]
                                     [--calls 20] [--max-seconds 300]

``y = gelu(x @ w1) @ w2`` on one GPU, x [M, K], w1 [K, F], w2 [F, K]: the MLP slices of
GPT-3 175B (hidden 12288, FFN 49152) and LLaMA-2 70B (hidden 8192, FFN 28672) at tensor
parallel 4 and 8 (F = FFN / TP), M = 512, 1024, 2048 tokens, bf16. Per shape, after
``tune_mlp_chain`` picked both tile kernels' configs (the stream-synced chain runs the same
two kernels):

- ``torch``: cuBLAS + gelu + cuBLAS (``mlp_chain_ref``);
- ``stream-sync``: the two tile kernels one after the other, each over every SM;
- ``sync own``: the same with each GEMM's own pick alone (``tune_gemm``, BLOCK_M 128, its
  GROUP_M order), the baseline where the chain's tuner took BLOCK_M 64 or row-block
  order; the ``flag / sync`` figures divide by the faster of the two;
- ``row``: the chain with RowSync (fc2's tiles of a row block start once fc1 stored it);
- ``tile``: the chain with TileSync (each K group of an fc2 tile waits for the fc1 tile it reads);
- ``row pdl``: RowSync with both kernels on one stream, fc2 a programmatic dependent launch
  of fc1 (``ChainConfig.launch="pdl"``; where ``pdl_supported``); ``row`` and ``tile`` take
  the other launch, two streams and a start gate;
- ``fc1``, ``fc2``: each tile kernel alone over every SM (their sum is what stream sync
  costs without the gap between them).

fc2 in the chain and in stream sync runs on the engine the consumer ops take
(``overlap.kernels.engine``: the Gluon GEMM where it measured faster, else the tile GEMM;
``OVERLAP_GEMM_ENGINE`` forces one); ``fc2_engines`` names what each took per tile.

each eager (``calls`` calls queued back to back, after a sleep that keeps the GPU ahead
of the host, so host time is hidden) and as a CUDA graph of ``calls`` calls, in
interleaved rounds, medians of ms per call. Before timing, each captured graph is
replayed with a new x copied into its input and checked against ``mlp_chain_ref`` (a
stale read fails the check). The waves columns say how many waves of tiles each GEMM has
on the SMs it gets (the tail of fc1's last wave is what tile flags can fill);
``wave_model`` is the chain model's bound (``benchmarks/chain_model.py``) on flags over
the best stream sync: with the best tiles and orders (``ceiling``) and with the tuned ones.

Writes ``chain_graph.json`` ({"context", "rows"}) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.context import run_context  # noqa: E402

MODELS = {"gpt3-175b": (12288, 49152), "llama2-70b": (8192, 28672)}
TPS = (4, 8)
VARIANTS = ("torch", "stream-sync", "sync own", "row", "tile", "row pdl", "fc1", "fc2")


def shapes(rows: tuple[int, ...]) -> list[dict[str, Any]]:
    out = []
    for model, (hidden, ffn) in MODELS.items():
        for tp in TPS:
            for m in rows:
                out.append({"model": model, "tp": tp, "m": m, "k": hidden, "f": ffn // tp})
    return out


def _timed(fn: Callable[[], Any], calls: int) -> float:
    """ms per call of ``calls`` calls of ``fn`` queued behind a sleep (GPU time, host hidden)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(20_000_000)  # ~10 ms: the host queues every call before the GPU gets to them
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def _graph(fn: Callable[[], Any], calls: int) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn`` called ``calls`` times in one CUDA graph (after warm calls on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            out = fn()
    torch.cuda.synchronize()
    return g, out


def waves(tiles: int, sms: int) -> float:
    return tiles / sms


def run_shape(sh: dict[str, Any], calls: int, rounds: int) -> dict[str, Any]:
    from dataclasses import replace

    from benchmarks import chain_model
    from overlap.kernels.autotune import tune_gemm
    from overlap.kernels.tile_gemm import launch_tile_gemm, pdl_supported
    from overlap.ops import ChainConfig, mlp_chain, mlp_chain_ref, mlp_chain_stream_sync, tune_mlp_chain
    from overlap.ops import chain as ch

    dev = torch.device("cuda", torch.cuda.current_device())
    m, k, f = sh["m"], sh["k"], sh["f"]
    gen = torch.Generator(device=dev).manual_seed(m + k + f)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
    w1 = (torch.randn(f, k, device=dev, dtype=torch.bfloat16, generator=gen) * k ** -0.5).t()  # fc1.weight.t()
    w2 = (torch.randn(k, f, device=dev, dtype=torch.bfloat16, generator=gen) * f ** -0.5).t()  # fc2.weight.t()
    t0 = time.perf_counter()
    tuned = tune_mlp_chain(x, w1, w2)
    tune_s = time.perf_counter() - t0
    cfg = replace(tuned, launch="streams")
    pdl = replace(tuned, launch="pdl") if pdl_supported(dev) else None
    variants = [v for v in VARIANTS if v != "row pdl" or pdl is not None]
    rt = ch._runtime(dev)
    prod, cons, *_ = ch._tables(rt, m, f, k, cfg)
    pc = cfg.producer or ch._default_gemm()
    cc = cfg.consumer or pc
    # each GEMM's own pick alone (per-tile kernel, BLOCK_M 128, its GROUP_M order): the
    # stream-synced baseline when the chain's tuner took BLOCK_M 64 or row-block order
    own = ChainConfig(producer=tune_gemm(m, f, k, dtype=x.dtype, device=dev, block_m=128),
                      consumer=tune_gemm(m, k, f, dtype=x.dtype, device=dev, block_m=128))
    mid = torch.empty(m, f, device=dev, dtype=torch.bfloat16)
    y = torch.empty(m, k, device=dev, dtype=torch.bfloat16)
    fns: dict[str, Callable[[], Any]] = {
        "torch": lambda: mlp_chain_ref(x, w1, w2),
        "stream-sync": lambda: mlp_chain_stream_sync(x, w1, w2, config=cfg),
        "sync own": lambda: mlp_chain_stream_sync(x, w1, w2, config=own),
        "row": lambda: mlp_chain(x, w1, w2, config=cfg, sync="row"),
        "tile": lambda: mlp_chain(x, w1, w2, config=cfg, sync="tile"),
        "row pdl": lambda: mlp_chain(x, w1, w2, config=pdl, sync="row"),
        "fc1": lambda: launch_tile_gemm(x, w1, mid, prod, grid=rt.num_sms, config=pc, activation="gelu"),
        "fc2": lambda: launch_tile_gemm(mid, w2, y, cons, grid=rt.num_sms, config=cc),
    }
    row: dict[str, Any] = dict(sh, tune_s=round(tune_s, 3), producer=str(pc), consumer=str(cc), launch=tuned.launch,
                               fc1_tiles=len(prod), fc2_tiles=len(cons), sms=rt.num_sms)
    row["fc1_waves"] = waves(len(prod), rt.num_sms)
    row["fc2_waves"] = waves(len(cons), rt.num_sms)
    row["own"] = [str(own.producer), str(own.consumer)]
    # the chain model (benchmarks/chain_model.py): flags over the best stream sync at best
    # (its ceiling) and with the tuned tiles and orders
    best_sync = chain_model.best_sync(m, k, f, k, rt.num_sms)
    tuned_plan = chain_model.plan(m, k, f, k, pc.block_m, pc.block_n, cc.block_n, pc.group_m, cc.group_m, rt.num_sms)
    row["wave_model"] = {"ceiling": best_sync / chain_model.plans(m, k, f, k, rt.num_sms)[0].flag,
                         "tuned": best_sync / tuned_plan.flag}
    graphs: dict[str, Any] = {}
    errs: dict[str, float] = {}
    for name in [v for v in variants if v not in ("fc1", "fc2")]:
        fns[name]()  # eager warm call (plans, compiles) before any capture
        g, out = _graph(fns[name], calls)
        # a new x, then a replay: the captured calls must read it (a stale read fails here)
        x.copy_(torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen))
        g.replay()
        torch.cuda.synchronize()
        want = mlp_chain_ref(x, w1, w2).float()
        errs[name] = float((out.float() - want).norm() / want.norm())
        graphs[name] = g
    for name in ("fc1", "fc2"):
        fns[name]()
        graphs[name] = _graph(fns[name], calls)[0]
    times: dict[str, list[float]] = {f"{v} {mode}": [] for v in variants for mode in ("eager", "graph")}
    for _ in range(rounds):
        for v in variants:
            times[f"{v} eager"].append(_timed(fns[v], calls))
            times[f"{v} graph"].append(_timed(graphs[v].replay, 1) / calls)
    row["ms"] = {key: statistics.median(t) for key, t in times.items()}
    row["rounds"] = times
    row["rel_err"] = errs
    ms = row["ms"]
    for mode in ("eager", "graph"):
        best = min(ms[f"{v} {mode}"] for v in ("row", "tile", "row pdl") if f"{v} {mode}" in ms)
        row[f"flag_over_sync_{mode}"] = min(ms[f"stream-sync {mode}"], ms[f"sync own {mode}"]) / best
        row[f"flag_over_torch_{mode}"] = ms[f"torch {mode}"] / best
    row["fc1_plus_fc2_ms"] = ms["fc1 graph"] + ms["fc2 graph"]
    # the engine fc2 took in the chain (waiting on fc1's flags) and in stream sync (alone)
    from overlap.kernels import engine

    row["fc2_engines"] = {("wait" if p[9] else "alone") + f" {p[5]}x{p[6]}": label
                          for p, (label, _why) in engine.picks().items() if p[:3] == (m, k, f)}
    del graphs
    torch.cuda.synchronize()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default="512,1024,2048")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--max-seconds", type=float, default=300.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("chain_graph.py needs a GPU")
    rows_m = tuple(int(r) for r in args.rows.split(","))
    t_start = time.perf_counter()
    rows, left_out = [], []
    for sh in shapes(rows_m):
        if time.perf_counter() - t_start > args.max_seconds:
            left_out.append(sh)
            continue
        r = run_shape(sh, args.calls, args.rounds)
        rows.append(r)
        ms = r["ms"]
        print(f"{r['model']:10s} TP{r['tp']} M={r['m']:5d} K={r['k']:5d} F={r['f']:5d} | graph ms: torch "
              f"{ms['torch graph']:.4f} sync {ms['stream-sync graph']:.4f} row {ms['row graph']:.4f} "
              f"own {ms['sync own graph']:.4f} tile {ms['tile graph']:.4f} pdl {ms.get('row pdl graph', float('nan')):.4f} "
              f"fc1+fc2 {r['fc1_plus_fc2_ms']:.4f} | flag/sync {r['flag_over_sync_graph']:.3f}"
              f" flag/torch {r['flag_over_torch_graph']:.3f} | eager flag/sync {r['flag_over_sync_eager']:.3f} "
              f"flag/torch {r['flag_over_torch_eager']:.3f} | model {r['wave_model']['ceiling']:.3f} "
              f"tuned {r['wave_model']['tuned']:.3f} | waves {r['fc1_waves']:.2f}/{r['fc2_waves']:.2f} | "
              f"err {max(r['rel_err'].values()):.1e} | fc2 {r['fc2_engines']}", flush=True)
    out = {"context": run_context(1), "rows": rows, "left_out": left_out,
           "args": {"rows": rows_m, "rounds": args.rounds, "calls": args.calls}}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "chain_graph.json"), "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
