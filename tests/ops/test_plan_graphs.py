"""Plan graphs (``overlap.ops._graphs``) on the CPU: a stand-in for ``torch.cuda`` whose
graph records the work queued during its capture and reruns it on replay, reading the
static inputs and the fixed inputs in place and writing the same outputs, as a CUDA graph
does. The GPU run of the same is ``tests/gpu/plan_graphs_check.py``."""

from __future__ import annotations

import contextlib
import threading
import warnings
from types import SimpleNamespace

import pytest
import torch

from overlap.ops import _graphs, _state


class _Graph:
    capturing: "_Graph | None" = None

    def __init__(self) -> None:
        self.work: list = []
        self.resets = 0

    def capture_begin(self, capture_error_mode: str = "global") -> None:
        assert capture_error_mode == "thread_local"
        _Graph.capturing = self

    def capture_end(self) -> None:
        _Graph.capturing = None

    def replay(self) -> None:
        for w in self.work:
            w()

    def reset(self) -> None:
        self.resets += 1


def _queue(fn) -> None:  # noqa: ANN001
    """Run ``fn`` now, or record it in the graph being captured (a capture runs nothing)."""
    if _Graph.capturing is not None:
        _Graph.capturing.work.append(fn)
    else:
        fn()


class _Event:
    done = True

    def record(self, stream) -> None:  # noqa: ANN001
        self.stream = stream

    def query(self) -> bool:
        return _Event.done


class _Cuda:
    CUDAGraph = _Graph
    Event = _Event

    def __init__(self) -> None:
        self.syncs = 0

    @staticmethod
    def device(dev):  # noqa: ANN001, ANN205
        return contextlib.nullcontext()

    @staticmethod
    def stream(s):  # noqa: ANN001, ANN205
        return contextlib.nullcontext()

    @staticmethod
    def Stream(dev):  # noqa: ANN001, ANN205, N802
        return _Stream()

    def synchronize(self, dev=None) -> None:  # noqa: ANN001
        self.syncs += 1

    @staticmethod
    def current_device() -> None:  # the stand-in runtime's device is the CPU: index None
        return None


class _Stream:
    cuda_stream = 7

    def wait_stream(self, other) -> None:  # noqa: ANN001
        pass


class _Order:
    def __init__(self, log: list) -> None:
        self.lock = threading.RLock()
        self.log = log

    def begin(self, cur) -> None:  # noqa: ANN001
        self.log.append("begin")

    def end(self, cur) -> None:  # noqa: ANN001
        self.log.append("end")


