"""See what ran: named profiler ranges, a per-op report of paths taken, and hidden communication.

    with op_range("all_gather_matmul", "p2p x4"):     # host side, one per call
        record_call(op, shape, path, why)             # always on: a counter
        tm = timer(op, shape, path)                   # CUDA events, only while profiling
        ...
    print(report())                                   # calls, paths, tuning, warnings, timing

Three costs, three switches:

* ``record_call`` / ``record_warning`` / ``record_timeout`` / ``record_tuning`` are always on:
  a dictionary update each, no tensor, no synchronization.
* ``op_range`` and ``gpu_range`` are ``torch.profiler.record_function`` ranges while a
  torch profiler records (whatever the switch says: then the host time is being spent
  on the profiler anyway), plus NVTX ranges while profiling is on. With neither, they
  return one shared no-op object: no allocation, about 0.1 us per call.
* ``timer`` records CUDA events on the op's streams only while profiling is on; they are
  read when ``report()`` is called, and only once they have completed (``Event.query``):
  nothing on the op's path ever waits on the GPU.

Profiling is switched by ``OVERLAP_PROFILE=1`` (read once, at import) or ``profile(True)``.

What the NVTX ranges show in Nsight Systems: ``range_push`` / ``range_pop`` are host
markers, so each range is drawn on the CPU thread over the time the op spent *enqueuing*
its work. Nsight Systems also projects a range onto the GPU ("CUDA HW" rows): there it
covers the kernels, copies and memsets launched inside it, on the streams they ran on.
So ``gpu_range("comm", "chunk", 3)`` around a chunk's copy and flag post labels that copy
on the comm stream's row; a flag post made with ``cuStreamWriteValue32`` is no activity
of its own and shows only as the gap it leaves. The torch profiler does the same with its
``gpu_user_annotation`` events (one per stream), which ``benchmarks/timeline.py`` draws.

Hidden communication (``report()``'s ``hidden``), per op, shape and overlapped path:

    hidden = clip((comm_alone + gemm_alone - op) / comm_alone, 0, 1)

* ``op``: median over timed calls of the span on the caller's stream from an event
  recorded before the op forks its side streams to one recorded after it joins them
  (``timer(...).start("op")`` / ``.stop("op")``): the op's GPU time, queueing gaps included.
* ``comm_alone``, ``gemm_alone``: the spans of the comm-stream work (first chunk's transfer
  to last flag post) and of the GEMM launch(es), from the same events recorded in calls
  that ran them *one after the other* (a serial path: ``timer(..., serial=True)``, e.g.
  the chunked stream baseline the tuners time), or given by a benchmark that timed them
  apart (``record_alone``). Inside an overlapped call the GEMM grid's span includes its
  tiles' flag waits and the comm span includes the slowdown of sharing the GPU, so those
  in-call spans (``comm_ms``, ``gemm_ms`` in the report) are shown but never used as the
  alone-times: with them the fraction would read 1 whatever happened.

1 means the op took no longer than its GEMM alone would have plus nothing of the
communication; 0 means it took as long as doing both in turn (or longer).
"""

from __future__ import annotations

import json
import functools
import os
import statistics
import itertools
import sys
import threading
import warnings
from collections import deque
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch.autograd import profiler as _autograd_profiler

__all__ = ["profile", "op_range", "gpu_range", "record_call", "record_warning", "record_timeout", "record_tuning",
           "record_alone", "record_engine", "record_phases", "timer", "EventTimer", "Why", "Report", "report",
           "reset_report", "hidden_fraction",
           "trace", "tile_gemm_metadata", "add_norm_metadata", "reduce_norm_metadata", "fold_norm_metadata"]

_enabled: bool = os.environ.get("OVERLAP_PROFILE", "").strip().lower() not in ("", "0", "false", "no", "off")


def profile(enabled: bool | None = None) -> bool:
    """Switch profiling on or off (``None``: leave it); returns whether it is on.

    On: ``op_range`` / ``gpu_range`` add NVTX ranges (and record_function ranges even with
    no torch profiler running), and ``timer`` records CUDA events per phase. Starts as
    ``OVERLAP_PROFILE`` says."""
    global _enabled
    if enabled is not None:
        _enabled = bool(enabled)
    return _enabled


class Why:
    """Reasons for a path that ``record_call`` understands (any string is accepted)."""

    TUNER = "tuner pick"
    CONFIG = "config given"
    DEFAULT = "default config"
    NO_GPU = "no GPU"
    DTYPE = "dtype"
    WORLD_1 = "world size 1"
    CAPTURE = "capture"
    TRANSPORT = "transport unavailable"


