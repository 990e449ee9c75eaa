"""Per-group state the overlapped ops share: communicators, streams, flags, SM budget.

One ``Runtime`` per (group ranks, device). It owns

* the library's NCCL communicators over the group, one per CTA cap (capped ones
  for the overlapped path; an uncapped one for the chunked stream baseline),
* a high-priority communication stream (NCCL kernels launched there are
  scheduled ahead of queued GEMM work) and a high-priority auxiliary stream
  (per-chunk prologues such as the all-reduce op's residual add and norm),
* flag arrays and an error word per op,

and knows the SM count, from which the GEMM grid is sized so that NCCL's CTAs
always find free SMs (a persistent grid over every SM, spinning on flags that
NCCL must set, never lets NCCL run: measured hang, see DESIGN.md).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .. import flags as _flags

__all__ = ["Runtime", "get_runtime", "OverlapConfig", "warn_once", "resolve_group", "check_agree", "time_ms",
           "report_errors", "on_stream", "time_candidates", "split_variants", "ws_variants", "gemm_plan"]

_lock = threading.Lock()
_runtimes: dict[tuple, "Runtime"] = {}
_warned: set[str] = set()


def warn_once(key: str, msg: str) -> None:
    """Warn once per process and key (fallbacks are never silent, never noisy)."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, stacklevel=3)


