"""Where the MLP chain's time goes at small M, per BLOCK_M: each GEMM's tuned pick alone,
cuBLAS alone, the picks chained (RowSync) and stream-synced.

    python benchmarks/diag/chain_tune_diag.py [--out DIR]

``y = gelu(x @ w1) @ w2``, bf16, w1 and w2 as ``weight.t()``, the MLP slices of
``benchmarks/chain_graph.py`` where the chain was furthest from torch (LLaMA-2 70B at TP 8,
M 512 and 1024) and two where it was close. For BLOCK_M 128 and 64 (the chain's two GEMMs
share it) and with BLOCK_M free: ``tune_gemm``'s pick for fc1 and fc2 (per-tile kernel, every
SM) and its ms, the flattened pick's ms (``flatten=True``, what the GEMM alone gets), then
per BLOCK_M the chained and stream-synced ms of the two picks (graph replays). Writes
``chain_tune_diag.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.context import run_context  # noqa: E402

SHAPES = ((512, 8192, 3584), (1024, 8192, 3584), (512, 12288, 6144), (2048, 8192, 3584), (512, 8192, 7168))


def main() -> None:
    from overlap.kernels.autotune import GraphTimer, _cfg_str, tune_gemm
    from overlap.ops import ChainConfig, mlp_chain, mlp_chain_stream_sync

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    dt = torch.bfloat16
    rows = []

    for m, k, f in SHAPES:
        g = torch.Generator(device=dev).manual_seed(m + k + f)
        x = torch.randn(m, k, device=dev, dtype=dt, generator=g)
        w1 = (torch.randn(f, k, device=dev, dtype=dt, generator=g) * k ** -0.5).t()
        w2 = (torch.randn(k, f, device=dev, dtype=dt, generator=g) * f ** -0.5).t()
        mid = torch.nn.functional.gelu(x @ w1)
        row = {"m": m, "k": k, "f": f, "n": k}
        timers = {"cublas fc1": GraphTimer(lambda: x @ w1), "cublas fc2": GraphTimer(lambda: mid @ w2),
                  "torch chain": GraphTimer(lambda: torch.nn.functional.gelu(x @ w1) @ w2)}
        picks = {}
        from overlap.kernels.tile_gemm import launch_gemm
        c1 = torch.empty(m, f, device=dev, dtype=dt)
        c2 = torch.empty(m, k, device=dev, dtype=dt)
        for bm in (128, 64, None):
            for flat in (False, True):
                p1 = tune_gemm(m, f, k, dtype=dt, device=dev, b_kn=False, block_m=bm, flatten=flat)
                p2 = tune_gemm(m, k, f, dtype=dt, device=dev, b_kn=False, block_m=bm, flatten=flat)
                tag = f"bm{bm or 'any'}{' flat' if flat else ''}"
                picks[tag] = (_cfg_str(p1), _cfg_str(p2))
                timers[f"{tag} fc1"] = GraphTimer(lambda p1=p1: launch_gemm(x, w1, c1, grid=132, config=p1))
                timers[f"{tag} fc2"] = GraphTimer(lambda p2=p2: launch_gemm(mid, w2, c2, grid=132, config=p2))
                if bm is not None and not flat:
                    cfg = ChainConfig(producer=p1, consumer=p2, check="none")
                    mlp_chain(x, w1, w2, config=cfg)
                    mlp_chain_stream_sync(x, w1, w2, config=cfg)
                    timers[f"{tag} chain row"] = GraphTimer(lambda cfg=cfg: mlp_chain(x, w1, w2, config=cfg))
                    timers[f"{tag} stream-sync"] = GraphTimer(
                        lambda cfg=cfg: mlp_chain_stream_sync(x, w1, w2, config=cfg))
        ms = {name: [] for name in timers}
        for _ in range(5):
            for name, t in timers.items():
                ms[name].append(t.ms())
        row["ms"] = {name: round(statistics.median(v), 4) for name, v in ms.items()}
        row["picks"] = picks
        rows.append(row)
        print(f"{m}x{k}x{f}:", flush=True)
        for tag, (a, b) in picks.items():
            print(f"  {tag:12s} fc1 {a:32s} fc2 {b}", flush=True)
        for name, v in row["ms"].items():
            print(f"  {name:24s} {v:.4f} ms", flush=True)
        del timers
        torch.cuda.synchronize()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "chain_tune_diag.json"), "w") as fh:
        json.dump({"context": run_context(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
