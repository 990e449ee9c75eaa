"""Persistent Triton GEMM whose tiles wait on and post to flags.

    C[c_row + i, n] = sum_k A_src[a_row + i, k] * B[k, n]      for each tile of the table

One launch computes every tile of a *tile table* (an int32 [T, 8] tensor built
on the host, in schedule order; see ``overlap.policies``). Program ``p`` takes
table rows p, p + G, p + 2G, ... (G = grid size, the SMs the GEMM may hold), or,
with a dispatch counter, the next row handed out by an atomic add, which lets
a second launch on other SMs join the same table.
Each row says where the tile reads A (which of two A operands, which row),
where it writes C (row, count of valid rows), which N tile, and its flags:

    row = [a_row, a_src, c_row, c_rows, pid_n, wait_idx, wait_mult, post_idx]

    wait: before its A loads the tile spins, with acquire semantics, until
          flags[wait_idx] >= epoch * wait_mult          (wait_idx < 0: no wait)
    post: after its C tile is stored (all threads, then a CTA barrier), one
          thread adds 1 to flags[post_idx] with release semantics

Flags are never reset: each call of an op bumps ``epoch``, so a flag left by an
earlier call cannot satisfy a later one (cuSync's iteration counter,
Jangda et al., CGO 2024).

A flag two or more calls ahead of the waiter's epoch is recorded too (code 2,
``FlagProtocolError``): no writer runs that far ahead while every rank's waits
hold, so it means the ranks fell out of step after an earlier failure.

A wait is bounded: past ``timeout_ns`` (GPU global timer) or ``max_spins``
polls (under the interpreter) the tile records [code, rank, flag index,
expected, seen, table row] in the error word, does no work, and every other
tile of every program then skips its work, so the kernel exits promptly and the
host raises ``overlap.flags.FlagTimeoutError``. No hang, whatever the peers do.
A tile that skips its work so (its wait failed, its sender's signature disagreed, or
the error word was set) stores NaN over its C tile, masked to C's rows and columns
(``_poison``), so a call that returns before its error is raised (``check="async"``)
returns NaN where it had no data, never C's old values; a skipped split piece stores
NaN and is not counted, so no piece sums the others' partials over it. Dead tiles of a
row cut store nothing; the stores happen on the error path only. The
decision to stop is taken by all of a program's warps alike (``_cta_any``): their own
reads of the timer or the error word can differ by a few nanoseconds, and warps that
went different ways would leave each other waiting at a barrier.

Two A operands exist so the all-gather op can read its local shard straight
from the input (no copy into the gathered buffer) while remote rows come from
the buffer NCCL fills: the K loop is instantiated once per source, each
software-pipelined on its own.

B is read through a TMA descriptor either as [K, N] row-major (``B_KN``) or as
the [N, K] row-major storage of an ``nn.Linear`` weight (``b = w.t()``; no copy).

With ``SPLIT`` the table's last rows are split tiles, ``split_parts`` rows in a row per
tile (``overlap.policies.split_tail``): piece p runs K steps [p * k / parts, (p + 1) * k /
parts), stores its fp32 partial in a workspace and counts itself in the counter word
after the dispatch word; the piece that counts last sums the partials in piece order
and stores (and posts) the tile. No piece waits, so a split tile cannot hang.

With ``NORM_EPI`` the A rows are a residual stream h whose LayerNorm / RMSNorm the
GEMM applies in its epilogue, B being diag(norm weight) B (``overlap.kernels.norm_fold``):
``C = rstd * (h @ B') - mean * rstd * colsum(B') + bias @ B`` per row and column.

``GemmConfig.flatten`` takes a second kernel, ``tile_gemm_flat_kernel``: program p takes rows p,
p + G, ... in order, and its tile loop and K loop are one software pipeline (Triton's
``tl.range(..., flatten=True)``), so the next tile's first K steps load while this tile's
epilogue runs; the per-tile kernel starts each tile's pipeline from empty after its stores
(benchmarks/results/2026-12-02_1xH200_608f1c4). The pipeline issues a tile's loads before the loop
reaches the tile, so waits and posts are per *group* of rows (a run of rows with one wait
flag, post flag and A source, ``policies.flat_groups``): a program waits for a group's flag
before its pipeline over its rows of the group, and adds its count of them to the group's
post flag once they are all stored.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import observe as _observe

from .. import protocol as _p

try:  # Programmatic dependent launch (Hopper); Triton 3.4 and later
    from triton.language.extra.cuda import gdc_launch_dependents as _gdc_launch_dependents
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
except ImportError:  # pragma: no cover - an older Triton: pdl_supported() says no
    _gdc_launch_dependents = _gdc_wait = None

__all__ = ["tile_gemm_kernel", "tile_gemm_flat_kernel"]

# the protocol's numbers (overlap/protocol.py) as the kernels read them
_TABLE_COLS = tl.constexpr(_p.TABLE_COLS)
_COL_A_ROW = tl.constexpr(_p.COL_A_ROW)
_COL_A_SRC = tl.constexpr(_p.COL_A_SRC)
_COL_C_ROW = tl.constexpr(_p.COL_C_ROW)
_COL_C_ROWS = tl.constexpr(_p.COL_C_ROWS)
_COL_N_TILE = tl.constexpr(_p.COL_N_TILE)
_COL_WAIT = tl.constexpr(_p.COL_WAIT)
_COL_WAIT_MULT = tl.constexpr(_p.COL_WAIT_MULT)
_COL_POST = tl.constexpr(_p.COL_POST)
_N_TILE_BITS = tl.constexpr(_p.N_TILE_BITS)
_N_TILE_MASK = tl.constexpr(_p.N_TILE_MASK)
_ERR_CODE = tl.constexpr(_p.ERR_CODE)
_ERR_RANK = tl.constexpr(_p.ERR_RANK)
_ERR_FLAG = tl.constexpr(_p.ERR_FLAG)
_ERR_EXPECTED = tl.constexpr(_p.ERR_EXPECTED)
_ERR_SEEN = tl.constexpr(_p.ERR_SEEN)
_ERR_TILE = tl.constexpr(_p.ERR_TILE)
_ERR_HOST_LO = tl.constexpr(_p.ERR_HOST_LO)
_ERR_HOST_HI = tl.constexpr(_p.ERR_HOST_HI)
_ERR_TIMEOUT = tl.constexpr(_p.ERR_TIMEOUT)
_ERR_AHEAD = tl.constexpr(_p.ERR_AHEAD)
_ERR_DISAGREE = tl.constexpr(_p.ERR_DISAGREE)


@triton.jit
def _gelu(x):
    # erf form, as torch.nn.functional.gelu(approximate="none")
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def _mainloop(a_desc, b_desc, off_am, off_bn, k_lo, k_hi,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              B_KN: tl.constexpr, UPCAST: tl.constexpr, WARP_SPEC: tl.constexpr = False):
    """K steps [k_lo, k_hi) of one tile (all of them, or one split piece's). With
    ``WARP_SPEC`` the loop is warp-specialized by Triton (``tl.range(warp_specialize=True)``):
    its partitions run the TMA loads and the MMAs on separate warps, so the loads of
    later steps are issued while MMAs run."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if WARP_SPEC:  # a constexpr branch: a Triton without the keyword never sees it
        for ki in tl.range(k_lo, k_hi, warp_specialize=True):
            acc = _kstep(a_desc, b_desc, off_am, off_bn, ki, acc, BLOCK_K, B_KN, UPCAST)
    else:
        for ki in range(k_lo, k_hi):
            acc = _kstep(a_desc, b_desc, off_am, off_bn, ki, acc, BLOCK_K, B_KN, UPCAST)
    return acc


@triton.jit
def _kstep(a_desc, b_desc, off_am, off_bn, ki, acc, BLOCK_K: tl.constexpr, B_KN: tl.constexpr,
           UPCAST: tl.constexpr):
    """One K step of a tile: acc += A[rows, k step] @ B[k step, cols]."""
    off_k = ki * BLOCK_K
    a = a_desc.load([off_am, off_k])
    if B_KN:
        b = b_desc.load([off_k, off_bn])
    else:
        b = b_desc.load([off_bn, off_k]).T
    if UPCAST:  # the interpreter's bf16 dot is wrong; fp32 is exact there
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc)


