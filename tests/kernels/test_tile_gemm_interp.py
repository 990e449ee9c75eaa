"""The tile-flag GEMM under the Triton interpreter: schedules, layouts, posts, waits and
their timeouts, the dispatch counter, the chain's syncs, split tails, counters that wrap.

Each test runs in a child process with TRITON_INTERPRET=1 (``tests._interp``)."""

from __future__ import annotations

import torch

from tests._interp import interpreted
from tests.kernels._interp_common import (CFG, ErrorWord, FlagProtocolError, FlagTimeoutError, GemmConfig, RowSync, Segment, TOL, _rel, _table, _torch_norm, all_gather_layout, build_tile_table, launch_add_norm, launch_reduce_norm, launch_tile_gemm, row_block_segments, row_chunk_segments, rowsync_chain_tables, split_tail, split_workspace, tilesync_chain_tables)


@interpreted
def test_schedules() -> None:
    """Any tile order, partial tiles, both B layouts, fp16 and fp32, two grid sizes."""
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float16, torch.float32):
        for (m, n, k) in [(40, 48, 32), (33, 24, 48)]:
            a = torch.randn(m, k, generator=g).to(dt)
            w = torch.randn(n, k, generator=g).to(dt)
            ref = a.double() @ w.double().t()
            table = _table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n)
            perm = torch.randperm(table.shape[0], generator=g)
            for b in (w.t(), w.t().contiguous()):
                for tab, grid in ((table, 3), (table[perm].contiguous(), 5)):
                    c = torch.full((m, n), float("nan"), dtype=dt)
                    launch_tile_gemm(a, b, c, tab, grid=grid, config=CFG)
                    assert not torch.isnan(c).any(), "an output element was not written"
                    assert _rel(c, ref) < TOL[dt], (dt, m, n, k, _rel(c, ref))
    # rows that TMA cannot address are refused with a clear error, not an assert
    w = torch.randn(20, 48, dtype=torch.float16)
    try:
        launch_tile_gemm(torch.randn(16, 48, dtype=torch.float16), w.t().contiguous(),
                         torch.empty(16, 20, dtype=torch.float16), _table([Segment(0, 0, 0, 16)], 20), grid=1,
                         config=CFG)
    except ValueError as e:
        assert "16-byte" in str(e), e
    else:
        raise AssertionError("misaligned B accepted")



@interpreted
def test_all_gather_layout() -> None:
    """Two A sources and the chunk-major gathered buffer map back to natural C rows."""
    g = torch.Generator().manual_seed(1)
    world, ms, k, n = 3, 37, 32, 24
    for rank in range(world):
        for chunks in (1, 2, 3):
            full = torch.randn(world * ms, k, generator=g, dtype=torch.float32)
            w = torch.randn(n, k, generator=g, dtype=torch.float32)
            lay = all_gather_layout(world, rank, ms, chunks, CFG.block_m)
            gathered = torch.empty_like(full)
            for start, rows in zip(lay.chunk_starts, lay.chunk_rows):
                for r in range(world):  # what NCCL's all-gather of chunk c writes
                    gathered[world * start + r * rows: world * start + (r + 1) * rows] = \
                        full[r * ms + start: r * ms + start + rows]
            perm = torch.tensor(lay.gathered_to_natural())
            assert torch.equal(gathered[perm], full)
            a_shard = full[rank * ms:(rank + 1) * ms].clone()
            flags = torch.full((4,), 5, dtype=torch.int32)  # every chunk landed in epoch 5
            err = torch.zeros(8, dtype=torch.int32)
            c = torch.full((world * ms, n), float("nan"))
            launch_tile_gemm(a_shard, w.t(), c, _table(lay.segments, n), a2=gathered, flags=flags, err=err,
                             epoch=5, grid=4, config=CFG, wait=True)
            assert err[0].item() == 0, err
            assert _rel(c, full.double() @ w.double().t()) < 1e-5, (rank, chunks)



