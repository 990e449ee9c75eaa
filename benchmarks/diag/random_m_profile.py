"""Where the host time of a new M goes: cProfile over calls of each fused op with M random in
[1, 16384] (the shapes of ``random_m.py``), after a few warm calls.

    bash launch/torchrun.sh 1 benchmarks/diag/random_m_profile.py [--calls 200] [--out DIR]

Writes ``random_m_profile.txt``: per op, the host ms per call and the functions with the most
own time and the most cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from overlap import dist  # noqa: E402
from overlap.ops import Norm, OverlapConfig, all_gather_matmul, all_reduce_matmul, mlp_chain  # noqa: E402

K, N, F, M_MAX = 4096, 4096, 8192, 16384


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    ctx = dist.init(timeout_s=120)
    dev = torch.device("cuda", torch.cuda.current_device())
    rng = random.Random(1)
    b = (torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 64).t()
    w1 = torch.randn(K, F, device=dev, dtype=torch.bfloat16) / 64
    w2 = torch.randn(F, N, device=dev, dtype=torch.bfloat16) / 90
    norm = Norm("layernorm", torch.ones(K, device=dev, dtype=torch.bfloat16), None)
    x_all = torch.randn(M_MAX, K, device=dev, dtype=torch.bfloat16)
    res_all = torch.randn(M_MAX, K, device=dev, dtype=torch.bfloat16)
    cfg = OverlapConfig(transport="nccl")
    ops = {
        "all_gather_matmul": lambda m: all_gather_matmul(x_all[:m], b, config=cfg),
        "all_reduce_matmul": lambda m: all_reduce_matmul(x_all[:m], b, residual=res_all[:m], norm=norm, config=cfg),
        "mlp_chain": lambda m: mlp_chain(x_all[:m], w1, w2),
    }
    report = io.StringIO()
    for name, op in ops.items():
        for m in (1, 17, 8192):  # warm: every kernel variant compiled
            op(m)
        torch.cuda.synchronize()
        ms = [rng.randint(1, M_MAX) for _ in range(args.calls)]
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for m in ms:
            op(m)
        prof.disable()
        host = (time.perf_counter() - t0) * 1e3 / len(ms)
        torch.cuda.synchronize()
        report.write(f"==== {name}: {host:.3f} host ms per call under the profiler, {len(ms)} calls\n")
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).strip_dirs().sort_stats(key).print_stats(25)
            report.write(f"-- by {key}\n" + s.getvalue().split("\n\n", 1)[-1] + "\n")
    if ctx.is_main:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "random_m_profile.txt"), "w") as f:
            f.write(report.getvalue())
        print(report.getvalue()[:3000])
    dist.shutdown()


if __name__ == "__main__":
    main()
