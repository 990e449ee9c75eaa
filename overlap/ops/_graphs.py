"""Plan graphs: a bound body's work captured once as a private CUDA graph, replayed per call.

An eager call from a bound body (``_calls.BoundBody``) still makes a dozen native calls
(collectives, flag posts, launches, allocations, events, the words' zeroing): measured on
an H200 at 512 x 1024 x 1024, about 130 us of host time against torch.mm's 15 us, while
its GPU work takes about 17 us. For such a signature the host sets the pace. A plan graph
takes the host out of it: at the signature's ``CAPTURE_AT``-th planned call the op's fused
body (the full path's ``_fused``, which a user's capture already runs: words of its own,
zeroed inside the graph, every wait against 1) is captured into a graph of its own, on a
capture stream, reading contiguous static copies of the call's moving inputs (the
activations: the rows, the residual) and the call's fixed inputs (weights, the norm's
weight and bias) in place. What the capture keeps alive (its words, its GEMM plans) goes
to the graph (``_state.capture_sink``), freed with it. Every later call of the signature::

    key -> CallPlan -> agree (counted) -> order -> copy moving inputs -> replay
        -> clone outputs -> order end -> error report -> outputs

How a replay's copies in and out are made (memcpy nodes, driver copies, or the graph's own
kernels from a relay): ``_graph_copies``.

A replay is ordered like an eager call (``DeviceOrder`` under its lock: after the previous
call, whatever its stream), reports a timeout as the op's config says, and returns new
tensors (the graph's outputs are cloned: a later replay never changes an earlier result).

``mlp_chain`` (one GPU, no group) has call plans too: its "body" (``chain._Body``) is its
fused body with the plan's config, and its replay has no agreement point (its plan's
transport is "local").

When a signature gets a graph (``OVERLAP_PLAN_GRAPHS``, read when a body is made):

- ``auto`` (the default): where the GEMM work is at most ``AUTO_FLOPS`` (there the host
  sets the pace; above it the copies and clones would cost GPU time that the host no
  longer hides);
- ``always``: every signature with a bound body; ``off``: none.

A graph is replayed only for the fixed inputs it captured (their data pointers compared
per call; their values may change in place, as an optimizer changes weights). A model's
layers of one shape share a signature, each with its own weights: a signature keeps a
graph per set of fixed inputs, up to ``PER_SIGNATURE``: the one of the last call and the
others parked until their inputs come back. A set of fixed inputs is captured once it has
come in ``CAPTURE_AT`` calls; until then, and where the signature's graphs are all taken
(one parked but not replayed in ``STALE_CALLS`` calls of the signature makes room: it is
retired, freed by a later capture once an event behind its last replay has completed, no
wait), its calls run the bound body. After ``MAX_CAPTURES`` captures the signature is
taken as having fixed inputs that move every call: never captured again, its graphs
dropped. A capture that fails (an op whose body cannot be captured) runs the call as
before, and the signature is never captured again (its other graphs dropped). At most
``MAX_GRAPHS`` graphs live at
once per process, and none is captured on a device whose graphs hold ``graph_mb()`` MiB or
more as measured at their captures (``OVERLAP_PLAN_GRAPH_MB``).

Every rank decides alike: the count is of planned calls of a signature that every rank
makes (agreed shapes, the same setting). While profiling (``overlap.observe`` or torch's
profiler) a call runs the fused body, timed and drawn, and still counts; the capture is
made at the next call not profiled. Fixed inputs moved on one rank and not another, or
profiling on one rank only, make one rank's call eager while another replays; both queue
the same collectives (NCCL mixes captured and eager calls on one communicator).

Graphs are dropped with their plans (``clear_call_plans``) and before a runtime's
communicators are destroyed (``drop_graphs``, from ``reset_runtimes``; every live graph of
the runtime, its call plan cached or evicted, after a device synchronize; ``clear_call_plans``
retires them instead, with no wait): a captured
collective must not outlive its communicator. The decision and the capture are made under
the device's order lock; a replay finds its graph still there under it, or runs the fused
body.
"""

from __future__ import annotations

import os
import functools
import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch

from .. import observe as _observe
from . import _graph_nodes, _state
from ._graph_copies import _cloned, _cloner, _copier, _pair_or_one, _tensors
from ._plans import report_eager
from ._runtime import check_agreed

__all__ = ["PlanGraph", "replay_or_capture", "drop_graphs", "mode", "AUTO_FLOPS", "CAPTURE_AT", "MAX_CAPTURES",
           "MAX_GRAPHS", "PER_SIGNATURE", "STALE_CALLS", "GRAPH_MB", "graph_mb", "NO", "stats", "live"]

