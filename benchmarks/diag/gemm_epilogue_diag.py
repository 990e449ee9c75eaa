"""Would a GEMM whose epilogue overlaps the next tile close the tile GEMM's gap to cuBLAS?

    python benchmarks/diag/gemm_epilogue_diag.py [--out DIR] [--max-seconds S]

The tile GEMM sweep (``benchmarks/gemm_sweep.py``, 2026-12-01) missed its targets on the
short-K and small shapes, read then as the epilogue (the fp32 accumulator converted and
stored from registers while nothing of the next tile loads) and the pipeline's fill per
tile. This probe measures that reading before the library's kernel is changed: a plain
persistent GEMM (no tile table, no flags) written for the question, with

- a static schedule (tile = program + i * programs, GROUP_M swizzle),
- the tile loop and the K loop flattened into one software pipeline (``tl.range(...,
  flatten=True)``), so the next tile's loads are issued during this tile's epilogue,
  with or without warp specialization of that loop,
- the epilogue as TMA stores, whole or in two column halves (a smaller register-to-
  shared-memory staging),

against cuBLAS (``torch.mm``) and the library's tuned tile GEMM (``tune_gemm`` +
``launch_tile_gemm`` over every SM), each timed as CUDA-graph replays in interleaved
rounds (medians), every output checked against ``torch.mm``. Shapes: the 13 sweep shapes
under 0.93x cuBLAS and 5 that met it. The idea of flattening the persistent loop and
subtiling the epilogue is from Triton's persistent-matmul tutorial (09); the kernel is
written here. Writes ``gemm_epilogue.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.context import run_context  # noqa: E402

# (M, N, K, B layout, dtype): the sweep's 13 misses, then 5 of its passes as a control
SHAPES = [
    (16384, 4096, 512, "kn", "float16"), (2048, 1536, 4096, "nk", "float16"), (1024, 6144, 768, "nk", "bfloat16"),
    (2048, 8192, 1024, "nk", "bfloat16"), (2048, 4096, 1024, "nk", "bfloat16"), (8192, 4096, 1024, "nk", "bfloat16"),
    (512, 3584, 1792, "nk", "bfloat16"), (1024, 9216, 6144, "nk", "bfloat16"), (4096, 2688, 3584, "kn", "bfloat16"),
    (8192, 3696, 8192, "nk", "float16"), (4096, 6144, 1536, "nk", "bfloat16"), (8192, 4096, 2048, "nk", "bfloat16"),
    (1024, 9472, 3584, "nk", "float16"),
    (8192, 4096, 14336, "nk", "bfloat16"), (16384, 16384, 4096, "nk", "bfloat16"), (2048, 12288, 4096, "kn", "bfloat16"),
    (512, 12288, 12288, "nk", "bfloat16"), (32768, 4096, 4096, "kn", "bfloat16"),
]
TILES = ((128, 256, 64, 3, 8), (128, 128, 64, 4, 4), (256, 128, 64, 3, 8))  # BM, BN, BK, stages, warps
MODES = (("plain", False, False, 1), ("sub2", False, False, 2), ("flat sub2", True, False, 2),
         ("flat ws sub2", True, True, 2))  # name, FLATTEN, WS, SUBTILE


@triton.jit
def _swizzle(t, num_m, num_n, GROUP_M: tl.constexpr):
    per_group = GROUP_M * num_n
    first_m = (t // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (t % per_group) % rows, (t % per_group) // rows


@triton.jit
def probe_gemm_kernel(a_desc, b_desc, c_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GROUP_M: tl.constexpr, B_KN: tl.constexpr, SUBTILE: tl.constexpr, FLATTEN: tl.constexpr,
                      WS: tl.constexpr, NUM_PROGS: tl.constexpr):
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    k_steps = tl.cdiv(K, BK)
    for t in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGS, flatten=FLATTEN, warp_specialize=WS):
        pm, pn = _swizzle(t, num_m, num_n, GROUP_M)
        om = pm * BM
        on = pn * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ks in range(k_steps):
            a = a_desc.load([om, ks * BK])
            if B_KN:
                b = b_desc.load([ks * BK, on])
            else:
                b = b_desc.load([on, ks * BK]).T
            acc = tl.dot(a, b, acc)
        if SUBTILE == 2:
            halves = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            c_desc.store([om, on], left.to(c_desc.dtype))
            c_desc.store([om, on + BN // 2], right.to(c_desc.dtype))
        else:
            c_desc.store([om, on], acc.to(c_desc.dtype))


def probe_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, b_kn: bool, tile: tuple[int, ...], flatten: bool,
               ws: bool, subtile: int, sms: int, group_m: int = 8) -> Callable[[], Any]:
    """A callable that runs the probe kernel once: c = a @ b (b row-major [K, N] with
    ``b_kn``, else the [N, K] storage of ``w.t()``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, stages, warps = tile
    m, k = a.shape
    n = c.shape[1]
    b_store = b if b_kn else b.t()
    a_d = TensorDescriptor.from_tensor(a, [bm, bk])
    b_d = TensorDescriptor.from_tensor(b_store, [bk, bn] if b_kn else [bn, bk])
    c_d = TensorDescriptor.from_tensor(c, [bm, bn // subtile])
    progs = min(sms, triton.cdiv(m, bm) * triton.cdiv(n, bn))

    def run() -> None:
        probe_gemm_kernel[(progs,)](a_d, b_d, c_d, m, n, k, BM=bm, BN=bn, BK=bk, GROUP_M=group_m, B_KN=b_kn,
                                    SUBTILE=subtile, FLATTEN=flatten, WS=ws, NUM_PROGS=progs, num_stages=stages,
                                    num_warps=warps)

    return run


def graph_ms(fn: Callable[[], Any], calls: int) -> tuple[float, Any]:
    """(ms per call of ``fn`` as replays of a CUDA graph of ``calls`` calls, the graph)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    return _replay_ms(g) / calls, g


def _replay_ms(g: Any) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(5_000_000)
    s.record()
    g.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


def run_shape(shape: tuple[Any, ...], rounds: int, sms: int, ws_ok: bool) -> dict[str, Any]:
    from overlap.kernels.autotune import tune_gemm
    from overlap.kernels.tile_gemm import launch_tile_gemm
    from overlap.policies import Segment, build_tile_table, table_tensor

    m, n, k, layout, dname = shape
    dt = getattr(torch, dname)
    dev = torch.device("cuda")
    a = torch.randn(m, k, device=dev, dtype=dt)
    w = torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5
    b = w.t().contiguous() if layout == "kn" else w.t()
    want = torch.mm(a, b)
    flops = 2.0 * m * n * k
    calls = max(2, min(64, int(2e-3 / max(flops / 700e12, 1e-6))))
    fns: dict[str, Callable[[], Any]] = {"cublas": lambda: torch.mm(a, b)}
    cfg = tune_gemm(m, n, k, dtype=dt, device=dev, b_kn=layout == "kn")
    c_lib = torch.empty(m, n, device=dev, dtype=dt)
    table = table_tensor(build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, cfg.block_m, cfg.block_n,
                                          array=True), dev)
    fns["library"] = lambda: launch_tile_gemm(a, b, c_lib, table, grid=sms, config=cfg)
    outs = {"library": c_lib}
    for tile in TILES:
        for name, flat, ws, sub in MODES:
            if ws and not ws_ok:
                continue
            c = torch.empty(m, n, device=dev, dtype=dt)
            label = f"{tile[0]}x{tile[1]}x{tile[2]} s{tile[3]} w{tile[4]} {name}"
            fns[label] = probe_gemm(a, b, c, layout == "kn", tile, flat, ws, sub, sms)
            outs[label] = c
    graphs: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for label, fn in list(fns.items()):
        try:
            graphs[label] = graph_ms(fn, calls)[1]
        except Exception as e:  # a config that does not build (shared memory, registers): reported, not fatal
            failed[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            torch.cuda.synchronize()
    errs = {label: float((c.float() - want.float()).norm() / want.float().norm())
            for label, c in outs.items() if label in graphs}
    times: dict[str, list[float]] = {label: [] for label in graphs}
    for _ in range(rounds):
        for label, g in graphs.items():
            times[label].append(_replay_ms(g) / calls)
    ms = {label: statistics.median(t) for label, t in times.items()}
    probes = {label: t for label, t in ms.items() if label not in ("cublas", "library") and errs[label] < 1e-2}
    best = min(probes, key=probes.get) if probes else None
    return {"m": m, "n": n, "k": k, "b_layout": layout, "dtype": dname, "calls_per_replay": calls,
            "library_config": str(cfg), "ms": ms, "rel_err": errs, "failed": failed, "best_probe": best,
            "library_vs_cublas": ms["cublas"] / ms["library"],
            "best_probe_vs_cublas": ms["cublas"] / probes[best] if best else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-seconds", type=float, default=300.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gemm_epilogue_diag.py needs a GPU")
    from overlap.kernels.tile_gemm import warp_specialize_supported

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ws_ok = warp_specialize_supported(torch.device("cuda"))
    t0 = time.perf_counter()
    rows, left = [], []
    for shape in SHAPES:
        if time.perf_counter() - t0 > args.max_seconds:
            left.append(shape)
            continue
        r = run_shape(shape, args.rounds, sms, ws_ok)
        rows.append(r)
        bp = r["best_probe_vs_cublas"]
        print(f"{r['m']:6d}x{r['n']:6d}x{r['k']:6d} {r['b_layout']} {r['dtype']:8s} cuBLAS {r['ms']['cublas']:.4f} ms"
              f" | library {r['library_vs_cublas']:.3f}x | best probe {bp if bp is None else round(bp, 3)}x "
              f"({r['best_probe']}) | failed {len(r['failed'])}", flush=True)
    geo = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None  # noqa: E731
    summary = {"shapes": len(rows), "library_geomean": geo([r["library_vs_cublas"] for r in rows]),
               "best_probe_geomean": geo([r["best_probe_vs_cublas"] for r in rows if r["best_probe_vs_cublas"]]),
               "left_out": left}
    summary["probe_geomean_by_mode_best_tile"] = {}
    for mode, *_ in MODES:  # per mode, each shape's best tile
        per_shape = []
        for r in rows:
            cands = [r["ms"]["cublas"] / t for label, t in r["ms"].items()
                     if label not in ("cublas", "library") and label.split(" ", 3)[-1] == mode
                     and r["rel_err"].get(label, 1) < 1e-2]
            if cands:
                per_shape.append(max(cands))
        summary["probe_geomean_by_mode_best_tile"][mode] = geo(per_shape)
    print(json.dumps(summary, indent=1), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gemm_epilogue.json"), "w") as fh:
            json.dump({"context": run_context(1), "summary": summary, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
