"""GPU checks of ``overlap.nn``: the gloo worker's checks (``tests/_nn_worker.py``) on CUDA in bf16.

Under ``bash launch/torchrun.sh 2 tests/gpu/nn_check.py`` or alone at world size 1:
every layer's output and gradients against one unsharded reference (bf16 weights, the
error as a relative norm against the fp32-accumulated reference, bound by 3e-2), sizes
scaled so that every fused op takes its tile-flag path (16-byte rows), overlap=True
against overlap=False, ``from_linear``, ``parallelize``, bad arguments, then the layers
under torch.compile. Prints ``PASS nn world=<R> ...``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from tests import _nn_worker as w  # noqa: E402

if __name__ == "__main__":
    w.main(device="cuda", dtype="bfloat16", scale=16, compile_too=True)