@dataclass(frozen=True, kw_only=True)
class OverlapConfig:
    """How an overlapped op runs; fields left ``None`` come from the tuner or defaults."""

    chunks: int | None = None
    """NCCL calls the collective is cut into (each followed by a flag post)."""
    nccl_ctas: int | None = None
    """Cap on NCCL's CTAs for the op's communicator (about 10 GB/s each on NVLink)."""
    sm_margin: int | None = None
    """SMs left idle beyond NCCL's CTAs (or the reduce kernel's programs); ``None``:
    4 on the NCCL transport, 0 on the peer-copy transport."""
    give_back: bool = True
    """After the last chunk lands (or the p2p all-reduce's reduce kernel ends), launch a
    second GEMM grid on the SMs the first one left, taking tiles from the same dispatch
    counter. Ignored by the p2p all-gather, whose GEMM holds every SM."""
    gemm: Any = None
    """``overlap.kernels.tile_gemm.GemmConfig``; ``None``: the tuned or default one."""
    timeout_ms: float | None = None
    """Bound of one tile's flag wait; ``None``: ``OVERLAP_WAIT_TIMEOUT_MS`` or 500 ms."""
    transport: str | None = None
    """How rows move between GPUs: "nccl" (chunked NCCL collectives on the
    library's communicator; their CTAs hold SMs) or "p2p" (copy-engine pushes into
    peer memory on one node, ``overlap._p2p``; no SM). ``None``: "p2p" where the
    group's ranks can map each other's memory (``OVERLAP_TRANSPORT`` overrides)."""
    reduce_ctas: int | None = None
    """p2p all-reduce: SMs left to the kernel that sums the pushed partials (and adds
    the residual and norms) chunk by chunk, one program each; ``None``: 16."""
    reduce_shared: bool = False
    """p2p all-reduce: the reduce kernel runs in small programs (4 warps, short column
    blocks, few registers) *beside* the GEMM's programs on the same SMs, instead of on
    SMs of its own: the GEMM grid covers every SM and no give-back grid runs;
    ``reduce_ctas`` then counts the reduce programs. A GEMM program leaves room on its
    SM for one such program (registers and shared memory), so they are resident
    whichever is dispatched first. Not with a warp-specialized GEMM
    (``GemmConfig.warp_specialize``: ValueError)."""
    two_shot: bool = False
    """p2p all-reduce: reduce-scatter, then all-gather (instead of every rank summing all
    rows). Each rank's reduce kernel sums only the rows it owns (1/R of them, pushed to it
    by every peer), and its copy stream pushes each reduced chunk (with the folded norm's
    row statistics) back to every peer as soon as it is ready; the GEMM reads its own rows
    from h and the peers' from the shared buffer. The same bytes cross the links as in the
    one-shot push; the reduce kernel does 1/R of the work. With a norm it needs
    ``fold_norm`` (the GEMM must read h, not normed rows). The residual is added by the
    rank that reduces a row, so it must be the same on every rank (the replicated residual
    stream of tensor parallelism is)."""
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
    Ignored without a norm and on the NCCL transport."""
    check: str = "async"
    """Timeout reporting: 'sync' (check after every call; synchronizes), 'async'
    (raise on a later call once the copy of the error word has landed), 'none'."""

    def __post_init__(self) -> None:
        if self.chunks is not None and self.chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {self.chunks}")
        if self.nccl_ctas is not None and not (1 <= self.nccl_ctas <= 64):
            raise ValueError(f"nccl_ctas must be in [1, 64], got {self.nccl_ctas}")
        if self.sm_margin is not None and self.sm_margin < 0:
            raise ValueError(f"sm_margin must be >= 0, got {self.sm_margin}")
        if self.transport not in (None, "nccl", "p2p"):
            raise ValueError(f"transport must be 'nccl', 'p2p' or None, got {self.transport!r}")
        if not (0 <= self.split_tail <= 64):
            raise ValueError(f"split_tail must be in [0, 64], got {self.split_tail}")
        if self.reduce_ctas is not None and not (1 <= self.reduce_ctas <= 1024):
            raise ValueError(f"reduce_ctas must be in [1, 1024], got {self.reduce_ctas}")
        if self.check not in ("sync", "async", "none"):
            raise ValueError(f"check must be 'sync', 'async' or 'none', got {self.check!r}")
        if self.timeout_ms is not None and self.timeout_ms <= 0:
            raise ValueError(f"timeout_ms must be > 0, got {self.timeout_ms}")

    def margin(self, transport: str) -> int:
        """``sm_margin`` resolved for ``transport``."""
        if self.sm_margin is not None:
            return self.sm_margin
        return 4 if transport == "nccl" else 0


class Runtime:
    """Communicators, stream, flags and SM budget for one group on one device."""

    def __init__(self, group: Any, ranks: tuple[int, ...], rank: int, device: torch.device) -> None:
        self.group, self.ranks, self.rank, self.device = group, ranks, rank, device
        self.world = len(ranks)
        props = torch.cuda.get_device_properties(device)
        self.num_sms = int(props.multi_processor_count)
        self.comm_stream = torch.cuda.Stream(device=device, priority=-1)
        # prologue work between a chunk landing and its flag (e.g. residual add + norm)
        self.aux_stream = torch.cuda.Stream(device=device, priority=-1)
        # a second copy stream: pushes that wait on this rank's own kernels (the two-shot
        # all-reduce's gather) must not queue behind those that do not
        self.copy_stream = torch.cuda.Stream(device=device, priority=-1)
        self._comms: dict[int | None, Any] = {}
        self._flags: dict[str, _flags.FlagArray] = {}
        self._errs: dict[str, _flags.ErrorWord] = {}
        self._counters: dict[str, torch.Tensor] = {}
        self._heap: Any = None
        self._p2p_why: str | None = None  # None: not decided yet
        self._p2p_done: dict[str, tuple[torch.cuda.Event, torch.cuda.Stream]] = {}
        self._events: dict[Any, torch.cuda.Event] = {}  # fork / join, reused (see fork)

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

        All on one stream. Measured on 2x H200 (256 MB per rank in 16 chunks, a flag
        write after each): 0.80 ms on one stream, 0.77 alternating two streams, 0.79 with
        the flag writes on a second stream behind events, against 0.69 for one copy;
        inside the all-reduce op the one-stream order was the fastest (1.14 ms at
        16384x2048x8192, against 1.16 and 1.68)."""
        from .. import _p2p

        _p2p.memcpy_async(dst, src, nbytes, self.comm_stream)
        _flags.stream_write_value(self.comm_stream, flags, idx, value)

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

    def flags(self, name: str, n: int) -> _flags.FlagArray:
        f = self._flags.get(name)
        if f is None or len(f) < n:
            f = _flags.FlagArray(max(n, 64), self.device)
            self._flags[name] = f
        return f

    def err(self, name: str) -> _flags.ErrorWord:
        if name not in self._errs:
            self._errs[name] = _flags.ErrorWord(self.device, what=name)
        return self._errs[name]

    def counter(self, name: str, n: int = 1) -> torch.Tensor:
        """An op's int32 counter words: the GEMM's dispatch counter, then one count per
        split tile (``OverlapConfig.split_tail``); at least ``n``, zeroed by the op per call."""
        c = self._counters.get(name)
        if c is None or c.numel() < n:
            c = self._counters[name] = torch.zeros(max(n, 1 if c is None else 2 * c.numel()), dtype=torch.int32,
                                                   device=self.device)
        return c


