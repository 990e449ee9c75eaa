"""The tile GEMM with and without a warp-specialized K loop, against cuBLAS (one GPU).

    python benchmarks/diag/gemm_ws_diag.py [--out DIR] [--shapes M,N,K ...] [--rounds 7]

Per shape (B as the ``w.t()`` of an nn.Linear weight, as the ops see it): cuBLAS and
the tile GEMM in each config of ``VARIANTS`` on all SMs and on the SMs an overlapped op
leaves it (``--op-sms``), with waits already satisfied (the ops' tables wait), in
interleaved rounds. A config that does not compile is reported and skipped. Prints a
table and writes ``gemm_ws.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.bench_gemm import _events_ms  # noqa: E402
from benchmarks.context import run_context  # noqa: E402
from overlap.kernels.tile_gemm import GemmConfig, launch_tile_gemm  # noqa: E402
from overlap.policies import Segment, build_tile_table  # noqa: E402

SHAPES = [(16384, 2048, 8192), (8192, 24576, 12288)]
VARIANTS = {
    "base": GemmConfig(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8),
    "ws": GemmConfig(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, warp_specialize=True),
    "ws_s4": GemmConfig(block_m=128, block_n=256, block_k=64, num_stages=4, num_warps=8, warp_specialize=True),
    "ws_128x128": GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=8,
                             warp_specialize=True),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", nargs="*", default=None)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--op-sms", type=int, default=116)
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for (m, n, k) in shapes:
        g = torch.Generator(device=dev).manual_seed(m + n + k)
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) / k ** 0.5
        b = w.t()
        ref = (a @ b).float()
        flags = torch.full((4,), 7, dtype=torch.int32, device=dev)
        err = torch.zeros(8, dtype=torch.int32, device=dev)
        c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        fns, rec = {"cublas": lambda: torch.mm(a, b, out=c)}, {"M": m, "N": n, "K": k, "variants": {}}
        for name, cfg in VARIANTS.items():
            seg = [Segment(a_src=0, a_row=0, c_row=0, rows=m, wait_idx=0, wait_mult=1)]
            table = torch.tensor(build_tile_table(seg, n, cfg.block_m, cfg.block_n), dtype=torch.int32, device=dev)
            for grid in (sms, args.op_sms):
                def fn(cfg=cfg, table=table, grid=grid):
                    launch_tile_gemm(a, b, c, table, grid=grid, config=cfg, flags=flags, err=err, epoch=7,
                                     wait=True)
                key = f"{name}@{grid}"
                try:
                    c.zero_()
                    fn()
                    torch.cuda.synchronize()
                    rel = ((c.float() - ref).norm() / ref.norm()).item()
                    assert err[0].item() == 0, err.tolist()
                except Exception as e:  # a config this Triton cannot build: say so, go on
                    print(f"{m}x{n}x{k} {key}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    traceback.print_exc(limit=2)
                    rec["variants"][key] = {"config": str(cfg), "error": f"{type(e).__name__}: {str(e)[:300]}"}
                    break
                fns[key] = fn
                rec["variants"][key] = {"config": str(cfg), "grid": grid, "rel_err": rel}
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        times = {kk: [] for kk in fns}
        for _ in range(args.rounds):  # interleaved: drifts of clock and temperature hit all alike
            for kk, fn in fns.items():
                times[kk].append(_events_ms(fn, args.iters))
        flops = 2.0 * m * n * k
        rec["cublas_ms"] = statistics.median(times["cublas"])
        rec["times"] = times
        print(f"{m}x{n}x{k}: cuBLAS {rec['cublas_ms']:.3f} ms ({flops / rec['cublas_ms'] / 1e9:.0f} TFLOP/s)",
              flush=True)
        for kk in fns:
            if kk == "cublas":
                continue
            v = rec["variants"][kk]
            v["ms"] = statistics.median(times[kk])
            v["range_ms"] = [min(times[kk]), max(times[kk])]
            print(f"  {kk:>16}: {v['ms']:.3f} ms [{v['range_ms'][0]:.3f}, {v['range_ms'][1]:.3f}] "
                  f"{flops / v['ms'] / 1e9:.0f} TFLOP/s, x{rec['cublas_ms'] / v['ms']:.3f} of cuBLAS, "
                  f"err {v['rel_err']:.1e}", flush=True)
        rows.append(rec)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemm_ws.json"), "w") as f:
        json.dump({"context": run_context(), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
