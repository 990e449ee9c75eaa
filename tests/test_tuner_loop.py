"""The tuners' shared candidate loop (overlap.ops._runtime.time_candidates) on the CPU:
one gloo process, a fake timer and a fake error word. A candidate whose waits timed
out is dropped (and warned about); the others come back with async error checks."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch.distributed as tdist

from overlap.flags import FlagTimeoutError
from overlap.ops import OverlapConfig
from overlap.ops._runtime import time_candidates
from tests._procs import free_port


@pytest.fixture
def group() -> Any:
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield tdist.group.WORLD
    tdist.destroy_process_group()


class _Err:
    what = "fake op"

    def __init__(self) -> None:
        self.fail_next = False

    def check(self, block: bool = True) -> None:
        if self.fail_next:
            self.fail_next = False
            raise FlagTimeoutError("fake op", 0, 1, 5, 4, 0)


def test_timed_out_candidate_is_dropped(group: Any, capsys: pytest.CaptureFixture[str]) -> None:
    rt = types.SimpleNamespace(device=torch.device("cpu"), rank=0)
    err = _Err()
    seen: list[OverlapConfig] = []
    cands = [OverlapConfig(chunks=c) for c in (1, 2, 3)]

    def run(cand: OverlapConfig) -> None:
        seen.append(cand)
        err.fail_next = cand.chunks == 2  # this one's waits time out

    def timer(fn: Any, iters: int, grp: Any) -> float:
        fn()
        return float(len(seen))

    with pytest.warns(UserWarning, match="timed out"):
        out = time_candidates(rt, err, cands, run, 3, group, describe=lambda c: f"cand {c.chunks}", timer=timer)
    assert [(t, c.chunks) for t, c in out] == [(1.0, 1), (3.0, 3)]
    assert all(c.check == "async" for _, c in out) and all(c.check == "none" for c in seen)
    printed = capsys.readouterr().out
    assert "cand 2" in printed and "rejected" in printed and printed.count("rejected") == 1
