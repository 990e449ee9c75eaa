"""Sync policies and tile schedules: which flag a consumer tile waits on, and in what order tiles run.

Pure Python (no GPU). The output is the *tile table* that
``overlap.kernels.tile_gemm`` walks, one int32 row per tile in schedule order:

    [a_row, a_src, c_row, c_rows, pid_n, wait_idx, wait_mult, post_idx]

The table is built from *row segments*: runs of output rows that share an A
source and a wait. A segment is cut into BLOCK_M-row tiles times the N tiles;
tiles never straddle segments (a segment's last tile masks its extra rows), so
a tile depends on exactly one flag.

Policies (cuSync's names, Jangda et al., CGO 2024):

    ChunkSync  consumer rows of collective chunk c wait on flags[c] >= epoch
               (flag written once per call by the communication stream)
    RowSync    consumer row block i waits on flags[i] >= epoch * n_tiles(producer)
               (each producer tile of row block i adds 1 when stored)

    TileSync   consumer tile of row block i waits, before K group j of its K loop,
               on flags[i * n_prod + j] >= epoch: the one producer tile (i, j) that
               wrote those K columns (``tilesync_chain_tables``; the GEMM's
               ``k_wait`` is the producer's BLOCK_N over the consumer's BLOCK_K)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from . import protocol as P

__all__ = [
    "Segment",
    "build_tile_table",
    "build_multi_tile_table",
    "table_tensor",
    "upload",
    "row_bucket",
    "plan_rows",
    "PLAN_ROWS_MIN",
    "split_rows",
    "split_tail",
    "tail_parts",
    "all_gather_layout",
    "AllGatherLayout",
    "all_gather_push_layout",
    "push_slot",
    "RowSync",
    "row_block_segments",
    "row_chunk_segments",
    "rowsync_chain_tables",
    "TileSync",
    "tilesync_chain_tables",
    "NO_FLAG",
]

NO_FLAG = -1


@dataclass(frozen=True)
class Segment:
    """Output rows [c_row, c_row + rows) computed from A_src rows [a_row, a_row + rows)."""

    a_src: int
    a_row: int
    c_row: int
    rows: int
    wait_idx: int = NO_FLAG
    wait_mult: int = 1
    post_base: int = NO_FLAG
    """First flag a producer tile of this segment posts to (+ its m-tile index), or NO_FLAG."""

    def __post_init__(self) -> None:
        if self.rows <= 0:
            raise ValueError(f"segment must have rows > 0, got {self.rows}")
        if min(self.a_row, self.c_row) < 0 or self.a_src not in (0, 1):
            raise ValueError(f"bad segment {self}")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


ROW_BUCKET_MIN = 128
"""The smallest row bucket (one tile row of the default GEMM config)."""


def row_bucket(rows: int) -> int:
    """The bucket of a row count: the next power of two, at least ``ROW_BUCKET_MIN``.

    Per-M state that costs a collective (the ranks' agreement check, growing the shared
    peer-copy buffers) is keyed or sized by this, not by M: a server whose token count
    changes every call pays it once per bucket (8 buckets from 1 to 16384 rows), and a
    buffer sized for a bucket holds at most twice the rows it must."""
    if rows <= 0:
        raise ValueError(f"rows must be positive, got {rows}")
    return max(ROW_BUCKET_MIN, 1 << (int(rows) - 1).bit_length())


PLAN_ROWS_MIN = 64
"""The smallest plan bucket (``plan_rows``)."""


def plan_rows(rows: int) -> int:
    """The rows a consumer op's plan is made for when M changes call to call: ``rows``
    rounded up to a multiple of 1/8 to 1/16 of its power-of-two ceiling (at least
    ``PLAN_ROWS_MIN``): 8 buckets per doubling, 48 from 1 to 16384 rows; a bucket is at
    most 1/8 larger than any M it holds above 512 rows, at most 63 rows larger below. The plan's tile table, chunks and launches
    serve every M of the bucket: the GEMM cuts its tiles at this call's rows
    (``launch_tile_gemm(rows=)``), and the tiles past them do nothing. Finer than
    ``row_bucket`` (what the ranks' agreement and the shared buffers are keyed or sized
    by) because a plan's slack is work: cut tiles and a chunk's rows sent padded."""
    if rows <= 0:
        raise ValueError(f"rows must be positive, got {rows}")
    step = max(PLAN_ROWS_MIN, 1 << max(0, (int(rows) - 1).bit_length() - 4))
    return -(-int(rows) // step) * step


def build_tile_table(segments: Sequence[Segment], n: int, block_m: int, block_n: int,
                     group_m: int = 8, *, array: bool = False) -> Any:
    """Tile rows for ``segments`` in the order given; inside a segment, groups of
    ``group_m`` row tiles sweep all N tiles (row tile fastest) for L2 reuse of B.

    Built with numpy: a new M makes a new table on the hot path of a server whose token
    count changes every call, and a Python loop over 2048 tiles took 6 ms where this
    takes a fraction of one. ``array``: an int32 ``numpy`` array [tiles, 8] (what the
    ops upload); else a list of lists."""
    import numpy as np

    if n <= 0 or block_m <= 0 or block_n <= 0 or group_m <= 0:
        raise ValueError("n, block_m, block_n, group_m must be positive")
    n_tiles = _cdiv(n, block_n)
    # every segment's fields as columns: the tiles of all segments are made in one pass (a
    # chain's table has one segment per row block: a pass per segment cost ~30 us each)
    seg = np.array([(g.a_src, g.a_row, g.c_row, g.rows, g.wait_idx, g.wait_mult, g.post_base) for g in segments],
                   dtype=np.int64).reshape(-1, 7)
    m_tiles = -(-seg[:, 3] // block_m)
    counts = m_tiles * n_tiles
    total = int(counts.sum())
    sid = np.repeat(np.arange(len(seg)), counts)  # each tile's segment
    local = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    mt = m_tiles[sid]
    # (group, column tile, row tile) order inside a segment: groups of group_m row tiles,
    # each sweeping every column tile with the row tile fastest; the last group may be short
    grp = local // (group_m * n_tiles)
    within = local - grp * group_m * n_tiles
    gsize = np.minimum(group_m, mt - grp * group_m)
    pnv = within // gsize
    pmv = grp * group_m + within % gsize
    off = pmv * block_m
    sv = seg[sid]
    table = np.empty((total, P.TABLE_COLS), dtype=np.int64)
    table[:, P.COL_A_ROW] = sv[:, 1] + off
    table[:, P.COL_A_SRC] = sv[:, 0]
    table[:, P.COL_C_ROW] = sv[:, 2] + off
    table[:, P.COL_C_ROWS] = np.minimum(block_m, sv[:, 3] - off)
    table[:, P.COL_N_TILE] = pnv
    table[:, P.COL_WAIT] = sv[:, 4]
    table[:, P.COL_WAIT_MULT] = sv[:, 5]
    table[:, P.COL_POST] = np.where(sv[:, 6] == NO_FLAG, NO_FLAG, sv[:, 6] + pmv)
    if array:
        return table.astype(np.int32)
    return table.tolist()


def build_multi_tile_table(segments: Sequence[Segment], ns: Sequence[int], block_m: int, block_n: int,
                           group_m: int = 8, *, array: bool = False) -> Any:
    """One table for the GEMMs of several weights that read the same A rows (Q, K and V;
    SwiGLU's gate and up), weight w having ``ns[w]`` columns: each tile's weight index
    sits in ``COL_N_TILE`` above its column tile (``protocol.N_TILE_BITS``).

    Order: the segments in runs of consecutive ones that wait on the same flag (the local
    rows; one chunk as it lands); for each run, weight 0's tiles, then weight 1's, ...;
    within a weight, ``build_tile_table``'s order (groups of ``group_m`` row tiles).
    So the first chunk to land feeds every weight before any tile waits on the next, and
    a weight's tiles wait on the same flags, with the same multipliers, as in its own
    table. One weight: ``build_tile_table``'s table, unchanged. Segments may not post
    (a tile's post would count once per weight)."""
    import numpy as np

    ns = [int(n) for n in ns]
    if not ns or min(ns) <= 0:
        raise ValueError(f"ns must be a non-empty list of positive column counts, got {ns}")
    if len(ns) == 1:
        return build_tile_table(segments, ns[0], block_m, block_n, group_m, array=array)
    if len(ns) > 1 << (31 - P.N_TILE_BITS):
        raise ValueError(f"at most {1 << (31 - P.N_TILE_BITS)} weights in one table, got {len(ns)}")
    if any(_cdiv(n, block_n) > P.N_TILE_MASK for n in ns):
        raise ValueError(f"a weight of {max(ns)} columns has more than {P.N_TILE_MASK} column tiles")
    if any(g.post_base != NO_FLAG for g in segments):
        raise ValueError("a table of several weights cannot post: a row block's post would count once per weight")
    waits = [(g.wait_idx, g.wait_mult) for g in segments]
    seg_run = np.cumsum([0] + [int(waits[i] != waits[i - 1]) for i in range(1, len(waits))])
    m_tiles = np.array([_cdiv(g.rows, block_m) for g in segments], dtype=np.int64)
    tables, runs, weight = [], [], []
    for w, n in enumerate(ns):
        t = build_tile_table(segments, n, block_m, block_n, group_m, array=True).astype(np.int64)
        t[:, P.COL_N_TILE] |= w << P.N_TILE_BITS
        tables.append(t)
        runs.append(np.repeat(seg_run, m_tiles * _cdiv(n, block_n)))
        weight.append(np.full(len(t), w, dtype=np.int64))
    table = np.concatenate(tables)
    # by run, then weight; a stable sort keeps each weight's own order inside a run
    order = np.lexsort((np.concatenate(weight), np.concatenate(runs)))
    table = table[order]
    if array:
        return table.astype(np.int32)
    return table.tolist()


_host_tables: Any = None
"""Device tables made by ``table_tensor`` (and runs of their rows made by ``table_rows``) ->
their rows on the host (torch's ``WeakIdKeyDictionary``: keyed by the tensor's identity, an
entry lives as long as its device tensor); ``host_table``."""
_host_lock = threading.Lock()


def _keep_host(t: Any, rows: Any) -> None:
    global _host_tables
    with _host_lock:
        if _host_tables is None:
            from torch.utils.weak import WeakIdKeyDictionary

            _host_tables = WeakIdKeyDictionary()
        _host_tables[t] = rows  # (another tensor object than t: the entry holds no reference to it)


def table_tensor(table: Any, device: Any) -> Any:
    """A tile table (list of rows or numpy array) as the int32 device tensor the GEMM reads.
    Its rows stay on the host too, for ``host_table`` (a table is never written after)."""
    import numpy as np
    import torch

    arr = np.array(table, dtype=np.int32).reshape(-1, P.TABLE_COLS)
    t = upload(arr, device)
    _keep_host(t, torch.from_numpy(arr))
    return t


def table_rows(table: Any, start: int, stop: int | None = None) -> Any:
    """``table[start:stop]``, its host rows kept as ``table_tensor`` keeps a table's (found by
    ``host_table`` also where the view has no ``_base``: one made in inference mode)."""
    view = table[start:stop]
    host = host_table(table)
    if host is not None:
        _keep_host(view, host[start:stop])
    return view


def host_table(t: Any) -> Any:
    """The host rows of a device table made by ``table_tensor`` or ``table_rows``, or of a run
    of its rows (a view ``table[i:j]``), without reading the device (a read there would wait
    for the stream and everything queued on it); None for any other tensor."""
    if _host_tables is None or t.dim() != 2:
        return None
    host = _host_tables.get(t)
    if host is not None:
        return host
    base = t._base if t._base is not None else t
    host = _host_tables.get(base)
    if host is None or t.dtype != host.dtype or t.stride() != (P.TABLE_COLS, 1):
        return None
    first, rem = divmod(t.data_ptr() - base.data_ptr(), P.TABLE_COLS * t.element_size())
    if rem or first < 0 or first + t.shape[0] > host.shape[0] or t.shape[1] != P.TABLE_COLS:
        return None
    return host[first:first + t.shape[0]]


def flat_groups(table: Any) -> Any:
    """The runs of table rows with one wait flag, wait multiple, post flag and A source, as
    int32 [G, 6] of (first row, end row, wait index, wait multiple, post index, A source)
    in table order: what ``GemmConfig.flatten``'s kernel waits and posts by (a program waits
    for a run's flag before its rows of the run, and adds their count to the run's post flag
    once they are stored). Raises ValueError when one post index has rows in two runs (the
    flag would then be complete only with its last run, which a per-run count cannot tell)."""
    import numpy as np

    rows = np.asarray(table, dtype=np.int32).reshape(-1, P.TABLE_COLS)
    if len(rows) == 0:
        return np.zeros((0, 6), dtype=np.int32)
    keys = rows[:, [P.COL_WAIT, P.COL_WAIT_MULT, P.COL_POST, P.COL_A_SRC]]
    starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]).any(axis=1)])
    ends = np.r_[starts[1:], len(rows)]
    post = keys[starts, 2]
    flagged = post[post >= 0]
    if len(np.unique(flagged)) != len(flagged):
        raise ValueError("flat_groups: a post index has rows in more than one run of the table")
    return np.stack([starts, ends, keys[starts, 0], keys[starts, 1], post, keys[starts, 3]], axis=1).astype(np.int32)