@triton.jit
def _mainloop_tilesync(a_desc, b_desc, off_am, off_bn, K, flags_ptr, err_ptr, w_idx, expected, ahead, rank, t,
                       timeout_ns, max_spins,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       B_KN: tl.constexpr, UPCAST: tl.constexpr, K_WAIT: tl.constexpr,
                       USE_TIMER: tl.constexpr, FENCE_ASYNC: tl.constexpr):
    """The K loop in groups of K_WAIT steps, group g only once flags[w_idx + g] >= expected
    (TileSync: the producer tile that wrote these K columns has posted). The wait sits
    between two loops, so the software pipeline of a group issues no load before it.
    Returns (acc, ok); ok = 0 after a failed wait (the later groups are skipped)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    ok = 1
    for g in range(0, tl.cdiv(k_tiles, K_WAIT)):
        if ok != 0:
            ok = _wait(flags_ptr, err_ptr, w_idx + g, expected, ahead, rank, t, timeout_ns, max_spins,
                       USE_TIMER, FENCE_ASYNC)
        if ok != 0:
            for ki in range(g * K_WAIT, tl.minimum((g + 1) * K_WAIT, k_tiles)):
                acc = _kstep(a_desc, b_desc, off_am, off_bn, ki, acc, BLOCK_K, B_KN, UPCAST)
    return acc, ok


@triton.jit
def _epilogue(acc, c_ptr, rows, rmask, cols, N, stride_cm, stride_cn, rowstat_ptr, colvec_ptr,
              NORM_EPI: tl.constexpr, ACTIVATION: tl.constexpr):
    """Folded norm, activation and the store of C rows ``rows`` (valid where ``rmask``)."""
    cm = cols < N
    if NORM_EPI:
        # a norm folded into B (overlap.kernels.norm_fold): A rows are h, B is
        # diag(w) B; per row rstd and mean * rstd, per column u = colsum(B'), v = bias @ B
        rs = tl.load(rowstat_ptr + rows.to(tl.int64) * 2, mask=rmask, other=0.0)
        sh = tl.load(rowstat_ptr + rows.to(tl.int64) * 2 + 1, mask=rmask, other=0.0)
        u = tl.load(colvec_ptr + cols, mask=cm, other=0.0)
        v = tl.load(colvec_ptr + N + cols, mask=cm, other=0.0)
        acc = acc * rs[:, None] - sh[:, None] * u[None, :] + v[None, :]
    if ACTIVATION == 1:
        acc = _gelu(acc)
    mask = rmask[:, None] & cm[None, :]
    ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _poison(c_ptr, rows, rmask, cols, N, stride_cm, stride_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """NaN over the C rows ``rows`` (valid where ``rmask``) and columns ``cols`` (< N) of a
    tile that skipped its work after a failed wait or with the error word set: a call
    whose waits expired returns NaN where it has no data, never the buffer's old values."""
    mask = rmask[:, None] & (cols < N)[None, :]
    ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    nan = tl.full((BLOCK_M, BLOCK_N), float("nan"), tl.float32)
    tl.store(ptrs, nan.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_finish(acc, ws_ptr, cnt_ptr, slot, piece, parts, c_ptr, c_row, c_rows, cols, N, stride_cm, stride_cn,
                  rowstat_ptr, colvec_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  NORM_EPI: tl.constexpr, ACTIVATION: tl.constexpr, FIX_M: tl.constexpr):
    """One K piece of a split tile: store its fp32 partial in the workspace and count it;
    the piece that counts last sums all ``parts`` partials in piece order (the same bits
    whichever piece is last) and finishes the tile. Nothing waits, so nothing can hang.
    Returns 1 in the program that stored the C tile."""
    tile_elems: tl.constexpr = BLOCK_M * BLOCK_N
    offs_i = tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, BLOCK_N)
    base = ws_ptr + (slot * parts).to(tl.int64) * tile_elems
    tl.store(base + piece * tile_elems + offs_i[:, None] * BLOCK_N + offs_j[None, :], acc)
    # every thread's partial precedes the barrier; the release by the one thread of the
    # scalar atomic publishes them, its acquire makes the others' visible here
    tl.debug_barrier()
    seen = tl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel", scope="gpu")
    last = (seen == parts - 1).to(tl.int32)
    if last != 0:
        tl.debug_barrier()
        for r0 in tl.static_range(0, BLOCK_M, FIX_M):
            offs_r = r0 + tl.arange(0, FIX_M)
            tot = tl.zeros((FIX_M, BLOCK_N), dtype=tl.float32)
            for p in range(parts):
                # .cg: from L2, where the other SMs' partials are (not a stale L1 line)
                tot += tl.load(base + p * tile_elems + offs_r[:, None] * BLOCK_N + offs_j[None, :],
                               cache_modifier=".cg")
            _epilogue(tot, c_ptr, c_row + offs_r, offs_r < c_rows, cols, N, stride_cm, stride_cn,
                      rowstat_ptr, colvec_ptr, NORM_EPI, ACTIVATION)
    return last


@triton.jit
def _cut_rows(row, rows, rows_cap, rows_span):
    """Table row ``row`` of a block of ``rows_span`` rows, moved to this call's block of
    ``rows_cap``; the tile's ``rows`` cut at that block's end (0 or less: none left)."""
    blk = row // rows_span
    off = row - blk * rows_span
    return blk * rows_cap + off, tl.minimum(rows, rows_cap - off)


