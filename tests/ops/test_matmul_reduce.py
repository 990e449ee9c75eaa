"""The producer ops (GEMM -> reduce-scatter / all-reduce): their chunk maps and tile
tables, their reference path on gloo (2 and 4 ranks), and the producer GEMM's per-chunk
posts under the Triton interpreter."""

from __future__ import annotations

import itertools

import pytest
import torch

from overlap.ops.matmul_reduce import producer_table, reduce_scatter_layout
from tests._interp import interpreted
from tests._procs import REPO, run_ranks


@pytest.mark.parametrize("world,m,chunks", [(1, 256, 1), (2, 600, 2), (4, 1024, 3), (8, 8192, 4)])
@pytest.mark.parametrize("scatter", [True, False])
def test_chunk_map_covers_each_row_once(world: int, m: int, chunks: int, scatter: bool) -> None:
    cmap = reduce_scatter_layout(world, m, chunks, 128, scatter)
    ms = m // world if scatter else m
    assert sum(cmap.chunk_rows) == ms and cmap.chunk_starts[0] == 0
    assert all(r % 128 == 0 for r in cmap.chunk_rows[:-1])
    a_rows, c_rows = [], []
    for seg, c in cmap.segments:
        a_rows += range(seg.a_row, seg.a_row + seg.rows)
        c_rows += range(seg.c_row, seg.c_row + seg.rows)
    assert sorted(a_rows) == list(range(m)) and sorted(c_rows) == list(range(m))
    # chunks in schedule order, and a chunk's output rows one contiguous block
    order = [c for _, c in cmap.segments]
    assert order == sorted(order)
    for c, (start, rows) in enumerate(zip(cmap.chunk_starts, cmap.chunk_rows)):
        segs = [s for s, cc in cmap.segments if cc == c]
        lo = min(s.c_row for s in segs)
        assert sorted(r for s in segs for r in range(s.c_row, s.c_row + s.rows)) == \
            list(range(lo, lo + (world if scatter else 1) * rows))
        if scatter:  # destination d's rows of the chunk at block d of the chunk (NCCL's order)
            assert [(s.a_row, s.c_row) for s in segs] == [(d * ms + start, world * start + d * rows)
                                                          for d in range(world)]
            assert lo == world * start


def test_producer_table_posts_per_chunk() -> None:
    cmap = reduce_scatter_layout(2, 600, 2, 128)
    table, counts = producer_table(cmap, 300, 64, 128)
    assert counts == [24, 6] and len(table) == 30
    assert [row[7] for row in table] == [0] * 24 + [1] * 6
    assert all(row[5] < 0 for row in table)  # a producer waits on nothing


def test_bad_layouts() -> None:
    with pytest.raises(ValueError, match="multiple"):
        reduce_scatter_layout(3, 100, 1)


@pytest.mark.parametrize("world_size", [2, 4])
def test_producer_ops_gloo(world_size: int) -> None:
    procs = run_ranks(REPO / "tests" / "_matmul_reduce_worker.py", world_size, timeout_s=150)
    for p in procs:
        assert p.returncode == 0 and f"PASS matmul_reduce rank={p.rank}" in p.out, p


@interpreted
def test_producer_gemm_interpreted() -> None:
    """The producer GEMM under the interpreter: tiles in the chunk map's order, every tile
    posting its chunk's counter once (the counts the comm stream waits for), each
    segment's rows where the map puts them; new inputs per call."""
    from overlap.kernels.tile_gemm import GemmConfig, launch_tile_gemm
    from overlap.ops.matmul_reduce import producer_table, reduce_scatter_layout
    from overlap.policies import flat_groups

    g = torch.Generator().manual_seed(3)
    for (world, m, n, k, chunks, scatter), flatten in itertools.product(
            ((2, 80, 40, 32, 2, True), (3, 96, 24, 16, 3, True), (1, 50, 32, 48, 2, False)), (False, True)):
        # flatten: the producer GEMM as one software pipeline, posting per chunk (flat_groups)
        cfg = GemmConfig(block_m=16, block_n=16, block_k=16, num_stages=1, num_warps=4, flatten=flatten)
        for call in range(2):  # new inputs, the counters zeroed per call as the op does
            a = torch.randn(m, k, generator=g, dtype=torch.float16)
            w = torch.randn(n, k, generator=g, dtype=torch.float16)
            cmap = reduce_scatter_layout(world, m, chunks, 16, scatter)
            rows, counts = producer_table(cmap, n, cfg.block_m, cfg.block_n)
            table = torch.tensor(rows, dtype=torch.int32)
            flags = torch.zeros(len(counts), dtype=torch.int32)
            counter = torch.zeros(4, dtype=torch.int32)
            err = torch.zeros(8, dtype=torch.int32)
            c = torch.full((m, n), float("nan"), dtype=torch.float16)
            groups = torch.tensor(flat_groups(rows)) if flatten else None
            launch_tile_gemm(a, w.t(), c, table, flags=flags, err=err, epoch=1, grid=3, config=cfg, post=True,
                             counter=counter[0:1], groups=groups)
            assert flags.tolist() == counts, (flags.tolist(), counts)
            ref = a.double() @ w.double().t()
            for seg, ch in cmap.segments:
                got = c[seg.c_row:seg.c_row + seg.rows].double()
                want = ref[seg.a_row:seg.a_row + seg.rows]
                assert ((got - want).norm() / want.norm()).item() < 2e-3, (world, seg)


@pytest.mark.parametrize("m", [128, 1000, 2048, 4096 + 64, 16384])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 8])
def test_boundary_halves_chunk_alike(m: int, chunks: int) -> None:
    """matmul_all_reduce_matmul hands each chunk from the producer half (the all-reduce's
    chunk map) to the consumer half (all_reduce_matmul's row chunks): the two must cut M
    into the same row ranges, whatever the GEMM configs."""
    from overlap.ops import matmul_reduce as mr
    from overlap.policies import row_chunk_segments

    cmap = mr.reduce_scatter_layout(1, m, chunks, mr.CHUNK_ALIGN, scatter=False)
    sizes, segs = row_chunk_segments(m, chunks, mr.CHUNK_ALIGN)
    assert tuple(sizes) == cmap.chunk_rows
    assert [s.a_row for s in segs] == list(cmap.chunk_starts)
    assert sum(sizes) == m