class _Body:
    """A bound body whose fused body is C = A @ B (+ residual), its work queued as a graph
    would capture it; ``moving`` the rows and the residual."""

    moving = (0, 2)

    def __init__(self, flops: int = 1 << 20, fail: Exception | None = None, alias: bool = False,
                 words: int = 0) -> None:
        self.flops, self.fail, self.alias, self.words = flops, fail, alias, words
        self.err, self.check = "err-word", "async"
        self.fused_calls = 0

    def fused(self, a: torch.Tensor, b: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        self.fused_calls += 1
        if self.fail is not None:
            raise self.fail
        for i in range(self.words):  # what a fused body keeps for a capture: its words, its plans
            _state.LocalWords(torch.device("cpu")).get(f"w{i}", 1, 4)
            _state.keep_for_capture(("a plan", i))
        if self.alias:
            return a[:1]
        c = torch.empty(a.shape[0], b.shape[1])
        _queue(lambda: torch.mm(a, b, out=c) if residual is None else torch.addmm(residual, a, b, out=c))
        return c


@pytest.fixture
def fake(monkeypatch):  # noqa: ANN001, ANN201
    """The stand-in runtime, call plan and reports; ``log`` the order of what a call did."""
    log: list = []
    cuda = _Cuda()
    monkeypatch.setattr(_graphs, "_cuda", cuda)
    monkeypatch.setattr(_graphs, "check_agreed", lambda rt, op, names, values, key: log.append("agreed"))
    monkeypatch.setattr(_graphs, "report_eager", lambda err, check: log.append(("report", err, check)))
    monkeypatch.setattr(_graphs._observe, "record_call", lambda *a: log.append("recorded"))
    monkeypatch.setattr(_state, "capturing", lambda: _Graph.capturing is not None)
    monkeypatch.delenv("OVERLAP_PLAN_GRAPHS", raising=False)
    for k in _graphs.stats:
        monkeypatch.setitem(_graphs.stats, k, 0)
    stream = _Stream()
    rt = SimpleNamespace(order=_Order(log), current_stream=lambda: stream, device=torch.device("cpu"), seen=set(),
                         _caches={})
    cp = SimpleNamespace(op="test_op", names=(), values=(), key=(), shape=(8, 8, 8), path="nccl", why="test",
                         sig=("sig",), transport="nccl")
    return SimpleNamespace(rt=rt, cp=cp, log=log, cuda=cuda)


def _call(f, body, a, b, r=None):  # noqa: ANN001, ANN202
    return _graphs.replay_or_capture(f.rt, f.cp, body, (a, b, r))


def test_captured_at_the_nth_call_then_replayed_with_new_inputs(fake) -> None:  # noqa: ANN001
    """Calls before ``CAPTURE_AT`` run as before; the ``CAPTURE_AT``-th captures and replays;
    every replay reads this call's inputs (new every call: a stale read fails) and the
    weight in place, and returns a new tensor (a later replay leaves it unchanged)."""
    body = _Body()
    b = torch.randn(8, 4)
    for _ in range(_graphs.CAPTURE_AT - 1):
        assert _call(fake, body, torch.randn(6, 8), b, torch.randn(6, 4)) is _graphs.NO
    assert body.fused_calls == 0 and _graphs.stats["captured"] == 0
    outs = []
    for i in range(5):
        a, r = torch.randn(6, 8), torch.randn(6, 4)
        got = _call(fake, body, a, b, r)
        assert got is not _graphs.NO
        torch.testing.assert_close(got, torch.addmm(r, a, b))
        outs.append((got, got.clone()))
    for got, was in outs:
        assert torch.equal(got, was), "a later replay changed an earlier output"
    assert len({o.data_ptr() for o, _ in outs}) == len(outs)
    assert body.fused_calls == 1 and _graphs.stats["captured"] == 1 and _graphs.stats["replayed"] == 5
    b.mul_(2)  # the weight changed in place (an optimizer step): read in place
    a, r = torch.randn(6, 8), torch.randn(6, 4)
    torch.testing.assert_close(_call(fake, body, a, b, r), torch.addmm(r, a, b))
    assert fake.rt.seen == {("test_op", ("sig",))}
    assert "PlanGraph(moving inputs [0, 2]" in repr(body.gstate.graph)
    # no residual where the graph read one (another call key in the ops): not from this graph
    assert _call(fake, body, torch.randn(6, 8), b) is _graphs.NO and body.gstate.graph is None


def test_a_replay_in_the_order_of_a_call(fake) -> None:  # noqa: ANN001
    """A replay: the agreement point, the call counted, the device order begun, the graph,
    the order ended, then the error word reported as the body's check says; an exception
    in the replay still ends the order."""
    body = _Body()
    b = torch.randn(8, 4)
    for _ in range(_graphs.CAPTURE_AT):
        _call(fake, body, torch.randn(6, 8), b)
    del fake.log[:]
    _call(fake, body, torch.randn(6, 8), b)
    assert fake.log == ["agreed", "recorded", "begin", "end", ("report", "err-word", "async")], fake.log
    del fake.log[:]

    def boom() -> None:
        raise RuntimeError("replay failed")

    body.gstate.graph.graph.replay = boom
    with pytest.raises(RuntimeError, match="replay failed"):
        _call(fake, body, torch.randn(6, 8), b)
    assert fake.log == ["agreed", "recorded", "begin", "end"], fake.log


def test_each_layers_weights_keep_a_graph_of_their_own(fake) -> None:  # noqa: ANN001
    """Layers of one shape share a signature, each with its own weight: each weight, once it
    has come in ``CAPTURE_AT`` calls, gets a graph of its own, kept while the others run;
    every call replays the graph of its own weight (new rows every call: a graph of
    another layer's weight, or a stale read, fails the check)."""
    body = _Body()
    ws = [torch.randn(8, 4) for _ in range(3)]
    for step in range(_graphs.CAPTURE_AT + 3):
        for layer, w in enumerate(ws):
            a = torch.randn(6, 8)
            got = _call(fake, body, a, w)
            if step < _graphs.CAPTURE_AT - 1:
                assert got is _graphs.NO, (step, layer)
            else:
                torch.testing.assert_close(got, a @ w)
    assert body.fused_calls == 3 and _graphs.stats["captured"] == 3 and _graphs.stats["dropped"] == 0
    assert _graphs.stats["replayed"] == 3 * 4 and len(body.gstate.parked) == 2
    ws[1].mul_(2)  # a weight changed in place (an optimizer step): read in place by its graph
    for w in ws:
        a = torch.randn(6, 8)
        torch.testing.assert_close(_call(fake, body, a, w), a @ w)
    assert body.fused_calls == 3


def test_a_graph_holds_no_weight_and_a_failed_capture_drops_the_others(fake) -> None:  # noqa: ANN001
    """A graph reads its weights in place: its statics hold the moving inputs' copies only
    (a parked graph's statics keep no old model's weights alive); a capture that fails
    turns the signature off and drops the graphs of its other weights too (never replayed
    again)."""
    body = _Body()
    w0, w1 = torch.randn(8, 4), torch.randn(8, 4)
    for w in (w0, w1):
        for _ in range(_graphs.CAPTURE_AT):
            _call(fake, body, torch.randn(6, 8), w)
    assert body.fused_calls == 2 and len(body.gstate.parked) == 1
    for g in [body.gstate.graph] + [v[0] for v in body.gstate.parked.values()]:
        assert [x is None for x in g.statics] == [False, True, True], g.statics  # only the moving rows
    body.fail = LookupError("cannot capture")  # (a type of its own: the warning keyed by it)
    w2 = torch.randn(8, 4)
    for _ in range(_graphs.CAPTURE_AT):  # (warned once per process: "could not be captured")
        assert _call(fake, body, torch.randn(6, 8), w2) is _graphs.NO
    st = body.gstate
    assert st.off and st.graph is None and not st.parked and _graphs.stats["refused"] == 1
    assert _graphs.stats["dropped"] == 2
    assert _call(fake, body, torch.randn(6, 8), w1) is _graphs.NO  # its graph went with the rest


def test_moving_weights_make_room_then_are_never_captured(fake, monkeypatch) -> None:  # noqa: ANN001
    """Weights that do not come back: the signature's graphs fill up (a new weight then
    runs as before), a graph not replayed in ``STALE_CALLS`` calls makes room (retired, no
    wait), and after ``MAX_CAPTURES`` captures the signature is never captured again, its
    graphs retired, not freed under a replay that still runs."""
    monkeypatch.setattr(_graphs, "PER_SIGNATURE", 3)
    monkeypatch.setattr(_graphs, "STALE_CALLS", 9)
    monkeypatch.setattr(_graphs, "MAX_CAPTURES", 5)
    body = _Body()
    kept = []  # (every weight kept alive: no address comes back)

    def weight() -> torch.Tensor:
        kept.append(torch.randn(8, 4))
        return kept[-1]

    def calls(w: torch.Tensor, n: int) -> list:
        out = []
        for _ in range(n):
            a = torch.randn(6, 8)
            got = _call(fake, body, a, w)
            if got is not _graphs.NO:
                torch.testing.assert_close(got, a @ w)
            out.append(got is not _graphs.NO)
        return out

    _graphs._retired.clear()
    for _ in range(3):  # calls 1-9: three weights, three graphs: the signature's all
        assert calls(weight(), _graphs.CAPTURE_AT)[-1]
    assert len(body.gstate.parked) == 2 and body.fused_calls == 3
    w = weight()  # calls 10-12: its count is reached, but the oldest parked graph (call 3) is not stale
    assert calls(w, _graphs.CAPTURE_AT) == [False] * _graphs.CAPTURE_AT
    assert body.fused_calls == 3 and _graphs.stats["dropped"] == 0
    # calls 13-15: counted again; at 15 the graph last replayed at call 3 is stale: it makes room
    assert calls(w, _graphs.CAPTURE_AT) == [False] * (_graphs.CAPTURE_AT - 1) + [True]
    assert body.fused_calls == 4 and _graphs.stats["dropped"] == 1 and fake.cuda.syncs == 0
    assert calls(weight(), _graphs.CAPTURE_AT)[-1] and body.fused_calls == 5  # calls 16-18 (call 6's made room)
    assert _graphs.stats["dropped"] == 2
    st = body.gstate
    graphs = [g.graph for g in [st.graph] + [v[0] for v in st.parked.values()]]
    monkeypatch.setattr(_Event, "done", False)  # their last replays still run
    assert not any(calls(weight(), 3 * _graphs.CAPTURE_AT))  # a sixth capture: the signature is off
    assert st.off and body.fused_calls == 5 and not st.parked and st.graph is None
    assert len(graphs) == 3 and all(g.resets == 0 for g in graphs)  # retired, not freed under a running replay
    monkeypatch.setattr(_Event, "done", True)
    _graphs._reap()
    assert all(g.resets == 1 for g in graphs) and not _graphs._retired


def test_a_capture_that_fails_runs_the_call_and_is_not_tried_again(fake) -> None:  # noqa: ANN001
    """A body whose capture raises: the call runs as before, one warning names the op, the
    words the capture took are given back, and the signature is never captured again."""
    body = _Body(fail=RuntimeError("not capturable"))
    b = torch.randn(8, 4)
    n_words = len(_state._captured_words)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3 * _graphs.CAPTURE_AT):
            assert _call(fake, body, torch.randn(6, 8), b) is _graphs.NO
    assert body.fused_calls == 1 and body.gstate.off and _graphs.stats["refused"] == 1
    assert any("test_op" in str(x.message) and "not capturable" in str(x.message) for x in w)
    assert len(_state._captured_words) == n_words


