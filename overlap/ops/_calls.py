"""A call plan per signature: what a fused op decides once for calls that look alike.

The first call of an op at a signature (its inputs' shapes, strides, dtypes and device,
its options, its resolved config and transport, on one runtime) runs the op's checks and
decisions in full and, once the call has returned, records them as a ``CallPlan``: the
values the ranks agree on, the capture signature, the path and reason the report counts.
A later call of that signature finds the plan by one tuple of its inputs' attributes and
goes straight to the agreement point (``check_agree``: the call counted, the key found)
and the op's fused body::

    first call   checks -> runtime -> tuned pick -> transport -> chunks -> agree -> fused body
                                                                      \\-> CallPlan (on success)
    later calls  key -> CallPlan -> agree (counted) -> fused body

The plan is found through an index (``index``, ``index_lookup``): a dict from a cheap
tuple of the call (the op, the group and config objects' identities, the inputs'
attributes and options) to what the full lookup found (runtime, plan, resolved config,
transport), trusted while ``_state.generation`` is unchanged (every change of a tuned
pick or call plan cache, a reset, the runtimes dropped, ``clear_call_plans``) and while
the group and config objects and ``OVERLAP_TRANSPORT`` are the entry's; else the full
lookup runs and indexes its result.

Still looked at on every call: the inputs' types and autograd (a refusal takes the full
path, which raises), a CUDA graph capture (the full path: it checks that the signature
ran eagerly), the tuned pick and the transport (a tuner run or ``OVERLAP_TRANSPORT`` may
change either between calls; both enter the key), and the inputs' 16-byte alignment
(what TMA needs of a pointer; an unaligned one takes the full path, which refuses it).
Everything else the full path checks is a function of the key.

On the NCCL transport a plan also holds a **bound body** (``BoundBody``), made by the
signature's first call from a plan: every object the op's fused body looks up per call
(its op plan, GEMM plans, communicator, error word, wait bound, streams, words, events)
found once, each launch bound (``gemm_bind``: ``TileGemmPlan.bind``, or an engine plan's
pick's, the tile GEMM's or ``GluonGemmPlan.bind``; the C launcher's arguments built
once, a call setting only its tensors' storage), each collective bound
(``NcclCommunicator.bound``), each flag post and the words' zeroing bound
(``flags.bound_write_value``, ``bound_zero``). A later call is then::

    key -> CallPlan -> aligned -> ready -> agree (counted) -> order, zero, fork
        -> collectives, posts, launches -> join -> error report -> output

The settings read from the environment (``OVERLAP_WAIT_TIMEOUT_MS``, ``OVERLAP_SM_MARGIN``,
``OVERLAP_STREAM_GATE``, ``OVERLAP_GEMM_ENGINE``) are read when a body is made, so a
change takes effect for the signatures first called after it, or for every signature after
``clear_call_plans()``. ``ready`` declines the body (the call takes the fused body as the
full path runs it) while profiling is on (``overlap.observe`` or torch's profiler: the
fused body draws ranges and times phases), while a Triton launch hook is set, and where
the current device is not the runtime's.

Where the host sets the pace, a body's signature is captured once as a plan graph and
replayed per call (``_graphs``; ``OVERLAP_PLAN_GRAPHS``): the ops ask
``_graphs.replay_or_capture`` before they run the body.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch

from .. import observe as _observe
from ._plans import report_eager
from . import _state
from ._state import Words
from ._runtime import LRU, Runtime, _runtimes, agree_key, check_agree, check_agreed, observed

__all__ = ["CallPlan", "call_plans", "find", "keep", "run_planned", "run_bound", "BoundBody", "clear_call_plans",
           "gemm_bind", "aligned", "tensor_key", "grad_refused", "stats", "index", "index_lookup", "generation",
           "transport_env"]

_launch: Any = None  # overlap.kernels._launch, once a body is made

stats: dict[str, int] = {"made": 0, "planned": 0, "bound": 0}
"""Call plans made, calls that ran from one, and of those the calls that ran through its
bound body (proof that the short path ran)."""

CALLS_CAP = 256
"""Call plans a runtime keeps per op (the most recently used)."""

INDEX_CAP = 1024
"""Entries of the call plans' index (``index``) before it is emptied and starts again."""

_index: dict[tuple, tuple] = _state.call_index
"""A call's cheap key -> (generation, group, config, OVERLAP_TRANSPORT, (rt, plan, config,
transport), tuned cache, tuned key, plans cache, plan key): see ``index_lookup``."""

