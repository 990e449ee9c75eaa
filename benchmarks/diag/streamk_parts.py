"""Where the stream-K GEMM's time goes (one GPU): per shape, the flattened tile GEMM, the
stream-K kernel as the tuner runs it, without its fix-up (each piece stores its own sum:
a wrong C, timing only), with every tile in stream-K order, and with none (its
data-parallel loop alone), against cuBLAS; CUDA-graph replays in interleaved rounds.

    python benchmarks/diag/streamk_parts.py [--out DIR] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

SHAPES = ((2048, 1536, 4096, "float16"), (512, 4096, 1024, "bfloat16"), (4096, 6656, 16384, "float16"),
          (16384, 4096, 512, "float16"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import torch

    from benchmarks.context import run_context
    from overlap.kernels.autotune import GraphTimer
    from overlap.kernels.streamk import launch_streamk, streamk_split
    from overlap.kernels.tile_gemm import GemmConfig, b_operand, launch_tile_gemm
    from overlap.policies import Segment, build_tile_table

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dev = torch.device("cuda")
    rows = []
    for m, n, k, dt in SHAPES:
        dtype = getattr(torch, dt)
        flat = GemmConfig(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, flatten=True)
        sk = GemmConfig(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, stream_k=True)
        table = torch.tensor(build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, 128, 256, group_m=8),
                             dtype=torch.int32, device=dev)
        t = table.shape[0]
        a = torch.randn(m, k, device=dev, dtype=dtype)
        w = torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5
        b = w.t()
        bs, b_kn = b_operand(b)
        ref = torch.mm(a, b)
        cs = {name: torch.empty(m, n, device=dev, dtype=dtype) for name in ("flat", "sk", "nofix", "all", "dp", "dpfor")}

        def skl(c, **kw):
            return lambda: launch_streamk(a, bs, b_kn, c, table, grid=sms, config=sk, activation=None, interp=False,
                                          **kw)

        fns = {"cublas": lambda: torch.mm(a, b, out=ref),
               "flat": lambda: launch_tile_gemm(a, b, cs["flat"], table, grid=sms, config=flat),
               "sk": skl(cs["sk"]), "nofix": skl(cs["nofix"], _fixup=0), "all": skl(cs["all"], _sk_tiles=t),
               "dp": skl(cs["dp"], _sk_tiles=0), "dpfor": skl(cs["dpfor"], _sk_tiles=0, _dp_flat=0)}
        timers = {kk: GraphTimer(f) for kk, f in fns.items()}
        torch.cuda.synchronize()
        errs = {kk: ((c.float() - ref.float()).norm() / ref.float().norm()).item() for kk, c in cs.items()}
        times = {kk: [] for kk in timers}
        for _ in range(args.rounds):
            for kk, tm in timers.items():
                times[kk].append(tm.ms())
        med = {kk: round(statistics.median(v), 5) for kk, v in times.items()}
        row = {"m": m, "n": n, "k": k, "dtype": dt, "tiles": t, "split": streamk_split(t, sms), "ms": med,
               "rel_err": errs}
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "streamk_parts.json"), "w") as f:
        json.dump({"context": run_context(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
