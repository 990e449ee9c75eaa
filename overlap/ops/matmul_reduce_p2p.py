"""The producer ops' peer-copy transport (``transport="p2p"``, one node): GEMM ->
reduce-scatter and GEMM -> all-reduce with the copy engines moving each chunk as its
tiles finish, and the destination summing the chunks as they land.

    matmul_reduce_scatter(a, b)  ==  reduce_scatter(a @ b, dim=0)
    matmul_all_reduce(a, b)      ==  all_reduce(a @ b) (+ residual)

    tensor     shape                on each of R ranks
    a          [M, K/R]             this rank's columns of the input
    b          [K/R, N]             this rank's rows of the weight (any nn.Linear layout)
    c          [M, N]               this rank's partial sums (the GEMM's output, natural row order)
    recv       [R - 1, rows, N]     the peers' partials of the rows this rank reduces (rows = M/R
                                    for the reduce-scatter, M for the all-reduce), by sender slot
                                    (``policies.push_slot``), two halves by call parity
    returns    [M/R, N] / [M, N]    the reduce-scatter's block r / the all-reduce's sum (+ residual)

The schedule (R = 2, 2 chunks; P = a tile's release add to its chunk's counter after its
stores; W = a stream wait on a chunk's count, no SM; F = a flag write, no SM):

    GEMM grid    | chunk0 tiles (P c0) ....... | chunk1 tiles (P c1) ....... |      (SMs - reduce_ctas)
    copy stream  |W c0| push c0 -> peers |F peers|F own| W c1| push c1 ... |      (copy engines)
    reduce grid  | wait own c0 + peers' c0; sum (+ residual) | wait c1; sum |      (reduce_ctas SMs)

- The GEMM is the NCCL path's: one persistent launch, tiles from one atomic counter in
  chunk order, each tile posting its chunk's counter (local words zeroed per call). It
  writes C in natural row order: a copy engine moves any contiguous rows, so the NCCL
  path's chunk-major permutation is not needed.
- The copy stream (the runtime's comm stream) waits for a chunk's tile count
  (``cuStreamWaitValue32``), pushes the chunk's rows to each destination (reduce-scatter:
  destination d gets only rows of its block d; all-reduce: the whole chunk to every
  peer), each push followed by a flag write on the destination (``Runtime.push``:
  put-with-signal, ``overlap._p2p``), then writes this rank's own flag for the chunk.
- The reduce kernel (``kernels.add_norm.ReducePlan`` with ``own=True``, no norm) waits per
  chunk for the own flag (the local partial is complete) and every peer's flag, sums the
  R partials in rank order (the same bits on every rank), adds the residual, and writes
  the output. Its programs hold ``reduce_ctas`` SMs the GEMM grid leaves (or, with
  ``reduce_shared``, run beside the GEMM's programs). Nothing waits in a circle: the GEMM
  waits on nothing, the pushes wait only on this rank's GEMM, the reduce kernel on the
  pushes; every kernel wait is bounded (``FlagTimeoutError`` naming rank, flag, expected
  and seen values, reported after the call as ``OverlapConfig.check`` says).
- All-reduce: the sum is written over C in place (no second [M, N] buffer). The own
  flag of a chunk follows that chunk's pushes on the copy stream, so the reduce kernel
  overwrites rows only after the copy engines have read them.

Shared state, as the all-reduce op's p2p path: the peer buffers are used as two halves by
call parity (no handshake; ``overlap._p2p``), the flags carry epochs the host counts per
call (``SharedFlags``), each call's signature travels beside its rows (the peer's kernel
raises ``RanksDisagreeError`` on a mismatch), ``run_p2p`` takes the epoch back where a call
failed before its first push, and a CUDA graph capture runs the reference instead (the
op's front, ``matmul_reduce.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import flags as _flags
from ..observe import gpu_range
from ..policies import Segment, flat_groups, push_slot, row_bucket, split_rows, table_tensor, upload
from . import matmul_reduce as _mr
from ._runtime import (LRU, OverlapCaptureError, OverlapConfig, Runtime, call_sig, capturing, dtype_code, gemm_plan,
                       on_stream, post_sig, report_errors)

__all__ = ["Push", "PushLayout", "push_layout"]


@dataclass(frozen=True)
class Push:
    """One copy of a chunk's rows to a destination, and the flag written behind it."""

    dest: int
    """Rank whose receive buffer the rows land in."""
    src_row: int
    """First row in the sender's C [M, N]."""
    dst_row: int
    """First row in the destination's receive buffer viewed as [(R - 1) * rows, N]."""
    rows: int
    flag: int
    """Index in the destination's shared flags (sender slot * stride + chunk)."""