def test_an_output_that_is_an_input_is_not_graphed(fake) -> None:  # noqa: ANN001
    """An output sharing memory with a static input (a replay would hand out the static's
    memory) is refused; the call runs as before."""
    body = _Body(alias=True)
    b = torch.randn(8, 4)
    for _ in range(2 * _graphs.CAPTURE_AT):
        assert _call(fake, body, torch.randn(6, 8), b) is _graphs.NO
    assert body.fused_calls == 1 and body.gstate.off


def test_the_graph_owns_what_its_capture_keeps(fake) -> None:  # noqa: ANN001
    """The words and plans a capture keeps alive (which a user's graph keeps for the
    process's life: ``LocalWords``, ``keep_for_capture``) belong to the plan graph, freed
    with it; a user's capture after it keeps its own in the process-wide lists."""
    body = _Body(words=2)
    b = torch.randn(8, 4)
    n_words, n_kept = len(_state._captured_words), len(_state._kept_for_capture)
    for _ in range(_graphs.CAPTURE_AT):
        _call(fake, body, torch.randn(6, 8), b)
    assert len(_state._captured_words) == n_words and len(_state._kept_for_capture) == n_kept
    keep = body.gstate.graph.keep
    assert len(keep) == 4 and sum(isinstance(k, torch.Tensor) for k in keep) == 2, keep
    _Graph.capturing = _Graph()  # a user's capture: the process-wide lists again
    try:
        _state.LocalWords(torch.device("cpu")).get("user", 1, 4)
        _state.keep_for_capture(("a user plan",))
    finally:
        _Graph.capturing = None
    assert len(_state._captured_words) == n_words + 1 and _state._kept_for_capture[-1] == ("a user plan",)
    del _state._captured_words[-1], _state._kept_for_capture[-1]


