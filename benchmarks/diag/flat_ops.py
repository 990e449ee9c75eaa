"""The ops with their GEMM flattened (``GemmConfig.flatten``) against the per-tile GEMM, at
world size 1 (one GPU: the collectives are trivial, so the GEMM's own speed shows).

    bash launch/torchrun.sh 1 benchmarks/diag/flat_ops.py [--out DIR] [--rounds 5]

Per op and shape (bf16, ``w.t()`` weights): cuBLAS alone (``torch.mm``), the op with the
per-tile GEMM (2 chunks, 16 NCCL CTAs, no give-back grid), the same with a flattened GEMM,
and the per-tile GEMM with its give-back grid (the ops' default). Each timed as 20 calls
queued behind a sleep (the host is ahead; GPU time), interleaved rounds, medians; every
output checked against torch first. Shapes: the producer issue's (M, N, K/R) for
``matmul_reduce_scatter`` and ``matmul_all_reduce``, and layer shapes for the consumer ops.
Writes ``flat_ops.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.context import run_context  # noqa: E402
from overlap import dist  # noqa: E402
from overlap.kernels.tile_gemm import GemmConfig  # noqa: E402
from overlap.ops import (OverlapConfig, all_gather_matmul, all_reduce_matmul, matmul_all_reduce,  # noqa: E402
                         matmul_reduce_scatter)

SHAPES = {
    "matmul_reduce_scatter": [(8192, 12288, 6144), (8192, 8192, 3584), (16384, 8192, 1024), (8192, 8192, 2048)],
    "matmul_all_reduce": [(8192, 12288, 6144), (16384, 8192, 1024)],
    "all_gather_matmul": [(8192, 3584, 8192), (16384, 4096, 4096), (8192, 6144, 1536), (4096, 12288, 4096)],
    "all_reduce_matmul": [(8192, 12288, 6144), (16384, 4096, 1024)],
}
OPS: dict[str, Callable[..., Any]] = {"matmul_reduce_scatter": matmul_reduce_scatter, "matmul_all_reduce": matmul_all_reduce,
                                      "all_gather_matmul": all_gather_matmul, "all_reduce_matmul": all_reduce_matmul}


def timed(fn: Callable[[], Any], calls: int = 20) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(50_000_000)
    s.record()
    for _ in range(calls):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dist.init()
    dev = torch.device("cuda", torch.cuda.current_device())
    base = dict(chunks=2, nccl_ctas=16, transport="nccl", check="none")
    cfgs = {"per-tile": OverlapConfig(**base, give_back=False),
            "flat": OverlapConfig(**base, give_back=False, gemm=GemmConfig(flatten=True)),
            "per-tile + give-back": OverlapConfig(**base, give_back=True)}
    rows = []
    for op, shapes in SHAPES.items():
        for m, n, k in shapes:
            g = torch.Generator(device=dev).manual_seed(m + n + k)
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) / k ** 0.5
            b = w.t()
            fns: dict[str, Callable[[], Any]] = {"cublas": lambda: torch.mm(a, b)}
            want = torch.mm(a.float(), b.float())
            errs = {}
            for name, cfg in cfgs.items():
                if op in ("matmul_reduce_scatter", "matmul_all_reduce") and name == "per-tile + give-back":
                    continue  # the producer ops have no give-back grid
                fn = (lambda cfg=cfg: OPS[op](a, b, config=cfg))
                out = fn()
                out = out[0] if isinstance(out, tuple) else out
                errs[name] = float((out.float() - want).norm() / want.norm())
                assert errs[name] < 2e-2, (op, m, n, k, name, errs[name])
                fns[name] = fn
            torch.cuda.synchronize()
            times: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    times[name].append(timed(fn))
            ms = {name: statistics.median(t) for name, t in times.items()}
            row = {"op": op, "m": m, "n": n, "k": k, "ms": ms, "rounds": times, "rel_err": errs,
                   "flat_over_per_tile": ms["per-tile"] / ms["flat"]}
            rows.append(row)
            print(f"{op:22s} {m:6d}x{n:6d}x{k:6d} cuBLAS {ms['cublas']:.3f} | per-tile {ms['per-tile']:.3f} | flat "
                  f"{ms['flat']:.3f} ({row['flat_over_per_tile']:.3f}x)"
                  + (f" | per-tile + give-back {ms['per-tile + give-back']:.3f}" if "per-tile + give-back" in ms
                     else ""), flush=True)
    if args.out and torch.distributed.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "flat_ops.json"), "w") as fh:
            json.dump({"context": run_context(1), "rows": rows}, fh, indent=1)
    dist.shutdown()


if __name__ == "__main__":
    main()
