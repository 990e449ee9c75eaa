"""The test runner's forked ranks (tests/_forkrun.py) behave as ranks started one by one."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests._procs import run_ranks

SCRIPT = '''
import os, sys, time
print("ARGV", sys.argv[1:], "NAME", __name__, "PATH0", sys.path[0], "RANK", os.environ["RANK"],
      "WORLD", os.environ["WORLD_SIZE"], "X", os.environ.get("X"), flush=True)
rank = int(os.environ["RANK"])
if rank == 1:
    raise ValueError("rank 1 refuses")
if rank == 2:
    sys.exit(7)
if rank == 3:
    time.sleep(60)
print("PASS", rank)
'''


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_forked_ranks_match_started_ranks(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    got = {}
    for fork in (False, True):
        # (a deadline well past a start-up on a loaded machine, the fork runner's import of
        # torch included: rank 0 must end before it; 5 s was missed under a full parallel suite)
        procs = run_ranks(script, 4, ["a", "b"], timeout_s=12, env={"X": "y"}, fork=fork)
        got[fork] = [(p.rank, p.returncode) for p in procs]
        for p in procs:
            assert f"ARGV ['a', 'b'] NAME __main__ PATH0 {tmp_path} RANK {p.rank} WORLD 4 X y" in p.out, (fork, p)
        assert "PASS 0" in procs[0].out and "ValueError: rank 1 refuses" in procs[1].out, (fork, procs)
        assert procs[3].elapsed_s >= 11.9 and procs[0].elapsed_s < 11.9, (fork, procs)
    # exit statuses as a plain start gives them: 0, 1 (the traceback), 7, None (killed at the deadline)
    assert got[True] == got[False] == [(0, 0), (1, 1), (2, 7), (3, None)], got
    assert sys.modules.get("tests._forkrun") is None  # the runner is a script, never imported here
