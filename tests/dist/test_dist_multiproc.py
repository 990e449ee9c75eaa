"""overlap.dist across real processes on gloo: groups, collectives, NCCL bootstrap, timeouts.

Each test starts its own ranks (tests/_dist_worker.py) with torchrun-style variables and
a fresh port, and bounds them in time, so a hang fails the test instead of stalling it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests._procs import REPO, Proc, run_cmd, run_ranks

WORKER = Path(__file__).resolve().parent.parent / "_dist_worker.py"


def _all_pass(results: list[Proc], tag: str) -> None:
    report = "\n".join(map(str, results))
    for r in results:
        assert r.returncode == 0, report
        assert f"PASS {tag} rank={r.rank}" in r.out, report


@pytest.mark.parametrize("world_size", [2, 4])
def test_groups_and_collectives(world_size: int) -> None:
    """tp_size 1, 2 (and 4): group ranks, idempotent init, bad tp_size, tp/dp collectives."""
    _all_pass(run_ranks(WORKER, world_size, ["groups"], timeout_s=90), "groups")


@pytest.mark.parametrize(("world_size", "tp_size"), [(2, 2), (4, 2), (4, 4)])
def test_nccl_comm_bootstrap_with_fake_backend(world_size: int, tp_size: int) -> None:
    """Every member gets group rank 0's unique id and its own (nranks, rank)."""
    _all_pass(run_ranks(WORKER, world_size, ["nccl", str(tp_size)], timeout_s=90), "nccl")


def test_rank_that_never_arrives_is_a_named_error() -> None:
    """World size 2, only rank 0 started: DistInitError naming rank 1, after ~timeout."""
    (r0,) = run_ranks(WORKER, 2, ["init", "3"], ranks=[0], timeout_s=40)
    assert r0.returncode == 3, r0
    msg = re.search(r"DISTINITERROR (.*)", r0.out)
    assert msg, r0
    text = msg.group(1)
    assert "rank 0 of 2" in text and "rank(s) [1]" in text and "waited 3 s" in text, text
    assert re.search(r"127\.0\.0\.1:\d+", text), text
    waited = float(re.search(r"after ([\d.]+) s", r0.out).group(1))
    assert 2.5 <= waited < 10, r0


def test_missing_rank0_is_a_named_error() -> None:
    """Only rank 1 started: it cannot reach the store rank 0 would host; bounded error."""
    (r1,) = run_ranks(WORKER, 2, ["init", "3"], ranks=[1], timeout_s=40)
    assert r1.returncode == 3, r1
    text = re.search(r"DISTINITERROR (.*)", r1.out).group(1)
    assert "rank 1 of 2" in text and "could not reach the rendezvous store" in text, text
    waited = float(re.search(r"after ([\d.]+) s", r1.out).group(1))
    assert 2.5 <= waited < 10, r1


def test_nccl_comm_member_that_never_arrives() -> None:
    """Rank 1 skips nccl_comm(): rank 0 gets a DistInitError naming it, not a hang."""
    _all_pass(run_ranks(WORKER, 2, ["nccl_missing"], timeout_s=60), "nccl_missing")


def test_nccl_comm_config_mismatch_raises_on_every_rank() -> None:
    _all_pass(run_ranks(WORKER, 2, ["nccl_config_mismatch"], timeout_s=60), "nccl_config_mismatch")


# ---- shutdown: bounded whatever timeout_s is; a failed rank 0 ends the job in seconds ----


def _ended_fast(out: str, elapsed_s: float, ranks: int = 2) -> None:
    assert elapsed_s < 30, f"the job took {elapsed_s:.1f} s (timeout_s is 120)\n{out}"
    assert "rank 0 failed on purpose" in out, out


def test_failed_rank0_ends_hand_started_job_fast() -> None:
    """Hand-started ranks (rank 0 hosts the store), timeout_s=120: rank 0 raises while rank
    1 waits in an all-reduce; both processes end within seconds, both non-zero."""
    r0, r1 = run_ranks(WORKER, 2, ["fail0"], timeout_s=60)
    _ended_fast(r0.out, max(r0.elapsed_s, r1.elapsed_s))
    assert r0.returncode not in (0, None) and r1.returncode not in (0, None), f"{r0}\n{r1}"
    assert "Connection closed by peer" in r1.out, r1  # rank 1's all-reduce failed at once
    if Path("/proc/self/task").is_dir():  # its traceback held the group: gone at shutdown all the same
        assert "gloo threads left: []" in r1.out, r1


@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("mpirun", marks=pytest.mark.mpi)])
def test_failed_rank0_ends_launched_job_fast(launcher: str) -> None:
    r = run_cmd(["bash", f"launch/{launcher}.sh", "2", str(WORKER.relative_to(REPO)), "fail0"], timeout_s=60)
    _ended_fast(r.out, r.elapsed_s)
    assert r.returncode not in (0, None), r


def test_shutdown_bound_whatever_timeout_s() -> None:
    """A peer that never reaches shutdown: rank 0 waits the shutdown bound, not timeout_s."""
    r0, r1 = run_ranks(WORKER, 2, ["goodbye_bound"], timeout_s=60)
    assert r0.returncode == 0 and "PASS goodbye_bound rank=0" in r0.out, f"{r0}\n{r1}"
