"""Shared pieces of the ops' state: bounded caches, what a CUDA graph capture keeps, the
order of calls on a device, error words, one-time warnings, and the local flag words.

Process-global where a capture or a graph outlives a runtime (``keep_for_capture``, the
error words, the captured words, the device orders); the rest is held by each
``Runtime`` (``overlap.ops._runtime``)."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections import OrderedDict
from typing import Any, Iterator, NamedTuple

import torch

from .. import flags as _flags

__all__ = ["LRU", "keep_for_capture", "OverlapCaptureError", "capturing", "DeviceOrder", "device_order",
           "register_error_word", "check_errors", "warn_once", "Words", "LocalWords"]

_warned: set[str] = set()  # process-global: a warning is once per process, whatever shutdowns come between
_captured_words: list[torch.Tensor] = []
"""Flag and counter words of captured calls: a graph holds their addresses for as long
as it lives, which the library cannot see, so they are never freed."""


generation = [0]
"""Bumped by every change of a watched ``LRU`` (a tuned pick stored or evicted, a call
plan kept, evicted or cleared) and by ``reset`` / ``reset_runtimes``: what ``_calls``'s
index of call plans checks before it trusts an entry."""


call_index: dict = {}
"""The call plans' index (``_calls.index``), here so that dropping the runtimes empties it
(its entries hold a runtime each)."""


class LRU(OrderedDict):
    """A dict of at most ``cap`` entries; setting a new key past the cap drops the least
    recently used one. Every per-shape cache of the ops is one of these: a server whose
    token count M changes every call would otherwise grow them without bound. Reads and
    writes take a lock (the ops run from several threads; their caches are shared).

    Evicting is safe for eager calls (an entry is rebuilt on its next use) but not for
    what a CUDA graph captured: a graph holds the device addresses of a plan's tables
    and words for as long as it lives, so a plan used inside a capture is also kept by
    ``keep_for_capture`` and is never freed."""

    watched = False
    """A cache whose every change may change a call's decision (the tuned picks, the call
    plans: ``Runtime.cache`` marks them): each change bumps ``generation``."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        if cap < 1:
            raise ValueError(f"an LRU needs room for one entry, got cap={cap}")
        self.cap = cap
        self._lock = threading.Lock()

    def get(self, key: Any, default: Any = None) -> Any:
        with self._lock:
            try:
                v = OrderedDict.__getitem__(self, key)
            except KeyError:
                return default
            self.move_to_end(key)
            return v

    def __setitem__(self, key: Any, value: Any) -> None:
        with self._lock:
            OrderedDict.__setitem__(self, key, value)
            self.move_to_end(key)
            while len(self) > self.cap:
                OrderedDict.popitem(self, last=False)
            if self.watched:
                generation[0] += 1

    def __delitem__(self, key: Any) -> None:
        with self._lock:
            OrderedDict.__delitem__(self, key)
            if self.watched:
                generation[0] += 1

    def pop(self, key: Any, *default: Any) -> Any:
        with self._lock:
            try:
                return OrderedDict.pop(self, key, *default)
            finally:
                if self.watched:
                    generation[0] += 1

    def popitem(self, last: bool = True) -> tuple:
        with self._lock:
            try:
                return OrderedDict.popitem(self, last)
            finally:
                if self.watched:
                    generation[0] += 1

    def clear(self) -> None:
        with self._lock:
            OrderedDict.clear(self)
            if self.watched:
                generation[0] += 1

    def update(self, *args: Any, **kw: Any) -> None:
        for k, v in dict(*args, **kw).items():
            self[k] = v

    def setdefault(self, key: Any, default: Any = None) -> Any:
        with self._lock:
            if OrderedDict.__contains__(self, key):
                return OrderedDict.__getitem__(self, key)
        self[key] = default
        return default

    def add(self, key: Any) -> None:
        """Use as a bounded set: remember ``key``."""
        self[key] = True


_kept_for_capture: list[Any] = []  # process-global: a graph outlives shutdown and holds these addresses


def keep_for_capture(obj: Any) -> Any:
    """Keep ``obj`` (a plan, a table) alive for the life of the process when the current
    stream is capturing: the graph holds its device addresses (see ``LRU``). Inside the
    library's own capture of a plan graph (``capture_sink``), kept by that graph instead."""
    if capturing():
        sink = getattr(_sink, "keep", None)
        if sink is not None:
            if not any(o is obj for o in sink):
                sink.append(obj)
            return obj
        with _lock_kept:
            if not any(o is obj for o in _kept_for_capture):
                _kept_for_capture.append(obj)
    return obj


_lock_kept = threading.Lock()
_sink = threading.local()


@contextlib.contextmanager
def capture_sink() -> Iterator[list]:
    """While a plan graph (``_graphs``) is captured on this thread: what the capture keeps
    alive (``keep_for_capture``, captured words) goes into the list yielded, which the plan
    graph owns and frees with it, not into the process-wide lists."""
    prev = getattr(_sink, "keep", None)
    _sink.keep = got = []
    try:
        yield got
    finally:
        _sink.keep = prev


class OverlapCaptureError(RuntimeError):
    """An op was called inside a CUDA graph capture in a way that cannot be captured
    (its kernels, plans or communicators are made by the first eager call of a shape)."""


def capturing() -> bool:
    """True while the current CUDA stream is capturing a graph. Asked several times per
    call: CUDA initialized (a capture needs it) is a flag read, where
    ``torch.cuda.is_available()`` reads the environment and counts devices."""
    # what ``torch.cuda.is_initialized()`` and ``is_current_stream_capturing()`` read,
    # without their two Python frames (asked about six times a call)
    cuda = torch.cuda
    return bool(cuda._initialized) and not cuda._is_in_bad_fork() and torch._C._cuda_isCurrentStreamCapturing()


