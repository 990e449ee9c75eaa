"""Pure logic of tile tables, chunk splits and the all-gather layout (no GPU)."""

from __future__ import annotations

import pytest

from overlap.policies import (NO_FLAG, RowSync, Segment, all_gather_layout, all_gather_push_layout,
                              build_tile_table, push_slot, row_block_segments, row_chunk_segments, split_rows,
                              split_tail, tail_parts)


@pytest.mark.parametrize("rows,chunks,align", [(1000, 3, 128), (512, 4, 128), (777, 4, 1), (100, 8, 64), (5, 5, 1)])
def test_split_rows_covers_exactly(rows: int, chunks: int, align: int) -> None:
    sizes = split_rows(rows, chunks, align)
    assert sum(sizes) == rows and all(s > 0 for s in sizes)
    assert len(sizes) <= chunks
    assert all(s % align == 0 for s in sizes[:-1])


def test_split_rows_rejects_bad_input() -> None:
    for bad in [(0, 2, 1), (10, 0, 1), (10, 2, 0)]:
        with pytest.raises(ValueError):
            split_rows(*bad)


def test_table_covers_every_output_element_once() -> None:
    m, n, bm, bn = 300, 200, 64, 64
    segs = [Segment(a_src=0, a_row=0, c_row=0, rows=130), Segment(a_src=1, a_row=500, c_row=130, rows=170, wait_idx=2)]
    table = build_tile_table(segs, n, bm, bn, group_m=2)
    seen = [[0] * n for _ in range(m)]
    for a_row, a_src, c_row, c_rows, pid_n, w_idx, w_mult, post in table:
        assert 0 < c_rows <= bm
        for i in range(c_rows):
            for j in range(pid_n * bn, min(n, pid_n * bn + bn)):
                seen[c_row + i][j] += 1
        # a tile never straddles segments: its wait is its segment's
        if c_row >= 130:
            assert (a_src, w_idx) == (1, 2) and a_row - 500 == c_row - 130
        else:
            assert (a_src, w_idx) == (0, NO_FLAG) and a_row == c_row
    assert all(v == 1 for row in seen for v in row)


