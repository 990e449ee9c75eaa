"""Graphs, streams, threads, failures and timeouts on one GPU (see safety_check.py)."""

from __future__ import annotations

import re

import pytest

from tests._procs import REPO, run_cmd

pytestmark = pytest.mark.gpu


def test_safety_one_gpu() -> None:
    r = run_cmd(["python", str(REPO / "tests" / "gpu" / "safety_check.py")], timeout_s=420)
    for line in re.findall(r"^(?:PASS|FAIL) .*$", r.out, re.M):
        print(line)
    assert r.returncode == 0 and "ALL PASS" in r.out, r.out[-8000:]