_generation = _state.generation
_env_data = getattr(os.environ, "_data", None)
if isinstance(_env_data, dict) and all(isinstance(k, bytes) for k in list(_env_data)[:1]):
    def transport_env() -> Any:
        """``OVERLAP_TRANSPORT`` as the index compares it: here the raw bytes from
        ``os.environ``'s own mapping (the one ``os.environ[...] = ...`` and ``del`` change),
        one dict read instead of ``os.environ.get``'s three Python frames; None where unset.
        The mapping is looked up per call (``os.environ`` itself may have been replaced)."""
        try:
            return os.environ._data.get(b"OVERLAP_TRANSPORT")  # type: ignore[attr-defined]
        except AttributeError:  # (replaced by a mapping of another kind)
            return os.environ.get("OVERLAP_TRANSPORT")
else:  # a platform whose environment mapping is kept otherwise
    def transport_env() -> Any:
        """``OVERLAP_TRANSPORT`` as the index compares it (None where unset)."""
        return os.environ.get("OVERLAP_TRANSPORT")
_move_to_end = OrderedDict.move_to_end  # C: marks an entry used without a Python frame


class CallPlan:
    """What the full path of one op decided for one signature (see the module docstring)."""

    __slots__ = ("op", "names", "values", "rows_at", "sig", "shape", "path", "why", "config", "transport", "key",
                 "body", "kept_as")

    def __init__(self, op: str, names: tuple[str, ...], values: tuple[int, ...], rows_at: int | None, sig: tuple,
                 shape: tuple[int, ...], path: str, why: str, config: Any, transport: str) -> None:
        self.op, self.names, self.values, self.rows_at, self.sig = op, names, values, rows_at, sig
        self.shape, self.path, self.why, self.config, self.transport = shape, path, why, config, transport
        self.key = agree_key(op, names, values, rows_at)
        self.body: BoundBody | None = None
        """The bound body (NCCL transport), made by the signature's first call from this plan."""
        self.kept_as: tuple | None = None
        """The key object it is kept under in its op's call plans (``keep``): the index marks
        it used by that very object (a lookup by identity, not by comparing an equal key's
        config field by field)."""

    def __repr__(self) -> str:
        agreed = ", ".join(f"{n}={v}" for n, v in zip(self.names, self.values))
        return (f"CallPlan({self.op} {'x'.join(str(x) for x in self.shape)} on {self.path} ({self.why}); "
                f"ranks agree on {agreed}" + (f"; {self.body!r}" if self.body is not None else "") + ")")


def call_plans(rt: Runtime, op: str) -> LRU:
    """The call plans of ``op`` on ``rt`` by signature key."""
    return rt.cache(f"{op}.calls", CALLS_CAP)


def find(rt: Runtime, op: str, key: tuple) -> CallPlan | None:
    """The plan of ``key`` for ``op`` on ``rt``, or None (also for a key that cannot be
    hashed: a config holding a list, which then always takes the full path)."""
    try:
        return call_plans(rt, op).get(key)
    except TypeError:
        return None


def index_lookup(key: tuple, group: Any, config: Any) -> tuple | None:
    """The ``(rt, cp, cfg, transport)`` indexed under ``key`` (``index``), or None: none
    there, or one from before a change that may change a call's decision (``generation``
    moved: a tuned pick stored or evicted, a call plan kept, evicted or cleared, a reset,
    the runtimes dropped), another group or config object than the one it was made for, or
    another ``OVERLAP_TRANSPORT``. The hit's tuned pick and call plan are marked used in
    their caches, as the full lookup's reads mark them."""
    e = _index.get(key)
    if e is None or e[0] != _generation[0] or e[1] is not group or e[2] is not config or \
            e[3] != transport_env():
        return None
    try:
        if e[5] is not None:
            _move_to_end(e[5], e[6])
        _move_to_end(e[7], e[8])
    except KeyError:  # evicted (the generation moved too): the full lookup decides
        return None
    return e[4]


def index(key: tuple, gen: int, group: Any, config: Any, env: str | None, rt: Runtime, cp: CallPlan, cfg: Any,
          transport: str, tuned_cache: Any, tuned_key: Any, plan_key: tuple) -> None:
    """Index the full lookup's result (``rt``, the plan ``cp`` found under ``plan_key``, the
    config and transport it resolved, the tuned pick read from ``tuned_cache`` at
    ``tuned_key`` or None) under the call's cheap ``key``: the group and config objects'
    identities, the inputs' attributes and options. ``gen`` and ``env`` are the generation
    and ``OVERLAP_TRANSPORT`` read before the lookup began (a change during it leaves the
    entry stale, never wrong). Bounded: past ``INDEX_CAP`` entries the index starts again."""
    if len(_index) >= INDEX_CAP:
        _index.clear()
    if cp.kept_as is not None and cp.kept_as == plan_key:
        plan_key = cp.kept_as
    _index[key] = (gen, group, config, env, (rt, cp, cfg, transport), tuned_cache, tuned_key,
                   call_plans(rt, cp.op), plan_key)