def test_an_expanded_residual_is_copied_into_a_dense_static(fake) -> None:  # noqa: ANN001
    """A moving input that is a broadcast view (stride 0) is copied into a contiguous
    static input: every replay takes the call's values."""
    body = _Body()
    b = torch.randn(8, 4)
    for it in range(_graphs.CAPTURE_AT + 3):
        a, row = torch.randn(6, 8), torch.randn(4)
        got = _call(fake, body, a, b, row.expand(6, 4))
        if it >= _graphs.CAPTURE_AT - 1:
            torch.testing.assert_close(got, a @ b + row)
    assert body.gstate.graph.statics[2].is_contiguous()


def test_a_graph_dropped_by_another_thread_runs_the_call_unreplayed(fake) -> None:  # noqa: ANN001
    """A graph dropped between a call's pick and its replay (another thread's call with
    other weights, ``drop_graphs``): the call runs the fused body, right."""
    body = _Body()
    b = torch.randn(8, 4)
    for _ in range(_graphs.CAPTURE_AT):
        _call(fake, body, torch.randn(6, 8), b)
    g = body.gstate.graph
    g.drop()
    a = torch.randn(6, 8)
    out = _graphs._replay(fake.rt, fake.cp, body, g, (a, b, None))
    torch.testing.assert_close(out, a @ b)
    assert body.fused_calls == 2


def test_the_setting(fake, monkeypatch) -> None:  # noqa: ANN001
    """``auto``: a graph up to ``AUTO_FLOPS``; ``always``: every size; ``off``: none; a
    value outside those raises, naming it."""
    for setting, flops, graphed in (("auto", _graphs.AUTO_FLOPS, True), ("auto", _graphs.AUTO_FLOPS + 1, False),
                                    ("always", 1 << 50, True), ("off", 1, False), ("", 1, True), ("ON", 1, True)):
        monkeypatch.setenv("OVERLAP_PLAN_GRAPHS", setting)
        body = _Body(flops=flops)
        b = torch.randn(8, 4)
        got = [_call(fake, body, torch.randn(6, 8), b) for _ in range(_graphs.CAPTURE_AT)]
        assert (got[-1] is not _graphs.NO) == graphed, (setting, flops)
        assert all(g is _graphs.NO for g in got[:-1])
    monkeypatch.setenv("OVERLAP_PLAN_GRAPHS", "sometimes")
    with pytest.raises(ValueError, match="OVERLAP_PLAN_GRAPHS='sometimes'"):
        _call(fake, _Body(), torch.randn(6, 8), torch.randn(8, 4))
    # a body without ``flops`` (no graph support) is never graphed
    monkeypatch.delenv("OVERLAP_PLAN_GRAPHS")
    assert _graphs.replay_or_capture(fake.rt, fake.cp, SimpleNamespace(), (torch.randn(2, 2),)) is _graphs.NO


def test_at_most_max_graphs_alive(fake, monkeypatch) -> None:  # noqa: ANN001
    """Past ``MAX_GRAPHS`` live graphs a signature is not captured; it is once one is gone."""
    monkeypatch.setattr(_graphs, "live", _graphs.weakref.WeakSet())
    monkeypatch.setattr(_graphs, "MAX_GRAPHS", 1)
    first, second = _Body(), _Body()
    b = torch.randn(8, 4)
    for _ in range(_graphs.CAPTURE_AT):
        _call(fake, first, torch.randn(6, 8), b)
    for _ in range(_graphs.CAPTURE_AT):
        assert _call(fake, second, torch.randn(6, 8), b) is _graphs.NO
    assert second.fused_calls == 0
    _graphs._drop(first.gstate)
    for _ in range(_graphs.CAPTURE_AT):
        _call(fake, second, torch.randn(6, 8), b)
    assert second.fused_calls == 1 and second.gstate.graph is not None


def test_graphs_within_their_memory_budget(fake, monkeypatch) -> None:  # noqa: ANN001
    """Each graph's memory is measured at its capture (the reserved memory it added, its
    static inputs); past ``OVERLAP_PLAN_GRAPH_MB`` of a device's graphs no signature is
    captured (its calls run as before); once a graph is gone there is room again."""
    monkeypatch.setattr(_graphs, "live", _graphs.weakref.WeakSet())
    reserved = [0]
    monkeypatch.setattr(fake.cuda, "memory_reserved", lambda dev: reserved[0], raising=False)

    class Pooled(_Body):
        def fused(self, *args):  # noqa: ANN001, ANN002, ANN201
            reserved[0] += 10 << 20  # what the capture's pool reserves
            return super().fused(*args)

    monkeypatch.setenv("OVERLAP_PLAN_GRAPH_MB", "15")
    body = Pooled()
    ws = [torch.randn(8, 4) for _ in range(3)]
    for w in ws:
        for _ in range(_graphs.CAPTURE_AT):
            a = torch.randn(6, 8)
            got = _call(fake, body, a, w)
    assert body.fused_calls == 2 and got is _graphs.NO  # 10 MiB held: a second; 20 MiB: no third
    held = [g.bytes for g in _graphs.live]
    assert sorted(held) == [10 << 20] * 2, held  # the reserved memory each capture added
    _graphs._drop(body.gstate)
    for _ in range(_graphs.CAPTURE_AT):
        a = torch.randn(6, 8)
        got = _call(fake, body, a, ws[2])
    torch.testing.assert_close(got, a @ ws[2])
    monkeypatch.setenv("OVERLAP_PLAN_GRAPH_MB", "lots")
    with pytest.warns(UserWarning, match="OVERLAP_PLAN_GRAPH_MB='lots'"):
        assert _graphs.graph_mb() == _graphs.GRAPH_MB


