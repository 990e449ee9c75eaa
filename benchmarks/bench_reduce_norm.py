"""The p2p all-reduce's reduce (+ add + norm) kernel alone, on one GPU, flags pre-set.

    python benchmarks/bench_reduce_norm.py [--m 16384] [--k 8192]

Every wait is already satisfied, so this is the kernel's own speed: ms and GB/s moved
(partials and residual read, h and y written) per program count, warps and row block,
with and without residual + LayerNorm. The op leaves the kernel a few SMs while the
GEMM runs; how fast it is on them decides how much of the copy time it can hide behind.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from overlap.kernels.add_norm import launch_reduce_norm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    m, k, world = args.m, args.k, args.world
    dt = torch.bfloat16
    x = torch.randn(m, k, device=dev, dtype=dt)
    recv = torch.randn(world - 1, m, k, device=dev, dtype=dt)
    res = torch.randn(m, k, device=dev, dtype=dt)
    h = torch.empty_like(x)
    y = torch.empty_like(x)
    w = torch.ones(k, device=dev, dtype=dt)
    bias = torch.zeros(k, device=dev, dtype=dt)
    chunks = 8
    starts = torch.tensor([i * m // chunks for i in range(chunks + 1)], dtype=torch.int32, device=dev)
    rflags = torch.full(((world - 1) * chunks,), 1, dtype=torch.int32, device=dev)
    err = torch.zeros(8, dtype=torch.int32, device=dev)
    print(f"reduce_norm alone: M={m} K={k} world={world} bf16, {chunks} chunks; ms, GB/s", flush=True)
    for ln in (False, True):
        moved = (world + 1 + (1 if ln else 0)) * m * k * 2 + (m * k * 2 if ln else 0)
        for programs in (32, 64, 128, 264):
            for nw in (4, 8, 16):
                for rows in (1, 2):
                    ready = torch.zeros(chunks, dtype=torch.int32, device=dev)

                    def run() -> None:
                        launch_reduce_norm(x, recv, h, starts=starts, rflags=rflags, ready=ready, err=err, epoch=1,
                                           rank=0, world=world, programs=programs,
                                           residual=res if ln else None, norm="layernorm" if ln else None,
                                           weight=w if ln else None, bias=bias if ln else None,
                                           y=y if ln else None, num_warps=nw, rows=rows)

                    try:
                        for _ in range(3):
                            run()
                        torch.cuda.synchronize()
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record()
                        for _ in range(10):
                            run()
                        e.record()
                        torch.cuda.synchronize()
                        ms = s.elapsed_time(e) / 10
                        print(f"  {'add+ln' if ln else 'sum   '} programs {programs:4d} warps {nw:2d} rows {rows}: "
                              f"{ms:.3f} ms {moved / ms / 1e6:7.0f} GB/s", flush=True)
                    except Exception as ex:  # noqa: BLE001 - e.g. too many registers for a config
                        print(f"  programs {programs} warps {nw} rows {rows}: failed ({type(ex).__name__}: {ex})"[:200])
    assert err[0].item() == 0, err


if __name__ == "__main__":
    main()