@interpreted
def test_posts_and_gelu() -> None:
    """RowSync waits satisfied; every producer tile posts once to its row block; GeLU epilogue."""
    g = torch.Generator().manual_seed(2)
    m, n, k = 40, 48, 32
    a = torch.randn(m, k, generator=g, dtype=torch.float16)
    w = torch.randn(n, k, generator=g, dtype=torch.float16)
    n_tiles = 3
    segs = row_block_segments(m, CFG.block_m, wait=RowSync(producer_n_tiles=n_tiles), post=True)
    wait_flags = torch.full((8,), 4 * n_tiles, dtype=torch.int32)  # epoch 4 fully posted upstream
    err = torch.zeros(8, dtype=torch.int32)
    c = torch.empty(m, n, dtype=torch.float16)
    launch_tile_gemm(a, w.t(), c, _table(segs, n), flags=wait_flags, err=err, epoch=4, grid=2, config=CFG,
                     wait=True, post=True, activation="gelu")
    assert err[0].item() == 0
    # 3 row blocks x 3 column tiles: each row block's flag got exactly 3 posts
    assert wait_flags.tolist() == [4 * n_tiles + 3] * 3 + [4 * n_tiles] * 5, wait_flags
    ref = torch.nn.functional.gelu(a.double() @ w.double().t())
    assert _rel(c, ref) < 2e-3



@interpreted
def test_timeout() -> None:
    """A flag never posted (and one left from the previous epoch) ends in a clear error, not a hang."""
    g = torch.Generator().manual_seed(3)
    m, n, k = 32, 32, 16
    a = torch.randn(m, k, generator=g, dtype=torch.float32)
    w = torch.randn(n, k, generator=g, dtype=torch.float32)
    segs = [Segment(a_src=0, a_row=0, c_row=0, rows=16),  # ready
            Segment(a_src=0, a_row=16, c_row=16, rows=16, wait_idx=1)]
    for stale in (0, 6):  # 6 = the previous call's epoch: must not satisfy epoch 7
        flags = torch.tensor([0, stale], dtype=torch.int32)
        ew = ErrorWord("cpu", what="test op")
        c = torch.full((m, n), float("nan"))
        launch_tile_gemm(a, w.t(), c, _table(segs, n), flags=flags, err=ew.word, epoch=7, rank=3, grid=2,
                         config=CFG, wait=True, max_spins=200)
        try:
            ew.check()
        except FlagTimeoutError as e:
            assert (e.rank, e.flag_idx, e.expected, e.seen) == (3, 1, 7, stale), e
            assert "rank 3" in str(e) and "flag 1" in str(e)
        else:
            raise AssertionError("timeout not reported")
        assert torch.isnan(c[16:]).all(), "a tile that timed out stored numbers"
        assert ew.word.tolist() == [0] * 8, "the word is cleared once reported"
    # a flag one call ahead is fine (a peer may be one call ahead); two calls ahead
    # means the ranks are out of step: a protocol error, not "landed"
    for seen, bad in ((8, False), (9, True)):
        flags = torch.tensor([0, seen], dtype=torch.int32)
        ew = ErrorWord("cpu", what="test op")
        c = torch.full((m, n), float("nan"))
        launch_tile_gemm(a, w.t(), c, _table(segs, n), flags=flags, err=ew.word, epoch=7, rank=3, grid=1,
                         config=CFG, wait=True, max_spins=200)
        if not bad:
            ew.check()
            assert not torch.isnan(c).any()
            continue
        try:
            ew.check()
        except FlagProtocolError as e:
            assert (e.flag_idx, e.expected, e.seen) == (1, 7, 9) and "out of step" in str(e), e
        else:
            raise AssertionError("a flag two calls ahead was taken as landed")
        assert torch.isnan(c[16:]).all()
    # the p2p reduce kernel checks the same
    ew = ErrorWord("cpu", what="reduce")
    h = torch.full((4, 16), float("nan"))
    launch_reduce_norm(torch.ones(4, 16), torch.ones(1, 4, 16), h, starts=torch.tensor([0, 4], dtype=torch.int32),
                       rflags=torch.tensor([9], dtype=torch.int32), ready=torch.zeros(1, dtype=torch.int32),
                       err=ew.word, epoch=7, rank=0, world=2, programs=1, max_spins=50)
    try:
        ew.check()
    except FlagProtocolError as e:
        assert (e.flag_idx, e.expected, e.seen) == (0, 7, 9), e
    else:
        raise AssertionError("the reduce kernel took a flag two calls ahead as landed")
    assert torch.isnan(h).all()



