"""The ranks never get silently out of step (gloo, 2 and 4 ranks; see _steps_worker.py):
refusals on one rank only, unsupported dtypes, eps and N-D disagreements, exceptions
before and after the collective, two threads per rank."""

from __future__ import annotations

import pytest

from tests._procs import REPO, run_ranks


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_stay_in_step_gloo(world_size: int) -> None:
    procs = run_ranks(REPO / "tests" / "_steps_worker.py", world_size, timeout_s=240)
    for p in procs:
        assert p.returncode == 0 and f"PASS steps rank={p.rank}" in p.out, p
