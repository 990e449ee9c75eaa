"""The ops' guarantees that need no GPU: ranks that disagree (gloo, 2 and 4 ranks),
a call outside the group, inputs that require grad, bounded waits that must end, the
peer-copy call's failure handling (``run_p2p``) and quiet calls."""

from __future__ import annotations

import threading
from dataclasses import replace
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch

from overlap import flags as fl
from overlap.ops import ChainConfig, OverlapConfig
from overlap.ops import _runtime as rtmod
from tests._procs import REPO, run_ranks


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_that_disagree_gloo(world_size: int) -> None:
    procs = run_ranks(REPO / "tests" / "_safety_worker.py", world_size, timeout_s=150)
    for p in procs:
        assert p.returncode == 0 and f"PASS safety rank={p.rank}" in p.out, p


@pytest.mark.parametrize("bad", ["inf", "nan", "0", "-5", "soon"])
def test_wait_bound_must_end(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OVERLAP_WAIT_TIMEOUT_MS", bad)
    with pytest.raises(ValueError, match="OVERLAP_WAIT_TIMEOUT_MS"):
        fl.default_timeout_ms()
    with pytest.raises(ValueError, match="timeout_ms"):
        OverlapConfig(timeout_ms=float("inf"))
    with pytest.raises(ValueError, match="timeout_ms"):
        ChainConfig(timeout_ms=float("inf"))


def test_default_bound_follows_the_process_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default wait bound is minutes (the process groups' timeout), so a rank that
    arrives seconds late is waited for: OVERLAP_WAIT_TIMEOUT_MS first, then the
    overlap.dist context's timeout, then torch's default process-group timeout; and
    shutdown's drain stays bounded (at most 60 s)."""
    from datetime import timedelta

    from torch.distributed import constants

    from overlap import dist

    monkeypatch.delenv("OVERLAP_WAIT_TIMEOUT_MS", raising=False)
    monkeypatch.setattr(dist, "get_context", lambda: None)
    torch_default = constants.default_pg_timeout.total_seconds() * 1000.0
    assert fl.default_timeout_ms() == torch_default and torch_default >= 60_000
    assert rtmod.shutdown_timeout_s() == 60.0
    # no context: the group's backend picks torch's default (NCCL's own where torch sets one)
    monkeypatch.setattr(constants, "default_pg_nccl_timeout", timedelta(minutes=7))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    assert fl.default_timeout_ms("a group") == 7 * 60_000.0
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    assert fl.default_timeout_ms("a group") == torch_default
    # overlap.dist.init's context: its timeout_s, which its process groups have too
    monkeypatch.setattr(dist, "get_context", lambda: SimpleNamespace(timeout_s=42.0))
    assert fl.default_timeout_ms() == 42_000.0 and fl.default_timeout_ms("a group") == 42_000.0
    assert rtmod.shutdown_timeout_s() == 47.0
    monkeypatch.setattr(dist, "get_context", lambda: SimpleNamespace(timeout_s=float("inf")))
    with pytest.raises(ValueError, match="finite"):
        fl.default_timeout_ms()
    # the environment overrides both
    monkeypatch.setenv("OVERLAP_WAIT_TIMEOUT_MS", "250")
    assert fl.default_timeout_ms() == 250.0 and rtmod.shutdown_timeout_s() == 5.25


def test_tuner_bounds_its_timed_calls() -> None:
    """A tuner's timed calls wait seconds, not the default's minutes (a candidate that
    starves its own communication is dropped quickly); a bound the candidate sets stays."""
    assert rtmod.tuning_bound(OverlapConfig()).timeout_ms == rtmod.TUNE_TIMEOUT_MS
    assert rtmod.tuning_bound(OverlapConfig(timeout_ms=7.0)).timeout_ms == 7.0


def test_wrap32() -> None:
    assert [fl.wrap32(v) for v in (0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 5, -1)] == \
        [0, 1, 2**31 - 1, -(2**31), -1, 0, 5, -1]


def test_refuse_grad() -> None:
    a = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="no backward yet"):
        rtmod.refuse_grad("op", a, None)
    with torch.no_grad():
        rtmod.refuse_grad("op", a, None)
    rtmod.refuse_grad("op", a.detach(), None)


class _FakeOrder:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.events: list[str] = []

    def begin(self, cur: Any) -> None:
        self.events.append("begin")

    def end(self, cur: Any) -> None:
        self.events.append("end")


def _fake_rt() -> Any:
    sf = SimpleNamespace(epoch=41)
    rt = SimpleNamespace(device=torch.device("cpu"), pushes=0, order=_FakeOrder(), comm_stream="cs",
                         aux_stream="ns", copy_stream="cs2", joined=[], ended=[])
    rt.p2p = lambda: SimpleNamespace(flags=lambda name, n: sf)
    rt.current_stream = lambda: torch.cuda.current_stream()
    rt.join = lambda cur, *s: rt.joined.append(s)
    rt.p2p_end = lambda op, cur: rt.ended.append(op)
    return rt, sf


@pytest.mark.parametrize("pushed", [0, 3])
def test_run_p2p_failure(pushed: int) -> None:
    """An exception in a peer-copy call: the side streams are joined into the caller's,
    the call's end is marked, and the epoch is taken back only if no push was queued."""
    rt, sf = _fake_rt()

    def call() -> None:
        sf.epoch += 1
        rt.pushes += pushed
        raise KeyboardInterrupt("injected")

    with mock.patch.object(torch.cuda, "current_stream", lambda *a: "cur"):
        with pytest.raises(KeyboardInterrupt):
            rtmod.run_p2p(rt, "op", call)
        assert sf.epoch == (42 if pushed else 41)
        assert rt.joined == [("cs", "ns", "cs2")] and rt.ended == ["op"]
        assert rt.order.events == ["begin", "end"]
        # a call that succeeds keeps its epoch and joins nothing extra
        assert rtmod.run_p2p(rt, "op", lambda: sf.__setattr__("epoch", sf.epoch + 1) or "ok") == "ok"
        assert sf.epoch == (43 if pushed else 42) and len(rt.joined) == 1


def test_check_errors_without_words() -> None:
    from overlap.ops import _state

    with mock.patch.object(_state, "_error_words", []):
        rtmod.check_errors()


def test_first_runtime_does_not_deadlock() -> None:
    """The first runtime on a device asks for the device's call order while ``get_runtime``
    holds the registry's lock: the two must not share a non-reentrant lock (that hung
    the first collective op of a process that had run no chain before)."""
    import types

    done: list[Any] = []
    fake_props = types.SimpleNamespace(multi_processor_count=132)
    with mock.patch.object(torch.cuda, "get_device_properties", lambda d: fake_props), \
            mock.patch.object(torch.cuda, "Stream", lambda **kw: object()), \
            mock.patch.object(rtmod, "group_key", lambda g: ((0,), 0)), \
            mock.patch.dict(rtmod._orders, clear=True), mock.patch.dict(rtmod._runtimes, clear=True), \
            mock.patch.dict(rtmod._by_group, clear=True):
        t = threading.Thread(target=lambda: done.append(rtmod.get_runtime(object(), torch.device("cuda", 7))),
                             daemon=True)
        t.start()
        t.join(timeout=10)
        assert done and done[0].order is rtmod._orders[7], "get_runtime did not return (lock held twice)"


def test_sm_margin_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """OVERLAP_SM_MARGIN: the SMs every op leaves free for other NCCL traffic where a
    config sets none (the rule of docs/guarantees.md, "Other NCCL traffic")."""
    monkeypatch.delenv("OVERLAP_SM_MARGIN", raising=False)
    assert (OverlapConfig().margin("p2p"), OverlapConfig().margin("nccl")) == (0, 4)
    monkeypatch.setenv("OVERLAP_SM_MARGIN", "24")
    assert (OverlapConfig().margin("p2p"), OverlapConfig().margin("nccl")) == (24, 24)
    assert OverlapConfig(sm_margin=2).margin("p2p") == 2
    for bad in ("-1", "many"):
        monkeypatch.setenv("OVERLAP_SM_MARGIN", bad)
        with pytest.raises(ValueError, match="OVERLAP_SM_MARGIN"):
            OverlapConfig().margin("p2p")


def test_post_sig_refreshes_idle_chunk_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer-copy sender writes its signature word of the call's parity every call, and once
    per ``REFRESH_EVERY`` calls also sets every chunk flag of its region to the previous
    epoch, so no flag is left alone for 2**31 calls (where it would compare as ahead)."""
    writes: list[tuple[int, int]] = []
    monkeypatch.setattr(fl, "stream_write_value", lambda s, f, i, v: writes.append((i, v)))
    rtmod.post_sig("cur", [(object(), 512)], 5, 512, 77)
    assert writes == [(512 + 512 - 1 - 1, 77)]
    for e in (rtmod.REFRESH_EVERY * 3, 2**32):  # also at the wrap: epoch 0
        writes.clear()
        rtmod.post_sig("cur", [(object(), 16)], fl.wrap32(e), 8, 9)
        assert writes[0] == (16 + 8 - 1 - (e & 1), 9)
        assert sorted(writes[1:]) == [(16 + i, fl.wrap32(e - 1)) for i in range(6)]
    writes.clear()
    rtmod.post_sig("cur", [(object(), 0)], rtmod.REFRESH_EVERY + 1, 8, 9)
    assert len(writes) == 1


def test_dependent_launch_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ChainConfig.launch`` takes 'streams' or 'pdl' only, and the chain's GEMMs no
    flattened config; a tile GEMM asked for a programmatic dependent launch where it is not
    taken (no GPU, or faked so) refuses with a clear error before launching anything."""
    from overlap.kernels import tile_gemm as tg
    from overlap.kernels.tile_gemm import DEFAULT_CONFIG, GemmConfig, launch_tile_gemm, pdl_supported
    from overlap.policies import Segment, build_tile_table

    assert ChainConfig(launch="pdl").launch == "pdl" and ChainConfig().launch == "streams"
    with pytest.raises(ValueError, match="launch must be"):
        ChainConfig(launch="graph")
    with pytest.raises(ValueError, match="flatten"):
        ChainConfig(consumer=replace(DEFAULT_CONFIG, flatten=True))
    if not torch.cuda.is_available():
        assert not pdl_supported()
    monkeypatch.setattr(tg, "pdl_supported", lambda device=None: False)
    a, w, c = torch.zeros(32, 32).half(), torch.zeros(32, 32).half(), torch.zeros(32, 32).half()
    tab = torch.tensor(build_tile_table([Segment(0, 0, 0, 32)], 32, 16, 16), dtype=torch.int32)
    small = GemmConfig(block_m=16, block_n=16, block_k=16, num_stages=1, num_warps=4)
    for kw in (dict(pdl_trigger=True), dict(pdl_dependent=True)):
        with pytest.raises(ValueError, match="programmatic dependent launch"):
            launch_tile_gemm(a, w.t(), c, tab, grid=1, config=small, **kw)
        with pytest.raises(ValueError, match="programmatic dependent launch"):
            launch_tile_gemm(a, w.t(), c, tab, grid=1, config=replace(DEFAULT_CONFIG, flatten=True), **kw)