@interpreted
def test_dispatch_counter() -> None:
    """Two launches share one table through the dispatch counter: every tile runs exactly once."""
    g = torch.Generator().manual_seed(4)
    m, n, k = 64, 64, 16
    a = torch.randn(m, k, generator=g, dtype=torch.float32)
    w = torch.randn(n, k, generator=g, dtype=torch.float32)
    segs = row_block_segments(m, CFG.block_m, post=True)
    flags = torch.zeros(8, dtype=torch.int32)
    err = torch.zeros(8, dtype=torch.int32)
    counter = torch.zeros(1, dtype=torch.int32)
    c = torch.full((m, n), float("nan"))
    tab = _table(segs, n)
    launch_tile_gemm(a, w.t(), c, tab, flags=flags, err=err, grid=2, config=CFG, post=True, counter=counter)
    launch_tile_gemm(a, w.t(), c, tab, flags=flags, err=err, grid=3, config=CFG, post=True, counter=counter)
    assert flags[:4].tolist() == [4, 4, 4, 4], flags  # 4 column tiles per row block, each once
    assert _rel(c, a.double() @ w.double().t()) < 1e-5



@interpreted
def test_row_chunks() -> None:
    """The all-reduce op's pipeline, one rank, no NCCL: chunks land one by one
    (add + norm, then a flag); each GEMM tile waits on its own chunk only. With
    the last chunk's flag never set, exactly that chunk's rows are NaN
    and the timeout names its flag."""
    g = torch.Generator().manual_seed(6)
    m, n, k, chunks = 70, 32, 48, 3
    x = torch.randn(m, k, generator=g, dtype=torch.float32)
    res = torch.randn(m, k, generator=g, dtype=torch.float32)
    w = torch.randn(k, generator=g, dtype=torch.float32)
    wb = torch.randn(n, k, generator=g, dtype=torch.float32)
    sizes, segs = row_chunk_segments(m, chunks, CFG.block_m)
    assert len(sizes) == chunks and sum(sizes) == m
    tab = _table(segs, n)
    for land in (chunks, chunks - 1):
        h, y = x.clone(), torch.zeros(m, k)  # finite: a tile that ran early would write numbers
        flags = torch.full((4,), 8, dtype=torch.int32)  # the previous call's epoch
        ew = ErrorWord("cpu", what="test op")
        start = 0
        for c_idx, rows in enumerate(sizes[:land]):
            launch_add_norm(h, start, rows, residual=res, norm="rmsnorm", weight=w, y=y, block_k=16)
            flags[c_idx] = 9
            start += rows
        c = torch.full((m, n), float("nan"))
        # the interpreter runs programs one after another, and a timeout stops
        # the rest of the grid: one program walks the table in schedule order
        # (chunk order), so every tile of a landed chunk runs before the stall
        launch_tile_gemm(y, wb.t(), c, tab, flags=flags, err=ew.word, epoch=9, rank=1,
                         grid=3 if land == chunks else 1, config=CFG, wait=True, max_spins=100)
        ref = _torch_norm(x + res, "rmsnorm", w, None, 1e-5).double() @ wb.double().t()
        done = sum(sizes[:land])
        assert _rel(c[:done], ref[:done]) < 1e-5
        if land == chunks:
            ew.check()
        else:
            assert torch.isnan(c[done:]).all(), "a tile of an unlanded chunk stored numbers"
            try:
                ew.check()
            except FlagTimeoutError as e:
                assert (e.flag_idx, e.expected, e.seen) == (chunks - 1, 9, 8), e
            else:
                raise AssertionError("timeout not reported")