# ---- ranges ---------------------------------------------------------------------------

class _Noop:
    """The shared do-nothing range and timer: falsy, so ``if tm:`` skips a block."""

    __slots__ = ()

    # ``with`` calls these unbound, as builtins are no descriptors: ``"".format`` takes
    # any arguments and returns "" (falsy: an exception propagates). A C call instead of a
    # Python frame halves the cost of the no-op ``with`` (about 0.1 us).
    __enter__ = "".format
    __exit__ = "".format

    def __bool__(self) -> bool:
        return False

    def start(self, phase: str, stream: Any = None) -> None:
        return None

    def stop(self, phase: str, stream: Any = None) -> None:
        return None

    def commit(self) -> None:
        return None


_NOOP = _Noop()
_nvtx_mod: Any = None  # None: not looked up yet; False: unavailable


def _nvtx() -> Any:
    """``torch.cuda.nvtx`` where this torch has NVTX (a CUDA build), else False."""
    global _nvtx_mod
    if _nvtx_mod is None:
        try:
            from torch._C import _nvtx  # noqa: F401 - a CPU build has none

            import torch.cuda.nvtx as nv

            _nvtx_mod = nv
        except ImportError:
            _nvtx_mod = False
    return _nvtx_mod


class _Range:
    """A record_function range plus an NVTX range of the same name."""

    __slots__ = ("name", "_rf", "_nv")

    def __init__(self, name: str) -> None:
        self.name = name
        self._rf: Any = None
        self._nv: Any = None

    def __enter__(self) -> "_Range":
        nv = _nvtx()
        if nv:
            nv.range_push(self.name)
            self._nv = nv
        self._rf = torch.profiler.record_function(self.name)
        self._rf.__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool:
        self._rf.__exit__(*exc)
        if self._nv:
            self._nv.range_pop()
        return False


def _range(name: str) -> Any:
    if _enabled:
        return _Range(name)
    return torch.profiler.record_function(name)


def op_range(name: str, path: str) -> Any:
    """Context manager around one call of op ``name`` on ``path``: the range
    ``overlap.<name>[<path>]`` (e.g. ``overlap.all_gather_matmul[p2p x4]``) in a torch
    profiler trace and, while profiling is on, in Nsight Systems (NVTX). With profiling
    off and no torch profiler recording it is one shared no-op object."""
    if not _enabled and not _autograd_profiler._is_profiler_enabled:
        return _NOOP
    return _range(f"overlap.{name}[{path}]")


def gpu_range(stream: Any, label: str, index: int | None = None) -> Any:
    """Context manager around work an op enqueues on one stream: the range
    ``overlap:<stream>:<label>[ <index>]`` (e.g. ``overlap:comm:chunk 3``), which the torch
    profiler also draws over the GPU work launched inside it, on its stream
    (``gpu_user_annotation``), and Nsight Systems projects onto the GPU rows (NVTX).
    ``stream``: the stream's role ("comm", "gemm", "gate", "giveback", "reduce", "aux", "copy")
    or a stream (then its id). ``index`` is formatted only when the range is made, so
    ``gpu_range("comm", "chunk", c)`` costs nothing when off. No-op as ``op_range``."""
    if not _enabled and not _autograd_profiler._is_profiler_enabled:
        return _NOOP
    role = stream if isinstance(stream, str) else f"stream {getattr(stream, 'stream_id', stream)}"
    return _range(f"overlap:{role}:{label}" if index is None else f"overlap:{role}:{label} {index}")


# ---- the record -----------------------------------------------------------------------

_lock = threading.Lock()
_calls: dict[tuple, Any] = {}           # (op, shape, path, why) -> itertools.count
_warnings: dict[tuple, int] = {}        # (op, shape, msg) -> times
_timeouts: dict[tuple, list] = {}       # (op, shape) -> [count, last message]
_tunings: dict[tuple, tuple] = {}       # (op, shape) -> (candidates, picked)
_alone: dict[tuple, dict] = {}          # (op, shape) -> {"comm": ms, "gemm": ms}
_engines: dict[tuple, tuple] = {}       # (M, N, K, dtype, kind) -> (engine, why), the last GEMM plan's
_samples: dict[tuple, deque] = {}       # (op, shape, path, serial, phase) -> ms
_pending: deque = deque()               # (op, shape, path, serial, {phase: (start, end)})
_dropped = [0]
_MAX_PENDING = 4096
_MAX_SAMPLES = 512


