"""The safety guarantees at two ranks, under torchrun and mpirun (see safety2_check.py)."""

from __future__ import annotations

import re

import pytest

from tests._procs import run_cmd

pytestmark = pytest.mark.gpu2


@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("mpirun", marks=pytest.mark.mpi)])
def test_safety_two_gpus(launcher: str) -> None:
    r = run_cmd(["bash", f"launch/{launcher}.sh", "2", "tests/gpu/safety2_check.py"], timeout_s=420)
    for line in re.findall(r"^PASS .*$", r.out, re.M):
        print(line)
    assert re.search(rf"^ALL PASS safety2 {launcher}", r.out, re.M), r.out[-8000:]
