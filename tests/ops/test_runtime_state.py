"""What the ops keep lives on a runtime (``overlap.ops._runtime.Runtime``): one per group
and device, one per device for the chain (``local_runtime``). ``overlap.dist.shutdown``
drops the runtimes, so after a new ``init`` over the same ranks no plan, tuned config,
agreement key or chain state of the old one is used again (they were built on, and
checked over, communicators and groups that shutdown destroyed)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as tdist

from overlap import dist
from overlap.ops import SEQUENTIAL, OverlapConfig
from overlap.ops import _runtime as rtm
from overlap.ops import all_gather as ag
from overlap.ops import all_reduce as ar
from overlap.ops import boundary as bd
from overlap.ops import chain as ch
from overlap.ops import matmul_reduce as mr
from tests._fake_nccl import FakeNccl
from tests.ops._cpu_runtime import cpu_runtime, cuda_stand_ins

CPU = torch.device("cpu")
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def single(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A one-process launch (``overlap.dist.init``: gloo, world 1), runtimes makeable on the CPU."""
    for k in list(os.environ):
        if k in _LAUNCH_VARS or k.startswith(("OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "TORCHELASTIC_")):
            monkeypatch.delenv(k)
    prev = dist.set_nccl_backend(FakeNccl())
    assert dist.get_context() is None and not tdist.is_initialized()
    try:
        with cuda_stand_ins():
            yield
    finally:
        dist.shutdown()
        dist.set_nccl_backend(prev)


def _runtime() -> rtm.Runtime:
    return rtm.get_runtime(rtm.resolve_group(None), CPU)  # what an op's call resolves and looks up


def test_plans_do_not_survive_shutdown(single: None) -> None:
    """A plan built before ``shutdown`` is not the one a call after a new ``init`` over the
    same ranks gets (module-level caches keyed by the ranks handed the old one out)."""
    cfg = OverlapConfig(chunks=2)
    dist.init(timeout_s=10)
    rt = _runtime()
    before = (ag._plan(rt, 300, 256, 128, cfg), ar._plan(rt, 300, 256, 128, cfg),
              mr._plan(rt, "matmul_all_reduce", 300, 256, 128, cfg))
    assert ag._plan(rt, 300, 256, 128, cfg) is before[0]  # cached while the runtime lives
    dist.shutdown()
    dist.init(timeout_s=10)
    rt2 = _runtime()
    assert rt2 is not rt and rt2.ranks == rt.ranks
    after = (ag._plan(rt2, 300, 256, 128, cfg), ar._plan(rt2, 300, 256, 128, cfg),
             mr._plan(rt2, "matmul_all_reduce", 300, 256, 128, cfg))
    for old, new in zip(before, after):
        assert new is not old, "a plan survived shutdown"
        assert torch.equal(new.table, old.table)


def test_shutdown_drops_every_cache(single: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans, tuned configs (as the tuners store them), row permutations, the ranks'
    agreement keys and the chain's runtime (its tables, tuned configs, words): none is
    seen again after ``shutdown``; the agreement is checked again."""
    gathers: list[list[int]] = []
    real = rtm.gather_ints
    monkeypatch.setattr(rtm, "gather_ints", lambda *a: gathers.append(a[2]) or real(*a))
    cfg = OverlapConfig(chunks=2)
    dist.init(timeout_s=10)
    rt = _runtime()
    ag._plan(rt, 300, 256, 128, cfg)
    ag._tuned(rt)[(300, 256, 128, torch.float16)] = cfg
    ar._tuned(rt)[ar._tune_key(torch.empty(300, 128), 256, None, None)] = SEQUENTIAL
    mr._tuned(rt)[("matmul_all_reduce", 300, 256, 128, torch.float16, False)] = cfg
    rtm.check_agree(rt, "op", ("M", "K"), (300, 128), rows_at=0)
    rtm.check_agree(rt, "op", ("M", "K"), (300, 128), rows_at=0)
    assert len(gathers) == 1  # agreed once per runtime
    local = rtm.local_runtime(CPU)
    assert ch._runtime(CPU) is local and local is not rt and local.world == 1 and local.group is None
    ch._tables(local, 300, 512, 256, ch.ChainConfig())
    ch._tuned(local)[("x",)] = ch.ChainConfig()
    held = dict(rt._caches), dict(local._caches)
    assert all(held) and all(len(c) for d in held for c in d.values())

    dist.shutdown()
    assert not rt._caches and not local._caches, "a runtime held past shutdown still hands out its caches"
    assert rtm.local_runtime_if_made(CPU) is None
    dist.init(timeout_s=10)
    rt2, local2 = _runtime(), ch._runtime(CPU)
    assert rt2 is not rt and local2 is not local
    for acc in (ag._plans, ag._tuned, ag._perms, ar._plans, ar._tuned, mr._plans, mr._tuned):
        assert not acc(rt2), acc
    for acc in (ch._tables_of, ch._tuned):
        assert not acc(local2), acc
    rtm.check_agree(rt2, "op", ("M", "K"), (300, 128), rows_at=0)
    assert len(gathers) == 2  # checked again over the new group


def test_runtime_cache() -> None:
    """``Runtime.cache``: made on first use, the same object after, bounded, per runtime."""
    rt, other = cpu_runtime(), cpu_runtime()
    c = rt.cache("op.plans", 3)
    assert isinstance(c, rtm.LRU) and c.cap == 3 and rt.cache("op.plans", 3) is c
    for i in range(5):
        c[i] = i
    assert list(rt.cache("op.plans", 3)) == [2, 3, 4]
    assert not other.cache("op.plans", 3)
    with pytest.raises(ValueError, match="cap"):
        rt.cache("op.plans", 4)


def test_op_modules_keep_no_state_of_their_own() -> None:
    """No op module holds a cache at module level (it would outlive the runtimes); each
    one's caches are reached through the runtime of the call."""
    for mod in (ag, ar, mr, ch, bd):
        held = [name for name, v in vars(mod).items()
                if not name.startswith("__") and name != "stats" and isinstance(v, (dict, set, list))]
        assert not held, (mod.__name__, held)
    rt = cpu_runtime()
    for acc, cap in ((ag._plans, 64), (ag._tuned, 256), (ag._perms, 16), (ar._plans, 64), (ar._tuned, 256),
                     (mr._plans, 64), (mr._tuned, 256), (ch._tables_of, 64), (ch._tuned, 256)):
        c = acc(rt)
        assert c is acc(rt) and c.cap == cap and any(c is v for v in rt._caches.values()), acc


def test_local_runtime_is_not_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chain's runtime is made without a process group (none is initialized here) and
    names no rank in its error word."""
    assert not tdist.is_initialized()
    monkeypatch.setattr(rtm, "_runtimes", {})
    from overlap.ops import _state

    monkeypatch.setattr(_state, "_error_words", [])  # (the CPU word below is not for check_errors)
    with cuda_stand_ins():
        rt = rtm.local_runtime(CPU)
    assert rtm.local_runtime(CPU) is rt is rtm.local_runtime_if_made(CPU)
    assert (rt.group, rt.world, rt.rank) == (None, 1, 0)
    assert rt.p2p() is None and "one rank" in rt.p2p_why
    assert rt.err(ch.OP).what == "mlp_chain"


def test_every_tuner_returns_sequential_without_a_tile_flag_path(single: None) -> None:
    """CPU or fp32 inputs: each collective op's tuner answers SEQUENTIAL untimed, as the
    op itself takes the reference there (no runtime is asked for)."""
    from overlap.ops import tune_all_gather_matmul, tune_all_reduce_matmul
    from overlap.ops.matmul_reduce import tune_matmul_all_reduce, tune_matmul_reduce_scatter

    dist.init(timeout_s=10)
    a, b = torch.randn(8, 16), torch.randn(16, 8)
    assert tune_all_gather_matmul(a, b) is SEQUENTIAL
    assert tune_all_reduce_matmul(a, b) is SEQUENTIAL
    assert tune_matmul_reduce_scatter(a, b) is SEQUENTIAL
    assert tune_matmul_all_reduce(a, b) is SEQUENTIAL
    from overlap.ops import tune_matmul_all_reduce_matmul

    assert tune_matmul_all_reduce_matmul(a, b, torch.randn(8, 4)) is SEQUENTIAL
    with pytest.raises(ValueError, match="b_next"):
        tune_matmul_all_reduce_matmul(a, b, torch.randn(4, 4))
    with pytest.raises(ValueError, match="peer-copy"):  # the op runs on NCCL only
        tune_matmul_all_reduce_matmul(a, b, torch.randn(8, 4), candidates=[OverlapConfig(transport="p2p")])
    with pytest.raises(ValueError, match="K mismatch"):
        tune_all_gather_matmul(a, b.t())