@dataclass(frozen=True)
class PushLayout:
    """Who sends which rows where, for rank ``rank`` of ``world``.

    Each rank reduces ``block_rows`` rows: its block of M/R (reduce-scatter, ``scatter``)
    or all M (all-reduce), cut into row chunks (``chunk_starts``, ``chunk_rows``, within
    the block). Chunk c of destination d is C rows ``d * block_rows + start_c`` (all-reduce:
    ``start_c``) on every rank; a sender's rows land in the destination's receive slot
    ``push_slot(sender, d)``, at row ``start_c`` of the slot, and flag ``slot * stride + c``
    says they have. Flag ``(world - 1) * stride + c`` of a rank's own flags says its own
    partial of chunk c is complete (its GEMM's tiles stored)."""

    world: int
    rank: int
    m: int
    scatter: bool
    block_rows: int
    chunk_starts: tuple[int, ...]
    chunk_rows: tuple[int, ...]
    stride: int

    def block_start(self, d: int) -> int:
        """First row of C that destination ``d`` reduces."""
        return d * self.block_rows if self.scatter else 0

    def segments(self) -> list[tuple[Segment, int]]:
        """The GEMM's segments in schedule order, chunk by chunk (each with its chunk, the
        counter its tiles post): C in natural row order, every destination's rows of the
        chunk (reduce-scatter) or the chunk's rows (all-reduce)."""
        out: list[tuple[Segment, int]] = []
        for c, (st, rows) in enumerate(zip(self.chunk_starts, self.chunk_rows)):
            dests = range(self.world) if self.scatter else (0,)
            for d in dests:
                r0 = self.block_start(d) + st
                out.append((Segment(a_src=0, a_row=r0, c_row=r0, rows=rows), c))
        return out

    def pushes(self, c: int) -> list[Push]:
        """Chunk ``c``'s pushes from this rank, destinations from the right neighbour on
        (so that at R > 2 the senders start on different links)."""
        st, rows = self.chunk_starts[c], self.chunk_rows[c]
        out = []
        for step in range(1, self.world):
            d = (self.rank + step) % self.world
            slot = push_slot(self.rank, d, self.world)
            out.append(Push(d, self.block_start(d) + st, slot * self.block_rows + st, rows, slot * self.stride + c))
        return out

    def own_flag(self, c: int) -> int:
        return (self.world - 1) * self.stride + c

    def recv_flag(self, sender: int, c: int) -> int:
        """The flag of this rank's that ``sender``'s push of chunk ``c`` sets."""
        return push_slot(sender, self.rank, self.world) * self.stride + c


def push_layout(world: int, rank: int, m: int, chunks: int, scatter: bool,
                align: int = _mr.CHUNK_ALIGN) -> PushLayout:
    """The ``PushLayout`` of an [M, N] product over ``world`` ranks in ``chunks`` row chunks
    (multiples of ``align`` rows but the last; fewer where the rows are too few)."""
    from .._p2p import flag_stride

    if world < 2:
        raise ValueError(f"the peer-copy transport needs at least 2 ranks, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} of {world}")
    if scatter and m % world:
        raise ValueError(f"M={m} is not a multiple of the {world} ranks")
    block = m // world if scatter else m
    sizes = split_rows(block, chunks, align)
    stride = flag_stride(world)
    if len(sizes) > stride - 2:  # the last two flags of a sender's region: its signature words
        raise ValueError(f"at most {stride - 2} chunks on the p2p transport at {world} ranks, got {len(sizes)}")
    starts, s = [], 0
    for r in sizes:
        starts.append(s)
        s += r
    return PushLayout(world, rank, m, scatter, block, tuple(starts), tuple(sizes), stride)


@dataclass(frozen=True)
class _PeerPlan:
    layout: PushLayout
    table: torch.Tensor
    counts: tuple[int, ...]
    """Tiles per chunk: what the copy stream waits for on the chunk's counter."""
    grid: int
    programs: int
    shared: bool
    gemm: Any
    groups: torch.Tensor | None
    """A flattened GEMM's (``GemmConfig.flatten``) runs of tiles per chunk (``flat_groups``)."""
    starts: torch.Tensor
    """int32 [chunks + 1] row starts within the reduced block (the reduce kernel's)."""
    ready: Any
    """The reduce kernel's per-chunk posts (``FlagArray``, zeroed per call; read by no one
    here: the call's end is the streams' join)."""
    launches: LRU = field(default_factory=lambda: LRU(16))
    """Made on first use: the GEMM's and the reduce kernel's launch plans, and per block
    and dtype the receive views and push lists of both call parities."""


