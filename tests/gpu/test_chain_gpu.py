"""The intra-GPU chain on one GPU (see chain_check.py)."""

from __future__ import annotations

import re

import pytest

from tests._procs import REPO, run_cmd

pytestmark = pytest.mark.gpu


def test_mlp_chain_gpu() -> None:
    r = run_cmd(["python", str(REPO / "tests" / "gpu" / "chain_check.py")], timeout_s=300)
    assert r.returncode == 0, r.out[-6000:]
    assert re.search(r"^PASS chain ", r.out, re.M), r
    print(re.search(r"^PASS chain .*$", r.out, re.M).group(0))
