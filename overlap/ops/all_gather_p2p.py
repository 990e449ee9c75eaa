"""The all-gather op's peer-copy transport (``transport="p2p"``, one node): every rank
pushes its shard, chunk by chunk, into each peer's shared buffer with the copy engines and
writes the peer's flag for the chunk behind the copy; the GEMM covers every SM: the
local shard's tiles as a grid of their own, then, behind a stream gate on the first peer
chunk's flag, a grid of each peer's chunks, each tile behind its flag. The op's front, its
reference, plans, NCCL transport and tuner are in ``all_gather.py``; the schedule is drawn
there."""

from __future__ import annotations

from typing import Any

import torch

from .. import flags as _flags
from ..observe import gpu_range
from ..policies import row_bucket
from . import all_gather as _ag
from ._runtime import OverlapConfig, Runtime, call_sig, dtype_code, gemm_plan, post_sig, report_errors


def _fused_p2p(rt: Runtime, a_shard: torch.Tensor, b: torch.Tensor, return_gathered: bool,
               cfg: OverlapConfig) -> Any:
    from .._p2p import flag_stride

    ms, k = a_shard.shape
    n = _ag._ns(b)  # a tuple for a list of weights: one grid, c the list of their outputs
    world, rank = rt.world, rt.rank
    heap = rt.p2p()
    p = _ag._plan(rt, ms, n, k, cfg, "p2p")
    stride = flag_stride(world)
    row_bytes = k * a_shard.element_size()
    # sized for the bucket of M/R (``row_bucket``): a new M of a bucket seen before grows
    # nothing, so it needs no collective (growing is one) and no host agreement check
    half = -(-world * row_bucket(ms) * row_bytes // 1024) * 1024
    # two halves, used by call parity (see overlap._p2p on why no handshake is needed);
    # a grown block keeps that: every rank grows at the same call, after a barrier
    blk = heap.block("all_gather_matmul", 2 * half)
    sf = heap.flags("all_gather_matmul", p.flag_count)
    err = rt.err("all_gather_matmul")
    timeout_ns = int((cfg.timeout_ms or _flags.default_timeout_ms(rt.group)) * 1e6)
    c = [a_shard.new_empty((world * ms, x)) for x in n] if isinstance(n, tuple) else \
        a_shard.new_empty((world * ms, n))
    # the epoch last, just before the first work is queued: a call that fails before
    # it must not leave this rank's count ahead of its peers'
    epoch = sf.next_epoch()
    # this parity's gathered view and push list, made once per plan, block and dtype
    ck = ("p2p", epoch % 2, a_shard.dtype)
    st = p.launches.get(ck)
    if st is None or st[0] is not blk:
        off = (epoch % 2) * (blk.nbytes // 2)
        pushes = []
        for c_idx, (start, rows) in enumerate(zip(p.layout.chunk_starts, p.layout.chunk_rows)):
            for step in range(1, world):
                peer = (rank + step) % world
                pushes.append((blk.ptrs[peer] + off + (rank * ms + start) * row_bytes, start * row_bytes,
                               rows * row_bytes, sf.peer(peer), rank * stride + c_idx))
        st = p.launches[ck] = (blk, blk.tensor(rank, off, (world * ms, k), a_shard.dtype), pushes)
    gathered = st[1]
    cur = torch.cuda.current_stream(a_shard.device)
    ns = n if isinstance(n, tuple) else (n,)
    sig = call_sig("all_gather_matmul", (ms, k, *ns, dtype_code(a_shard.dtype), len(p.layout.chunk_rows)))
    post_sig(cur, [(sf.peer((rank + step) % world), rank * stride) for step in range(1, world)], epoch, stride, sig)
    rt.p2p_begin("all_gather_matmul", cur)
    src = a_shard.data_ptr()
    with gpu_range("comm", "pushes"):
        for dst, src_off, nbytes, peer_flags, idx in st[2]:
            rt.push(dst, src + src_off, nbytes, peer_flags, idx, epoch)
    from ..kernels import gate as _gate

    gated = p.local > 0 and _gate.enabled()
    counter = None
    if p.split:
        # split tiles count their pieces; their tiles are handed out by a dispatch counter
        # (gated: the peers' grid's, 4 words on: 16-byte aligned for the cached launch)
        counter = rt.counter("all_gather_matmul", p.counters + 4)
        _flags.stream_zero(cur, counter, p.counters + 4)
    if gated:
        # the local shard's tiles on a grid of their own now; behind it a one-program gate on
        # the first peer chunk's flag (this call's epoch), then the peers' grid: while a
        # peer is late no grid waits on the SMs
        gl = gemm_plan(p.local_launches, a_shard, b, c, p.local_table, a2=gathered, flags=sf.local,
                       err=err.word, timeout_ns=timeout_ns, rank=rank, config=p.gemm, wait=True, sig_stride=stride)
        gp = gemm_plan(p.launches, a_shard, b, c, p.rest_table, a2=gathered, flags=sf.local, err=err.word,
                       timeout_ns=timeout_ns, counter=None if counter is None else counter[4:], rank=rank,
                       config=p.gemm, wait=True, sig_stride=stride,
                       split=None if p.split is None else (p.split[0] - p.local, p.split[1]))
        descs = gl.operands(a_shard, b, gathered)
        with gpu_range("gemm", "local grid"):
            gl.launch(descs, c, epoch=epoch, grid=p.grid, sig=sig)
        idx, mult = p.first_wait
        with gpu_range("gate", "chunk", 0):
            _gate.launch_gate(sf.local, idx, epoch * mult, (epoch + 2) * mult, err.word, rank=rank,
                              timeout_ns=timeout_ns)
        with gpu_range("gemm", "grid"):
            gp.launch(descs, c, epoch=epoch, grid=p.grid, sig=sig)
    else:
        gp = gemm_plan(p.launches, a_shard, b, c, p.table, a2=gathered, flags=sf.local, err=err.word,
                       timeout_ns=timeout_ns, counter=counter, rank=rank, config=p.gemm, wait=True, split=p.split,
                       sig_stride=stride, groups=p.groups)
        with gpu_range("gemm", "grid"):
            gp.launch(gp.operands(a_shard, b, gathered), c, epoch=epoch, grid=p.grid, sig=sig)
    rt.join(cur, rt.comm_stream)  # no record_stream needed (Runtime.join)
    out_g = None
    if return_gathered:
        # the shared buffer is overwritten two calls later: hand out a copy. Where the call
        # recorded a failure (the error word, set by the GEMM that ended before this on
        # ``cur``), the peers' rows as NaN: a chunk that never landed holds older rows
        out_g = torch.where(err.word[:1] == 0, gathered, float("nan"))
        out_g[rank * ms:(rank + 1) * ms].copy_(a_shard)
    rt.p2p_end("all_gather_matmul", cur)
    report_errors(err, cfg.check)
    _ag.stats["fused"] += 1
    _ag.stats["p2p"] += 1
    _ag.stats["many"] += isinstance(n, tuple)
    return (c, out_g) if return_gathered else c
