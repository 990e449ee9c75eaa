"""Residual add and LayerNorm / RMSNorm of a block of rows, in one pass over memory.

    h[i, :] = h[i, :] + residual[i, :]            (in place; skipped without a residual)
    y[i, :] = norm(h[i, :]) * weight (+ bias)     (skipped without a norm: y is h)

This is the all-reduce -> GEMM op's prologue: it runs on a side stream after
each row chunk of the all-reduce lands, before the chunk's flag is written.
One program per row (not persistent): programs are small (4 warps, no shared
memory to speak of), so they fill whatever SMs are free as they come free,
and a chunk never waits for a fixed set of SMs. (A resident tile-GEMM program
leaves no registers beside it, so in practice that means the SMs the GEMM grid
leaves free.)

Statistics are taken in fp32 from ``h`` after rounding to its dtype, as
``torch.nn.functional.layer_norm(h)`` sees it when the add is done by torch
first. LayerNorm reads the row three times (sum, squared deviations from the
mean, output), RMSNorm twice; the later reads are L2 hits for rows up to a
few MB. Weight and bias must be contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl

from .. import observe as _observe
from .. import protocol as _p

_ERR_CODE = tl.constexpr(_p.ERR_CODE)  # the error record's code slot (overlap/protocol.py)

__all__ = ["add_norm_kernel", "launch_add_norm", "bind_add_norm", "reduce_norm_kernel", "launch_reduce_norm", "ReducePlan", "ReduceShape",
           "NORM_KINDS", "stats_segment"]

NORM_KINDS = {None: 0, "layernorm": 1, "rmsnorm": 2}


@triton.jit(launch_metadata=_observe.add_norm_metadata, do_not_specialize=["row0"])
def add_norm_kernel(h_ptr, res_ptr, y_ptr, w_ptr, b_ptr, row0, K, eps,
                    stride_h, stride_r, stride_y,
                    HAS_RES: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    row = (row0 + tl.program_id(0)).to(tl.int64)
    h_row = h_ptr + row * stride_h
    offs = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    # pass 1: the add (stored rounded, as torch would store h) and the sum (LayerNorm)
    # or the sum of squares (RMSNorm)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs
        m = cols < K
        x = tl.load(h_row + cols, mask=m, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * stride_r + cols, mask=m, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
            tl.store(h_row + cols, x, mask=m)
        xf = x.to(tl.float32)
        if NORM == 2:
            acc += xf * xf
        else:
            acc += xf
    if NORM != 0:
        _norm_row(h_row, y_ptr + row * stride_y, w_ptr, b_ptr, K, eps, acc, NORM, HAS_BIAS, BLOCK_K)


@triton.jit
def _norm_row(h_row, y_row, w_ptr, b_ptr, K, eps, acc, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """y_row = norm(h_row) given pass 1's per-lane sums ``acc`` (of h, or of h^2 for RMSNorm)."""
    offs = tl.arange(0, BLOCK_K)
    if NORM != 0:
        if NORM == 1:
            # pass 2 (LayerNorm): the variance around the mean, not E[x^2] - mean^2,
            # which cancels when |mean| >> std
            mean = tl.sum(acc, axis=0) / K
            acc2 = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + offs
                m = cols < K
                d = tl.where(m, tl.load(h_row + cols, mask=m, other=0.0).to(tl.float32) - mean, 0.0)
                acc2 += d * d
            var = tl.sum(acc2, axis=0) / K
        else:
            mean = 0.0
            var = tl.sum(acc, axis=0) / K
        rstd = 1.0 / tl.sqrt(var + eps)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + offs
            m = cols < K
            xf = tl.load(h_row + cols, mask=m, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
            y = (xf - mean) * rstd * w
            if HAS_BIAS:
                y += tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(y_row + cols, y.to(y_row.dtype.element_ty), mask=m)


def launch_add_norm(h: Any, row0: int, rows: int, *, residual: Any = None, norm: str | None = None,
                    weight: Any = None, bias: Any = None, eps: float = 1e-5, y: Any = None,
                    num_warps: int = 4, block_k: int | None = None, bind: bool = False) -> Any:
    """Rows [row0, row0 + rows) of ``h`` [M, K]: add ``residual`` in place, then
    write ``norm(h)`` to ``y`` (same rows). Current stream. Unit column strides.
    ``bind``: launch nothing, return ``bind_add_norm``'s launch."""
    if norm not in NORM_KINDS:
        raise ValueError(f"norm must be one of {sorted(k for k in NORM_KINDS if k)} or None, got {norm!r}")
    if residual is None and norm is None:
        return
    if rows <= 0:
        return
    K = h.shape[1]
    for name, t in (("h", h), ("residual", residual), ("y", y)):
        if t is not None and t.stride(1) != 1:
            raise ValueError(f"{name} must have unit column stride")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dim() == 1 and t.numel() > 1 and t.stride(0) != 1:
            raise ValueError(f"norm {name} must be contiguous")
    if norm is not None and (y is None or weight is None):
        raise ValueError("a norm needs y and weight")
    block_k = block_k or min(triton.next_power_of_2(K), 2048)
    tensors = (h, residual if residual is not None else h, y if y is not None else h,
               weight if weight is not None else h, bias if bias is not None else h)
    strides = (h.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0) if y is not None else 0)
    meta = dict(HAS_RES=residual is not None, NORM=NORM_KINDS[norm], HAS_BIAS=bias is not None, BLOCK_K=block_k)
    # the op launches this once per chunk: through the cached launcher, not Triton's binding
    # path; keyed on what Triton specializes on (row0 is not: do_not_specialize)
    key = (tuple(meta.values()), tuple(t.dtype for t in tensors), K, strides)
    pl = _add_norm_launcher.prepared(key, meta, num_warps=num_warps, interpret=interpreting())
    args = (*tensors, int(row0), K, float(eps), *strides)
    if bind:
        from ._launch import BoundLaunch

        return BoundLaunch.of(pl, rows, args, tensors, positional=True)  # h stands in for absent ones
    pl.launch(rows, args, aligned=tensors)
    return None