class DeviceOrder:
    """The library's calls on one device, in one order across streams and threads.

    Every op's GEMM is a persistent grid whose tiles spin on flags, and the work that
    sets those flags (NCCL kernels, the chain's producer) needs SMs of its own. Two
    such calls running at once on two streams can take each other's SMs and time out.
    So each call holds ``lock`` on the host while it queues its work, and its first
    work waits for the previous call's end (an event on that call's stream) when it is
    queued on another stream. On one stream the order is the stream's own and nothing
    is added. Inside a graph capture no event from outside the capture can be waited
    on: a captured call is ordered by the graph, and a replay, like any kernel, by the
    stream it is replayed on (the caller orders replays against other streams)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._ev: torch.cuda.Event | None = None
        self._stream: torch.cuda.Stream | None = None

    def begin(self, cur: torch.cuda.Stream) -> None:
        """Order ``cur``'s next work after the previous call (hold ``lock``). The event
        is recorded on the previous call's stream only now, when a call comes on another
        stream: it then also covers whatever was queued there after that call (more
        order than needed, never less), and a run of calls on one stream records none."""
        prev = self._stream
        # (``is`` first: the runtimes hand out one Stream object per stream, and torch's
        # Stream comparison is a Python frame)
        if prev is not None and prev is not cur and prev != cur and not capturing():
            if self._ev is None:
                self._ev = torch.cuda.Event()
            self._ev.record(prev)  # a wait queued earlier keeps the record it saw
            cur.wait_event(self._ev)

    def end(self, cur: torch.cuda.Stream) -> None:
        """Mark the end of a call whose work is all on ``cur`` by now (hold ``lock``)."""
        self._stream = cur

    def last_stream(self) -> torch.cuda.Stream | None:
        """The stream of the last call (its work ends there)."""
        return self._stream


_orders: dict[int, DeviceOrder] = {}  # process-global: one order per device over every runtime, across re-inits
_orders_lock = threading.Lock()  # not _lock: get_runtime holds that while a Runtime asks for its order


def device_order(device: torch.device) -> DeviceOrder:
    """The ``DeviceOrder`` of ``device`` (one per device, shared by every op and group)."""
    o = _orders.get(device.index)
    if o is None:
        with _orders_lock:
            o = _orders.setdefault(device.index, DeviceOrder())
    return o


_error_words: list[_flags.ErrorWord] = []
"""Every error word an op made, for ``check_errors``. Process-global, not dropped with
its runtime: a captured graph writes into the word for as long as it lives."""


def register_error_word(err: _flags.ErrorWord) -> _flags.ErrorWord:
    with _orders_lock:  # (Runtime.err can run under _lock)
        _error_words.append(err)
    return err


def check_errors(*, block: bool = True) -> None:
    """Raise ``overlap.flags.FlagTimeoutError`` for a timeout any op recorded and has not
    reported yet: in an eager call with ``check='none'``, or in a CUDA graph replay
    (a captured call does not check; its timeouts surface here or on the op's next
    eager call). ``block=True`` first waits for the work queued so far on each word's
    device; ``block=False`` reads only what has landed (never waits on the GPU)."""
    with _orders_lock:
        words = list(_error_words)
    for err in words:
        err.check(block=block)


def warn_once(key: str, msg: str) -> None:
    """Warn once per process and key (fallbacks are never silent, never noisy)."""
    if key not in _warned:
        _warned.add(key)
        from .. import observe

        observe.record_warning(msg.split(":", 1)[0], (), msg)
        warnings.warn(msg, stacklevel=3)


class Words(NamedTuple):
    """One call's int32 words: ``counters`` (the GEMM's dispatch counter first) and
    ``flags``, views of ``buf``, which the call zeroes whole before anything reads it."""

    buf: torch.Tensor
    counters: torch.Tensor
    flags: torch.Tensor


class LocalWords:
    """Counters and flags that only this device writes: the NCCL transport's chunk
    flags (posted by the comm stream), the chain's row-block flags (posted by the
    producer), dispatch and split counters.

    They need no epoch: a call zeroes its words on its own stream first
    (``flags.stream_zero``, one memset), after the previous call ended
    (``DeviceOrder``), so flags count from 0 in every call and a wait is for 1 (or
    the call's count). Nothing on the host advances per call, so an exception at any
    point leaves the next call correct, and a CUDA graph captures the zeroing with the
    call. A captured call gets words of its own, kept for the life of the process: its
    replays never share flags with eager calls or with other graphs."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._by: dict[str, tuple[int, torch.Tensor, int, Words]] = {}  # counters, buffer, words, views

    def get(self, name: str, n_counters: int, n_flags: int) -> Words:
        # the flags start 16-byte aligned: Triton specializes pointers on it
        nc = -(-max(1, n_counters) // 4) * 4
        words = nc + max(1, n_flags)
        if capturing():
            buf = torch.empty(words, dtype=torch.int32, device=self.device)
            sink = getattr(_sink, "keep", None)
            (sink if sink is not None else _captured_words).append(buf)
            return Words(buf, buf[:nc], buf[nc:])
        got = self._by.get(name)
        if got is not None and got[0] == nc and got[2] == words:
            return got[3]  # the views of the last call of this size: three slices fewer per call
        if got is None or got[0] != nc or got[1].numel() < words:
            # grown to a power of two: flag counts follow M (the chain's row blocks), and a
            # server whose M changes every call must not reallocate on every larger M
            size = max(1 << (words - 1).bit_length(), nc + 64)
            buf = torch.zeros(size, dtype=torch.int32, device=self.device)
        else:
            buf = got[1]
        w = Words(buf[:words], buf[:nc], buf[nc:words])
        self._by[name] = (nc, buf, words, w)
        return w
