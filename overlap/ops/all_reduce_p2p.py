"""The all-reduce op's peer-copy transport (``transport="p2p"``, one node): the one-shot
path (every rank pushes each row chunk of its partial sums into every peer's buffer; a
persistent reduce kernel sums them in rank order, adds the residual, norms, and posts the
chunk for the GEMM) and the two-shot path (each rank reduces its share of the rows and
pushes them back), the folded norm's B', and the layouts they use. The op's front, its
reference, plans, NCCL transport and tuner are in ``all_reduce.py``; the schedule is drawn
there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .. import flags as _flags
from ..observe import gpu_range
from ..policies import Segment, push_slot, row_bucket, split_rows
from . import all_reduce as _ar
from ._runtime import (OverlapConfig, Runtime, call_sig, dtype_code, gemm_plan, on_stream, post_sig,
                       report_errors)

if TYPE_CHECKING:
    from ..kernels.add_norm import ReduceShape
    from .all_reduce import Norm, _Plan

_NAN = torch.tensor(float("nan"))
"""A CPU scalar (taken as a value by ops on any device) for rows a failed call had no data for."""

REDUCE_PROGRAMS_PER_SM = 1
"""p2p reduce kernel programs per SM left to it. Its programs spin on flags, so every
one must be resident while the GEMM holds the other SMs: at K = 8192 a program needs
over half an SM's registers, so one per SM (more would wait for SMs that the GEMM
frees only at its end, and the GEMM's waits would time out)."""


@dataclass(frozen=True)
class _TwoShot:
    """Rows of the two-shot all-reduce: rank r reduces rows [offsets[r], offsets[r] +
    rows[r]) in row chunks ``chunks[r]``. Shared flags (region of ``flag_stride`` per
    sender slot s = ``push_slot``): s * stride + c, peer's partial of my chunk c landed
    (reduce-scatter); s * stride + C + c, peer's reduced chunk c landed (all-gather; C =
    the chunk count asked for); (R - 1) * stride + c, my own chunk c reduced (written by
    my copy stream once the reduce kernel posted it)."""

    world: int
    rank: int
    rows: tuple[int, ...]
    offsets: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    ask: int
    stride: int

    def starts(self, r: int) -> list[int]:
        out, s = [], 0
        for c in self.chunks[r]:
            out.append(s)
            s += c
        return out

    def rs_flag(self, sender: int, receiver: int, c: int) -> int:
        return push_slot(sender, receiver, self.world) * self.stride + c

    def ag_flag(self, sender: int, receiver: int, c: int) -> int:
        return push_slot(sender, receiver, self.world) * self.stride + self.ask + c

    def own_flag(self, c: int) -> int:
        return (self.world - 1) * self.stride + c

    def segments(self) -> list[Segment]:
        """The GEMM's rows: own chunks (A = h, no peer involved), then chunk by chunk the
        peers' (A2 = the gathered buffer, at the same rows)."""
        me, segs = self.rank, []
        for c, (s, rows) in enumerate(zip(self.starts(me), self.chunks[me])):
            o = self.offsets[me] + s
            segs.append(Segment(a_src=0, a_row=o, c_row=o, rows=rows, wait_idx=self.own_flag(c)))
        for c in range(max(len(ch) for ch in self.chunks)):
            for step in range(1, self.world):
                r = (me - step) % self.world
                if c < len(self.chunks[r]):
                    o = self.offsets[r] + self.starts(r)[c]
                    segs.append(Segment(a_src=1, a_row=o, c_row=o, rows=self.chunks[r][c],
                                        wait_idx=self.ag_flag(r, me, c)))
        return segs


