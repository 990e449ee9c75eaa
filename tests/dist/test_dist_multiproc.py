"""overlap.dist across real processes on gloo: groups, collectives, NCCL bootstrap, timeouts.

Each test starts its own ranks (tests/_dist_worker.py) with torchrun-style variables and
a fresh port, and bounds them in time, so a hang fails the test instead of stalling it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests._procs import Proc, run_ranks

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