AUTO_FLOPS = 2 ** 35
"""``auto``: a signature whose GEMMs take at most this many flops (about 34 GFLOP, some
60 us of an H200's bf16 work) gets a graph."""

CAPTURE_AT = 3
"""The planned call of a signature (with its fixed inputs unmoved) that captures it: the
first calls compile, tune and bind; the graph is made once they are done."""

PER_SIGNATURE = 32
"""Graphs one signature keeps at once, one per set of fixed inputs (a model's layers of one
shape share a signature, each with its own weights): the one last replayed and those
parked for their fixed inputs' next call."""

STALE_CALLS = 4 * PER_SIGNATURE
"""A parked graph not replayed in this many calls of its signature may make room for
another set of fixed inputs."""

MAX_CAPTURES = 4 * PER_SIGNATURE
"""Captures of one signature before its fixed inputs are taken as moving every call."""

MAX_GRAPHS = 64
"""Plan graphs alive at once in the process (each holds its buffers in a pool of its own)."""

GRAPH_MB = 2048
"""Memory the plan graphs of one device may hold, in MiB (``OVERLAP_PLAN_GRAPH_MB``, read
at each capture; each graph's share measured at its capture: the device's reserved memory
it added, at least its static inputs): once they hold that much, no signature is captured."""


def graph_mb() -> float:
    """``OVERLAP_PLAN_GRAPH_MB`` (a number of MiB), else ``GRAPH_MB``; another value is
    warned once and ``GRAPH_MB`` taken (read at a capture, after the call's agreement
    point: it must not raise on one rank)."""
    raw = os.environ.get("OVERLAP_PLAN_GRAPH_MB", "").strip()
    if not raw:
        return GRAPH_MB
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb >= 0:
        _state.warn_once(f"plan-graph-mb-{raw}", f"OVERLAP_PLAN_GRAPH_MB={raw!r}: expected a number of MiB, 0 or "
                         f"more; plan graphs take the default ({GRAPH_MB})")
        return GRAPH_MB
    return mb


def _reserved(dev: Any) -> int:
    fn = getattr(_cuda, "memory_reserved", None)
    return int(fn(dev)) if fn is not None else 0

_cuda: Any = torch.cuda
"""What the graphs are made with (``torch.cuda``; a stand-in in the CPU tests)."""

NO = object()
"""``replay_or_capture``'s answer when the call is not run from a graph."""

_FUSED = object()
"""``_node_call``'s answer when the call must run the fused body (its graph dropped)."""

stats: dict[str, int] = {"captured": 0, "replayed": 0, "refused": 0, "dropped": 0, "relayed": 0, "noded": 0}
"""Graphs captured, calls replayed, captures that failed or were refused, graphs dropped,
replays whose copies the graph made from a relay (``kernels.relay``) or through its own
memcpy nodes (``_graph_nodes``)."""

live: "weakref.WeakSet[PlanGraph]" = weakref.WeakSet()
"""The plan graphs alive."""

_glock = threading.Lock()
"""Guards ``live`` and ``_retired`` (shared by every device; each device's calls hold only
that device's order lock). Never held while a graph is freed or a device waited for."""

_MODES = {"auto": "auto", "": "auto", "always": "always", "1": "always", "on": "always", "off": "off", "0": "off",
          "never": "off"}


def mode() -> str:
    """``OVERLAP_PLAN_GRAPHS`` as ``auto``, ``always`` or ``off`` (a value outside those raises)."""
    raw = os.environ.get("OVERLAP_PLAN_GRAPHS", "auto").strip().lower()
    if raw not in _MODES:
        raise ValueError(f"OVERLAP_PLAN_GRAPHS={raw!r}: expected auto, always or off")
    return _MODES[raw]


def wanted(flops: int, setting: str | None = None) -> bool:
    """A body of ``flops`` GEMM work gets a graph under ``setting`` (default: ``mode()``)."""
    setting = mode() if setting is None else setting
    return setting == "always" or (setting == "auto" and flops <= AUTO_FLOPS)


def _fixed_ptrs(args: tuple, moving: tuple[int, ...]) -> tuple:
    """The data pointers of the fixed inputs (tensors, and a norm's weight and bias), and
    which inputs are None (the call key tells those apart already; kept here too, so a
    graph never runs without an input it read)."""
    out = []
    for i, x in enumerate(args):
        if x is None:
            out.append(i)
            continue
        if i in moving:
            continue
        if isinstance(x, torch.Tensor):
            out.append(x.data_ptr())
        else:
            for name in ("weight", "bias"):
                t = getattr(x, name, None)
                if isinstance(t, torch.Tensor):
                    out.append(t.data_ptr())
    return tuple(out)


