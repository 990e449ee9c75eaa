"""Tile-flag GEMM alone against cuBLAS (one GPU): no waits, and waits already satisfied.

    python benchmarks/bench_gemm.py [--out DIR] [--shapes M,N,K ...]

Prints a table and writes ``gemm.json`` (every figure, with the run's context).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.context import run_context  # noqa: E402
from overlap.kernels.tile_gemm import GemmConfig, launch_tile_gemm  # noqa: E402
from overlap.policies import Segment, build_tile_table  # noqa: E402

SHAPES = [(16384, 2048, 8192), (8192, 1024, 8192), (8192, 24576, 12288), (8192, 18432, 12288), (8192, 14336, 8192)]
CONFIGS = [GemmConfig(), GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=8),
           GemmConfig(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", nargs="*", default=None)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    import triton.testing

    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for (m, n, k) in shapes:
        g = torch.Generator(device=dev).manual_seed(m + n + k)
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) / k ** 0.5
        ref = a @ w.t()
        flops = 2.0 * m * n * k
        t_cublas = triton.testing.do_bench(lambda: a @ w.t(), warmup=25, rep=args.reps, return_mode="median")
        rec = {"M": m, "N": n, "K": k, "cublas_ms": t_cublas, "cublas_tflops": flops / t_cublas / 1e9, "configs": []}
        flags = torch.zeros(4, dtype=torch.int32, device=dev)
        err = torch.zeros(8, dtype=torch.int32, device=dev)
        flags[0] = 7
        for ci, cfg in enumerate(CONFIGS):
            b_variants = [("w.t()", w.t())] if ci != 2 else [("row-major b", w.t().contiguous())]
            for bname, b in b_variants:
                seg = [Segment(a_src=0, a_row=0, c_row=0, rows=m)]
                table = torch.tensor(build_tile_table(seg, n, cfg.block_m, cfg.block_n), dtype=torch.int32, device=dev)
                segw = [Segment(a_src=0, a_row=0, c_row=0, rows=m, wait_idx=0, wait_mult=1)]
                tablew = torch.tensor(build_tile_table(segw, n, cfg.block_m, cfg.block_n), dtype=torch.int32,
                                      device=dev)
                c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                try:
                    launch_tile_gemm(a, b, c, table, grid=sms, config=cfg)
                    torch.cuda.synchronize()
                except Exception as e:  # a config that does not compile/fit is reported, not fatal
                    rec["configs"].append({"config": str(cfg), "b": bname, "error": repr(e)[:300]})
                    continue
                rel = ((c.float() - ref.float()).norm() / ref.float().norm()).item()
                t0 = triton.testing.do_bench(lambda: launch_tile_gemm(a, b, c, table, grid=sms, config=cfg),
                                             warmup=25, rep=args.reps, return_mode="median")
                t1 = triton.testing.do_bench(
                    lambda: launch_tile_gemm(a, b, c, tablew, grid=sms, config=cfg, flags=flags, err=err, epoch=7,
                                             wait=True), warmup=25, rep=args.reps, return_mode="median")
                relw = ((c.float() - ref.float()).norm() / ref.float().norm()).item()
                assert err[0].item() == 0, err.tolist()
                rec["configs"].append({"config": str(cfg), "b": bname, "ms": t0, "tflops": flops / t0 / 1e9,
                                       "vs_cublas": t_cublas / t0, "wait_ms": t1, "wait_overhead": t1 / t0 - 1,
                                       "rel_err": rel, "rel_err_wait": relw})
        rows.append(rec)
        best = max((c for c in rec["configs"] if "ms" in c), key=lambda c: c["vs_cublas"], default=None)
        print(f"{m:>6} {n:>6} {k:>6}  cuBLAS {t_cublas:.3f} ms {rec['cublas_tflops']:.0f} TF | " + " | ".join(
            f"{c['config'][10:60]} {c['b']}: {c['ms']:.3f} ms x{c['vs_cublas']:.2f} wait+{100 * c['wait_overhead']:.1f}% "
            f"err {c['rel_err']:.1e}" if "ms" in c else f"ERR {c['error'][:80]}" for c in rec["configs"]), flush=True)
        if best:
            print(f"      best x{best['vs_cublas']:.3f} of cuBLAS", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemm.json"), "w") as f:
        json.dump({"context": run_context(), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
