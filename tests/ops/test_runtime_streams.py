"""The ops' stream ordering helpers on fake streams and events (no GPU): fork, join and
the p2p call order that the shared buffers' reuse rests on."""

from __future__ import annotations

from typing import Any

from overlap.ops._runtime import Runtime


class FakeEvent:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def record(self, stream: Any) -> None:
        self.log.append(("record", self.name, stream.name))


class FakeStream:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, ev: FakeEvent) -> None:
        self.log.append(("wait", self.name, ev.name))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.name == self.name

    __hash__ = None  # type: ignore[assignment]


def _runtime(log: list) -> Runtime:
    rt = Runtime.__new__(Runtime)  # no device: only the stream helpers are used
    rt.comm_stream = FakeStream(log, "comm")
    rt._events = {"fork": FakeEvent(log, "fork"), 0: FakeEvent(log, "j0"), 1: FakeEvent(log, "j1")}
    rt._p2p_done = {}
    return rt


def test_fork_and_join_use_one_event_per_edge() -> None:
    log: list = []
    rt = _runtime(log)
    cur, aux = FakeStream(log, "cur"), FakeStream(log, "aux")
    rt.fork(cur, rt.comm_stream, aux)
    rt.join(cur, rt.comm_stream, aux)
    assert log == [("record", "fork", "cur"), ("wait", "comm", "fork"), ("wait", "aux", "fork"),
                   ("record", "j0", "comm"), ("wait", "cur", "j0"), ("record", "j1", "aux"), ("wait", "cur", "j1")]


def test_p2p_call_waits_for_the_last_call_only_on_another_stream() -> None:
    log: list = []
    rt = _runtime(log)
    a, b = FakeStream(log, "a"), FakeStream(log, "b")
    rt._p2p_done["op"] = (FakeEvent(log, "done"), a)  # the op's last call ended on stream a
    rt.p2p_begin("op", FakeStream(log, "a"))  # same stream (another handle object): the fork orders it
    assert ("wait", "comm", "done") not in log
    rt.p2p_begin("op", b)
    assert log[-1] == ("wait", "comm", "done")
    rt.p2p_end("op", b)
    assert log[-1] == ("record", "done", "b") and rt._p2p_done["op"][1] == b


def test_fused_call_frame(monkeypatch) -> None:  # noqa: ANN001
    """fused_call: the words zeroed on the caller's stream before the side streams fork; on
    exit (an exception too) joined and the order released; the error word reported only
    after a call that did not raise; the lock released either way."""
    import threading

    import torch

    from overlap import flags as fl
    from overlap.ops import _runtime

    log: list = []

    class Words:
        def __init__(self, name: str) -> None:
            self.name, self.buf = name, torch.ones(4, dtype=torch.int32)

    class Order:
        lock = threading.RLock()

        def begin(self, cur: object) -> None:
            log.append("begin")

        def end(self, cur: object) -> None:
            log.append("end")

    class Rt:
        device, order = torch.device("cpu"), Order()

        def current_stream(self) -> object:
            return torch.cuda.current_stream()

        def local_words(self, name: str, counters: int, flags: int) -> Words:
            log.append(f"words {name}")
            return Words(name)

        def fork(self, cur: object, *side: object) -> None:
            log.append(f"fork {len(side)}")

        def join(self, cur: object, *side: object) -> None:
            log.append(f"join {len(side)}")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: "cur")
    monkeypatch.setattr(fl, "stream_zero", lambda s, t, n: (log.append(f"zero {s}"), t.zero_()))
    from overlap.ops import _plans

    monkeypatch.setattr(_plans, "report_errors", lambda err, check: log.append(f"report {check}"))
    def free(lock: threading.RLock) -> bool:  # another thread can take it (an RLock is reentrant here)
        got: list = []

        def take() -> None:
            got.append(lock.acquire(blocking=False))
            if got[0]:
                lock.release()

        th = threading.Thread(target=take)
        th.start()
        th.join()
        return got[0]

    rt = Rt()
    with _runtime.fused_call(rt, "err", "sync", ("cs", "ns"), ("a", 1, 2), ("b", 4, 3)) as (cur, (wa, wb)):
        assert cur == "cur" and (wa.name, wb.name) == ("a", "b")
        assert int(wa.buf.sum()) == 0 == int(wb.buf.sum())
        log.append("body")
    assert log == ["words a", "words b", "begin", "zero cur", "zero cur", "fork 2", "body", "join 2", "end",
                   "report sync"], log
    assert free(Order.lock)
    del log[:]
    try:
        with _runtime.fused_call(rt, "err", "sync", ("cs",), ("a", 1, 2)):
            log.append("body")
            raise KeyError("boom")
    except KeyError:
        pass
    assert log == ["words a", "begin", "zero cur", "fork 1", "body", "join 1", "end"], log  # no report
    assert free(Order.lock)


def test_current_stream_one_object_per_handle(monkeypatch) -> None:
    """The caller's stream as a ``Stream`` object made once per raw handle: the same handle
    gives the same object (torch asked once), another handle its own, and the map stays
    bounded."""
    from types import SimpleNamespace

    import torch

    handle = [7]
    made: list = []

    def current_stream(device: object) -> object:
        made.append(SimpleNamespace(handle=handle[0]))
        return made[-1]

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: handle[0], raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    rt = Runtime.__new__(Runtime)
    rt.device, rt._streams = torch.device("cuda", 0), {}
    s7 = rt.current_stream()
    assert rt.current_stream() is s7 and s7.handle == 7 and len(made) == 1
    handle[0] = 9
    s9 = rt.current_stream()
    assert s9.handle == 9 and s9 is not s7 and rt.current_stream() is s9
    handle[0] = 7
    assert rt.current_stream() is s7 and len(made) == 2
    for h in range(1000, 1600):
        handle[0] = h
        assert rt.current_stream().handle == h
    assert len(rt._streams) <= 256