class PlanGraph:
    """One signature's captured body: the graph, its static inputs, its outputs, the fixed
    inputs' pointers it captured, and the words it owns."""

    __slots__ = ("graph", "statics", "moving", "out", "ptrs", "keep", "streams", "last", "device", "index",
                 "clone", "owner", "copiers", "replay", "relay", "rin", "rout", "holder", "fin", "nodes", "held",
                 "bytes", "__weakref__")

    def __init__(self, graph: Any, statics: list, moving: tuple[int, ...], out: Any, ptrs: tuple,
                 keep: list, stream: Any, device: Any, owner: int, relay: Any = None,
                 rin: tuple = (), rout: tuple = (), nodes: Any = None, held: tuple = ()) -> None:
        self.graph, self.statics, self.moving, self.out, self.ptrs, self.keep = \
            graph, statics, moving, out, ptrs, keep
        self.owner = owner
        """``id`` of the runtime whose communicators the graph captured."""
        self.bytes = 0
        """The device memory the graph holds, as measured at its capture (``GRAPH_MB``)."""
        self.streams = {id(stream)}
        """The streams its static inputs were used on (each recorded on them: their memory
        is not reused before a replay there has ended; a runtime keeps one ``Stream``
        object per stream, so an id names one)."""
        self.last = stream
        self.device = device
        self.index = device.index if getattr(device, "type", None) == "cuda" else None
        self.clone = _cloner(out)
        """``out`` -> new tensors of the same structure."""
        self.copiers = {i: _copier(statics[i]) for i in moving if statics[i] is not None}
        """Per moving input: ``f(src, raw_stream) -> bool``, one driver copy of a contiguous
        ``src`` into its static input (False: the caller copies with ``copy_``)."""
        base = getattr(torch._C, "_CUDAGraph", None)
        self.replay = functools.partial(base.replay, graph) if base is not None and isinstance(graph, base) else None
        """The graph's replay as one C call (torch's ``CUDAGraph.replay`` adds a Python frame
        and a check of a pool tracker the library's graphs do not use); None: ``graph.replay``."""
        self.relay, self.rin, self.rout = relay, rin, rout
        """``relay``: the graph's ring of slots (``kernels.relay.Relay``) where its copies are
        kernels of its own, or None (driver copies per call). ``rin``: per relayed input
        (index, column, shape, dtype); ``rout``: per relayed output (column, the graph's
        output), empty where the outputs are cloned (another structure than a tensor or a
        pair of contiguous tensors)."""
        self.nodes = nodes
        """``_graph_nodes.Nodes`` where the graph copies through memcpy nodes of its own,
        re-pointed per call; else None (then ``statics`` and ``out`` are what driver copies
        write into and clone from: in a graph captured with its nodes, their placeholders)."""
        self.held = tuple(statics[i] for i in moving if statics[i] is not None) + tuple(held)
        """The tensors allocated outside the capture that the graph reads (recorded on each
        stream it is replayed on)."""
        self.holder = [stream]
        """The stream of the last replay, for ``fin``."""
        self.fin = None
        """A graph freed without ``drop`` (its call plan freed) retires its relay."""
        if relay is not None:
            self.fin = weakref.finalize(self, _retire_relay, self.holder, relay, device)
            self.fin.atexit = False  # (at exit the process's memory goes anyway)

    def __repr__(self) -> str:
        how = f"; {self.nodes!r}" if self.nodes is not None else (" (relay)" if self.relay is not None else "")
        return (f"PlanGraph(moving inputs {list(self.moving)} copied in, "
                f"{len(self.ptrs)} fixed input(s) read in place{how})")

    def drop(self, wait: bool = True) -> None:
        """Free the graph once its replays have ended: ``wait``, after a device synchronize;
        else retired (``_retired``: freed by a later capture or drop once an event recorded
        behind its last replay has completed; no wait on the caller's path)."""
        if self.graph is None:
            return
        if self.fin is not None:
            self.fin.detach()  # retired with the graph below (its ``keep`` holds the relay)
        if wait:
            _cuda.synchronize(self.device)
            _free(self.graph)
        else:
            ev = _cuda.Event()
            ev.record(self.last)  # calls are in one device order: the last replay ends after every other
            with _glock:  # (``held``: the statics a graph with memcpy nodes reads behind its placeholders)
                _retired.append((ev, self.device, self.graph, self.statics, self.keep + list(self.held)))
        self.graph = None
        self.statics = self.out = self.keep = self.clone = self.last = self.copiers = self.replay = None
        self.relay = self.nodes = None
        self.held = ()


