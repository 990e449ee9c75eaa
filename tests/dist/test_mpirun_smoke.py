"""launch/mpirun.sh end to end: overlap.dist.init under mpirun on gloo (CPU)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests._procs import REPO, run_cmd

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(("np_", "tp"), [(2, 2), (4, 2)])
def test_mpirun_init_allreduce_and_uid_broadcast(np_: int, tp: int) -> None:
    """4 ranks on a 2-core machine also checks --oversubscribe is added."""
    r = run_cmd(["bash", str(REPO / "launch/mpirun.sh"), str(np_), "tests/_mpi_smoke.py", str(tp)],
                timeout_s=120)
    assert r.returncode == 0, r
    assert f"PASS mpirun world={np_} tp={tp} uid_exchange=mpi" in r.out, r


def test_mpirun_rank_error_aborts_the_job(tmp_path: Path) -> None:
    """One rank raising ends the job (python -m mpi4py) instead of leaving rank 0 waiting
    forever in a collective; also runs an ENTRY given as -m module."""
    (tmp_path / "abort_probe.py").write_text(
        "from mpi4py import MPI\n"
        "if MPI.COMM_WORLD.Get_rank() == 1:\n"
        "    raise RuntimeError('rank 1 fails on purpose')\n"
        "MPI.COMM_WORLD.barrier()\n"
    )
    r = run_cmd(["bash", str(REPO / "launch/mpirun.sh"), "2", "-m", "abort_probe"], timeout_s=60,
                env={"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])})
    assert r.returncode not in (0, None), r
    assert "rank 1 fails on purpose" in r.out, r
