"""All-gather -> GEMM on R GPUs: the suite's agmm op (benchmarks/run.py --ops agmm).

    bash launch/torchrun.sh 2 benchmarks/bench_all_gather_matmul.py --out DIR
    bash launch/mpirun.sh 2 benchmarks/bench_all_gather_matmul.py --out DIR

Kept for its old command line; it runs

    benchmarks/run.py --ops agmm [--shapes all | --shape MxNxK ...] --iters N --out DIR [--no-tune]

and writes DIR/results.json, DIR/results.md and DIR/agmm.png (see benchmarks/suite/).
Shapes: the old names (comm-heavy-16k, comm-heavy-8k, gpt3-fc1, gpt3-qkv-like,
llama70b-fc1) or M,N,K; default all five.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.suite.runner import main as run_main  # noqa: E402

SHAPES = {
    "comm-heavy-16k": (16384, 2048, 8192),
    "comm-heavy-8k": (8192, 1024, 8192),
    "gpt3-fc1": (8192, 18432, 12288),
    "gpt3-qkv-like": (8192, 24576, 12288),
    "llama70b-fc1": (8192, 14336, 8192),
}


def suite_args(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", nargs="*", default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-tune", action="store_true")
    args = ap.parse_args(argv)
    out = ["--ops", "agmm", "--iters", str(args.iters), "--out", args.out]
    if args.shapes:
        for name in args.shapes:
            dims = SHAPES[name] if name in SHAPES else tuple(int(v) for v in name.split(","))
            out += ["--shape", "x".join(map(str, dims))]
    else:
        out += ["--shapes", "all"]
    if args.no_tune:
        out.append("--no-tune")
    return out


if __name__ == "__main__":
    sys.exit(run_main(suite_args()))
