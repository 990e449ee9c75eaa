"""One benchmark runner for every op of the library (see benchmarks/suite/).

    bash launch/torchrun.sh 2 benchmarks/run.py --ops agmm,armm,chain \
        --shapes gpt3-175b,llama-70b,comm-heavy --out DIR
    bash launch/mpirun.sh   2 benchmarks/run.py --ops agmm,armm,chain \
        --shapes gpt3-175b,llama-70b,comm-heavy --out DIR
    bash launch/torchrun.sh 2 benchmarks/run.py --ops agmm --shape 8192x1024x8192 --iters 50

    python benchmarks/run.py --help

Without a GPU it runs on gloo with scaled-down shapes; its figures are not GPU figures.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.suite.runner import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
