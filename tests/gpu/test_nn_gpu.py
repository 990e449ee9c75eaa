"""``overlap.nn`` on CUDA in bf16: one GPU (world size 1) and two (torchrun); see nn_check.py."""

from __future__ import annotations

import re

import pytest

from tests._procs import REPO, run_cmd


@pytest.mark.gpu
def test_nn_one_gpu() -> None:
    r = run_cmd(["python", str(REPO / "tests" / "gpu" / "nn_check.py")], timeout_s=400)
    assert r.returncode == 0 and re.search(r"^PASS nn world=1 ", r.out, re.M), r.out[-6000:]


@pytest.mark.gpu2
def test_nn_two_gpus() -> None:
    r = run_cmd(["bash", "launch/torchrun.sh", "2", "tests/gpu/nn_check.py"], timeout_s=400)
    assert r.returncode == 0 and re.search(r"^PASS nn world=2 ", r.out, re.M), r.out[-6000:]


@pytest.mark.gpu
def test_layers_graphed_whole_gpu() -> None:
    """Forward + backward of each layer captured by torch.cuda.make_graphed_callables: every
    replay, with new inputs, equals the layer run eagerly (graphed_layers_check.py)."""
    r = run_cmd(["python", str(REPO / "tests" / "gpu" / "graphed_layers_check.py")], timeout_s=400)
    assert r.returncode == 0 and re.search(r"^PASS graphed_layers world=1 layers=5", r.out, re.M), r.out[-6000:]
