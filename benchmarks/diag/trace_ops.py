"""Profile a few calls of every op on one GPU: a chrome trace, the report, a timeline per op.

    PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 python benchmarks/diag/trace_ops.py --out DIR [--calls 5] [--small]

In one process (``overlap.dist.init()``: world size 1, NCCL on a GPU, gloo on a CPU):

1. every op and its baseline called twice, profiling off (kernels compiled, plans made;
   the report counts these calls, and a fallback's one-time warning, but has no timing);
2. profiling on (``overlap.profile(True)``), the baselines that run communication and GEMM
   one after the other, ``--calls`` times each: ``mlp_chain_stream_sync`` (its producer and
   consumer grids are the chain's alone-times), ``all_gather_matmul_ref`` and
   ``all_reduce_matmul_ref`` (+ residual, LayerNorm);
3. under ``overlap.observe.trace(DIR/trace.json)``, ``--calls`` calls each of ``mlp_chain``,
   ``all_gather_matmul`` and ``all_reduce_matmul`` (+ residual, LayerNorm), the last two
   with ``OverlapConfig(transport="nccl", chunks=2, nccl_ctas=8)``;
4. writes DIR/report.txt (``print(overlap.report())``), DIR/report.json, and
   DIR/trace.<op>.png per op (``benchmarks/timeline.py``, the last call); the trace is
   gzipped past 15 MB and dropped past 15 MB gzipped.

On a CPU the ops take their reference paths: the report (calls, paths, reasons) and the
host ranges are there, timings and GPU lanes are not. ``--small`` (the default on a CPU)
takes shapes that run in a few milliseconds.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import overlap  # noqa: E402
from overlap import Norm, OverlapConfig, observe  # noqa: E402

# (M, K, F, N) for the chain; (M, N, K) for the collective ops
SHAPES = {"chain": (2048, 12288, 6144, 12288), "agmm": (8192, 4096, 8192), "armm": (8192, 4096, 8192)}
SMALL = {"chain": (512, 1024, 2048, 1024), "agmm": (1024, 768, 1024), "armm": (1024, 512, 1024)}
CONFIG = dict(transport="nccl", chunks=2, nccl_ctas=8)
MAX_BYTES = 15 << 20

__all__ = ["main", "run"]


def _cases(dev: torch.device, dt: torch.dtype, shapes: dict, seed: int) -> list[tuple[str, Callable, Callable]]:
    """(op, baseline call, op call) per op; new inputs every call (``normal_`` in place)."""
    from overlap.ops import all_gather_matmul_ref, all_reduce_matmul_ref, mlp_chain_stream_sync

    g = torch.Generator(device=dev).manual_seed(seed)

    def randn(*s: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*s, device=dev, dtype=torch.float32, generator=g) * scale).to(dt)

    m, k, f, n = shapes["chain"]
    x = randn(m, k)
    w1 = randn(f, k, scale=k ** -0.5).t()  # fc1.weight.t(): [K, F], no copy
    w2 = randn(n, f, scale=f ** -0.5).t()  # fc2.weight.t(): [F, N]
    cfg = OverlapConfig(**CONFIG)

    ma, na, ka = shapes["agmm"]
    a = randn(ma, ka)
    wa = randn(na, ka, scale=ka ** -0.5).t()

    mr, nr, kr = shapes["armm"]
    xr = randn(mr, kr)
    wr = randn(nr, kr, scale=kr ** -0.5).t()
    res = randn(mr, kr)
    ln = Norm("layernorm", (torch.rand(kr, device=dev, generator=g) + 0.5).to(dt), randn(kr), 1e-5)

    def fresh(*ts: torch.Tensor) -> None:
        for t in ts:
            t.normal_(generator=g)

    return [
        ("mlp_chain",
         lambda: (fresh(x), mlp_chain_stream_sync(x, w1, w2)),
         lambda: (fresh(x), overlap.mlp_chain(x, w1, w2))),
        ("all_gather_matmul",
         lambda: (fresh(a), all_gather_matmul_ref(a, wa)),
         lambda: (fresh(a), overlap.all_gather_matmul(a, wa, config=cfg))),
        ("all_reduce_matmul",
         lambda: (fresh(xr, res), all_reduce_matmul_ref(xr, wr, residual=res, norm=ln)),
         lambda: (fresh(xr, res), overlap.all_reduce_matmul(xr, wr, residual=res, norm=ln, config=cfg))),
    ]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(out: str, calls: int = 5, small: bool = False) -> dict[str, Any]:
    """Steps 1-4 of the module's docstring in an initialized process; returns a summary."""
    ctx = overlap.dist.get_context()
    dev = ctx.device
    on_gpu = dev.type == "cuda"
    dt = torch.bfloat16 if on_gpu else torch.float32
    shapes = SMALL if small or not on_gpu else SHAPES
    os.makedirs(out, exist_ok=True)
    cases = _cases(dev, dt, shapes, seed=0)
    was = overlap.profile()
    t0 = time.perf_counter()
    overlap.reset_report()  # from the first call: a fallback's warning is recorded once, there
    with torch.no_grad():
        overlap.profile(False)
        for _, base, op in cases:  # 1. warm: compiled, planned; counted, not timed
            for _ in range(2):
                base()
                op()
        _sync()
        overlap.profile(True)
        for _, base, _ in cases:  # 2. the serial baselines: the alone-times
            for _ in range(calls):
                base()
        _sync()
        trace = os.path.join(out, "trace.json")
        with observe.trace(trace):  # 3. the ops, traced
            for _, _, op in cases:
                for _ in range(calls):
                    op()
    overlap.profile(was)
    _sync()
    rep = overlap.report()  # 4.
    with open(os.path.join(out, "report.txt"), "w") as fh:
        fh.write(str(rep) + "\n")
    with open(os.path.join(out, "report.json"), "w") as fh:
        fh.write(rep.to_json(indent=1) + "\n")
    pngs: list[str] = []
    try:
        from benchmarks import timeline

        pngs = timeline.main([trace, "--out", out])
    except SystemExit as e:  # no matplotlib, or no op range found: said, not fatal here
        print(f"timeline: {e}", flush=True)
    size = os.path.getsize(trace)
    if size > MAX_BYTES:
        with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(trace)
        trace += ".gz"
        if os.path.getsize(trace) > MAX_BYTES:
            print(f"trace {size >> 20} MB, {os.path.getsize(trace) >> 20} MB gzipped: dropped", flush=True)
            os.remove(trace)
            trace = ""
    summary = {"device": torch.cuda.get_device_name(dev) if on_gpu else "cpu", "dtype": str(dt).split(".")[-1],
               "torch": torch.__version__, "shapes": {k: list(v) for k, v in shapes.items()}, "calls": calls,
               "config": CONFIG, "trace": os.path.basename(trace) if trace else None,
               "pngs": [os.path.basename(p) for p in pngs], "seconds": round(time.perf_counter() - t0, 1),
               "hidden": _hidden(rep)}
    return summary


