"""Per-group state the overlapped ops share: communicators, streams, flags, SM budget.

One ``Runtime`` per (group ranks, device), and one per device for single-GPU work (the
chain: ``local_runtime``, world 1, no group). It owns

* the library's NCCL communicators over the group, one per CTA cap (capped ones
  for the overlapped path; an uncapped one for the chunked stream baseline),
* a high-priority communication stream (NCCL kernels launched there are
  scheduled ahead of queued GEMM work) and a high-priority auxiliary stream
  (per-chunk prologues such as the all-reduce op's residual add and norm),
* flag arrays and an error word per op,
* every per-shape cache of the ops (``Runtime.cache``: plans, tuned configs, row
  permutations, the ranks' agreement keys, the chain's tables), so that
  ``overlap.dist.shutdown`` (``reset_runtimes``) drops them with the communicators,

and knows the SM count, from which the GEMM grid is sized so that NCCL's CTAs
always find free SMs (a persistent grid over every SM, spinning on flags that
NCCL must set, never lets NCCL run: a hang, docs/design.md).
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from .. import flags as _flags
from .. import observe as _observe
from .._fields import bool_field, choice_field, float_field, int_field
from ..dist import shared as _share
from . import _agree

__all__ = ["LRU", "keep_for_capture", "Runtime", "get_runtime", "local_runtime", "OverlapConfig", "NcclTransport", "PeerCopyTransport", "warn_once", "resolve_group", "check_agree", "time_ms",
           "report_errors", "fused_call", "on_stream", "time_candidates", "split_variants", "ws_variants", "gemm_plan",
           "OverlapCaptureError", "capturing", "device_order", "check_errors", "register_error_word", "reset",
           "Sequential", "Chunked", "Path", "SEQUENTIAL", "tune_paths", "flat_variants"]

_lock = threading.Lock()
_runtimes: dict[tuple, "Runtime"] = {}
"""By (group ranks, device index); the local runtimes by (None, device index)."""
_warned: set[str] = set()  # process-global: a warning is once per process, whatever shutdowns come between


class LRU(OrderedDict):
    """A dict of at most ``cap`` entries; setting a new key past the cap drops the least
    recently used one. Every per-shape cache of the ops is one of these: a server whose
    token count M changes every call would otherwise grow them without bound. Reads and
    writes take a lock (the ops run from several threads; their caches are shared).

    Evicting is safe for eager calls (an entry is rebuilt on its next use) but not for
    what a CUDA graph captured: a graph holds the device addresses of a plan's tables
    and words for as long as it lives, so a plan used inside a capture is also kept by
    ``keep_for_capture`` and is never freed."""

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
                self.popitem(last=False)

    def add(self, key: Any) -> None:
        """Use as a bounded set: remember ``key``."""
        self[key] = True


_kept_for_capture: list[Any] = []  # process-global: a graph outlives shutdown and holds these addresses


def keep_for_capture(obj: Any) -> Any:
    """Keep ``obj`` (a plan, a table) alive for the life of the process when the current
    stream is capturing: the graph holds its device addresses (see ``LRU``)."""
    if capturing():
        with _lock_kept:
            if not any(o is obj for o in _kept_for_capture):
                _kept_for_capture.append(obj)
    return obj


_lock_kept = threading.Lock()


class OverlapCaptureError(RuntimeError):
    """An op was called inside a CUDA graph capture in a way that cannot be captured
    (its kernels, plans or communicators are made by the first eager call of a shape)."""


def capturing() -> bool:
    """True while the current CUDA stream is capturing a graph. Asked several times per
    call: CUDA initialized (a capture needs it) is a flag read, where
    ``torch.cuda.is_available()`` reads the environment and counts devices."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


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
        if prev is not None and prev != cur and not capturing():
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


MAX_SMS = 512
"""Bound of the config fields that count SMs (margins, reduce programs): more than any GPU has."""
MAX_CHUNKS = 64
"""Bound of ``OverlapConfig.chunks`` (each chunk is an NCCL call or a push and a flag)."""
MIN_TIMEOUT_MS = 1e-3
"""Shortest wait bound a config takes (1 us; a shorter one rounds to no wait at all)."""
MAX_TIMEOUT_MS = 7 * 24 * 3600 * 1000.0
"""Longest wait bound a config takes (a week: a bound, never a hang)."""


def check_gemm_field(owner: str, name: str, v: Any) -> None:
    """``v`` None or an ``overlap.kernels.tile_gemm.GemmConfig`` (looked up only where that
    module is loaded: a GemmConfig cannot exist before)."""
    if v is None:
        return
    import sys

    mod = sys.modules.get("overlap.kernels.tile_gemm")
    if mod is None or not isinstance(v, mod.GemmConfig):
        raise TypeError(f"{owner}.{name} must be an overlap.kernels.tile_gemm.GemmConfig or None, got {v!r} "
                        f"({type(v).__name__})")


@dataclass(frozen=True, kw_only=True)
class NcclTransport:
    """The NCCL transport and its options, for ``OverlapConfig(transport=NcclTransport(...))``
    (the same config as ``transport="nccl"`` with ``nccl_ctas``): rows move in chunked NCCL
    collectives on the library's communicator, whose CTAs hold SMs."""

    name: ClassVar[str] = "nccl"
    ctas: int | None = None
    """Cap on NCCL's CTAs for the op's communicator (``OverlapConfig.nccl_ctas``; its
    bandwidth grows with them; each is an SM the GEMM does not get: docs/design.md, the SM
    budget); ``None``: 16."""

    def __post_init__(self) -> None:
        int_field("NcclTransport", "ctas", self.ctas, 1, 64, none_ok=True)


@dataclass(frozen=True, kw_only=True)
class PeerCopyTransport:
    """The peer-copy transport and its options, for
    ``OverlapConfig(transport=PeerCopyTransport(...))`` (the same config as
    ``transport="p2p"`` with the flat fields of the same names): copy-engine pushes into
    peer memory on one node (``overlap._p2p``; no SM). The options are the all-reduce's;
    the all-gather takes none."""

    name: ClassVar[str] = "p2p"
    reduce_ctas: int | None = None
    """SMs left to the kernel that sums the pushed partials (and adds the residual and
    norms) chunk by chunk, one program each; with ``reduce_shared`` the number of reduce
    programs. ``None``: 16."""
    reduce_shared: bool = False
    """The reduce kernel runs in small programs (4 warps, short column blocks, few
    registers) *beside* the GEMM's programs on the same SMs, instead of on SMs of its own:
    the GEMM grid covers every SM and no give-back grid runs; ``reduce_ctas`` then counts
    the reduce programs. A GEMM program leaves room on its SM for one such program
    (registers and shared memory), so they are resident whichever is dispatched first. Not
    with a warp-specialized GEMM (``GemmConfig.warp_specialize``: ValueError)."""
    two_shot: bool = False
    """Reduce-scatter, then all-gather (instead of every rank summing all rows): each
    rank's reduce kernel sums the 1/R of the rows it owns and pushes each reduced chunk
    back to every peer. With a norm it needs ``fold_norm``; the residual must be the same
    on every rank (``OverlapConfig.two_shot`` has the details)."""
    fold_norm: bool = False
    """With a norm: fold it into the GEMM instead of writing the normed rows (the reduce
    kernel writes each row's statistics, B is replaced by diag(norm weight) B once per
    call, the GEMM's epilogue applies the rest). Ignored without a norm."""

    def __post_init__(self) -> None:
        int_field("PeerCopyTransport", "reduce_ctas", self.reduce_ctas, 1, MAX_SMS, none_ok=True)
        for f in ("reduce_shared", "two_shot", "fold_norm"):
            bool_field("PeerCopyTransport", f, getattr(self, f))


# each typed transport's options: (its field, OverlapConfig's flat field of the same meaning)
_TRANSPORT_FIELDS: dict[type, tuple[tuple[str, str], ...]] = {
    NcclTransport: (("ctas", "nccl_ctas"),),
    PeerCopyTransport: (("reduce_ctas", "reduce_ctas"), ("reduce_shared", "reduce_shared"),
                        ("two_shot", "two_shot"), ("fold_norm", "fold_norm")),
}
_FLAT_DEFAULTS = {"nccl_ctas": None, "reduce_ctas": None, "reduce_shared": False, "two_shot": False,
                  "fold_norm": False}


@dataclass(frozen=True)
class Sequential:
    """A tuner's pick that runs the op's reference (``*_ref``): the collective and the GEMM
    one after the other, for a shape where overlap does not pay. ``str()`` is its label
    in reports and results: ``"sequential"``."""

    def __str__(self) -> str:
        return "sequential"


@dataclass(frozen=True)
class Chunked:
    """A tuner's pick that runs the op's chunked stream-overlap baseline (``*_chunked``)
    in ``chunks`` pieces. ``str()``: ``"chunked x4"``."""

    chunks: int

    def __post_init__(self) -> None:
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 2:
            raise ValueError(f"Chunked: chunks must be an int >= 2, got {self.chunks!r}")

    def __str__(self) -> str:
        return f"chunked x{self.chunks}"


