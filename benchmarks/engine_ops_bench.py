"""The consumer ops and a producer op at world size 1 on each GEMM engine, side by side in one run.

    python benchmarks/engine_ops_bench.py --out DIR [--rounds 5] [--iters 10]

``all_gather_matmul`` and ``all_reduce_matmul`` (residual, LayerNorm), and the producer op
``matmul_all_reduce`` (whose GEMM tiles post; ``matmul_reduce_scatter``'s GEMM cuts A's rows
per row bucket, which only the tile GEMM does), on the NCCL transport of a one-rank group (the path they take at 2 or more ranks), bf16, ``w.t()``
weights, per shape and op: ``OVERLAP_GEMM_ENGINE=tile`` (the ``triton.language`` tile
GEMM, as before the engine choice) and ``auto`` (the engine the ops pick by measuring,
``overlap.kernels.engine``), in interleaved rounds of ``--iters`` eager calls each timed
by CUDA events around the calls (host time included, as a caller pays it), medians kept;
cuBLAS (``torch.mm``) beside them. Every round's inputs are new and each engine's last
output is checked against torch. Writes ``engine_ops.json`` ({"context", "rows",
"report"}) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHAPES = [  # M, N, K: sweep shapes and layer shapes (the last three never tuned on)
    (8192, 8192, 8192),
    (16384, 6144, 4096),
    (4096, 10752, 3584),
    (2048, 8192, 14784),
    (8192, 3696, 8192),
    (4096, 5120, 5120),
    (6144, 13824, 5120),
    (3072, 7168, 2560),
]


OPS = ("agmm", "armm", "mar")
"""all_gather_matmul, all_reduce_matmul (+ residual, LayerNorm), matmul_all_reduce."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--shapes", type=int, default=len(SHAPES), help="the first N shapes")
    args = ap.parse_args()
    import torch

    from benchmarks.context import run_context
    from overlap import dist, observe
    from overlap.ops import Norm, OverlapConfig, all_gather_matmul, all_reduce_matmul, matmul_all_reduce
    from overlap.kernels.engine import ENGINE_ENV

    dist.init()
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = OverlapConfig(transport="nccl", check="async")
    rows: list[dict[str, Any]] = []
    for m, n, k in SHAPES[:args.shapes]:
        g = torch.Generator(device=dev).manual_seed(m + n + k)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) / k ** 0.5
        b = w.t()
        norm = Norm("layernorm", torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5,
                    torch.randn(k, device=dev, dtype=torch.bfloat16))
        xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2)]
        res = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
        c_ref = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        calls = {
            "agmm": lambda i: all_gather_matmul(xs[i % 2], b, config=cfg),
            "armm": lambda i: all_reduce_matmul(xs[i % 2], b, residual=res, norm=norm, config=cfg)[0],
            "mar": lambda i: matmul_all_reduce(xs[i % 2], b, config=cfg),
            "cublas": lambda i: torch.mm(xs[i % 2], b, out=c_ref),
        }
        runs = [(op, eng) for op in OPS for eng in ("tile", "auto")] + [("cublas", "-")]
        times: dict[tuple, list[float]] = {r: [] for r in runs}
        for op, eng in runs:  # warm: plans, compiles, the engine's measurement
            os.environ[ENGINE_ENV] = eng if eng != "-" else "tile"
            calls[op](0)
        torch.cuda.synchronize()
        for rnd in range(args.rounds):
            for x in xs:
                x.normal_()
            for op, eng in runs:
                os.environ[ENGINE_ENV] = eng if eng != "-" else "tile"
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                e0.record()
                for i in range(args.iters):
                    calls[op](i)
                e1.record()
                torch.cuda.synchronize()
                times[(op, eng)].append(e0.elapsed_time(e1) / args.iters)
        # each engine's result against torch, on new inputs
        errs = {}
        for op, eng in runs[:-1]:
            os.environ[ENGINE_ENV] = eng
            xs[0].normal_()
            got = calls[op](0).float()
            if op != "armm":
                want = xs[0].float() @ b.float()
            else:
                h = (xs[0].float() + res.float()).to(torch.bfloat16).float()
                y = torch.nn.functional.layer_norm(h, (k,), norm.weight.float(), norm.bias.float())
                want = y.to(torch.bfloat16).float() @ b.float()
            errs[(op, eng)] = ((got - want).norm() / want.norm()).item()
        med = {r: statistics.median(v) for r, v in times.items()}
        for op in OPS:
            t, a = med[(op, "tile")], med[(op, "auto")]
            row = {"op": op, "m": m, "n": n, "k": k, "tile_ms": round(t, 4), "auto_ms": round(a, 4),
                   "auto_vs_tile": round(t / a, 4), "cublas_ms": round(med[("cublas", "-")], 4),
                   "rel_err": {"tile": errs[(op, "tile")], "auto": errs[(op, "auto")]},
                   "times": {"tile": times[(op, "tile")], "auto": times[(op, "auto")]}}
            rows.append(row)
            print(f"{op} {m}x{n}x{k}: tile engine {t:.4f} ms, auto {a:.4f} ms ({t / a:.3f}x), "
                  f"cuBLAS GEMM {row['cublas_ms']:.4f} ms; rel err {errs[(op, 'tile')]:.1e} / "
                  f"{errs[(op, 'auto')]:.1e}", flush=True)
            assert errs[(op, "tile")] < 2e-2 and errs[(op, "auto")] < 2e-2, (op, errs)
    rep = observe.report()
    for e in rep.engines:
        print(f"engine {e['gemm']}: {e['engine']} ({e['why']})", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "engine_ops.json"), "w") as f:
        json.dump({"context": run_context(), "rows": rows, "engines": rep.engines}, f, indent=1)
    sp = [r["auto_vs_tile"] for r in rows]
    print(f"auto vs tile engine: geo-mean {statistics.geometric_mean(sp):.3f}x, min {min(sp):.3f}x, "
          f"max {max(sp):.3f}x over {len(sp)} op calls", flush=True)
    dist.shutdown()


if __name__ == "__main__":
    main()
