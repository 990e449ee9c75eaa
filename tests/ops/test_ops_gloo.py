"""The ops on gloo (2 and 4 CPU ranks) through their reference path, and their input checks."""

from __future__ import annotations

import pytest

from tests._procs import REPO, run_ranks


@pytest.mark.parametrize("world_size", [2, 4])
def test_ops_gloo(world_size: int) -> None:
    procs = run_ranks(REPO / "tests" / "_ops_worker.py", world_size, timeout_s=120)
    for p in procs:
        assert p.returncode == 0 and f"PASS ops rank={p.rank}" in p.out, p