def _env_transport() -> str | None:
    import os

    v = os.environ.get("OVERLAP_TRANSPORT", "").strip().lower()
    if v in ("", "auto"):
        return None
    if v not in ("nccl", "p2p"):
        raise ValueError(f"OVERLAP_TRANSPORT must be 'nccl', 'p2p' or 'auto', got {v!r}")
    return v


def _open_heap(rt: Runtime) -> tuple[Any, str]:
    """(PeerHeap, "") or (None, why). Collective over the runtime's group."""
    import socket

    import torch.distributed as tdist

    from .._p2p import P2PUnavailable, PeerHeap

    if rt.world == 1:
        return None, "one rank: nothing to move"
    try:
        import cupy  # noqa: F401

        mine = (socket.gethostname(), "")
    except Exception as e:  # noqa: BLE001
        mine = (socket.gethostname(), f"rank {rt.rank}: cupy: {e}")
    if not mine[1] and not _flags._cuda_driver():
        # the flag writes would fall back to a fill kernel, which finds no SM while
        # the GEMM (all SMs) waits for it: every call would time out
        mine = (mine[0], f"rank {rt.rank}: cuda-bindings missing (pip install 'overlap[cu13]' or [cu12])")
    alls: list[Any] = [None] * rt.world
    tdist.all_gather_object(alls, mine, group=rt.group)
    hosts = {h for h, _ in alls}
    errs = [e for _, e in alls if e]
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


def get_runtime(group: Any, device: torch.device) -> Runtime:
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


def reset_runtimes() -> None:
    """Forget every runtime; ``dist.shutdown`` calls this before it destroys the
    communicators the runtimes hold, so ops after a new ``init`` build fresh ones."""
    with _lock:
        for rt in _runtimes.values():
            try:
                torch.cuda.synchronize(rt.device)
                rt.close()
            except Exception:  # noqa: BLE001 - teardown is best effort
                pass
        _runtimes.clear()
        _by_group.clear()


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


_agreed: set[tuple] = set()


def check_agree(rt: Runtime, op: str, names: tuple[str, ...], values: tuple[int, ...]) -> None:
    """Sizes that must agree across the group's ranks (else NCCL sizes disagree
    and peers hang). Checked once per (op, values) with a tiny all-gather on
    torch's group; a rank that disagrees makes every rank raise."""
    key = (rt.ranks, op, names, values)
    if key in _agreed:
        return
    import torch.distributed as tdist

    n = len(values)
    mine = torch.tensor(values, dtype=torch.int64, device=rt.device)
    alls = torch.empty(rt.world * n, dtype=torch.int64, device=rt.device)
    tdist.all_gather_into_tensor(alls, mine, group=rt.group)
    vals = alls.view(rt.world, n).tolist()
    if any(v != vals[0] for v in vals):
        raise ValueError(f"{op}: ranks disagree on ({', '.join(names)}): {vals} (rank order of the group)")
    _agreed.add(key)


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
        t = timer(lambda: run(cand), iters, group)
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

    ranked = [c for _, c in sorted(results, key=lambda r: r[0]) if isinstance(c, OverlapConfig) and c.split_tail < 2]
    return [replace(c, split_tail=s) for c in ranked[:top] for s in parts]


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
              and not getattr(c.gemm, "warp_specialize", False)]
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
    ranked += [r for r in ordered[max(1, top):] if isinstance(r[1], str) and r[1] in keep]
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


def gemm_plan(plans: dict, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, table: torch.Tensor, *,
              flags: torch.Tensor, err: torch.Tensor, timeout_ns: int, counter: torch.Tensor | None = None,
              **kw: Any) -> Any:
    """The ``TileGemmPlan`` in ``plans`` (an op plan's own dict) for these operands'
    dtype, B's layout, the wait bound and the flag, error and counter tensors; made on
    first use. The op plan fixes everything else (shapes, table, config, rank)."""
    key = (a.dtype, b.stride(), timeout_ns, flags.data_ptr(), err.data_ptr(),
           counter.data_ptr() if counter is not None else 0, bool(kw.get("norm_epi")), kw.get("split"))
    gp = plans.get(key)
    if gp is None:
        from ..kernels.tile_gemm import TileGemmPlan

        gp = plans[key] = TileGemmPlan(a, b, c, table, flags=flags, err=err, timeout_ns=timeout_ns,
                                       counter=counter, **kw)
    return gp


def report_errors(err: _flags.ErrorWord, check: str) -> None:
    """Turn a recorded flag timeout into ``FlagTimeoutError`` as ``check`` says."""
    if check == "sync":
        err.check(block=True)
    elif check == "async":
        err.check(block=False)
        err.snapshot()