def _two_shot_layout(world: int, rank: int, m: int, chunks: int) -> _TwoShot:
    from .._p2p import flag_stride

    rows = split_rows(m, world, _ar.CHUNK_ALIGN)
    if len(rows) < world:
        raise ValueError(f"two_shot: M={m} has fewer than {world} blocks of {_ar.CHUNK_ALIGN} rows to share out")
    offsets, acc = [], 0
    for r in rows:
        offsets.append(acc)
        acc += r
    stride = flag_stride(world)
    if 2 * chunks > stride - 2:  # the last two flags of a region: the sender's signature words
        raise ValueError(f"two_shot: at most {(stride - 2) // 2} chunks at {world} ranks")
    return _TwoShot(world, rank, tuple(rows), tuple(offsets),
                    tuple(tuple(split_rows(r, chunks, _ar.CHUNK_ALIGN)) for r in rows), chunks, stride)


SHARED_SMS = ("reduce_shared: the reduce kernel's programs share the GEMM's SMs, which the tile GEMM leaves room "
              "on and the Gluon GEMM does not")
"""Why a GEMM beside a reduce kernel on its SMs stays on the tile GEMM (``engine_plan``'s ``tile_only``)."""


def shared_reduce_shape(k: int) -> ReduceShape:
    """The reduce kernel's block shape when its programs share SMs with the GEMM's
    (``OverlapConfig.reduce_shared``): 4 warps over 4096 elements (2 rows of 2048
    columns at K >= 2048). Its registers (48-110 per thread on triton 3.6, sm_90) fit
    beside a GEMM program of 128 x 256 tiles (8 warps, up to 216 per thread) in the
    SM's 64K, and it takes 1 KB of shared memory against the GEMM's 148 KB of 228."""
    block_k = min(2048, 1 << max(0, (k - 1).bit_length()))
    rows = max(1, min(8, 4096 // block_k))
    # the written norm's output pass in blocks of the same rows (twice would take more
    # registers than fit beside the GEMM)
    from ..kernels.add_norm import ReduceShape

    return ReduceShape(block_k=block_k, rows=rows, num_warps=4, y_rows=rows)


def _fold(p: _Plan, b: torch.Tensor, norm: Norm, num_sms: int) -> tuple[torch.Tensor, torch.Tensor]:
    """B' = diag(norm weight) B and its column vectors, through the op plan's ``FoldPlan``."""
    from ..kernels.norm_fold import FoldPlan, foldable

    if not foldable(b):
        b = b.contiguous()
    fkey = ("fold", b.dtype, b.stride(), norm.weight.dtype, None if norm.bias is None else norm.bias.dtype)
    fp = p.launches.get(fkey)
    if fp is None:
        fp = p.launches[fkey] = FoldPlan(b, norm.weight, norm.bias, num_sms=num_sms)
    return fp.launch(b, norm.weight, norm.bias)


def _fused_p2p(rt: Runtime, x: torch.Tensor, b: torch.Tensor, residual: torch.Tensor | None, norm: Norm | None,
               cfg: OverlapConfig) -> tuple[torch.Tensor, torch.Tensor]:
    from .._p2p import flag_stride
    from ..kernels.add_norm import ReducePlan

    if cfg.two_shot and norm is not None and not cfg.fold_norm:
        raise ValueError("two_shot with a norm needs fold_norm=True (the GEMM reads h, not normed rows)")
    m, k = x.shape
    n = b.shape[1]
    world, rank = rt.world, rt.rank
    heap = rt.p2p()
    p = _ar._plan(rt, m, n, k, cfg, "p2p")
    if p.two_shot is not None:
        return _fused_two_shot(rt, p, x, b, residual, norm, cfg)
    chunks = len(p.chunk_rows)
    row_bytes = k * x.element_size()
    # sized for the bucket of M (``row_bucket``): a new M of a bucket seen before grows
    # nothing, so it needs no collective (growing is one) and no host agreement check
    half = -(-(world - 1) * row_bucket(m) * row_bytes // 1024) * 1024
    # two halves by call parity (overlap._p2p: no handshake needed for reuse)
    blk = heap.block("all_reduce_matmul", 2 * half)
    stride = flag_stride(world)
    if chunks > stride - 2:  # the last two flags of a sender's region: its signature words
        raise ValueError(f"all_reduce_matmul: at most {stride - 2} chunks on the p2p transport at {world} ranks")
    sf = heap.flags("all_reduce_matmul", (world - 1) * stride)
    ready = p.ready
    err = rt.err("all_reduce_matmul")
    counter = rt.counter("all_reduce_matmul", p.counters)
    timeout_ns = int((cfg.timeout_ms or _flags.default_timeout_ms(rt.group)) * 1e6)
    residual, norm = _ar._contiguous(residual, norm)
    fold = cfg.fold_norm and norm is not None
    h = torch.empty_like(x)
    y = torch.empty_like(x) if norm is not None and not fold else h
    rowstat = torch.empty((m, 2), dtype=torch.float32, device=x.device) if fold else None
    c = x.new_empty((m, n))
    # the epoch last, just before the first work is queued: a call that fails before
    # its first push takes it back (``_run_p2p``)
    epoch = sf.next_epoch()
    # the ready flags are counted on this device only: zeroed per call (LocalWords'
    # argument), so a GEMM tile waits for the reduce programs' count of one call
    r_epoch = 1
    # this parity's receive view and push list, made once per plan, block and dtype
    ck = ("p2p", epoch % 2, x.dtype)
    st = p.launches.get(ck)
    if st is None or st[0] is not blk:
        off = (epoch % 2) * (blk.nbytes // 2)
        pushes, start = [], 0
        for c_idx, rows in enumerate(p.chunk_rows):
            for step in range(1, world):
                peer = (rank + step) % world
                slot = push_slot(rank, peer, world)
                pushes.append((blk.ptrs[peer] + off + (slot * m + start) * row_bytes, start * row_bytes,
                               rows * row_bytes, sf.peer(peer), slot * stride + c_idx))
            start += rows
        st = p.launches[ck] = (blk, blk.tensor(rank, off, (world - 1, m, k), x.dtype), pushes)
    recv = st[1]
    cur = torch.cuda.current_stream(x.device)
    ns = rt.aux_stream
    # reset the dispatch counter (and split tiles' counts) and the ready flags before the
    # side streams fork from this one
    _flags.stream_zero(cur, counter, p.counters)
    _flags.stream_zero(cur, ready.flags, len(ready))
    sig = call_sig("all_reduce_matmul", (m, k, n, dtype_code(x.dtype), int(residual is not None), _ar._norm_code(norm),
                                         chunks))
    post_sig(cur, [(sf.peer(q), push_slot(rank, q, world) * stride) for q in range(world) if q != rank], epoch,
             stride, sig)
    rt.p2p_begin("all_reduce_matmul", cur, ns)
    src = x.data_ptr()
    with gpu_range("comm", "pushes"):
        for dst, src_off, nbytes, peer_flags, idx in st[2]:
            rt.push(dst, src + src_off, nbytes, peer_flags, idx, epoch)
    # folded: the reduce kernel takes no weight, bias or y, and writes the rows' statistics
    w = norm.weight if norm and not fold else None
    bias = norm.bias if norm and not fold else None
    y_out = y if norm is not None and not fold else None
    rkey = ("reduce", x.dtype, None if residual is None else residual.dtype, norm.kind if norm else None,
            None if w is None else w.dtype, None if bias is None else bias.dtype,
            norm.eps if norm else 0.0, timeout_ns, sf.local.data_ptr(), err.word.data_ptr(), fold)
    rp = p.launches.get(rkey)
    if rp is None:
        rp = p.launches[rkey] = ReducePlan(
            x, recv, h, starts=p.starts, rflags=sf.local, ready=ready.flags, err=err.word, rank=rank, world=world,
            programs=p.reduce_programs, residual=residual, norm=norm.kind if norm else None, weight=w, bias=bias,
            eps=norm.eps if norm else 1e-5, y=y_out, flag_stride=stride, timeout_ns=timeout_ns, stats=rowstat,
            sig=True, shape=shared_reduce_shape(k) if p.reduce_shared else None)
    with on_stream(ns, cur), gpu_range("reduce", "kernel"):
        rp.launch(x, recv, h, epoch=epoch, residual=residual, weight=w, bias=bias, y=y_out, stats=rowstat, sig=sig)
    vec = None
    if fold:
        # B' = diag(weight) B and its column vectors, on this stream while the first chunk moves
        b, vec = _fold(p, b, norm, rt.num_sms)
        if p.give_back_grid:
            # the give-back grid on the reduce stream reads them too: after the fold (queued
            # there behind the reduce kernel, so that one does not wait)
            rt.fork(cur, ns)
    gp = gemm_plan(p.launches, y, b, c, p.table, flags=ready.flags, err=err.word, timeout_ns=timeout_ns,
                   counter=counter, rank=rank, config=p.gemm, wait=True, norm_epi=fold, split=p.split,
                   groups=p.groups, tile_only=SHARED_SMS if p.reduce_shared else None)
    descs = gp.operands(y, b)
    # a one-program gate on the first chunk's ready flag before the grid: while a peer's
    # rows are late the GEMM holds no SM (the reduce kernel's programs do, on theirs)
    idx, mult = p.first_wait
    _ar.gate(ready.flags, err, rank, timeout_ns, idx=idx, expected=r_epoch * mult, ahead=(r_epoch + 2) * mult)
    with gpu_range("gemm", "grid"):
        gp.launch(descs, c, epoch=r_epoch, grid=p.grid, rowstat=rowstat, colvec=vec)
    if p.give_back_grid:
        # queued behind the reduce kernel: its SMs are free by then
        with on_stream(ns, cur):
            gp.launch(descs, c, epoch=r_epoch, grid=p.give_back_grid, rowstat=rowstat, colvec=vec)
    rt.join(cur, rt.comm_stream, ns)  # no record_stream needed (Runtime.join)
    rt.p2p_end("all_reduce_matmul", cur)
    report_errors(err, cfg.check)
    _ar.stats["fused"] += 1
    _ar.stats["p2p"] += 1
    return c, h


def _fused_two_shot(rt: Runtime, p: _Plan, x: torch.Tensor, b: torch.Tensor, residual: torch.Tensor | None,
                    norm: Norm | None, cfg: OverlapConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The p2p all-reduce as reduce-scatter then all-gather (``OverlapConfig.two_shot``):

        copy stream    | push peers' rows of my partial -> their slots |W|        (copy engines)
        reduce grid    | wait my rows' chunks; sum (+ residual, row stats); post |
        copy stream 2  | wait chunk c reduced |W own| push h rows c (+ stats) -> peers |W| ... |
        GEMM grid      | my rows' tiles (wait own flags) | peers' rows' tiles (wait their pushes), from the buffer |
        current stream                                                             ... | copy peers' rows into h |
    """
    from ..kernels.add_norm import ReducePlan

    two = p.two_shot
    m, k = x.shape
    n = b.shape[1]
    world, rank = rt.world, rt.rank
    heap = rt.p2p()
    esize = x.element_size()
    row_bytes = k * esize
    me_rows, me_off = two.rows[rank], two.offsets[rank]

    def up(v: int) -> int:
        return -(-v // 1024) * 1024

    rs_part = up((world - 1) * max(two.rows) * row_bytes)
    ag_part = up(m * row_bytes)
    # the block sized for the bucket of M (``row_bucket``, as in ``_fused_p2p``): a rank's
    # share of rows is at most M / R + 128 (``split_rows`` in 128-row units), so each half
    # holds this call's parts, whose offsets follow M
    mb = row_bucket(m)
    blk = heap.block("all_reduce_matmul.two_shot",
                     2 * (up((world - 1) * (-(-mb // world) + _ar.CHUNK_ALIGN) * row_bytes) + up(mb * row_bytes)
                          + up(mb * 8)))
    sf = heap.flags("all_reduce_matmul", two.own_flag(two.ask))
    ready = p.ready
    err = rt.err("all_reduce_matmul")
    counter = rt.counter("all_reduce_matmul", p.counters)
    timeout_ns = int((cfg.timeout_ms or _flags.default_timeout_ms(rt.group)) * 1e6)
    residual, norm = _ar._contiguous(residual, norm)
    fold = norm is not None
    h = torch.empty_like(x)
    c = x.new_empty((m, n))
    epoch = sf.next_epoch()
    r_epoch = 1  # the ready flags are zeroed per call, as in _fused_p2p
    # this parity's views and push lists, made once per plan, block and dtype
    ck = ("two_shot", epoch % 2, x.dtype)
    st = p.launches.get(ck)
    if st is None or st[0] is not blk:
        off = (epoch % 2) * (blk.nbytes // 2)
        rs = blk.tensor(rank, off, (world - 1, me_rows, k), x.dtype)
        ag = blk.tensor(rank, off + rs_part, (m, k), x.dtype)
        stats_all = blk.tensor(rank, off + rs_part + ag_part, (m, 2), torch.float32)
        scatter = []  # (dst, src offset in x, bytes, peer, flag): my partial of peer q's rows
        for c_idx in range(max(len(ch) for ch in two.chunks)):
            for step in range(1, world):
                q = (rank + step) % world
                if c_idx >= len(two.chunks[q]):
                    continue
                s0 = two.starts(q)[c_idx]
                rows = two.chunks[q][c_idx]
                slot = push_slot(rank, q, world)
                scatter.append((blk.ptrs[q] + off + (slot * two.rows[q] + s0) * row_bytes,
                                (two.offsets[q] + s0) * row_bytes, rows * row_bytes, q, two.rs_flag(rank, q, c_idx)))
        gather = []  # per own chunk: (rows offset, bytes, [(peer, dst of rows, dst of stats, flag)])
        for c_idx, (s0, rows) in enumerate(zip(two.starts(rank), two.chunks[rank])):
            g0 = me_off + s0
            gather.append((g0, rows, [(q, blk.ptrs[q] + off + rs_part + g0 * row_bytes,
                                       blk.ptrs[q] + off + rs_part + ag_part + g0 * 8, two.ag_flag(rank, q, c_idx))
                                      for q in range(world) if q != rank]))
        st = p.launches[ck] = (blk, rs, ag, stats_all, scatter, gather)
    _, rs, ag, stats_all, scatter, gather = st
    cur = torch.cuda.current_stream(x.device)
    ns, cs2 = rt.aux_stream, rt.copy_stream
    _flags.stream_zero(cur, counter, p.counters)
    _flags.stream_zero(cur, ready.flags, len(ready))
    # the signature in my region of every peer's flags, and in my own-chunks region of mine
    sig = call_sig("all_reduce_matmul.two_shot", (m, k, n, dtype_code(x.dtype), int(residual is not None),
                                                  _ar._norm_code(norm), two.ask))
    post_sig(cur, [(sf.peer(q), push_slot(rank, q, world) * two.stride) for q in range(world) if q != rank]
             + [(sf.local, two.own_flag(0))], epoch, two.stride, sig)
    rt.p2p_begin("all_reduce_matmul", cur, ns, cs2)
    src = x.data_ptr()
    for dst, src_off, nbytes, q, idx in scatter:
        rt.push(dst, src + src_off, nbytes, sf.peer(q), idx, epoch)
    # my rows: the peers' partials summed in rank order with mine (+ residual, row statistics)
    x_me, h_me = x[me_off:me_off + me_rows], h[me_off:me_off + me_rows]
    res_me = residual[me_off:me_off + me_rows] if residual is not None else None
    st_me = stats_all[me_off:me_off + me_rows] if fold else None
    rkey = ("reduce2", x.dtype, None if residual is None else residual.dtype, norm.kind if norm else None,
            norm.eps if norm else 0.0,
            timeout_ns, sf.local.data_ptr(), err.word.data_ptr())
    rp = p.launches.get(rkey)
    if rp is None:
        rp = p.launches[rkey] = ReducePlan(
            x_me, rs, h_me, starts=p.starts, rflags=sf.local, ready=ready.flags, err=err.word, rank=rank,
            world=world, programs=p.reduce_programs, residual=res_me, norm=norm.kind if norm else None,
            eps=norm.eps if norm else 1e-5, flag_stride=two.stride, timeout_ns=timeout_ns, stats=st_me, sig=True,
            shape=shared_reduce_shape(k) if p.reduce_shared else None)
    with on_stream(ns, cur):
        rp.launch(x_me, rs, h_me, epoch=epoch, residual=res_me, stats=st_me, sig=sig)
    # each own chunk, once reduced: its flag for my GEMM, then its rows (and statistics) to every peer
    from .. import _p2p

    h_ptr, st_ptr = h.data_ptr(), stats_all.data_ptr()
    for c_idx, (g0, rows, peers) in enumerate(gather):
        _flags.stream_wait_value(cs2, ready.flags, c_idx, r_epoch * p.reduce_programs)
        _flags.stream_write_value(cs2, sf.local, two.own_flag(c_idx), epoch)
        for q, dst, dst_st, idx in peers:
            _p2p.memcpy_async(dst, h_ptr + g0 * row_bytes, rows * row_bytes, cs2)
            if fold:
                _p2p.memcpy_async(dst_st, st_ptr + g0 * 8, rows * 8, cs2)
            _flags.stream_write_value(cs2, sf.peer(q), idx, epoch)
    vec = None
    if fold:
        b, vec = _fold(p, b, norm, rt.num_sms)
        if p.give_back_grid:
            rt.fork(cur, ns)  # the give-back grid reads B' too
    gp = gemm_plan(p.launches, h, b, c, p.table, a2=ag, flags=sf.local, err=err.word, timeout_ns=timeout_ns,
                   counter=counter, rank=rank, config=p.gemm, wait=True, norm_epi=fold, split=p.split,
                   sig_stride=two.stride, groups=p.groups, tile_only=SHARED_SMS if p.reduce_shared else None)
    descs = gp.operands(h, b, ag)
    rowstat = stats_all if fold else None
    gp.launch(descs, c, epoch=epoch, grid=p.grid, rowstat=rowstat, colvec=vec, sig=sig)
    if p.give_back_grid:
        with on_stream(ns, cur):  # behind the reduce kernel: its SMs are free by then
            gp.launch(descs, c, epoch=epoch, grid=p.give_back_grid, rowstat=rowstat, colvec=vec, sig=sig)
    rt.join(cur, rt.comm_stream, ns, cs2)  # no record_stream needed (Runtime.join)
    # the peers' rows of h, from the buffer, once every GEMM tile ran: each waited (bounded)
    # for its rows to land. A stream wait on the peers' flags instead would never end if a
    # peer stopped pushing; the ready flags the copy stream waits on above are always
    # posted by the reduce kernel, which ends whatever its waits saw
    # Where the call recorded a failure (the error word, set by a kernel that ended before
    # this on ``cur``), those rows as NaN: a peer's share that never came back holds older rows
    ok = err.word[:1] == 0
    for g in range(1, world):
        o, r = two.offsets[(rank - g) % world], two.rows[(rank - g) % world]
        torch.where(ok, ag[o:o + r], _NAN, out=h[o:o + r])
    rt.p2p_end("all_reduce_matmul", cur)
    report_errors(err, cfg.check)
    _ar.stats["fused"] += 1
    _ar.stats["p2p"] += 1
    return c, h