SEQUENTIAL = Sequential()


@dataclass(frozen=True, kw_only=True)
class OverlapConfig:
    """How an overlapped op runs; fields left ``None`` come from the tuner or defaults.

    A transport's options can be given with it, typed: ``transport=NcclTransport(ctas=8)``
    or ``transport=PeerCopyTransport(reduce_ctas=24, fold_norm=True)``. Construction turns
    them into the flat fields (``transport="nccl"``, ``nccl_ctas=8``), so the two spellings
    make equal configs; ``transport_options`` gives the typed form back. Fields that only
    one transport reads are refused with the other one (ValueError); with ``transport=None``
    (chosen at call time) both transports' fields may be set, each read where its
    transport is chosen."""

    chunks: int | None = None
    """NCCL calls the collective is cut into (each followed by a flag post)."""
    nccl_ctas: int | None = None
    """NCCL transport: cap on NCCL's CTAs for the op's communicator (its bandwidth grows
    with them; each is an SM the GEMM does not get: docs/design.md, the SM budget);
    ``None``: 16. ``NcclTransport.ctas``; not with ``transport="p2p"`` (ValueError)."""
    sm_margin: int | None = None
    """SMs left idle beyond NCCL's CTAs (or the reduce kernel's programs); ``None``:
    ``OVERLAP_SM_MARGIN`` (``env_sm_margin``) where set, else 4 on the NCCL transport and 0
    on the peer-copy transport. Where other NCCL traffic shares the GPU (a data-parallel
    all-reduce on torch's communicator), leave at least that communicator's CTA cap free
    (docs/guarantees.md, "Other NCCL traffic")."""
    give_back: bool = True
    """After the last chunk lands (or the p2p all-reduce's reduce kernel ends), launch a
    second GEMM grid on the SMs the first one left, taking tiles from the same dispatch
    counter. Ignored by the p2p all-gather, whose GEMM holds every SM."""
    gemm: Any = None
    """``overlap.kernels.tile_gemm.GemmConfig``; ``None``: the tuned or default one."""
    timeout_ms: float | None = None
    """Bound of one tile's flag wait; ``None``: ``overlap.flags.default_timeout_ms(group)``
    (``OVERLAP_WAIT_TIMEOUT_MS``, else the process groups' timeout: minutes, so that a rank
    arriving seconds late is waited for)."""
    transport: str | NcclTransport | PeerCopyTransport | None = None
    """How rows move between GPUs: "nccl" (chunked NCCL collectives on the
    library's communicator; their CTAs hold SMs) or "p2p" (copy-engine pushes into
    peer memory on one node, ``overlap._p2p``; no SM). ``None``: "p2p" where the
    group's ranks can map each other's memory (``OVERLAP_TRANSPORT`` overrides).
    A ``NcclTransport`` or ``PeerCopyTransport`` gives the transport with its options;
    after construction this field is always the name ("nccl", "p2p") or ``None``."""
    reduce_ctas: int | None = None
    """p2p all-reduce: SMs left to the kernel that sums the pushed partials (and adds
    the residual and norms) chunk by chunk, one program each; ``None``: 16.
    ``PeerCopyTransport.reduce_ctas``; not with ``transport="nccl"`` (ValueError)."""
    reduce_shared: bool = False
    """p2p all-reduce: the reduce kernel runs in small programs (4 warps, short column
    blocks, few registers) *beside* the GEMM's programs on the same SMs, instead of on
    SMs of its own: the GEMM grid covers every SM and no give-back grid runs;
    ``reduce_ctas`` then counts the reduce programs. A GEMM program leaves room on its
    SM for one such program (registers and shared memory), so they are resident
    whichever is dispatched first. Not with a warp-specialized GEMM
    (``GemmConfig.warp_specialize``: ValueError, at construction where the transport is
    "p2p", else when the call picks it: ``check_for``). Not with ``transport="nccl"``."""
    two_shot: bool = False
    """p2p all-reduce: reduce-scatter, then all-gather (instead of every rank summing all
    rows). Each rank's reduce kernel sums only the rows it owns (1/R of them, pushed to it
    by every peer), and its copy stream pushes each reduced chunk (with the folded norm's
    row statistics) back to every peer as soon as it is ready; the GEMM reads its own rows
    from h and the peers' from the shared buffer. The same bytes cross the links as in the
    one-shot push; the reduce kernel does 1/R of the work. With a norm it needs
    ``fold_norm`` (the GEMM must read h, not normed rows; ValueError at the call). The
    residual is added by the rank that reduces a row, so it must be the same on every rank
    (the replicated residual stream of tensor parallelism is). Not with
    ``transport="nccl"``."""
    split_tail: int = 0
    """Split the GEMM's tail tiles along K into at most this many pieces (0 or 1: none):
    on the all-reduce op the tiles of the last row chunk, which all become ready at once
    at the end; on the all-gather op the tiles left over after the grid's last full wave.
    Each tail tile is cut into enough pieces to spread the tail over the GEMM's SMs
    (``overlap.policies.tail_parts``); the piece that finishes last sums the pieces'
    fp32 partials and stores the tile (``overlap.policies.split_tail``)."""
    fold_norm: bool = False
    """p2p all-reduce with a norm: fold the norm into the GEMM instead of writing the
    normed rows. The reduce kernel writes each row's statistics, B is replaced by
    diag(norm weight) B once per call (``overlap.kernels.norm_fold``), and the GEMM
    applies the rest in its epilogue. The reduce kernel then moves the bytes of the
    no-norm case plus the residual, at the cost of one pass over B per call.
    Ignored without a norm, and where ``transport=None`` resolves to NCCL; not with
    ``transport="nccl"``."""
    check: str = "async"
    """Timeout reporting: 'sync' (check after every call; synchronizes), 'async'
    (raise on a later call once the copy of the error word has landed), 'none'. A call
    that returns before its timeout is raised holds NaN where it had no data, with the
    exceptions of docs/guarantees.md, "What a call whose wait expired returns"."""

    def __post_init__(self) -> None:
        self._check_fields()
        typed = self.transport
        if isinstance(typed, (NcclTransport, PeerCopyTransport)):
            # the typed form into the flat fields: equal (and hashing equal) to the flat spelling
            for tf, ff in _TRANSPORT_FIELDS[type(typed)]:
                mine, flat = getattr(typed, tf), getattr(self, ff)
                if flat != _FLAT_DEFAULTS[ff] and flat != mine:
                    raise ValueError(f"transport={typed!r} and {ff}={flat!r} disagree: give the "
                                     f"{typed.name} transport's options in {type(typed).__name__} only")
                if mine != _FLAT_DEFAULTS[ff]:
                    object.__setattr__(self, ff, mine)
            object.__setattr__(self, "transport", typed.name)
        if getattr(self.gemm, "tail_block_m", 0):
            raise ValueError("GemmConfig.tail_block_m/n is for the GEMM alone (launch_gemm): an op's GEMM is one "
                             "launch over its table")
        if getattr(self.gemm, "flatten", False) and (self.give_back or self.split_tail > 1 or self.fold_norm):
            # the flattened kernel takes rows statically: a second grid on the same table
            # would compute them again; it has no split tiles and no folded-norm epilogue
            raise ValueError("a flattened GEMM (GemmConfig.flatten) takes no give-back grid, split tail or folded "
                             "norm: give_back=False, split_tail 0 or 1, fold_norm=False")
        if self.transport is not None:  # else each transport's rules apply where the call picks it
            self.check_for(self.transport)

    def _check_fields(self) -> None:
        """Every field's type and range (``overlap._fields``); the cross-field rules follow."""
        o = "OverlapConfig"
        int_field(o, "chunks", self.chunks, 1, MAX_CHUNKS, none_ok=True)
        int_field(o, "nccl_ctas", self.nccl_ctas, 1, 64, none_ok=True)
        int_field(o, "sm_margin", self.sm_margin, 0, MAX_SMS, none_ok=True)
        bool_field(o, "give_back", self.give_back)
        check_gemm_field(o, "gemm", self.gemm)
        float_field(o, "timeout_ms", self.timeout_ms, MIN_TIMEOUT_MS, MAX_TIMEOUT_MS, none_ok=True)
        if not (self.transport is None or isinstance(self.transport, (NcclTransport, PeerCopyTransport))
                or (isinstance(self.transport, str) and self.transport in ("nccl", "p2p"))):
            raise ValueError("OverlapConfig.transport must be 'nccl', 'p2p', NcclTransport(...), "
                             f"PeerCopyTransport(...) or None, got {self.transport!r}")
        int_field(o, "reduce_ctas", self.reduce_ctas, 1, MAX_SMS, none_ok=True)
        for f in ("reduce_shared", "two_shot", "fold_norm"):
            bool_field(o, f, getattr(self, f))
        int_field(o, "split_tail", self.split_tail, 0, 64)
        choice_field(o, "check", self.check, ("sync", "async", "none"))

    def check_for(self, transport: str) -> None:
        """Raise ValueError where a field set here cannot apply on ``transport`` ("nccl" or
        "p2p"), or where fields of that transport conflict whatever the call's inputs.
        Construction runs it for a given transport; an op runs it when the call picks the
        transport of a config that left it ``None`` (there the other transport's fields are
        ignored, not refused)."""
        if transport == "nccl" and self.transport == "nccl":
            wrong = [f for f in ("reduce_ctas", "reduce_shared", "two_shot", "fold_norm")
                     if getattr(self, f) != _FLAT_DEFAULTS[f]]
            if wrong:
                raise ValueError(f"{', '.join(wrong)}: peer-copy transport options (PeerCopyTransport), "
                                 "not read on transport='nccl'; leave them unset, or transport=None to "
                                 "let the call choose")
        if transport == "p2p":
            if self.transport == "p2p" and self.nccl_ctas is not None:
                raise ValueError("nccl_ctas: an NCCL transport option (NcclTransport.ctas), not read on "
                                 "transport='p2p'; leave it unset, or transport=None to let the call choose")
            if self.reduce_shared and getattr(self.gemm, "warp_specialize", False):
                # the small reduce programs are sized to fit beside the plain GEMM's; a GEMM
                # program that filled its SM would leave them queued behind tiles that wait on them
                raise ValueError("reduce_shared runs the reduce programs beside the GEMM's; not with a "
                                 "warp-specialized GEMM (GemmConfig.warp_specialize)")
            if self.reduce_shared and getattr(self.gemm, "flatten", False):
                # the same, for a GEMM whose registers and shared memory beside them were not measured
                raise ValueError("reduce_shared runs the reduce programs beside the GEMM's; not with a "
                                 "flattened GEMM (GemmConfig.flatten)")

    @property
    def transport_options(self) -> NcclTransport | PeerCopyTransport | None:
        """The transport with its options, typed (``NcclTransport`` or
        ``PeerCopyTransport``), or ``None`` where the call chooses the transport."""
        if self.transport is None:
            return None
        cls = NcclTransport if self.transport == "nccl" else PeerCopyTransport
        return cls(**{tf: getattr(self, ff) for tf, ff in _TRANSPORT_FIELDS[cls]})

    def margin(self, transport: str) -> int:
        """``sm_margin`` resolved for ``transport``."""
        if self.sm_margin is not None:
            return self.sm_margin
        env = env_sm_margin()
        if env is not None:
            return env
        return 4 if transport == "nccl" else 0