def bind_add_norm(h: Any, row0: int, rows: int, *, residual: Any = None, norm: str | None = None,
                  weight: Any = None, bias: Any = None, eps: float = 1e-5, y: Any = None) -> Any:
    """``launch_add_norm``'s launch with every argument fixed but its tensors' storage
    (``_launch.BoundLaunch``), called per call as ``bl(stream, (h, residual, y, weight,
    bias))`` with ``h`` in place of each one absent here; None where it cannot be bound
    (not launched once yet, the interpreter, another launcher form, nothing to do)."""
    if (residual is None and norm is None) or rows <= 0 or interpreting():
        return None
    return launch_add_norm(h, row0, rows, residual=residual, norm=norm, weight=weight, bias=bias, eps=eps, y=y,
                           bind=True)


# --------------------------------------------------------------------------
# the p2p all-reduce's consumer: sum the pushed partials, add, norm, post
# --------------------------------------------------------------------------
from ._launch import CachedLauncher  # noqa: E402
from .tile_gemm import _check_sig, _cta_any, _wait, interpreting  # noqa: E402

_add_norm_launcher = CachedLauncher(add_norm_kernel)


@triton.jit
def _sum_parts(x_ptr, recv_ptr, res_ptr, off2, m, rank, slot_stride, HAS_RES: tl.constexpr, WORLD: tl.constexpr,
               dt: tl.constexpr, STREAM: tl.constexpr = False):
    """h for a block at element offsets ``off2``: the WORLD partials (this rank's from
    x, peer r's from recv slot (r - rank - 1) mod WORLD) summed in rank order in fp32,
    rounded like an all-reduce's output, plus the residual (rounded again, as torch's
    add after an all-reduce). Every load is issued before the sum needs it. STREAM:
    the loads bypass L1 (each element is read once)."""
    if HAS_RES:
        if STREAM:
            rv = tl.load(res_ptr + off2, mask=m, other=0.0, cache_modifier=".cg")
        else:
            rv = tl.load(res_ptr + off2, mask=m, other=0.0)
    if WORLD == 2:
        # two terms: an add in the tensors' own type rounds the exact sum once, as the
        # fp32 sum rounded does (exact in fp32 unless one term is below half an ulp of
        # the other), and the same either way round. On sm_90 that is one packed
        # instruction per two elements (HADD2.BF16), where the fp32 path spent about
        # five per element on unpacking, adding and rounding
        if STREAM:
            xv = tl.load(x_ptr + off2, mask=m, other=0.0, cache_modifier=".cg")
            pv = tl.load(recv_ptr + off2, mask=m, other=0.0, cache_modifier=".cg")
        else:
            xv = tl.load(x_ptr + off2, mask=m, other=0.0)
            pv = tl.load(recv_ptr + off2, mask=m, other=0.0)
        hv = (xv + pv).to(dt)
        if HAS_RES:
            hv = (hv + rv.to(dt)).to(dt)
        return hv
    tot = tl.zeros(off2.shape, dtype=tl.float32)
    for r in tl.static_range(WORLD):  # unrolled: the loads do not wait for the adds
        slot = (r - rank - 1 + WORLD) % WORLD
        src = tl.where(r == rank, x_ptr + off2, recv_ptr + slot.to(tl.int64) * slot_stride + off2)
        if STREAM:
            tot += tl.load(src, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        else:
            tot += tl.load(src, mask=m, other=0.0).to(tl.float32)
    hv = tot.to(dt)
    if HAS_RES:
        hv = (hv.to(tl.float32) + rv.to(tl.float32)).to(dt)
    return hv


@triton.jit
def _store_stats(stats_ptr, rows, rmask, rstd, shift):
    """stats[row] = (rstd, mean * rstd): a folded norm's row statistics."""
    p = stats_ptr + rows.to(tl.int64) * 2
    tl.store(p, rstd, mask=rmask)
    tl.store(p + 1, shift, mask=rmask)


@triton.jit
def _seg_rows(x_ptr, recv_ptr, res_ptr, h_ptr, seg_ptr, rb, r1, n_seg, seg_plane, rank, slot_stride,
              HAS_RES: tl.constexpr, WORLD: tl.constexpr, NORM: tl.constexpr, ROWS: tl.constexpr,
              SUB: tl.constexpr, SEG: tl.constexpr, dt: tl.constexpr, STREAM: tl.constexpr,
              ASM_STORE: tl.constexpr):
    """Rows [rb, min(rb + ROWS, r1)): h summed and stored, and each segment's mean and
    sum of squared deviations (LayerNorm; RMSNorm: 0 and the sum of squares) stored
    to seg [2, M, n_seg]. The rows are contiguous, so they are taken flat, SUB
    segments of SEG columns at a time. The block is [T * SUB, INNER] (SEG = T *
    INNER, INNER up to 256: one warp's 16-byte loads), its tensor row q holding
    piece q // SUB of segment q % SUB: Triton lays the SUB warps along the rows and
    repeats them T times, so a segment's T pieces sit in one warp's registers. Its
    sums are each thread's own adds and one 5-step shuffle tree (a tree per
    256-column piece took 2.5 instructions per element), and need no barrier: the
    warps run on independently."""
    INNER: tl.constexpr = SEG if SEG < 256 else 256
    T: tl.constexpr = SEG // INNER
    g_end = tl.minimum(rb + ROWS, r1) * n_seg
    j = tl.arange(0, SUB)
    q = tl.arange(0, T * SUB)
    within = ((q % SUB) * SEG + (q // SUB) * INNER)[:, None] + tl.arange(0, INNER)[None, :]
    for s0 in range(rb * n_seg, g_end, SUB):
        g = s0 + j
        ok = g < g_end
        m = ((s0 + q % SUB) < g_end)[:, None]
        off2 = tl.cast(s0, tl.int64) * SEG + within
        hv = _sum_parts(x_ptr, recv_ptr, res_ptr, off2, m, rank, slot_stride, HAS_RES, WORLD, dt, STREAM)
        tl.store(h_ptr + off2, hv, mask=m)
        hf = tl.reshape(hv.to(tl.float32), (T, SUB, INNER))
        if NORM == 1:
            smean = tl.sum(tl.sum(hf, axis=0), axis=1) / SEG
            d = hf - smean[None, :, None]
            sm2 = tl.sum(tl.sum(d * d, axis=0), axis=1)
        else:
            smean = tl.zeros((SUB,), dtype=tl.float32)
            sm2 = tl.sum(tl.sum(hf * hf, axis=0), axis=1)
        _store_in_place(seg_ptr + g, smean, ok, ASM_STORE)
        _store_in_place(seg_ptr + seg_plane + g, sm2, ok, ASM_STORE)


@triton.jit
def _store_in_place(ptrs, vals, mask, ASM_STORE: tl.constexpr):
    """Store fp32 ``vals`` from the layout they are in. A warp's sums sit in every lane
    of the warp; tl.store would first move them to a layout of its own, through shared
    memory and barriers that hold all warps in step. ASM_STORE (not under the
    interpreter): one st.global per lane, the lanes of a warp writing the same word."""
    if ASM_STORE:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.f32 [$1], $2; mov.u32 $0, 0; }",
            "=r,l,f,r", [ptrs.to(tl.uint64, bitcast=True), vals, mask.to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptrs, vals, mask=mask)


@triton.jit
def _seg_merge(seg_ptr, stats_ptr, rows, rmask, K, n_seg, seg_plane, eps,
               SEG: tl.constexpr, NSEG_P2: tl.constexpr, ASM_STORE: tl.constexpr, SHIFT: tl.constexpr = True):
    """The row statistics of ``rows`` from their segments' (Chan et al.'s pairwise merge
    for equal counts: the mean of the means, the squared deviations plus SEG times the
    means' squared deviations from the mean): stats[row] = (rstd, mean * rstd) for a
    folded norm (SHIFT), (rstd, mean) for the kernel's own output pass."""
    s = tl.arange(0, NSEG_P2)
    mm = rmask[:, None] & (s < n_seg)[None, :]
    off = rows.to(tl.int64)[:, None] * n_seg + s[None, :]
    means = tl.load(seg_ptr + off, mask=mm, other=0.0)
    m2s = tl.load(seg_ptr + seg_plane + off, mask=mm, other=0.0)
    mean = tl.sum(means, axis=1) / n_seg
    dm = tl.where(mm, means - mean[:, None], 0.0)
    m2 = tl.sum(m2s, axis=1) + SEG * tl.sum(dm * dm, axis=1)
    rstd = 1.0 / tl.sqrt(m2 / K + eps)
    p = stats_ptr + rows.to(tl.int64) * 2
    _store_in_place(p, rstd, rmask, ASM_STORE)
    if SHIFT:
        _store_in_place(p + 1, mean * rstd, rmask, ASM_STORE)
    else:
        _store_in_place(p + 1, mean, rmask, ASM_STORE)


@triton.jit
def _norm_out(h_ptr, y_ptr, w_ptr, b_ptr, base, rmask, mean, rstd, K, offs, BLOCK_K: tl.constexpr,
              HAS_BIAS: tl.constexpr):
    """y = (h - mean) * rstd * w (+ bias) for the rows at element offsets ``base``, h
    read back in BLOCK_K-column blocks."""
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs
        cm = cols < K
        m = rmask[:, None] & cm[None, :]
        off2 = base[:, None] + cols[None, :]
        hf = tl.load(h_ptr + off2, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        yv = (hf - mean[:, None]) * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            yv += tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + off2, yv.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["n_chunks", "flag_stride", "epoch", "rank", "timeout_ns", "max_spins", "sig"],
            launch_metadata=_observe.reduce_norm_metadata)
def reduce_norm_kernel(x_ptr, recv_ptr, res_ptr, h_ptr, y_ptr, w_ptr, b_ptr,
                       rflags_ptr, ready_ptr, err_ptr, starts_ptr, stats_ptr, seg_ptr,
                       K, eps, n_chunks, flag_stride, epoch, rank, slot_stride, timeout_ns, max_spins, sig,
                       WORLD: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK_K: tl.constexpr, USE_TIMER: tl.constexpr,
                       FENCE_ASYNC: tl.constexpr, EVEN_K: tl.constexpr = False, FOLD: tl.constexpr = False,
                       STREAM: tl.constexpr = False, SEG: tl.constexpr = 0, NSEG_P2: tl.constexpr = 1,
                       MERGE_ROWS: tl.constexpr = 1, Y_ROWS: tl.constexpr = 1, SIG: tl.constexpr = False,
                       OWN: tl.constexpr = False):
    """Persistent over row chunks in order. For chunk c every program waits until each
    peer's rows landed (rflags[slot * flag_stride + c] >= epoch) and, with OWN, until
    this rank's own partial of the chunk is complete (rflags[(WORLD - 1) * flag_stride
    + c] >= epoch: a GEMM on this device produces x, and a stream posts that flag once
    the chunk's tiles are stored; the producer ops' peer-copy path), then takes blocks of
    ROWS rows (start_c + pid * ROWS, + G * ROWS, ...): h = the partials summed in
    rank order (the same bits on every rank) (+ residual), y = norm(h); then adds 1
    to ready[c] (release). A consumer of chunk c waits for ready[c] >= its epoch * G.
    After a timeout (recorded in the error word) programs skip their rows but still
    post, so nothing waits in vain; a skipped chunk's rows of h (and of y, or the
    folded norm's statistics) are stored as NaN, so the GEMM behind reads NaN, never
    the buffers' old rows.

    With SEG = 0 (whole-row statistics): with BLOCK_K >= K a row block stays in
    registers, h is written once and the norm comes from registers (two-pass
    statistics, exact); otherwise the K blocks merge their means and squared deviations
    (Chan et al.'s pairwise update: stable when |mean| >> std) and the output pass
    reads h back. With a norm, ``ReducePlan`` takes segments (below) by default.

    FOLD (with a norm): no y. Each row's rstd and mean * rstd (0 for RMSNorm) go to
    stats [M, 2] fp32 for a GEMM that applies the norm in its epilogue (its B holding
    the norm's weight, ``overlap.kernels.norm_fold``); the K-blocked path then skips
    its output pass.

    SEG > 0 (with a norm; SEG divides K and ROWS * BLOCK_K): the statistics come in two
    steps that take no barrier per row block. The rows are taken flat, in segments of
    SEG columns that each lie in one warp (``_seg_rows``); each segment's mean and
    squared deviations go to seg [2, M, K / SEG] fp32. After its last block of a chunk
    the program merges the segments of its own rows, MERGE_ROWS rows at a time
    (``_seg_merge``; NSEG_P2: K / SEG to the next power of two). The block-wide sums
    of the whole-row path hold every warp at a barrier per block, which left the
    loads idle; the segments take no barrier, and the kernel with statistics runs no
    slower than the residual add alone (docs/experiments.md, 2026-11-30, "Reduce
    statistics from warp-held segments").
    Without FOLD the merge writes each row's (rstd, mean) to stats (there the plan's
    scratch), and the program writes y for its rows of the chunk from h read back
    (``_norm_out``), as the K-blocked path does, Y_ROWS rows (a multiple of ROWS) at a
    time."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_K)
    rofs = tl.arange(0, ROWS)
    dt = h_ptr.dtype.element_ty
    # the norm's weight and bias, once per program (read by the in-register path;
    # without a norm these point at x and are unused)
    if FOLD:
        w_all = tl.zeros((BLOCK_K,), dtype=tl.float32)
        b_all = w_all
    else:
        w_all = tl.load(w_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
        b_all = tl.load(b_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
    for c in range(n_chunks):
        r0 = tl.load(starts_ptr + c)
        r1 = tl.load(starts_ptr + c + 1)
        ok = 1
        # the same in every warp: the row blocks' pass holds barriers
        if _cta_any((tl.load(err_ptr + _ERR_CODE, volatile=True) != 0).to(tl.int32), FENCE_ASYNC) != 0:
            ok = 0
        if OWN:
            # this rank's partial (no signature: this rank writes the flag itself)
            if ok != 0:
                ok = _wait(rflags_ptr, err_ptr, (WORLD - 1) * flag_stride + c, epoch, epoch + 2, rank, c,
                           timeout_ns, max_spins, USE_TIMER, FENCE_ASYNC)
        for s in range(WORLD - 1):
            if ok != 0:
                ok = _wait(rflags_ptr, err_ptr, s * flag_stride + c, epoch, epoch + 2, rank, c, timeout_ns,
                           max_spins, USE_TIMER, FENCE_ASYNC)
                if SIG:
                    # the sender's signature word, the last flag of its region (as the tile GEMM's)
                    if ok != 0:
                        ok = _check_sig(rflags_ptr, err_ptr, s * flag_stride + c, flag_stride, sig, epoch & 1,
                                        rank, c, FENCE_ASYNC)
        if SEG > 0:
            if ok != 0:
                n_seg = K // SEG
                seg_plane = n_seg * (slot_stride // K)  # slot_stride is M * K
                for rb in range(r0 + pid * ROWS, r1, G * ROWS):
                    _seg_rows(x_ptr, recv_ptr, res_ptr, h_ptr, seg_ptr, rb, r1, n_seg, seg_plane, rank, slot_stride,
                              HAS_RES, WORLD, NORM, ROWS, ROWS * BLOCK_K // SEG, SEG, dt, STREAM, FENCE_ASYNC)
                # this program's segment sums precede its reads of them
                tl.debug_barrier()
                q = tl.arange(0, MERGE_ROWS)
                for rb in range(r0 + pid * ROWS, r1, G * MERGE_ROWS):
                    rows = rb + (q // ROWS) * (G * ROWS) + q % ROWS
                    _seg_merge(seg_ptr, stats_ptr, rows, rows < r1, K, n_seg, seg_plane, eps, SEG, NSEG_P2,
                               FENCE_ASYNC, FOLD)
                if not FOLD:
                    # y from h read back, with the rows' (rstd, mean) just merged: the
                    # merge's stores precede the barrier, the reads follow it. Y_ROWS
                    # rows at a time: Y_ROWS / ROWS of this program's row blocks
                    tl.debug_barrier()
                    tl.static_assert(Y_ROWS % ROWS == 0, "Y_ROWS must be a multiple of ROWS")
                    yq = tl.arange(0, Y_ROWS)
                    for rb in range(r0 + pid * ROWS, r1, G * Y_ROWS):
                        rows = rb + (yq // ROWS) * (G * ROWS) + yq % ROWS
                        rmask = rows < r1
                        rstd = tl.load(stats_ptr + rows.to(tl.int64) * 2, mask=rmask, other=0.0)
                        mean = tl.load(stats_ptr + rows.to(tl.int64) * 2 + 1, mask=rmask, other=0.0)
                        _norm_out(h_ptr, y_ptr, w_ptr, b_ptr, rows.to(tl.int64) * K, rmask, mean, rstd, K, offs,
                                  BLOCK_K, HAS_BIAS)
        elif ok != 0:
            for rb in range(r0 + pid * ROWS, r1, G * ROWS):
                rows = rb + rofs
                rmask = rows < r1
                base = rows.to(tl.int64) * K
                if BLOCK_K >= K:
                    if EVEN_K:  # K == BLOCK_K: every column is real, no column mask
                        m = rmask[:, None]
                    else:
                        m = rmask[:, None] & (offs < K)[None, :]
                    off2 = base[:, None] + offs[None, :]
                    hv = _sum_parts(x_ptr, recv_ptr, res_ptr, off2, m, rank, slot_stride, HAS_RES, WORLD, dt, STREAM)
                    tl.store(h_ptr + off2, hv, mask=m)
                    if NORM != 0:
                        # masked-off rows loaded as 0: their statistics are finite and unused
                        if EVEN_K:
                            hf = hv.to(tl.float32)
                        else:
                            hf = tl.where(m, hv.to(tl.float32), 0.0)
                        if NORM == 1:
                            mean = tl.sum(hf, axis=1) / K
                            if EVEN_K:
                                d = hf - mean[:, None]
                            else:
                                d = tl.where(m, hf - mean[:, None], 0.0)
                        else:
                            mean = tl.zeros((ROWS,), dtype=tl.float32)
                            d = hf
                        rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / K + eps)
                        if FOLD:
                            _store_stats(stats_ptr, rows, rmask, rstd, mean * rstd)
                        else:
                            yv = (hf - mean[:, None]) * rstd[:, None] * w_all[None, :]
                            if HAS_BIAS:
                                yv += b_all[None, :]
                            tl.store(y_ptr + off2, yv.to(y_ptr.dtype.element_ty), mask=m)
                else:
                    mean = tl.zeros((ROWS,), dtype=tl.float32)
                    m2 = tl.zeros((ROWS,), dtype=tl.float32)
                    for k0 in range(0, K, BLOCK_K):
                        cols = k0 + offs
                        m = rmask[:, None] & (cols < K)[None, :]
                        off2 = base[:, None] + cols[None, :]
                        hv = _sum_parts(x_ptr, recv_ptr, res_ptr, off2, m, rank, slot_stride, HAS_RES, WORLD, dt,
                                        STREAM)
                        tl.store(h_ptr + off2, hv, mask=m)
                        if NORM == 1:
                            hf = tl.where(m, hv.to(tl.float32), 0.0)
                            nb = tl.minimum(K - k0, BLOCK_K).to(tl.float32)
                            bmean = tl.sum(hf, axis=1) / nb
                            d = tl.where(m, hf - bmean[:, None], 0.0)
                            bm2 = tl.sum(d * d, axis=1)
                            n0 = k0 * 1.0
                            delta = bmean - mean
                            mean += delta * (nb / (n0 + nb))
                            m2 += bm2 + delta * delta * (n0 * nb / (n0 + nb))
                        elif NORM == 2:
                            hf = tl.where(m, hv.to(tl.float32), 0.0)
                            m2 += tl.sum(hf * hf, axis=1)
                    if NORM != 0:
                        rstd = 1.0 / tl.sqrt(m2 / K + eps)
                    if FOLD:
                        _store_stats(stats_ptr, rows, rmask, rstd, mean * rstd)
                    elif NORM != 0:
                        _norm_out(h_ptr, y_ptr, w_ptr, b_ptr, base, rmask, mean, rstd, K, offs, BLOCK_K, HAS_BIAS)
        if ok == 0:
            # the chunk skipped after a failed wait or with the error word set: NaN over this
            # program's rows of h (and of y, or the folded norm's statistics), which the
            # consumer GEMM reads once the post below lets it, never the buffers' old rows
            nan = tl.full((ROWS, BLOCK_K), float("nan"), tl.float32)
            for rb in range(r0 + pid * ROWS, r1, G * ROWS):
                rows = rb + rofs
                rmask = rows < r1
                base = rows.to(tl.int64) * K
                for k0 in range(0, K, BLOCK_K):
                    cols = k0 + offs
                    m = rmask[:, None] & (cols < K)[None, :]
                    off2 = base[:, None] + cols[None, :]
                    tl.store(h_ptr + off2, nan.to(dt), mask=m)
                    if NORM != 0:
                        if not FOLD:
                            tl.store(y_ptr + off2, nan.to(y_ptr.dtype.element_ty), mask=m)
                if FOLD:
                    nan_rows = tl.full((ROWS,), float("nan"), tl.float32)
                    _store_stats(stats_ptr, rows, rmask, nan_rows, nan_rows)
        # every thread's stores of this chunk precede the barrier; one release add publishes them
        tl.debug_barrier()
        tl.atomic_add(ready_ptr + c, 1, sem="release", scope="gpu")


def reduce_block_shape(K: int, block_k: int | None = None, split: bool = False) -> tuple[int, int, int]:
    """(BLOCK_K, ROWS, num_warps) the reduce kernel takes by default for rows of K columns
    (``block_k`` given: the rows and warps for it). Up to 8192 columns (4096 with
    ``split``) a row block whole in registers; above, 4096-column blocks (the K loop
    with merged statistics). Blocks of 32K elements, 16 warps above 8K elements."""
    if block_k is None:
        p2 = triton.next_power_of_2(K)
        block_k = p2 if p2 <= (4096 if split else 8192) else 4096
    rows = max(1, min(8, 32768 // block_k))
    return block_k, rows, 16 if block_k * rows > 8192 else 8


@dataclass(frozen=True)
class ReduceShape:
    """How the reduce kernel blocks its rows; a field left None takes the default for K.
    The ops pass one only for the reduce programs that share SMs with the GEMM
    (``all_reduce_p2p.shared_reduce_shape``); the benchmarks of the kernel sweep them.

    ``block_k``, ``rows``, ``num_warps``: the block (``reduce_block_shape``).
    ``segment``: with a norm, the width of the segments the statistics are summed over
    before they are merged (the kernel's SEG); None picks ``stats_segment(K, rows *
    block_k, num_warps)``, 0 takes the whole-row statistics (and, writing y, normalizes a
    row block whole in registers where it fits). ``y_rows``: writing y from segments, the
    rows of a block of the output pass (a power-of-two multiple of ``rows``; None: twice
    ``rows`` where the block is exactly K columns, else ``rows``). ``stream_loads``: the
    partials and the residual are loaded past L1 (read once)."""

    block_k: int | None = None
    rows: int | None = None
    num_warps: int | None = None
    segment: int | None = None
    y_rows: int | None = None
    stream_loads: bool = False


def launch_reduce_norm(x: Any, recv: Any, h: Any, *, starts: Any, rflags: Any, ready: Any, err: Any,
                       epoch: int, rank: int, world: int, programs: int, residual: Any = None,
                       norm: str | None = None, weight: Any = None, bias: Any = None, eps: float = 1e-5,
                       y: Any = None, flag_stride: int | None = None,
                       timeout_ns: int = 500_000_000, max_spins: int = 2_000_000,
                       stats: Any = None, shape: ReduceShape | None = None) -> None:
    """Launch ``reduce_norm_kernel`` with ``programs`` programs on the current stream.

    ``x``, ``h``, ``residual``, ``y``: contiguous [M, K]; ``recv``: contiguous
    [world - 1, M, K] (peer r's partial in slot (r - rank - 1) mod world);
    ``starts``: int32 [chunks + 1] row starts on the device; ``rflags``: int32
    flags the peers set (slot * flag_stride + c; default stride: the chunk count);
    ``ready``: int32 [chunks] this
    kernel posts to; ``err``: the error word shared with the consumer GEMM.
    ``stats``: contiguous fp32 [M, 2] instead of ``y`` (a norm folded into the
    consumer GEMM: each row's rstd and mean * rstd; weight and bias are then unused).
    ``shape``: the kernel's blocking (``ReduceShape``; None: the defaults for K).
    An op that launches it call after call keeps a ``ReducePlan`` instead.
    """
    plan = ReducePlan(x, recv, h, starts=starts, rflags=rflags, ready=ready, err=err, rank=rank, world=world,
                      programs=programs, residual=residual, norm=norm, weight=weight, bias=bias, eps=eps, y=y,
                      flag_stride=flag_stride, timeout_ns=timeout_ns, max_spins=max_spins, stats=stats, shape=shape)
    plan.launch(x, recv, h, epoch=epoch, residual=residual, weight=weight, bias=bias, y=y, stats=stats)


class ReducePlan:
    """``launch_reduce_norm`` checked and keyed once: shapes, dtypes, the flag and error
    tensors, chunking, programs and block shape are fixed; per launch the operands
    (contiguous, of the plan's shapes: the caller's guarantee) and the epoch change.
    The arguments are ``launch_reduce_norm``'s, and ``own``: each chunk also waits for
    flag (world - 1) * flag_stride + c of ``rflags`` (this rank's partial of the chunk
    complete; the producer ops' peer-copy path, whose x a GEMM is still writing)."""

    def __init__(self, x: Any, recv: Any, h: Any, *, starts: Any, rflags: Any, ready: Any, err: Any, rank: int,
                 world: int, programs: int, residual: Any = None, norm: str | None = None, weight: Any = None,
                 bias: Any = None, eps: float = 1e-5, y: Any = None, flag_stride: int | None = None,
                 timeout_ns: int = 500_000_000, max_spins: int = 2_000_000, stats: Any = None,
                 shape: ReduceShape | None = None, sig: bool = False, own: bool = False) -> None:
        shape = shape or ReduceShape()
        block_k, rows, num_warps = shape.block_k, shape.rows, shape.num_warps
        segment, y_rows = shape.segment, shape.y_rows
        if norm not in NORM_KINDS:
            raise ValueError(f"norm must be one of {sorted(k for k in NORM_KINDS if k)} or None, got {norm!r}")
        m, K = x.shape
        if stats is not None:
            if norm is None or y is not None:
                raise ValueError("stats replace y: they need a norm and no y")
            if str(stats.dtype) != "torch.float32" or tuple(stats.shape) != (m, 2):
                raise ValueError(f"stats must be fp32 [{m}, 2], got {stats.dtype} {tuple(stats.shape)}")
        elif norm is not None and (y is None or weight is None):
            raise ValueError("a norm needs y and weight (or stats)")
        for name, t in (("x", x), ("h", h), ("residual", residual), ("y", y), ("recv", recv),
                        ("weight", weight), ("bias", bias), ("stats", stats)):
            if t is not None and not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        for name, t in (("recv", recv), ("h", h), ("residual", residual), ("y", y)):
            if t is not None and t.dtype != x.dtype:
                raise ValueError(f"{name} is {t.dtype}, x is {x.dtype}: the kernel takes one dtype")
        if recv.shape[0] != world - 1 or tuple(recv.shape[1:]) != (m, K):
            raise ValueError(f"recv must be [{world - 1}, {m}, {K}], got {tuple(recv.shape)}")
        n_chunks = starts.numel() - 1
        flag_stride = n_chunks if flag_stride is None else int(flag_stride)
        if flag_stride < n_chunks:
            raise ValueError(f"flag_stride {flag_stride} < {n_chunks} chunks")
        # a row block in registers up to 8K columns, 4096-column blocks above. Each program
        # runs alone on its SM beside the GEMM, so its loads in flight set its bandwidth:
        # blocks of 32K elements and 16 warps beat smaller ones with fewer warps; past 8K
        # columns a whole row in registers loses to 4096-column blocks of several rows.
        # Loading the next block ahead of this one's work was slower (it spilled with a
        # norm) and was reverted.
        # a residual without a norm: 4096-column blocks of 8 rows, more loads in flight than
        # whole rows; with a norm, whole rows were faster before the segment statistics.
        # Figures: docs/experiments.md, 2026-11-29 ("The p2p all-reduce, reduce kernel and
        # pushes", "Reduce blocks over 8192 columns", "The folded norm").
        split = residual is not None and norm is None
        d_block, d_rows, d_warps = reduce_block_shape(K, block_k, split)
        block_k = block_k or d_block
        rows = rows or d_rows
        num_warps = num_warps or d_warps
        seg = 0
        if norm is not None:
            seg = stats_segment(K, rows * block_k, num_warps) if segment is None else int(segment)
            if seg and (seg & (seg - 1) or K % seg or (rows * block_k) % seg):
                raise ValueError(f"segment {seg} must be a power of two dividing K={K} and the block's "
                                 f"{rows} x {block_k} elements")
        n_seg_p2 = triton.next_power_of_2(K // seg) if seg else 1
        # merge batches of about 8 values per thread per plane, whole row blocks each
        merge_rows = max(rows, min(128, _pow2_floor(num_warps * 32 * 8 // n_seg_p2)))
        # writing y from segment statistics: rows per block of the output pass. Twice the
        # block's rows where the block is exactly K columns (whole rows, no column mask:
        # more loads in flight); not for K-blocked rows, where the doubled block spills
        # (docs/experiments.md, 2026-11-30, "Normed rows from the segment statistics")
        uses_y_rows = seg and stats is None
        if y_rows is None:
            y_rows = 2 * rows if block_k == K else rows
        y_rows = int(y_rows)
        if uses_y_rows and (y_rows < rows or y_rows % rows or y_rows & (y_rows - 1)):
            raise ValueError(f"y_rows {y_rows} must be a power-of-two multiple of the block's {rows} rows")
        # the segments' sums: [2, M, K / seg] fp32, the plan's own scratch; writing y, the
        # rows' merged (rstd, mean) too: [M, 2] fp32
        self.seg = _alloc_like(x, 2 * m * (K // seg)) if seg else None
        self.row_stats = _alloc_like(x, 2 * m) if seg and stats is None else None
        interp = interpreting()
        self.has_res, self.has_y, self.has_w, self.has_b, self.has_stats = (
            residual is not None, y is not None, weight is not None, bias is not None, stats is not None)
        self.fixed = (rflags, ready, err, starts)
        self.scalars = (K, float(eps), n_chunks, flag_stride)
        self.tail = (int(rank), m * K, int(timeout_ns), int(max_spins))
        self.programs = max(1, int(programs))
        meta = dict(WORLD=int(world), HAS_RES=residual is not None, NORM=NORM_KINDS[norm], HAS_BIAS=bias is not None,
                    ROWS=rows, BLOCK_K=block_k, USE_TIMER=not interp, FENCE_ASYNC=not interp,
                    EVEN_K=block_k == K, FOLD=stats is not None, STREAM=bool(shape.stream_loads) and not interp,
                    SEG=seg, NSEG_P2=n_seg_p2, MERGE_ROWS=merge_rows, Y_ROWS=y_rows if uses_y_rows else 1,
                    SIG=bool(sig), OWN=bool(own))
        if own and flag_stride * world > rflags.numel():
            raise ValueError(f"own: the own chunks' flags at {(world - 1) * flag_stride}.. lie past the "
                             f"{rflags.numel()} flags")
        if sig and flag_stride < n_chunks + 2:
            raise ValueError(f"a signature needs two flags of its own after the {n_chunks} chunks' "
                             f"(flag_stride {flag_stride})")
        res = residual if residual is not None else x
        tensors = (x, recv, res, h, y if y is not None else h, weight if weight is not None else x,
                   bias if bias is not None else x, rflags, ready, err, starts,
                   stats if stats is not None else (self.row_stats if seg else starts), self.seg if seg else starts)
        # what Triton specializes on: constexprs, dtypes, K and the slot stride
        key = (tuple(meta.values()), tuple(t.dtype for t in tensors), K, m * K)
        self.prepared = _reduce_launcher.prepare(key, meta, num_warps=num_warps, interpret=interp)

    def launch(self, x: Any, recv: Any, h: Any, *, epoch: int, residual: Any = None, weight: Any = None,
               bias: Any = None, y: Any = None, stats: Any = None, sig: int = 0) -> None:
        """``sig``: the call's signature, checked after each wait when the plan was made
        with ``sig=True`` (the peer-copy ops' check that the ranks agree on the call)."""
        if ((residual is not None, y is not None, weight is not None, bias is not None, stats is not None)
                != (self.has_res, self.has_y, self.has_w, self.has_b, self.has_stats)):
            raise ValueError("residual, y, weight, bias and stats must be given as when the plan was made")
        ops = (x, recv, residual if residual is not None else x, h, y if y is not None else h,
               weight if weight is not None else x, bias if bias is not None else x)
        st = stats if stats is not None else (self.row_stats if self.row_stats is not None else self.fixed[3])
        seg = self.seg if self.seg is not None else self.fixed[3]
        self.prepared.launch(self.programs, (*ops, *self.fixed, st, seg, *self.scalars, int(epoch), *self.tail,
                                             int(sig)), aligned=(*ops, st, seg))


def stats_segment(K: int, block: int, num_warps: int) -> int:
    """The segment width the reduce kernel sums a norm's row statistics over: the
    largest power of two up to 2048 that divides K and leaves each of ``num_warps``
    warps a segment of its own in a block of ``block`` elements (one warp per segment,
    no barrier; longer segments, fewer shuffle trees); 0 (whole-row statistics) below 16."""
    seg = 2048
    while seg >= 16 and (K % seg or block % seg or block // seg < num_warps):
        seg //= 2
    return seg if seg >= 16 else 0


def _pow2_floor(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def _alloc_like(x: Any, n: int) -> Any:
    import torch

    return torch.empty(n, dtype=torch.float32, device=x.device)


_reduce_launcher = CachedLauncher(reduce_norm_kernel)
