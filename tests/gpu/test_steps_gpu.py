"""Refusals and two threads on the tile-flag paths at world size 1 (see steps_check.py)."""

from __future__ import annotations

import re

import pytest

from tests._procs import REPO, run_cmd

pytestmark = pytest.mark.gpu


def test_steps_one_gpu() -> None:
    r = run_cmd(["python", str(REPO / "tests" / "gpu" / "steps_check.py")], timeout_s=420)
    for line in re.findall(r"^(?:PASS|FAIL) .*$", r.out, re.M):
        print(line)
    assert r.returncode == 0 and "ALL PASS" in r.out, r.out[-8000:]