def upload(arr: Any, device: Any) -> Any:
    """A numpy array (or list) as a tensor on ``device``, queued on the current stream
    without making the host wait for the stream's earlier work.

    A copy from pageable host memory does make it wait (CUDA synchronizes the stream before
    a pageable host-to-device copy): a plan built on the hot path, as a server whose M
    changes every call builds one per call, would then hold the host until the GPU had
    run everything queued before, and the calls would run serialized. The array goes
    through a pinned block of PyTorch's caching host allocator instead, which keeps the
    block until the copy has run."""
    import numpy as np
    import torch

    t = torch.from_numpy(np.ascontiguousarray(arr))
    dev = torch.device(device)
    if dev.type != "cuda":
        return t.to(dev)
    staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    staged.copy_(t)
    return staged.to(dev, non_blocking=True)


def split_tail(table: list[list[int]], tiles: int, parts: int) -> tuple[list[list[int]], int | None]:
    """Split the last ``tiles`` rows of ``table`` into ``parts`` K pieces each: every such
    tile's row is repeated ``parts`` times in a row, and the GEMM (``launch_tile_gemm(split=)``)
    runs piece p of a tile over K steps [p * k / parts, (p + 1) * k / parts), the last piece
    to finish summing them (stream-K's fix-up, Osama et al., PPoPP 2023, in its simplest
    form: whole tiles, equal pieces). Returns (table, first split row), or (table, None)
    with nothing to split.

    Why: a tile is the unit of work, so the tiles that become ready last (those of the
    last chunk to land) or that are left over after the last full wave of the grid run
    on a part of the GPU while the rest idles; in pieces they spread over more SMs."""
    tiles = min(max(int(tiles), 0), len(table))
    if tiles == 0 or parts < 2:
        return table, None
    head_n = len(table) - tiles
    if not isinstance(table, list):  # a numpy table (``build_tile_table(array=True)``)
        import numpy as np

        return np.concatenate([table[:head_n], np.repeat(table[head_n:], parts, axis=0)]), head_n
    head = table[:head_n]
    return head + [list(r) for r in table[head_n:] for _ in range(parts)], head_n


