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
