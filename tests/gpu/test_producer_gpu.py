"""The producer ops on one GPU (world size 1) and on two (torchrun, mpirun); see producer_check.py,
and producer_p2p_check.py for the peer-copy transport (two GPUs of one node)."""

from __future__ import annotations

import re

import pytest

from tests._procs import REPO, run_cmd


@pytest.mark.gpu
def test_producer_one_gpu() -> None:
    r = run_cmd(["python", str(REPO / "tests" / "gpu" / "producer_check.py")], timeout_s=300)
    assert r.returncode == 0 and re.search(r"^PASS producer world=1 ", r.out, re.M), r.out[-6000:]


@pytest.mark.gpu2
@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("mpirun", marks=pytest.mark.mpi)])
def test_producer_two_gpus(launcher: str) -> None:
    r = run_cmd(["bash", f"launch/{launcher}.sh", "2", "tests/gpu/producer_check.py"], timeout_s=400)
    assert r.returncode == 0 and re.search(rf"^PASS producer world=2 {launcher}", r.out, re.M), r.out[-6000:]


@pytest.mark.gpu2
@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("mpirun", marks=pytest.mark.mpi)])
def test_producer_p2p_two_gpus(launcher: str) -> None:
    r = run_cmd(["bash", f"launch/{launcher}.sh", "2", "tests/gpu/producer_p2p_check.py"], timeout_s=500)
    assert r.returncode == 0 and re.search(rf"^PASS producer_p2p world=2 {launcher}", r.out, re.M), r.out[-6000:]
