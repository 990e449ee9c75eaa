"""A new M every call (an inference server, variable-length training): 1000 calls with M
random in [1, 16384] against the same calls at a fixed M, and against the sequential path
(the op's reference), for all_gather_matmul, all_reduce_matmul, matmul_reduce_scatter and
matmul_all_reduce (NCCL transport; world size 1 is enough to see host time and memory) and
mlp_chain. Reports per case the host
time per call (queueing, no synchronization inside the loop), the GPU time per call, the
peak memory, the blocking agreement checks made, and the plans cached at the end.

    bash launch/torchrun.sh 1 benchmarks/diag/random_m.py [--calls 1000] [--out DIR]

Prints a table on rank 0 and writes ``random_m.json`` (with the GPU, versions and commit).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from overlap import dist  # noqa: E402
from overlap.ops import (Norm, OverlapConfig, all_gather_matmul, all_gather_matmul_ref,  # noqa: E402
                         all_reduce_matmul, all_reduce_matmul_ref, matmul_all_reduce, matmul_all_reduce_ref,
                         matmul_reduce_scatter, matmul_reduce_scatter_ref, mlp_chain, mlp_chain_ref)
from overlap.ops import _runtime  # noqa: E402
from overlap.ops import all_gather as agmod  # noqa: E402
from overlap.ops import all_reduce as armod  # noqa: E402
from overlap.ops import chain as chmod  # noqa: E402
from overlap.ops import matmul_reduce as mrmod  # noqa: E402

K, N, F = 4096, 4096, 8192
M_MAX = 16384


def _run(calls: list[int], make: Callable[[int], Callable[[], Any]]) -> dict[str, float]:
    """Host and GPU time per call and the peak memory of ``calls`` (one M each)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    gathers = [0]
    real = _runtime.gather_ints

    def counting(*a: Any, **kw: Any) -> Any:
        gathers[0] += 1
        return real(*a, **kw)

    _runtime.gather_ints = counting
    fns = [make(m) for m in calls]  # inputs made before the clock starts
    host: list[float] = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        start.record()
        for fn in fns:
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
    finally:
        _runtime.gather_ints = real
    return {"host_ms_mean": statistics.fmean(host), "host_ms_p50": statistics.median(host),
            "host_ms_p99": sorted(host)[int(0.99 * len(host)) - 1], "host_ms_max": max(host),
            "gpu_ms_per_call": start.elapsed_time(end) / len(fns),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "blocking_checks": gathers[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    ctx = dist.init(timeout_s=120)
    dev = torch.device("cuda", torch.cuda.current_device())
    rng = random.Random(0)
    rand_ms = [rng.randint(1, M_MAX) for _ in range(args.calls)]
    fixed_ms = [M_MAX // 2] * args.calls
    b = (torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 64).t()
    w1 = torch.randn(K, F, device=dev, dtype=torch.bfloat16) / 64
    w2 = torch.randn(F, N, device=dev, dtype=torch.bfloat16) / 90
    norm = Norm("layernorm", torch.ones(K, device=dev, dtype=torch.bfloat16), None)
    x_all = torch.randn(M_MAX, K, device=dev, dtype=torch.bfloat16)
    res_all = torch.randn(M_MAX, K, device=dev, dtype=torch.bfloat16)
    cfg = OverlapConfig(transport="nccl")

    cases: dict[str, Callable[[int], Callable[[], Any]]] = {
        "all_gather_matmul": lambda m: (lambda: all_gather_matmul(x_all[:m], b, config=cfg)),
        "all_gather_matmul sequential": lambda m: (lambda: all_gather_matmul_ref(x_all[:m], b)),
        "all_reduce_matmul": lambda m: (lambda: all_reduce_matmul(x_all[:m], b, residual=res_all[:m], norm=norm,
                                                                  config=cfg)),
        "all_reduce_matmul sequential": lambda m: (lambda: all_reduce_matmul_ref(x_all[:m], b, residual=res_all[:m],
                                                                                 norm=norm)),
        "matmul_reduce_scatter": lambda m: (lambda: matmul_reduce_scatter(x_all[:m], b, config=cfg)),
        "matmul_reduce_scatter sequential": lambda m: (lambda: matmul_reduce_scatter_ref(x_all[:m], b)),
        "matmul_all_reduce": lambda m: (lambda: matmul_all_reduce(x_all[:m], b, residual=res_all[:m], config=cfg)),
        "matmul_all_reduce sequential": lambda m: (lambda: matmul_all_reduce_ref(x_all[:m], b,
                                                                                 residual=res_all[:m])),
        "mlp_chain": lambda m: (lambda: mlp_chain(x_all[:m], w1, w2)),
        "mlp_chain sequential": lambda m: (lambda: mlp_chain_ref(x_all[:m], w1, w2)),
    }
    rows = []
    for name, make in cases.items():
        for label, ms in (("fixed M", fixed_ms), ("random M", rand_ms)):
            _run(ms[:3], make)  # warm: compile the kernels (not what is measured)
            r = _run(ms, make)
            rt, local = _runtime.get_runtime(_runtime.resolve_group(None), dev), chmod._runtime(dev)
            r.update(case=name, m=label,
                     plans=len(agmod._plans(rt)) + len(armod._plans(rt)) + len(mrmod._plans(rt))
                     + len(chmod._tables_of(local)))
            rows.append(r)
    if ctx.is_main:
        print(f"{'case':32s} {'M':9s} {'host ms mean':>12s} {'p50':>7s} {'p99':>7s} {'max':>8s} "
              f"{'GPU ms/call':>11s} {'peak GiB':>8s} {'checks':>6s} {'plans':>5s}")
        for r in rows:
            print(f"{r['case']:32s} {r['m']:9s} {r['host_ms_mean']:12.3f} {r['host_ms_p50']:7.3f} "
                  f"{r['host_ms_p99']:7.3f} {r['host_ms_max']:8.2f} {r['gpu_ms_per_call']:11.3f} "
                  f"{r['peak_mem_gib']:8.2f} {r['blocking_checks']:6d} {r['plans']:5d}", flush=True)
        commit = os.environ.get("OVERLAP_COMMIT", "")  # a run from an archive of the tree has no git
        if not commit:
            try:
                commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=os.path.dirname(__file__)).stdout.strip()
            except Exception:  # noqa: BLE001
                commit = ""
        import triton

        meta = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
                "commit": commit, "calls": args.calls, "K": K, "N": N, "F": F, "M_max": M_MAX}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "random_m.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    dist.shutdown()


if __name__ == "__main__":
    main()
