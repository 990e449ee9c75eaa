"""overlap.dist.nccl_comm on two GPUs, under torchrun and under mpirun."""

from __future__ import annotations

import json
import re

import pytest

from tests._procs import run_cmd

pytestmark = pytest.mark.gpu2


@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("mpirun", marks=pytest.mark.mpi)])
def test_nccl_comm_matches_torch_distributed(launcher: str) -> None:
    r = run_cmd(["bash", f"launch/{launcher}.sh", "2", "tests/gpu/nccl_comm_check.py"], timeout_s=300)
    assert r.returncode == 0, r.out[-6000:]
    assert re.search(rf"^PASS nccl_comm launcher={launcher} world=2 ", r.out, re.M), r
    line = re.search(r"^VERSIONS (.*)$", r.out, re.M)
    assert line, r
    v = json.loads(line.group(1))
    assert v["launcher"] == launcher and v["gpu"], v
    print(line.group(0))  # shown with pytest -s: which torch / NCCL / cupy / GPU ran
