"""A refusal at a signature the peers agreed before (``overlap.ops._refusal``): the record
word, its decoding into ``PeerRefusedError``, the senders' regions against the ops'
layouts, the refusing rank's decision and the peers' check before an exchange (an
in-process store), and the whole protocol at 2 and 4 ranks on gloo (_refusal_worker.py)."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
import torch.distributed as tdist

from overlap import flags as F
from overlap import protocol as P
from overlap.ops import _agree, _refusal
from overlap.ops._runtime import call_sig
from tests._procs import REPO, run_ranks


def test_record_word() -> None:
    for rank in (0, 1, 7, 1023):
        for calls in (0, 1, 65535, 65536 + 9, 2 ** 40 + 3):
            for kind in P.REFUSAL_KINDS:
                w = P.refusal_word(rank, calls, kind)
                assert 0 < w < 2 ** 31 and w % 2 == 0, w
                assert P.read_refusal(w) == (rank, calls & 0xFFFF, kind)
                assert P.read_refusal(F.wrap32(w)) == (rank, calls & 0xFFFF, kind)
    assert P.read_refusal(P.refusal_word(2, 5, "KeyError"))[2] == "an error"
    with pytest.raises(ValueError, match="rank 1024"):
        P.refusal_word(1024, 0, "ValueError")
    # a signature (always odd) and the flags' first value are never a record
    assert P.read_refusal(0) is None
    for i in range(2000):
        assert P.read_refusal(call_sig("all_gather_matmul", (i, 64, 3))) is None


class _Step:
    """A group's step as ``_agree`` keeps it, for the hook to find by the group's ranks."""

    def __init__(self, ranks: tuple[int, ...], rank: int) -> None:
        self.st = _agree.GroupStep(ranks, rank)
        self.key = object()

    def __enter__(self) -> _agree.GroupStep:
        _agree._steps[id(self.key)] = (self.key, self.st)
        return self.st

    def __exit__(self, *exc: object) -> None:
        del _agree._steps[id(self.key)]


def _board(st: _agree.GroupStep, store: object, rank: int | None = None) -> _refusal.Board:
    return _refusal.Board(store, st.ranks, st.rank if rank is None else rank)


def test_error_word_raises_peer_refused_and_ends_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = (10, 11, 12)
    store = tdist.HashStore()
    with _Step(ranks, 0) as st:
        st.board = _board(st, store)
        monkeypatch.setattr(_refusal, "board_of", lambda s, g: s.board)
        er = _refusal.era(ranks)
        _board(st, store, rank=2).post_refusal(er, 70001, "band", "ValueError: x must be 2-D, got 1-D")
        err = F.ErrorWord("cpu", what="all_gather_matmul (rank 0)")
        err.ranks = ranks
        sig = call_sig("all_gather_matmul", (4, 8, 6))
        rec = P.refusal_word(2, 70001, "ValueError")
        err.word[:6] = torch.tensor([P.ERR_DISAGREE, 0, 510, sig, rec, 3], dtype=torch.int32)
        with pytest.raises(F.PeerRefusedError) as ei:
            err.check()
        e = ei.value
        assert isinstance(e, F.RanksRefusedError) and isinstance(e, ValueError)
        assert isinstance(e, F.RanksDisagreeError)  # what a peer-copy op's callers catch today
        assert (e.refuser, e.calls, e.kind) == (2, 70001 & 0xFFFF, "ValueError")
        msg = str(e)
        for s in ("group rank 2 refused", "call 70001: ValueError: x must be 2-D", "overlap.reset(group)"):
            assert s in msg, (s, msg)
        assert st.broken is not None and "group rank 2" in st.broken and "x must be 2-D" in st.broken
        err.check()  # reported once: the word is clear
        # a signature that differs (not a record) stays RanksDisagreeError and ends nothing
        st.broken = None
        err.word[:6] = torch.tensor([P.ERR_DISAGREE, 0, 510, sig, sig ^ 2, 3], dtype=torch.int32)
        with pytest.raises(F.RanksDisagreeError) as ei:
            err.check()
        assert not isinstance(ei.value, F.PeerRefusedError) and st.broken is None
        # a word of no group (a local runtime's): the error still names the rank and kind
        err2 = F.ErrorWord("cpu", what="chain")
        err2.word[:6] = torch.tensor([P.ERR_DISAGREE, 0, 510, sig, rec, 3], dtype=torch.int32)
        with pytest.raises(F.PeerRefusedError, match="group rank 2 refused.*ValueError"):
            err2.check()
        assert st.broken is None


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_sender_regions_match_the_ops_layouts(world: int) -> None:
    from overlap._p2p import flag_stride
    from overlap.ops.all_reduce_p2p import _two_shot_layout
    from overlap.ops.matmul_reduce_p2p import push_layout
    from overlap.policies import all_gather_push_layout

    stride = flag_stride(world)
    for me in range(world):
        lay = all_gather_push_layout(world, me, 512, 3, 128, flag_stride=stride)
        waits = [(s.a_row // 512, s.wait_idx, s.wait_mult) for s in lay.segments if s.a_src == 1]
        assert waits
        for sender, idx, mult in waits:
            assert mult == 1 and idx // stride == _refusal.sender_region("all_gather_matmul", sender, me, world)
            assert idx % stride < stride - 2  # a chunk flag, not a signature word
        two = _two_shot_layout(world, me, 1024 * world, 2)
        pl = push_layout(world, me, 256 * world, 3, scatter=True)
        for sender in range(world):
            if sender == me:
                continue
            for c in range(2):
                for idx in (two.rs_flag(sender, me, c), two.ag_flag(sender, me, c)):
                    assert idx // stride == _refusal.sender_region("all_reduce_matmul", sender, me, world)
                    assert idx % stride < stride - 2
            for op in ("matmul_reduce_scatter", "matmul_all_reduce"):
                for c in range(3):
                    assert pl.recv_flag(sender, c) // stride == _refusal.sender_region(op, sender, me, world)


def test_every_shared_flag_region_is_known() -> None:
    """Every name the ops ask the peer heap's flags for has its senders' regions in
    ``SENDER_REGIONS`` (a new op must say where its senders write, or a refusal skips it)."""
    names: set[str] = set()
    for path in (REPO / "overlap" / "ops").glob("*.py"):
        names |= set(re.findall(r'heap\.flags\("([^"]+)"', path.read_text()))
        if re.search(r"heap\.flags\(op\b", path.read_text()):
            names |= {"matmul_reduce_scatter", "matmul_all_reduce"}
    assert names and names <= set(_refusal.SENDER_REGIONS), names - set(_refusal.SENDER_REGIONS)


def _later(delay: float, fn: object) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        fn()  # type: ignore[operator]
    t = threading.Thread(target=run)
    t.start()
    return t


def test_decide() -> None:
    ranks = (0, 1, 2)
    store = tdist.HashStore()
    me = _refusal.Board(store, ranks, 1)
    peers = {r: _refusal.Board(store, ranks, r) for r in (0, 2)}
    er = _refusal.era(ranks)
    # the peers reach this call's exchange (one at once, one later): the exchange
    peers[0].post_exchange(er, 5)
    t = _later(0.05, lambda: peers[2].post_exchange(er, 5))
    assert _refusal.decide(me, er, 5, None, 5.0) == "exchange"
    t.join()
    # keys of another call or era, and no push: nothing within the bound
    t0 = time.monotonic()
    assert _refusal.decide(me, er, 6, None, 0.2) == "late"
    assert _refusal.decide(me, er + 1, 5, None, 0.2) == "late"
    assert time.monotonic() - t0 < 2.0
    # a peer's push of this call landed: in band, at once
    pushed = threading.Event()
    t = _later(0.05, pushed.set)
    t0 = time.monotonic()
    assert _refusal.decide(me, er, 7, pushed.is_set, 5.0) == "band"
    assert time.monotonic() - t0 < 2.0
    t.join()
    # two ranks refusing the same call, the third in the exchange: both exchange
    peers[0].post_refusal(er, 8, "pending", "ValueError: a")
    peers[2].post_exchange(er, 8)
    assert _refusal.decide(me, er, 8, None, 5.0) == "exchange"
    # another rank refused this call in band: in band too, whatever the others do
    peers[0].post_refusal(er, 9, "band", "ValueError: a")
    peers[2].post_exchange(er, 9)
    assert _refusal.decide(me, er, 9, None, 5.0) == "band"


def test_before_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    ranks = (20, 21, 22)
    store = tdist.HashStore()
    monkeypatch.setattr(_refusal, "board_of", lambda s, g: s.board)
    monkeypatch.setenv("OVERLAP_WAIT_TIMEOUT_MS", "3000")
    st = _agree.GroupStep(ranks, 0)
    st.board = _refusal.Board(store, ranks, 0)
    r2 = _refusal.Board(store, ranks, 2)
    er = _refusal.era(ranks)
    st.calls = 4
    _refusal.before_exchange(st, None, "toy")  # no refusal posted: P only
    assert st.board.exchanging(0, er, 4) and st.broken is None
    # a refusal of an earlier era (before a reset) ends nothing
    r2.post_refusal(er - 1, 4, "band", "ValueError: old")
    _refusal.before_exchange(st, None, "toy")
    assert st.broken is None
    # a peer deciding this very call: waited for; it joins the exchange
    st.calls = 5
    r2.post_refusal(er, 5, "pending", "ValueError: bad")
    t = _later(0.2, lambda: r2.post_refusal(er, 5, "exchange", "ValueError: bad"))
    t0 = time.monotonic()
    _refusal.before_exchange(st, None, "toy")
    assert 0.15 < time.monotonic() - t0 < 2.0 and st.broken is None
    t.join()
    # ... or it went in band: the group ends here with its rank and message
    st.calls = 6
    r2.post_refusal(er, 6, "pending", "TypeError: a is float16, b is bfloat16")
    t = _later(0.1, lambda: r2.post_refusal(er, 6, "band", "TypeError: a is float16, b is bfloat16"))
    with pytest.raises(_agree.RanksRefusedError, match=r"toy: group rank 0: group rank 2 refused call 6 .*"
                                                        r"a is float16.*overlap.reset"):
        _refusal.before_exchange(st, None, "toy")
    t.join()
    assert st.broken is not None and "group rank 2" in st.broken
    # a refusal of an earlier call left in band ("late"): ends the group at the next exchange
    st.broken, st.calls = None, 9
    with pytest.raises(_agree.RanksRefusedError, match="group rank 2 refused call 6"):
        _refusal.before_exchange(st, None, "toy")
    # after a reset (a new era), it ends nothing
    _refusal.next_era(ranks)
    st.broken, st.calls = None, 1
    _refusal.before_exchange(st, None, "toy")
    assert st.broken is None


@pytest.mark.parametrize("world_size", [2, 4])
def test_refusal_gloo(world_size: int) -> None:
    procs = run_ranks(REPO / "tests" / "_refusal_worker.py", world_size, timeout_s=240)
    for p in procs:
        assert p.returncode == 0 and f"PASS refusal rank={p.rank}" in p.out, p


def test_a_store_that_fails_leaves_the_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the job's store cannot be reached, a refusal takes the exchange (as before this
    way existed) and an exchange goes on: no error of the store's ends a call."""
    from types import SimpleNamespace

    class Gone:
        def __getattr__(self, name: str) -> object:
            def fail(*a: object, **kw: object) -> None:
                raise RuntimeError("store: connection reset")
            return fail

    ranks = (30, 31)
    st = _agree.GroupStep(ranks, 0)
    st.board = _refusal.Board(Gone(), ranks, 0)
    monkeypatch.setattr(_refusal, "board_of", lambda s, g: s.board)
    st.calls = 3
    _refusal.before_exchange(st, None, "toy")
    assert st.broken is None
    cs = SimpleNamespace(step=st, group=None, op="toy")
    assert _refusal.refuse_in_band(cs, ValueError("toy: bad")) is False  # type: ignore[arg-type]
    assert st.broken is None