def _free(graph: Any) -> None:
    reset = getattr(graph, "reset", None)
    if reset is not None:
        reset()


_retired: list[tuple] = []
"""Dropped graphs whose last replay may still run: (event, device, graph, what it holds)."""


def _reap(device: Any = None) -> None:
    """Free the retired graphs whose replays have ended (an event query each: no wait);
    with ``device``, every one of that device, after a synchronize."""
    with _glock:
        mine = [r for r in _retired if device is not None and r[1] == device]
        if mine:
            _retired[:] = [r for r in _retired if r[1] != device]
    if mine:
        _cuda.synchronize(device)
        for r in mine:
            _free(r[2])
    with _glock:
        done = [r for r in _retired if r[0].query()]
        if done:
            _retired[:] = [r for r in _retired if not any(r is d for d in done)]
    for r in done:
        _free(r[2])


class GraphState:
    """Per bound body: the counts towards a capture per set of fixed inputs' pointers, the
    captures made, the graph of the last replayed call (None, or a ``PlanGraph``), the
    graphs parked for other fixed inputs (pointers -> (graph, the signature's call count at
    its last replay)), the signature's calls, and ``off`` (True once the signature is never
    captured again)."""

    __slots__ = ("counts", "counted", "captures", "graph", "parked", "calls", "off")

    def __init__(self, want: bool) -> None:
        self.counts: dict[tuple, int] = {}
        self.counted: tuple | None = None
        self.captures, self.graph, self.off, self.calls = 0, None, not want, 0
        self.parked: OrderedDict[tuple, tuple[PlanGraph, int]] = OrderedDict()

    @property
    def count(self) -> int:
        """The count towards a capture of the pointers counted last (0 once captured)."""
        return self.counts.get(self.counted, 0)


def state_for(body: Any) -> GraphState | None:
    """``body.gstate``, made on first use from ``body.flops`` (None: a body without graph
    support)."""
    st = getattr(body, "gstate", None)
    if st is None:
        flops = getattr(body, "flops", None)
        if flops is None:
            return None
        st = vars(body).setdefault("gstate", GraphState(wanted(flops)))  # one per body, threads or not
    return st


def replay_or_capture(rt: Any, cp: Any, body: Any, args: tuple, ptrs: tuple | None = None) -> Any:
    """The call run from the signature's graph (replayed, or captured now and replayed),
    or ``NO``: the caller runs it as before. Counts the call towards a capture. ``ptrs``:
    the data pointers of every input the graph reads in place (its fixed inputs, read by
    the caller already; an op gives them in one order on every call), else read here
    (``_fixed_ptrs``)."""
    st = state_for(body)
    if st is None or st.off:
        return NO
    if ptrs is None:
        ptrs = _fixed_ptrs(args, body.moving)
    # while profiling, the call runs the fused body (its ranges drawn, its phases timed);
    # it still counts towards the capture, made at the next call not profiled
    profiling = _observe._enabled or torch.autograd.profiler._is_profiler_enabled
    with rt.order.lock:  # (an RLock: decided with no other thread's call of this device in between)
        st.calls += 1
        g = st.graph
        if g is not None and g.graph is None:  # dropped by ``drop_graphs``
            st.graph = g = None
        if g is not None and g.ptrs != ptrs:
            # another set of fixed inputs (another layer's weights): this graph is parked
            # for its own inputs' next call, that set's graph taken if one is parked
            st.parked[g.ptrs] = (g, st.calls - 1)
            st.graph = g = None
        if g is None and st.parked:
            hit = st.parked.pop(ptrs, None)
            if hit is not None and hit[0].graph is not None:
                st.graph = g = hit[0]
        if g is not None and g.relay is not None:
            bad = g.relay.failed()
            if bad:  # (before the agreement point: a raise here is the call's refusal)
                _drop(st, wait=False)
                st.off = True
                raise RuntimeError(f"{cp.op}: the plan graph's call {bad} did not make its copies (its slot was "
                                   "not written for it, or its replay failed); its outputs are not valid. The "
                                   "signature now runs without a plan graph")
        if g is not None and profiling:
            return NO
        if g is not None and g.relay is not None:
            if not g.relay.room():
                return NO  # its slots all in flight (the GPU far behind): this call runs without the graph
        if g is None:
            if st.off:
                return NO
            counts = st.counts
            n = counts.pop(ptrs, 0) + 1
            if len(counts) >= MAX_CAPTURES:  # (pointers that never came back)
                counts.clear()
            counts[ptrs] = n
            st.counted = ptrs
            if n < CAPTURE_AT or profiling:
                return NO
            if st.captures >= MAX_CAPTURES:
                st.off = True
                _drop_parked(st)
                return NO
            if len(st.parked) >= PER_SIGNATURE and not _unpark_stale(st):
                counts[ptrs] = 0  # the signature's graphs all in use: tried again after CAPTURE_AT more calls
                return NO
            _reap()
            with _glock:
                held = sum(g.bytes for g in live if g.device == rt.device)
                full = len(live) >= MAX_GRAPHS or held >= graph_mb() * (1 << 20)
            if full:
                counts[ptrs] = 0  # tried again after CAPTURE_AT more calls
                return NO
            del counts[ptrs]
            st.captures += 1
            g = _capture(rt, cp.op, body, args, ptrs)
            if g is None:
                st.off = True
                _drop(st, wait=False)  # (its other weights' graphs too: never replayed again)
                stats["refused"] += 1
                return NO
            st.graph = g
            with _glock:
                live.add(g)
            stats["captured"] += 1
    return _replay(rt, cp, body, g, args)