def test_dropped_with_the_plans_and_before_the_communicators(fake, monkeypatch) -> None:  # noqa: ANN001
    """``drop_graphs`` frees a runtime's plan graphs after a device synchronize and turns
    their signatures off; ``reset_runtimes`` does it before it closes the runtime (whose
    communicators the graphs captured), and keeps them unfreed where the communicators
    were aborted; ``clear_call_plans`` drops them with the plans."""
    from overlap.ops import _calls, _lifecycle, _runtime

    def graphed() -> SimpleNamespace:
        body = _Body()
        b = torch.randn(8, 4)
        for _ in range(_graphs.CAPTURE_AT):
            _call(fake, body, torch.randn(6, 8), b)
        return SimpleNamespace(body=body)

    cp = graphed()
    evicted = graphed()  # its call plan no longer cached (an LRU evicted it): still dropped
    fake.rt._caches = {"test_op.calls": {"k": cp}}
    monkeypatch.setattr(_graphs, "live", _graphs.weakref.WeakSet([cp.body.gstate.graph, evicted.body.gstate.graph]))
    for pg in _graphs.live:
        pg.owner = id(fake.rt)
    g, ge = cp.body.gstate.graph.graph, evicted.body.gstate.graph.graph
    _graphs.drop_graphs(fake.rt)
    assert g.resets == 1 and ge.resets == 1 and fake.cuda.syncs == 2 and cp.body.gstate.off
    assert _call(fake, cp.body, torch.randn(6, 8), torch.randn(8, 4)) is _graphs.NO and cp.body.gstate.graph is None

    log = fake.log
    cp = graphed()
    g = cp.body.gstate.graph.graph
    rt = SimpleNamespace(device=torch.device("cpu"), _caches={"test_op.calls": {"k": cp}}, _comms={},
                         close=lambda: log.append(("close", g.resets)))
    cp.body.gstate.graph.owner = id(rt)
    monkeypatch.setitem(_runtime._runtimes, ("test-rt",), rt)
    monkeypatch.setattr(_lifecycle, "_drain", lambda rt, t: True)
    _lifecycle.reset_runtimes()
    assert log[-1] == ("close", 1), log  # the graph freed before the runtime closed

    cp = graphed()
    kept = cp.body.gstate.graph
    aborted: list = []
    rt = SimpleNamespace(device=torch.device("cuda", 0), _caches={"test_op.calls": {"k": cp}}, rank=0, ranks=(0,),
                         group=None, _comms={None: SimpleNamespace(abort=lambda: aborted.append(kept.graph.resets))},
                         close=lambda: log.append("closed"))
    kept.owner = id(rt)
    monkeypatch.setitem(_runtime._runtimes, ("test-rt",), rt)
    monkeypatch.setattr(_lifecycle, "_drain", lambda rt, t: False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _lifecycle.reset_runtimes()
    assert aborted == [0] and kept in _graphs._abandoned and kept.graph is not None
    _graphs._abandoned.remove(kept)

    cp = graphed()
    g = cp.body.gstate.graph.graph
    rt = SimpleNamespace(_caches={"test_op.calls": {"k": cp}}, device=torch.device("cpu"))
    cp.body.gstate.graph.owner = id(rt)
    monkeypatch.setitem(_runtime._runtimes, ("test-rt",), rt)
    _calls.clear_call_plans()
    assert g.resets == 1 and rt._caches["test_op.calls"] == {}


def test_each_op_copies_its_activations_and_reads_its_weights_in_place() -> None:
    """Each op's bound body names as moving (copied into the graph per call) its rows and
    residual, and nothing else: a weight or norm copied per call would cost a copy of it,
    an activation read in place would be a stale read."""
    import inspect

    from overlap.ops import all_gather, all_reduce, boundary, matmul_reduce

    acts = {"a_shard", "x", "a", "residual"}
    for mod in (all_gather, all_reduce, matmul_reduce, boundary):
        params = list(inspect.signature(mod._Bound.fused).parameters)[1:]
        assert {params[i] for i in mod._Bound.moving} == acts & set(params), (mod.__name__, params)
        src = inspect.getsource(mod._planned)
        assert f"_graphs.replay_or_capture(rt, cp, body, ({', '.join(params)})" in src, mod.__name__
        assert f"_calls.run_bound(rt, cp, {', '.join(params)})" in src, mod.__name__


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA (the driver copies' first look)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def test_driver_copies_in_and_out(monkeypatch) -> None:  # noqa: ANN001
    """A replay's copies as one driver copy each (a stand-in driver that moves host bytes):
    a contiguous input of the static's shape and dtype copied in, anything else left to
    ``copy_``; an output cloned into a new tensor of its own memory."""
    import ctypes

    from overlap import flags

    calls: list = []

    class Drv:
        CUdeviceptr = CUstream = int

        @staticmethod
        def cuMemcpyDtoDAsync(dst, src, n, stream):  # noqa: ANN001, ANN205, N802
            calls.append(stream)
            ctypes.memmove(dst, src, n)
            return (0,)

    monkeypatch.setattr(flags, "_cuda_driver", lambda: Drv)
    static = torch.Tensor._make_subclass(_OnCuda, torch.zeros(6, 8))
    copy = _graphs._copier(static)
    src = torch.randn(6, 8)
    assert copy(src, 5) and torch.equal(static, src) and calls == [5]
    for other in (torch.randn(8, 6).t(), torch.randn(6, 8, dtype=torch.float64), torch.randn(4).expand(6, 4)):
        assert not copy(other, 5)  # copy_ does these
    assert len(calls) == 1
    out = torch.Tensor._make_subclass(_OnCuda, torch.randn(6, 4))
    clone = _graphs._cloner((out, out))
    a, b = clone(9)
    assert torch.equal(a, out) and torch.equal(b, out) and a.data_ptr() != out.data_ptr() != b.data_ptr()
    assert calls[-2:] == [9, 9]
    out.add_(1)  # the graph's next replay: the clones keep their values
    assert not torch.equal(a, out)


def test_no_driver_copy_off_the_runtimes_device(fake, monkeypatch) -> None:  # noqa: ANN001
    """The driver copies run in the thread's current context: with another device current,
    a replay copies and clones through torch (which switch devices themselves)."""
    body = _Body()
    b = torch.randn(8, 4)
    for _ in range(_graphs.CAPTURE_AT):
        _call(fake, body, torch.randn(6, 8), b)
    g = body.gstate.graph
    used: list = []
    g.copiers = {i: (lambda x, raw, i=i: used.append(i) or False) for i in g.moving}
    g.clone = lambda raw: used.append("clone") or _graphs._cloned(g.out)
    a = torch.randn(6, 8)
    torch.testing.assert_close(_call(fake, body, a, b), a @ b)
    assert used == [0, "clone"]
    del used[:]
    monkeypatch.setattr(fake.cuda, "current_device", lambda: 5)  # not the runtime's device
    a = torch.randn(6, 8)
    torch.testing.assert_close(_call(fake, body, a, b), a @ b)
    assert used == []


def test_profiled_calls_run_eagerly_and_still_count(fake, monkeypatch) -> None:  # noqa: ANN001
    """While profiling, a call is never replayed (its ranges and phases come from the fused
    body) and never captured, but it counts: the capture comes at the next call not profiled."""
    body = _Body()
    b = torch.randn(8, 4)
    monkeypatch.setattr(_graphs._observe, "_enabled", True)
    for _ in range(_graphs.CAPTURE_AT + 2):
        assert _call(fake, body, torch.randn(6, 8), b) is _graphs.NO
    assert body.fused_calls == 0 and body.gstate.count == _graphs.CAPTURE_AT + 2
    monkeypatch.setattr(_graphs._observe, "_enabled", False)
    a = torch.randn(6, 8)
    torch.testing.assert_close(_call(fake, body, a, b), a @ b)  # captured now, replayed
    assert body.fused_calls == 1
    monkeypatch.setattr(_graphs._observe, "_enabled", True)
    assert _call(fake, body, torch.randn(6, 8), b) is _graphs.NO and body.gstate.graph is not None


def test_a_failure_before_the_agreement_point_runs_the_call_as_before(fake, monkeypatch) -> None:  # noqa: ANN001
    """Everything a capture does comes before the call's agreement point: an allocation that
    fails there (out of memory) must not raise on this rank alone; the call runs as before,
    warned, and the signature is not captured again."""
    body = _Body()
    b = torch.randn(8, 4)

    def oom(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(_graphs.torch, "empty", oom)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(2 * _graphs.CAPTURE_AT):
            assert _call(fake, body, torch.randn(6, 8), b) is _graphs.NO
    assert body.gstate.off and body.fused_calls == 0
    assert any("out of memory" in str(x.message) for x in w)
    assert "agreed" not in fake.log


def test_clear_call_plans_waits_for_nothing(fake, monkeypatch) -> None:  # noqa: ANN001
    """``clear_call_plans`` retires the plan graphs (a device wait there could be held by a dead
    peer's kernel); each is freed once its last replay has ended."""
    from overlap.ops import _calls, _runtime

    body = _Body()
    b = torch.randn(8, 4)
    for _ in range(_graphs.CAPTURE_AT):
        _call(fake, body, torch.randn(6, 8), b)
    g = body.gstate.graph
    graph = g.graph
    rt = SimpleNamespace(_caches={"test_op.calls": {"k": SimpleNamespace(body=body)}}, device=torch.device("cpu"))
    g.owner = id(rt)
    monkeypatch.setitem(_runtime._runtimes, ("test-rt",), rt)
    monkeypatch.setattr(_Event, "done", False)
    _calls.clear_call_plans()
    assert fake.cuda.syncs == 0 and graph.resets == 0 and any(r[2] is graph for r in _graphs._retired)
    monkeypatch.setattr(_Event, "done", True)
    _graphs._reap()
    assert graph.resets == 1


def test_a_replay_keeps_its_signature_warm(fake) -> None:  # noqa: ANN001
    """A replay marks its signature as run eagerly (what a user's later capture of it asks),
    the most recently used in the runtime's bounded ``seen``: other signatures' calls do not
    push it out while it is replayed."""
    fake.rt.seen = _state.LRU(3)
    body, b = _Body(), torch.randn(8, 4)
    key = (fake.cp.op, fake.cp.sig)
    for _ in range(_graphs.CAPTURE_AT):
        _call(fake, body, torch.randn(6, 8), b)
    assert _graphs.stats["captured"] == 1
    for i in range(5):
        fake.rt.seen.add(("other", i))
        fake.rt.seen.add(("other", -i))
        _call(fake, body, torch.randn(6, 8), b)
        assert list(fake.rt.seen)[-1] == key
    fake.rt.seen.clear()
    _call(fake, body, torch.randn(6, 8), b)
    assert key in fake.rt.seen


def test_a_one_gpu_op_replays_without_an_agreement(fake) -> None:  # noqa: ANN001
    """A plan of a one-GPU op (the chain: transport "local") has no ranks to agree with: its
    replay counts the call and reports its error word, with no agreement point; a group op's
    replay has one."""
    body, b = _Body(), torch.randn(8, 4)
    fake.cp.transport = "local"
    for _ in range(_graphs.CAPTURE_AT + 1):
        _call(fake, body, torch.randn(6, 8), b)
    assert _graphs.stats["replayed"] == 2 and "agreed" not in fake.log and fake.log.count("recorded") == 2
    fake.cp.transport = "nccl"
    _call(fake, body, torch.randn(6, 8), b)
    assert fake.log.count("agreed") == 1


class _Relay:
    """A stand-in ring (``kernels.relay.Relay``): its copies queued in the graph read the
    addresses of the call posted last (the stand-in graph reruns its work at once)."""

    def __init__(self, dev, cols) -> None:  # noqa: ANN001
        self.cols, self.next, self.addrs, self.posts = cols, 1, None, 0
        self.fail, self.full = 0, False

    def warm(self, statics, cols) -> None:  # noqa: ANN001
        self.post([0] * self.cols)

    def _copy(self, col, st, into) -> None:  # noqa: ANN001
        import ctypes

        addr = self.addrs[col - 1]
        if addr:
            n = st.numel() * st.element_size()
            ctypes.memmove(st.data_ptr(), addr, n) if into else ctypes.memmove(addr, st.data_ptr(), n)

    def copy_in(self, st):  # noqa: ANN001, ANN201
        col, self.next = self.next, self.next + 1
        _queue(lambda: self._copy(col, st, True))
        return col

    def copy_out(self, st):  # noqa: ANN001, ANN201
        col, self.next = self.next, self.next + 1
        _queue(lambda: self._copy(col, st, False))
        return col

    def advance(self) -> None:
        _queue(lambda: None)

    def begin(self) -> None:
        _queue(lambda: None)

    def post(self, addrs) -> None:  # noqa: ANN001
        assert len(addrs) == self.cols
        self.addrs, self.posts = list(addrs), self.posts + 1

    def failed(self) -> int:
        return self.fail

    def lost(self) -> None:
        self.fail = -1

    def room(self) -> bool:
        return not self.full


@pytest.fixture
def relayed(fake, monkeypatch):  # noqa: ANN001, ANN201
    made: list = []
    monkeypatch.setenv("OVERLAP_PLAN_GRAPH_COPIES", "graph")
    monkeypatch.setattr(_graphs, "_relay_ok", lambda dev: True)
    monkeypatch.setattr(_graphs, "_make_relay", lambda dev, cols: made.append(_Relay(dev, cols)) or made[-1])
    fake.relays = made
    return fake


def test_relayed_copies_follow_each_call(relayed) -> None:  # noqa: ANN001
    """With the graph's own copies: each call posts its activations' and its new output's
    addresses (no host copy of a contiguous input), and gets a new tensor; an input that is
    not contiguous is copied by the host and posted as 0; earlier outputs stay as they were."""
    body, b = _Body(), torch.randn(8, 4)
    outs = []
    for it in range(_graphs.CAPTURE_AT + 5):
        a, r = torch.randn(6, 8), torch.randn(6, 4)
        if it == _graphs.CAPTURE_AT + 3:
            r = torch.randn(4).expand(6, 4)  # strided: copied by the host, its column posted as 0
        got = _call(relayed, body, a, b, r)
        if it < _graphs.CAPTURE_AT - 1:
            assert got is _graphs.NO  # counted, run by the caller
            continue
        torch.testing.assert_close(got, torch.addmm(r, a, b))
        outs.append((got, torch.addmm(r, a, b)))
        addrs = relayed.relays[0].addrs
        assert addrs[0] == a.data_ptr() and addrs[2] == got.data_ptr() and addrs[3] == 0
        assert addrs[1] == (0 if r.stride(0) == 0 else r.data_ptr())
    assert len(relayed.relays) == 1 and _graphs.stats["relayed"] == 6 == _graphs.stats["replayed"]
    assert relayed.relays[0].posts == 6 + 1  # and the warm-up's
    for got, want in outs:
        torch.testing.assert_close(got, want)
    assert len({o.data_ptr() for o, _ in outs}) == 6, "an output's memory reused"


def test_relay_full_or_failed_before_the_agreement(relayed) -> None:  # noqa: ANN001
    """A ring with every slot in flight: the call runs eagerly (the fused body), no wait; a
    copy that found its slot unwritten: the next call raises before its agreement point,
    and the signature runs without a graph from then on."""
    body, b = _Body(), torch.randn(8, 4)
    for _ in range(_graphs.CAPTURE_AT):
        _call(relayed, body, torch.randn(6, 8), b)
    relay = relayed.relays[0]
    relay.full = True
    fused, replayed = body.fused_calls, _graphs.stats["replayed"]
    a = torch.randn(6, 8)
    assert _call(relayed, body, a, b) is _graphs.NO and _graphs.stats["replayed"] == replayed
    relay.full = False
    a = torch.randn(6, 8)
    torch.testing.assert_close(_call(relayed, body, a, b), a @ b)
    relay.fail = 9
    del relayed.log[:]
    with pytest.raises(RuntimeError, match="call 9 did not make its copies"):
        _call(relayed, body, torch.randn(6, 8), b)
    assert "agreed" not in relayed.log and body.gstate.off and body.gstate.graph is None
    assert _call(relayed, body, torch.randn(6, 8), b) is _graphs.NO
    assert body.fused_calls == fused


def test_a_replay_that_raises_after_its_post_fails_the_graph(relayed) -> None:  # noqa: ANN001
    """A call posted and never replayed would leave the graph's counter one slot behind (each
    later replay reading the call before it): the replay's error is raised, and the next
    call raises before its agreement and runs without the graph from then on."""
    body, b = _Body(), torch.randn(8, 4)
    for _ in range(_graphs.CAPTURE_AT):
        _call(relayed, body, torch.randn(6, 8), b)

    def boom() -> None:
        raise RuntimeError("replay failed")

    body.gstate.graph.graph.replay = boom
    body.gstate.graph.replay = None
    with pytest.raises(RuntimeError, match="replay failed"):
        _call(relayed, body, torch.randn(6, 8), b)
    with pytest.raises(RuntimeError, match="did not make its copies"):
        _call(relayed, body, torch.randn(6, 8), b)
    assert body.gstate.off and _call(relayed, body, torch.randn(6, 8), b) is _graphs.NO


def test_graph_copies_are_asked_for(fake, monkeypatch) -> None:  # noqa: ANN001
    """The graph's own copies only with ``OVERLAP_PLAN_GRAPH_COPIES=graph`` (read at each
    capture); unset (nodes, none here), ``driver`` or another value (warned): none."""
    made: list = []
    monkeypatch.setattr(_graphs, "_relay_ok", lambda dev: True)
    monkeypatch.setattr(_graphs, "_make_relay", lambda dev, cols: made.append(_Relay(dev, cols)) or made[-1])
    for value, relayed in ((None, False), ("driver", False), ("graph", True), ("both", False)):
        if value is None:
            monkeypatch.delenv("OVERLAP_PLAN_GRAPH_COPIES", raising=False)
        else:
            monkeypatch.setenv("OVERLAP_PLAN_GRAPH_COPIES", value)
        body, b = _Body(), torch.randn(8, 4)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            _state._warned.discard("plan-graph-copies-both")
            for _ in range(_graphs.CAPTURE_AT):
                _call(fake, body, torch.randn(6, 8), b)
        assert (body.gstate.graph.relay is not None) == relayed, value
        if value == "both":
            assert any("OVERLAP_PLAN_GRAPH_COPIES='both'" in str(w.message) for w in got), [str(w.message) for w in got]
    assert len(made) == 1


def test_a_relay_outlives_its_graph_until_the_gpu_is_done(relayed, monkeypatch) -> None:  # noqa: ANN001
    """The relay's pinned slots are kept until an event behind the graph's work has
    completed: after a capture that failed (its warm-up may still run), and when a graph
    goes without ``drop`` (its call plan freed); freed by a later reap once the event has."""
    import gc

    monkeypatch.setattr(_graphs, "_retired", [])
    body, b = _Body(fail=RuntimeError("no capture")), torch.randn(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (warned once per process: another test may have)
        for _ in range(_graphs.CAPTURE_AT):
            _call(relayed, body, torch.randn(6, 8), b)
    assert body.gstate.off
    assert len(relayed.relays) == 1 and [r[4] for r in _graphs._retired] == [[relayed.relays[0]]]
    body, b = _Body(), torch.randn(8, 4)
    for _ in range(_graphs.CAPTURE_AT + 1):
        _call(relayed, body, torch.randn(6, 8), b)
    relay = body.gstate.graph.relay
    body.gstate.graph = None  # the plan freed, its graph with it: no drop
    gc.collect()
    assert [r[4] for r in _graphs._retired][-1] == [relay]
    monkeypatch.setattr(_Event, "done", True)
    _graphs._reap()
    assert _graphs._retired == []
