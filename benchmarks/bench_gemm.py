"""Tile-flag GEMM alone against cuBLAS (one GPU): no waits, and waits already satisfied.

    python benchmarks/bench_gemm.py [--out DIR] [--shapes M,N,K ...] [--rounds 9]

Per shape and B layout: the config ``overlap.kernels.autotune.tune_gemm`` picks
(every candidate's time is kept in its cache), then interleaved rounds of
cuBLAS, the tile GEMM, and the tile GEMM with waits already satisfied; the
wait overhead is the median of the per-round ratios, with its range. Prints a
table and writes ``gemm.json`` (every figure, with the run's context).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.context import run_context  # noqa: E402
from overlap.kernels.autotune import tune_gemm  # noqa: E402
from overlap.kernels.tile_gemm import launch_tile_gemm  # noqa: E402
from overlap.policies import Segment, build_tile_table  # noqa: E402

SHAPES = [(16384, 2048, 8192), (8192, 1024, 8192), (8192, 24576, 12288), (8192, 18432, 12288), (8192, 14336, 8192)]


def _events_ms(fn, iters: int) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", nargs="*", default=None)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    import statistics

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
        rec = {"M": m, "N": n, "K": k, "layouts": []}
        for bname, b, b_kn in (("w.t()", w.t(), False), ("row-major b", w.t().contiguous(), True)):
            cfg = tune_gemm(m, n, k, dtype=torch.bfloat16, device=dev, b_kn=b_kn)
            seg = [Segment(a_src=0, a_row=0, c_row=0, rows=m)]
            table = torch.tensor(build_tile_table(seg, n, cfg.block_m, cfg.block_n, group_m=cfg.group_m),
                                 dtype=torch.int32, device=dev)
            segw = [Segment(a_src=0, a_row=0, c_row=0, rows=m, wait_idx=0, wait_mult=1)]
            tablew = torch.tensor(build_tile_table(segw, n, cfg.block_m, cfg.block_n, group_m=cfg.group_m),
                                  dtype=torch.int32, device=dev)
            flags = torch.full((4,), 7, dtype=torch.int32, device=dev)
            err = torch.zeros(8, dtype=torch.int32, device=dev)
            c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)

            def plain():
                launch_tile_gemm(a, b, c, table, grid=sms, config=cfg)

            def waited():
                launch_tile_gemm(a, b, c, tablew, grid=sms, config=cfg, flags=flags, err=err, epoch=7, wait=True)

            def cublas():
                torch.mm(a, b, out=c)

            for fn in (plain, waited, cublas):
                fn()
            torch.cuda.synchronize()
            # interleaved rounds: slow drifts (clocks, temperature) hit all three alike
            t = {"plain": [], "waited": [], "cublas": []}
            for _ in range(args.rounds):
                for name, fn in (("cublas", cublas), ("plain", plain), ("waited", waited)):
                    t[name].append(_events_ms(fn, args.iters))
            plain()
            rel = ((c.float() - ref.float()).norm() / ref.float().norm()).item()
            waited()
            relw = ((c.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err[0].item() == 0, err.tolist()
            med = {kk: statistics.median(v) for kk, v in t.items()}
            ratios = sorted(w_ / p_ for w_, p_ in zip(t["waited"], t["plain"]))
            rec["layouts"].append({
                "b": bname, "config": str(cfg), "cublas_ms": med["cublas"], "ms": med["plain"],
                "wait_ms": med["waited"], "tflops": flops / med["plain"] / 1e9,
                "cublas_tflops": flops / med["cublas"] / 1e9, "vs_cublas": med["cublas"] / med["plain"],
                "wait_overhead_median": statistics.median(ratios) - 1,
                "wait_overhead_range": [ratios[0] - 1, ratios[-1] - 1], "rounds": args.rounds,
                "rel_err": rel, "rel_err_wait": relw, "times": t})
            r = rec["layouts"][-1]
            print(f"{m:>6} {n:>6} {k:>6} {bname:>11}: cuBLAS {med['cublas']:.3f} ms | tile {med['plain']:.3f} ms "
                  f"x{r['vs_cublas']:.3f} ({cfg}) | satisfied waits {100 * r['wait_overhead_median']:+.1f}% "
                  f"[{100 * ratios[0] - 100:+.1f}, {100 * ratios[-1] - 100:+.1f}] | err {rel:.1e}", flush=True)
        rows.append(rec)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemm.json"), "w") as f:
        json.dump({"context": run_context(), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
