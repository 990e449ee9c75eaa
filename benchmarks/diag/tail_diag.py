"""The tile GEMM alone as two launches on one stream: the rows whose 128x256 tiles fill
whole waves of the grid, then the rows left with a tile of half the size (twice as many
tiles, so the last partial wave of big tiles becomes at most one wave of small ones),
against the one-launch flattened GEMM and cuBLAS (one GPU).

    python benchmarks/diag/tail_diag.py [--out DIR] [--rounds 5] [--small]

Per shape, through ``launch_gemm``: one launch of flattened 128x256 tiles, and the same
config with a tail (``GemmConfig.tail_block_m``) of 64x256 or 128x128: rows [0, M1)
(``tail_rows``) with 128x256, then rows [M1, M) with the tail's tiles. Checked against
cuBLAS; CUDA-graph replays in interleaved rounds (medians). Writes ``tail_diag.json``.
(Its first run, at 7ecc691, made the two launches by hand with the same split.)

``--small``: the shapes whose 128x256 tiles are under two waves (``SMALL_SHAPES``, the
sweep's worst and others like them), 128x128 tiles with and without a tail of 64x128
(a full wave of 128x128, then the rest at a quarter of a 128x256 tile's work), against
one launch of 128x256 and the GEMM alone's tuned pick (``tune_gemm(flatten=True)``).
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

# (M, N, K, dtype): 96, 96, 96, 96 and 192 tiles of 128x256 on 132 SMs
SMALL_SHAPES = ((2048, 1536, 4096, "float16"), (2048, 1536, 8192, "bfloat16"), (1024, 3072, 4096, "bfloat16"),
                (1536, 2048, 8192, "bfloat16"), (4096, 1536, 4096, "bfloat16"))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="128x128 tiles with a 64x128 tail on SMALL_SHAPES")
    args = ap.parse_args()
    import torch

    from benchmarks.context import run_context
    from overlap.kernels.autotune import GraphTimer, tune_gemm
    from overlap.kernels.tile_gemm import GemmConfig, launch_gemm, tail_rows

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dev = torch.device("cuda")
    big = GemmConfig(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, flatten=True)
    tails = {"64x256": replace(big, tail_block_m=64, tail_block_n=256),
             "128x128": replace(big, tail_block_m=128, tail_block_n=128)}
    shapes = SHAPES
    if args.small:
        shapes = SMALL_SHAPES
        mid = GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=5, num_warps=4, flatten=True)
        tails = {"128x128 alone": mid, "128x128 + 64x128": replace(mid, tail_block_m=64, tail_block_n=128),
                 "128x128 w8 + 64x128": replace(mid, num_warps=8, num_stages=4, tail_block_m=64, tail_block_n=128)}

    rows_out = []
    for m, n, k, dt in shapes:
        dtype = getattr(torch, dt)
        a = torch.randn(m, k, device=dev, dtype=dtype)
        w = torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5
        b = w.t()
        ref = torch.mm(a, b)
        tiles = cdiv(m, 128) * cdiv(n, 256)
        m1 = tail_rows(m, n, tails["128x128 + 64x128" if args.small else "128x128"], sms)
        cs = {name: torch.empty(m, n, device=dev, dtype=dtype)
              for name in ("one launch", *[f"tail {t}" for t in tails])}
        fns = {"cublas": lambda: torch.mm(a, b, out=ref),
               "one launch": lambda: launch_gemm(a, b, cs["one launch"], grid=sms, config=big)}
        for name, cfg in tails.items():
            fns[f"tail {name}"] = lambda c=cs[f"tail {name}"], cfg=cfg: launch_gemm(a, b, c, grid=sms, config=cfg)
        pick = None
        if args.small:
            pick = tune_gemm(m, n, k, dtype=dtype, device=dev, b_kn=False, flatten=True)
            cs["library"] = torch.empty(m, n, device=dev, dtype=dtype)
            fns["library"] = lambda: launch_gemm(a, b, cs["library"], grid=sms, config=pick)
        timers = {kk: GraphTimer(f) for kk, f in fns.items()}
        torch.cuda.synchronize()
        errs = {kk: ((c.float() - ref.float()).norm() / ref.float().norm()).item() for kk, c in cs.items()}
        times = {kk: [] for kk in timers}
        for _ in range(args.rounds):
            for kk, tm in timers.items():
                times[kk].append(tm.ms())
        med = {kk: round(statistics.median(v), 5) for kk, v in times.items()}
        row = {"m": m, "n": n, "k": k, "dtype": dt, "tiles": tiles, "m1": m1, "ms": med, "rel_err": errs,
               "library": str(pick) if pick is not None else None,
               "speed_vs_cublas": {kk: round(med["cublas"] / v, 4) for kk, v in med.items() if kk != "cublas"}}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tail_diag.json"), "w") as f:
        json.dump({"context": run_context(), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
