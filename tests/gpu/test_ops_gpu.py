"""The collective ops on two GPUs, under torchrun and under mpirun (see agmm_check.py, armm_check.py)."""

from __future__ import annotations

import re

import pytest

from tests._procs import run_cmd

pytestmark = pytest.mark.gpu2


@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("mpirun", marks=pytest.mark.mpi)])
@pytest.mark.parametrize("op", ["agmm", "armm"])
def test_op_gpu(op: str, launcher: str) -> None:
    r = run_cmd(["bash", f"launch/{launcher}.sh", "2", f"tests/gpu/{op}_check.py"], timeout_s=400)
    assert r.returncode == 0, r.out[-6000:]
    assert re.search(rf"^PASS {op} {launcher} world=2 ", r.out, re.M), r
    print(re.search(rf"^PASS {op} .*$", r.out, re.M).group(0))
