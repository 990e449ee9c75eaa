"""Stream-K order for the tile GEMM alone (``GemmConfig.stream_k``).

A persistent grid of G programs over T tiles of k K steps each runs ceil(T / G) waves; when
T is not a multiple of G the last wave leaves SMs idle (96 tiles on 132 SMs: 27% of the GPU
for the whole run). Stream-K (Osama, Merrill, Cecka, Garland, Ahmad: "Stream-K:
Work-centric Parallel Decomposition for Dense Matrix-Matrix Multiplication on the GPU",
PPoPP 2023) gives each program an equal, contiguous run of the T x k (tile, K step)
iterations, across tile boundaries, so every SM does the same work; a tile whose K steps
fall to several programs is summed from their fp32 partials.

As the paper's hybrid: the tiles of the last full wave and of the partial one (``T mod G +
G`` tiles when T > G; all T tiles when T <= G) run first, in stream-K order, each program
taking one contiguous run of their iterations; the tiles before them in the table then run
one per program per wave (data-parallel, one software pipeline over a program's tiles as in
``tile_gemm_flat_kernel``). Below one wave the grid is cut to ``MAX_PIECES`` programs per
tile, so no tile is summed from more partials than that (plus one).

A program's run holds at most two split pieces: the end of one tile (its run's first
piece) and the start of another (its last); the workspace holds two fp32 BLOCK_M x BLOCK_N
partials per program, slot ``2 p + 1`` for a piece that starts its tile, ``2 p`` for the
other.

The fix-up waits for nothing: every piece of a split tile stores its partial, then adds one
to the tile's counter (acq_rel, after a CTA barrier); the piece that counts last sums the
partials in piece order (the same bits whichever piece is last), stores the tile and sets
the counter back to 0. So no program spins on another (nothing to hang on, whatever else
holds the SMs), and the counters are zero again when the launch ends, with no memset per
launch.

The tile table is the GEMM's usual one (``overlap.policies.build_tile_table``: GROUP_M
order); its first rows are the stream-K tiles. No waits, posts, second A, split tail,
folded norm, several weights or row cut: the GEMM alone.
"""

from __future__ import annotations

import threading
from typing import Any

import triton
import triton.language as tl

from .. import protocol as _p
from ._launch import CachedLauncher as _CachedLauncher
from .tile_gemm import _epilogue, _kstep, _mainloop

__all__ = ["tile_gemm_streamk_kernel", "streamk_split", "launch_streamk", "MAX_PIECES"]

_TABLE_COLS = tl.constexpr(_p.TABLE_COLS)
_COL_A_ROW = tl.constexpr(_p.COL_A_ROW)
_COL_C_ROW = tl.constexpr(_p.COL_C_ROW)
_COL_C_ROWS = tl.constexpr(_p.COL_C_ROWS)
_COL_N_TILE = tl.constexpr(_p.COL_N_TILE)

MAX_PIECES = 4
"""Below one wave, programs per tile at most (the grid is cut to ``MAX_PIECES * T``)."""
FIX_M = 32
"""Rows of a tile the fix-up sums at a time (its registers: FIX_M x BLOCK_N fp32)."""