def tail_parts(tail_tiles: int, sms: int, k_steps: int, max_parts: int) -> int:
    """K pieces per tail tile for ``split_tail``: as many as the tail's pieces can run on
    the ``sms`` SMs the GEMM holds at once (``sms // tail_tiles``), at most ``max_parts``
    and ``k_steps``; 1 (no split) when that is under 2 (no tail, or one that fills over
    half the SMs already)."""
    if tail_tiles <= 0:
        return 1
    parts = min(sms // tail_tiles, max_parts, k_steps)
    return parts if parts >= 2 else 1


def split_rows(rows: int, chunks: int, align: int = 1) -> list[int]:
    """Split ``rows`` into ``chunks`` sizes, each a multiple of ``align`` except the
    last, as equal as that allows; no chunk is empty (fewer chunks if needed)."""
    if rows <= 0 or chunks <= 0 or align <= 0:
        raise ValueError(f"rows, chunks, align must be positive (got {rows}, {chunks}, {align})")
    units = _cdiv(rows, align)
    chunks = min(chunks, units)
    base, extra = divmod(units, chunks)
    sizes = [(base + (1 if i < extra else 0)) * align for i in range(chunks)]
    sizes[-1] -= sum(sizes) - rows
    assert sum(sizes) == rows and all(s > 0 for s in sizes), sizes
    return sizes


@dataclass(frozen=True)
class AllGatherLayout:
    """Where a chunked all-gather puts rows, and the consumer's segments.

    The gathered buffer is chunk-major: chunk c of every rank lands by one NCCL
    all-gather as a contiguous block ``[R, rows_c, K]`` at row ``R * start_c``.
    The output C keeps the natural order: rank r's row i is C row ``r * m_shard + i``.
    """

    world: int
    rank: int
    m_shard: int
    chunk_rows: tuple[int, ...]
    segments: tuple[Segment, ...]
    natural: bool = False
    """The gathered buffer is in natural row order (``all_gather_push_layout``)."""

    @property
    def chunk_starts(self) -> tuple[int, ...]:
        out, s = [], 0
        for r in self.chunk_rows:
            out.append(s)
            s += r
        return tuple(out)

    def gathered_to_natural(self) -> list[int]:
        """Row permutation p with natural[i] = gathered[p[i]] (for return_gathered)."""
        if self.natural:
            return list(range(self.world * self.m_shard))
        perm = [0] * (self.world * self.m_shard)
        for start, rows in zip(self.chunk_starts, self.chunk_rows):
            for r in range(self.world):
                for i in range(rows):
                    perm[r * self.m_shard + start + i] = self.world * start + r * rows + i
        return perm


def all_gather_layout(world: int, rank: int, m_shard: int, chunks: int, block_m: int,
                      local_first: bool = True) -> AllGatherLayout:
    """Segments for ``all_gather(a_shard) @ b`` with ``chunks`` NCCL calls.

    Schedule: the local shard's rows first (A source 0 = the shard itself, no
    wait), then every peer's rows chunk by chunk in arrival order, waiting on
    flags[c]. Chunk sizes are multiples of ``block_m`` where possible so that
    few tiles are partial.
    """
    if not (0 <= rank < world):
        raise ValueError(f"rank {rank} outside [0, {world})")
    sizes = split_rows(m_shard, chunks, block_m)
    segs: list[Segment] = []
    if local_first:
        segs.append(Segment(a_src=0, a_row=0, c_row=rank * m_shard, rows=m_shard))
    start = 0
    for c, rows in enumerate(sizes):
        for step in range(1, world):
            r = (rank - step) % world  # ring order: the left neighbour's data lands first
            segs.append(Segment(a_src=1, a_row=world * start + r * rows, c_row=r * m_shard + start,
                                rows=rows, wait_idx=c, wait_mult=1))
        if not local_first:
            segs.append(Segment(a_src=1, a_row=world * start + rank * rows, c_row=rank * m_shard + start,
                                rows=rows, wait_idx=c, wait_mult=1))
        start += rows
    return AllGatherLayout(world, rank, m_shard, tuple(sizes), tuple(segs))


def all_gather_push_layout(world: int, rank: int, m_shard: int, chunks: int, align: int,
                           flag_stride: int | None = None) -> AllGatherLayout:
    """Segments for ``all_gather(a_shard) @ b`` when every peer *pushes* its chunks
    into this rank's buffer (copy engines, ``overlap._p2p``).

    The buffer is in natural row order: peer r's chunk c lands at rows
    ``r * m_shard + start_c`` and sets flags[r * flag_stride + c]. Each sender owns
    a fixed run of flags whatever the chunk count (``flag_stride``, default the chunk
    count), so a sender one call ahead with another chunking never writes a flag
    another sender's rows are waited on with. Schedule: the local shard
    first (A source 0, no wait), then chunk by chunk the peers in the order their
    pushes reach this rank (rank r pushes to r + 1, r + 2, ...: the left
    neighbour first).
    """
    if not (0 <= rank < world):
        raise ValueError(f"rank {rank} outside [0, {world})")
    sizes = split_rows(m_shard, chunks, align)
    stride = len(sizes) if flag_stride is None else flag_stride
    if stride < len(sizes):
        raise ValueError(f"flag_stride {stride} < {len(sizes)} chunks")
    segs: list[Segment] = [Segment(a_src=0, a_row=0, c_row=rank * m_shard, rows=m_shard)]
    start = 0
    for c, rows in enumerate(sizes):
        for step in range(1, world):
            r = (rank - step) % world
            segs.append(Segment(a_src=1, a_row=r * m_shard + start, c_row=r * m_shard + start, rows=rows,
                                wait_idx=r * stride + c, wait_mult=1))
        start += rows
    return AllGatherLayout(world, rank, m_shard, tuple(sizes), tuple(segs), natural=True)


def push_slot(sender: int, receiver: int, world: int) -> int:
    """Slot of ``sender``'s rows in ``receiver``'s buffer when every rank pushes to
    every other (one-shot all-reduce): 0 .. world - 2, the receiver's right
    neighbour in slot 0."""
    if sender == receiver or not (0 <= sender < world and 0 <= receiver < world):
        raise ValueError(f"no slot for sender {sender}, receiver {receiver} of {world}")
    return (sender - receiver - 1) % world


@dataclass(frozen=True)
class RowSync:
    """Consumer row block i waits until all ``producer_n_tiles`` tiles of producer row block i posted."""

    producer_n_tiles: int

    def wait(self, m_tile: int) -> tuple[int, int]:
        """(flag index, multiplier of the epoch) for consumer row block ``m_tile``."""
        return m_tile, self.producer_n_tiles


def row_block_segments(m: int, block_m: int, *, wait: "RowSync | TileSync | None" = None,
                       post: bool = False) -> list[Segment]:
    """One segment per BLOCK_M row block of an [m, *] GEMM (A source 0), with
    the policy's wait per block and/or a post to flag = row block index."""
    segs = []
    for i in range(_cdiv(m, block_m)):
        w_idx, w_mult = wait.wait(i) if wait is not None else (NO_FLAG, 1)
        segs.append(Segment(a_src=0, a_row=i * block_m, c_row=i * block_m,
                            rows=min(block_m, m - i * block_m), wait_idx=w_idx, wait_mult=w_mult,
                            post_base=i if post else NO_FLAG))
    return segs


def row_chunk_segments(m: int, chunks: int, block_m: int) -> tuple[list[int], list[Segment]]:
    """ChunkSync over the rows of an [m, *] GEMM whose A rows arrive in ``chunks``
    row chunks in order (e.g. a chunked all-reduce): chunk sizes (multiples of
    ``block_m`` except the last) and one segment per chunk, waiting on flags[c]."""
    sizes = split_rows(m, chunks, block_m)
    segs, start = [], 0
    for c, rows in enumerate(sizes):
        segs.append(Segment(a_src=0, a_row=start, c_row=start, rows=rows, wait_idx=c, wait_mult=1))
        start += rows
    return sizes, segs


def _row_blocks(m: int, n: int, block_m: int, block_n: int, *, wait: "RowSync | TileSync | None" = None,
                post: bool = False, group_m: int = 1) -> Any:
    """``build_tile_table(row_block_segments(m, block_m, wait=wait, post=post), n, block_m,
    block_n, array=True)`` without a segment per row block: one segment in ``group_m``
    order (1: a row block at a time), the per-block wait filled in after from each tile's
    row (the chain builds these per new M; 128 segment objects cost most of a millisecond)."""
    t = build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=m, post_base=0 if post else NO_FLAG)], n,
                         block_m, block_n, group_m=group_m, array=True)
    if wait is not None:
        first, mult = wait.wait(1)
        step = first - wait.wait(0)[0]  # flags per row block (both policies: affine in the block)
        t[:, P.COL_WAIT] = wait.wait(0)[0] + (t[:, P.COL_A_ROW] // block_m) * step
        t[:, P.COL_WAIT_MULT] = mult
    return t


def rowsync_chain_tables(m: int, f: int, n: int, block_m: int, prod_block_n: int,
                         cons_block_n: int, *, array: bool = False, prod_group_m: int = 1,
                         cons_group_m: int = 1) -> tuple[Any, Any]:
    """Tile tables of a producer GEMM [m, f] feeding a consumer GEMM [m, f] x [f, n]
    through RowSync: every producer tile posts once to flags[row block]; a consumer tile
    of row block i waits for flags[i] >= epoch * (producer N tiles). Each table in
    ``build_tile_table``'s order with its ``group_m`` (1: row-block order, a row block's
    N tiles, then the next's; more: groups of row blocks sweeping the N tiles together,
    B shared through L2, the flags the same). ``array``: numpy tables."""
    n_prod = _cdiv(f, prod_block_n)
    prod = _row_blocks(m, f, block_m, prod_block_n, post=True, group_m=prod_group_m)
    cons = _row_blocks(m, n, block_m, cons_block_n, wait=RowSync(n_prod), group_m=cons_group_m)
    return (prod, cons) if array else (prod.tolist(), cons.tolist())


@dataclass(frozen=True)
class TileSync:
    """Consumer tile of row block i reads K group j only after producer tile (i, j) posted.

    ``producer_n_tiles`` producer tiles per row block (of ``producer_block_n`` columns);
    the consumer's K step ``consumer_block_k`` must divide ``producer_block_n``."""

    producer_n_tiles: int
    producer_block_n: int
    consumer_block_k: int

    def __post_init__(self) -> None:
        if self.consumer_block_k <= 0 or self.producer_block_n % self.consumer_block_k:
            raise ValueError(f"TileSync: the consumer's BLOCK_K {self.consumer_block_k} must divide the "
                             f"producer's BLOCK_N {self.producer_block_n}")

    @property
    def k_wait(self) -> int:
        """Consumer K steps per producer tile (the GEMM's ``k_wait``)."""
        return self.producer_block_n // self.consumer_block_k

    def wait(self, m_tile: int) -> tuple[int, int]:
        """(first flag index, multiplier) for consumer row block ``m_tile``: K group j
        waits on the first index + j."""
        return m_tile * self.producer_n_tiles, 1

    def post(self, m_tile: int, n_tile: int) -> int:
        """Flag the producer tile (m_tile, n_tile) adds 1 to when stored."""
        return m_tile * self.producer_n_tiles + n_tile


def tilesync_chain_tables(m: int, f: int, n: int, block_m: int, prod_block_n: int, cons_block_n: int,
                          cons_block_k: int, *, array: bool = False, prod_group_m: int = 1,
                          cons_group_m: int = 1) -> tuple[Any, Any, TileSync]:
    """Tile tables of a producer GEMM [m, f] feeding a consumer [m, f] x [f, n]
    through TileSync: producer tile (i, j) posts once to flags[i * n_prod + j]; a
    consumer tile of row block i waits on flags[i * n_prod + j] >= epoch before its K
    steps over columns [j * prod_block_n, (j + 1) * prod_block_n) of the producer's
    output. Flags used: cdiv(m, block_m) * n_prod. Orders and ``array`` as in
    ``rowsync_chain_tables``."""
    n_prod = _cdiv(f, prod_block_n)
    pol = TileSync(n_prod, prod_block_n, cons_block_k)
    prod = _row_blocks(m, f, block_m, prod_block_n, post=True, group_m=prod_group_m)
    # post per tile (``TileSync.post``), not per row block
    prod[:, P.COL_POST] = prod[:, P.COL_POST] * n_prod + prod[:, P.COL_N_TILE]
    cons = _row_blocks(m, n, block_m, cons_block_n, wait=pol, group_m=cons_group_m)
    return (prod, cons, pol) if array else (prod.tolist(), cons.tolist(), pol)


def flatten(rows: Iterable[Iterable[int]]) -> list[int]:
    return [v for r in rows for v in r]