def _drop(st: GraphState, wait: bool = True) -> None:
    """Drop the signature's graphs: its current one and those parked."""
    _drop_parked(st, wait)
    if st.graph is not None:
        _drop_one(st.graph, wait)
        st.graph = None
        if not wait:
            _reap()  # what earlier drops retired and has ended


def _drop_one(g: PlanGraph, wait: bool) -> None:
    g.drop(wait)
    with _glock:
        live.discard(g)
    stats["dropped"] += 1


def _drop_parked(st: GraphState, wait: bool = False) -> None:
    while st.parked:
        _drop_one(st.parked.popitem(last=False)[1][0], wait)


def _unpark_stale(st: GraphState) -> bool:
    """Drop the parked graph replayed longest ago if that was over ``STALE_CALLS`` calls of
    the signature ago (its fixed inputs gone, or a rare layer); True where one was."""
    ptrs, (g, last) = min(st.parked.items(), key=lambda kv: kv[1][1])
    if st.calls - last <= STALE_CALLS:
        return False
    del st.parked[ptrs]
    _drop_one(g, wait=False)
    return True


def _capture(rt: Any, op: str, body: Any, args: tuple, ptrs: tuple) -> PlanGraph | None:
    """Capture ``body.fused`` on static copies of the moving inputs (contiguous: a copy
    into them takes any input, an expanded one too); None where it cannot be (a failed
    capture, an output that is an input's memory). What the capture keeps alive (plans,
    tables, words: ``_state.capture_sink``) belongs to the graph."""
    moving = body.moving
    dev = rt.device
    statics = list(args)
    before = _reserved(dev)
    with rt.order.lock, _cuda.device(dev):
        cur = rt.current_stream()
        with _state.capture_sink() as keep:
            # everything here comes before the call's agreement point: a failure (an allocation,
            # the capture) must not raise on this rank alone, so the call runs as before
            cap = relay = None
            try:
                for i in moving:
                    x = args[i]
                    if x is not None:
                        statics[i] = torch.empty(x.shape, dtype=x.dtype, device=x.device)
                cols = [i for i in moving if statics[i] is not None]
                how = copies()
                # (made before the capture stream waits for this one: its counter's zeroing is ordered first)
                relay = _make_relay(dev, len(cols) + 2) if how == "graph" and _relay_ok(dev) else None
                graph = None
                if how == "nodes" and all(statics[i].numel() for i in cols) and _graph_nodes.usable(dev, _cuda):
                    graph = _graph_nodes.new_graph(_cuda)  # kept after its capture: its nodes are looked up
                noded = graph is not None
                # the placeholders the graph's input nodes copy from until a call points them elsewhere
                phs = {i: torch.empty_like(statics[i]) for i in cols} if noded else {}
                cap = _capture_stream(rt)
                cap.wait_stream(cur)
                rin: list = []
                rout: list = []
                obufs: list = []
                if graph is None:
                    graph = _cuda.CUDAGraph()
                with _cuda.stream(cap):
                    if relay is not None:
                        relay.warm(statics, cols)  # compiled and loaded outside the capture
                    graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        if relay is not None:
                            relay.begin()
                            rin = [(i, relay.copy_in(statics[i]), statics[i].shape, statics[i].dtype) for i in cols]
                        for i in phs:
                            _graph_nodes.capture_copy(statics[i], phs[i], cap)
                        out = body.fused(*statics)
                        if relay is not None:
                            outs = _pair_or_one(out)
                            if outs is not None:
                                rout = [(relay.copy_out(o), o) for o in outs]
                            relay.advance()
                        if noded:
                            outs = _pair_or_one(out)
                            if outs is not None:  # (else the outputs are cloned per call)
                                obufs = [(o, torch.empty_like(o)) for o in outs]
                                for o, ob in obufs:
                                    _graph_nodes.capture_copy(ob, o, cap)
                    finally:
                        graph.capture_end()
                if noded:
                    graph.instantiate()  # (a kept graph is instantiated by hand: a failure refuses the capture)
                if relay is not None:
                    keep.append(relay)  # its pinned slots live as long as the graph's replays
            except Exception as e:  # noqa: BLE001 - the call runs as before; the signature is not captured again
                _state.warn_once(f"plan-graph-{op}-{type(e).__name__}",
                                 f"{op}: a call plan's graph could not be captured ({type(e).__name__}: {e}); "
                                 "its signature runs without one")
                if relay is not None and cap is not None:
                    _retire_relay([cap], relay, dev)  # its warm-up may still run on the capture stream
                return None
            finally:
                if cap is not None:
                    cur.wait_stream(cap)
        outs = _tensors(out)
        ins = [statics[i] for i in moving if statics[i] is not None]
        if outs is None or any(o.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()
                               for o in outs for s in ins):
            graph.reset()
            if relay is not None:
                _retire_relay([cur], relay, dev)  # (cur waits for the capture stream's warm-up)
            return None
        nodes = None
        inner: tuple = ()
        if noded and (phs or obufs):  # (nothing to re-point: a plain replay)
            nodes = _graph_nodes.bind(graph, [(i, statics[i], phs[i]) for i in phs], obufs, len(obufs) == 2)
            if nodes is None:
                _state.warn_once(f"plan-graph-nodes-{op}", f"{op}: a plan graph's memcpy nodes could not be found; "
                                 "its calls copy with the driver (OVERLAP_PLAN_GRAPH_COPIES=nodes)")
            # driver copies (``nodes`` None, or given up later) go into the placeholders and out of
            # the output nodes' placeholders, which the graph's own nodes copy from and into
            inner = tuple(statics[i] for i in phs)
            statics = [phs.get(i, x) for i, x in enumerate(statics)]
            if obufs:
                out = obufs[0][1] if len(obufs) == 1 else (obufs[0][1], obufs[1][1])
        # the fixed inputs (weights) are the caller's: read in place by a replay whose call
        # holds them at the pointers captured, not held in the graph's statics (a parked
        # graph's statics keep no old model's weights alive)
        statics = [x if i in moving else None for i, x in enumerate(statics)]
        pg = PlanGraph(graph, statics, moving, out, ptrs, keep, cur, dev, id(rt), relay, tuple(rin), tuple(rout),
                       nodes, inner)
        # its share of the device's memory: the reserved memory its capture added (its pool,
        # any new segment under its static inputs), at least its static inputs and placeholders
        mine = [statics[i] for i in moving if isinstance(statics[i], torch.Tensor)] + list(inner)
        pg.bytes = max(_reserved(dev) - before, sum(t.numel() * t.element_size() for t in mine))
        return pg