def _hidden(rep: observe.Report) -> list[dict]:
    """Per op and overlapped path: op time, alone-times and the hidden fraction."""
    out = []
    for r in rep.rows:
        for t in r["timing"]:
            if not t["serial"]:
                out.append({"op": r["op"], "shape": r["shape"], "path": t["path"], "op_ms": t.get("op_ms"),
                            "comm_alone_ms": t.get("comm_alone_ms"), "gemm_alone_ms": t.get("gemm_alone_ms"),
                            "hidden": t.get("hidden")})
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for trace.json, report.txt, report.json, trace.<op>.png")
    ap.add_argument("--calls", type=int, default=5, help="profiled calls per op and per baseline")
    ap.add_argument("--small", action="store_true", help="small shapes (the default on a CPU)")
    args = ap.parse_args(argv)
    overlap.dist.init(timeout_s=120)
    try:
        summary = run(args.out, args.calls, args.small)
    finally:
        overlap.dist.shutdown()
    print(open(os.path.join(args.out, "report.txt")).read(), flush=True)
    for h in summary["hidden"]:
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"{h['op']} {'x'.join(map(str, h['shape']))} [{h['path']}]: op {fmt(h['op_ms'])} ms, comm alone "
              f"{fmt(h['comm_alone_ms'])} ms, gemm alone {fmt(h['gemm_alone_ms'])} ms, hidden {fmt(h['hidden'])}",
              flush=True)
    print("summary " + json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