Path = OverlapConfig | Sequential | Chunked
"""What a tuner picks for a shape, and what an op then runs: the tile-flag path with an
``OverlapConfig``, the reference (``Sequential``) or the chunked baseline (``Chunked``)."""


def env_sm_margin() -> int | None:
    """``OVERLAP_SM_MARGIN``: SMs every op's grids leave free for other work on the GPU
    (``OverlapConfig.sm_margin`` where a config sets none; the chain's grids too), or None
    where unset. A job that runs data-parallel NCCL collectives beside the ops sets it to
    at least their CTA cap (``NCCL_MAX_CTAS``): then every kernel of both can be resident
    at once, and no wait of one can hold the SMs the other needs."""
    import os

    v = os.environ.get("OVERLAP_SM_MARGIN", "").strip()
    if not v:
        return None
    try:
        out = int(v)
    except ValueError:
        raise ValueError(f"OVERLAP_SM_MARGIN must be an integer, got {v!r}") from None
    if out < 0:
        raise ValueError(f"OVERLAP_SM_MARGIN must be >= 0, got {v!r}")
    return out


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
            _captured_words.append(buf)
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


class Runtime:
    """Communicators, stream, flags and SM budget for one group on one device."""

    gpu_share, shared_gpu = 1, False  # one rank per GPU unless __init__ finds otherwise

    def __init__(self, group: Any, ranks: tuple[int, ...], rank: int, device: torch.device) -> None:
        self.group, self.ranks, self.rank, self.device = group, ranks, rank, device
        self.world = len(ranks)
        props = torch.cuda.get_device_properties(device)
        self.gpu_share, self.shared_gpu = _context_share(device)
        """Ranks on this device and shared-GPU mode (``overlap.dist.shared``): grids take an
        equal part of the SMs, the NCCL transport is refused."""
        self.num_sms = _share.sm_share(int(props.multi_processor_count), self.gpu_share)
        self.comm_stream = torch.cuda.Stream(device=device, priority=-1)
        # prologue work between a chunk landing and its flag (e.g. residual add + norm)
        self.aux_stream = torch.cuda.Stream(device=device, priority=-1)
        # a second copy stream: pushes that wait on this rank's own kernels (the two-shot
        # all-reduce's gather) must not queue behind those that do not
        self.copy_stream = torch.cuda.Stream(device=device, priority=-1)
        self._comms: dict[int | None, Any] = {}
        self._errs: dict[str, _flags.ErrorWord] = {}
        self._counters: dict[str, torch.Tensor] = {}
        self._local = LocalWords(device)
        self.pushes = 0
        """Pushes queued so far (``run_p2p`` takes an epoch back when a call queued none)."""
        self.order = device_order(device)
        self.seen = LRU(4096)
        """Call signatures an eager call has run (the 4096 most recent): a capture needs one
        (``require_warm``)."""
        self._heap: Any = None
        self._p2p_why: str | None = None  # None: not decided yet
        self._p2p_done: dict[str, tuple[torch.cuda.Event, torch.cuda.Stream]] = {}
        self._events: dict[Any, torch.cuda.Event] = {}  # fork / join, reused (see fork)
        self._caches: dict[str, LRU] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}  # by raw handle (``current_stream``)

    def current_stream(self) -> torch.cuda.Stream:
        """The caller's current stream on this runtime's device, as
        ``torch.cuda.current_stream(device)`` gives it, but one ``Stream`` object per raw
        handle, made on first sight (torch builds a new one on every call). A handle names
        one stream for as long as it lives: torch's pool streams are never destroyed, and
        an external stream's id is its handle."""
        raw = torch._C._cuda_getCurrentRawStream(self.device.index)
        s = self._streams.get(raw)
        if s is None:
            if len(self._streams) >= 256:  # external streams come and go: stay bounded
                self._streams.clear()
            s = self._streams[raw] = torch.cuda.current_stream(self.device)
        return s

    def cache(self, name: str, cap: int) -> LRU:
        """The runtime's per-shape cache ``name``, an ``LRU`` of at most ``cap`` entries,
        made on first use. The ops keep every per-shape cache here (plans, tuned configs,
        permutations, agreement keys), so each goes with its runtime: a new ``init`` after
        ``overlap.dist.shutdown`` starts with none of them."""
        c = self._caches.get(name)
        if c is None:
            c = self._caches.setdefault(name, LRU(cap))  # two threads making it get one
        if c.cap != cap:
            raise ValueError(f"cache {name!r} holds {c.cap} entries, asked for with cap={cap}")
        return c

    def fork(self, cur: torch.cuda.Stream, *streams: torch.cuda.Stream) -> None:
        """Make ``streams`` wait for the work queued on ``cur`` so far (one reused event;
        ``Stream.wait_stream`` makes a new one per call)."""
        ev = self._events.get("fork")
        if ev is None:
            ev = self._events["fork"] = torch.cuda.Event()
        ev.record(cur)
        for s in streams:
            s.wait_event(ev)

    def join(self, cur: torch.cuda.Stream, *streams: torch.cuda.Stream) -> None:
        """Make ``cur`` wait for the work queued on ``streams`` so far.

        The ops join every side stream back into ``cur`` before they return, so all
        their side-stream uses of a tensor come before anything queued on ``cur``
        later. The caching allocator hands a freed block out again only to
        allocations on the stream it was allocated on (``cur``), so that order makes
        ``record_stream`` unnecessary, and the ops do not call it."""
        for i, s in enumerate(streams):
            ev = self._events.get(i)
            if ev is None:
                ev = self._events[i] = torch.cuda.Event()
            ev.record(s)
            cur.wait_event(ev)

    def p2p_begin(self, op: str, cur: torch.cuda.Stream, *streams: torch.cuda.Stream) -> None:
        """Fork the comm stream (and ``streams``) for a p2p call of ``op``: after the
        caller's work so far; the comm stream also after ``op``'s previous call
        wherever it ran. The shared buffers' reuse rests on this order
        (``overlap._p2p``)."""
        self.fork(cur, self.comm_stream, *streams)
        prev = self._p2p_done.get(op)
        if prev is not None and prev[1] != cur:
            # on the same stream the fork above already comes after that call's end
            # (torch's streams come from pools and are never destroyed: a handle seen
            # again is the same stream)
            self.comm_stream.wait_event(prev[0])

    def push(self, dst: int, src: int, nbytes: int, flags: torch.Tensor, idx: int, value: int) -> None:
        """Copy ``nbytes`` from ``src`` to a peer's ``dst`` with the copy engines on the
        comm stream, then set the peer's ``flags[idx] = value`` behind it, so the flag
        says the bytes have landed (``overlap._p2p``).

        All on one stream: copies alternating over two streams, or the flag writes on a
        second stream behind events, were no faster alone and slower inside the
        all-reduce op (docs/experiments.md, 2026-11-29)."""
        from .. import _p2p

        _p2p.memcpy_async(dst, src, nbytes, self.comm_stream)
        _flags.stream_write_value(self.comm_stream, flags, idx, value)
        self.pushes += 1

    def p2p_end(self, op: str, cur: torch.cuda.Stream) -> None:
        """Mark the end of a p2p call of ``op`` (all its streams joined into ``cur``)."""
        prev = self._p2p_done.get(op)
        ev = prev[0] if prev is not None else torch.cuda.Event()
        ev.record(cur)  # a wait queued earlier keeps the record it saw
        self._p2p_done[op] = (ev, cur)

    def p2p(self) -> Any:
        """The group's ``overlap._p2p.PeerHeap``, or None where the ranks cannot map
        each other's memory (then ``p2p_why`` says why). Collective the first time:
        every rank of the group must call it at the same point."""
        if self._p2p_why is None:
            self._heap, self._p2p_why = _open_heap(self)
        return self._heap

    @property
    def p2p_why(self) -> str:
        return self._p2p_why or ""

    def transport(self, cfg: "OverlapConfig") -> str:
        """The transport ``cfg`` asks for, resolved. Collective the first time on
        every rank, whatever it asks for, so ranks that ask for different transports
        still meet in the same collective (and then disagree in ``check_agree``)."""
        want = cfg.transport or _env_transport()
        heap = self.p2p()
        if self.shared_gpu and self.world > 1:
            if capturing():
                # the peer-copy transport's captured call runs the reference, whose collective
                # is gloo's here: host work that no CUDA graph can hold
                raise OverlapCaptureError(
                    f"shared-GPU mode: rank {self.rank}: the ops of ranks {list(self.ranks)} cannot be captured in "
                    "a CUDA graph: their host collectives run on gloo, which a capture cannot hold; capture with "
                    "one GPU per rank")
            if want == "nccl":
                raise RuntimeError(_share.nccl_refusal("transport 'nccl'", self.rank, list(self.ranks)))
            if heap is None:
                raise RuntimeError(f"shared-GPU mode: rank {self.rank}: the ranks {list(self.ranks)} share a GPU, "
                                   f"which needs the peer-copy transport, and it is unavailable: {self.p2p_why}")
            return "p2p"
        if want == "nccl":
            return "nccl"
        if heap is not None:
            return "p2p"
        if want == "p2p":
            raise RuntimeError(f"transport 'p2p' asked for, but this group cannot use peer memory: {self.p2p_why}")
        return "nccl"

    def close(self) -> None:
        if self._heap is not None:
            self._heap.close()
            self._heap = None

    def comm(self, max_ctas: int | None) -> Any:
        """The library's communicator over this group, NCCL CTAs capped at ``max_ctas``."""
        if max_ctas not in self._comms:
            if self.shared_gpu and self.world > 1:
                raise RuntimeError(_share.nccl_refusal("the NCCL transport", self.rank, list(self.ranks)))
            from .. import dist
            from .._nccl import NcclConfig

            cfg = NcclConfig(max_ctas=max_ctas, min_ctas=max_ctas) if max_ctas else NcclConfig()
            comm = dist.nccl_comm(self.group, config=cfg)
            if comm.nranks != self.world or comm.rank != self.rank:
                raise ValueError(f"communicator (rank {comm.rank} of {comm.nranks}) is not over this group "
                                 f"(rank {self.rank} of {self.world})")
            # first collective connects the peers: do it now, not inside a timed wait
            x = torch.zeros(self.world, device=self.device)
            comm.all_reduce(x, x, stream=torch.cuda.current_stream(self.device))
            torch.cuda.synchronize(self.device)
            self._comms[max_ctas] = comm
        return self._comms[max_ctas]

    def local_words(self, name: str, n_counters: int, n_flags: int) -> "Words":
        """The counters and local flags of one call of op ``name`` (``LocalWords``)."""
        return self._local.get(name, n_counters, n_flags)

    def err(self, name: str) -> _flags.ErrorWord:
        if name not in self._errs:
            if capturing():
                raise OverlapCaptureError(f"{name}: call it once outside the CUDA graph capture first")
            what = name if self.group is None else f"{name} (rank {self.rank})"  # a local runtime has no rank
            self._errs[name] = register_error_word(_flags.ErrorWord(self.device, what=what))
        return self._errs[name]

    def require_warm(self, op: str, sig: tuple) -> None:
        """Inside a capture: ``sig`` (the call's shapes, dtypes and config) must have run
        eagerly before, which compiled its kernels, made its plan and communicators and
        checked the ranks' agreement (none of which a capture may do); else a clear
        ``OverlapCaptureError``. Outside: nothing (``mark_warm`` records a call that ran)."""
        if capturing() and (op, sig) not in self.seen:
            raise OverlapCaptureError(
                f"{op}: this call ({sig}) has not run outside a CUDA graph capture yet; call the op once "
                "with the same shapes, dtypes and config before capturing it (that call compiles its "
                "kernels, builds its plan and checks that the ranks agree)")

    def mark_warm(self, op: str, sig: tuple, out: Any) -> Any:
        """Remember ``sig`` as run eagerly (after the call returned: one that raised, say in
        its first compile, does not count) and return ``out``."""
        if not capturing():
            self.seen.add((op, sig))
        return out

    def counter(self, name: str, n: int = 1) -> torch.Tensor:
        """An op's int32 counter words: the GEMM's dispatch counter, then one count per
        split tile (``OverlapConfig.split_tail``); at least ``n``, zeroed by the op per call."""
        c = self._counters.get(name)
        if c is None or c.numel() < n:
            c = self._counters[name] = torch.zeros(max(n, 1 if c is None else 2 * c.numel()), dtype=torch.int32,
                                                   device=self.device)
        return c


