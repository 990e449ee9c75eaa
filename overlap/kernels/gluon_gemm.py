"""Warp-specialized persistent GEMM in Gluon (sm_90) whose tiles wait on flags.

    C[c_row + i, n] = sum_k A_src[a_row + i, k] * B[k, n]      for each tile of the table

The same tile table, flags, epochs and error word as ``overlap.kernels.tile_gemm``
(``overlap.protocol``); what differs is who does what inside a program:

    loader warp (1 warp, few registers)      MMA warpgroups (default partition, 8 warps)
    -----------------------------------      -------------------------------------------
    for each of the program's tiles:         for each of the program's tiles:
      wait flags[w] >= epoch * mult            for each K step:
        (acquire, bounded; error word)           wait ready[s]; wgmma (async);
      for each K step:                           wgmma_wait(1); arrive empty[s - 1]
        wait empty[s]; expect ready[s];        wgmma_wait(0); arrive empty[last]
        TMA A and B into ring slot s           epilogue: activation, C store (TMA for a
                                                 whole tile, masked stores for a ragged one)

Only the loader warp spins: the MMA warps wait on the ring's mbarriers, and the loader,
being one warp, runs ahead into the next tile's flag and loads while they finish a tile
and run its epilogue. A failed wait (timeout, a flag two epochs ahead) is recorded in the
error word as the ``triton.language`` kernel records it; the loader then arrives on the
tile's ring slots without loading (so the MMA warps never block) and the MMA warps, which
read the error word after each tile's K loop, store nothing. Every later tile of every
program sees the error word and skips its wait and its stores, so the grid exits.

With ``GluonGemmConfig.pingpong`` the MMA warps are two partitions of one warpgroup each,
on alternate tiles of the program (``gluon_gemm_pp_kernel``): one's epilogue runs under
the other's K loop, and a turn barrier hands the ring over between them.

With ``GluonGemmConfig.wide`` (a 192-column tile, ``gluon_gemm_wide_kernel``) B and C are
two TMA tiles each (128 and 64 columns) and the MMA warps hold two accumulators, issuing two
wgmmas a K step: Gluon's register tiles have power-of-two sides, so a 192-wide accumulator
is the two. It fills waves a 256-wide tile leaves partial (N = 1536 at M = 2048: 96 tiles of
128x256 on 132 SMs, 128 of 128x192).

Tiles are taken statically (program p runs rows p, p + G, ...) or, with a dispatch
counter (``DYNAMIC``), from an atomic counter shared by every launch over the table (the
give-back grid can join): the loader warp takes a tile and hands its index to the MMA
warps through a two-slot queue in shared memory, and ends with an end mark per MMA
warpgroup.

With ``post`` (the plain kernel: a producer op's tiles, which wait on nothing) the MMA
warps store each tile's C through their C tile in shared memory by coalesced masked stores
(from registers where the config keeps no C tile), then, after a barrier of their threads, one
thread adds 1 to the tile's post flag with release semantics (``tile_gemm``'s posts; a dead
tile counts too).

Not here (the ``triton.language`` kernel has them): posts from tiles that also wait, posts
on the ping-pong and 192-column kernels, split tiles (the table's kind: ``split_tail`` is this
kernel's own), several weights, the folded norm,
signature words, A-row cuts, TileSync. The ops run it where their call needs none of these
and it measured faster (``overlap.kernels.engine``; ``GluonGemmPlan`` is the form they
launch); the tile GEMM runs everything else.

Version differences of the Gluon API live in ``overlap.kernels._gluon_compat``; where it
says Gluon is missing, nothing here is defined but ``AVAILABLE`` and ``REASON``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from .. import protocol as _p
from . import _gluon_compat as _c
from ._launch import HostDesc

__all__ = ["AVAILABLE", "REASON", "GluonGemmConfig", "GluonGemmPlan", "launch_gluon_gemm", "descriptors", "split_plan"]

AVAILABLE: bool = _c.AVAILABLE
REASON: str = _c.REASON


@dataclass(frozen=True, kw_only=True)
class GluonGemmConfig:
    """Tile shape and ring depth of the warp-specialized GEMM."""

    block_m: int = 128
    """Rows of a C tile: 128 or 256 (both warpgroups on one tile, 64-row wgmmas); with
    ``pingpong`` 64 or 128 (one warpgroup's tile)."""
    block_n: int = 256
    """Columns of a C tile: 128 or 256 (a wgmma's N; Gluon's register tiles are powers of
    two), or 192 with block_m 128 (``wide``: two accumulators of 128 and 64 columns, two
    wgmmas a K step). With ``pingpong``, block_m x block_n at most 128 x 128 or 64 x 256:
    one warpgroup holds the fp32 accumulator (128 registers a thread)."""
    block_k: int = 64
    """K step of the ring."""
    stages: int = 3
    """Ring slots (A and B tiles each). 128x256x64 at 16 bits: 48 KiB a slot, plus 64 KiB
    for the C tile the TMA store reads: 3 slots take 208 KiB of an SM's 227; 4 do not fit
    (refused here) unless block_k is 32 or C is stored from registers (``tma_epilogue=False``:
    no C tile in shared memory, 4 slots take 192 KiB)."""
    loader_regs: int = 48
    """Registers per thread of the loader warp (its spin loop and error record are scalar)."""
    pingpong: bool = False
    """Two MMA warpgroups on alternate tiles of the program (CUTLASS's "ping-pong"): one runs
    its tile's epilogue while the other's K loop keeps the tensor cores busy. A turn barrier
    passes the ring from one to the other once a warpgroup has taken its tile's last slot,
    so each waits only on ring phases that its predecessor has seen complete."""
    ahead: bool = False
    """Reads at tile boundaries moved off the tiles' path. The loader warp reads each tile's
    table row a tile early (static tiles: while it issues the tile before's loads; by the
    dispatch counter: it takes the next tile at the current one's first K step and reads
    its row at step min(K steps - 1, 2)), and it does not wait again on the flag and
    multiple of the last wait it passed (flags only grow within a launch), skipping that
    tile's poll, error-word read and proxy fence. The MMA warps (tiles that wait) read the
    error word during the tile's first K step, behind its first ring wait (the loader
    records a failed tile's error before it arrives on the tile's slots), not after its
    last, where the epilogue waited on it. So a tile whose own wait passed stores its
    (right) values even where another tile failed during its K loop; a failed tile still
    stores NaN (with K = 0 there is no step to read it in: C is zeros, right without data).
    Off by default: checked on an H100, and no faster there than without it
    (``benchmarks/gluon_gemm_bench.py``'s ``+`` variants; docs/experiments.md, 2026-12-05)."""
    split_tail: bool = False
    """The last wave's tiles split along K (the plain kernel, tiles that wait or run alone;
    not ``ahead``, not posts). Where a launch's tiles leave the last wave of its programs
    at most half full (R tiles), each of those R tiles runs as 2 or more K slices so that
    the tail has as many slices as programs, or fewer where K allows no more slices of 4 steps
    (the "data-parallel + split-K" hybrid of
    Osama et al., Stream-K, PPoPP 2023): every slice stores its fp32 partial to the plan's
    workspace, then adds 1 to its tile's arrival count (release, after a barrier of the
    partition's threads); the slice that arrives last (acquire) adds the others' partials
    to its own and stores the tile (or NaN after a failed wait, as every tile), and sets
    the count back to 0 for the next launch. No slice waits on another: none can hang. The
    split is fixed by a plan's first launch (its grid), so launches that join one table by
    the dispatch counter agree on it (``split_plan``)."""
    tma_epilogue: bool = True
    """C through shared memory and a TMA store (whole tiles). False (the plain kernel only):
    every tile's C by masked stores from the MMA warps' registers, and no C tile in shared
    memory, which leaves room for a fourth ring slot at 128x256x64 (4 x 48 KiB): more loads
    in flight for a long K, a slower store per tile."""

    def __post_init__(self) -> None:
        tiles = ((64, 256), (128, 128)) if self.pingpong else ((128, 128), (128, 192), (128, 256), (256, 128))
        if (self.block_m, self.block_n) not in tiles:
            raise ValueError(f"GluonGemmConfig: a {'ping-pong ' if self.pingpong else ''}tile is one of "
                             f"{', '.join(f'{m}x{n}' for m, n in tiles)}, got {self.block_m}x{self.block_n}")
        if self.block_k not in (32, 64, 128):
            raise ValueError(f"GluonGemmConfig.block_k must be 32, 64 or 128, got {self.block_k}")
        if self.stages < 2:
            raise ValueError(f"GluonGemmConfig.stages must be >= 2, got {self.stages}")
        if self.smem_bytes(2) > 227 * 1024:
            raise ValueError(f"GluonGemmConfig {self}: {self.smem_bytes(2)} bytes of shared memory at 16-bit "
                             "operands, more than an H100/H200 SM's 227 KiB")
        if not self.tma_epilogue and self.kind != "plain":
            raise ValueError("GluonGemmConfig.tma_epilogue=False is the plain kernel's (not ping-pong, not 192 "
                             "columns)")
        if self.split_tail and (self.kind != "plain" or self.ahead):
            raise ValueError("GluonGemmConfig.split_tail is the plain kernel's (not ping-pong, not 192 columns), "
                             "without ahead")
        if self.loader_regs % 8 or not 24 <= self.loader_regs <= 256:
            raise ValueError(f"GluonGemmConfig.loader_regs must be a multiple of 8 in [24, 256], got "
                             f"{self.loader_regs}")

    def smem_bytes(self, elem: int) -> int:
        """Shared memory of a program: the ring, the C tile(s) and the barriers."""
        ring = self.stages * (self.block_m + self.block_n) * self.block_k * elem
        c_tiles = (2 if self.pingpong else 1) if self.tma_epilogue else 0
        # + ring barriers, tile queue, turn barriers, and what the compiler adds
        return ring + c_tiles * self.block_m * self.block_n * elem + 16 * self.stages + 1024

    @property
    def wide(self) -> bool:
        """A 192-column tile: C as two accumulators (128 and 64 columns), B and C as two TMA
        tiles each (``gluon_gemm_wide_kernel``). A 192-wide tile fills the SMs where 256
        leaves a partial wave: N = 1536 at M = 2048 is 128 tiles of 128x192 on 132 SMs, 96
        of 128x256."""
        return self.block_n == 192

    @property
    def kind(self) -> str:
        """Which kernel runs the config: "pp" (``pingpong``), "wide" or "plain"."""
        return "pp" if self.pingpong else ("wide" if self.wide else "plain")

    @property
    def num_warps(self) -> int:
        """Warps of the default partition: both MMA warpgroups, or (``pingpong``) the first."""
        return 4 if self.pingpong else 8


if AVAILABLE:
    gluon = _c.gluon
    gl = _c.gl
    mbarrier = _c.mbarrier

    _TABLE_COLS = gl.constexpr(_p.TABLE_COLS)
    _COL_A_ROW = gl.constexpr(_p.COL_A_ROW)
    _COL_A_SRC = gl.constexpr(_p.COL_A_SRC)
    _COL_C_ROW = gl.constexpr(_p.COL_C_ROW)
    _COL_C_ROWS = gl.constexpr(_p.COL_C_ROWS)
    _COL_N_TILE = gl.constexpr(_p.COL_N_TILE)
    _COL_WAIT = gl.constexpr(_p.COL_WAIT)
    _COL_WAIT_MULT = gl.constexpr(_p.COL_WAIT_MULT)
    _COL_POST = gl.constexpr(_p.COL_POST)
    _ERR_CODE = gl.constexpr(_p.ERR_CODE)
    _ERR_RANK = gl.constexpr(_p.ERR_RANK)
    _ERR_FLAG = gl.constexpr(_p.ERR_FLAG)
    _ERR_EXPECTED = gl.constexpr(_p.ERR_EXPECTED)
    _ERR_SEEN = gl.constexpr(_p.ERR_SEEN)
    _ERR_TILE = gl.constexpr(_p.ERR_TILE)
    _ERR_HOST_LO = gl.constexpr(_p.ERR_HOST_LO)
    _ERR_HOST_HI = gl.constexpr(_p.ERR_HOST_HI)
    _ERR_TIMEOUT = gl.constexpr(_p.ERR_TIMEOUT)
    _ERR_AHEAD = gl.constexpr(_p.ERR_AHEAD)

    _PER_CALL = ["num_tiles", "epoch", "rank", "timeout_ns", "rows_cap", "rows_span", "num_units", "split_from",
                 "split_q", "split_r"]
    """Integers that change from call to call (an epoch of 1, a row count that divides by
    16): not specialized on, so a new value never compiles another kernel (which a CUDA
    graph capture could not take); the split's integers (``split_tail``) likewise."""

    @gluon.jit
    def _warp_any(x):
        """1 in every lane of the warp if ``x`` is nonzero in any lane (``vote.any``): the
        loader's per-lane reads of the timer and the error word may differ, and its branches
        must not split the warp."""
        return gl.inline_asm_elementwise(
            "{ .reg .pred p, q; setp.ne.s32 p, $1, 0; vote.sync.any.pred q, p, 0xffffffff; selp.s32 $0, 1, 0, q; }",
            "=r,r", [x.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _globaltimer():
        return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                         pack=1)

    @gluon.jit
    def _cut_rows(row, rows, rows_cap, rows_span):
        """Table row ``row`` of a block of ``rows_span`` rows, moved to this call's block of
        ``rows_cap``; the tile's ``rows`` cut at that block's end (0 or less: a dead tile).
        As ``tile_gemm._cut_rows``."""
        blk = row // rows_span
        off = row - blk * rows_span
        return blk * rows_cap + off, gl.minimum(rows, rows_cap - off)

    @gluon.jit
    def _record(err_ptr, code, rank, idx, expected, seen, t):
        """[code, rank, flag index, expected, seen, tile] into the error word, the first
        failure only; and into the host's pinned words whose address words 6-7 hold (0:
        none), the code last with release semantics (as ``tile_gemm._record``)."""
        prev = gl.atomic_cas(err_ptr + _ERR_CODE, 0, code, sem="relaxed", scope="gpu")
        if prev == 0:
            gl.store(err_ptr + _ERR_RANK, rank)
            gl.store(err_ptr + _ERR_FLAG, idx)
            gl.store(err_ptr + _ERR_EXPECTED, expected)
            gl.store(err_ptr + _ERR_SEEN, seen)
            gl.store(err_ptr + _ERR_TILE, t)
            lo = gl.load(err_ptr + _ERR_HOST_LO)
            hi = gl.load(err_ptr + _ERR_HOST_HI)
            host = (hi.to(gl.int64) << 32) | (lo.to(gl.int64) & 0xFFFFFFFF)
            if host != 0:
                hp = host.to(gl.pointer_type(gl.int32))
                gl.store(hp + _ERR_RANK, rank)
                gl.store(hp + _ERR_FLAG, idx)
                gl.store(hp + _ERR_EXPECTED, expected)
                gl.store(hp + _ERR_SEEN, seen)
                gl.store(hp + _ERR_TILE, t)
                gl.atomic_xchg(hp + _ERR_CODE, code, sem="release", scope="sys")

    @gluon.jit
    def _wait_flag(flags_ptr, err_ptr, idx, expected, ahead, rank, t, timeout_ns):
        """The loader's wait: spin (acquire, system scope, 256 ns back-off) until
        flags[idx] >= expected, compares on int32 differences (flags and epochs wrap
        together); past ``timeout_ns`` or once another tile recorded an error, stop. A value
        at or above ``ahead`` is an error too (code 2). Returns 1 when satisfied."""
        seen = gl.atomic_add(flags_ptr + idx, 0, sem="acquire", scope="sys")
        t0 = _globaltimer()
        aborted = 0
        while ((seen - expected) < 0) & (aborted == 0):
            gl.inline_asm_elementwise("nanosleep.u32 256; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
            seen = gl.atomic_add(flags_ptr + idx, 0, sem="acquire", scope="sys")
            late = (_globaltimer() - t0) > timeout_ns
            other = gl.load(err_ptr + _ERR_CODE, volatile=True)
            aborted = _warp_any(late | (other != 0))
        ok = _warp_any((seen - expected) >= 0)
        code = _ERR_TIMEOUT
        if _warp_any((seen - ahead) >= 0) != 0:
            ok = 0
            code = _ERR_AHEAD
        if ok == 0:
            _record(err_ptr, code, rank, idx, expected, seen, t)
        # the A tiles are read by TMA (the async proxy) after a generic-proxy acquire
        gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
        return ok

    @gluon.jit
    def _partition_error(err_ptr, WARPS: gl.constexpr):
        """1 in every thread of an MMA partition of ``WARPS`` warps if the error word is set
        as any of them read it, else 0. Each thread's volatile read is its own: a failure
        recorded by another program between two warps' reads would send them down different
        branches of the epilogue, whose stores hold barriers of the partition's threads (the
        warps that went the other way would leave the rest at a barrier). So the decision is
        reduced over the partition first (``tile_gemm._cta_any``'s rule)."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        seen = gl.load(err_ptr + _ERR_CODE + gl.zeros([32 * WARPS], gl.int32, layout=layout), volatile=True)
        return gl.max((seen != 0).to(gl.int32), axis=0)

    @gluon.jit
    def _first_step_error(err_ptr, ki, bad, WARPS: gl.constexpr):
        """(``AHEAD``, the MMA warps) the error word read at a tile's first K step, after its
        first ring wait (a failed tile's error was recorded before the loader arrived on its
        slots) and its first wgmma's issue (``_partition_error``); ``bad`` as it was at a
        later step."""
        if ki == 0:
            bad = _partition_error(err_ptr, WARPS)
        return bad

    @gluon.jit
    def _row_fields(table_ptr, t):
        """What the loader reads of table row ``t``: A row, A source, column tile, C row,
        C rows, wait flag, wait multiple (one 32-byte row: the loads go out together)."""
        row = table_ptr + t * _TABLE_COLS
        return (gl.load(row + _COL_A_ROW), gl.load(row + _COL_A_SRC), gl.load(row + _COL_N_TILE),
                gl.load(row + _COL_C_ROW), gl.load(row + _COL_C_ROWS), gl.load(row + _COL_WAIT),
                gl.load(row + _COL_WAIT_MULT))

    @gluon.jit
    def _unit(u, split_from, q, r, k_tiles):
        """Work unit ``u`` of a split launch (``split_tail``): units below ``split_from`` are
        whole tiles (tile u, K steps 0 .. k_tiles); the rest are K slices of the tail tiles
        split_from, split_from + 1, ...: the first ``r`` of them in q + 1 slices, the others
        in q. Returns (tile, first K step, end K step, tail index, slices of the tile, its
        first slice's unit - split_from, the slice's index)."""
        tile = u
        k0 = 0
        k1 = k_tiles
        i = -1
        n = 1
        base = 0
        s = 0
        if u >= split_from:
            v = u - split_from
            big = r * (q + 1)
            if v < big:
                i = v // (q + 1)
                n = q + 1
                base = i * (q + 1)
            else:
                i = r + (v - big) // q
                n = q
                base = big + (i - r) * q
            s = v - base
            tile = split_from + i
            k0 = s * k_tiles // n
            k1 = (s + 1) * k_tiles // n
        return tile, k0, k1, i, n, base, s

    @gluon.jit
    def _fence_gpu():
        gl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)

    @gluon.jit
    def _fixup(acc, acc_layout: gl.constexpr, ws_ptr, sk_ptr, i, n, base, s, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr):
        """A K slice's end (``split_tail``): its fp32 partial into workspace slot base + s,
        a barrier of the partition's threads, then one thread's acq_rel add of 1 to tail
        tile i's arrival count. The slice that arrives last returns the sum of every slice's
        partial and 1 (and sets the count back to 0); the others return ``acc`` and 0. Each
        thread reads and writes only its own elements' places; the partials of other
        programs are read past L1 (``.cg``), after the acquire and a barrier."""
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        idx = gl.expand_dims(rows * BLOCK_N, 1) + gl.expand_dims(cols, 0)
        elems: gl.constexpr = BLOCK_M * BLOCK_N
        gl.store(ws_ptr + (base + s).to(gl.int64) * elems + idx, acc)
        _fence_gpu()  # (every thread's stores ordered before the barrier and the add, as CUTLASS's split-K)
        _c.thread_barrier()
        old = gl.atomic_add(sk_ptr + i, 1, sem="acq_rel", scope="gpu")
        _c.thread_barrier()
        _fence_gpu()
        last = 0
        if old == n - 1:
            last = 1
            for o in range(n):
                if o != s:
                    acc += gl.load(ws_ptr + (base + o).to(gl.int64) * elems + idx, cache_modifier=".cg")
            gl.store(sk_ptr + i, 0)
        return acc, last

    @gluon.jit
    def _put_tile(tq, tq_ready, tq_empty, j, t):
        """Loader side of the tile queue (``DYNAMIC``): the program's j-th tile index ``t``
        into queue slot j % 2, once the MMA side has taken what that slot held before."""
        q = j % 2
        mbarrier.wait(tq_empty.index(q), ((j // 2) & 1) ^ 1)
        tq.index(q).store(gl.full([1], t, gl.int32, layout=gl.BlockedLayout([1], [32], [1], [0])))
        mbarrier.arrive(tq_ready.index(q), count=1)

    @gluon.jit
    def _take_tile(tq, tq_ready, tq_empty, j, WARPS: gl.constexpr):
        """MMA side of the tile queue: the program's j-th tile (or unit) index (the loader's end
        mark, ``num_units``: none left)."""
        q = j % 2
        mbarrier.wait(tq_ready.index(q), (j // 2) & 1)
        t = gl.max(tq.index(q).load(gl.BlockedLayout([1], [32], [WARPS], [0])), axis=0)
        mbarrier.arrive(tq_empty.index(q), count=1)
        return t

    @gluon.jit
    def _loader(a_desc, a2_desc, b_desc, b1_desc, table_ptr, flags_ptr, err_ptr, counter_ptr, a_bufs, b_bufs,
                b1_bufs, ready, empty, tq, tq_ready, tq_empty, K, num_tiles, epoch, rank, timeout_ns, rows_cap,
                rows_span, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                STAGES: gl.constexpr, B_KN: gl.constexpr, HAS_A2: gl.constexpr, HAS_WAIT: gl.constexpr,
                DYNAMIC: gl.constexpr, CLIP: gl.constexpr, WIDE: gl.constexpr, CONSUMERS: gl.constexpr,
                AHEAD: gl.constexpr, num_units, split_from, split_q, split_r, SPLIT: gl.constexpr):
        """The loader warp: per tile, the flag wait, then the K steps' TMA loads into the
        ring (a failed tile arrives on its slots without loading). With ``DYNAMIC`` it takes
        each tile from the dispatch counter and passes its index to the MMA side through the
        tile queue, then one end mark (``num_units``) per MMA consumer. With ``CLIP`` a tile
        whose C rows the call's row blocks cut away (a dead tile) neither waits nor loads.
        With ``WIDE`` (a 192-column tile) B comes as two TMA tiles a step: its first 128
        columns through ``b_desc`` into ``b_bufs``, the last 64 through ``b1_desc`` into
        ``b1_bufs`` (one ring slot's barrier counts the bytes of all three loads). ``AHEAD``
        (``GluonGemmConfig.ahead``): each tile's row read a tile ahead (static tiles: at the
        tile before's start; by the counter: the next tile taken at the current one's first
        K step and its row read at step min(K steps - 1, 2), after the loop where there is
        none, so neither the take nor the row's read sits at the boundary), and no second
        wait on the flag and multiple of the last wait passed. ``SPLIT`` (``split_tail``):
        ``num_units`` work units, each a tile or a K slice of one (``_unit``), the unit's
        index passed through the tile queue."""
        pid = gl.program_id(0)
        num_progs = gl.num_programs(0)
        k_tiles = gl.cdiv(K, BLOCK_K)
        nbytes: gl.constexpr = (BLOCK_M + BLOCK_N) * BLOCK_K * a_desc.dtype.primitive_bitwidth // 8
        cnt = 0
        j = 0
        passed_idx = -1  # (AHEAD) the flag and multiple of the last wait passed; -1: none yet
        passed_mult = 0
        if DYNAMIC:
            t = gl.atomic_add(counter_ptr, 1, sem="relaxed", scope="gpu")
        else:
            t = pid
        if AHEAD:  # (a row index past the table, a counter's last take, is clamped: never read past it)
            nx_a_row, nx_a_src, nx_n_tile, nx_c_row, nx_c_rows, nx_w_idx, nx_w_mult = _row_fields(
                table_ptr, gl.minimum(t, num_tiles - 1))
            row_at = gl.minimum(k_tiles - 1, 2)  # (by the counter: the K step that reads the next row)
        while t < num_units:
            if DYNAMIC:
                _put_tile(tq, tq_ready, tq_empty, j, t)
            tt = t  # (the tile of unit t; its K steps k0 .. k1)
            k0 = 0
            k1 = k_tiles
            if SPLIT:
                tt, k0, k1, _i, _n, _b, _s = _unit(t, split_from, split_q, split_r, k_tiles)
            if AHEAD:
                a_row, a_src, n_tile, c_row, c_rows, w_idx, w_mult = (nx_a_row, nx_a_src, nx_n_tile, nx_c_row,
                                                                      nx_c_rows, nx_w_idx, nx_w_mult)
                if DYNAMIC:
                    t_next = t  # (taken at the K loop's first step)
                else:
                    # the next tile's row, read now and first used a tile from now
                    t_next = t + num_progs
                    nx_a_row, nx_a_src, nx_n_tile, nx_c_row, nx_c_rows, nx_w_idx, nx_w_mult = _row_fields(
                        table_ptr, gl.minimum(t_next, num_tiles - 1))
            else:
                a_row, a_src, n_tile, c_row, c_rows, w_idx, w_mult = _row_fields(table_ptr, tt)
            off_n = n_tile * BLOCK_N
            ok = 1
            if CLIP:
                cut_row, cut_rows = _cut_rows(c_row, c_rows, rows_cap, rows_span)
                if cut_rows <= 0:
                    ok = 0
            if HAS_WAIT:
                if ok != 0:  # (a dead tile neither waits nor records)
                    again = 1
                    if AHEAD:  # (flags only grow within a launch: a wait passed stays passed)
                        if (w_idx == passed_idx) & (w_mult == passed_mult):
                            again = 0
                    if again != 0:
                        if _warp_any(gl.load(err_ptr + _ERR_CODE, volatile=True) != 0) != 0:
                            ok = 0
                        elif w_idx >= 0:
                            ok = _wait_flag(flags_ptr, err_ptr, w_idx, epoch * w_mult, (epoch + 2) * w_mult, rank,
                                            tt, timeout_ns)
                            if AHEAD:
                                if ok != 0:
                                    passed_idx = w_idx
                                    passed_mult = w_mult
            load = ok != 0
            from_a2 = False
            if HAS_A2:
                from_a2 = a_src != 0
            for ki in range(k0, k1):
                s = cnt % STAGES
                ph = (cnt // STAGES) & 1
                # a slot is free once the MMA warps released it (phase 1 passes at start)
                mbarrier.wait(empty.index(s), ph ^ 1)
                bar = ready.index(s)
                off_k = ki * BLOCK_K
                mbarrier.expect(bar, nbytes, pred=load)
                _c.tma_load(a_desc, [a_row, off_k], bar, a_bufs.index(s), pred=load & (not from_a2))
                if HAS_A2:
                    _c.tma_load(a2_desc, [a_row, off_k], bar, a_bufs.index(s), pred=load & from_a2)
                if B_KN:
                    _c.tma_load(b_desc, [off_k, off_n], bar, b_bufs.index(s), pred=load)
                    if WIDE:
                        _c.tma_load(b1_desc, [off_k, off_n + 128], bar, b1_bufs.index(s), pred=load)
                else:
                    _c.tma_load(b_desc, [off_n, off_k], bar, b_bufs.index(s), pred=load)
                    if WIDE:
                        _c.tma_load(b1_desc, [off_n + 128, off_k], bar, b1_bufs.index(s), pred=load)
                mbarrier.arrive(bar, count=1, pred=not load)
                if AHEAD and DYNAMIC:
                    if ki == 0:
                        t_next = gl.atomic_add(counter_ptr, 1, sem="relaxed", scope="gpu")
                    if ki == row_at:
                        nx_a_row, nx_a_src, nx_n_tile, nx_c_row, nx_c_rows, nx_w_idx, nx_w_mult = _row_fields(
                            table_ptr, gl.minimum(t_next, num_tiles - 1))
                cnt += 1
            j += 1
            if AHEAD:
                if DYNAMIC:
                    if k_tiles == 0:  # (no K step took it)
                        t_next = gl.atomic_add(counter_ptr, 1, sem="relaxed", scope="gpu")
                        nx_a_row, nx_a_src, nx_n_tile, nx_c_row, nx_c_rows, nx_w_idx, nx_w_mult = _row_fields(
                            table_ptr, gl.minimum(t_next, num_tiles - 1))
                t = t_next
            elif DYNAMIC:
                t = gl.atomic_add(counter_ptr, 1, sem="relaxed", scope="gpu")
            else:
                t += num_progs
        if DYNAMIC:
            for e in gl.static_range(CONSUMERS):
                _put_tile(tq, tq_ready, tq_empty, j + e, num_units)

    @gluon.jit
    def _epilogue(acc, acc_layout: gl.constexpr, c_smem, c_desc, c_ptr, err_ptr, c_row, c_rows, off_n, N,
                  stride_cm, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_WAIT: gl.constexpr,
                  ACTIVATION: gl.constexpr, GIVEN: gl.constexpr, bad, WARPS: gl.constexpr):
        """Activation and the C store of one tile: a whole tile through shared memory and one
        TMA store (clipped at N; the buffer's previous store must have read it first), a
        ragged one (``c_rows`` < BLOCK_M) by masked stores. Where the error word is set (by
        a failed wait anywhere, this tile's included: its slots were never loaded) NaN over
        the tile instead, masked to C's rows and columns (``tile_gemm._poison``): a call that
        returns before its error is raised returns NaN where it may have had no data, never
        C's old values. The word is read here, after the K loop, or (``GIVEN``) as the caller
        read it (``bad``: ``ahead``'s read in the tile's first K step, where a failure recorded
        later by another tile leaves this one's right values; the 192-column tile's one read
        for both its parts). Either way the partition's threads decide together
        (``_partition_error``). A dead tile (``c_rows`` <= 0: a row cut) stores nothing."""
        # (constexpr branches spelled out: Triton 3.6's Gluon front end emitted the NaN store of
        # a flag that stayed a Python int, and its build of that failed)
        if c_rows > 0:
            if HAS_WAIT:
                if GIVEN:
                    failed = bad
                else:
                    failed = _partition_error(err_ptr, WARPS)
                if failed != 0:
                    _poison(c_ptr, acc_layout, c_row, c_rows, off_n, N, stride_cm, BLOCK_M, BLOCK_N)
                else:
                    _store(acc, acc_layout, c_smem, c_desc, c_ptr, c_row, c_rows, off_n, N, stride_cm, BLOCK_M,
                           BLOCK_N, ACTIVATION)
            else:
                _store(acc, acc_layout, c_smem, c_desc, c_ptr, c_row, c_rows, off_n, N, stride_cm, BLOCK_M, BLOCK_N,
                       ACTIVATION)

    @gluon.jit
    def _epilogue_regs(acc, acc_layout: gl.constexpr, c_ptr, err_ptr, c_row, c_rows, off_n, N, stride_cm,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_WAIT: gl.constexpr,
                       ACTIVATION: gl.constexpr, GIVEN: gl.constexpr, bad, WARPS: gl.constexpr):
        """``_epilogue`` by masked stores from registers, whole tiles too (no C tile in shared
        memory: ``GluonGemmConfig.tma_epilogue=False``); NaN after a failed wait as there."""
        if c_rows > 0:
            if HAS_WAIT:
                if GIVEN:
                    failed = bad
                else:
                    failed = _partition_error(err_ptr, WARPS)
                if failed != 0:
                    _poison(c_ptr, acc_layout, c_row, c_rows, off_n, N, stride_cm, BLOCK_M, BLOCK_N)
                else:
                    _masked(_activate(acc, c_ptr, ACTIVATION), acc_layout, c_ptr, c_row, c_rows, off_n, N,
                            stride_cm, BLOCK_M, BLOCK_N)
            else:
                _masked(_activate(acc, c_ptr, ACTIVATION), acc_layout, c_ptr, c_row, c_rows, off_n, N, stride_cm,
                        BLOCK_M, BLOCK_N)

    @gluon.jit
    def _poison(c_ptr, acc_layout: gl.constexpr, c_row, c_rows, off_n, N, stride_cm, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr):
        """NaN over a tile's rows and columns of C (masked stores)."""
        offs = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        mask = gl.expand_dims(offs < c_rows, 1) & gl.expand_dims(cols < N, 0)
        ptrs = c_ptr + gl.expand_dims((c_row + offs).to(gl.int64) * stride_cm, 1) + gl.expand_dims(cols, 0)
        nan = gl.full([BLOCK_M, BLOCK_N], float("nan"), gl.float32, layout=acc_layout)
        gl.store(ptrs, nan.to(c_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _activate(acc, c_ptr, ACTIVATION: gl.constexpr):
        """The activation, then C's dtype."""
        if ACTIVATION == 1:
            acc = 0.5 * acc * (1.0 + gl.erf(acc * 0.7071067811865476))
        return acc.to(c_ptr.dtype.element_ty)

    @gluon.jit
    def _masked(out, acc_layout: gl.constexpr, c_ptr, c_row, c_rows, off_n, N, stride_cm, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr):
        """``out`` into C's rows ``c_row`` .. + ``c_rows`` by masked stores of each thread's own
        elements (the generic proxy: a later release by one thread of the partition, after a
        barrier of its threads, publishes them, as ``tile_gemm``'s posts)."""
        offs = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        mask = gl.expand_dims(offs < c_rows, 1) & gl.expand_dims(cols < N, 0)
        ptrs = c_ptr + gl.expand_dims((c_row + offs).to(gl.int64) * stride_cm, 1) + gl.expand_dims(cols, 0)
        gl.store(ptrs, out, mask=mask)

    @gluon.jit
    def _staged(out, c_smem, c_ptr, c_row, c_rows, off_n, N, stride_cm, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
        """``out`` into C's rows ``c_row`` .. + ``c_rows`` through shared memory: the MMA layout
        into ``c_smem``, a barrier of the partition, then ``_masked`` from a layout of 8 adjacent
        elements per thread (16-byte stores, a warp's on adjacent columns). The caller's
        barrier before its post also keeps the next tile's ``c_smem.store`` behind every
        thread's loads."""
        gl.static_assert(BLOCK_N == 128 or BLOCK_N == 256, "staged stores: a warp's row of 8-element "
                         "pieces is 128 or 256 columns")
        c_smem.store(out)
        _c.thread_barrier()
        TPW_N: gl.constexpr = BLOCK_N // 8
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_N, TPW_N], [num_warps, 1], [1, 0])
        _masked(c_smem.load(layout), layout, c_ptr, c_row, c_rows, off_n, N, stride_cm, BLOCK_M, BLOCK_N)

    @gluon.jit
    def _store(acc, acc_layout: gl.constexpr, c_smem, c_desc, c_ptr, c_row, c_rows, off_n, N, stride_cm,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, ACTIVATION: gl.constexpr):
        """Activation, then the tile into C."""
        out = _activate(acc, c_ptr, ACTIVATION)
        if c_rows >= BLOCK_M:
            _c.tma.store_wait(0)
            c_smem.store(out)
            _c.fence_async_shared()
            _c.tma_store(c_desc, [c_row, off_n], c_smem)
        else:
            _masked(out, acc_layout, c_ptr, c_row, c_rows, off_n, N, stride_cm, BLOCK_M, BLOCK_N)

    @gluon.jit
    def _mma(a_bufs, b_bufs, ready, empty, tq, tq_ready, tq_empty, c_smem, c_desc, c_ptr, table_ptr, flags_ptr,
             err_ptr, ws_ptr, sk_ptr, N, K, num_tiles, stride_cm, rows_cap, rows_span, num_units, split_from,
             split_q, split_r,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
             B_KN: gl.constexpr, HAS_WAIT: gl.constexpr, ACTIVATION: gl.constexpr, DYNAMIC: gl.constexpr,
             CLIP: gl.constexpr, POST: gl.constexpr, TMA_C: gl.constexpr, AHEAD: gl.constexpr, SPLIT: gl.constexpr,
             num_warps: gl.constexpr):
        """The MMA warpgroups (the default partition): the K loop on wgmma with one MMA in
        flight, then the epilogue. With ``POST`` (a producer's tiles) each tile's C is stored
        by masked stores, and once every thread of the partition has stored (a barrier of its
        threads) one thread adds 1 to the tile's post flag with release semantics at GPU
        scope: whoever acquires the count sees the tile (``tile_gemm``'s posts). A dead tile
        (a row cut) stores nothing and still counts: the flag's waiters expect every tile.
        ``SPLIT`` (``split_tail``): a K slice of a tail tile ends in ``_fixup``; only the last
        slice to arrive runs the tile's epilogue (a dead tile's slices skip both)."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        pid = gl.program_id(0)
        num_progs = gl.num_programs(0)
        k_tiles = gl.cdiv(K, BLOCK_K)
        cnt = 0
        j = 0
        if DYNAMIC:
            t = _take_tile(tq, tq_ready, tq_empty, j, num_warps)
        else:
            t = pid
        while t < num_units:
            tt = t  # (the tile of unit t; its K steps k0 .. k1)
            k0 = 0
            k1 = k_tiles
            if SPLIT:
                tt, k0, k1, sp_i, sp_n, sp_base, sp_s = _unit(t, split_from, split_q, split_r, k_tiles)
            row = table_ptr + tt * _TABLE_COLS
            c_row = gl.load(row + _COL_C_ROW)
            c_rows = gl.load(row + _COL_C_ROWS)
            if CLIP:
                c_row, c_rows = _cut_rows(c_row, c_rows, rows_cap, rows_span)
            off_n = gl.load(row + _COL_N_TILE) * BLOCK_N
            acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
            bad = 0
            for ki in range(k0, k1):
                s = cnt % STAGES
                mbarrier.wait(ready.index(s), (cnt // STAGES) & 1)
                if B_KN:
                    b_op = b_bufs.index(s)
                else:
                    b_op = b_bufs.index(s).permute((1, 0))
                acc = _c.warpgroup_mma(a_bufs.index(s), b_op, acc, is_async=True)
                if AHEAD and HAS_WAIT:
                    bad = _first_step_error(err_ptr, ki, bad, num_warps)
                acc = _c.warpgroup_mma_wait(1, deps=(acc,))
                # the MMA of the step before is done: its slot goes back to the loader
                mbarrier.arrive(empty.index((cnt + STAGES - 1) % STAGES), count=1, pred=ki > k0)
                cnt += 1
            acc = _c.warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index((cnt + STAGES - 1) % STAGES), count=1, pred=k1 > k0)
            last = 1
            if SPLIT:
                if tt >= split_from:
                    if c_rows > 0:
                        acc, last = _fixup(acc, acc_layout, ws_ptr, sk_ptr, sp_i, sp_n, sp_base, sp_s, BLOCK_M,
                                           BLOCK_N)
                    else:
                        last = 0
            if POST:
                if c_rows > 0:
                    if TMA_C:  # (a C tile in shared memory: coalesced stores through it)
                        _staged(_activate(acc, c_ptr, ACTIVATION), c_smem, c_ptr, c_row, c_rows, off_n, N, stride_cm,
                                BLOCK_M, BLOCK_N, num_warps)
                    else:
                        _masked(_activate(acc, c_ptr, ACTIVATION), acc_layout, c_ptr, c_row, c_rows, off_n, N,
                                stride_cm, BLOCK_M, BLOCK_N)
                p_idx = gl.load(row + _COL_POST)
                _c.thread_barrier()
                if p_idx >= 0:
                    gl.atomic_add(flags_ptr + p_idx, 1, sem="release", scope="gpu")
            elif TMA_C:
                if last != 0:
                    _epilogue(acc, acc_layout, c_smem, c_desc, c_ptr, err_ptr, c_row, c_rows, off_n, N, stride_cm,
                              BLOCK_M, BLOCK_N, HAS_WAIT, ACTIVATION, AHEAD, bad, num_warps)
            else:
                if last != 0:
                    _epilogue_regs(acc, acc_layout, c_ptr, err_ptr, c_row, c_rows, off_n, N, stride_cm, BLOCK_M,
                                   BLOCK_N, HAS_WAIT, ACTIVATION, AHEAD, bad, num_warps)
            j += 1
            if DYNAMIC:
                t = _take_tile(tq, tq_ready, tq_empty, j, num_warps)
            else:
                t += num_progs
        if TMA_C and not POST:
            _c.tma.store_wait(0)

    @gluon.jit(do_not_specialize=_PER_CALL)
    def gluon_gemm_kernel(a_desc, a2_desc, b_desc, c_desc, c_ptr, table_ptr, flags_ptr, err_ptr, counter_ptr,
                          ws_ptr, sk_ptr, N, K, num_tiles, epoch, rank, timeout_ns, stride_cm, rows_cap, rows_span,
                          num_units, split_from, split_q, split_r,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                          STAGES: gl.constexpr, B_KN: gl.constexpr, HAS_A2: gl.constexpr, HAS_WAIT: gl.constexpr,
                          ACTIVATION: gl.constexpr, DYNAMIC: gl.constexpr, LOADER_REGS: gl.constexpr,
                          WS_LIST: gl.constexpr, CLIP: gl.constexpr, POST: gl.constexpr, TMA_C: gl.constexpr,
                          AHEAD: gl.constexpr, SPLIT: gl.constexpr, num_warps: gl.constexpr):
        dtype: gl.constexpr = a_desc.dtype
        gl.static_assert(not (POST and HAS_WAIT), "a tile posts or waits here, not both")
        gl.static_assert(not (SPLIT and (POST or AHEAD)), "split tails neither post nor read ahead")
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        if TMA_C:  # (a TMA store's C tile; with POST, the tile's stores staged through it)
            c_smem = gl.allocate_shared_memory(c_desc.dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
        else:  # (C by masked stores: a token buffer, never written)
            c_smem = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # the tile queue (DYNAMIC): two int32 slots and their barriers
        tq = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        tq_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        tq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(tq_ready.index(i), count=1)
            mbarrier.init(tq_empty.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            # one arrival: the compiler puts a barrier of the partition's warps before an
            # arrive and lets one thread do it, so both warpgroups' wgmma waits precede it
            mbarrier.init(empty.index(i), count=1)
        # (the argument tuples are written inline: a tuple bound to a name turns its
        # constexprs into tensors; only the list form of Triton 3.6 and later)
        gl.static_assert(WS_LIST, "the Gluon GEMM needs gl.warp_specialize's list form (Triton 3.6+)")
        if WS_LIST:
            gl.warp_specialize([
                (_mma, (a_bufs, b_bufs, ready, empty, tq, tq_ready, tq_empty, c_smem, c_desc, c_ptr, table_ptr,
                        flags_ptr, err_ptr, ws_ptr, sk_ptr, N, K, num_tiles, stride_cm, rows_cap, rows_span, num_units,
                        split_from, split_q, split_r, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, B_KN, HAS_WAIT, ACTIVATION,
                        DYNAMIC, CLIP, POST, TMA_C, AHEAD, SPLIT, num_warps)),
                (_loader, (a_desc, a2_desc, b_desc, b_desc, table_ptr, flags_ptr, err_ptr, counter_ptr, a_bufs,
                           b_bufs, b_bufs, ready, empty, tq, tq_ready, tq_empty, K, num_tiles, epoch, rank,
                           timeout_ns, rows_cap, rows_span, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, B_KN, HAS_A2,
                           HAS_WAIT, DYNAMIC, CLIP, False, 1, AHEAD, num_units, split_from, split_q, split_r,
                           SPLIT)),
            ], [1], [LOADER_REGS])


    @gluon.jit
    def _mma_pp(a_bufs, b_bufs, ready, empty, turn, tq, tq_ready, tq_empty, c_smem, c_desc, c_ptr, table_ptr,
                err_ptr, N, K, num_tiles, stride_cm, rows_cap, rows_span,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                B_KN: gl.constexpr, HAS_WAIT: gl.constexpr, ACTIVATION: gl.constexpr, DYNAMIC: gl.constexpr,
                CLIP: gl.constexpr, WG: gl.constexpr, AHEAD: gl.constexpr):
        """One of the two ping-pong MMA warpgroups: the program's tiles WG, WG + 2, ...

        Its n-th tile is the program's tile j = 2n + WG, whose K steps are ring uses
        j * k_tiles ... Before its first ring wait it waits its turn (the other warpgroup has
        taken all of tile j - 1's slots, so every ring phase before this tile's has been
        seen complete: a parity wait cannot be satisfied by a phase two uses old); once it
        has taken its own last slot it passes the turn, and runs its epilogue while the
        other's K loop runs."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        pid = gl.program_id(0)
        num_progs = gl.num_programs(0)
        k_tiles = gl.cdiv(K, BLOCK_K)
        c_buf = c_smem.index(WG)
        n = 0
        # the program's tiles j = 2n + WG: with DYNAMIC its queue slot is always WG
        if DYNAMIC:
            t = _take_tile(tq, tq_ready, tq_empty, WG, 4)
        else:
            t = pid + WG * num_progs
        while t < num_tiles:
            row = table_ptr + t * _TABLE_COLS
            c_row = gl.load(row + _COL_C_ROW)
            c_rows = gl.load(row + _COL_C_ROWS)
            if CLIP:
                c_row, c_rows = _cut_rows(c_row, c_rows, rows_cap, rows_span)
            off_n = gl.load(row + _COL_N_TILE) * BLOCK_N
            cnt = (2 * n + WG) * k_tiles
            # warpgroup 0 waits for phase n - 1 of its turn barrier (none at n = 0: parity 1
            # passes on a fresh barrier), warpgroup 1 for phase n of its own
            mbarrier.wait(turn.index(WG), (n & 1) ^ (1 - WG))
            acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
            bad = 0
            for ki in range(k_tiles):
                s = cnt % STAGES
                mbarrier.wait(ready.index(s), (cnt // STAGES) & 1)
                if B_KN:
                    b_op = b_bufs.index(s)
                else:
                    b_op = b_bufs.index(s).permute((1, 0))
                acc = _c.warpgroup_mma(a_bufs.index(s), b_op, acc, is_async=True)
                if AHEAD and HAS_WAIT:
                    bad = _first_step_error(err_ptr, ki, bad, 4)
                acc = _c.warpgroup_mma_wait(1, deps=(acc,))
                mbarrier.arrive(empty.index((cnt + STAGES - 1) % STAGES), count=1, pred=ki > 0)
                cnt += 1
            mbarrier.arrive(turn.index(1 - WG), count=1)
            acc = _c.warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index((cnt + STAGES - 1) % STAGES), count=1, pred=k_tiles > 0)
            _epilogue(acc, acc_layout, c_buf, c_desc, c_ptr, err_ptr, c_row, c_rows, off_n, N, stride_cm,
                      BLOCK_M, BLOCK_N, HAS_WAIT, ACTIVATION, AHEAD, bad, 4)
            n += 1
            if DYNAMIC:
                t = _take_tile(tq, tq_ready, tq_empty, 2 * n + WG, 4)
            else:
                t += 2 * num_progs
        _c.tma.store_wait(0)

    @gluon.jit(do_not_specialize=_PER_CALL)
    def gluon_gemm_pp_kernel(a_desc, a2_desc, b_desc, c_desc, c_ptr, table_ptr, flags_ptr, err_ptr, counter_ptr,
                             N, K, num_tiles, epoch, rank, timeout_ns, stride_cm, rows_cap, rows_span,
                             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                             STAGES: gl.constexpr, B_KN: gl.constexpr, HAS_A2: gl.constexpr,
                             HAS_WAIT: gl.constexpr, ACTIVATION: gl.constexpr, DYNAMIC: gl.constexpr,
                             LOADER_REGS: gl.constexpr, MMA_REGS: gl.constexpr, WS_LIST: gl.constexpr,
                             CLIP: gl.constexpr, AHEAD: gl.constexpr, num_warps: gl.constexpr):
        """``gluon_gemm_kernel`` with two MMA warpgroups in ping-pong (``_mma_pp``): the
        default partition is warpgroup 0, a worker partition of 4 warps warpgroup 1."""
        dtype: gl.constexpr = a_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [2, BLOCK_M, BLOCK_N], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # the tile queue (DYNAMIC): two int32 slots and their barriers
        tq = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        tq_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        tq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(tq_ready.index(i), count=1)
            mbarrier.init(tq_empty.index(i), count=1)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        # (three partitions of two signatures: only the list form of Triton 3.6 and later)
        gl.static_assert(WS_LIST, "the ping-pong kernel needs gl.warp_specialize's list form (Triton 3.6+)")
        if WS_LIST:
            gl.warp_specialize([
                (_mma_pp, (a_bufs, b_bufs, ready, empty, turn, tq, tq_ready, tq_empty, c_smem, c_desc, c_ptr,
                           table_ptr, err_ptr, N, K, num_tiles, stride_cm, rows_cap, rows_span, BLOCK_M, BLOCK_N,
                           BLOCK_K, STAGES, B_KN, HAS_WAIT, ACTIVATION, DYNAMIC, CLIP, 0, AHEAD)),
                (_mma_pp, (a_bufs, b_bufs, ready, empty, turn, tq, tq_ready, tq_empty, c_smem, c_desc, c_ptr,
                           table_ptr, err_ptr, N, K, num_tiles, stride_cm, rows_cap, rows_span, BLOCK_M, BLOCK_N,
                           BLOCK_K, STAGES, B_KN, HAS_WAIT, ACTIVATION, DYNAMIC, CLIP, 1, AHEAD)),
                (_loader, (a_desc, a2_desc, b_desc, b_desc, table_ptr, flags_ptr, err_ptr, counter_ptr, a_bufs,
                           b_bufs, b_bufs, ready, empty, tq, tq_ready, tq_empty, K, num_tiles, epoch, rank,
                           timeout_ns, rows_cap, rows_span, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, B_KN, HAS_A2,
                           HAS_WAIT, DYNAMIC, CLIP, False, 2, AHEAD, num_tiles, num_tiles, 1, 0, False)),
            ], [4, 1], [MMA_REGS, LOADER_REGS])


    @gluon.jit
    def _mma_wide(a_bufs, b_bufs, b1_bufs, ready, empty, tq, tq_ready, tq_empty, c_smem, c1_smem, c_desc, c1_desc,
                  c_ptr, table_ptr, err_ptr, N, K, num_tiles, stride_cm, rows_cap, rows_span,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                  B_KN: gl.constexpr, HAS_WAIT: gl.constexpr, ACTIVATION: gl.constexpr, DYNAMIC: gl.constexpr,
                  CLIP: gl.constexpr, AHEAD: gl.constexpr, num_warps: gl.constexpr):
        """``_mma`` of a 192-column tile: two accumulators (the tile's first 128 columns and
        its last 64), two wgmmas a K step on the same A slot (both in flight until the next
        step's issue: the wait leaves the two just issued), two epilogues."""
        BN1: gl.constexpr = BLOCK_N - 128
        l0: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, 128, 16])
        l1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BN1, 16])
        pid = gl.program_id(0)
        num_progs = gl.num_programs(0)
        k_tiles = gl.cdiv(K, BLOCK_K)
        cnt = 0
        j = 0
        if DYNAMIC:
            t = _take_tile(tq, tq_ready, tq_empty, j, num_warps)
        else:
            t = pid
        while t < num_tiles:
            row = table_ptr + t * _TABLE_COLS
            c_row = gl.load(row + _COL_C_ROW)
            c_rows = gl.load(row + _COL_C_ROWS)
            if CLIP:
                c_row, c_rows = _cut_rows(c_row, c_rows, rows_cap, rows_span)
            off_n = gl.load(row + _COL_N_TILE) * BLOCK_N
            acc0 = gl.zeros((BLOCK_M, 128), dtype=gl.float32, layout=l0)
            acc1 = gl.zeros((BLOCK_M, BN1), dtype=gl.float32, layout=l1)
            bad = 0
            for ki in range(k_tiles):
                s = cnt % STAGES
                mbarrier.wait(ready.index(s), (cnt // STAGES) & 1)
                if B_KN:
                    b0 = b_bufs.index(s)
                    b1 = b1_bufs.index(s)
                else:
                    b0 = b_bufs.index(s).permute((1, 0))
                    b1 = b1_bufs.index(s).permute((1, 0))
                acc0 = _c.warpgroup_mma(a_bufs.index(s), b0, acc0, is_async=True)
                acc1 = _c.warpgroup_mma(a_bufs.index(s), b1, acc1, is_async=True)
                if AHEAD and HAS_WAIT:
                    bad = _first_step_error(err_ptr, ki, bad, num_warps)
                acc0, acc1 = _c.warpgroup_mma_wait(2, deps=(acc0, acc1))
                # both MMAs of the step before are done: its slot goes back to the loader
                mbarrier.arrive(empty.index((cnt + STAGES - 1) % STAGES), count=1, pred=ki > 0)
                cnt += 1
            acc0, acc1 = _c.warpgroup_mma_wait(0, deps=(acc0, acc1))
            mbarrier.arrive(empty.index((cnt + STAGES - 1) % STAGES), count=1, pred=k_tiles > 0)
            if HAS_WAIT and not AHEAD:  # (one read for both parts: the tile NaN or right whole)
                if c_rows > 0:
                    bad = _partition_error(err_ptr, num_warps)
            _epilogue(acc0, l0, c_smem, c_desc, c_ptr, err_ptr, c_row, c_rows, off_n, N, stride_cm,
                      BLOCK_M, 128, HAS_WAIT, ACTIVATION, True, bad, num_warps)
            if off_n + 128 < N:  # (the last 64 columns of the last column tile may lie past N)
                _epilogue(acc1, l1, c1_smem, c1_desc, c_ptr, err_ptr, c_row, c_rows, off_n + 128, N, stride_cm,
                          BLOCK_M, BN1, HAS_WAIT, ACTIVATION, True, bad, num_warps)
            j += 1
            if DYNAMIC:
                t = _take_tile(tq, tq_ready, tq_empty, j, num_warps)
            else:
                t += num_progs
        _c.tma.store_wait(0)

    @gluon.jit(do_not_specialize=_PER_CALL)
    def gluon_gemm_wide_kernel(a_desc, a2_desc, b_desc, b1_desc, c_desc, c1_desc, c_ptr, table_ptr, flags_ptr,
                               err_ptr, counter_ptr, N, K, num_tiles, epoch, rank, timeout_ns, stride_cm, rows_cap,
                               rows_span, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                               STAGES: gl.constexpr, B_KN: gl.constexpr, HAS_A2: gl.constexpr,
                               HAS_WAIT: gl.constexpr, ACTIVATION: gl.constexpr, DYNAMIC: gl.constexpr,
                               LOADER_REGS: gl.constexpr, WS_LIST: gl.constexpr, CLIP: gl.constexpr,
                               AHEAD: gl.constexpr, num_warps: gl.constexpr):
        """``gluon_gemm_kernel`` on 192-column tiles (``GluonGemmConfig.wide``): B and C each
        as a 128-column and a 64-column TMA tile (``b_desc``/``b1_desc``, ``c_desc``/``c1_desc``),
        two accumulators in the MMA warpgroups (``_mma_wide``); the loader, the flags, the
        error word, the dispatch counter and the row cut as there."""
        dtype: gl.constexpr = a_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        b1_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b1_desc.block_type.shape, b1_desc.layout)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, [BLOCK_M, 128], c_desc.layout)
        c1_smem = gl.allocate_shared_memory(c1_desc.dtype, [BLOCK_M, BLOCK_N - 128], c1_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        tq = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        tq_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        tq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(tq_ready.index(i), count=1)
            mbarrier.init(tq_empty.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        gl.static_assert(WS_LIST, "the Gluon GEMM needs gl.warp_specialize's list form (Triton 3.6+)")
        gl.static_assert(BLOCK_N == 192, "the wide kernel's tile is 192 columns (128 + 64)")
        if WS_LIST:
            gl.warp_specialize([
                (_mma_wide, (a_bufs, b_bufs, b1_bufs, ready, empty, tq, tq_ready, tq_empty, c_smem, c1_smem, c_desc,
                             c1_desc, c_ptr, table_ptr, err_ptr, N, K, num_tiles, stride_cm, rows_cap, rows_span,
                             BLOCK_M, BLOCK_N, BLOCK_K, STAGES, B_KN, HAS_WAIT, ACTIVATION, DYNAMIC, CLIP,
                             AHEAD, num_warps)),
                (_loader, (a_desc, a2_desc, b_desc, b1_desc, table_ptr, flags_ptr, err_ptr, counter_ptr, a_bufs,
                           b_bufs, b1_bufs, ready, empty, tq, tq_ready, tq_empty, K, num_tiles, epoch, rank,
                           timeout_ns, rows_cap, rows_span, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, B_KN, HAS_A2,
                           HAS_WAIT, DYNAMIC, CLIP, True, 1, AHEAD, num_tiles, num_tiles, 1, 0, False)),
            ], [1], [LOADER_REGS])


def _gl_dtype(dt: torch.dtype) -> Any:
    gl = _c.gl
    table = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
    if dt not in table:
        raise ValueError(f"gluon_gemm: operands must be bfloat16 or float16, got {dt}")
    return table[dt]


@functools.lru_cache(maxsize=64)
def _smem_layout(rows: int, cols: int, dt: torch.dtype) -> Any:
    """The shared-memory layout of a [rows, cols] TMA tile (made once: a few microseconds each)."""
    return _c.gl.NVMMASharedLayout.get_default_for([rows, cols], _gl_dtype(dt))


def _gluon_desc(t: torch.Tensor, block: list[int]) -> Any:
    """The Gluon TMA descriptor of ``t`` in ``block`` tiles (``_launch.HostDesc.triton``)."""
    return _c.TensorDescriptor.from_tensor(t, list(block), _smem_layout(block[0], block[1], t.dtype))


def _b_block(config: GluonGemmConfig, b_kn: bool, cols: int) -> list[int]:
    """The TMA tile of B for ``cols`` of a tile's columns."""
    return [config.block_k, cols] if b_kn else [cols, config.block_k]


def _col_parts(config: GluonGemmConfig) -> tuple[int, ...]:
    """The column widths of a tile's B and C TMA tiles: the tile's, or (``wide``) 128 and the rest."""
    return (128, config.block_n - 128) if config.wide else (config.block_n,)


def descriptors(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, config: GluonGemmConfig,
                a2: torch.Tensor | None = None) -> tuple[Any, ...]:
    """TMA descriptors of A (and A2), B and C, and whether B is read as row-major [K, N]
    (``b`` itself) or as the [N, K] storage of an ``nn.Linear`` weight (``b = w.t()``):
    ``(a, a2, b, c, b_kn)``; for a ``wide`` config B and C come as two descriptors each
    (a tile's first 128 columns, then the rest): ``(a, a2, b, b1, c, c1, b_kn)``, the
    kernel's order."""
    TD = _c.TensorDescriptor
    bm, bk = config.block_m, config.block_k
    a_layout = _smem_layout(bm, bk, a.dtype)
    a_desc = TD.from_tensor(a, [bm, bk], a_layout)
    a2_desc = TD.from_tensor(a2, [bm, bk], a_layout) if a2 is not None else a_desc
    b_kn = not (b.stride(0) == 1 and b.stride(1) == b.shape[0]) and b.stride(1) == 1
    b_store = b if b_kn else b.t()  # [K, N], or the [N, K] row-major weight
    bs, cs = [], []
    for cols in _col_parts(config):
        blk = _b_block(config, b_kn, cols)
        bs.append(TD.from_tensor(b_store, blk, _smem_layout(blk[0], blk[1], b.dtype)))
        cs.append(TD.from_tensor(c, [bm, cols], _smem_layout(bm, cols, c.dtype)))
    return (a_desc, a2_desc, *bs, *cs, b_kn)


def launch_gluon_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, table: torch.Tensor, *,
                      grid: int, a2: torch.Tensor | None = None, flags: torch.Tensor | None = None,
                      err: torch.Tensor | None = None, epoch: int = 0, rank: int = 0,
                      timeout_ns: int = 2_000_000_000, activation: int = 0, counter: torch.Tensor | None = None,
                      config: GluonGemmConfig | None = None, rows: tuple[int, int] | None = None,
                      post: bool = False) -> None:
    """Run the tiles of ``table`` (``overlap.policies.build_tile_table``'s int32 [T, 8]) on
    ``grid`` programs: ``c[c_row + i, n] = (a2 if a_src else a)[a_row + i, :] @ b[:, n]``.

    ========  =============================================  =========================
    tensor    shape                                          notes
    ========  =============================================  =========================
    a, a2     [M_a, K], row-major                            bf16 / fp16
    b         [K, N]: ``w.t()`` of a [N, K] weight, or       read in place
              row-major [K, N]
    c         [M, N], row-major, a's dtype
    flags     int32 [F]                                      with ``err``: tiles wait
    err       int32 [8] (``overlap.protocol`` error word)
    ========  =============================================  =========================

    With ``flags`` a tile whose wait column is >= 0 waits for ``flags[w] >= epoch * mult``
    (its loader warp only). ``counter``: an int32 [1] device tensor, zero before the call's
    first launch: tiles are then handed out in table order by an atomic add on it (each
    program's loader takes the next and passes it to its MMA warps), so a second launch,
    on other SMs or behind a stream wait, can join the same table. Without it program p runs
    rows p, p + grid, ... ``rows=(cap, span)``: the table was made for C rows in blocks of
    ``span`` and this call's blocks hold ``cap <= span`` (``tile_gemm.launch_tile_gemm``'s
    ``rows``, C rows only): a tile's rows are cut at its block's end, and a tile with none
    left neither waits nor stores. ``post`` (a plain config, ``flags`` and no ``err``): each
    tile then adds 1 to ``flags[post column]`` (none where it is negative) once its C rows are
    stored, with release semantics; a dead tile counts too. Raises ``RuntimeError`` where
    Gluon is missing (``REASON``)."""
    if not AVAILABLE:
        raise RuntimeError(f"gluon_gemm: {REASON}")
    if grid < 1:
        raise ValueError(f"gluon_gemm: grid must be >= 1, got {grid}")
    if config is not None and config.split_tail and counter is not None:
        raise ValueError("gluon_gemm: a split tail (split_tail) on a dispatch counter runs through one "
                         "GluonGemmPlan for every launch that shares the counter (its first launch fixes the "
                         "split); launch_gluon_gemm makes a plan per launch")
    plan = GluonGemmPlan(a, b, c, table, a2=a2, flags=flags, err=err, rank=rank, timeout_ns=timeout_ns,
                         activation=activation, counter=counter, config=config, clip=rows is not None, post=post)
    plan.launch(a, b, c, a2=a2, epoch=epoch, grid=grid, rows=rows)


def _capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` (a CUDA one) is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


SPLIT_MIN_STEPS = 4
"""K steps a slice of a split tail tile takes at least (``split_plan``)."""


def split_plan(num_tiles: int, grid: int, k_tiles: int) -> tuple[int, int, int, int] | None:
    """How ``GluonGemmConfig.split_tail`` splits ``num_tiles`` tiles of ``k_tiles`` K steps on
    ``grid`` programs: ``(split_from, q, r, num_units)``, the tiles from ``split_from`` on
    (the last wave's R) each in q or (the first r of them) q + 1 K slices, R * q + r units in
    the tail: ``grid``, or fewer where K caps q (slices of ``SPLIT_MIN_STEPS`` steps at
    least; r is then 0); None where nothing is split: the last wave is full or more
    than half full (q < 2), or K is too short for slices of ``SPLIT_MIN_STEPS`` steps."""
    if num_tiles <= 0 or grid <= 0 or k_tiles <= 0:
        return None
    tail = num_tiles % grid if num_tiles > grid else num_tiles
    if tail == 0:
        return None
    q = grid // tail
    r = grid % tail
    if k_tiles // SPLIT_MIN_STEPS < q + (r > 0):
        q, r = k_tiles // SPLIT_MIN_STEPS, 0
    if q < 2:
        return None
    start = num_tiles - tail
    return start, q, r, start + tail * q + r


class GluonGemmPlan:
    """``launch_gluon_gemm``'s checks, constexprs and launch key made once, for a GEMM an op
    launches call after call (``overlap.kernels.engine``): per launch only the operands'
    storage (their shapes and strides as the plan's; A's and C's row counts free with
    ``clip``), the epoch, the grid and the row cut change, and the kernel is launched
    through a prepared launch (no per-call argument binding by Triton). A ``split_tail``
    config's split is the first launch's (its grid); a later grid does not change it."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, table: torch.Tensor, *,
                 a2: torch.Tensor | None = None, flags: torch.Tensor | None = None, err: torch.Tensor | None = None,
                 rank: int = 0, timeout_ns: int = 2_000_000_000, activation: int = 0,
                 counter: torch.Tensor | None = None, config: GluonGemmConfig | None = None,
                 clip: bool = False, post: bool = False) -> None:
        if not AVAILABLE:
            raise RuntimeError(f"gluon_gemm: {REASON}")
        cfg = config or GluonGemmConfig()
        if post and (cfg.kind != "plain" or flags is None or err is not None):
            raise ValueError("gluon_gemm: posts (post=True) take a plain config (not ping-pong, not 192 columns) "
                             "and flags, and no error word: a tile that posts does not wait")
        if a.dim() != 2 or b.dim() != 2 or c.dim() != 2 or a.shape[1] != b.shape[0] or c.shape[1] != b.shape[1]:
            raise ValueError(f"gluon_gemm: shapes a {tuple(a.shape)}, b {tuple(b.shape)}, c {tuple(c.shape)} do "
                             "not make c = a @ b")
        if not (a.dtype == b.dtype == c.dtype) or (a2 is not None and a2.dtype != a.dtype):
            raise ValueError(f"gluon_gemm: dtypes differ: a {a.dtype}, b {b.dtype}, c {c.dtype}")
        _gl_dtype(a.dtype)
        if c.stride(1) != 1:
            raise ValueError(f"gluon_gemm: c must be row-major, got strides {c.stride()}")
        if table.dtype != torch.int32 or table.dim() != 2 or table.shape[1] != _p.TABLE_COLS:
            raise ValueError(f"gluon_gemm: table must be int32 [T, {_p.TABLE_COLS}], got {table.dtype} "
                             f"{tuple(table.shape)}")
        has_wait = flags is not None and not post
        if post and flags.dtype != torch.int32:
            raise ValueError(f"gluon_gemm: post flags must be int32, got {flags.dtype}")
        if has_wait and (err is None or flags.dtype != torch.int32 or err.dtype != torch.int32
                         or err.numel() < _p.ERR_WORDS):
            raise ValueError("gluon_gemm: flags need an int32 error word of 8 words (err)")
        dynamic = counter is not None
        if dynamic and (counter.dtype != torch.int32 or counter.numel() < 1 or counter.device != table.device):
            raise ValueError(f"gluon_gemm: counter must be an int32 tensor of >= 1 word on the table's device, "
                             f"got {counter.dtype} {tuple(counter.shape)} on {counter.device}")
        b_kn = not (b.stride(0) == 1 and b.stride(1) == b.shape[0]) and b.stride(1) == 1
        self.cfg, self.b_kn, self.clip, self.table = cfg, b_kn, bool(clip), table
        self.flags = flags if has_wait or post else table  # never read without waits or posts
        self.err = err if has_wait else table
        self.counter = counter if dynamic else table
        # 8 MMA warps + the loader's warpgroup: 384 threads share the 64 K registers of an SM;
        # the MMA partition(s) take what the loader's few leave (setmaxnreg)
        meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.stages, B_KN=b_kn,
                    HAS_A2=a2 is not None, HAS_WAIT=has_wait, ACTIVATION=int(activation), DYNAMIC=dynamic,
                    LOADER_REGS=cfg.loader_regs)
        if cfg.pingpong:
            meta["MMA_REGS"] = 232
        meta.update(WS_LIST=_c.WS_LIST_FORM, CLIP=bool(clip))
        if cfg.split_tail and post:
            raise ValueError("gluon_gemm: a split tail (split_tail) does not post")
        if cfg.kind == "plain":
            meta["POST"] = bool(post)
            meta["TMA_C"] = bool(cfg.tma_epilogue)
        meta["AHEAD"] = bool(cfg.ahead)
        if cfg.kind == "plain":
            meta["SPLIT"] = bool(cfg.split_tail)
        meta["num_warps"] = cfg.num_warps

        a2_ = a2 if a2 is not None else a
        b_store = b if b_kn else b.t()
        self.has_a2 = a2 is not None
        self.layouts = (self._rows_free(a), self._rows_free(a2_), (tuple(b_store.shape), tuple(b_store.stride())),
                        (c.shape[1], tuple(c.stride())))
        # what Triton specializes on beside the constexprs: dtypes, N, K and C's row stride (the
        # integers it does not skip), and, to be safe, the operands' row strides and B's layout
        key = (tuple(meta.values()), a.dtype, c.dtype, c.shape[1], a.shape[1], c.stride(0), a.stride(0),
               a2_.stride(0), tuple(b_store.shape), tuple(b_store.stride()))
        self.prepared = _LAUNCHERS[cfg.kind].prepare(key, meta, num_warps=cfg.num_warps,
                                                     options=(("maxnreg", 168),))
        self.head = (c.shape[1], a.shape[1], table.shape[0])
        self.tail = (int(rank), int(timeout_ns), c.stride(0))
        own = (table, self.flags, self.err, self.counter)
        self.own_aligned = not any(t.data_ptr() % 16 for t in own)
        self.k_tiles = -(-a.shape[1] // cfg.block_k)
        # the workspace argument where nothing is split: fp32 as the split's own, since the
        # kernel is compiled for the pointer's type and launched again by the key above for
        # another plan of the same key whose tail is split
        self.no_ws = torch.empty(1, dtype=torch.float32, device=table.device) if cfg.kind == "plain" else None
        self.split: tuple | None = None
        """(``split_tail``) the split fixed at the first launch: (grid, split_plan's tuple or
        None, workspace, arrival counts)."""

    def _rows_free(self, t: torch.Tensor) -> tuple:
        return (tuple(t.shape)[1:] if self.clip else tuple(t.shape), tuple(t.stride()))

    def launch(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, a2: torch.Tensor | None = None,
               epoch: int, grid: int, rows: tuple[int, int] | None = None) -> None:
        """Launch on the current stream (``launch_gluon_gemm``'s arguments)."""
        if (rows is not None) != self.clip:
            raise ValueError(f"gluon_gemm: rows=(cap, span) must be given {'with' if self.clip else 'without'} "
                             "the plan's clip")
        if rows is not None and not (isinstance(rows, tuple) and len(rows) == 2 and 1 <= rows[0] <= rows[1]):
            raise ValueError(f"gluon_gemm: rows must be (cap, span) with 1 <= cap <= span, got {rows!r}")
        if (a2 is not None) != self.has_a2:
            raise ValueError(f"gluon_gemm: the plan was made {'with' if self.has_a2 else 'without'} an a2")
        a2_ = a2 if a2 is not None else a
        b_store = b if self.b_kn else b.t()
        got = (self._rows_free(a), self._rows_free(a2_), (tuple(b_store.shape), tuple(b_store.stride())),
               (c.shape[1], tuple(c.stride())))
        if got != self.layouts:
            raise ValueError(f"gluon_gemm: operands (a, a2, b, c) laid out as {got}; the plan's are {self.layouts}")
        if self.table.shape[0] == 0:
            return
        if self.prepared.raw is not None:
            # the compiled kernel's C launcher called with the descriptors filled once per
            # pointer (``_launch._RawLaunch``): plain fields, no Gluon descriptor objects per call
            descs = self._host_descs(a, a2, b_store, c)
        else:
            descs = descriptors(a, b, c, self.cfg, a2)[:-1]
        nprog, args = self._args(descs, c, epoch, grid, rows)
        self.prepared.launch(nprog, args, aligned=(c,) if self.own_aligned else
                             (c, self.table, self.flags, self.err, self.counter))

    def _host_descs(self, a: torch.Tensor, a2: torch.Tensor | None, b_store: torch.Tensor,
                    c: torch.Tensor) -> tuple:
        """The descriptors' fields (``HostDesc``; the Gluon descriptor made of them where
        Triton's path is taken), in the kernel's order (``descriptors``); a2's is a's where
        there is none."""
        cfg, mk = self.cfg, _gluon_desc
        a_desc = HostDesc(a, a.shape, a.stride(), [cfg.block_m, cfg.block_k], mk)
        a2_desc = HostDesc(a2, a2.shape, a2.stride(), [cfg.block_m, cfg.block_k], mk) if a2 is not None else a_desc
        parts = _col_parts(cfg)
        bs = [HostDesc(b_store, b_store.shape, b_store.stride(), _b_block(cfg, self.b_kn, cols), mk) for cols in parts]
        cs = [HostDesc(c, c.shape, c.stride(), [cfg.block_m, cols], mk) for cols in parts]
        return (a_desc, a2_desc, *bs, *cs)

    def _args(self, descs: tuple, c: torch.Tensor, epoch: int, grid: int, rows: Any) -> tuple[int, tuple]:
        """(programs, the kernel's arguments) of a launch with these descriptors."""
        cap, span = rows if rows is not None else (1, 1)
        if self.cfg.kind != "plain":
            nprog = max(1, min(int(grid), self.table.shape[0]))
            return nprog, (*descs, c, self.table, self.flags, self.err, self.counter, *self.head, int(epoch),
                           *self.tail, int(cap), int(span))
        ws, sk, units, start, q, r = self._split_args(int(grid))
        nprog = max(1, min(int(grid), units))
        return nprog, (*descs, c, self.table, self.flags, self.err, self.counter, ws, sk, *self.head, int(epoch),
                       *self.tail, int(cap), int(span), units, start, q, r)

    def _split_args(self, grid: int) -> tuple:
        """(workspace, arrival counts, units, split_from, q, r) of a launch of the plain
        kernel: the split of the plan's first launch (``split_plan`` for its grid; none where
        that launch is captured in a CUDA graph), kept for the plan's life, so every launch of
        it (a give-back grid joining by the counter too, another grid later) cuts the tiles
        alike; the table's tiles whole where there is none. The workspace takes up to grid x
        BLOCK_M x BLOCK_N fp32 (16.5 MiB at 128x256 on 132 SMs) for the plan's life. The
        arrival counts are set back to 0 by each tile's last slice, not per call: a launch
        that runs only some of a tile's slices (a dispatch counter not zeroed before it)
        would leave them off for the launches after."""
        n = self.table.shape[0]
        if not self.cfg.split_tail:
            return self.no_ws, self.table, n, n, 1, 0
        if self.split is None:
            sp = split_plan(n, grid, self.k_tiles)
            if sp is not None and _capturing(self.table.device):
                # (a first launch inside a capture: its counts' zeroing would only be recorded, not
                # run, and an eager launch before the graph's first replay would read them unset;
                # such a plan stays unsplit for good)
                sp = None
            if sp is None:
                self.split = (grid, None, self.no_ws, self.table)
            else:
                start, q, r, units = sp
                dev = self.table.device
                ws = torch.empty((units - start) * self.cfg.block_m * self.cfg.block_n, dtype=torch.float32,
                                 device=dev)
                sk = torch.zeros(n - start, dtype=torch.int32, device=dev)
                self.split = (grid, sp, ws, sk)
        _g, sp, ws, sk = self.split
        if sp is None:
            return ws, sk, n, n, 1, 0
        start, q, r, units = sp
        return ws, sk, units, start, q, r

    def bind(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *, a2: torch.Tensor | None = None,
             epoch: int, grid: int, rows: tuple[int, int] | None = None) -> Any:
        """This plan's launch with every argument fixed but the storage of its tensors, for a
        call plan (``overlap.ops._calls``), as ``TileGemmPlan.bind``: a
        ``_launch.BoundLaunch`` called per call as ``bl(stream, (a, a2, b_store, c, None,
        None))`` with tensors of the shapes and strides given here (``b_store``: b, or
        ``b.t()`` where ``b_kn`` is False). None where it cannot be bound (the kernel not
        compiled and launched yet, another launcher form, an unaligned plan tensor, no tile,
        operands not of the plan's layouts): the caller keeps ``launch``."""
        if self.prepared.raw is None or not self.own_aligned or self.table.shape[0] == 0:
            return None
        if (rows is not None) != self.clip or (a2 is not None) != self.has_a2:
            return None
        b_store = b if self.b_kn else b.t()
        a2_ = a2 if a2 is not None else a
        if (self._rows_free(a), self._rows_free(a2_), (tuple(b_store.shape), tuple(b_store.stride())),
                (c.shape[1], tuple(c.stride()))) != self.layouts:
            return None
        from ._launch import BoundLaunch

        nprog, args = self._args(self._host_descs(a, a2, b_store, c), c, epoch, grid, rows)
        return BoundLaunch.of(self.prepared, nprog, args, (a, a2, b_store, c, None, None))


_LAUNCHERS: dict[str, Any] = {}
"""The kernels' cached launchers by ``GluonGemmConfig.kind`` (``overlap.kernels._launch``): a
launch of a kernel already built skips Triton's per-call argument binding (tens of
microseconds of host time)."""
if AVAILABLE:
    from ._launch import CachedLauncher as _CachedLauncher

    _LAUNCHERS.update({"plain": _CachedLauncher(gluon_gemm_kernel), "pp": _CachedLauncher(gluon_gemm_pp_kernel),
                       "wide": _CachedLauncher(gluon_gemm_wide_kernel)})
