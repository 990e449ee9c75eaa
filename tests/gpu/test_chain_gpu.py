"""The intra-GPU chain on one GPU (see chain_check.py)."""

from __future__ import annotations

import re

import pytest

from tests._procs import REPO, run_cmd

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("engine", ["tile", "gluon"])
def test_mlp_chain_gpu(engine: str) -> None:
    """fc2 on the tile GEMM (bit-equal to the stream-synced baseline), or forced onto the
    Gluon GEMM where it can run it (RowSync; the engines listed)."""
    r = run_cmd(["python", str(REPO / "tests" / "gpu" / "chain_check.py"), "--engine", engine], timeout_s=300)
    assert r.returncode == 0, r.out[-6000:]
    got = re.search(r"^PASS chain .* engines=(\S+)$", r.out, re.M)
    assert got, r.out[-6000:]
    if engine == "gluon":
        assert any(e.startswith("gluon") for e in got.group(1).split(",")), got.group(0)
    print(got.group(0))
