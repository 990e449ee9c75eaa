"""Before / after on one GPU: the tile GEMM against cuBLAS, the chain, and the reduce kernel,
timed from whichever ``overlap`` is first on ``PYTHONPATH``.

    PYTHONPATH=OLD_TREE python benchmarks/diag/regress.py --label before --out DIR
    PYTHONPATH=NEW_TREE python benchmarks/diag/regress.py --label after --out DIR

Run the two trees alternately in one job (before, after, before, after) so that clocks and
heat drift hit both alike. Only calls whose signatures are the same in both trees are used:
``launch_tile_gemm`` with the default ``GemmConfig`` (no tuner: the kernel, not the tuner's
pick), ``mlp_chain`` / ``mlp_chain_stream_sync`` with their default configs, and
``launch_reduce_norm`` as ``benchmarks/bench_reduce_norm.py --quick`` calls it. Writes
``regress_<label>_<round>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

GEMM_SHAPES = [(8192, 8192, 8192), (16384, 2048, 8192), (8192, 14336, 4096), (4096, 4096, 4096)]
CHAIN_SHAPES = [(8192, 4096, 16384, 4096), (4096, 8192, 8192, 8192)]


def _ms(fn, iters: int = 10, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e) / iters)
    return statistics.median(out)


def gemm_rows(dev: torch.device) -> list[dict]:
    from overlap.kernels.tile_gemm import DEFAULT_CONFIG, launch_tile_gemm
    from overlap.policies import Segment, build_tile_table

    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for m, n, k in GEMM_SHAPES:
        g = torch.Generator(device=dev).manual_seed(m + n + k)
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) / k ** 0.5
        cfg = DEFAULT_CONFIG
        table = torch.tensor(build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, cfg.block_m,
                                              cfg.block_n), dtype=torch.int32, device=dev)
        c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        for layout, b in (("w.t()", w.t()), ("row-major", w.t().contiguous())):
            launch_tile_gemm(a, b, c, table, grid=sms, config=cfg)
            err = (c.float() - (a @ b).float()).abs().max().item()
            t_tile = _ms(lambda: launch_tile_gemm(a, b, c, table, grid=sms, config=cfg))
            t_cublas = _ms(lambda: torch.matmul(a, b))
            rows.append({"case": "gemm", "M": m, "N": n, "K": k, "layout": layout, "tile_ms": t_tile,
                         "cublas_ms": t_cublas, "vs_cublas": t_cublas / t_tile,
                         "tflops": 2.0 * m * n * k / t_tile / 1e9, "max_abs_err": err})
    return rows


def chain_rows(dev: torch.device) -> list[dict]:
    from overlap.ops.chain import mlp_chain, mlp_chain_ref, mlp_chain_stream_sync

    rows = []
    for m, k, f, n in CHAIN_SHAPES:
        g = torch.Generator(device=dev).manual_seed(m + k + f + n)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
        w1 = (torch.randn(f, k, device=dev, dtype=torch.bfloat16, generator=g) / k ** 0.5).t()
        w2 = (torch.randn(n, f, device=dev, dtype=torch.bfloat16, generator=g) / f ** 0.5).t()
        ref = mlp_chain_ref(x, w1, w2)
        got = mlp_chain(x, w1, w2)
        rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        rec = {"case": "chain", "M": m, "K": k, "F": f, "N": n, "rel_err": rel}
        for name, fn in (("chain_ms", lambda: mlp_chain(x, w1, w2)),
                         ("stream_sync_ms", lambda: mlp_chain_stream_sync(x, w1, w2)),
                         ("torch_ms", lambda: mlp_chain_ref(x, w1, w2))):
            rec[name] = _ms(fn)
        rows.append(rec)
    return rows


def reduce_rows(dev: torch.device) -> list[dict]:
    """The p2p all-reduce's reduce kernel alone (waits pre-satisfied), world 2, 8 chunks, 16
    programs, the kernel's default block shape: the sum with a residual and LayerNorm, as
    ``benchmarks/bench_reduce_norm.py --quick`` times it."""
    from overlap.kernels.add_norm import launch_reduce_norm

    m, k, world, chunks = 16384, 8192, 2, 8
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    recv = torch.randn(world - 1, m, k, device=dev, dtype=torch.bfloat16)
    res = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    h, y = torch.empty_like(x), torch.empty_like(x)
    wt = torch.ones(k, device=dev, dtype=torch.bfloat16)
    bias = torch.zeros(k, device=dev, dtype=torch.bfloat16)
    starts = torch.tensor([i * m // chunks for i in range(chunks + 1)], device=dev, dtype=torch.int32)
    rflags = torch.ones((world - 1) * chunks, device=dev, dtype=torch.int32)
    ready = torch.zeros(chunks, device=dev, dtype=torch.int32)
    err = torch.zeros(8, device=dev, dtype=torch.int32)
    rows = []
    for mode, ln in (("add", False), ("add+ln", True)):
        def run() -> None:
            launch_reduce_norm(x, recv, h, starts=starts, rflags=rflags, ready=ready, err=err, epoch=1, rank=0,
                               world=world, programs=16, residual=res, norm="layernorm" if ln else None,
                               weight=wt if ln else None, bias=bias if ln else None, y=y if ln else None)

        t = _ms(run)
        moved = (world + 2 + (1 if ln else 0)) * m * k * 2
        rows.append({"case": "reduce", "mode": mode, "M": m, "K": k, "programs": 16, "ms": t,
                     "GBps": moved / t / 1e6})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--round", type=int, default=0)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    import triton

    import overlap

    dev = torch.device("cuda")
    meta = {"label": args.label, "round": args.round, "gpu": torch.cuda.get_device_name(dev),
            "torch": torch.__version__, "triton": triton.__version__,
            "tree": os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(overlap.__file__))))}
    rows = gemm_rows(dev) + chain_rows(dev) + reduce_rows(dev)
    for r in rows:
        print(args.label, args.round, json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))
    with open(os.path.join(args.out, f"regress_{args.label}_{args.round}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