COPIES: str | None = None
"""How plan graphs captured from now on copy their activations in and their outputs out:
``nodes`` (memcpy nodes of the graph, re-pointed per call: ``_graph_nodes``; driver copies
where the driver or torch cannot keep and update a graph), ``driver`` (a driver copy per
activation and output per call) or ``graph`` (kernels of the graph, from addresses the host
leaves in pinned slots: ``kernels.relay``); None: as ``OVERLAP_PLAN_GRAPH_COPIES`` says
(``DEFAULT_COPIES`` where unset), read at each capture."""

DEFAULT_COPIES = "nodes"
"""Measured on an H200 (world size 1, 512 x 1024 x 1024, 300 calls, one process): memcpy nodes
took 32-36 us a call of ``all_gather_matmul`` against 51.5 with driver copies, and less on
each of the five group ops (docs/experiments.md, 2026-12-05)."""

_COPIES = ("driver", "graph", "nodes")


def copies() -> str:
    """``COPIES``, or ``OVERLAP_PLAN_GRAPH_COPIES`` (unset: ``DEFAULT_COPIES``; another value:
    warned, ``DEFAULT_COPIES``)."""
    if COPIES is not None:
        return COPIES
    raw = os.environ.get("OVERLAP_PLAN_GRAPH_COPIES", "").strip().lower() or DEFAULT_COPIES
    if raw in _COPIES:
        return raw
    _state.warn_once(f"plan-graph-copies-{raw}", f"OVERLAP_PLAN_GRAPH_COPIES={raw!r}: expected nodes, driver or "
                     f"graph; plan graphs copy as the default ({DEFAULT_COPIES})")
    return DEFAULT_COPIES