@triton.jit
def _cta_any(x, ASM: tl.constexpr):
    """1 in every thread of the program if ``x`` is nonzero in any, else 0 (a CTA
    barrier with an OR: ``bar.red.or.pred``). Per-thread reads (the GPU timer, a
    volatile load of the error word) can differ between warps; a decision taken on
    them must be the same in all of them before a branch that holds barriers (a scalar
    atomic's broadcast, the K loop's pipeline), or the warps that went the other way
    would leave the rest waiting at a barrier for good. Every thread must reach it.
    Without ASM (the interpreter: one thread) ``x`` as it is."""
    if ASM:
        r = tl.inline_asm_elementwise(
            "{ .reg .pred p, q; setp.ne.s32 p, $1, 0; bar.red.or.pred q, 0, p; selp.s32 $0, 1, 0, q; }",
            "=r,r", [x.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        r = (x != 0).to(tl.int32)
    return r


@triton.jit
def _poll(flags_ptr, idx):
    # system scope: a flag may be written by a peer GPU's copy stream (overlap._p2p)
    return tl.atomic_add(flags_ptr + idx, 0, sem="acquire", scope="sys")


@triton.jit
def _record(err_ptr, code, rank, idx, expected, seen, t):
    """Record a failed wait in the error word: [code, rank, flag index, expected, seen,
    tile]. The first failure wins; later ones only stop."""
    prev = tl.atomic_cas(err_ptr + _ERR_CODE, 0, code, sem="relaxed", scope="gpu")
    if prev == 0:
        tl.store(err_ptr + _ERR_RANK, rank)
        tl.store(err_ptr + _ERR_FLAG, idx)
        tl.store(err_ptr + _ERR_EXPECTED, expected)
        tl.store(err_ptr + _ERR_SEEN, seen)
        tl.store(err_ptr + _ERR_TILE, t)
        # and the record into the host's pinned words whose address slots 6-7 hold
        # (0: none), which the host reads on every call without a copy or a
        # synchronization (a stuck peer cannot make the report wait): the fields
        # first, then the code with release semantics, so a host that sees the
        # code sees the fields
        lo = tl.load(err_ptr + _ERR_HOST_LO)
        hi = tl.load(err_ptr + _ERR_HOST_HI)
        host = (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)
        if host != 0:
            hp = host.to(tl.pointer_type(tl.int32))
            tl.store(hp + _ERR_RANK, rank)
            tl.store(hp + _ERR_FLAG, idx)
            tl.store(hp + _ERR_EXPECTED, expected)
            tl.store(hp + _ERR_SEEN, seen)
            tl.store(hp + _ERR_TILE, t)
            tl.atomic_xchg(hp + _ERR_CODE, code, sem="release", scope="sys")


@triton.jit
def _check_sig(flags_ptr, err_ptr, idx, sig_stride, sig, par, rank, t, FENCE_ASYNC: tl.constexpr):
    """After a wait on flag ``idx`` succeeded: 1 if its sender's signature word for this
    call's parity ``par`` (flag ``stride - 1 - par`` of the sender's region of
    ``sig_stride`` flags) holds ``sig``, the signature of this rank's call; else 0 and
    code 3 recorded (the ranks disagree on the call's shapes, dtype or config). The
    sender writes the word before any of its pushes of the call, from the stream its
    push streams fork from, so the flag's acquire makes it visible; two words by call
    parity, as the data buffers' halves (``overlap._p2p``): a sender one call ahead
    writes the other word."""
    sidx = (idx // sig_stride) * sig_stride + sig_stride - 1 - par
    seen = _poll(flags_ptr, sidx)
    ok = 1
    if _cta_any((seen != sig).to(tl.int32), FENCE_ASYNC) != 0:
        _record(err_ptr, _ERR_DISAGREE, rank, sidx, sig, seen, t)
        ok = 0
    return ok


@triton.jit
def _wait(flags_ptr, err_ptr, idx, expected, ahead, rank, t, timeout_ns, max_spins,
          USE_TIMER: tl.constexpr, FENCE_ASYNC: tl.constexpr):
    """Spin until flags[idx] >= expected; returns 1 when satisfied, 0 on timeout/abort.
    A value at or above ``ahead`` is an error too (code 2): every writer is at most
    one call ahead of its waiter while all ranks' waits hold, so such a value means
    an earlier timeout left the ranks out of step (see overlap._p2p).

    Compares are on the int32 difference, ``(seen - expected) >= 0``: flags, epochs and
    counts wrap modulo 2**32 together (``overlap.flags.wrap32``), and a difference
    compares the same across the wrap."""
    seen = _poll(flags_ptr, idx)
    spins = 0
    aborted = 0
    if USE_TIMER:
        t0 = tl.extra.cuda.globaltimer()
    while ((seen - expected) < 0) & (aborted == 0):
        if FENCE_ASYNC:
            # back off between polls: 100+ CTAs polling one L2 line in a tight
            # loop slow down the NCCL kernel they are waiting for
            tl.inline_asm_elementwise("nanosleep.u32 256; mov.u32 $0, 0;", "=r", [],
                                      dtype=tl.int32, is_pure=False, pack=1)
        seen = _poll(flags_ptr, idx)
        spins += 1
        if USE_TIMER:
            late = (tl.extra.cuda.globaltimer() - t0) > timeout_ns
        else:
            late = spins > max_spins
        # another tile timed out: stop waiting too, so the whole grid exits. The same
        # decision in every warp: the next poll's broadcast holds a barrier
        other = tl.load(err_ptr + _ERR_CODE, volatile=True)
        aborted = _cta_any((late | (other != 0)).to(tl.int32), FENCE_ASYNC)
    ok = ((seen - expected) >= 0).to(tl.int32)
    code = _ERR_TIMEOUT
    if (seen - ahead) >= 0:
        ok = 0
        code = _ERR_AHEAD
    if ok == 0:
        _record(err_ptr, code, rank, idx, expected, seen, t)
    if FENCE_ASYNC:
        # the A tiles are read by TMA (async proxy) after a generic-proxy acquire
        tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)
    return ok


@triton.jit(do_not_specialize=["num_tiles", "epoch", "rank", "timeout_ns", "max_spins", "num_progs", "start_idx",
                               "split_start", "split_parts", "sig", "sig_stride", "rows_cap", "rows_span"],
            launch_metadata=_observe.tile_gemm_metadata)
def tile_gemm_kernel(
    # operands
    a_desc, a2_desc, b_desc, c_ptr,
    # schedule, flags, error word
    table_ptr, flags_ptr, err_ptr, counter_ptr,
    # the folded norm's row statistics and column vectors (NORM_EPI)
    rowstat_ptr, colvec_ptr,
    # split tiles' fp32 partials (SPLIT)
    ws_ptr,
    # sizes and scalars
    N, K, num_tiles, epoch, rank, timeout_ns, max_spins, num_progs, start_idx, split_start, split_parts,
    # the call's signature and the flags' region per sender (SIG)
    sig, sig_stride,
    # a table made for row blocks of rows_span rows, run for blocks of rows_cap (CLIP)
    rows_cap, rows_span,
    # strides
    stride_cm, stride_cn,
    # weights 1..3 reading the same A (NUM_B > 1), each with its own C, N and C row stride; None
    # past NUM_B - 1, which Triton takes as constexprs: a one-weight kernel has none of them
    b1_desc, b2_desc, b3_desc, c1_ptr, c2_ptr, c3_ptr, N1, N2, N3, stride_c1m, stride_c2m, stride_c3m,
    # meta
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_A2: tl.constexpr, B_KN: tl.constexpr,
    HAS_WAIT: tl.constexpr, HAS_POST: tl.constexpr, ACTIVATION: tl.constexpr,
    USE_TIMER: tl.constexpr, FENCE_ASYNC: tl.constexpr, UPCAST: tl.constexpr,
    DYNAMIC: tl.constexpr, POST_START: tl.constexpr, K_WAIT: tl.constexpr = 0,
    NORM_EPI: tl.constexpr = False, SPLIT: tl.constexpr = False, WARP_SPEC: tl.constexpr = False,
    SIG: tl.constexpr = False, NUM_B: tl.constexpr = 1, CLIP: tl.constexpr = 0,
    PDL_TRIGGER: tl.constexpr = False, PDL_JOIN: tl.constexpr = False,
):
    pid = tl.program_id(0)
    if PDL_TRIGGER:
        # a kernel launched after this one with programmatic dependent launch may start
        # once every program of this grid got here: all of them hold their SMs then
        _gdc_launch_dependents()
    if POST_START:
        # "this grid is running": a dependent launch held back by a stream wait on
        # this flag is dispatched only after this grid's programs took their SMs
        if pid == 0:
            tl.atomic_xchg(flags_ptr + start_idx, epoch, sem="relaxed", scope="gpu")
    offs_i = tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    if DYNAMIC:
        t = tl.atomic_add(counter_ptr, 1, sem="relaxed", scope="gpu")
    else:
        t = pid
    while t < num_tiles:
        row = table_ptr + t * _TABLE_COLS
        a_row = tl.load(row + _COL_A_ROW)
        a_src = tl.load(row + _COL_A_SRC)
        c_row = tl.load(row + _COL_C_ROW)
        c_rows = tl.load(row + _COL_C_ROWS)
        pid_n = tl.load(row + _COL_N_TILE)
        live = 1
        # the table's rows come in blocks of rows_span (a row bucket's, per source rank:
        # its C rows, CLIP == 1; per destination rank of a reduce-scatter: its A rows,
        # CLIP == 2, C rows staying where the table puts them); this call's blocks hold
        # rows_cap: the tile's rows in them, cut at the block's end (a tile with none
        # left is dead: no wait, no work)
        if CLIP == 1:
            c_row, c_rows = _cut_rows(c_row, c_rows, rows_cap, rows_span)
        if CLIP == 2:
            a_row, c_rows = _cut_rows(a_row, c_rows, rows_cap, rows_span)
        if CLIP != 0:
            live = (c_rows > 0).to(tl.int32)
        b_use = b_desc
        c_use = c_ptr
        n_use = N
        scm = stride_cm
        if NUM_B > 1:
            # the tile's weight sits above its column tile (protocol.N_TILE_BITS): that
            # weight's B, C, N and C row stride (constexpr-unrolled; C's column stride is
            # shared, checked on the host)
            w_b = pid_n >> _N_TILE_BITS
            pid_n = pid_n & _N_TILE_MASK
            if w_b == 1:
                b_use = b1_desc
                c_use = c1_ptr
                n_use = N1
                scm = stride_c1m
            if NUM_B > 2:
                if w_b == 2:
                    b_use = b2_desc
                    c_use = c2_ptr
                    n_use = N2
                    scm = stride_c2m
            if NUM_B > 3:
                if w_b == 3:
                    b_use = b3_desc
                    c_use = c3_ptr
                    n_use = N3
                    scm = stride_c3m
        ok = live
        if HAS_WAIT:
            w_idx = tl.load(row + _COL_WAIT)
            w_mult = tl.load(row + _COL_WAIT_MULT)
            # (the same in every warp: the K loop's pipeline holds barriers)
            if live == 0:
                ok = 0
            elif _cta_any((tl.load(err_ptr + _ERR_CODE, volatile=True) != 0).to(tl.int32), FENCE_ASYNC) != 0:
                ok = 0
            elif w_idx >= 0:
                if K_WAIT == 0:  # else the K loop waits, group by group (TileSync)
                    ok = _wait(flags_ptr, err_ptr, w_idx, epoch * w_mult, (epoch + 2) * w_mult, rank, t,
                               timeout_ns, max_spins, USE_TIMER, FENCE_ASYNC)
                    if SIG:
                        if ok != 0:
                            ok = _check_sig(flags_ptr, err_ptr, w_idx, sig_stride, sig, epoch & 1, rank, t,
                                            FENCE_ASYNC)
        if ok != 0:
            off_bn = pid_n * BLOCK_N
            a_use = a_desc
            if HAS_A2:
                if a_src != 0:
                    a_use = a2_desc
            # a split tile (rows split_start.. of the table, ``split_parts`` rows per tile,
            # one per K piece) runs K steps [k_lo, k_hi) and leaves a partial sum
            k_lo = 0
            k_hi = k_tiles
            slot = -1
            piece = 0
            if SPLIT:
                if t >= split_start:
                    slot = (t - split_start) // split_parts
                    piece = (t - split_start) - slot * split_parts
                    k_lo = piece * k_tiles // split_parts
                    k_hi = (piece + 1) * k_tiles // split_parts
            done = 1
            if HAS_WAIT & (K_WAIT > 0):
                if w_idx >= 0:
                    acc, done = _mainloop_tilesync(a_use, b_use, a_row, off_bn, K, flags_ptr, err_ptr, w_idx,
                                                   epoch * w_mult, (epoch + 2) * w_mult, rank, t, timeout_ns,
                                                   max_spins, BLOCK_M, BLOCK_N, BLOCK_K, B_KN, UPCAST, K_WAIT,
                                                   USE_TIMER, FENCE_ASYNC)
                else:
                    acc = _mainloop(a_use, b_use, a_row, off_bn, k_lo, k_hi, BLOCK_M, BLOCK_N, BLOCK_K, B_KN,
                                    UPCAST, WARP_SPEC)
            else:
                acc = _mainloop(a_use, b_use, a_row, off_bn, k_lo, k_hi, BLOCK_M, BLOCK_N, BLOCK_K, B_KN, UPCAST,
                                WARP_SPEC)
            if done != 0:
                cols = off_bn + offs_j
                stored = 1
                if SPLIT:
                    if slot >= 0:
                        stored = _split_finish(acc, ws_ptr, counter_ptr + 1, slot, piece, split_parts, c_use,
                                               c_row, c_rows, cols, n_use, scm, stride_cn, rowstat_ptr,
                                               colvec_ptr, BLOCK_M, BLOCK_N, NORM_EPI, ACTIVATION, 32)
                    else:
                        _epilogue(acc, c_use, c_row + offs_i, offs_i < c_rows, cols, n_use, scm, stride_cn,
                                  rowstat_ptr, colvec_ptr, NORM_EPI, ACTIVATION)
                else:
                    _epilogue(acc, c_use, c_row + offs_i, offs_i < c_rows, cols, n_use, scm, stride_cn,
                              rowstat_ptr, colvec_ptr, NORM_EPI, ACTIVATION)
                if HAS_POST:
                    p_idx = tl.load(row + _COL_POST)
                    # every thread's C stores precede the barrier; the release
                    # add by one thread then publishes them (cumulativity)
                    tl.debug_barrier()
                    if (p_idx >= 0) & (stored != 0):
                        tl.atomic_add(flags_ptr + p_idx, 1, sem="release", scope="gpu")
            else:
                # a TileSync group's wait failed part-way through the K loop
                _poison(c_use, c_row + offs_i, offs_i < c_rows, off_bn + offs_j, n_use, scm, stride_cn,
                        BLOCK_M, BLOCK_N)
        if HAS_WAIT:
            if (ok == 0) & (live != 0):
                # skipped after a failed wait or with the error word set (not a dead tile):
                # NaN, not whatever C held. A split piece stores NaN and does not count, so
                # the tile's sum is never stored over it (no piece sees the count complete)
                _poison(c_use, c_row + offs_i, offs_i < c_rows, pid_n * BLOCK_N + offs_j, n_use, scm, stride_cn,
                        BLOCK_M, BLOCK_N)
        if CLIP:
            if HAS_POST:
                if live == 0:
                    # a dead tile still counts in its row block's flag (once per tile,
                    # not per split piece): the tiles that wait on it expect every post
                    p_idx = tl.load(row + _COL_POST)
                    first = 1
                    if SPLIT:
                        if t >= split_start:
                            first = (((t - split_start) % split_parts) == 0).to(tl.int32)
                    if (p_idx >= 0) & (first != 0):
                        tl.atomic_add(flags_ptr + p_idx, 1, sem="release", scope="gpu")
        if DYNAMIC:
            t = tl.atomic_add(counter_ptr, 1, sem="relaxed", scope="gpu")
        else:
            t += num_progs
    if PDL_JOIN:
        # a grid launched as a programmatic dependent ends only after the grid it depends
        # on has: whatever that grid still writes (after a failed wait here let this grid's
        # tiles skip their waits) lands before any work queued behind this one
        _gdc_wait()


@triton.jit(do_not_specialize=["num_tiles", "num_groups", "epoch", "rank", "timeout_ns", "max_spins", "num_progs",
                               "start_idx", "sig", "sig_stride"],
            launch_metadata=_observe.tile_gemm_metadata)
def tile_gemm_flat_kernel(
    a_desc, a2_desc, b_desc, c_ptr, table_ptr, flags_ptr, err_ptr, groups_ptr,
    N, K, num_tiles, num_groups, epoch, rank, timeout_ns, max_spins, num_progs, start_idx, sig, sig_stride,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_A2: tl.constexpr, B_KN: tl.constexpr,
    HAS_GROUPS: tl.constexpr, HAS_WAIT: tl.constexpr, HAS_POST: tl.constexpr, ACTIVATION: tl.constexpr,
    USE_TIMER: tl.constexpr, FENCE_ASYNC: tl.constexpr, UPCAST: tl.constexpr, POST_START: tl.constexpr,
    SIG: tl.constexpr,
):
    """``tile_gemm_kernel`` with one software pipeline over a program's tiles: program p
    takes rows p, p + G, ... (G = ``num_progs``), its tile loop and K loop flattened.

    With ``HAS_GROUPS`` the rows come in groups (``groups_ptr``: int32 [num_groups, 6] of
    first row, end row, wait index, wait multiple, post index, A source; ``policies.
    flat_groups``), each the rows of one flag. Per group a program first waits, all its warps
    together, for the group's flag (``HAS_WAIT``; the same bounded wait, error record and
    signature check as a tile of the per-tile kernel), then runs its rows of the group as
    one pipeline, so no load of a row is issued before the row's wait; and after its last
    row of the group adds its count of rows to the post flag (``HAS_POST``; release, after
    a CTA barrier), so the flag reaches the group's tile count when every tile is stored."""
    pid = tl.program_id(0)
    if POST_START:
        if pid == 0:
            tl.atomic_xchg(flags_ptr + start_idx, epoch, sem="relaxed", scope="gpu")
    offs_i = tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    n_groups = num_groups if HAS_GROUPS else 1
    for g in range(n_groups):
        lo = 0
        hi = num_tiles
        w_idx = -1
        w_mult = 1
        p_idx = -1
        a_src = 0
        if HAS_GROUPS:
            gp = groups_ptr + g * 6
            lo = tl.load(gp)
            hi = tl.load(gp + 1)
            w_idx = tl.load(gp + 2)
            w_mult = tl.load(gp + 3)
            p_idx = tl.load(gp + 4)
            a_src = tl.load(gp + 5)
        # this program's rows of the group: those equal to pid modulo G
        first = lo + ((pid - lo) % num_progs + num_progs) % num_progs
        mine = tl.maximum(hi - first + num_progs - 1, 0) // num_progs
        skipped = 0
        if HAS_WAIT:
            # (the same in every warp: the loop's pipeline holds barriers)
            if _cta_any((tl.load(err_ptr + _ERR_CODE, volatile=True) != 0).to(tl.int32), FENCE_ASYNC) != 0:
                skipped = mine
                mine = 0
            elif (w_idx >= 0) & (mine > 0):
                ok = _wait(flags_ptr, err_ptr, w_idx, epoch * w_mult, (epoch + 2) * w_mult, rank, first,
                           timeout_ns, max_spins, USE_TIMER, FENCE_ASYNC)
                if SIG:
                    if ok != 0:
                        ok = _check_sig(flags_ptr, err_ptr, w_idx, sig_stride, sig, epoch & 1, rank, first,
                                        FENCE_ASYNC)
                if ok == 0:
                    skipped = mine
                    mine = 0
        a_use = a_desc
        if HAS_A2:
            if a_src != 0:
                a_use = a2_desc
        for j in tl.range(0, mine, flatten=True):
            row = table_ptr + (first + j * num_progs) * _TABLE_COLS
            a_row = tl.load(row + _COL_A_ROW)
            c_row = tl.load(row + _COL_C_ROW)
            c_rows = tl.load(row + _COL_C_ROWS)
            off_bn = tl.load(row + _COL_N_TILE) * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                acc = _kstep(a_use, b_desc, a_row, off_bn, ki, acc, BLOCK_K, B_KN, UPCAST)
            _epilogue(acc, c_ptr, c_row + offs_i, offs_i < c_rows, off_bn + offs_j, N, stride_cm, stride_cn,
                      flags_ptr, flags_ptr, False, ACTIVATION)
        if HAS_WAIT:
            # this program's rows of a group skipped after a failed wait or with the error
            # word set: NaN, not whatever C held (the error path only: no load otherwise)
            for j in range(0, skipped):
                row = table_ptr + (first + j * num_progs) * _TABLE_COLS
                c_row = tl.load(row + _COL_C_ROW)
                c_rows = tl.load(row + _COL_C_ROWS)
                _poison(c_ptr, c_row + offs_i, offs_i < c_rows, tl.load(row + _COL_N_TILE) * BLOCK_N + offs_j, N,
                        stride_cm, stride_cn, BLOCK_M, BLOCK_N)
        if HAS_POST:
            # every thread's C stores of the group precede the barrier; one release add
            # then publishes them (cumulativity), as the per-tile kernel's posts
            tl.debug_barrier()
            if (p_idx >= 0) & (mine > 0):
                tl.atomic_add(flags_ptr + p_idx, mine, sem="release", scope="gpu")


# --------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------
import functools  # noqa: E402
import os  # noqa: E402
import threading  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402

from ._launch import CachedLauncher as _CachedLauncher  # noqa: E402
from ._launch import HostDesc  # noqa: E402
from typing import Any, Sequence  # noqa: E402


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True, kw_only=True)
class GemmConfig:
    """Tile shape and pipelining of the persistent GEMM."""

    block_m: int = 128
    """Rows of a C tile (also the row granularity of chunk waits)."""
    block_n: int = 256
    """Columns of a C tile."""
    block_k: int = 64
    """K step of the main loop."""
    num_stages: int = 3
    """Software-pipelining depth of the K loop. The ring of A and B tiles and the
    epilogue's scratch must fit shared memory, which keeps the default tile at 3
    (docs/experiments.md, "Before the library")."""
    num_warps: int = 8
    """Warps per program."""
    warp_specialize: bool = False
    """Warp-specialize the K loop (Triton's ``tl.range(warp_specialize=True)``): the TMA
    loads and the MMAs run on separate warps. Needs Triton 3.6 or later (earlier
    versions are not tried) and a Hopper or later GPU (``warp_specialize_supported``); ignored under the interpreter. TileSync's grouped
    waits (``k_wait``) keep their plain loop."""
    flatten: bool = False
    """One software pipeline over a program's tiles and their K steps
    (``tile_gemm_flat_kernel``): waits and posts per group of rows with one flag
    (``policies.flat_groups``), not per tile; no TileSync (``k_wait``), split tiles, several
    weights, folded norm or warp specialization. Launched with a grid of G programs it takes
    rows p, p + G, ... statically: no dispatch counter, so no second grid can join (an op's
    give-back grid is refused with it: ``OverlapConfig``)."""
    tail_block_m: int = 0
    """With ``tail_block_n``, for the GEMM alone (``launch_gemm``; 0: off): the most whole
    row blocks whose tiles fit the grid's whole waves run first (``tail_rows``), then the
    rows left as a second launch of ``tail_block_m x tail_block_n`` tiles (``tail_config``),
    so a last partial wave of big tiles becomes a wave of smaller ones where they fit one
    (benchmarks/results/2026-12-02_1xH200_7ecc691). Needs ``flatten``; an op's GEMM takes
    none."""
    tail_block_n: int = 0
    """Columns of the tail launch's tiles (see ``tail_block_m``)."""
    group_m: int = 8
    """Row tiles per group of a tile table's order (``overlap.policies.build_tile_table``'s
    ``group_m``): a group sweeps all N tiles, so its A rows and the B columns in flight stay
    in L2. Read by whoever builds the table (the tuner, the benchmarks); the kernel never
    sees it, and ops that order tiles by their schedule keep their own order."""

    def __post_init__(self) -> None:
        from .._fields import bool_field, int_field

        for name in ("block_m", "block_n", "block_k", "tail_block_m", "tail_block_n"):
            int_field("GemmConfig", name, getattr(self, name), 0 if name.startswith("tail") else 16, 1024)
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"GemmConfig.{name} must be a power of two >= 16, got {v}")
        int_field("GemmConfig", "num_stages", self.num_stages, 1, 16)
        int_field("GemmConfig", "num_warps", self.num_warps, 1, 16)
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemmConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        int_field("GemmConfig", "group_m", self.group_m, 1, 1 << 16)
        bool_field("GemmConfig", "warp_specialize", self.warp_specialize)
        bool_field("GemmConfig", "flatten", self.flatten)
        if self.flatten and self.warp_specialize:
            raise ValueError("GemmConfig: flatten and warp_specialize do not combine (the flattened loop is "
                             "not warp-specialized)")
        tail = (self.tail_block_m, self.tail_block_n)
        if tail != (0, 0):
            if any(v < 16 or v & (v - 1) for v in tail):
                raise ValueError(f"GemmConfig.tail_block_m/n must both be 0 or powers of two >= 16, got {tail}")
            if not self.flatten:
                raise ValueError("GemmConfig.tail_block_m/n need flatten=True (the GEMM alone's two flattened "
                                 "launches)")