def generation() -> int:
    """The generation an ``index`` entry is made at (read before the full lookup)."""
    return _generation[0]


def keep(rt: Runtime, key: tuple, cp: CallPlan) -> None:
    """Remember ``cp`` under ``key`` (a call of its signature has returned), unless a plan
    is kept there already (the one in use stays, with its body and graph); an unhashable
    key is not kept."""
    try:
        plans = call_plans(rt, cp.op)
        if key in plans:  # made already (a full-path call of a planned signature: a capture, an
            return        # unaligned input): the plan in use, its body and graph, stay
        plans[key] = cp
        cp.kept_as = key
    except TypeError:
        return
    stats["made"] += 1


def run_planned(rt: Runtime, cp: CallPlan, fn: Any, *args: Any) -> Any:
    """One call of ``cp.op`` as the full path ends it, the same steps in the same order: the
    agreement point, then ``fn(*args)`` observed, then the signature remembered as run
    eagerly (for a later capture)."""
    check_agree(rt, cp.op, cp.names, cp.values, rows_at=cp.rows_at)
    return rt.mark_warm(cp.op, cp.sig, observed(cp.op, cp.shape, cp.path, cp.why, rt.device, fn, *args))


def run_bound(rt: Runtime, cp: CallPlan, *args: Any) -> Any:
    """One call of ``cp.op`` through its bound body, the full path's steps in its order:
    the agreement point (the call counted, the key found), the call counted in
    ``overlap.report()``, the body, the signature remembered as run eagerly. The caller
    checked ``cp.body.ready()`` (no profiling: ``observed`` would draw and time nothing)."""
    check_agreed(rt, cp.op, cp.names, cp.values, cp.key)
    _observe.record_call(cp.op, cp.shape, cp.path, cp.why)
    out = cp.body(*args)
    rt.seen.add((cp.op, cp.sig))  # ``mark_warm``: a later capture of the signature needs it
    stats["bound"] += 1
    return out


def clear_call_plans() -> None:
    """Forget every call plan and bound body (the next call of each signature takes the
    full path): for a changed ``OVERLAP_*`` setting that a body read when it was made."""
    from . import _graphs

    for rt in list(_runtimes.values()):
        _graphs.drop_graphs(rt, wait=False)  # retired: no wait on the device
        for name in [n for n in rt._caches if n.endswith(".calls")]:
            rt._caches[name].clear()
    _index.clear()
    _generation[0] += 1


