"""all_gather_matmul on two GPUs, under torchrun and under mpirun (see agmm_check.py)."""

from __future__ import annotations

import re

import pytest

from tests._procs import run_cmd

pytestmark = pytest.mark.gpu2


@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("mpirun", marks=pytest.mark.mpi)])
def test_all_gather_matmul_gpu(launcher: str) -> None:
    r = run_cmd(["bash", f"launch/{launcher}.sh", "2", "tests/gpu/agmm_check.py"], timeout_s=400)
    assert r.returncode == 0, r
    assert re.search(rf"^PASS agmm {launcher} world=2 ", r.out, re.M), r
    print(re.search(r"^PASS agmm .*$", r.out, re.M).group(0))