@interpreted
def test_chain() -> None:
    """fc1 (GeLU epilogue, posts) -> fc2 (RowSync waits) through the chain's tables:
    the result matches torch; fc2 run before fc1 (the interpreter runs one kernel
    to the end before the next) times out on row block 0 instead of hanging,
    and the previous call's flags do not satisfy it. The second call runs both tables in
    grouped order (``group_m`` 2), as a tuned chain does."""
    g = torch.Generator().manual_seed(7)
    m, k, f, n = 40, 32, 48, 24
    x = torch.randn(m, k, generator=g, dtype=torch.float16)
    w1 = torch.randn(f, k, generator=g, dtype=torch.float16) / k ** 0.5  # nn.Linear layouts
    w2 = torch.randn(n, f, generator=g, dtype=torch.float16) / f ** 0.5
    n_prod = -(-f // CFG.block_n)
    flags = torch.zeros(8, dtype=torch.int32)
    for epoch in (1, 2):
        grp = epoch  # row-block order, then groups of 2 row blocks
        prod_l, cons_l = rowsync_chain_tables(m, f, n, CFG.block_m, CFG.block_n, CFG.block_n, prod_group_m=grp,
                                              cons_group_m=grp)
        prod, cons = (torch.tensor(t, dtype=torch.int32) for t in (prod_l, cons_l))
        xe = x * epoch  # inputs change every call
        mid = torch.full((m, f), float("nan"), dtype=torch.float16)
        y = torch.full((m, n), float("nan"), dtype=torch.float16)
        ew = ErrorWord("cpu", what="chain")
        launch_tile_gemm(xe, w1.t(), mid, prod, flags=flags, err=ew.word, epoch=epoch, grid=3, config=CFG,
                         post=True, activation="gelu", counter=torch.zeros(1, dtype=torch.int32), start_flag=3)
        assert flags[:3].tolist() == [epoch * n_prod] * 3, flags
        assert flags[3].item() == epoch, "the producer's start flag holds this call's epoch"
        launch_tile_gemm(mid, w2.t(), y, cons, flags=flags, err=ew.word, epoch=epoch, grid=2, config=CFG,
                         wait=True, counter=torch.zeros(1, dtype=torch.int32), max_spins=100)
        ew.check()
        ref = torch.nn.functional.gelu(xe.double() @ w1.double().t()) @ w2.double().t()
        assert _rel(y, ref) < 3e-3, _rel(y, ref)
    # consumer alone in epoch 3: flags hold epoch 2's counts
    cons = torch.tensor(rowsync_chain_tables(m, f, n, CFG.block_m, CFG.block_n, CFG.block_n)[1], dtype=torch.int32)
    y = torch.full((m, n), float("nan"), dtype=torch.float16)
    ew = ErrorWord("cpu", what="chain")
    launch_tile_gemm(mid, w2.t(), y, cons, flags=flags, err=ew.word, epoch=3, grid=2, config=CFG, wait=True,
                     max_spins=100)
    try:
        ew.check()
    except FlagTimeoutError as e:
        assert (e.flag_idx, e.expected, e.seen) == (0, 3 * n_prod, 2 * n_prod), e
    else:
        raise AssertionError("consumer ran on stale producer flags")
    assert torch.isnan(y).all()



@interpreted
def test_tilesync() -> None:
    """fc1 (posts per tile) -> fc2 (TileSync: its K loop waits group by group, each on the
    one fc1 tile it reads): matches torch over two epochs; with only the first fc1 tile of a
    row block posted, the fc2 tile times out on the second one (flag index 1), does not
    write, and a stale flag from the previous call does not satisfy it."""
    g = torch.Generator().manual_seed(8)
    m, k, f, n = 40, 32, 48, 24
    pcfg = GemmConfig(block_m=16, block_n=32, block_k=16, num_stages=1, num_warps=4)
    x = torch.randn(m, k, generator=g, dtype=torch.float16)
    w1 = torch.randn(f, k, generator=g, dtype=torch.float16) / k ** 0.5
    w2 = torch.randn(n, f, generator=g, dtype=torch.float16) / f ** 0.5
    prod_l, cons_l, pol = tilesync_chain_tables(m, f, n, 16, pcfg.block_n, CFG.block_n, CFG.block_k)
    assert pol.k_wait == 2 and pol.producer_n_tiles == 2
    prod, cons = (torch.tensor(t, dtype=torch.int32) for t in (prod_l, cons_l))
    flags = torch.zeros(7, dtype=torch.int32)  # 3 row blocks x 2 fc1 tiles + the start flag
    for epoch in (1, 2):
        xe = x * epoch
        mid = torch.full((m, f), float("nan"), dtype=torch.float16)
        y = torch.full((m, n), float("nan"), dtype=torch.float16)
        ew = ErrorWord("cpu", what="chain")
        launch_tile_gemm(xe, w1.t(), mid, prod, flags=flags, err=ew.word, epoch=epoch, grid=3, config=pcfg,
                         post=True, activation="gelu", counter=torch.zeros(1, dtype=torch.int32), start_flag=6)
        assert flags[:6].tolist() == [epoch] * 6, flags  # one post per fc1 tile
        launch_tile_gemm(mid, w2.t(), y, cons, flags=flags, err=ew.word, epoch=epoch, grid=2, config=CFG,
                         wait=True, k_wait=pol.k_wait, counter=torch.zeros(1, dtype=torch.int32), max_spins=100)
        ew.check()
        ref = torch.nn.functional.gelu(xe.double() @ w1.double().t()) @ w2.double().t()
        assert _rel(y, ref) < 3e-3, _rel(y, ref)
    # epoch 3: fc1 tile (0, 0) posted, tile (0, 1) still at epoch 2's count
    flags[:6] = torch.tensor([3, 2, 3, 3, 3, 3], dtype=torch.int32)
    y = torch.full((m, n), float("nan"), dtype=torch.float16)
    ew = ErrorWord("cpu", what="chain")
    launch_tile_gemm(mid, w2.t(), y, cons, flags=flags, err=ew.word, epoch=3, grid=1, config=CFG, wait=True,
                     k_wait=pol.k_wait, max_spins=100)
    try:
        ew.check()
    except FlagTimeoutError as e:
        assert (e.flag_idx, e.expected, e.seen) == (1, 3, 2), e
    else:
        raise AssertionError("an fc2 tile read fc1 columns whose tile had not posted")
    assert torch.isnan(y[:16]).all(), "a tile whose K group timed out stored numbers"
    try:
        launch_tile_gemm(mid, w2.t(), y, cons, flags=flags, err=ew.word, epoch=3, grid=1, config=CFG,
                         k_wait=2)
    except ValueError as e:
        assert "k_wait" in str(e)
    else:
        raise AssertionError("k_wait without waits accepted")



@interpreted
def test_split_tail() -> None:
    """Split tiles: the last tiles of a table in K pieces; the last piece of each sums the
    pieces and finishes the tile (epilogue, one post per tile, not per piece). Every
    piece count up to the K steps, partial tiles, both dtypes, the folded-norm epilogue,
    two launches sharing the table; and what the launcher refuses."""
    from overlap.kernels.norm_fold import fold_norm

    cfg = GemmConfig(block_m=32, block_n=16, block_k=16, num_stages=1, num_warps=4)
    g = torch.Generator().manual_seed(11)
    m, n, k = 70, 40, 64  # 3 x 3 tiles, the last row and column partial; 4 K steps
    for dt in (torch.float16, torch.float32):
        a = torch.randn(m, k, generator=g).to(dt)
        w = torch.randn(n, k, generator=g).to(dt)
        ref = a.double() @ w.double().t()
        base = build_tile_table(row_block_segments(m, cfg.block_m, post=True), n, cfg.block_m, cfg.block_n, 2)
        for tiles, parts in ((4, 2), (9, 3), (1, 4), (5, 4)):
            rows, start = split_tail(base, tiles, parts)
            assert start == len(base) - tiles and len(rows) == start + tiles * parts
            tab = torch.tensor(rows, dtype=torch.int32)
            ws = split_workspace((start, parts), len(rows), cfg, "cpu")
            counter = torch.zeros(1 + tiles, dtype=torch.int32)
            flags = torch.zeros(8, dtype=torch.int32)
            err = torch.zeros(8, dtype=torch.int32)
            c = torch.full((m, n), float("nan"), dtype=dt)
            # two launches share the table through the dispatch counter
            for grid in (2, 3):
                launch_tile_gemm(a, w.t(), c, tab, flags=flags, err=err, grid=grid, config=cfg, post=True,
                                 counter=counter, split=(start, parts), workspace=ws)
            assert not torch.isnan(c).any(), (dt, tiles, parts, "a split tile was not stored")
            assert _rel(c, ref) < TOL[dt], (dt, tiles, parts, _rel(c, ref))
            assert counter[1:].tolist() == [parts] * tiles, counter  # every piece counted once
            assert flags[:3].tolist() == [3, 3, 3], flags  # one post per tile of each row block
    # the folded norm's epilogue on the summed pieces
    h = (torch.randn(m, k, generator=g) + 3.0).to(torch.float16)
    wn, bn = torch.randn(k, generator=g).to(torch.float16), torch.randn(k, generator=g).to(torch.float16)
    w = torch.randn(n, k, generator=g).to(torch.float16)
    hf = h.float()
    mean, var = hf.mean(1), hf.var(1, unbiased=False)
    rstd = torch.rsqrt(var + 1e-5)
    rowstat = torch.stack([rstd, mean * rstd], 1).contiguous()
    bf, vec = fold_norm(w.t(), wn, bn)
    rows, start = split_tail(build_tile_table([Segment(0, 0, 0, m)], n, cfg.block_m, cfg.block_n), 6, 2)
    tab = torch.tensor(rows, dtype=torch.int32)
    c = torch.full((m, n), float("nan"), dtype=torch.float16)
    launch_tile_gemm(h, bf, c, tab, grid=2, config=cfg, counter=torch.zeros(7, dtype=torch.int32),
                     split=(start, 2), workspace=split_workspace((start, 2), len(rows), cfg, "cpu"),
                     rowstat=rowstat, colvec=vec)
    ref = torch.nn.functional.layer_norm(hf, (k,), wn.float(), bn.float(), 1e-5).double() @ w.double().t()
    assert _rel(c, ref) < 3e-3, _rel(c, ref)
    # refused: no counter, a short counter or workspace, a ragged tail, more pieces than K steps
    a, w = torch.randn(m, k), torch.randn(n, k)
    rows, start = split_tail(build_tile_table([Segment(0, 0, 0, m)], n, cfg.block_m, cfg.block_n), 2, 2)
    tab = torch.tensor(rows, dtype=torch.int32)
    ws = split_workspace((start, 2), len(rows), cfg, "cpu")
    cnt = torch.zeros(3, dtype=torch.int32)
    for kw, what in ((dict(counter=None, workspace=ws, split=(start, 2)), "counter"),
                     (dict(counter=cnt[:2], workspace=ws, split=(start, 2)), "counter"),
                     (dict(counter=cnt, workspace=ws[:10], split=(start, 2)), "workspace"),
                     (dict(counter=cnt, workspace=ws, split=(start + 1, 2)), "whole number"),
                     (dict(counter=cnt, workspace=ws, split=(len(rows) - 4, 4), k=16), "steps")):
        kk = kw.pop("k", k)
        try:
            launch_tile_gemm(a[:, :kk], w.t()[:kk], torch.empty(m, n), tab, grid=1, config=cfg, **kw)
        except ValueError as e:
            assert what in str(e), (what, e)
        else:
            raise AssertionError(f"accepted a bad split ({what})")



@interpreted
def test_wrap() -> None:
    """Waits across the int32 wrap: epochs and counted flags wrap modulo 2**32 and
    compare by difference (``overlap.flags.wrap32``), so a flag one call behind still
    waits, the call's own value passes and two calls ahead is still a protocol error,
    at 2**31 and at 2**32 alike, for counts (``wait_mult`` 3) too."""
    from overlap.flags import wrap32

    g = torch.Generator().manual_seed(5)
    m, n, k = 16, 16, 16
    a = torch.randn(m, k, generator=g, dtype=torch.float32)
    w = torch.randn(n, k, generator=g, dtype=torch.float32)
    for mult in (1, 3):
        segs = [Segment(a_src=0, a_row=0, c_row=0, rows=16, wait_idx=0, wait_mult=mult)]
        for calls in (2**31 // mult, 2**32 // mult, 2**32 // mult + 1):
            epoch = wrap32(calls)
            for seen_calls, outcome in ((calls - 1, "timeout"), (calls, "ok"), (calls + 1, "ok"),
                                        (calls + 2, "ahead")):
                flags = torch.tensor([wrap32(seen_calls * mult)], dtype=torch.int32)
                ew = ErrorWord("cpu", what="wrap")
                c = torch.full((m, n), float("nan"))
                launch_tile_gemm(a, w.t(), c, _table(segs, n), flags=flags, err=ew.word, epoch=epoch, grid=1,
                                 config=CFG, wait=True, max_spins=50)
                try:
                    ew.check()
                    got = "ok"
                except FlagProtocolError:
                    got = "ahead"
                except FlagTimeoutError:
                    got = "timeout"
                assert got == outcome, (mult, calls, seen_calls, got, outcome)
                assert torch.isnan(c).all() == (outcome != "ok"), (mult, calls, seen_calls)



@interpreted
def test_row_cut() -> None:
    """A table made for row blocks of ``span`` rows run for blocks of ``cap`` (a plan of a
    row bucket, ``launch_tile_gemm(rows=(cap, span))``): each block's tiles land at
    ``b * cap``, cut at its end; the A rows past ``cap`` (NaN here) are read and never
    stored; a tile with no rows left does no work but still posts, once per tile (split
    pieces too), so a consumer waiting on the table's counts is not left waiting. With
    ``cut="a"`` the blocks are A's rows and C's stay where the table puts them."""
    cfg = GemmConfig(block_m=32, block_n=16, block_k=16, num_stages=1, num_warps=4)
    g = torch.Generator().manual_seed(12)
    span, n, k, blocks = 96, 40, 32, 2  # 3 row tiles per block, 3 column tiles
    w = torch.randn(n, k, generator=g).half()
    for cap, parts in ((40, 0), (96, 0), (1, 2), (70, 2)):
        # block b's rows at b * span of the padded A, its first cap real
        a_pad = torch.full((blocks * span, k), float("nan")).half()
        real = torch.randn(blocks * cap, k, generator=g).half()
        for b in range(blocks):
            a_pad[b * span: b * span + cap] = real[b * cap: (b + 1) * cap]
        segs = [Segment(a_src=0, a_row=b * span, c_row=b * span, rows=span, post_base=3 * b) for b in range(blocks)]
        rows = build_tile_table(segs, n, cfg.block_m, cfg.block_n, 2)
        split, ws, counter = None, None, torch.zeros(1 + 6, dtype=torch.int32)
        if parts:
            rows, start = split_tail(rows, 6, parts)
            split, ws = (start, parts), split_workspace((start, parts), len(rows), cfg, "cpu")
        tab = torch.tensor(rows, dtype=torch.int32)
        out = torch.full((blocks * cap + 8, n), float("nan")).half()  # 8 guard rows past C
        c = out[:blocks * cap]
        flags = torch.zeros(8, dtype=torch.int32)
        err = torch.zeros(8, dtype=torch.int32)
        for grid in (2, 3):  # two launches share the table through the dispatch counter
            launch_tile_gemm(a_pad, w.t(), c, tab, flags=flags, err=err, grid=grid, config=cfg, post=True,
                             counter=counter, split=split, workspace=ws, rows=(cap, span))
        assert not torch.isnan(c).any(), (cap, parts, "a row of C not stored, or a padded row stored")
        assert torch.isnan(out[blocks * cap:]).all(), (cap, parts, "a store past C")
        assert _rel(c, real.double() @ w.double().t()) < TOL[torch.float16], (cap, parts)
        # every row tile's flag got one post per column tile, dead or alive
        assert flags[:3 * blocks].tolist() == [3] * (3 * blocks), (cap, parts, flags)
    # cut="a": the blocks are A's (a reduce-scatter's destinations), C rows as the table says
    for cap in (40, 1, 96):
        real = torch.randn(blocks * cap, k, generator=g).half()
        segs = [Segment(a_src=0, a_row=b * span, c_row=b * span, rows=span, post_base=3 * b) for b in range(blocks)]
        tab = torch.tensor(build_tile_table(segs, n, cfg.block_m, cfg.block_n, 2), dtype=torch.int32)
        c = torch.full((blocks * span, n), float("nan")).half()
        flags = torch.zeros(8, dtype=torch.int32)
        launch_tile_gemm(real, w.t(), c, tab, flags=flags, err=torch.zeros(8, dtype=torch.int32), grid=3,
                         config=cfg, post=True, counter=torch.zeros(1, dtype=torch.int32), rows=(cap, span), cut="a")
        for b in range(blocks):
            want = real[b * cap:(b + 1) * cap].double() @ w.double().t()
            assert _rel(c[b * span: b * span + cap], want) < TOL[torch.float16], (cap, b)
            assert torch.isnan(c[b * span + cap:(b + 1) * span]).all(), (cap, b, "a row past the cut stored")
        assert flags[:3 * blocks].tolist() == [3] * (3 * blocks), (cap, flags)
    # what the launcher refuses
    for bad in ((0, 4), (5, 4)):
        try:
            launch_tile_gemm(a_pad, w.t(), c, tab, grid=1, config=cfg, rows=bad)
        except ValueError as e:
            assert "cap" in str(e), e
        else:
            raise AssertionError(f"rows={bad} accepted")