def _plan(rt: Runtime, op: str, m: int, n: int, k: int, cfg: OverlapConfig) -> _PeerPlan:
    from ..kernels.tile_gemm import DEFAULT_CONFIG
    from .all_reduce_p2p import REDUCE_PROGRAMS_PER_SM

    scatter = op == "matmul_reduce_scatter"
    gemm = cfg.gemm or DEFAULT_CONFIG
    chunks = cfg.chunks or _mr._default_chunks(m // rt.world if scatter else m)
    reduce_ctas = cfg.reduce_ctas or 16
    shared = bool(cfg.reduce_shared)
    margin = cfg.margin("p2p")
    key = ("p2p", op, m, n, k, chunks, reduce_ctas, shared, margin, gemm)
    plans = _mr._plans(rt)
    p = plans.get(key)
    if p is None:
        if capturing():
            raise OverlapCaptureError(f"{op}: M={m}, N={n}, K={k} with this config has not run outside a CUDA "
                                      "graph capture yet; call it once before capturing it")
        if cfg.two_shot:
            raise ValueError(f"{op}: two_shot is an option of all_reduce_matmul's peer-copy path; the producer "
                             "ops push every chunk to its reducer once (leave two_shot unset)")
        cfg.check_for("p2p")
        if shared and reduce_ctas > rt.num_sms:
            raise ValueError(f"{op}: reduce_shared: at most one reduce program per SM ({rt.num_sms}), "
                             f"got reduce_ctas={reduce_ctas}")
        lay = push_layout(rt.world, rt.rank, m, chunks, scatter)
        cmap = _mr.ChunkMap(lay.chunk_starts, lay.chunk_rows, tuple(lay.segments()), m)
        rows, counts = _mr.producer_table(cmap, n, gemm.block_m, gemm.block_n, gemm.group_m)
        # the reduce programs spin on flags: SMs of their own, unless they run beside the GEMM's
        grid = rt.num_sms - (0 if shared else reduce_ctas) - margin
        if grid < 1:
            raise ValueError(f"{op}: no SMs left for the GEMM: {rt.num_sms} SMs, reduce_ctas={reduce_ctas}, "
                             f"margin {margin}")
        acc = [0]
        for r in lay.chunk_rows:
            acc.append(acc[-1] + r)
        starts = upload(torch.tensor(acc, dtype=torch.int32).numpy(), rt.device)
        programs = reduce_ctas if shared else reduce_ctas * REDUCE_PROGRAMS_PER_SM
        groups = upload(flat_groups(rows), rt.device) if gemm.flatten else None
        p = _PeerPlan(lay, table_tensor(rows, rt.device), tuple(counts), grid, programs, shared, gemm, groups, starts,
                      _flags.FlagArray(len(lay.chunk_rows), rt.device))
        plans[key] = p
    return p


def _fused_p2p(rt: Runtime, op: str, a: torch.Tensor, b: torch.Tensor, residual: torch.Tensor | None,
               cfg: OverlapConfig) -> torch.Tensor:
    """One call on the peer-copy transport (run through ``_runtime.run_p2p``). Every plan
    is made before the call's epoch is taken and its first work queued: a failure there
    leaves nothing for the peers to see."""
    from ..kernels.add_norm import ReducePlan
    from .all_reduce_p2p import SHARED_SMS, shared_reduce_shape

    m, k = a.shape
    n = b.shape[1]
    world, rank = rt.world, rt.rank
    scatter = op == "matmul_reduce_scatter"
    heap = rt.p2p()
    p = _plan(rt, op, m, n, k, cfg)
    lay = p.layout
    chunks = len(lay.chunk_rows)
    rows = lay.block_rows
    row_bytes = n * a.element_size()
    # sized for the bucket of the rows (``row_bucket``): a new M of a bucket seen before
    # grows nothing (growing is collective), two halves by call parity
    half = -(-(world - 1) * row_bucket(rows) * row_bytes // 1024) * 1024
    blk = heap.block(op, 2 * half)
    sf = heap.flags(op, world * lay.stride)  # every sender slot's region, then this rank's own
    err = rt.err(op)
    timeout_ns = int((cfg.timeout_ms or _flags.default_timeout_ms(rt.group)) * 1e6)
    words = rt.local_words(op + ".p2p", 1, chunks)
    c = a.new_empty((m, n))
    x = c[lay.block_start(rank):lay.block_start(rank) + rows]  # this rank's partial of the rows it reduces
    out = a.new_empty((rows, n)) if scatter else c  # all-reduce: in place (the own flag follows the pushes)
    # per parity: the receive view and the pushes as (dst address, src offset, bytes, dest, flag)
    vk = ("views", a.dtype)
    views = p.launches.get(vk)
    if views is None or views[0] is not blk:
        recvs, lists = [], []
        for par in (0, 1):
            off = par * (blk.nbytes // 2)
            recvs.append(blk.tensor(rank, off, (world - 1, rows, n), a.dtype))
            lists.append([[(blk.ptrs[q.dest] + off + q.dst_row * row_bytes, q.src_row * row_bytes, q.rows * row_bytes,
                            q.dest, q.flag) for q in lay.pushes(ci)] for ci in range(chunks)])
        views = p.launches[vk] = (blk, recvs, lists)
    rkey = ("reduce", a.dtype, None if residual is None else residual.dtype, timeout_ns, sf.local.data_ptr(),
            err.word.data_ptr(), p.ready.flags.data_ptr())
    rp = p.launches.get(rkey)
    if rp is None:
        rp = p.launches[rkey] = ReducePlan(
            x, views[1][0], out, starts=p.starts, rflags=sf.local, ready=p.ready.flags, err=err.word, rank=rank,
            world=world, programs=p.programs, residual=residual, flag_stride=lay.stride, timeout_ns=timeout_ns,
            sig=True, own=True, shape=shared_reduce_shape(n) if p.shared else None)
    gp = gemm_plan(p.launches, a, b, c, p.table, flags=words.flags, err=err.word, timeout_ns=1,
                   counter=words.counters, rank=rank, config=p.gemm, post=True, groups=p.groups,
                   tile_only=SHARED_SMS if p.shared else None)
    descs = gp.operands(a, b)
    sig = call_sig(op, (m, k, n, dtype_code(a.dtype), int(residual is not None), chunks))
    # the epoch last, just before the first work is queued (``run_p2p`` takes it back
    # if no push follows)
    epoch = sf.next_epoch()
    par = epoch & 1
    recv, pushes = views[1][par], views[2][par]
    cur = torch.cuda.current_stream(a.device)
    cs, ns = rt.comm_stream, rt.aux_stream
    # the GEMM's dispatch and chunk counters and the reduce kernel's posts, zeroed on the
    # caller's stream before the side streams fork from it
    _flags.stream_zero(cur, words.buf, words.buf.numel())
    _flags.stream_zero(cur, p.ready.flags, len(p.ready))
    post_sig(cur, [(sf.peer(q), push_slot(rank, q, world) * lay.stride) for q in range(world) if q != rank],
             epoch, lay.stride, sig)
    rt.p2p_begin(op, cur, ns)
    # the GEMM first: its grid takes the SMs it is sized for, the reduce programs the rest
    with gpu_range("gemm", "grid"):
        gp.launch(descs, c, epoch=1, grid=p.grid)
    src = c.data_ptr()
    for ci in range(chunks):
        with gpu_range("comm", "chunk", ci):
            # every tile of the chunk stored (each posted once, with release)
            _flags.stream_wait_value(cs, words.flags, ci, p.counts[ci])
            for dst, src_off, nbytes, dest, idx in pushes[ci]:
                rt.push(dst, src + src_off, nbytes, sf.peer(dest), idx, epoch)
            # the local partial complete, and (same stream) read by the pushes above
            _flags.stream_write_value(cs, sf.local, lay.own_flag(ci), epoch)
    with on_stream(ns, cur), gpu_range("reduce", "kernel"):
        rp.launch(x, recv, out, epoch=epoch, residual=residual, sig=sig)
    rt.join(cur, cs, ns)  # no record_stream needed (Runtime.join)
    rt.p2p_end(op, cur)
    report_errors(err, cfg.check)
    _mr.stats["fused"] += 1
    _mr.stats["p2p"] += 1
    return out