DEFAULT_CONFIG = GemmConfig()


def pdl_supported(device: Any = None) -> bool:
    """Whether programmatic dependent launch is taken here (``launch_tile_gemm``'s
    ``pdl_trigger`` / ``pdl_dependent``): a Triton with ``gdc_launch_dependents`` and a GPU
    of compute capability 9.0 or later; False under the interpreter."""
    import torch

    if interpreting() or _gdc_launch_dependents is None or not torch.cuda.is_available():
        return False
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.type != "cuda":
        return False
    return _capability_major(dev.index if dev.index is not None else torch.cuda.current_device()) >= 9


@functools.lru_cache(maxsize=16)
def _capability_major(index: int) -> int:
    import torch

    return torch.cuda.get_device_capability(index)[0]


def warp_specialize_supported(device: Any = None) -> bool:
    """Whether ``GemmConfig.warp_specialize`` is taken here: Triton 3.6 or later
    (earlier ones are not tried; docs/experiments.md, 2026-12-01) and a GPU of
    compute capability 9.0 or later; False under the interpreter."""
    import torch

    if interpreting() or not torch.cuda.is_available():
        return False
    try:
        major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (3, 6) and torch.cuda.get_device_capability(device)[0] >= 9


ACTIVATIONS = {None: 0, "none": 0, "gelu": 1}

MAX_WEIGHTS = 4
"""Weights one grid can cover (``NUM_B``: the kernel's B descriptors and C pointers are
unrolled, one constexpr branch each)."""