def _loop_table(segments: list, n: int, bm: int, bn: int, gm: int) -> list[list[int]]:
    """The tile table as its definition reads, one tile at a time."""
    from overlap import protocol as P

    out = []
    for s in segments:
        mt = -(-s.rows // bm)
        for g0 in range(0, mt, gm):
            for pn in range(-(-n // bn)):
                for pm in range(g0, min(g0 + gm, mt)):
                    r = [0] * P.TABLE_COLS
                    r[P.COL_A_ROW], r[P.COL_A_SRC], r[P.COL_C_ROW] = s.a_row + pm * bm, s.a_src, s.c_row + pm * bm
                    r[P.COL_C_ROWS], r[P.COL_N_TILE] = min(bm, s.rows - pm * bm), pn
                    r[P.COL_WAIT], r[P.COL_WAIT_MULT] = s.wait_idx, s.wait_mult
                    r[P.COL_POST] = NO_FLAG if s.post_base == NO_FLAG else s.post_base + pm
                    out.append(r)
    return out


def test_table_matches_the_tile_by_tile_definition() -> None:
    """The vectorized builder (all segments in one numpy pass) against a loop over tiles:
    random segments, short last groups and tiles, list and array forms."""
    import random

    import numpy as np

    rng = random.Random(0)
    for _ in range(200):
        segs = [Segment(a_src=rng.randint(0, 1), a_row=rng.randint(0, 999), c_row=rng.randint(0, 999),
                        rows=rng.randint(1, 1500), wait_idx=rng.choice([NO_FLAG, rng.randint(0, 9)]),
                        wait_mult=rng.randint(1, 4), post_base=rng.choice([NO_FLAG, rng.randint(0, 50)]))
                for _ in range(rng.randint(0, 5))]
        n, bm, bn, gm = rng.randint(1, 2000), rng.choice([16, 64, 128]), rng.choice([32, 128, 256]), rng.randint(1, 9)
        want = _loop_table(segs, n, bm, bn, gm)
        assert build_tile_table(segs, n, bm, bn, gm) == want
        arr = build_tile_table(segs, n, bm, bn, gm, array=True)
        assert arr.dtype == np.int32 and arr.shape == (len(want), 8) and arr.tolist() == want


@pytest.mark.parametrize("m", [1, 100, 128, 129, 1000, 8191])
def test_chain_tables_are_the_row_block_segments_tables(m: int) -> None:
    """The chain's tables, built without a segment per row block, equal the tables of
    ``row_block_segments`` (RowSync and TileSync, the per-tile posts of TileSync)."""
    from overlap import protocol as P
    from overlap.policies import TileSync, rowsync_chain_tables, tilesync_chain_tables

    for f, n, bm, pbn, cbn, cbk in ((8192, 4096, 128, 256, 128, 64), (300, 200, 64, 64, 32, 32)):
        n_prod = -(-f // pbn)
        prod = build_tile_table(row_block_segments(m, bm, post=True), f, bm, pbn, array=True)
        cons = build_tile_table(row_block_segments(m, bm, wait=RowSync(n_prod)), n, bm, cbn, array=True)
        got = rowsync_chain_tables(m, f, n, bm, pbn, cbn, array=True)
        assert (got[0] == prod).all() and (got[1] == cons).all()
        assert rowsync_chain_tables(m, f, n, bm, pbn, cbn) == (prod.tolist(), cons.tolist())
        pol = TileSync(n_prod, pbn, cbk)
        prod[:, P.COL_POST] = prod[:, P.COL_POST] * n_prod + prod[:, P.COL_N_TILE]
        cons = build_tile_table(row_block_segments(m, bm, wait=pol), n, bm, cbn, array=True)
        tp, tc, tpol = tilesync_chain_tables(m, f, n, bm, pbn, cbn, cbk, array=True)
        assert (tp == prod).all() and (tc == cons).all() and tpol == pol


@pytest.mark.parametrize("group_m", [2, 8])
def test_chain_tables_in_group_order_keep_each_tiles_flags(group_m: int) -> None:
    """With a ``group_m`` the chain's tables hold the same tiles as in row-block order, in
    ``build_tile_table``'s grouped order, and every tile still waits on and posts to its
    own row block's (TileSync: its own tile's) flag."""
    from overlap import protocol as P
    from overlap.policies import rowsync_chain_tables, tilesync_chain_tables

    m, f, n, bm, pbn, cbn, cbk = 1000, 1280, 384, 64, 256, 128, 64
    n_prod = -(-f // pbn)
    rows = lambda t: sorted(map(tuple, t.tolist()))  # noqa: E731
    flat_p, flat_c = rowsync_chain_tables(m, f, n, bm, pbn, cbn, array=True)
    prod, cons = rowsync_chain_tables(m, f, n, bm, pbn, cbn, array=True, prod_group_m=group_m,
                                      cons_group_m=group_m)
    assert rows(prod) == rows(flat_p) and rows(cons) == rows(flat_c)
    assert prod.tolist() != flat_p.tolist()  # the order did change
    for t, width in ((prod, f), (cons, n)):
        want = build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], width, bm,
                                pbn if t is prod else cbn, group_m=group_m, array=True)
        assert (t[:, [P.COL_A_ROW, P.COL_N_TILE]] == want[:, [P.COL_A_ROW, P.COL_N_TILE]]).all()
    assert (prod[:, P.COL_POST] == prod[:, P.COL_A_ROW] // bm).all()
    assert (cons[:, P.COL_WAIT] == cons[:, P.COL_A_ROW] // bm).all() and (cons[:, P.COL_WAIT_MULT] == n_prod).all()
    tp, tc, pol = tilesync_chain_tables(m, f, n, bm, pbn, cbn, cbk, array=True, prod_group_m=group_m,
                                        cons_group_m=1)
    assert (tp[:, P.COL_POST] == tp[:, P.COL_A_ROW] // bm * n_prod + tp[:, P.COL_N_TILE]).all()
    assert (tc[:, P.COL_WAIT] == tc[:, P.COL_A_ROW] // bm * n_prod).all() and pol.k_wait == pbn // cbk
    assert rows(tc) == rows(tilesync_chain_tables(m, f, n, bm, pbn, cbn, cbk, array=True)[1])


def test_table_order_is_segment_order_then_grouped() -> None:
    segs = [Segment(a_src=0, a_row=0, c_row=0, rows=256), Segment(a_src=0, a_row=256, c_row=256, rows=128, wait_idx=0)]
    t = build_tile_table(segs, 256, 64, 128, group_m=2)
    # first segment: 4 row tiles x 2 col tiles, groups of 2 row tiles, row tile fastest
    assert [(r[2] // 64, r[4]) for r in t[:8]] == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert all(r[5] == 0 for r in t[8:]) and all(r[5] == NO_FLAG for r in t[:8])


@pytest.mark.parametrize("world,rank,ms,chunks", [(2, 0, 1000, 3), (2, 1, 512, 2), (4, 2, 777, 4), (4, 3, 128, 1)])
def test_all_gather_layout(world: int, rank: int, ms: int, chunks: int) -> None:
    lay = all_gather_layout(world, rank, ms, chunks, 128)
    assert sum(lay.chunk_rows) == ms
    # local shard first, from source 0, no wait
    first = lay.segments[0]
    assert (first.a_src, first.c_row, first.rows, first.wait_idx) == (0, rank * ms, ms, NO_FLAG)
    # every peer row appears once, waits on its own chunk, reads where NCCL puts it
    covered = set()
    for seg in lay.segments[1:]:
        c = seg.wait_idx
        start, rows = lay.chunk_starts[c], lay.chunk_rows[c]
        r = (seg.c_row - start) // ms
        assert r != rank and seg.c_row == r * ms + start and seg.rows == rows
        assert seg.a_row == world * start + r * rows  # chunk-major gathered buffer
        covered.update(range(seg.c_row, seg.c_row + seg.rows))
    assert covered == set(range(world * ms)) - set(range(rank * ms, (rank + 1) * ms))
    # chunks in arrival order: waits never go backwards
    waits = [s.wait_idx for s in lay.segments[1:]]
    assert waits == sorted(waits)
    # the permutation back to natural order is a bijection matching the layout
    perm = lay.gathered_to_natural()
    assert sorted(perm) == list(range(world * ms))
    for seg in lay.segments[1:]:
        assert perm[seg.c_row] == seg.a_row


@pytest.mark.parametrize("world,rank,ms,chunks", [(2, 0, 1000, 3), (2, 1, 512, 2), (4, 2, 777, 4), (8, 5, 128, 1)])
def test_all_gather_push_layout(world: int, rank: int, ms: int, chunks: int) -> None:
    lay = all_gather_push_layout(world, rank, ms, chunks, 128)
    n = len(lay.chunk_rows)
    assert lay.natural and lay.gathered_to_natural() == list(range(world * ms))
    first = lay.segments[0]
    assert (first.a_src, first.c_row, first.rows, first.wait_idx) == (0, rank * ms, ms, NO_FLAG)
    covered, flags = set(), []
    for seg in lay.segments[1:]:
        r, c = divmod(seg.wait_idx, n)  # one flag per sender and chunk
        assert r != rank and seg.a_src == 1
        assert seg.a_row == seg.c_row == r * ms + lay.chunk_starts[c] and seg.rows == lay.chunk_rows[c]
        covered.update(range(seg.c_row, seg.c_row + seg.rows))
        flags.append(seg.wait_idx)
    assert covered == set(range(world * ms)) - set(range(rank * ms, (rank + 1) * ms))
    assert len(set(flags)) == len(flags) == (world - 1) * n
    # chunk by chunk; within a chunk the left neighbour (whose first push is to this rank) first
    order = [divmod(f, n) for f in flags]
    assert [c for _, c in order] == sorted(c for _, c in order)
    assert [r for r, _ in order[:world - 1]] == [(rank - s) % world for s in range(1, world)]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_push_slot_is_a_bijection_per_receiver(world: int) -> None:
    for recv in range(world):
        slots = [push_slot(s, recv, world) for s in range(world) if s != recv]
        assert sorted(slots) == list(range(world - 1))
    assert push_slot((3 + 1) % world, 3 % world, world) == 0  # right neighbour in slot 0
    with pytest.raises(ValueError):
        push_slot(1, 1, world)


def test_overlap_config_transport_fields() -> None:
    from overlap.ops import OverlapConfig

    assert OverlapConfig().margin("nccl") == 4 and OverlapConfig().margin("p2p") == 0
    assert OverlapConfig(sm_margin=7).margin("p2p") == 7
    for bad in (dict(transport="ucx"), dict(reduce_ctas=0), dict(reduce_ctas=2000), dict(sm_margin=-1),
                dict(split_tail=-1), dict(split_tail=65)):
        with pytest.raises(ValueError):
            OverlapConfig(**bad)


def test_rowsync_segments_wait_and_post() -> None:
    segs = row_block_segments(300, 128, wait=RowSync(producer_n_tiles=5), post=True)
    assert [(s.c_row, s.rows, s.wait_idx, s.wait_mult, s.post_base) for s in segs] == [
        (0, 128, 0, 5, 0), (128, 128, 1, 5, 1), (256, 44, 2, 5, 2)]
    t = build_tile_table(segs, 256, 128, 128)
    assert [r[7] for r in t] == [0, 0, 1, 1, 2, 2]  # each producer tile posts to its row block


def test_tilesync_tables_post_per_tile_and_wait_per_k_group() -> None:
    from overlap.policies import TileSync, tilesync_chain_tables

    # producer [300, 640] in 128x256 tiles (3 row blocks x 3 column tiles, the last
    # 128 wide); consumer [300, 640] x [640, 256], BLOCK_K 64: 4 K steps per producer tile
    prod, cons, pol = tilesync_chain_tables(300, 640, 256, 128, 256, 128, 64)
    assert pol == TileSync(3, 256, 64) and pol.k_wait == 4
    # every producer tile posts to its own flag: row block * 3 + column tile
    assert sorted((r[2] // 128, r[4], r[7]) for r in prod) == [
        (i, j, 3 * i + j) for i in range(3) for j in range(3)]
    assert len({r[7] for r in prod}) == len(prod)
    # a consumer tile of row block i waits from flag 3 * i on (K group j: + j), once per call
    assert sorted({(r[2] // 128, r[5], r[6]) for r in cons}) == [(0, 0, 1), (1, 3, 1), (2, 6, 1)]
    # K group j of a consumer tile is exactly producer tile j's columns
    for j in range(3):
        cols = range(j * pol.k_wait * 64, min((j + 1) * pol.k_wait * 64, 640))
        assert all(c // 256 == j for c in cols)
    with pytest.raises(ValueError, match="must divide"):
        TileSync(3, 256, 96)


def test_segment_validation() -> None:
    with pytest.raises(ValueError):
        Segment(a_src=0, a_row=0, c_row=0, rows=0)
    with pytest.raises(ValueError):
        Segment(a_src=2, a_row=0, c_row=0, rows=4)
    with pytest.raises(ValueError):
        all_gather_layout(2, 2, 10, 1, 16)


@pytest.mark.parametrize("m,chunks", [(8192, 4), (1000, 3), (130, 4), (64, 2)])
def test_row_chunk_segments(m: int, chunks: int) -> None:
    sizes, segs = row_chunk_segments(m, chunks, 128)
    assert sum(sizes) == m and 1 <= len(sizes) <= chunks
    assert all(s % 128 == 0 for s in sizes[:-1])
    start = 0
    for c, (rows, seg) in enumerate(zip(sizes, segs)):
        # chunk c's rows read A and write C at the same rows, and wait on flag c (epoch x 1)
        assert (seg.a_src, seg.a_row, seg.c_row, seg.rows, seg.wait_idx, seg.wait_mult) == (0, start, start, rows, c, 1)
        start += rows
    t = build_tile_table(segs, 512, 128, 256)
    waits = [r[5] for r in t]
    assert waits == sorted(waits), "tiles run in chunk order"
    assert {r[0] for r in t} == set(range(0, m, 128))


def test_transport_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    from overlap.ops._runtime import _env_transport

    for v, want in (("", None), ("auto", None), ("NCCL", "nccl"), ("p2p", "p2p")):
        monkeypatch.setenv("OVERLAP_TRANSPORT", v)
        assert _env_transport() == want
    monkeypatch.setenv("OVERLAP_TRANSPORT", "shm")
    with pytest.raises(ValueError, match="OVERLAP_TRANSPORT"):
        _env_transport()


def test_push_layout_flag_stride() -> None:
    # each sender owns flags [r * stride, r * stride + chunks), whatever the chunking
    for chunks in (1, 3):
        lay = all_gather_push_layout(4, 1, 512, chunks, 128, flag_stride=8)
        n = len(lay.chunk_rows)
        assert sorted(s.wait_idx for s in lay.segments[1:]) == sorted(r * 8 + c for r in (0, 2, 3) for c in range(n))
    with pytest.raises(ValueError):
        all_gather_push_layout(2, 0, 512, 4, 128, flag_stride=2)


def test_runtime_transport_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    from overlap.ops import OverlapConfig
    from overlap.ops._runtime import Runtime

    monkeypatch.delenv("OVERLAP_TRANSPORT", raising=False)
    rt = object.__new__(Runtime)  # no device needed: the heap decision is pre-set
    rt._heap, rt._p2p_why = object(), ""
    assert rt.transport(OverlapConfig()) == "p2p"
    assert rt.transport(OverlapConfig(transport="nccl")) == "nccl"
    monkeypatch.setenv("OVERLAP_TRANSPORT", "nccl")
    assert rt.transport(OverlapConfig()) == "nccl"
    assert rt.transport(OverlapConfig(transport="p2p")) == "p2p"
    monkeypatch.delenv("OVERLAP_TRANSPORT")
    rt._heap, rt._p2p_why = None, "ranks on 2 hosts"
    assert rt.transport(OverlapConfig()) == "nccl"
    with pytest.raises(RuntimeError, match="ranks on 2 hosts"):
        rt.transport(OverlapConfig(transport="p2p"))


def test_split_tail_repeats_the_last_tiles_in_place():
    table = [[i] * 8 for i in range(5)]
    out, start = split_tail(table, 2, 3)
    assert start == 3
    assert [r[0] for r in out] == [0, 1, 2, 3, 3, 3, 4, 4, 4]  # a tile's pieces in a row, order kept
    assert out[3] is not out[4]  # rows are copies, not one list repeated
    assert split_tail(table, 0, 4) == (table, None)
    assert split_tail(table, 2, 1) == (table, None)
    assert split_tail(table, 9, 2)[1] == 0  # at most the whole table


@pytest.mark.parametrize("tail,sms,k_steps,max_parts,want", [
    (20, 132, 128, 8, 6),    # a last wave of 20 tiles on 132 SMs: 6 pieces each (120 running at once)
    (64, 132, 128, 8, 2),    # the last chunk of 64 tiles: 2 pieces
    (64, 132, 128, 1, 1),    # off
    (100, 132, 128, 8, 1),   # over half the SMs busy already: no split
    (0, 132, 128, 8, 1),     # no tail
    (4, 132, 3, 8, 3),       # no more pieces than K steps
    (4, 132, 1, 8, 1),
])
def test_tail_parts(tail, sms, k_steps, max_parts, want):
    assert tail_parts(tail, sms, k_steps, max_parts) == want


@pytest.mark.parametrize("k,want", [(8192, (2048, 2)), (12288, (2048, 2)), (1024, (1024, 4)), (100, (128, 8))])
def test_shared_reduce_shape(k, want):
    # the reduce kernel beside the GEMM: 4 warps over at most 4096 elements (few registers)
    pytest.importorskip("torch")
    from overlap.ops.all_reduce_p2p import shared_reduce_shape

    s = shared_reduce_shape(k)
    assert (s.block_k, s.rows, s.num_warps, s.y_rows) == (*want, 4, want[1])