def _retire_relay(holder: list, relay: Any, device: Any) -> None:
    """A relay whose graph went without ``drop`` (its plan freed): its pinned slots kept
    until an event behind the graph's last replay (or the capture stream's work) has
    completed, as a retired graph's (the host allocator would hand them out at once)."""
    try:
        ev = _cuda.Event()
        ev.record(holder[0])
    except Exception:  # noqa: BLE001 - no event to be had (the context is gone): kept for good
        _abandoned.append(relay)
        return
    with _glock:
        _retired.append((ev, device, None, None, [relay]))


def _relay_ok(dev: Any) -> bool:
    """Relayed copies on this device: a CUDA device under the real ``torch.cuda``."""
    return _cuda is torch.cuda and getattr(dev, "type", None) == "cuda"


def _make_relay(dev: Any, cols: int) -> Any:
    from ..kernels.relay import Relay

    return Relay(dev, cols)


def _capture_stream(rt: Any) -> Any:
    s = getattr(rt, "_graph_stream", None)
    if s is None:
        s = rt._graph_stream = _cuda.Stream(rt.device)
    return s


def _replay(rt: Any, cp: Any, body: Any, g: PlanGraph, args: tuple) -> Any:
    """One call from the graph, as the bound body's frame orders it (see the module
    docstring); the error word reported as the op's config says."""
    if cp.transport != "local":  # (a one-GPU op, the chain, has no ranks to agree with)
        check_agreed(rt, cp.op, cp.names, cp.values, cp.key)
    _observe.record_call(cp.op, cp.shape, cp.path, cp.why)
    order = rt.order
    with order.lock:
        if g.graph is None:  # dropped by another thread since it was picked: the fused body runs the call
            out = body.fused(*args)
            rt.seen.add((cp.op, cp.sig))
            return out
        cur = rt.current_stream()
        order.begin(cur)
        out = NO
        try:  # on the current stream (a replay launches there, on the graph's device)
            statics = g.statics
            if cur is not g.last:
                g.last = g.holder[0] = cur
                if id(cur) not in g.streams:  # the statics' memory not reused while this stream reads them
                    g.streams.add(id(cur))
                    for t in g.held:
                        t.record_stream(cur)
            relay = g.relay
            if relay is not None:
                # the graph copies: the addresses of this call's activations and of its new
                # outputs go into its next slot (an input that is not contiguous, copied here)
                addrs = [0] * relay.cols
                for i, col, shape, dtype in g.rin:
                    x = args[i]
                    p = x.data_ptr()
                    if x.dtype is dtype and x.shape == shape and not p & 15 and x.is_contiguous():
                        addrs[col - 1] = p
                    else:  # (the copy kernels read 16-byte-aligned words)
                        statics[i].copy_(x)
                if g.rout:
                    news = [torch.empty_like(o) for _c, o in g.rout]
                    for (col, _o), t in zip(g.rout, news):
                        addrs[col - 1] = t.data_ptr()
                relay.post(addrs)
                try:
                    if g.replay is not None:
                        g.replay()
                    else:
                        g.graph.replay()
                except BaseException:
                    relay.lost()  # posted, never replayed: the graph's counter is behind its slots
                    raise
                if g.rout:
                    out = news[0] if len(news) == 1 else (news[0], news[1])
                else:
                    out = _cloned(g.out)
                stats["relayed"] += 1
            else:
                raw = cur.cuda_stream
                # the driver copies run in the thread's current context: the runtime's device only
                drv = (_get_device() if _cuda is torch.cuda else _cuda.current_device()) == g.index
                out = NO if g.nodes is None else _node_call(body, g, args, raw, drv)
                if out is _FUSED:
                    pass  # (run below, once this call's order is ended: the body keeps its own)
                elif out is NO:
                    copiers = g.copiers
                    for i in g.moving:
                        x = args[i]
                        if x is not None and not (drv and copiers[i](x, raw)):
                            statics[i].copy_(x)
                    if g.replay is not None:
                        g.replay()
                    else:
                        g.graph.replay()
                    out = g.clone(raw) if drv else _cloned(g.out)
        finally:
            order.end(cur)
        if out is _FUSED:  # its graph dropped before anything was queued: the same collectives, eagerly
            out = body.fused(*args)
            rt.seen.add((cp.op, cp.sig))
            return out
        stats["replayed"] += 1  # (counted with how it copied, before a report that may raise)
        report_eager(body.err, body.check)
    _seen(rt.seen, (cp.op, cp.sig))
    return out