def record_call(op: str, shape: Sequence[int], path: str, why: str) -> None:
    """Count one call of ``op`` at ``shape`` (a tuple, e.g. (M, N, K)) that took ``path``
    ("p2p x4", "nccl x2", "chunked", "reference", ...) because of ``why`` (``Why``).
    O(1), no tensors, no synchronization; call it once per call, after the path is decided."""
    key = (op, shape, path, why)
    c = _calls.get(key)
    if c is None:  # the first call of this op, shape, path and reason: the only costly branch
        _first_call(op, path, why)
        c = _calls.setdefault(key, itertools.count())
    next(c)  # one C call: atomic under the GIL, and no lock to take (a lock doubled the cost)


_noted: set[str] = set()


def _device_info() -> tuple[int, int, str] | None:
    """(major, minor, name) of the current CUDA device; None without one."""
    if not torch.cuda.is_available():
        return None
    return _device_props(torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _device_props(i: int) -> tuple[int, int, str]:
    """Looked up once per device: a new shape's first call (every call, where M changes
    every call) pays a dict lookup, not a device query."""
    major, minor = torch.cuda.get_device_capability(i)
    return major, minor, torch.cuda.get_device_name(i)


def _first_call(op: str, path: str, why: str) -> None:
    """Say once per process what a GPU run gets when it is not what the library was built
    for: fp32 (or any dtype but fp16/bf16) runs the references, with no overlap; a GPU
    other than Hopper runs the fused paths untested. Shown as a warning and in the
    report's notes."""
    dev = _device_info()
    if dev is None:  # CPU: the ops' own warnings say they run their reference
        return
    major, minor, name = dev
    if path == "reference" and why.startswith("dtype "):
        dtype = why.removeprefix("dtype ")
        msg = (f"{op}: {dtype} on a GPU runs the reference (the collective, then torch.matmul): no "
               "overlap. The tile GEMM and its flag waits take fp16/bf16 only (tensor-core tiles); "
               "use bf16 or fp16 for the overlapped paths")
        key = f"dtype {dtype}"
    elif path != "reference" and major != 9:
        family = ("Ampere or Ada: Triton lowers the tile GEMM's TMA descriptors to plain loads, so "
                  "the fused paths run, but untested and never measured (expect them below cuBLAS)"
                  if major == 8 else
                  "Blackwell: untested; the tile GEMM's configs are tuned for Hopper's SMs and shared memory"
                  if major >= 10 else "older than Ampere: untested")
        msg = (f"{op}: the fused paths are built, tested and measured on Hopper (compute capability "
               f"9.0) only; this GPU is {name} ({major}.{minor}), {family}. Compare with the "
               "overlap.ops.*_ref references before relying on it")
        key = "arch"
    else:
        return
    if key in _noted:
        return
    _noted.add(key)
    record_warning(op, (), msg)
    warnings.warn(msg, stacklevel=4)


def _count(c: Any) -> int:
    """Calls counted by an ``itertools.count`` (its repr is ``count(n)``)."""
    r = repr(c)
    return int(r[r.index("(") + 1:-1])


def record_warning(op: str, shape: Sequence[int], msg: str) -> None:
    """Count a warning ``op`` raised (or would have: ``warn_once`` warns once, this counts all)."""
    key = (op, tuple(shape), str(msg))
    with _lock:
        _warnings[key] = _warnings.get(key, 0) + 1


def record_timeout(op: str, shape: Sequence[int], err: Any) -> None:
    """Count a failed flag wait of ``op`` (``err``: the ``FlagTimeoutError`` or its text). A
    failed wait that is not a plain timeout (``RanksDisagreeError``, ``PeerRefusedError``)
    keeps its type's name in front of its message, so a report does not call a refusal a
    timeout."""
    key = (op, tuple(shape))
    text = str(err)
    if isinstance(err, BaseException) and type(err).__name__ != "FlagTimeoutError":
        text = f"{type(err).__name__}: {text}"
    with _lock:
        t = _timeouts.setdefault(key, [0, ""])
        t[0] += 1
        t[1] = text


def record_tuning(op: str, shape: Sequence[int], candidates: Iterable[tuple[str, float]], picked: str) -> None:
    """Keep the tuner's candidates ``[(label, ms), ...]`` and its pick for ``op`` at ``shape``
    (the last tuning of a shape replaces the one before)."""
    cands = [(str(label), float(ms)) for label, ms in candidates]
    with _lock:
        _tunings[(op, tuple(shape))] = (cands, str(picked))


def record_engine(problem: Sequence[Any], engine: str, why: str) -> None:
    """Which GEMM engine (``overlap.kernels.engine``) runs an op's GEMM of ``problem`` ((M, N,
    K, dtype, "waits" | "posts" | "alone")) and why: measured times, a forced engine, or why
    Gluon cannot."""
    with _lock:
        _engines[tuple(problem)] = (str(engine), str(why))


def record_alone(op: str, shape: Sequence[int], *, comm_ms: float | None = None,
                 gemm_ms: float | None = None) -> None:
    """Alone-times measured apart (a benchmark's collective alone, GEMM alone); they take
    precedence over those of the op's serial calls in the hidden fraction."""
    with _lock:
        d = _alone.setdefault((op, tuple(shape)), {})
        if comm_ms is not None:
            d["comm"] = float(comm_ms)
        if gemm_ms is not None:
            d["gemm"] = float(gemm_ms)


def record_phases(op: str, shape: Sequence[int], path: str, phases: Mapping[str, tuple[Any, Any]], *,
                  serial: bool = False) -> None:
    """Hand one call's CUDA events ``{phase: (start, end)}`` to the report, to be read later.

    Events are read in ``report()``, once ``end.query()`` and ``start.query()`` say both
    completed (never waiting); a call whose events have not completed stays pending. At
    most 4096 calls stay pending: past that the oldest are read if complete, else
    dropped (counted in the report). ``serial``: the call ran its phases one after the
    other, so its "comm" and "gemm" spans are alone-times."""
    entry = (op, tuple(shape), path, bool(serial), dict(phases))
    with _lock:
        _pending.append(entry)
        if len(_pending) > _MAX_PENDING:
            _resolve_locked(limit=len(_pending) // 2, drop=True)


class EventTimer:
    """CUDA events of one call's phases (``timer`` makes one only while profiling is on).

    ``start(phase, stream)`` / ``stop(phase, stream)`` record an event on ``stream``
    (None: the current stream): the phase's span runs from the first to the second on
    the GPU. ``commit()`` hands the events to the report (``record_phases``). Events
    come from a pool and go back to it once read."""

    __slots__ = ("op", "shape", "path", "serial", "_ev")

    def __init__(self, op: str, shape: Sequence[int], path: str, *, serial: bool = False) -> None:
        self.op, self.shape, self.path, self.serial = op, tuple(shape), path, serial
        self._ev: dict[str, list] = {}

    def __bool__(self) -> bool:
        return True

    def start(self, phase: str, stream: Any = None) -> None:
        ev = _event()
        ev.record(stream)
        self._ev[phase] = [ev, None]

    def stop(self, phase: str, stream: Any = None) -> None:
        pair = self._ev.get(phase)
        if pair is None:
            raise ValueError(f"EventTimer: stop({phase!r}) without start")
        ev = _event()
        ev.record(stream)
        pair[1] = ev

    def commit(self) -> None:
        done = {p: (s, e) for p, (s, e) in self._ev.items() if e is not None}
        for s, e in self._ev.values():
            if e is None:
                _pool.append(s)  # started, never stopped (an exception): unused
        self._ev = {}
        if done:
            record_phases(self.op, self.shape, self.path, done, serial=self.serial)


_pool: list = []


def _event() -> Any:
    return _pool.pop() if _pool else torch.cuda.Event(enable_timing=True)


def timer(op: str, shape: Sequence[int], path: str, *, serial: bool = False) -> Any:
    """An ``EventTimer`` for this call while profiling is on and the current stream is not
    being captured into a CUDA graph; otherwise the shared no-op timer (falsy)."""
    if not _enabled:
        return _NOOP
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return _NOOP
    return EventTimer(op, shape, path, serial=serial)


def _resolve_locked(limit: int | None = None, drop: bool = False) -> None:
    """Read the pending calls whose events completed (``query()``: no wait)."""
    n = len(_pending) if limit is None else min(limit, len(_pending))
    keep = []
    for _ in range(n):
        op, shape, path, serial, phases = entry = _pending.popleft()
        if all(s.query() and e.query() for s, e in phases.values()):
            for ph, (s, e) in phases.items():
                key = (op, shape, path, serial, ph)
                q = _samples.get(key)
                if q is None:
                    q = _samples[key] = deque(maxlen=_MAX_SAMPLES)
                q.append(float(s.elapsed_time(e)))
                if isinstance(s, torch.cuda.Event):
                    _pool.extend((s, e))
        elif drop:
            _dropped[0] += 1
        else:
            keep.append(entry)
    _pending.extendleft(reversed(keep))


def reset_report() -> None:
    """Forget everything recorded (events still pending are dropped; the plan graphs'
    counts start again from here)."""
    with _lock:
        for d in (_calls, _warnings, _timeouts, _tunings, _alone, _samples, _engines):
            d.clear()
        _pending.clear()
        _dropped[0] = 0
        g = sys.modules.get("overlap.ops._graphs")
        _graphs_base.clear()
        if g is not None:
            _graphs_base.update(g.stats)


_graphs_base: dict[str, int] = {}
"""The plan graphs' counts (``overlap.ops._graphs.stats``) at the last ``reset_report``."""


def _plan_graphs() -> dict | None:
    """The plan graphs' counts since the last ``reset_report`` (captured, replayed, of those
    through memcpy nodes (``noded``) or the relay's kernels (``relayed``), refused, dropped),
    the graphs alive and how a capture now copies (``copies``); None where no op has made
    or tried one."""
    g = sys.modules.get("overlap.ops._graphs")
    if g is None:
        return None
    base = dict(_graphs_base)
    # (a count below its base was set back since the reset: counted from 0)
    got: dict[str, Any] = {k: v - base.get(k, 0) if v >= base.get(k, 0) else v for k, v in g.stats.items()}
    if not any(got.values()):
        return None
    got["live"] = len(g.live)
    got["copies"] = g.copies()
    return got


# ---- the report -----------------------------------------------------------------------

def _med(q: Any) -> float | None:
    """The median of ``q`` (statistics.median's value, at a fraction of its cost per row)."""
    if not q:
        return None
    s = sorted(q)
    h = len(s) // 2
    return s[h] if len(s) % 2 else (s[h - 1] + s[h]) / 2


def _shape_str(shape: Any) -> str:
    try:
        return "x".join(str(int(v)) for v in shape)
    except (TypeError, ValueError):
        return str(shape)


class Report:
    """What ``report()`` returns: ``rows`` (one dict per op and shape), ``notes`` (what an
    op recorded without a shape: process-wide warnings and timeouts), ``to_json()``, and
    ``str()`` a table.

    A row: ``op``, ``shape``, ``calls``; ``paths`` [{path, why, calls}]; ``tuning``
    {candidates [[label, ms]], picked} or None; ``warnings`` [{msg, count}]; ``timeouts``
    {count, last} or None; ``timing`` [{path, serial, calls, op_ms, comm_ms, gemm_ms,
    other phases' medians, comm_alone_ms, gemm_alone_ms, hidden}] (ms are medians;
    ``hidden`` None where an alone-time is missing). A note: ``op``, ``warnings``,
    ``timeouts`` as in a row. ``plan_graphs``: the plan graphs' counts since the last
    ``reset_report`` and how new captures copy, or None where none was made or tried."""

    def __init__(self, rows: list[dict], dropped: int = 0, pending: int = 0,
                 notes: list[dict] | None = None, engines: list[dict] | None = None,
                 plan_graphs: dict | None = None) -> None:
        self.rows = rows
        self.notes = notes or []
        self.engines = engines or []
        self.plan_graphs = plan_graphs
        """The plan graphs' counts (``_plan_graphs``), or None."""
        self.dropped = dropped
        self.pending = pending

    def to_json(self, **kw: Any) -> str:
        return json.dumps({"rows": self.rows, "notes": self.notes, "engines": self.engines,
                           "plan_graphs": self.plan_graphs, "dropped_timings": self.dropped,
                           "pending_timings": self.pending}, **kw)

    def __repr__(self) -> str:
        return f"Report({len(self.rows)} rows)"

    def __str__(self) -> str:
        if not self.rows and not self.notes and not self.engines and not self.plan_graphs:
            return "overlap report: no calls recorded"
        head = ("op", "shape", "path (why)", "calls", "op ms", "comm alone", "gemm alone", "hidden")
        lines: list[tuple] = []
        notes: list[str] = []
        for r in self.rows:
            timing = {t["path"]: t for t in r["timing"] if not t["serial"]}
            # each path once: counted calls first, then paths only timed (no record_call)
            paths = [(f"{p['path']} ({p['why']})", str(p["calls"]), timing.pop(p["path"], {}))
                     for p in r["paths"]]
            paths += [(path, "-", t) for path, t in timing.items()]
            for i, (label, calls, t) in enumerate(paths):  # a row with no call (tuned only): notes only
                lines.append((r["op"] if i == 0 else "", _shape_str(r["shape"]) if i == 0 else "",
                              label, calls,
                              _fmt(t.get("op_ms")), _fmt(t.get("comm_alone_ms")), _fmt(t.get("gemm_alone_ms")),
                              "-" if t.get("hidden") is None else f"{100 * t['hidden']:.0f}%"))
            tag = f"{r['op']} {_shape_str(r['shape'])}"
            if r["tuning"]:
                c = ", ".join(f"{lab} {ms:.3f}" + ("*" if lab == r["tuning"]["picked"] else "")
                              for lab, ms in r["tuning"]["candidates"])
                notes.append(f"{tag}: tuner picked {r['tuning']['picked']} from [{c}] ms")
            for w in r["warnings"]:
                notes.append(f"{tag}: warning x{w['count']}: {w['msg']}")
            if r["timeouts"]:
                notes.append(f"{tag}: {r['timeouts']['count']} failed wait(s), last: {r['timeouts']['last']}")
        for n in self.notes:  # the messages name their op
            notes += [f"warning x{w['count']}: {w['msg']}" for w in n["warnings"]]
            if n["timeouts"]:
                notes.append(f"{n['op']}: {n['timeouts']['count']} failed wait(s), last: {n['timeouts']['last']}")
        out: list[str] = []
        if lines:
            widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
            out = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
            out += ["  ".join(v.ljust(w) for v, w in zip(l, widths)).rstrip() for l in lines]
        for e in self.engines:
            m, n, k, dt = e["gemm"][:4]
            kind = {"waits": " (tiles that wait)", "posts": " (tiles that post)", "alone": " (alone)"}.get(
                (e["gemm"][4:] or [""])[0], "")
            notes.append(f"GEMM {m}x{n}x{k} {dt}{kind}: engine {e['engine']} ({e['why']})")
        g = self.plan_graphs
        if g:
            driven = max(0, g["replayed"] - g["noded"] - g["relayed"])
            notes.append(f"plan graphs: {g['captured']} captured, {g['replayed']} call(s) replayed "
                         f"({g['noded']} through memcpy nodes, {g['relayed']} through the relay's kernels, "
                         f"{driven} with driver copies), {g['refused']} refused, {g['dropped']} dropped, "
                         f"{g['live']} alive; new captures copy with: {g['copies']}")
        if self.pending or self.dropped:
            notes.append(f"timings: {self.pending} call(s) not complete yet, {self.dropped} dropped")
        return "\n".join(out + notes)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def report() -> Report:
    """The record so far: calls per op, shape, path and reason, tuning, warnings, timeouts,
    and (from calls timed while profiling was on, whose events have completed) phase
    times and the hidden fraction. Reads only events that completed; never waits.

    One pass over each record groups it by (op, shape), so the report takes time
    linear in the number of records (plus sorting the rows). What an op recorded
    without a shape (``shape == ()``: a process-wide warning) goes to ``notes``."""
    graphs = _plan_graphs()  # (outside the lock: it may warn, and a warning takes the lock)
    with _lock:
        _resolve_locked()
        by: dict[tuple, dict] = {}

        def entry(op: str, shape: Any) -> dict:
            e = by.get((op, shape))
            if e is None:
                e = by[(op, shape)] = {"paths": [], "warnings": [], "samples": {}}
            return e

        for (op, shape, path, why), c in list(_calls.items()):
            entry(op, shape)["paths"].append({"path": path, "why": why, "calls": _count(c)})
        for (op, shape, msg), n in _warnings.items():
            entry(op, shape)["warnings"].append({"msg": msg, "count": n})
        for (op, shape, path, serial, ph), q in _samples.items():
            if q:
                entry(op, shape)["samples"].setdefault((path, serial), {})[ph] = q
        for key in (*_timeouts, *_tunings, *_alone):
            entry(*key)
        rows, notes = [], []
        for (op, shape), e in sorted(by.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            to = _timeouts.get((op, shape))
            timeouts = {"count": to[0], "last": to[1]} if to else None
            if shape == ():
                notes.append({"op": op, "warnings": e["warnings"], "timeouts": timeouts})
                continue
            paths = sorted(e["paths"], key=lambda d: -d["calls"])
            tun = _tunings.get((op, shape))
            rows.append({
                "op": op, "shape": list(shape) if isinstance(shape, tuple) else shape,
                "calls": sum(d["calls"] for d in paths),
                "paths": paths,
                "tuning": {"candidates": [list(c) for c in tun[0]], "picked": tun[1]} if tun else None,
                "warnings": e["warnings"],
                "timeouts": timeouts,
                "timing": _timing(e["samples"], _alone.get((op, shape), {})),
            })
        engines = [{"gemm": list(k), "engine": v[0], "why": v[1]} for k, v in sorted(_engines.items(), key=str)]
        return Report(rows, _dropped[0], len(_pending), notes, engines, graphs)


def _timing(by: dict[tuple, dict], alone_given: dict) -> list[dict]:
    """Per (path, serial): the phases' medians and the hidden fraction; ``by`` maps
    (path, serial) to {phase: samples} of one op and shape."""
    # alone-times: given apart, else the medians of the serial calls' spans
    alone = dict(alone_given)
    for ph in ("comm", "gemm"):
        if ph not in alone:
            ser = [v for (path, serial), d in by.items() if serial for v in d.get(ph, ())]
            if ser:
                alone[ph] = statistics.median(ser)
    out = []
    for (path, serial), d in sorted(by.items()):
        t: dict[str, Any] = {"path": path, "serial": serial, "calls": max(len(q) for q in d.values())}
        for ph, q in sorted(d.items()):
            t[f"{ph}_ms"] = _med(q)
        t.setdefault("op_ms", None)
        ca, ga = alone.get("comm"), alone.get("gemm")
        t["comm_alone_ms"], t["gemm_alone_ms"] = ca, ga
        t["hidden"] = hidden_fraction(ca, ga, t["op_ms"]) if not serial else None
        out.append(t)
    return out


def hidden_fraction(comm_alone: float | None, gemm_alone: float | None, op: float | None) -> float | None:
    """``clip((comm_alone + gemm_alone - op) / comm_alone, 0, 1)``; None where a time is missing."""
    if comm_alone is None or gemm_alone is None or op is None or comm_alone <= 0:
        return None
    return min(1.0, max(0.0, (comm_alone + gemm_alone - op) / comm_alone))


# ---- a trace in one line ----------------------------------------------------------------

class trace:
    """``with trace("run.json"): ...``: profiling on and a torch profiler (CPU, and CUDA
    where there is a GPU) around the block; the chrome trace is written to ``path`` on
    exit, ready for ``python benchmarks/timeline.py run.json``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._prof: Any = None
        self._was = False

    def __enter__(self) -> Any:
        from torch.profiler import ProfilerActivity

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._was = profile()
        profile(True)
        self._prof = torch.profiler.profile(activities=acts)
        self._prof.__enter__()
        return self._prof

    def __exit__(self, *exc: Any) -> bool:
        try:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._prof.__exit__(*exc)
            self._prof.export_chrome_trace(self.path)
        finally:
            profile(self._was)
        return False


# ---- launch metadata of the Triton kernels ----------------------------------------------
# Triton calls these (``@triton.jit(launch_metadata=...)``) only while a launch hook is set,
# e.g. by proton; they return the kernel's name with its sizes, its flops (``flops<bits>``
# by the operands' width) and the bytes it must move at least (each operand once).

def _esize(t: Any) -> int:
    base = getattr(t, "base", t)  # a TensorDescriptor or a tensor
    return int(base.element_size())


def tile_gemm_metadata(grid: Any, kernel: Any, args: Mapping[str, Any]) -> dict:
    """``tile_gemm_kernel`` and ``tile_gemm_flat_kernel``: 2 * K * (C elements its table
    covers). Whole tiles count BLOCK_M x BLOCK_N each, split tiles (``SPLIT``) their
    ``split_parts`` pieces once, capped at the size of the C's (every weight's, for a grid
    over several); bytes: those rows of A, all of each B, those elements of C (plus a
    folded norm's statistics). A table shared by two launches through a dispatch counter
    (the give-back grid) is reported by each launch whole."""

    def on(key: str) -> bool:  # a constexpr the kernel may not have (the flattened one's are fewer)
        return key in args and bool(args[key])

    bm, bn = int(args["BLOCK_M"]), int(args["BLOCK_N"])
    n, k, tiles = int(args["N"]), int(args["K"]), int(args["num_tiles"])
    if on("SPLIT"):
        start, parts = int(args["split_start"]), max(1, int(args["split_parts"]))
        tiles = start + (tiles - start) // parts
    c = args["c_ptr"]
    # weights 1.. of a grid over several (NUM_B > 1): their C's and N's
    more = [(args[f"c{i}_ptr"], int(args[f"N{i}"])) for i in (1, 2, 3)
            if f"N{i}" in args and args[f"N{i}"] is not None]
    n_all = n + sum(ni for _, ni in more)
    elems = tiles * bm * bn
    if hasattr(c, "shape"):
        elems = min(elems, int(c.shape[0]) * n + sum(int(ci.shape[0]) * ni for ci, ni in more
                                                     if hasattr(ci, "shape")))
    rows = elems // max(n_all, 1)
    ea, eb, ec = _esize(args["a_desc"]), _esize(args["b_desc"]), _esize(c)
    nbytes = rows * k * ea + n_all * k * eb + elems * ec
    if on("NORM_EPI"):
        nbytes += rows * 8 + 2 * n * 4
    tags = "".join(f" {t}" for t, key in (("wait", "HAS_WAIT"), ("post", "HAS_POST"), ("split", "SPLIT"),
                                          ("norm", "NORM_EPI"), ("ws", "WARP_SPEC")) if on(key))
    tags += f" {1 + len(more)} weights" if more else ""
    return {"name": f"{kernel.name} [M={rows}, N={n_all}, K={k}]{tags}", f"flops{8 * ea}": 2.0 * k * elems,
            "bytes": nbytes}


def _norm_flops(norm: int, has_bias: bool) -> int:
    # per element: LayerNorm sum 1, squared deviation 3, output 3 (+1 bias); RMSNorm 2 + 2 (+1)
    return {0: 0, 1: 7, 2: 4}[int(norm)] + (1 if norm and has_bias else 0)


def add_norm_metadata(grid: Any, kernel: Any, args: Mapping[str, Any]) -> dict:
    """``add_norm_kernel``: one program per row (grid[0] rows of K); flops counted as 1 per
    element for the residual add and ``_norm_flops`` for the norm (fp32)."""
    rows, k = int(grid[0]), int(args["K"])
    e, norm, res = _esize(args["h_ptr"]), int(args["NORM"]), bool(args["HAS_RES"])
    elems = rows * k
    nbytes = elems * e * (1 + (2 if res else 0)) + ((elems * _esize(args["y_ptr"]) + k * e * (
        2 if args["HAS_BIAS"] else 1)) if norm else 0)
    flops = elems * ((1 if res else 0) + _norm_flops(norm, bool(args["HAS_BIAS"])))
    return {"name": f"{kernel.name} [M={rows}, K={k}]", "flops32": float(flops), "bytes": nbytes}


def reduce_norm_metadata(grid: Any, kernel: Any, args: Mapping[str, Any]) -> dict:
    """``reduce_norm_kernel``: all M = slot_stride / K rows (the two-shot path reduces
    1/R of them: an upper bound there). Reads WORLD partials (and the residual), writes
    h and, with a norm, y (or the folded norm's row statistics)."""
    k = int(args["K"])
    m = int(args["slot_stride"]) // max(k, 1)
    world, e = int(args["WORLD"]), _esize(args["x_ptr"])
    res, norm, fold, bias = bool(args["HAS_RES"]), int(args["NORM"]), bool(args.get("FOLD", False)), \
        bool(args["HAS_BIAS"])
    elems = m * k
    nbytes = elems * e * (world + (1 if res else 0) + 1)
    if norm:
        nbytes += m * 8 if fold else elems * e + k * e * (2 if bias else 1)
    flops = elems * ((world - 1) + (1 if res else 0) + (_norm_flops(norm, bias) if norm and not fold else
                                                           (3 if norm else 0)))
    return {"name": f"{kernel.name} [M={m}, K={k}, R={world}]", "flops32": float(flops), "bytes": nbytes}


def fold_norm_metadata(grid: Any, kernel: Any, args: Mapping[str, Any]) -> dict:
    """``fold_norm_kernel``: B' = diag(w) B and [u; v] in one pass over B [K, N]: per
    element a multiply and a column-sum add (and 2 for bias @ B)."""
    k, n = int(args["K"]), int(args["N"])
    e, bias = _esize(args["b_ptr"]), bool(args["HAS_BIAS"])
    nbytes = 2 * k * n * e + k * _esize(args["w_ptr"]) * (2 if bias else 1) + 2 * n * 4
    return {"name": f"{kernel.name} [K={k}, N={n}]", "flops32": float(k * n * (4 if bias else 2)),
            "bytes": nbytes}
