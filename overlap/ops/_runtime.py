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

The ops' other shared modules: ``_state`` (bounded caches, capture, call order, error
words, local flag words), ``_config`` (``OverlapConfig`` and the transports), ``_sigs``
(signatures and the agreement point), ``_plans`` (the call frame and GEMM plans),
``_tuning`` (the tuners' skeleton), ``_calls`` (a call plan per signature and its bound
body), ``_lifecycle`` (``reset`` and the runtimes' end at shutdown). Their names are
importable from here as well.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .. import flags as _flags
from ..dist import shared as _share
from . import _agree
from ._config import (MAX_CHUNKS, MAX_SMS, MAX_TIMEOUT_MS, MIN_TIMEOUT_MS, SEQUENTIAL, Chunked,  # noqa: F401
                      NcclTransport, OverlapConfig, Path, PeerCopyTransport, Sequential, _env_transport,
                      check_gemm_field, env_sm_margin)
from ._state import (LRU, DeviceOrder, LocalWords, OverlapCaptureError, Words, _captured_words,  # noqa: F401
                     _error_words, _kept_for_capture, _orders, _warned, capturing, check_errors, device_order,
                     keep_for_capture, register_error_word, warn_once)

__all__ = ["LRU", "keep_for_capture", "Runtime", "get_runtime", "local_runtime", "OverlapConfig", "NcclTransport", "PeerCopyTransport", "warn_once", "resolve_group", "check_agree", "time_ms",
           "report_errors", "fused_call", "on_stream", "time_candidates", "split_variants", "ws_variants", "gemm_plan",
           "OverlapCaptureError", "capturing", "device_order", "check_errors", "register_error_word", "reset",
           "Sequential", "Chunked", "Path", "SEQUENTIAL", "tune_paths", "flat_variants"]

_lock = threading.Lock()
_runtimes: dict[tuple, "Runtime"] = {}
"""By (group ranks, device index); the local runtimes by (None, device index)."""


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
        _flags.warm_kernel_forms(device)  # (what a captured call's posts and waits launch)

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
            c = LRU(cap)
            # a tuned pick or a call plan changes what a call decides: ``_calls``'s index watches them
            c.watched = name.endswith((".tuned", ".calls"))
            c = self._caches.setdefault(name, c)  # two threads making it get one
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

    def event(self, key: Any) -> torch.cuda.Event:
        """The runtime's event ``key``, made on first use and reused by every call (a wait
        takes the record made before it; a device's calls queue their work one at a time,
        ``fused_call``'s order lock): ``fork``'s and ``join``'s, a chunk's (``chunk_ready``)."""
        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = torch.cuda.Event()
        return ev

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
            if self.group is not None:
                self._errs[name].ranks = self.ranks  # a peer's refusal record ends this group (ops._refusal)
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
    me = _share.this_process(tdist.get_rank())
    try:
        import cupy  # noqa: F401

        mine = (host, "", gpu, me)
    except Exception as e:  # noqa: BLE001
        mine = (host, f"rank {rt.rank}: cupy: {e}", gpu, me)
    if not mine[1] and not _flags._cuda_driver():
        # the flag writes would fall back to a fill kernel, which finds no SM while
        # the GEMM (all SMs) waits for it: every call would time out
        mine = (host, f"rank {rt.rank}: cuda-bindings missing (pip install 'overlap[cu13]' or [cu12])", gpu, me)
    alls: list[Any] = [None] * rt.world
    tdist.all_gather_object(alls, mine, group=rt.group)
    _note_sharing(rt, host, [(h, g) for h, _, g, _ in alls])
    if rt.shared_gpu:  # the processes on this GPU, named if this rank's context is lost
        _share.note_gpu_peers(me.rank, [p for h, _, g, p in alls if (h, g) == (host, gpu)])
    hosts = {h for h, _, _, _ in alls}
    errs = [e for _, e, _, _ in alls if e]
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



def resolve_group(group: Any) -> Any:
    """``group``, else the tensor-parallel group of ``overlap.dist.init``, else WORLD."""
    if group is not None:
        return group
    if not _ctx_mod:
        from ..dist import context as ctx_mod  # (lazy: overlap.dist imports the ops)
        import torch.distributed as tdist

        _ctx_mod[:] = [ctx_mod, tdist.group]
    ctx = _ctx_mod[0]._ctx  # ``overlap.dist.get_context()`` (read on every call: one attribute)
    if ctx is not None:
        return ctx.tp_group
    return _ctx_mod[1].WORLD


_ctx_mod: list[Any] = []


# the names of the split-out modules, where the ops and tests import them from
from ._plans import (bucketed, fused_call, gemm_plan, observed, plan_rows_for, report_errors,  # noqa: E402,F401
                     serial_phases)
from ._sigs import (AGREED_CAP, REFRESH_EVERY, agree_on_reference, all_gather_single, call_sig,  # noqa: E402,F401
                    agree_key, check_agree, check_agreed, dtype_code, every_call_checked, gather_ints, post_sig,
                    refuse_grad)
from ._tuning import (TUNE_TIMEOUT_MS, WARM_TIMEOUT_MS, confirm_best, flat_variants, shared_gpu_choices,  # noqa: E402,F401
                      split_variants, time_candidates, time_ms, tune_paths, tuning_bound, ws_variants,
                      _none_timed_out)
from ._lifecycle import _drain, reset, reset_runtimes, shutdown_timeout_s  # noqa: E402,F401