@triton.jit
def _run_of(it, base, extra):
    """The program whose run holds iteration ``it``: runs of ``base + 1`` iterations for
    the first ``extra`` programs, ``base`` for the others."""
    big = extra * (base + 1)
    return tl.where(it < big, it // (base + 1), extra + (it - big) // tl.maximum(base, 1))


@triton.jit(do_not_specialize=["num_tiles", "sk_tiles", "num_progs"])
def tile_gemm_streamk_kernel(
    a_desc, b_desc, c_ptr, table_ptr, ws_ptr, cnt_ptr,
    N, K, num_tiles, sk_tiles, num_progs, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, B_KN: tl.constexpr,
    ACTIVATION: tl.constexpr, UPCAST: tl.constexpr, FIX: tl.constexpr, FIXUP: tl.constexpr = 1,
    DP_FLAT: tl.constexpr = 1,
):
    """C = A @ B over ``table``: its first ``sk_tiles`` rows in stream-K order, the rest
    data-parallel (see the module's docstring). ``ws_ptr``: fp32, ``2 * num_progs *
    BLOCK_M * BLOCK_N``; ``cnt_ptr``: int32 [sk_tiles], zero at launch (and at exit)."""
    pid = tl.program_id(0)
    offs_i = tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, BLOCK_N)
    tile_elems: tl.constexpr = BLOCK_M * BLOCK_N
    k_tiles = tl.cdiv(K, BLOCK_K)
    total = sk_tiles * k_tiles
    base = total // num_progs
    extra = total % num_progs
    start = pid * base + tl.minimum(pid, extra)
    end = start + base + (pid < extra).to(tl.int32)
    it = start
    while it < end:
        tile = it // k_tiles
        t0 = tile * k_tiles
        k0 = it - t0
        k1 = tl.minimum(k_tiles, end - t0)
        row = table_ptr + tile * _TABLE_COLS
        a_row = tl.load(row + _COL_A_ROW)
        c_row = tl.load(row + _COL_C_ROW)
        c_rows = tl.load(row + _COL_C_ROWS)
        off_bn = tl.load(row + _COL_N_TILE) * BLOCK_N
        acc = _mainloop(a_desc, b_desc, a_row, off_bn, k0, k1, BLOCK_M, BLOCK_N, BLOCK_K, B_KN, UPCAST)
        cols = off_bn + offs_j
        if ((k0 == 0) & (k1 == k_tiles)) | (FIXUP == 0):
            _epilogue(acc, c_ptr, c_row + offs_i, offs_i < c_rows, cols, N, stride_cm, stride_cn, c_ptr, c_ptr,
                      False, ACTIVATION)
        else:
            first = _run_of(t0, base, extra)
            last = _run_of(t0 + k_tiles - 1, base, extra)
            slot = 2 * pid + (k0 == 0).to(tl.int32)
            tl.store(ws_ptr + slot.to(tl.int64) * tile_elems + offs_i[:, None] * BLOCK_N + offs_j[None, :], acc)
            # every thread's partial precedes the barrier; the release of the one thread's
            # scalar atomic publishes them, its acquire makes the other pieces' visible
            tl.debug_barrier()
            seen = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if seen == last - first:
                tl.debug_barrier()
                for r0 in tl.static_range(0, BLOCK_M, FIX):
                    offs_r = r0 + tl.arange(0, FIX)
                    tot = tl.zeros((FIX, BLOCK_N), dtype=tl.float32)
                    for q in range(first, last + 1):
                        qs = 2 * q + (q == first).to(tl.int32)
                        # .cg: from L2, where the other SMs' partials are (not a stale L1 line)
                        tot += tl.load(ws_ptr + qs.to(tl.int64) * tile_elems + offs_r[:, None] * BLOCK_N
                                       + offs_j[None, :], cache_modifier=".cg")
                    _epilogue(tot, c_ptr, c_row + offs_r, offs_r < c_rows, cols, N, stride_cm, stride_cn, c_ptr,
                              c_ptr, False, ACTIVATION)
                # this launch's pieces of the tile have all counted: the word is free again
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
        it = t0 + k1
    # the data-parallel tiles: rows sk_tiles + pid, + G, ... as one pipeline
    mine = tl.maximum(num_tiles - sk_tiles - pid + num_progs - 1, 0) // num_progs
    if DP_FLAT:
        for j in tl.range(0, mine, flatten=True):
            row = table_ptr + (sk_tiles + pid + j * num_progs) * _TABLE_COLS
            a_row = tl.load(row + _COL_A_ROW)
            c_row = tl.load(row + _COL_C_ROW)
            c_rows = tl.load(row + _COL_C_ROWS)
            off_bn = tl.load(row + _COL_N_TILE) * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                acc = _kstep(a_desc, b_desc, a_row, off_bn, ki, acc, BLOCK_K, B_KN, UPCAST)
            _epilogue(acc, c_ptr, c_row + offs_i, offs_i < c_rows, off_bn + offs_j, N, stride_cm, stride_cn, c_ptr,
                      c_ptr, False, ACTIVATION)
    else:
        for j in range(0, mine):
            row = table_ptr + (sk_tiles + pid + j * num_progs) * _TABLE_COLS
            a_row = tl.load(row + _COL_A_ROW)
            c_row = tl.load(row + _COL_C_ROW)
            c_rows = tl.load(row + _COL_C_ROWS)
            off_bn = tl.load(row + _COL_N_TILE) * BLOCK_N
            acc = _mainloop(a_desc, b_desc, a_row, off_bn, 0, k_tiles, BLOCK_M, BLOCK_N, BLOCK_K, B_KN, UPCAST)
            _epilogue(acc, c_ptr, c_row + offs_i, offs_i < c_rows, off_bn + offs_j, N, stride_cm, stride_cn, c_ptr,
                      c_ptr, False, ACTIVATION)