def run_p2p(rt: Runtime, op: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, a peer-copy call of ``op``, in the device's call order, and safe
    against an exception at any point: the side streams are joined into the caller's
    (so the next call is ordered after whatever was queued), the end of the call is
    marked for the next call's comm stream, and the shared flags' epoch is taken back
    if no push was queued (the peers never saw this call; after a push they did, and
    the call counts as made: its pushes set the peers' flags for that epoch, and the
    next call's pushes the next)."""
    cur = rt.current_stream()
    with rt.order.lock:
        # read under the lock: another thread's call in between must not count as this one's
        sf = rt.p2p().flags(op, 1)
        e0, n0 = sf.epoch, rt.pushes
        rt.order.begin(cur)
        try:
            return fn(*args)
        except BaseException:
            if rt.pushes == n0:
                sf.epoch = e0
            rt.join(cur, rt.comm_stream, rt.aux_stream, rt.copy_stream)
            rt.p2p_end(op, cur)
            raise
        finally:
            rt.order.end(cur)


def call_sig(op: str, values: tuple[int, ...]) -> int:
    """The signature of a peer-copy call: a nonzero int32 of the op and the values every
    rank must pass alike (CRC-32 of their text, the same on every rank; never 0, the
    flags' value before any write). Written beside the pushed rows and compared by the
    peer's kernels: ranks that disagree get ``overlap.flags.RanksDisagreeError`` with no
    host synchronization, also where the host's agreement check was cached."""
    import zlib

    return _flags.wrap32(zlib.crc32(repr((op, tuple(int(v) for v in values))).encode()) | 1)


def post_sig(cur: torch.cuda.Stream, targets: list[tuple[torch.Tensor, int]], epoch: int, stride: int,
             sig: int) -> None:
    """Write ``sig`` into each (flags, region start) of ``targets`` (the peers' shared flags,
    this rank's region in each), in the word of the call's parity, on ``cur`` before the
    push streams fork from it: every push of the call, on any stream, comes after it."""
    off = stride - 1 - (epoch & 1)
    refresh = (epoch & (REFRESH_EVERY - 1)) == 0
    for flags, base in targets:
        _flags.stream_write_value(cur, flags, base + off, sig)
        if refresh:
            # A chunk flag is written only by calls that use that chunk; one left alone for
            # 2**31 calls would compare as ahead (and at 2**32 as landed). Once per
            # REFRESH_EVERY calls this sender sets every chunk flag of its region to the
            # previous epoch: no wait of this call or the peer's previous one is released
            # by it (their flags hold that epoch already, or are not read), and a later
            # wait compares against a value at most REFRESH_EVERY calls old.
            prev = _flags.wrap32(epoch - 1)
            for i in range(stride - 2):
                _flags.stream_write_value(cur, flags, base + i, prev)


REFRESH_EVERY = 1 << 24
"""Calls between refreshes of a peer-copy sender's idle chunk flags (``post_sig``)."""


def dtype_code(dtype: torch.dtype) -> int:
    """A number for ``dtype`` that every rank computes alike (for ``check_agree``)."""
    return _agree.dtype_code(dtype)


_EVERY_CALL: list[bool] = []


def every_call_checked() -> bool:
    """``OVERLAP_CHECK_RANKS=every`` (read on the first call): check the ranks' agreement
    on every call, not once per signature (a blocking all-gather per call; for debugging)."""
    if not _EVERY_CALL:
        import os

        _EVERY_CALL.append(os.environ.get("OVERLAP_CHECK_RANKS", "").strip().lower() == "every")
    return _EVERY_CALL[0]


def _env_transport() -> str | None:
    import os

    v = os.environ.get("OVERLAP_TRANSPORT", "").strip().lower()
    if v in ("", "auto"):
        return None
    if v not in ("nccl", "p2p"):
        raise ValueError(f"OVERLAP_TRANSPORT must be 'nccl', 'p2p' or 'auto', got {v!r}")
    return v


def _context_share(device: torch.device) -> tuple[int, bool]:
    """(ranks on ``device``, shared-GPU mode) as ``overlap.dist.init`` placed this rank."""
    from .. import dist

    ctx = dist.get_context()
    if ctx is None or not getattr(ctx, "shared_gpu", False) or ctx.device != device:
        return 1, False
    return ctx.gpu_share, True


def _gpu_id(device: torch.device) -> str:
    """Which physical GPU ``device`` is, the same text in every process that sees it."""
    props = torch.cuda.get_device_properties(device)
    return str(getattr(props, "uuid", "") or getattr(props, "pci_bus_id", "") or device)


def _note_sharing(rt: Runtime, host: str, gpus: list[tuple[str, str]]) -> None:
    """Shared-GPU mode for ``rt`` where ranks of its group run on its GPU (``gpus``: every
    rank's (host, GPU id), this rank's is ``host`` and ``gpus[rt.rank][1]``), however they
    were placed there: its grids then take an equal part of the SMs, and NCCL is refused."""
    same = sum(1 for g in gpus if g == (host, gpus[rt.rank][1]))
    if same > 1 and same > rt.gpu_share:
        full = rt.num_sms * rt.gpu_share
        rt.gpu_share, rt.shared_gpu = same, True
        rt.num_sms = _share.sm_share(full, same)


def _open_heap(rt: Runtime) -> tuple[Any, str]:
    """(PeerHeap, "") or (None, why). Collective over the runtime's group."""
    import socket

    import torch.distributed as tdist

    from .._p2p import P2PUnavailable, PeerHeap

    if rt.world == 1:
        return None, "one rank: nothing to move"
    host, gpu = socket.gethostname(), _gpu_id(rt.device)
    try:
        import cupy  # noqa: F401

        mine = (host, "", gpu)
    except Exception as e:  # noqa: BLE001
        mine = (host, f"rank {rt.rank}: cupy: {e}", gpu)
    if not mine[1] and not _flags._cuda_driver():
        # the flag writes would fall back to a fill kernel, which finds no SM while
        # the GEMM (all SMs) waits for it: every call would time out
        mine = (host, f"rank {rt.rank}: cuda-bindings missing (pip install 'overlap[cu13]' or [cu12])", gpu)
    alls: list[Any] = [None] * rt.world
    tdist.all_gather_object(alls, mine, group=rt.group)
    _note_sharing(rt, host, [(h, g) for h, _, g in alls])
    hosts = {h for h, _, _ in alls}
    errs = [e for _, e, _ in alls if e]
    if errs:
        return None, "; ".join(errs)
    if len(hosts) > 1:
        return None, f"ranks on {len(hosts)} hosts"
    try:
        return PeerHeap(rt.group, rt.world, rt.rank, rt.device), ""
    except P2PUnavailable as e:
        warn_once(f"p2p-{rt.ranks}", f"peer memory unavailable ({e}); the ops use NCCL")
        return None, str(e)


def group_key(group: Any) -> tuple[tuple[int, ...], int]:
    import torch.distributed as tdist

    from .. import dist

    ranks = tuple(dist.group_ranks(group))
    me = tdist.get_rank()
    if me not in ranks:
        raise ValueError(f"this process (global rank {me}) is not in the group {ranks}")
    return ranks, ranks.index(me)


_by_group: dict[tuple[int, int | None], tuple[Any, Runtime]] = {}
_captured_words: list[torch.Tensor] = []
"""Flag and counter words of captured calls: a graph holds their addresses for as long
as it lives, which the library cannot see, so they are never freed."""


def get_runtime_if_made(group: Any, device: torch.device) -> Runtime | None:
    """The runtime ``get_runtime`` would return, or None where none was made yet."""
    hit = _by_group.get((id(group), device.index))
    return hit[1] if hit is not None and hit[0] is group else None


def get_runtime(group: Any, device: torch.device) -> Runtime:
    """The runtime of ``group`` (resolved: a process group) on ``device``, made on first use."""
    # hot path: the group object seen before (its ranks cannot change)
    hit = _by_group.get((id(group), device.index))
    if hit is not None and hit[0] is group:
        return hit[1]
    ranks, rank = group_key(group)
    key = (ranks, device.index)
    with _lock:
        rt = _runtimes.get(key)
        if rt is None:
            rt = Runtime(group, ranks, rank, device)
            _runtimes[key] = rt
        _by_group[(id(group), device.index)] = (group, rt)
        return rt


def local_runtime_if_made(device: torch.device) -> Runtime | None:
    """The runtime ``local_runtime`` would return, or None where none was made yet."""
    return _runtimes.get((None, device.index))


def local_runtime(device: torch.device) -> Runtime:
    """The runtime of single-GPU work on ``device`` (the chain): world 1, no process group.
    Making it is not collective (streams, the SM count, the device's order); it never asks
    for a communicator or peer memory, the only collective parts of a runtime."""
    rt = _runtimes.get((None, device.index))
    if rt is None:
        with _lock:
            rt = _runtimes.get((None, device.index))
            if rt is None:
                rt = _runtimes[(None, device.index)] = Runtime(None, (0,), 0, device)
    return rt


class on_stream:
    """``with on_stream(s, cur):`` makes ``s`` current, then ``cur`` again; a few
    microseconds, where ``torch.cuda.stream`` costs about 19 (host time is what
    bounds the ops at small shapes)."""

    __slots__ = ("s", "cur")

    def __init__(self, s: torch.cuda.Stream, cur: torch.cuda.Stream) -> None:
        self.s, self.cur = s, cur

    def __enter__(self) -> None:
        torch.cuda.set_stream(self.s)

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.set_stream(self.cur)


def _drain(rt: Runtime, timeout_s: float) -> bool:
    """True once the runtime's streams and the device's last op call have finished,
    False if they have not within ``timeout_s`` (polled: never a blocking wait on a
    stream that may not finish, such as an NCCL kernel whose peer died)."""
    import time

    evs = []
    for s in (rt.comm_stream, rt.aux_stream, rt.copy_stream):
        ev = torch.cuda.Event()
        ev.record(s)
        evs.append(ev)
    last = rt.order.last_stream()
    if last is not None:
        ev = torch.cuda.Event()
        ev.record(last)
        evs.append(ev)
    deadline = time.monotonic() + timeout_s
    while not all(ev.query() for ev in evs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def shutdown_timeout_s(group: Any = None) -> float:
    """How long shutdown and ``reset`` wait for the ops' work to end: the wait bound
    (every tile's wait ends by then) plus 5 s, at most 60 s. The default bound is the
    process groups' timeout (minutes), so this is usually the 60 s cap: past it, shutdown
    aborts the library's NCCL communicators rather than wait out a dead peer's bound."""
    return min(60.0, _flags.default_timeout_ms(group) / 1000.0 + 5.0)


def reset(group: Any = None) -> None:
    """Bring the ops of ``group`` back in step on every rank after a timeout (collective:
    every rank of the group calls it, at the same point).

    After a ``FlagTimeoutError`` on the peer-copy transport the ranks may be out of
    step (a rank whose wait timed out went on; its peers' later flags then look two
    calls ahead: ``FlagProtocolError``). Every output of the group's peer-copy ops on
    every rank from the call that timed out until this reset is invalid. The reset
    waits (bounded by ``shutdown_timeout_s``) until this rank's work of the ops has
    ended, meets the other ranks, zeroes this rank's shared flags and epochs and the
    error words, and meets them again; the next call of every op is then epoch 1 on
    every rank. It also ends an out-of-step state (``overlap.ops._agree``: the group's call
    counters start again from 0 and a group ended on a rank is usable again). The NCCL
    transport and the chain keep no other state across calls. Raises ``RuntimeError`` if
    the work does not end in time (an NCCL kernel whose peer is gone): then
    ``overlap.dist.shutdown`` is the way out."""
    import torch.distributed as tdist

    group = resolve_group(group)
    rt = None
    ranks, _ = group_key(group)
    if torch.cuda.is_available():
        with _lock:
            rt = next((r for (rk, _), r in _runtimes.items() if rk == ranks), None)
    if rt is not None and not _drain(rt, shutdown_timeout_s(group)):
        raise RuntimeError(f"overlap.reset: rank {rt.rank}: the ops' work did not end within "
                           f"{shutdown_timeout_s(group):.0f} s; shut down instead (overlap.dist.shutdown)")
    tdist.barrier(group=group)  # every rank's pushes have ended: nothing lands after this
    _agree.reset_steps(ranks)  # the group's call counters from 0, the group no longer ended here
    if rt is not None:
        with rt.order.lock:
            if rt._heap is not None:
                for f in rt._heap._flags.values():
                    f.local.zero_()
                    f.epoch = 0
            for err in rt._errs.values():
                err.clear()
            rt._p2p_done.clear()
            torch.cuda.synchronize(rt.device)
    tdist.barrier(group=group)  # every rank zeroed its flags before any rank pushes again


def reset_runtimes() -> None:
    """Forget every runtime, and with them everything the ops keep per group and device:
    plans, tuned configs, the ranks' agreements, the chain's state. ``dist.shutdown`` calls
    this before it destroys the communicators the runtimes hold, so ops after a new
    ``init`` build fresh ones and check the ranks again. Bounded: where the ops' work has
    not ended within ``shutdown_timeout_s`` (a peer died mid-call), the runtime's NCCL
    communicators are aborted (which ends their kernels) and its peer memory is left
    mapped rather than freed under a running kernel. What a CUDA graph captured stays
    (``keep_for_capture``, the captured words, the error words)."""
    with _lock:
        for rt in _runtimes.values():
            try:
                if rt.device.type != "cuda" or _drain(rt, shutdown_timeout_s()):
                    rt.close()
                else:
                    who = f"rank {rt.rank} of group {rt.ranks}" if rt.group is not None else f"device {rt.device}"
                    warnings.warn(f"overlap: {who}: the ops' work did not end within "
                                  f"{shutdown_timeout_s():.0f} s; aborting the library's NCCL communicators",
                                  stacklevel=3)
                    for comm in rt._comms.values():
                        comm.abort()
                rt._caches.clear()  # gone also for whoever still holds the runtime
            except Exception:  # noqa: BLE001 - teardown is best effort
                pass
        _runtimes.clear()
        _by_group.clear()
    _agree.reset_steps()


def _register() -> None:
    from .. import dist

    dist.on_shutdown(reset_runtimes)


_register()


def resolve_group(group: Any) -> Any:
    """``group``, else the tensor-parallel group of ``overlap.dist.init``, else WORLD."""
    if group is not None:
        return group
    from .. import dist

    ctx = dist.get_context()
    if ctx is not None:
        return ctx.tp_group
    import torch.distributed as tdist

    return tdist.group.WORLD


AGREED_CAP = 1024
"""Agreement keys a runtime remembers (``check_agree``)."""


def check_agree(rt: Runtime, op: str, names: tuple[str, ...], values: tuple[int, ...],
                rows_at: int | None = None) -> None:
    """The call's agreement point on the tile-flag path (``overlap.ops._agree``): sizes that
    must agree across the group's ranks (else NCCL sizes disagree and peers hang). Checked
    with a tiny blocking all-gather on torch's group the first time a key is seen; the
    exchange also carries every rank's verdict, the group's call counter and the calling
    thread, and a rank that disagrees (or refused the call) makes every rank raise.

    ``rows_at``: the index in ``values`` of the row count (M or M/R), which enters the
    key by its bucket (``overlap.policies.row_bucket``): a new M in a bucket seen before
    costs no collective, so a server whose M changes every call pays the check once per
    bucket. What is compared when the check runs is every value, M included. Between
    checks, ranks that pass different M of one bucket are caught on the peer-copy
    transport by the kernels' signature comparison (``RanksDisagreeError``); on the NCCL
    transport they are not: where the NCCL calls then differ in size (the all-reduce ops)
    a flag timeout, bounded; where they match (the all-gather and the reduce-scatter send
    their bucket's chunks whole) a wrong result (docs/guarantees.md, "NCCL transport").
    ``OVERLAP_CHECK_RANKS=every`` checks every call."""
    if rows_at is not None:
        from ..policies import row_bucket

        kv = values[:rows_at] + (-row_bucket(values[rows_at]),) + values[rows_at + 1:]
    else:
        kv = values
    key = (op, names, kv)
    agreed = rt.cache("agreed", AGREED_CAP)
    if capturing():
        if not agreed.get(key):
            raise OverlapCaptureError(f"{op}: the call {dict(zip(names, values))} has not run outside a CUDA graph "
                                      "capture yet; call it once with the same shapes before capturing it")
        _agree.count_call(rt.group)  # counted as its eager call was; never an exchange in a capture
        return
    _agree.agreement(rt.group, rt.world, rt.device, op, names, values, agreed=agreed, key=key,
                     every=every_call_checked(), then_collective=False)


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> Any:
    """torch's all-gather into one tensor: ``all_gather_single`` where torch has it,
    else ``all_gather_into_tensor`` (deprecated from torch 2.13 on, warning on every call)."""
    import torch.distributed as tdist

    fn = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
    return fn(out, inp, group=group)


def gather_ints(group: Any, world: int, values: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's ``values`` (same length everywhere), in group rank order; collective,
    synchronizes. Uses ``all_gather_single`` where torch has it (``all_gather_into_tensor``
    is deprecated from torch 2.13 on and warns on every call)."""
    import torch.distributed as tdist

    n = len(values)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    alls = torch.empty(world * n, dtype=torch.int64, device=device)
    all_gather_single(alls, mine, group=group)
    return alls.view(world, n).tolist()


def observed(op: str, shape: tuple, path: str, why: str, device: torch.device, fn: Any, *args: Any,
             serial: bool = False) -> Any:
    """``fn(*args)``, one call of ``op`` on ``path`` (``overlap.observe``): a profiler range
    named ``overlap.<op>[<path>]``, the call counted in ``overlap.report()`` with ``why``,
    and, while profiling is on, the call's span on the caller's stream timed by CUDA
    events (read when the report is made, never waited on). Off: a counter and a shared
    no-op range, well under a microsecond."""
    with _observe.op_range(op, path):
        _observe.record_call(op, shape, path, why)
        # the switch first: with profiling off nothing else is looked at
        tm = _observe.timer(op, shape, path, serial=serial) if _observe._enabled and device.type == "cuda" else None
        if not tm:
            return fn(*args)
        cur = torch.cuda.current_stream(device)
        tm.start("op", cur)
        out = fn(*args)
        tm.stop("op", cur)
        tm.commit()
        return out


def serial_phases(op: str, shape: tuple, path: str, device: torch.device) -> Any:
    """A timer for a call that runs its communication and GEMM one after the other (the
    references): their spans are the alone-times of the report's hidden fraction. Falsy
    (a no-op) unless profiling is on and the call is on CUDA."""
    return _observe.timer(op, shape, path, serial=True) if _observe._enabled and device.type == "cuda" else None


def refuse_grad(op: str, *tensors: Any) -> None:
    """Raise if autograd would track a result of ``op``, which has no backward yet: a
    result silently detached from the graph would train wrong."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(f"{op}: an input requires grad, and this op has no backward yet; call it under "
                           "torch.no_grad() or on detached inputs (the overlap.nn layers carry the backward)")


def agree_on_reference(group: Any, op: str, names: tuple[str, ...], values: tuple[int, ...],
                       device: torch.device) -> None:
    """The ranks' agreement on a call the op sends to its reference path (a plain
    collective, where sizes that differ make gloo abort a rank and NCCL hang or
    corrupt): exchanged on every such call (a small all-gather; the reference path is
    not the fast path) with every rank's verdict and the group's call counter
    (``overlap.ops._agree``), every rank raising the same error. The reference's data
    collective follows it (``_agree.collective_done``). Not inside a capture."""
    import torch.distributed as tdist

    if capturing():
        return
    if tdist.get_rank(group) < 0:
        raise ValueError(f"{op}: this process (global rank {tdist.get_rank()}) is not in the group "
                         f"{tdist.get_process_group_ranks(group)}")
    world = tdist.get_world_size(group)
    if world == 1:
        return
    dev = device if tdist.get_backend(group) == "nccl" else torch.device("cpu")
    _agree.agreement(group, world, dev, op, names, values, then_collective=True)


def time_ms(fn: Any, iters: int, group: Any, batches: int = 3) -> float:
    """Milliseconds per call of ``fn`` (calls back to back; the median of ``batches``
    batches of ``iters`` calls), slowest rank; collective."""
    import statistics

    import torch.distributed as tdist

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        tdist.barrier(group=group)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    t = torch.tensor([statistics.median(times)], device="cuda")
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=group)
    return float(t.item())


def _none_timed_out(rt: Runtime, err: _flags.ErrorWord, group: Any, key: str, message: Any) -> bool:
    """Collective: True on every rank when no rank's ``err`` recorded a timeout; else
    False everywhere, and the ranks that saw one warn once (``message(error)``)."""
    import torch.distributed as tdist

    failed = torch.zeros(1, device=rt.device)
    try:
        err.check(block=True)
    except _flags.FlagTimeoutError as e:
        failed += 1
        warn_once(key, message(e))
    tdist.all_reduce(failed, group=group)
    return failed.item() == 0


WARM_TIMEOUT_MS = 60_000.0
"""Wait bound of a tuner candidate's first (compiling) call: a bound, not a hang."""
TUNE_TIMEOUT_MS = 5_000.0
"""Wait bound of a tuner's timed calls of a candidate that sets none. The ranks start
each candidate together (a barrier after its warm call), so a wait this long means the
candidate starves its own communication (e.g. NCCL finds no SM): it is dropped within
seconds, not after the minutes of the default bound (``flags.default_timeout_ms``)."""


def tuning_bound(cand: "OverlapConfig", shared: bool = False) -> "OverlapConfig":
    """``cand`` with its timed calls' wait bound: its own, else ``TUNE_TIMEOUT_MS`` (in
    shared-GPU mode at least ``overlap.dist.shared.SHARED_WAIT_FLOOR_MS``: a peer's
    pushes may wait whole time slices behind this rank's kernels)."""
    from dataclasses import replace

    if cand.timeout_ms is not None:
        return cand
    return replace(cand, timeout_ms=_share.library_wait_ms(TUNE_TIMEOUT_MS, shared))


def time_candidates(rt: Runtime, err: _flags.ErrorWord, candidates: list[OverlapConfig], run: Any, iters: int,
                    group: Any, describe: Any = None, timer: Any = None) -> list[tuple[float, OverlapConfig]]:
    """The tuners' common loop (collective): time ``run(cand)`` for each candidate with
    error checks off, then drop the candidate on every rank if its waits timed out on
    any rank. Returns ``[(ms, cand with check="async")]`` for the survivors.
    ``describe(cand)``: a label to print on rank 0 (None: quiet); ``timer``: ``time_ms``.

    Each candidate is first called once with its waits bounded by ``WARM_TIMEOUT_MS``,
    and no rank goes on before every rank is done: that call compiles the candidate's
    kernels, and a rank still compiling queues its next call late, past the bound of
    a peer that went on (a suite run at 9ad0b16 lost a candidate that way)."""
    import torch.distributed as tdist
    from dataclasses import replace

    timer = timer or time_ms
    out: list[tuple[float, OverlapConfig]] = []
    for cand in candidates:
        cand = replace(cand, check="none")
        run(replace(cand, timeout_ms=max(cand.timeout_ms or 0.0, WARM_TIMEOUT_MS)))
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        tdist.barrier(group=group)
        timed = tuning_bound(cand, getattr(rt, "shared_gpu", False))
        t = timer(lambda: run(timed), iters, group)
        ok = _none_timed_out(rt, err, group, f"tune-timeout-{err.what}-{cand}",
                             lambda e, cand=cand: f"tuner: {cand} timed out ({e}); skipped")
        if ok:
            out.append((t, replace(cand, check="async")))
        if describe is not None and rt.rank == 0:
            print(f"{describe(cand)}: {t:.3f} ms" + ("" if ok else " (timed out: rejected)"), flush=True)
    return out


def split_variants(results: list[tuple[float, Any]], top: int = 2, parts: tuple[int, ...] = (2, 8)) -> list[Any]:
    """The ``top`` fastest configs of a tuner's first pass (``(ms, choice)`` pairs; paths
    named by strings are skipped) again with their GEMM's tail split into at most each
    of ``parts`` K pieces (``OverlapConfig.split_tail``), for a second pass."""
    from dataclasses import replace

    ranked = [c for _, c in sorted(results, key=lambda r: r[0]) if isinstance(c, OverlapConfig) and c.split_tail < 2
              and not getattr(c.gemm, "flatten", False)]  # a flattened GEMM takes no split tail
    return [replace(c, split_tail=s) for c in ranked[:top] for s in parts]


def flat_variants(results: list[tuple[float, Any]], top: int = 2) -> list[Any]:
    """The ``top`` fastest configs of a tuner's passes so far (``(ms, choice)`` pairs; paths
    that are not configs are skipped) again with their GEMM flattened
    (``GemmConfig.flatten``: one software pipeline over a program's tiles), for ops whose
    GEMM tiles wait on nothing (the producer ops). Configs with split tiles or a
    warp-specialized GEMM are left out (the flattened kernel takes neither)."""
    from dataclasses import replace

    from ..kernels.tile_gemm import DEFAULT_CONFIG

    ranked = [c for _, c in sorted(results, key=lambda r: r[0]) if isinstance(c, OverlapConfig)
              and c.split_tail < 2 and not (c.gemm is not None and (c.gemm.flatten or c.gemm.warp_specialize))]
    return [replace(c, gemm=replace(c.gemm or DEFAULT_CONFIG, flatten=True), give_back=False) for c in ranked[:top]]


def ws_variants(results: list[tuple[float, Any]], device: Any, top: int = 2) -> list[Any]:
    """The ``top`` fastest configs of a tuner's passes so far (``(ms, choice)`` pairs; paths
    named by strings are skipped) again with their GEMM's K loop warp-specialized
    (``GemmConfig.warp_specialize``), for another pass; none where this Triton and the
    GPU ``device`` cannot build it (``warp_specialize_supported``). Configs with the reduce kernel beside
    the GEMM (``reduce_shared``) are left out: its programs are sized to fit beside the
    plain GEMM's."""
    from dataclasses import replace

    from ..kernels.tile_gemm import DEFAULT_CONFIG, warp_specialize_supported

    if not warp_specialize_supported(device):
        return []
    ranked = [c for _, c in sorted(results, key=lambda r: r[0])
              if isinstance(c, OverlapConfig) and not c.reduce_shared
              and not getattr(c.gemm, "warp_specialize", False) and not getattr(c.gemm, "flatten", False)]
    return [replace(c, gemm=replace(c.gemm or DEFAULT_CONFIG, warp_specialize=True)) for c in ranked[:top]]


def confirm_best(rt: Runtime, err: _flags.ErrorWord, results: list[tuple[float, Any]], fn_for: Any, iters: int,
                 group: Any, top: int = 3, rounds: int = 3, describe: Any = None,
                 timer: Any = None, keep: tuple[Any, ...] = ()) -> tuple[float, Any]:
    """The tuners' last step (collective): the ``top`` fastest of ``results`` ((ms,
    choice) pairs, each timed once, one after another) timed again in ``rounds``
    rounds of one batch each, interleaved, so that a drift of the GPU's clocks during
    the first pass cannot pick the winner; returns (median ms, choice) of the fastest.
    ``fn_for(choice)``: the callable to time, with error checks off. Times are the
    slowest rank's (``time_ms``), so every rank picks the same. If a tile-flag
    choice's waits time out here on any rank, the first pass's fastest is returned.
    ``describe(choice)``: a label to print on rank 0 (None: quiet). ``keep``: choices
    (e.g. the sequential baseline) timed again too wherever the first pass ranked them:
    a drift during the first pass then cannot pick a config slower than them."""
    import statistics

    timer = timer or time_ms
    ordered = sorted(results, key=lambda r: r[0])
    ranked = ordered[:max(1, top)]
    ranked += [r for r in ordered[max(1, top):] if not isinstance(r[1], OverlapConfig) and r[1] in keep]
    if len(ranked) < 2 or rounds < 1:
        return ranked[0]
    times: list[list[float]] = [[] for _ in ranked]
    for _ in range(rounds):
        for i, (_, choice) in enumerate(ranked):
            times[i].append(timer(fn_for(choice), iters, group, batches=1))
    if not _none_timed_out(rt, err, group, f"tune-confirm-timeout-{err.what}",
                           lambda e: f"tuner: a finalist timed out ({e}); keeping the first pass"):
        return ranked[0]
    meds = [statistics.median(t) for t in times]
    best = min(range(len(ranked)), key=lambda i: meds[i])
    if describe is not None and rt.rank == 0:
        for (t0, choice), med in zip(ranked, meds):
            print(f"{describe(choice)}: {t0:.3f} ms, again {med:.3f} ms{'  <- picked' if med == meds[best] else ''}",
                  flush=True)
    return meds[best], ranked[best][1]


def shared_gpu_choices(rt: Any, op: str, candidates: list[OverlapConfig], baselines: dict[Chunked, Any] | None
                       ) -> tuple[list[OverlapConfig], dict[Chunked, Any] | None]:
    """A tuner's candidates and baselines that can run on ``rt``: in shared-GPU mode
    (``overlap.dist.shared``) neither the NCCL candidates nor the chunked baselines (NCCL
    calls) can, and they are left out, with a warning where the caller named any."""
    if not (getattr(rt, "shared_gpu", False) and rt.world > 1):
        return candidates, baselines
    keep = [c for c in candidates if not (isinstance(c, OverlapConfig) and c.transport == "nccl")]
    if len(keep) < len(candidates) or baselines:
        warn_once(f"shared-gpu-tune-{op}", f"{op}: tuner: shared-GPU mode: {len(candidates) - len(keep)} NCCL "
                  f"candidate(s) and {len(baselines or {})} chunked baseline(s) (NCCL) left out; NCCL refuses "
                  "ranks that share a GPU")
    return keep, None


def tune_paths(rt: Runtime, op: str, shape: tuple[int, ...], title: str, *, ref: Any, candidates: list[OverlapConfig],
               run: Any, describe: Any, iters: int, group: Any, verbose: bool, cache: Any, key: Any,
               baselines: dict[Chunked, Any] | None = None, passes: tuple[Any, ...] = ()) -> Path:
    """The tuners' skeleton (collective: every rank calls it with the same shapes).

    Times the reference ``ref`` (``SEQUENTIAL``) and the ``baselines`` (``{Chunked(n):
    callable}``), then ``candidates`` through ``run(config)`` (``time_candidates``: a
    candidate whose waits time out on any rank is dropped), then each of ``passes``
    (``results -> more candidates``, e.g. ``split_variants``); the fastest three and the
    reference again in interleaved rounds (``confirm_best``). The pick goes into
    ``cache[key]`` (the op reads it when called without a config), into the report
    (``overlap.report()``), and, when it is not a tile-flag config, into a one-time warning.
    ``describe(config)``: a config's label; ``title``: the shape's, e.g. ``"agmm 8192x..."``."""
    from dataclasses import replace

    err = rt.err(op)
    candidates, baselines = shared_gpu_choices(rt, op, candidates, baselines)
    paths: dict[Any, Any] = {SEQUENTIAL: ref, **(baselines or {})}

    def label(choice: Any) -> str:
        return describe(choice) if isinstance(choice, OverlapConfig) else f"  tune {title}: {choice}"

    shown = label if verbose else None
    results: list[tuple[float, Any]] = []
    for path, fn in paths.items():
        results.append((time_ms(fn, iters, group), path))
        if verbose and rt.rank == 0:
            print(f"{label(path)}: {results[-1][0]:.3f} ms", flush=True)
    t_seq = results[0][0]
    results += time_candidates(rt, err, candidates, run, iters, group, shown)
    for more in passes:
        results += time_candidates(rt, err, more(results), run, iters, group, shown)

    def fn_for(choice: Any) -> Any:
        if not isinstance(choice, OverlapConfig):
            return paths[choice]
        quiet = tuning_bound(replace(choice, check="none"), getattr(rt, "shared_gpu", False))
        return lambda: run(quiet)

    best_t, best = confirm_best(rt, err, results, fn_for, iters, group, describe=shown, keep=(SEQUENTIAL,))
    cache[key] = best
    _observe.record_tuning(op, shape, [(label(c).strip(), t) for t, c in sorted(results, key=lambda r: r[0])],
                           label(best).strip())
    if not isinstance(best, OverlapConfig):
        warn_once(f"tuned-{op}-{best}-{key}",
                  f"{op}: tile-flag overlap does not pay for {title.split(' ', 1)[-1]} ({best} {best_t:.3f} ms was "
                  f"fastest; sequential {t_seq:.3f} ms); running {best} for this shape")
    return best


def bucketed(cfg: OverlapConfig | None, transport: str) -> int:
    """1 where a call's plan is made per row bucket (``plan_rows_for``: the NCCL transport
    with a per-tile GEMM), else 0; one of the values the ranks agree on (their NCCL calls'
    sizes come from the bucket's chunks, or from M's)."""
    return int(cfg is not None and transport == "nccl" and not (cfg.gemm is not None and cfg.gemm.flatten))


def plan_rows_for(rows: int, cfg: OverlapConfig, transport: str) -> int:
    """The rows (M, or M/R of a gathered op) a consumer op's plan is made for: on the
    NCCL transport with a per-tile GEMM, ``policies.plan_rows(rows)``: one plan (chunks,
    tile table, launches) per row bucket, the GEMM cutting its tiles at the call's rows
    (``launch_tile_gemm(rows=)``), so a new M of a bucket seen before costs no plan; else
    ``rows`` itself (the peer-copy transport's pushes and a flattened GEMM's groups are
    laid out for exact rows)."""
    from ..policies import plan_rows

    return plan_rows(rows) if bucketed(cfg, transport) else rows


def gemm_plan(plans: dict, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, table: torch.Tensor, *,
              flags: torch.Tensor, err: torch.Tensor, timeout_ns: int, counter: torch.Tensor | None = None,
              **kw: Any) -> Any:
    """The ``TileGemmPlan`` in ``plans`` (an op plan's own ``LRU``) for these operands'
    dtype, B's layout (each weight's, for a list of them), the wait bound, the table (a part
    of the op plan's, for a grid over some of its rows) and the flag, error and counter
    tensors; made on first use. The op plan fixes everything else (shapes,
    table, config, rank); with ``clip`` (a plan of a row bucket) not A's rows, which
    each launch gives (``TileGemmPlan.launch(rows=)``)."""
    b_strides = tuple(x.stride() for x in b) if isinstance(b, list) else b.stride()
    key = (a.dtype, b_strides, timeout_ns, table.data_ptr(), table.shape[0], flags.data_ptr(), err.data_ptr(),
           counter.data_ptr() if counter is not None else 0, bool(kw.get("norm_epi")), kw.get("split"),
           kw.get("sig_stride"), kw.get("clip") or None)
    gp = plans.get(key)
    if gp is None:
        from ..kernels.tile_gemm import TileGemmPlan

        gp = plans[key] = TileGemmPlan(a, b, c, table, flags=flags, err=err, timeout_ns=timeout_ns,
                                       counter=counter, **kw)
    # a captured launch reads the plan's table and split workspace on every replay: never freed
    return keep_for_capture(gp)


class fused_call:
    """The frame of one fused call on the NCCL transport, the same for every op:

        with fused_call(rt, err, cfg.check, (cs, ns), (name, counters, flags), ...) as (cur, words):
            ...allocate the outputs, queue the grids on cur and the collectives on the side streams...

    On entry, under the device's order lock: ``cur`` (the caller's stream) ordered after the
    previous call (``DeviceOrder``); each ``(name, counters, flags)`` of the call's local
    words (``Runtime.local_words``) zeroed on ``cur``; the side streams forked from ``cur``
    after that, so every launch and flag post comes after the zeroing. On exit, an
    exception too: the side streams joined back into ``cur`` (their work is ordered
    before the next call's zeroing) and the order released. Then, without an exception,
    the error word reported as ``check`` says, still under the lock (a cleared report's
    zeroing is queued on ``cur``, which the next call is ordered after)."""

    __slots__ = ("rt", "err", "check", "side", "specs", "cur")

    def __init__(self, rt: "Runtime", err: _flags.ErrorWord, check: str, side: tuple, *specs: tuple) -> None:
        self.rt, self.err, self.check, self.side, self.specs = rt, err, check, side, specs

    def __enter__(self) -> tuple[Any, list[Any]]:
        rt = self.rt
        rt.order.lock.acquire()
        try:
            words = [rt.local_words(*spec) for spec in self.specs]
            self.cur = cur = rt.current_stream()
            rt.order.begin(cur)
        except BaseException:
            rt.order.lock.release()
            raise
        try:
            for w in words:
                _flags.stream_zero(cur, w.buf, w.buf.numel())
            rt.fork(cur, *self.side)
        except BaseException:
            rt.order.end(cur)
            rt.order.lock.release()
            raise
        return cur, words

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        rt = self.rt
        try:
            try:
                rt.join(self.cur, *self.side)
            finally:
                rt.order.end(self.cur)
            if exc_type is None:
                report_errors(self.err, self.check)
        finally:
            rt.order.lock.release()


def report_errors(err: _flags.ErrorWord, check: str) -> None:
    """Turn a recorded flag timeout into ``FlagTimeoutError`` as ``check`` says. Inside a
    graph capture nothing (a capture may not synchronize or read the host mirror on
    every replay): replays' timeouts surface on the next eager call or ``check_errors``."""
    if capturing():
        return
    try:
        if check == "sync":
            err.check(block=True)
        elif check == "async":
            err.check(block=False)
            err.snapshot()
    except _flags.FlagTimeoutError as e:
        from .. import observe

        observe.record_timeout(err.what.split(" ", 1)[0], (), e)
        raise