def b_operand(b: Any) -> tuple[Any, bool]:
    """Storage and layout flag for B [K, N].

    Returns (tensor, b_kn): a row-major [K, N] tensor (b_kn=True), or the
    row-major [N, K] storage of a transposed view such as ``w.t()`` of an
    ``nn.Linear`` weight (b_kn=False). Only other layouts are copied.
    """
    if b.dim() != 2:
        raise ValueError(f"b must be 2-D [K, N], got shape {tuple(b.shape)}")
    if b.stride(1) == 1 and b.stride(0) >= b.shape[1]:
        return b, True
    if b.stride(0) == 1 and b.stride(1) >= b.shape[0]:
        return b.t(), False
    return b.contiguous(), True


def check_tma(name: str, t: Any) -> None:
    """ValueError unless TMA can read ``t`` (rows start on 16-byte boundaries)."""
    if (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
        raise ValueError(f"{name} {tuple(t.shape)} ({t.dtype}) cannot be read by TMA: rows must start on "
                         f"16-byte boundaries (row stride {t.stride(0)} elements)")


def check_b(b: Any) -> None:
    """What ``launch_tile_gemm`` will refuse about B, checked before an op queues any work."""
    check_tma("b", b_operand(b)[0])


def launch_tile_gemm(
    a: Any, b: Any, c: Any, table: Any, *,
    a2: Any = None, flags: Any = None, err: Any = None, epoch: int = 0, rank: int = 0,
    grid: int, config: GemmConfig = DEFAULT_CONFIG, activation: str | None = None,
    wait: bool = False, post: bool = False, timeout_ns: int = 500_000_000, max_spins: int = 2_000_000,
    counter: Any = None, start_flag: int | None = None, k_wait: int = 0,
    rowstat: Any = None, colvec: Any = None, split: tuple[int, int] | None = None, workspace: Any = None,
    sig: tuple[int, int] | None = None, groups: Any = None, rows: tuple[int, int] | None = None,
    cut: str = "c", pdl_trigger: bool = False, pdl_dependent: bool = False,
) -> None:
    """Launch ``tile_gemm_kernel`` over ``table`` on the current stream.

    ``a`` (and ``a2``) [*, K] row-major; ``b`` [K, N] (see ``b_operand``);
    ``c`` [*, N] with unit column stride; ``table`` int32 [T, 8] on the device;
    ``flags`` int32 and ``err`` int32 [8] on the device when ``wait``/``post``.
    ``grid``: programs to launch (capped at T); the SMs left are other kernels'.
    ``counter``: int32 [1] device tensor, zero before the first launch of a call:
    tiles are then handed out in table order by ``atomic_add`` on it, so a
    second launch (e.g. on the SMs NCCL gives back) can share the same table.
    ``start_flag``: program 0 sets ``flags[start_flag] = epoch`` as the grid starts.
    ``k_wait`` > 0 (TileSync): a tile's wait is not once before its K loop but before
    every ``k_wait`` K steps, group g on ``flags[wait_idx + g]``.
    ``rowstat`` fp32 [rows of C, 2] and ``colvec`` fp32 [2, N] (both or neither): a norm
    folded into B (``overlap.kernels.norm_fold``); each C element becomes
    ``acc * rowstat[i, 0] - rowstat[i, 1] * colvec[0, j] + colvec[1, j]`` before the
    activation. They are read after the tile's wait, like A.
    ``split=(start, parts)``: table rows ``start`` on are split tiles, ``parts`` rows per
    tile in a row (``overlap.policies.split_tail``), each running one ``parts``-th of the
    K steps; the last piece of a tile to finish sums the pieces in order and stores the
    tile. Needs ``counter`` with ``1 + (T - start) / parts`` zeroed words (one count per
    split tile after the dispatch word) and ``workspace`` fp32 with ``(T - start) *
    block_m * block_n`` elements (``split_workspace``).
    ``sig=(value, stride)``: after each satisfied wait on flag i the tile also checks
    that flag ``(i // stride) * stride + stride - 1 - (epoch & 1)`` (the sender's
    signature word for the call's parity) holds ``value`` (the peer-copy ops' check that
    the ranks agree on the call); otherwise it records code 3 and skips its work.

    ``rows=(cap, span)``: the table was made for C rows in blocks of ``span`` (one per
    source rank of a gathered A, or one block: a plan for a row bucket, ``policies.plan_rows``)
    and this call's blocks hold ``cap <= span`` rows: a tile's C row ``b * span + o`` becomes
    ``b * cap + o``, its rows are cut at ``cap - o``, and a tile with none left does
    nothing but post (once per tile) where the table says. A and A2 rows past ``cap`` in a
    cut tile are read and not stored. ``cut="a"``: the blocks are the table's A rows
    instead (a reduce-scatter's, one per destination): A row ``b * span + o`` becomes
    ``b * cap + o``, cut alike, and C rows stay as the table says.

    ``config.flatten``: ``tile_gemm_flat_kernel`` (no ``k_wait``, split, folded norm,
    several weights or ``rows``); with ``wait``, ``post`` or ``a2`` it needs ``groups``: int32 [G, 6]
    on the device, ``policies.flat_groups`` of the table.

    Programmatic dependent launch (``pdl_supported``; the per-tile kernel only):
    ``pdl_trigger``: every program lets a dependent launch start as soon as it runs;
    ``pdl_dependent``: this grid is launched as such a dependent of the kernel before it
    on the stream, so it may start while that kernel still runs (once all its programs
    triggered). Nothing then orders this grid's reads after that kernel's writes but the
    flags it waits on: only a grid whose every read of that kernel's output waits on a
    flag (a chain's consumer) may take it. Its programs end with a wait for that kernel
    (``griddepcontrol.wait``), so the work queued behind this grid comes after both.

    An op that launches the same GEMM call after call can keep a ``TileGemmPlan``
    instead: its checks and key are then made once, and one call's descriptors serve
    several launches.
    """
    if config.tail_block_m:
        raise ValueError("GemmConfig.tail_block_m/n: two launches of the GEMM alone, which launch_gemm makes; "
                         "launch_tile_gemm takes one table")
    b_stores, b_kn, cs = _check_launch(a, a2, b, c, wait, post, start_flag, flags, err, k_wait, rowstat, colvec)
    c = cs[0]
    num_tiles = table.shape[0]
    if config.flatten:
        _check_flat(wait, post, k_wait, split, a2, len(cs), rowstat is not None, groups, rows is not None)
    clip = _check_rows(rows)
    mode = _cut_mode(cut if rows is not None else None)
    if (pdl_trigger or pdl_dependent) and (config.flatten or not pdl_supported(a.device)):
        raise ValueError("pdl_trigger / pdl_dependent: programmatic dependent launch needs the per-tile kernel "
                         "(not GemmConfig.flatten), a GPU of compute capability 9.0+ and a Triton with "
                         "gdc_launch_dependents (overlap.kernels.tile_gemm.pdl_supported)")
    if num_tiles == 0:
        return
    if config.flatten:
        cfg = config
        interp = interpreting()
        a_desc = _desc(a, [cfg.block_m, cfg.block_k])
        a2_desc = _desc(a2, [cfg.block_m, cfg.block_k]) if a2 is not None else a_desc
        b_desc = _desc(b_stores[0], [cfg.block_k, cfg.block_n] if b_kn else [cfg.block_n, cfg.block_k])
        flags = flags if flags is not None else table
        err = err if err is not None else table
        meta = _flat_meta(cfg, a, a2, b_kn, groups is not None, wait, post, activation, interp, start_flag,
                          sig is not None)
        groups = groups if groups is not None else table
        key = _flat_key(meta, a, a2, b_stores[0], c, table, flags, err, groups)
        nprog = max(1, min(int(grid), num_tiles))
        args = (a_desc, a2_desc, b_desc, c, table, flags, err, groups, c.shape[1], a.shape[1], num_tiles,
                groups.shape[0] if meta["HAS_GROUPS"] else 0, int(epoch), int(rank), int(timeout_ns), int(max_spins),
                nprog, int(start_flag) if start_flag is not None else 0, *(sig or (0, 1)), c.stride(0), c.stride(1))
        _flat_launcher.launch(nprog, args, meta, key=key, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                              interpret=interp, aligned=(c, table, flags, err, groups))
        return
    sp = _check_split(split, workspace, counter, num_tiles, config, a.shape[1], k_wait)
    flags = flags if flags is not None else table  # never read: HAS_WAIT/HAS_POST are off
    err = err if err is not None else table
    cnt = counter if counter is not None else table
    cfg = config
    a_desc = _desc(a, [cfg.block_m, cfg.block_k])
    a2_desc = _desc(a2, [cfg.block_m, cfg.block_k]) if a2 is not None else a_desc
    b_descs = [_desc(t, [cfg.block_k, cfg.block_n] if b_kn else [cfg.block_n, cfg.block_k]) for t in b_stores]
    interp = interpreting()
    meta = _meta(cfg, a, a2, b_kn, wait, post, activation, interp, counter, start_flag, k_wait, rowstat, split,
                 sig is not None, len(b_stores), mode, pdl_trigger, pdl_dependent)
    key = _key(meta, a, a2, b_stores, cs, table, flags, err, cnt)
    nprog = max(1, min(int(grid), num_tiles))
    rowstat = rowstat if rowstat is not None else table  # never read: NORM_EPI is off
    colvec = colvec if colvec is not None else table
    ws = workspace if split is not None else table  # never read: SPLIT is off
    args = (a_desc, a2_desc, b_descs[0], c, table, flags, err, cnt, rowstat, colvec, ws,
            c.shape[1], a.shape[1], num_tiles, int(epoch), int(rank), int(timeout_ns), int(max_spins), nprog,
            int(start_flag) if start_flag is not None else 0, *sp, *(sig or (0, 1)), *clip, c.stride(0), c.stride(1),
            *_more_weights(b_descs[1:], cs[1:]))
    _launcher.launch(nprog, args, meta, key=key, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                     interpret=interp, aligned=(*cs, table, flags, err, cnt, rowstat, colvec, ws),
                     launch_pdl=bool(pdl_dependent))


def _desc(t: Any, block: list[int]) -> HostDesc:
    """``t``'s TMA descriptor fields (``TensorDescriptor.from_tensor``'s; ``_check_launch``
    checked the layout TMA needs, a launch checks the pointer and shape when it fills one)."""
    return HostDesc(t, t.shape, t.stride(), block)


TAIL_RINGS: dict[tuple[int, int], tuple[int, int]] = {(128, 128): (4, 4), (64, 256): (4, 8)}
"""Stages and warps of a tail launch by its tile (those measured in
benchmarks/results/2026-12-02_1xH200_7ecc691); another tile takes the main config's."""


def tail_config(config: GemmConfig) -> GemmConfig:
    """The flattened config of ``config``'s tail launch (``GemmConfig.tail_block_m``)."""
    tile = (config.tail_block_m, config.tail_block_n)
    stages, warps = TAIL_RINGS.get(tile, (config.num_stages, config.num_warps))
    return GemmConfig(block_m=tile[0], block_n=tile[1], block_k=config.block_k, num_stages=stages, num_warps=warps,
                      flatten=True, group_m=config.group_m)


@functools.lru_cache(maxsize=64)
def _split_configs(config: GemmConfig) -> tuple[GemmConfig, GemmConfig]:
    """(the first launch's config, the tail's) of a tail config, made once per config, not
    per call (a frozen dataclass's ``replace`` runs its checks again)."""
    return replace(config, tail_block_m=0, tail_block_n=0), tail_config(config)


def tail_rows(m: int, n: int, config: GemmConfig, grid: int) -> int:
    """Rows of the first launch of a tail config: the most ``block_m`` row blocks whose
    tiles (blocks x column tiles) fit the whole waves of ``grid`` programs (up to one row
    of tiles short of filling them); ``m`` when the waves are whole anyway, 0 when not
    one wave fills."""
    bm, nt = config.block_m, -(-n // config.block_n)
    tiles = -(-m // bm) * nt
    if tiles % grid == 0:
        return m
    return min(m, (tiles // grid) * grid // nt * bm)


_alone_tables: dict[tuple, tuple[Any, Any]] = {}
_ALONE_TABLES_MAX = 64
_captured_tables: dict[tuple, list[Any]] = {}
_alone_lock = threading.Lock()


def _alone_table(rows: int, n: int, cfg: GemmConfig, device: Any) -> Any:
    """The GEMM alone's tile table for ``rows`` x ``n`` (GROUP_M order), kept per shape: at
    most ``_ALONE_TABLES_MAX`` (the oldest dropped first), and any table a CUDA graph
    captured for the life of the process (its replays read it; like the ops' captured
    words, these are not freed with the graph).

    A new table is uploaded on the current stream without a host wait (``table_tensor``);
    a call on another stream waits for that upload's event until it has landed. A shape's
    first table cannot be made inside a capture (its upload would be captured): run the
    shape once first."""
    import torch

    from ..policies import Segment, build_tile_table, table_tensor

    key = (rows, n, cfg.block_m, cfg.block_n, cfg.group_m, str(device))
    cuda = torch.device(device).type == "cuda"
    capturing = cuda and torch.cuda.is_current_stream_capturing()
    with _alone_lock:
        got = _alone_tables.pop(key, None)
        if got is None and key in _captured_tables:
            got = (_captured_tables[key][-1], None)
        if got is None:
            if capturing:
                raise RuntimeError(f"launch_gemm: the tile table of {rows}x{n} ({cfg.block_m}x{cfg.block_n} tiles) "
                                   "is made at the shape's first call, which a CUDA graph capture cannot hold: "
                                   "call it once before capturing")
            t = table_tensor(build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=rows)], n, cfg.block_m,
                                              cfg.block_n, group_m=cfg.group_m), device)
            ev = None
            if cuda:
                ev = torch.cuda.Event()
                ev.record()
            got = (t, ev)
        t, ev = got
        # (inside a capture an event from outside it cannot be waited on, nor queried; the
        # captured launch reads the table at its replays, after the capture)
        if ev is not None and not capturing:
            if ev.query():
                ev = None  # landed: later calls need no wait
            else:
                torch.cuda.current_stream(device).wait_event(ev)
        _alone_tables[key] = (t, ev)  # (re)inserted last: the dict's order is the age
        while len(_alone_tables) > _ALONE_TABLES_MAX:
            _alone_tables.pop(next(iter(_alone_tables)))
        if capturing:
            kept = _captured_tables.setdefault(key, [])
            if not any(x is t for x in kept):
                kept.append(t)
    return t


def launch_gemm(a: Any, b: Any, c: Any, *, grid: int, config: GemmConfig = DEFAULT_CONFIG,
                activation: str | None = None) -> None:
    """C = A @ B by the tile GEMM alone (no flags) on the current stream: ``a`` [M, K],
    ``b`` [K, N] (``b_operand``), ``c`` [M, N] with unit column stride; the tile table is
    made here (GROUP_M order) and kept per shape. With ``config.tail_block_m``: rows
    ``[0, tail_rows)`` with ``config``, then rows ``[tail_rows, M)`` with ``tail_config``,
    both on this stream (the split is the same for every call of a shape and grid)."""
    m, n = c.shape[0], c.shape[1]
    if a.dim() != 2 or a.shape[0] != m:
        raise ValueError(f"launch_gemm: a {tuple(a.shape)} and c {tuple(c.shape)} differ in rows")
    if not config.tail_block_m:
        launch_tile_gemm(a, b, c, _alone_table(m, n, config, c.device), grid=grid, config=config,
                         activation=activation)
        return
    m1 = tail_rows(m, n, config, grid)
    main, tail = _split_configs(config)
    if m1 > 0:
        launch_tile_gemm(a[:m1], b, c[:m1], _alone_table(m1, n, main, c.device), grid=grid, config=main,
                         activation=activation)
    if m1 < m:
        launch_tile_gemm(a[m1:], b, c[m1:], _alone_table(m - m1, n, tail, c.device), grid=grid, config=tail,
                         activation=activation)


def split_workspace(split: tuple[int, int] | None, num_tiles: int, config: GemmConfig, device: Any) -> Any:
    """The fp32 workspace a split table needs (``launch_tile_gemm``), or None without one."""
    import torch

    if split is None:
        return None
    return torch.empty((num_tiles - split[0]) * config.block_m * config.block_n, dtype=torch.float32,
                       device=device)


def _check_split(split: Any, workspace: Any, counter: Any, num_tiles: int, cfg: GemmConfig, k: int,
                 k_wait: int) -> tuple[int, int]:
    """(split_start, split_parts) kernel arguments; (num_tiles, 1) without a split."""
    if split is None:
        return num_tiles, 1
    start, parts = (int(v) for v in split)
    pieces = num_tiles - start
    k_tiles = -(-k // cfg.block_k)
    if not (0 <= start < num_tiles) or parts < 2 or pieces % parts:
        raise ValueError(f"split={split}: need 0 <= start < {num_tiles} table rows, parts >= 2, and the "
                         f"rows from start a whole number of tiles of {parts} pieces")
    if parts > k_tiles:
        raise ValueError(f"split into {parts} K pieces, but K={k} has only {k_tiles} steps of {cfg.block_k}")
    if k_wait:
        raise ValueError("split tiles and k_wait (TileSync) do not combine")
    if cfg.block_m < 32:
        raise ValueError(f"split tiles need block_m >= 32, got {cfg.block_m}")
    if counter is None or counter.numel() < 1 + pieces // parts or str(counter.dtype) != "torch.int32":
        raise ValueError(f"split tiles need an int32 counter of >= {1 + pieces // parts} words "
                         "(dispatch, then one count per split tile)")
    need = pieces * cfg.block_m * cfg.block_n
    if (workspace is None or str(workspace.dtype) != "torch.float32" or workspace.numel() < need
            or not workspace.is_contiguous()):
        raise ValueError(f"split tiles need a contiguous fp32 workspace of >= {need} elements "
                         f"(split_workspace)")
    return start, parts


def _check_weights(a: Any, b: Any, c: Any) -> tuple[list[Any], bool, list[Any]]:
    """B and C as lists of one weight each (a list of B gives a list of C, one per weight,
    at most ``MAX_WEIGHTS``), checked; returns (the weights' ``b_operand`` storages, their
    shared layout flag, the C's)."""
    many = isinstance(b, (list, tuple))
    bs, cs = (list(b), list(c)) if many else ([b], [c])
    if many != isinstance(c, (list, tuple)) or len(bs) != len(cs) or not bs:
        raise ValueError("b and c: one tensor each, or lists of the same non-zero length (one C per weight)")
    if len(bs) > MAX_WEIGHTS:
        raise ValueError(f"at most {MAX_WEIGHTS} weights in one grid, got {len(bs)}")
    K = a.shape[1]
    stores = [b_operand(x) for x in bs]
    for i, ((t, kn), x) in enumerate(zip(stores, bs)):
        name = f"b[{i}]" if many else "b"
        if t.shape[0 if kn else 1] != K:
            raise ValueError(f"K mismatch: a has K={K}, {name} is {tuple(x.shape)}")
        check_tma(name, t)
    if len(bs) > 1:
        if len({kn for _, kn in stores}) != 1:
            raise ValueError("the weights of one grid must share a B layout: all row-major [K, N] or all "
                             "transposed views (w.t()) of [N, K] weights; got "
                             f"{['[K, N]' if kn else 'w.t()' for _, kn in stores]}")
        if len({t.dtype for t, _ in stores} | {a.dtype}) != 1 or len({x.dtype for x in cs}) != 1:
            raise ValueError(f"the weights of one grid share A's dtype and their C's one dtype; got A {a.dtype}, "
                             f"B {[t.dtype for t, _ in stores]}, C {[x.dtype for x in cs]}")
        for i, (x, (t, kn)) in enumerate(zip(cs, stores)):
            if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != t.shape[1 if kn else 0]:
                raise ValueError(f"c[{i}] must be [*, N] with unit column stride, N that of b[{i}]; got "
                                 f"{tuple(x.shape)} with strides {x.stride()}")
    return [t for t, _ in stores], stores[0][1], cs


def _more_weights(b_descs: Sequence[Any], cs: Sequence[Any]) -> tuple:
    """The kernel's arguments for weights 1.. (``NUM_B`` > 1): three B descriptors, three C
    pointers, three N and three C row strides, None past the last weight (Triton takes a None
    as a constexpr: nothing of it is in the compiled kernel)."""
    pad = [None] * (MAX_WEIGHTS - 1 - len(b_descs))
    return (*b_descs, *pad, *cs, *pad, *[x.shape[1] for x in cs], *pad, *[x.stride(0) for x in cs], *pad)


def _cut_mode(cut: Any) -> int:
    """``CLIP``: 0 no cut, 1 C's row blocks (``cut="c"``, or True), 2 A's (``cut="a"``)."""
    if cut is None or cut is False:
        return 0
    if cut is True:
        return 1
    if cut not in ("c", "a"):
        raise ValueError(f"cut must be 'c' or 'a', got {cut!r}")
    return 1 if cut == "c" else 2


def _check_rows(rows: Any) -> tuple[int, int]:
    """``rows=(cap, span)``'s kernel arguments ((1, 1) without: never read)."""
    if rows is None:
        return (1, 1)
    cap, span = (int(v) for v in rows)
    if not 0 < cap <= span:
        raise ValueError(f"rows={rows}: need 0 < cap <= span")
    return cap, span


def _check_flat(wait: bool, post: bool, k_wait: int, split: Any, a2: Any, num_b: int, norm_epi: bool,
                groups: Any, clip: bool = False) -> None:
    """What ``GemmConfig.flatten`` refuses, and the groups it needs."""
    bad = [name for name, on in (("k_wait (TileSync)", k_wait), ("split tiles", split is not None),
                                 ("several weights", num_b > 1), ("a folded norm", norm_epi),
                                 ("rows (a row bucket's table)", clip)) if on]
    if bad:
        raise ValueError(f"GemmConfig.flatten: a flattened GEMM takes no {', '.join(bad)}; use flatten=False here")
    if (wait or post or a2 is not None) and (groups is None or str(groups.dtype) != "torch.int32"
                                             or groups.dim() != 2 or groups.shape[1] != 6
                                             or not groups.is_contiguous()):
        raise ValueError("GemmConfig.flatten with waits, posts or a second A needs groups: contiguous int32 "
                         "[G, 6] (overlap.policies.flat_groups of the table)")


def _flat_meta(cfg: GemmConfig, a: Any, a2: Any, b_kn: bool, has_groups: bool, wait: bool, post: bool,
               activation: str | None, interp: bool, start_flag: Any, sig: bool) -> dict[str, Any]:
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_A2=a2 is not None, B_KN=b_kn,
                HAS_GROUPS=bool(has_groups), HAS_WAIT=bool(wait), HAS_POST=bool(post),
                ACTIVATION=ACTIVATIONS[activation], USE_TIMER=not interp, FENCE_ASYNC=not interp,
                UPCAST=interp and str(a.dtype) == "torch.bfloat16", POST_START=start_flag is not None, SIG=bool(sig))


def _flat_key(meta: dict[str, Any], a: Any, a2: Any, b_store: Any, c: Any, table: Any, flags: Any, err: Any,
              groups: Any) -> tuple:
    """``_key`` for the flattened kernel (not A's row count: see ``_key``)."""
    a2 = a2 if a2 is not None else a
    return ("flat", tuple(meta.values()), a.dtype, a2.dtype, b_store.dtype, c.dtype, table.dtype, flags.dtype,
            err.dtype, groups.dtype, c.shape[1], a.shape[1], c.stride(0), c.stride(1), a.stride(0), a2.stride(0),
            tuple(b_store.shape), tuple(b_store.stride()))


_NO_MORE = (None,) * (4 * (MAX_WEIGHTS - 1))
"""``_more_weights`` of one weight."""


def _check_launch(a: Any, a2: Any, b: Any, c: Any, wait: bool, post: bool, start_flag: Any, flags: Any, err: Any,
                  k_wait: int, rowstat: Any = None, colvec: Any = None,
                  norm_epi: bool = False) -> tuple[list[Any], bool, list[Any]]:
    """``launch_tile_gemm``'s argument checks; returns ``_check_weights(a, b, c)``."""
    if a.stride(1) != 1 or (a2 is not None and a2.stride(1) != 1):
        raise ValueError("A operands must have unit stride along K")
    b_stores, b_kn, cs = _check_weights(a, b, c)
    c = cs[0]
    if len(cs) > 1 and (k_wait or post or rowstat is not None or norm_epi):
        raise ValueError("a grid of several weights takes no k_wait (TileSync), posts or folded norm")
    for name, t in (("a", a), ("a2", a2)):
        if t is not None:
            check_tma(name, t)
    if k_wait < 0 or (k_wait and not wait):
        raise ValueError(f"k_wait={k_wait} needs wait=True and k_wait >= 0")
    if (wait or post or start_flag is not None) and (flags is None or err is None):
        raise ValueError("wait/post/start_flag need flags and err tensors")
    if (rowstat is None) != (colvec is None):
        raise ValueError("rowstat and colvec come together (a folded norm) or not at all")
    if rowstat is not None:
        n = c.shape[1]
        if (str(rowstat.dtype) != "torch.float32" or str(colvec.dtype) != "torch.float32"
                or not rowstat.is_contiguous() or not colvec.is_contiguous()
                or rowstat.dim() != 2 or rowstat.shape[1] != 2 or rowstat.shape[0] < c.shape[0]
                or tuple(colvec.shape) != (2, n)):
            raise ValueError(f"rowstat must be contiguous fp32 [>= {c.shape[0]}, 2] and colvec fp32 [2, {n}]; got "
                             f"{rowstat.dtype} {tuple(rowstat.shape)} and {colvec.dtype} {tuple(colvec.shape)}")
    return b_stores, b_kn, cs


def _meta(cfg: GemmConfig, a: Any, a2: Any, b_kn: bool, wait: bool, post: bool, activation: str | None,
          interp: bool, counter: Any, start_flag: Any, k_wait: int, rowstat: Any = None,
          split: Any = None, sig: bool = False, num_b: int = 1, clip: int = 0,
          pdl_trigger: bool = False, pdl_join: bool = False) -> dict[str, Any]:
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                HAS_A2=a2 is not None, B_KN=b_kn,
                HAS_WAIT=bool(wait), HAS_POST=bool(post), ACTIVATION=ACTIVATIONS[activation],
                USE_TIMER=not interp, FENCE_ASYNC=not interp,
                UPCAST=interp and str(a.dtype) == "torch.bfloat16", DYNAMIC=counter is not None,
                POST_START=start_flag is not None, K_WAIT=int(k_wait), NORM_EPI=rowstat is not None,
                SPLIT=split is not None, WARP_SPEC=bool(cfg.warp_specialize) and not interp, SIG=bool(sig),
                NUM_B=int(num_b), CLIP=int(clip), PDL_TRIGGER=bool(pdl_trigger), PDL_JOIN=bool(pdl_join))


def _key(meta: dict[str, Any], a: Any, a2: Any, b_stores: Any, cs: Any, table: Any, flags: Any, err: Any,
         counter: Any) -> tuple:
    """Everything Triton specializes on: the constexprs, the dtypes, the specialized
    integers (N, K, C's strides), and more: B's shape and the row strides. Not the row
    counts of A and A2: a descriptor is specialized on its dtype and block shape only
    (``tensordesc<bf16[128, 64]>``; its shape and strides are launch-time values), so a
    new M finds the kernel launched for another M instead of taking Triton's binding path."""
    a2 = a2 if a2 is not None else a
    if not isinstance(b_stores, list):  # one weight
        b_stores, cs = [b_stores], [cs]
    b_store, c = b_stores[0], cs[0]
    key = (tuple(meta.values()), a.dtype, a2.dtype, b_store.dtype, c.dtype, table.dtype, flags.dtype,
           err.dtype, counter.dtype, c.shape[1], a.shape[1], c.stride(0), c.stride(1),
           a.stride(0), a2.stride(0), tuple(b_store.shape), tuple(b_store.stride()))
    # weights 1.. (their dtypes are those of weight 0, checked): their N, C row strides, B's layouts
    more = tuple((x.shape[1], x.stride(0), tuple(t.shape), tuple(t.stride())) for t, x in zip(b_stores[1:], cs[1:]))
    return key + more if more else key


class TileGemmPlan:
    """One GEMM of an op, checked and keyed once: operand shapes, strides and dtypes,
    table, flags, error word, counter, config and options are fixed; per launch only
    the operands' storage, the epoch and the grid change.

    ``operands(a, b, a2)`` makes the TMA descriptors of a call, and raises ValueError
    when an operand's shape or strides differ from the plan's (B as ``b_operand``
    stores it); ``launch(descs, c, epoch=, grid=)`` launches on the current stream.
    The arguments are those of ``launch_tile_gemm``; ``clip`` ("c" or True, "a"; None: off)
    makes a plan of a row bucket, its ``cut``: A's row count is then the launch's own, and
    every launch gives ``rows``."""

    def __init__(self, a: Any, b: Any, c: Any, table: Any, *, a2: Any = None, flags: Any = None, err: Any = None,
                 rank: int = 0, config: GemmConfig = DEFAULT_CONFIG, activation: str | None = None,
                 wait: bool = False, post: bool = False, timeout_ns: int = 500_000_000,
                 max_spins: int = 2_000_000, counter: Any = None, start_flag: int | None = None,
                 k_wait: int = 0, norm_epi: bool = False, split: tuple[int, int] | None = None,
                 sig_stride: int | None = None, groups: Any = None, clip: Any = None) -> None:
        b_stores, b_kn, cs = _check_launch(a, a2, b, c, wait, post, start_flag, flags, err, k_wait,
                                           norm_epi=norm_epi)
        c = cs[0]
        if config.tail_block_m:
            raise ValueError("GemmConfig.tail_block_m/n: the GEMM alone (launch_gemm); an op's plan takes one launch")
        self.flat = bool(config.flatten)
        if self.flat:
            _check_flat(wait, post, k_wait, split, a2, len(cs), norm_epi, groups, bool(clip))
        self.mode = _cut_mode(clip)
        self.clip = self.mode != 0
        if sig_stride is not None and (sig_stride < 2 or not wait or k_wait):
            raise ValueError(f"sig_stride={sig_stride} needs wait, no k_wait and a stride of at least 2")
        cfg = config
        self.num_tiles = table.shape[0]
        # the plan owns its split workspace: launches of one plan are stream-ordered
        self.workspace = split_workspace(split, self.num_tiles, cfg, c.device) if self.num_tiles else None
        self.split = _check_split(split, self.workspace, counter, self.num_tiles, cfg, a.shape[1], k_wait)
        self.ws = self.workspace if split is not None else table  # never read without a split
        self.cfg, self.b_kn, self.table = cfg, b_kn, table
        self.flags = flags if flags is not None else table
        self.err = err if err is not None else table
        self.counter = counter if counter is not None else table
        self.a_block = [cfg.block_m, cfg.block_k]
        self.b_block = [cfg.block_k, cfg.block_n] if b_kn else [cfg.block_n, cfg.block_k]
        self.a_layout = self._rows_free(a)
        self.a2_layout = self._rows_free(a2) if a2 is not None else None
        self.b_layouts = [(tuple(t.shape), tuple(t.stride())) for t in b_stores]
        self.c_layouts = [(x.shape[1], tuple(x.stride())) for x in cs]
        self.many = isinstance(b, (list, tuple))
        self.interp = interpreting()
        self.norm_epi = bool(norm_epi)
        self.meta = _meta(cfg, a, a2, b_kn, wait, post, activation, self.interp, counter, start_flag, k_wait,
                          rowstat=True if norm_epi else None, split=split, sig=sig_stride is not None,
                          num_b=len(cs), clip=self.mode)
        self.sig_stride = int(sig_stride) if sig_stride is not None else 1
        self.key = _key(self.meta, a, a2, b_stores, cs, table, self.flags, self.err, self.counter)
        self.head = (c.shape[1], a.shape[1], self.num_tiles)
        if self.flat:
            self.meta = _flat_meta(cfg, a, a2, b_kn, groups is not None, wait, post, activation, self.interp,
                                   start_flag, sig_stride is not None)
            self.groups = groups if groups is not None else table  # never read without groups
            self.flat_head = (self.num_tiles, groups.shape[0] if groups is not None else 0)
            self.key = _flat_key(self.meta, a, a2, b_stores[0], c, table, self.flags, self.err, self.groups)
            self.prepared = _flat_launcher.prepare(self.key, self.meta, num_warps=cfg.num_warps,
                                                   num_stages=cfg.num_stages, interpret=self.interp)
        else:
            self.prepared = _launcher.prepare(self.key, self.meta, num_warps=cfg.num_warps,
                                              num_stages=cfg.num_stages, interpret=self.interp)
        self.tail = (int(rank), int(timeout_ns), int(max_spins))
        self.start = int(start_flag) if start_flag is not None else 0
        # the plan's own tensors are checked for 16-byte alignment (what the cached launch
        # assumes, ``_launch``) once here; a launch checks only the tensors it brings
        own = (self.table, self.flags, self.err, self.groups) if self.flat else \
            (self.table, self.flags, self.err, self.counter, self.ws)
        self.own_aligned = not any(t.data_ptr() % 16 for t in own)

    def _rows_free(self, t: Any) -> tuple:
        """What a launch must match of A or A2: shape and strides, but not the row count
        in a plan of a row bucket (``clip``), whose calls each bring their own."""
        shape = tuple(t.shape)
        return (shape[1:] if self.clip else shape, tuple(t.stride()))

    def operands(self, a: Any, b: Any, a2: Any = None) -> tuple[Any, ...]:
        """The TMA descriptors (A, A2, B) of one call, as ``HostDesc`` (the layouts are compared
        with the plan's here; Triton's checks of a pointer and shape run when a launch fills
        one); for a plan of several weights ``b`` is their list and the B descriptors come in
        its order, (A, A2, B0, B1, ...)."""
        if self._rows_free(a) != self.a_layout:
            raise ValueError(f"a is {tuple(a.shape)} with strides {a.stride()}; the plan's is {self.a_layout}")
        a_desc = HostDesc(a, a.shape, a.stride(), self.a_block)
        if a2 is None:
            if self.a2_layout is not None:
                raise ValueError("the plan has an a2; none given")
            a2_desc = a_desc
        else:
            if self._rows_free(a2) != self.a2_layout:
                raise ValueError(f"a2 is {tuple(a2.shape)} with strides {a2.stride()}; "
                                 f"the plan's is {self.a2_layout}")
            a2_desc = HostDesc(a2, a2.shape, a2.stride(), self.a_block)
        if isinstance(b, (list, tuple)) != self.many or (self.many and len(b) != len(self.b_layouts)):
            raise ValueError(f"the plan is of {len(self.b_layouts) if self.many else 'one'} weight(s): b must be "
                             f"{'a list of as many' if self.many else 'one tensor'}")
        if not self.many:
            return a_desc, a2_desc, self._b_desc(b, self.b_layouts[0])
        return (a_desc, a2_desc, *[self._b_desc(x, layout) for x, layout in zip(b, self.b_layouts)])

    def _b_desc(self, b: Any, layout: tuple) -> Any:
        b_store = b if self.b_kn else b.t()
        if (tuple(b_store.shape), b_store.stride()) != layout:
            b_store, b_kn = b_operand(b)  # a layout TMA reads through a copy
            if b_kn != self.b_kn or (tuple(b_store.shape), b_store.stride()) != layout:
                raise ValueError(f"b's storage is {tuple(b_store.shape)} with strides {b_store.stride()}; "
                                 f"the plan's is {layout}")
        return HostDesc(b_store, b_store.shape, b_store.stride(), self.b_block)

    def launch(self, descs: tuple[Any, ...], c: Any, *, epoch: int, grid: int, rowstat: Any = None,
               colvec: Any = None, sig: int = 0, rows: tuple[int, int] | None = None) -> None:
        """``descs``: ``operands``'s; ``c``: the C, or for a plan of several weights the list
        of their C's. ``rowstat`` and ``colvec``: those of ``launch_tile_gemm``, given exactly when
        the plan was made with ``norm_epi`` (checked there; here only their presence).
        ``sig``: the call's signature, checked after each wait when the plan was made
        with ``sig_stride`` (``launch_tile_gemm``'s ``sig``). ``rows``: ``launch_tile_gemm``'s,
        given exactly when the plan was made with ``clip``."""
        got = self._args(descs, c, epoch, grid, rowstat, colvec, sig, rows)
        if got is not None:
            self.prepared.launch(*got)

    def _args(self, descs: tuple[Any, ...], c: Any, epoch: int, grid: int, rowstat: Any, colvec: Any, sig: int,
              rows: Any) -> tuple | None:
        """``launch``'s checks; (programs, kernel arguments, tensors to check for alignment),
        or None where the plan has no tile."""
        if (rows is not None) != self.clip:
            raise ValueError(f"rows=(cap, span) must be given {'with' if self.clip else 'without'} clip")
        clip = _check_rows(rows)
        if self.num_tiles == 0:
            return None
        if self.many:
            cs = list(c)
            if len(cs) != len(self.c_layouts) or len(descs) != 2 + len(cs):
                raise ValueError(f"the plan has {len(self.c_layouts)} weights: as many C's and B descriptors")
            more = _more_weights(descs[3:], cs[1:])
        else:
            cs, more = (c,), _NO_MORE
        for x, layout in zip(cs, self.c_layouts):
            if (x.shape[1], x.stride()) != layout:
                raise ValueError(f"c is {tuple(x.shape)} with strides {x.stride()}; the plan's is {layout}")
        c = cs[0]
        if (rowstat is not None, colvec is not None) != (self.norm_epi, self.norm_epi):
            raise ValueError(f"rowstat and colvec must be given {'with' if self.norm_epi else 'without'} norm_epi")
        if rowstat is None:
            rowstat = colvec = self.table  # never read
        nprog = max(1, min(int(grid), self.num_tiles))
        if self.flat:
            return (nprog, (*descs[:3], c, self.table, self.flags, self.err, self.groups,
                            *self.head[:2], *self.flat_head, int(epoch), *self.tail, nprog, self.start,
                            int(sig), self.sig_stride, *self.c_layouts[0][1]),
                    (c,) if self.own_aligned else (c, self.table, self.flags, self.err, self.groups))
        args = (*descs[:3], c, self.table, self.flags, self.err, self.counter, rowstat, colvec, self.ws,
                *self.head, int(epoch), *self.tail, nprog, self.start, *self.split, int(sig), self.sig_stride, *clip,
                *self.c_layouts[0][1], *more)
        if self.own_aligned:
            aligned = (*cs, rowstat, colvec) if self.norm_epi else cs
        else:
            aligned = (*cs, self.table, self.flags, self.err, self.counter, rowstat, colvec, self.ws)
        return nprog, args, aligned

    def bind(self, a: Any, b: Any, c: Any, *, a2: Any = None, epoch: int, grid: int, rowstat: Any = None,
             colvec: Any = None, sig: int = 0, rows: tuple[int, int] | None = None) -> Any:
        """This plan's launch with every argument fixed but the storage of its tensors, for a
        call plan (``overlap.ops._calls``): ``_launch.BoundLaunch``, called per call as
        ``bl(stream, (a, a2, b_store, c, rowstat, colvec))`` with tensors of the shapes and
        strides given here (``b_store``: b, or ``b.t()`` where ``b_kn`` is False; a2 None
        without one). None where it cannot be bound (the kernel not compiled and launched
        yet, another launcher form, several weights, the flattened GEMM, a B read through a
        copy, an unaligned plan tensor): the caller keeps ``launch``."""
        if self.flat or self.many or not self.own_aligned or self.num_tiles == 0:
            return None
        from ._launch import BoundLaunch

        bs = b if self.b_kn else b.t()
        if (tuple(bs.shape), bs.stride()) != self.b_layouts[0]:
            return None  # B read through a copy (``b_operand``): not a storage the call gives
        descs = self.operands(a, b, a2)
        descs = (descs[0], descs[1], HostDesc(bs, bs.shape, bs.stride(), self.b_block))
        got = self._args(descs, c, epoch, grid, rowstat, colvec, sig, rows)
        if got is None:
            return None
        return BoundLaunch.of(self.prepared, got[0], got[1], (a, a2, bs, c, rowstat, colvec))


_launcher = _CachedLauncher(tile_gemm_kernel)
_flat_launcher = _CachedLauncher(tile_gemm_flat_kernel)