class BoundBody:
    """The frame of a bound body (see the module docstring): ``fused_call``'s steps, with
    what it looks up per call found once. A subclass sets ``side`` (the side streams),
    ``words`` (the call's local words, ``Runtime.local_words``), ``err`` and ``check``, calls
    ``bind_frame`` and defines ``run(raw, cur, *args)``: the op's collectives, posts and
    launches, queued on ``cur`` (raw handle ``raw``) and the side streams.

    Per call, under the device's order lock: ``cur`` ordered after the previous call
    (``DeviceOrder``), the words zeroed on ``cur`` (one memset), the side streams forked
    from ``cur``, ``run``; on exit, an exception too, the side streams joined into ``cur``
    and the order released; without an exception the error word reported as ``check``
    says, still under the lock.

    What the fused body does on the caller's stream outside its frame stays outside:
    ``prepare`` (None, or ``f(args) -> args``) before the frame (copies of strided inputs
    that the side streams read, so the fork orders them), ``finish`` (None, or ``f(out) ->
    out``) after it (work on buffers the side streams write, once they are joined)."""

    rt: Runtime
    side: tuple
    words: Any
    err: Any
    check: str
    prepare: Any = None
    finish: Any = None

    def bind_frame(self) -> None:
        from .. import flags as _flags
        from ..kernels import _launch as launch_mod

        global _launch
        _launch = launch_mod  # (lazy: the kernels import Triton)
        rt = self.rt
        self.order = rt.order
        self.dev = rt.device.index
        words = (self.words,) if isinstance(self.words, Words) else self.words
        self.zeros = tuple(_flags.bound_zero(w.buf, w.buf.numel()) for w in words)
        fork, joins = rt.event("fork"), [rt.event(i) for i in range(len(self.side))]
        base = getattr(torch._C, "_CudaEventBase", None)
        if base is not None and isinstance(fork, base):  # their C methods: no Python frame per call
            rec, wait = base.record, base.wait
            # ``rec(event, stream)``, ``wait(event, stream)``: the stream waits for the event
            self.rec, self.wait = rec, wait
            self.forks = tuple((lambda c, e=fork, s=s: (rec(e, c), wait(e, s))) for s in self.side)
            self.joins = tuple((lambda c, e=e, s=s: (rec(e, s), wait(e, c))) for s, e in zip(self.side, joins))
        else:
            self.rec, self.wait = (lambda e, s: e.record(s)), (lambda e, s: s.wait_event(e))
            self.forks = tuple((lambda c, s=s: rt.fork(c, s)) for s in self.side)
            self.joins = tuple((lambda c, s=s: rt.join(c, s)) for s in self.side)

    def ready(self) -> bool:
        """The body may run this call (see the module docstring); else the fused body does."""
        if _observe._enabled or torch.autograd.profiler._is_profiler_enabled or _launch.hooks_set():
            return False
        return self.dev is None or _launch._current_device() == self.dev

    def run(self, raw: int, cur: Any, *args: Any) -> Any:
        raise NotImplementedError

    def __call__(self, *args: Any) -> Any:
        if self.prepare is not None:
            args = self.prepare(args)
        rt, order = self.rt, self.order
        order.lock.acquire()
        try:
            cur = rt.current_stream()
            raw = cur.cuda_stream
            order.begin(cur)
            try:
                for z in self.zeros:
                    z(raw, cur)
                for f in self.forks:
                    f(cur)
                out = self.run(raw, cur, *args)
            finally:
                try:
                    for j in self.joins:
                        j(cur)
                finally:
                    order.end(cur)
            report_eager(self.err, self.check)
        finally:
            order.lock.release()
        return out if self.finish is None else self.finish(out)


def gemm_bind(gp: Any) -> Any:
    """The ``bind`` of a GEMM plan: a ``TileGemmPlan``'s, or an engine plan's
    (``kernels.engine.EnginePlan.bind``: the bound launch of the engine it picked, the tile
    GEMM's or the Gluon GEMM's, or None before its pick); None for any other plan, which
    keeps its own launch. (The type is asked, not the attribute: an engine plan's unknown
    attributes fall through to its tile plan's, and a stand-in's ``bind`` could be the tile
    plan's, launching the tile GEMM behind the engine's back.)"""
    from ..kernels.engine import EnginePlan
    from ..kernels.tile_gemm import TileGemmPlan

    if type(gp) is TileGemmPlan or type(gp) is EnginePlan:
        return gp.bind
    return None


def aligned(*ts: torch.Tensor | None) -> bool:
    """Every tensor given starts on a 16-byte boundary (what TMA and the cached launches need)."""
    for t in ts:
        if t is not None and t.data_ptr() % 16:
            return False
    return True


def scan(*ts: torch.Tensor | None) -> tuple[tuple, tuple[int, ...]] | None:
    """One pass over a call's tensors (None kept): per tensor its ``tensor_key`` and its
    data pointer (0 for None); None where the call needs the full path: autograd would
    track a result (``grad_refused``), or a pointer is not on a 16-byte boundary
    (``aligned``), or a tensor has no storage to point at (the full path says what is
    wrong). The planned calls of the ops with a norm read their inputs' keys, alignment and
    pointers here, each tensor's attributes once."""
    grad = torch.is_grad_enabled()
    keys: list = []
    ptrs: list = []
    try:
        for t in ts:
            if t is None:
                keys.append(None)
                ptrs.append(0)
                continue
            p = t.data_ptr()
            if p & 15 or (grad and t.requires_grad):
                return None
            keys.append((t.shape, t.stride(), t.dtype, t.device))
            ptrs.append(p)
    except RuntimeError:  # (no storage: a tensor of a tracing mode)
        return None
    return tuple(keys), tuple(ptrs)


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """What the full path's checks read of an optional tensor: shape, strides, dtype, device."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def grad_refused(*ts: torch.Tensor | None) -> bool:
    """Autograd would track a result of these inputs (the full path then refuses the call)."""
    if not torch.is_grad_enabled():
        return False
    for t in ts:
        if t is not None and t.requires_grad:
            return True
    return False