def _node_call(body: Any, g: PlanGraph, args: tuple, raw: int, drv: bool) -> Any:
    """The call through the graph's memcpy nodes (``_graph_nodes``): its outputs, or ``NO``
    where the driver refused a node's update: the nodes are pointed back at their
    placeholders and the graph copies with the driver from then on (this call too); or
    ``_FUSED`` where even that was refused: the graph is dropped, the signature runs without
    one, and this call runs the fused body (after the agreement point a raise on one rank
    would leave its peers' collectives waiting)."""
    nd = g.nodes
    try:
        if drv:
            out = nd.call(args, raw)
        else:  # (the launch on the graph's device)
            with _cuda.device(g.index):
                out = nd.call(args, raw)
    except _graph_nodes.NodeUpdateError as e:
        g.nodes = None
        if not nd.restore():
            st = state_for(body)
            _drop(st, wait=False)
            st.off = True
            _state.warn_once("plan-graph-nodes-restore", f"a plan graph's memcpy node could not be updated (CUresult "
                             f"{e}) nor pointed back at its placeholder; that signature runs without a plan graph")
            return _FUSED
        _state.warn_once("plan-graph-nodes-update", f"a plan graph's memcpy node could not be updated (CUresult {e}); "
                         "that graph copies with the driver from now on")
        return NO
    stats["noded"] += 1
    if out is None:  # (outputs of another structure than a tensor or a pair: cloned)
        out = g.clone(raw) if drv else _cloned(g.out)
    return out


def _seen(seen: Any, key: tuple) -> None:
    """``seen.add(key)`` (``mark_warm``: a user's later capture of the signature needs it),
    as one C call where the key is there already (the usual case: a replayed signature ran
    eagerly before it was captured)."""
    if isinstance(seen, OrderedDict):
        try:
            _move_to_end(seen, key)
            return
        except KeyError:
            pass
    seen.add(key)


_move_to_end = OrderedDict.move_to_end
_get_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
"""``torch.cuda.current_device()`` without its lazy-init check (a replay follows a capture:
CUDA is initialized)."""


_abandoned: list[PlanGraph] = []
"""Graphs whose communicators were aborted: never freed (freeing a captured collective
after its communicator is gone is not safe)."""


def drop_graphs(rt: Any, free: bool = True, wait: bool = True) -> None:
    """Drop the plan graphs of ``rt``'s call plans: before its communicators are destroyed
    (a captured collective must not outlive its communicator), or, ``free=False``, after
    they were aborted (the graphs are then kept, never replayed). ``wait=False`` (the plans
    cleared while the communicators live on): the graphs retired, freed once their last
    replays have ended, with no wait on the device (a dead peer's kernel would hold it).
    Under the device's order
    lock (a replay on another thread finds its graph there or not at all), taken within
    the shutdown bound or not at all (a thread stuck holding it must not hold shutdown)."""
    from ._lifecycle import shutdown_timeout_s

    order = getattr(rt, "order", None)
    locked = order is not None and order.lock.acquire(timeout=shutdown_timeout_s())
    try:
        _drop_graphs(rt, free, wait)
    finally:
        if locked:
            order.lock.release()


def _drop_graphs(rt: Any, free: bool, wait: bool) -> None:
    for name, cache in list(getattr(rt, "_caches", {}).items()):
        if not name.endswith(".calls"):
            continue
        for cp in list(cache.values()):
            st = getattr(getattr(cp, "body", None), "gstate", None)
            if st is not None:
                st.off = True  # the body's runtime is gone (or its plans are)
                if free:
                    _drop(st, wait)
    # every graph of the runtime, its call plan cached or not (evicted, held by the index)
    with _glock:
        mine = [g for g in list(live) if g.owner == id(rt)]
        for g in mine:
            live.discard(g)
    for g in mine:
        if free:
            g.drop(wait)
            stats["dropped"] += 1
        else:
            _abandoned.append(g)
    dev = getattr(rt, "device", None)
    if dev is None:
        return
    if free:
        _reap(dev if wait else None)
    else:
        with _glock:
            _abandoned.extend(r for r in _retired if r[1] == dev)
            _retired[:] = [r for r in _retired if r[1] != dev]
