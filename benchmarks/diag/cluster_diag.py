"""The flattened tile GEMM launched as 2-CTA clusters (Triton's ``num_ctas=2``: one program's
tile split over the two CTAs of a cluster) against the same kernel on one CTA per program and
cuBLAS, on long-K layer shapes (one GPU).

    python benchmarks/diag/cluster_diag.py [--out DIR] [--rounds 5]

Per shape and variant: built (or why not), checked against cuBLAS, timed as CUDA-graph
replays in interleaved rounds (medians). Writes ``cluster_diag.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

SHAPES = ((8192, 3696, 8192, "float16"), (32768, 2368, 3584, "float16"), (16384, 6144, 4096, "bfloat16"),
          (4096, 4096, 4096, "bfloat16"))
VARIANTS = (  # name: program tile (BM, BN), stages, warps per CTA, CTAs per program
    ("128x256 1cta", 128, 256, 3, 8, 1), ("256x256 2cta", 256, 256, 3, 8, 2), ("256x128 2cta", 256, 128, 4, 4, 2),
    ("128x256 2cta", 128, 256, 4, 4, 2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    from benchmarks.context import run_context
    from overlap.kernels.autotune import GraphTimer
    from overlap.kernels.tile_gemm import tile_gemm_flat_kernel
    from overlap.policies import Segment, build_tile_table

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dev = torch.device("cuda")
    rows = []
    for m, n, k, dt in SHAPES:
        dtype = getattr(torch, dt)
        a = torch.randn(m, k, device=dev, dtype=dtype)
        w = torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5
        ref = torch.mm(a, w.t())
        timers = {"cublas": GraphTimer(lambda: torch.mm(a, w.t(), out=ref))}
        errs: dict[str, object] = {}
        for name, bm, bn, st, nw, nc in VARIANTS:
            table = torch.tensor(build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, bm, bn, group_m=8),
                                 dtype=torch.int32, device=dev)
            c = torch.full((m, n), float("nan"), device=dev, dtype=dtype)
            a_desc = TensorDescriptor.from_tensor(a, [bm, 64])
            b_desc = TensorDescriptor.from_tensor(w, [bn, 64])
            nprog = min(sms // nc, table.shape[0])

            def fn(c=c, table=table, a_desc=a_desc, b_desc=b_desc, nprog=nprog, bm=bm, bn=bn, st=st, nw=nw, nc=nc):
                tile_gemm_flat_kernel[(nprog,)](
                    a_desc, a_desc, b_desc, c, table, table, table, table, n, k, table.shape[0], 0, 0, 0, 0, 0, nprog,
                    0, 0, 1, c.stride(0), c.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, HAS_A2=False, B_KN=False,
                    HAS_GROUPS=False, HAS_WAIT=False, HAS_POST=False, ACTIVATION=0, USE_TIMER=True,
                    FENCE_ASYNC=True, UPCAST=False, POST_START=False, SIG=False, num_warps=nw, num_stages=st,
                    num_ctas=nc)
            try:
                fn()
                torch.cuda.synchronize()
                errs[name] = ((c.float() - ref.float()).norm() / ref.float().norm()).item()
                timers[name] = GraphTimer(fn)
            except Exception as e:  # noqa: BLE001 - reported
                torch.cuda.synchronize()
                errs[name] = f"{type(e).__name__}: {str(e)[:300]}"
        times = {kk: [] for kk in timers}
        for _ in range(args.rounds):
            for kk, tm in timers.items():
                times[kk].append(tm.ms())
        med = {kk: round(statistics.median(v), 5) for kk, v in times.items()}
        row = {"m": m, "n": n, "k": k, "dtype": dt, "ms": med, "rel_err": errs,
               "speed_vs_cublas": {kk: round(med["cublas"] / v, 4) for kk, v in med.items() if kk != "cublas"}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cluster_diag.json"), "w") as f:
        json.dump({"context": run_context(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
