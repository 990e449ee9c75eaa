"""The tile GEMM alone as two launches on one stream: the rows whose 128x256 tiles fill
whole waves of the grid, then the rows left with a tile of half the size (twice as many
tiles, so the last partial wave of big tiles becomes at most one wave of small ones),
against the one-launch flattened GEMM and cuBLAS (one GPU).

    python benchmarks/diag/tail_diag.py [--out DIR] [--rounds 5]

Per shape, through ``launch_gemm``: one launch of flattened 128x256 tiles, and the same
config with a tail (``GemmConfig.tail_block_m``) of 64x256 or 128x128: rows [0, M1)
(``tail_rows``) with 128x256, then rows [M1, M) with the tail's tiles. Checked against
cuBLAS; CUDA-graph replays in interleaved rounds (medians). Writes ``tail_diag.json``.
(Its first run, at 7ecc691, made the two launches by hand with the same split.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

SHAPES = ((1024, 9216, 6144, "bfloat16"), (8192, 3696, 8192, "float16"), (4096, 10752, 3584, "bfloat16"),
          (16384, 6144, 4096, "bfloat16"), (32768, 2368, 3584, "float16"))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import torch

    from benchmarks.context import run_context
    from overlap.kernels.autotune import GraphTimer
    from overlap.kernels.tile_gemm import GemmConfig, launch_gemm, tail_rows

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dev = torch.device("cuda")
    big = GemmConfig(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, flatten=True)
    tails = {"64x256": replace(big, tail_block_m=64, tail_block_n=256),
             "128x128": replace(big, tail_block_m=128, tail_block_n=128)}

    rows_out = []
    for m, n, k, dt in SHAPES:
        dtype = getattr(torch, dt)
        a = torch.randn(m, k, device=dev, dtype=dtype)
        w = torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5
        b = w.t()
        ref = torch.mm(a, b)
        tiles = cdiv(m, 128) * cdiv(n, 256)
        m1 = tail_rows(m, n, tails["128x128"], sms)
        cs = {name: torch.empty(m, n, device=dev, dtype=dtype)
              for name in ("one launch", *[f"tail {t}" for t in tails])}
        fns = {"cublas": lambda: torch.mm(a, b, out=ref),
               "one launch": lambda: launch_gemm(a, b, cs["one launch"], grid=sms, config=big)}
        for name, cfg in tails.items():
            fns[f"tail {name}"] = lambda c=cs[f"tail {name}"], cfg=cfg: launch_gemm(a, b, c, grid=sms, config=cfg)
        timers = {kk: GraphTimer(f) for kk, f in fns.items()}
        torch.cuda.synchronize()
        errs = {kk: ((c.float() - ref.float()).norm() / ref.float().norm()).item() for kk, c in cs.items()}
        times = {kk: [] for kk in timers}
        for _ in range(args.rounds):
            for kk, tm in timers.items():
                times[kk].append(tm.ms())
        med = {kk: round(statistics.median(v), 5) for kk, v in times.items()}
        row = {"m": m, "n": n, "k": k, "dtype": dt, "tiles": tiles, "m1": m1, "ms": med, "rel_err": errs,
               "speed_vs_cublas": {kk: round(med["cublas"] / v, 4) for kk, v in med.items() if kk != "cublas"}}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tail_diag.json"), "w") as f:
        json.dump({"context": run_context(), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