def streamk_split(num_tiles: int, grid: int) -> tuple[int, int]:
    """(programs, stream-K tiles) for ``num_tiles`` tiles on at most ``grid`` programs:
    below one wave every tile, on at most ``MAX_PIECES`` programs per tile; above it the
    last full wave and the partial one (``T mod G + G``), or none when the waves are full."""
    t, g = int(num_tiles), max(1, int(grid))
    if t <= g:
        return max(1, min(g, MAX_PIECES * t)), t
    rem = t % g
    return g, (rem + g if rem else 0)


class _Buffers:
    """A stream's workspace and counters (grown as needed; the counters zeroed once, when
    made: each launch leaves them zero). Two streams never share them, so two stream-K
    GEMMs may run at once on two streams; launches on one stream are ordered by it. A
    launch captured in a CUDA graph gets buffers of its own, kept for the life of the
    process (its zeroing is captured with it), so its replays share nothing with eager
    launches or other graphs."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.captured: list[Any] = []

    def get(self, device: Any, ws_elems: int, words: int) -> tuple[Any, Any]:
        import torch

        if torch.cuda.is_available() and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            ws = torch.empty(ws_elems, dtype=torch.float32, device=device)
            cnt = torch.zeros(words, dtype=torch.int32, device=device)
            with self.lock:
                self.captured += [ws, cnt]
            return ws, cnt
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (device.index if device.index is not None else -1, stream)
        with self.lock:
            got = self.by.get(key)
            if got is None or got[0].numel() < ws_elems or got[1].numel() < words:
                ws_n = max(ws_elems, got[0].numel() if got else 0)
                cnt_n = max(1 << max(words - 1, 0).bit_length(), 64, got[1].numel() if got else 0)
                got = self.by[key] = (torch.empty(ws_n, dtype=torch.float32, device=device),
                                      torch.zeros(cnt_n, dtype=torch.int32, device=device))
            return got


_buffers = _Buffers()
_launcher = _CachedLauncher(tile_gemm_streamk_kernel)


def launch_streamk(a: Any, b_store: Any, b_kn: bool, c: Any, table: Any, *, grid: int, config: Any,
                   activation: str | None, interp: bool, _sk_tiles: int | None = None, _fixup: int = 1,
                   _dp_flat: int = 1) -> None:
    """Launch ``tile_gemm_streamk_kernel`` on the current stream (``launch_tile_gemm`` with
    ``config.stream_k``, after its checks). The underscored arguments are for timing the
    kernel's parts (``benchmarks/diag/streamk_diag.py``): the stream-K tiles, the fix-up
    off (each piece stores its own sum as the tile: a wrong C), the data-parallel loop
    not flattened."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .tile_gemm import ACTIVATIONS

    cfg = config
    num_tiles = int(table.shape[0])
    if num_tiles == 0:
        return
    nprog, sk = streamk_split(num_tiles, grid)
    if _sk_tiles is not None:
        nprog, sk = max(1, min(int(grid), num_tiles)), int(_sk_tiles)
    fix = min(FIX_M, cfg.block_m)
    ws, cnt = _buffers.get(c.device, 2 * nprog * cfg.block_m * cfg.block_n, max(1, sk))
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
    b_desc = TensorDescriptor.from_tensor(b_store, [cfg.block_k, cfg.block_n] if b_kn
                                          else [cfg.block_n, cfg.block_k])
    meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, B_KN=bool(b_kn),
                ACTIVATION=ACTIVATIONS[activation], UPCAST=interp and str(a.dtype) == "torch.bfloat16", FIX=fix,
                FIXUP=int(_fixup), DP_FLAT=int(_dp_flat))
    key = ("streamk", tuple(meta.values()), a.dtype, b_store.dtype, c.dtype, table.dtype, c.shape[1], a.shape[1],
           c.stride(0), c.stride(1), a.stride(0), tuple(b_store.shape), tuple(b_store.stride()))
    args = (a_desc, b_desc, c, table, ws, cnt, c.shape[1], a.shape[1], num_tiles, sk, nprog, c.stride(0),
            c.stride(1))
    _launcher.launch(nprog, args, meta, key=key, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                     interpret=interp, aligned=(c, table, ws, cnt))