def test_a_thread_refusal_takes_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call refused because another thread's call was in flight (found at the agreement
    point) goes the same way as a check's refusal: in band where the peers are moving data,
    with no exchange posted."""
    from types import SimpleNamespace

    st = _agree.GroupStep((40, 41), 0)
    cs = SimpleNamespace(step=st, contended="toy: called while a call of toy was in flight in another thread",
                         untracked=False, group=None, op="toy")
    monkeypatch.setattr(_agree._tls, "cur", cs, raising=False)
    seen: list[BaseException] = []
    monkeypatch.setattr(_refusal, "refuse_in_band", lambda c, e: seen.append(e) or True)

    def exchanged(*a: object) -> None:
        raise AssertionError("an exchange was posted")
    monkeypatch.setattr(_agree, "_exchange", exchanged)
    agreed = {("toy", (4,)): True}
    with pytest.raises(ValueError, match="in flight in another thread"):
        _agree.agreement(None, 2, torch.device("cpu"), "toy", ("M",), (4,), agreed=agreed, key=("toy", (4,)),
                         then_collective=False)
    assert len(seen) == 1 and st.calls == 1


def test_write_in_band_order_and_words(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusing rank's writes (GPU streams stood in for): per op of ``SENDER_REGIONS``
    that ran, after that op's previous call here, in each peer's flags: the signature word
    of the op's next call's parity first, then every chunk flag of its region at that
    call's epoch; an op of no known region is not written."""
    from types import SimpleNamespace

    from overlap._p2p import flag_stride

    log: list[tuple] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_event(self, ev: object) -> None:
            log.append(("wait", self.name, ev))

    class Event:
        def record(self, s: object = None) -> None:
            pass

        def query(self) -> bool:
            return True

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("cur"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(F, "stream_write_value", lambda s, flags, idx, v: log.append(("w", s.name, flags, idx, v)))
    world, me = 3, 1
    sfs = {name: SimpleNamespace(epoch=ep, peer=lambda q, name=name: f"{name}@{q}")
           for name, ep in (("all_gather_matmul", 6), ("all_reduce_matmul", 2 ** 32 - 1), ("mystery", 3))}
    comm = Stream("comm")
    order = SimpleNamespace(lock=threading.RLock(), begin=lambda s: log.append(("begin",)),
                            end=lambda s: log.append(("end",)))
    rt = SimpleNamespace(_heap=SimpleNamespace(_flags=sfs), world=world, rank=me, device="cpu", comm_stream=comm,
                         order=order, _p2p_done={"all_gather_matmul": ("agmm-done", None)},
                         fork=lambda cur, *s: log.append(("fork",)), join=lambda cur, *s: log.append(("join",)))
    word = P.refusal_word(me, 77, "ValueError")
    assert _refusal.write_in_band(rt, word, 1.0) == ["all_gather_matmul", "all_reduce_matmul"]
    stride = flag_stride(world)
    assert log[:2] == [("begin",), ("fork",)] and log[-2:] == [("join",), ("end",)]
    assert log[2] == ("wait", "comm", "agmm-done")  # after the op's previous call here
    writes = [e for e in log if e[0] == "w"]
    assert all(e[1] == "comm" for e in writes)
    assert not any("mystery" in e[2] for e in writes)
    for name, sf in sfs.items():
        if name == "mystery":
            continue
        epoch = F.wrap32(sf.epoch + 1)
        for q in (0, 2):
            mine = [e for e in writes if e[2] == f"{name}@{q}"]
            base = _refusal.sender_region(name, me, q, world) * stride
            assert mine[0][3:] == (base + stride - 1 - (epoch & 1), word), (name, q, mine[0])  # the record first
            assert [e[3] for e in mine[1:]] == list(range(base, base + stride - 2))
            assert all(e[4] == epoch for e in mine[1:])


@pytest.mark.parametrize("epoch0", [5, 2 ** 31 - 1, 2 ** 32 - 1])
def test_moving_probe(monkeypatch: pytest.MonkeyPatch, epoch0: int) -> None:
    """A peer's push of the op's next call landed: a chunk flag of a peer's region at that
    call's epoch (compared across the wrap); not an earlier epoch, not this rank's own
    region, not a signature word; no probe for an op that never ran on the peer-copy path."""
    import contextlib
    from types import SimpleNamespace

    from overlap._p2p import flag_stride

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    world, me = 3, 1
    stride = flag_stride(world)
    local = torch.zeros(1024, dtype=torch.int32)
    sf = SimpleNamespace(epoch=epoch0, local=local)
    rt = SimpleNamespace(_heap=SimpleNamespace(_flags={"all_gather_matmul": sf}), world=world, rank=me, device="cpu")
    assert _refusal._moving_probe(rt, "all_reduce_matmul") is None
    assert _refusal._moving_probe(SimpleNamespace(_heap=None), "all_gather_matmul") is None
    moving = _refusal._moving_probe(rt, "all_gather_matmul")
    e = F.wrap32(epoch0 + 1)
    local.fill_(F.wrap32(epoch0))  # every flag at this call's epoch - 1: nobody moving
    assert not moving()
    local[me * stride + 3] = e  # this rank's own region
    local[2 * stride + stride - 1] = e  # a peer's signature word
    assert not moving()
    local[2 * stride + 7] = e  # peer 2's chunk 7
    assert moving()
    local[2 * stride + 7] = F.wrap32(epoch0)
    local[0 * stride + 0] = e
    assert moving()


def test_block_boundary_in_shared_gpu_mode_refuses_like_matmul_all_reduce(monkeypatch) -> None:  # noqa: ANN001
    """In shared-GPU mode matmul_all_reduce_matmul runs matmul_all_reduce on the peer-copy
    transport: a rank refusing it makes the peer-memory check the peers make first, and
    probes matmul_all_reduce's flags for the peers' pushes; on the NCCL transport neither."""
    import types

    from overlap.ops import _agree, _refusal
    from overlap.ops import _runtime as rtm

    class FakeRt:
        def __init__(self, shared: bool) -> None:
            self.shared_gpu, self.world, self._p2p_why, self.opened = shared, 2, None, 0

        def p2p(self) -> None:
            self.opened += 1

    monkeypatch.setattr(_agree, "_tile_flag_input", lambda x: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(rtm, "get_runtime_if_made", lambda *a: None)
    for op, shared, opened in (("matmul_all_reduce_matmul", False, 0), ("matmul_all_reduce_matmul", True, 1),
                               ("all_gather_matmul", False, 1)):
        rt = FakeRt(shared)
        monkeypatch.setattr(rtm, "get_runtime", lambda *a, rt=rt: rt)
        _agree._mirror_first_collectives(types.SimpleNamespace(mirror=object(), group=None, op=op))
        assert rt.opened == opened, (op, shared)
        want = "matmul_all_reduce" if shared and op == "matmul_all_reduce_matmul" else op
        assert _refusal._data_op(rt, op) == want, (op, shared)


def test_a_store_failing_midway_leaves_the_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that fails after the first reads (a refusal was posted on the group before):
    the exchange still goes on on both sides, no store error ends a call."""
    from types import SimpleNamespace

    def fail(*a: object, **kw: object) -> None:
        raise RuntimeError("store: connection reset")

    st = _agree.GroupStep((50, 51), 0)
    st.calls = 5
    st.board = SimpleNamespace(post_exchange=lambda *a: None, any_refused=lambda: True, refusal=fail)
    monkeypatch.setattr(_refusal, "board_of", lambda s, g: s.board)
    monkeypatch.setattr(_refusal, "_bound_s", lambda g: 1.0)
    _refusal.before_exchange(st, None, "toy")  # the peer's record cannot be read: the exchange
    assert st.broken is None

    posted: list[str] = []

    def post_refusal(er: object, calls: int, state: str, why: str) -> None:
        posted.append(state)
        if state == "exchange":
            fail()
    st.board = SimpleNamespace(post_refusal=post_refusal)
    monkeypatch.setattr(_refusal, "_runtime_of", lambda ranks: None)
    monkeypatch.setattr(_refusal, "decide", lambda *a: "exchange")
    cs = SimpleNamespace(step=st, group=None, op="toy")
    assert _refusal.refuse_in_band(cs, ValueError("toy: bad")) is False  # type: ignore[arg-type]
    assert posted == ["pending", "exchange"] and st.broken is None


def test_a_call_plans_agreement_point_in_one_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    """``check_agreed`` (a call plan's agreement point) takes ``_agree.agreed_before`` for a
    key agreed before: the call counted, on its thread too, the key marked used, the call
    untracked at more than one rank, no exchange. Anything else goes to ``agreement`` as
    before: a key not agreed yet (an exchange), a contended call (refused), extra values
    to exchange, every call checked."""
    from types import SimpleNamespace

    from overlap.ops import _sigs
    from overlap.ops._state import LRU

    st = _agree.GroupStep((40, 41), 0)
    cs = SimpleNamespace(step=st, contended=None, untracked=False, group=None, op="toy")
    monkeypatch.setattr(_agree._tls, "cur", cs, raising=False)
    monkeypatch.setattr(_sigs, "_EVERY_CALL", [False])
    posted: list[tuple] = []
    monkeypatch.setattr(_agree, "_exchange", lambda st_, g, w, d, op, names, values, refusal: posted.append(values))
    agreed = LRU(8)
    key, other = ("toy", ("M",), (4,)), ("toy", ("M",), (8,))
    agreed.add(key)
    agreed.add(other)
    rt = SimpleNamespace(_caches={"agreed": agreed}, world=2, group=None, device=torch.device("cpu"),
                         cache=lambda name, cap: agreed)
    took: list[bool] = []
    fast = _agree.agreed_before
    monkeypatch.setattr(_agree, "agreed_before", lambda *a: took.append(fast(*a)) or took[-1])
    slow = _agree.agreement
    monkeypatch.setattr(_agree, "agreement", lambda *a, **k: took.append("full") or slow(*a, **k))
    _sigs.check_agreed(rt, "toy", ("M",), (4,), key)
    assert took == [True], "a key agreed before did not take the one-frame path"
    assert posted == [] and st.calls == 1 and sum(st.by_thread.values()) == 1 and cs.untracked
    assert list(agreed) == [other, key], "the key was not marked used"
    # one rank: counted and marked, not untracked (no peer moves data the host does not follow)
    cs.untracked = False
    rt.world = 1
    _sigs.check_agreed(rt, "toy", ("M",), (4,), key)
    assert took == [True, True] and st.calls == 2 and not cs.untracked
    rt.world = 2
    # before the first call has read OVERLAP_CHECK_RANKS: the full agreement (which reads it)
    monkeypatch.setattr(_sigs, "_EVERY_CALL", [])
    _sigs.check_agreed(rt, "toy", ("M",), (4,), key)
    assert took[-1] == "full" and posted == [] and st.calls == 3 and _sigs._EVERY_CALL == [False]
    # no call in flight in this thread: nothing done here, the full agreement decides
    monkeypatch.setattr(_agree._tls, "cur", None)
    assert fast(agreed, 2, key) is False and st.calls == 3
    monkeypatch.setattr(_agree._tls, "cur", cs)
    st.calls = 1
    st.by_thread.clear()
    st.by_thread[_agree._thread_code()] = 1
    # a key not agreed yet: the exchange, and the key agreed from then on
    new = ("toy", ("M",), (16,))
    _sigs.check_agreed(rt, "toy", ("M",), (16,), new)
    assert posted == [(16,)] and st.calls == 2 and new in agreed
    # every call checked: an exchange for a key agreed before too
    monkeypatch.setattr(_sigs, "_EVERY_CALL", [True])
    _sigs.check_agreed(rt, "toy", ("M",), (4,), key)
    assert posted == [(16,), (4,)] and st.calls == 3
    monkeypatch.setattr(_sigs, "_EVERY_CALL", [False])
    # extra values to exchange (a wrapper's): the exchange carries them
    monkeypatch.setattr(_agree._tls, "extra", (("world",), (2,)), raising=False)
    _sigs.check_agreed(rt, "toy", ("M",), (4,), key)
    assert posted[-1] == (4, 2) and st.calls == 4
    # a contended call: refused (in band here), not passed as agreed
    cs.contended = "toy: called while a call of toy was in flight in another thread"
    monkeypatch.setattr(_refusal, "refuse_in_band", lambda c, e: True)
    with pytest.raises(ValueError, match="in flight in another thread"):
        _sigs.check_agreed(rt, "toy", ("M",), (4,), key)
    assert st.calls == 5
