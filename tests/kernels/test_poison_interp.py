"""A call whose waits expired returns NaN where it has no data: every tile that waited for
a flag that never came, and every tile skipped after that, stores NaN over its C tile
(masked to the real rows and columns); tiles that ran before hold the right values, and
the error word names the flag. C is filled with finite garbage first, so a tile that
leaves it alone fails. Per-tile kernel (one and several weights, split tiles, TileSync),
flattened kernel.

Under the interpreter programs run one after another: one program (grid 1) takes the
table's rows in order, so which tiles ran before the timeout is known.

The tests run in a child process with TRITON_INTERPRET=1 (``tests._interp``)."""

from __future__ import annotations

from dataclasses import replace

import torch

from tests._interp import interpreted

GARBAGE = 1234.5


def _c(shape, dt):
    """C as a view inside a larger buffer of finite garbage (the margin must stay as it was)."""
    big = torch.full((shape[0] + 5, shape[1] + 7), GARBAGE, dtype=dt)
    return big, big[:shape[0], :shape[1]]


def _check(big, c, want, bad_rows, what):
    """Rows ``bad_rows`` of C all NaN, the others as ``want``, the margin untouched."""
    from tests.kernels._interp_common import TOL, _rel

    good = torch.ones(c.shape[0], dtype=torch.bool)
    good[bad_rows] = False
    assert torch.isnan(c[~good]).all(), (what, "a skipped tile left the buffer's values")
    assert not torch.isnan(c[good]).any(), (what, "a tile that ran stored NaN")
    if good.any():
        assert _rel(c[good], want[good]) < TOL[c.dtype], (what, _rel(c[good], want[good]))
    margin = big.clone()
    margin[:c.shape[0], :c.shape[1]] = GARBAGE
    assert (margin == GARBAGE).all(), (what, "NaN stored past C's rows or columns")


def _timed_out(ew, flag, expected):
    from tests.kernels._interp_common import FlagTimeoutError

    try:
        ew.check()
    except FlagTimeoutError as e:
        assert (e.flag_idx, e.expected) == (flag, expected), e
    else:
        raise AssertionError("the expired wait was not recorded")


@interpreted
def test_expired_wait_stores_nan() -> None:
    """Per-tile kernel, fp16 and fp32, partial tiles: rows 0-15 need no flag (right), rows
    16-31 wait on flag 1 that never comes (NaN), rows 32-39 wait on flag 2 that came but
    are skipped after the timeout (NaN). Then the same table with two weights (NaN in
    both Cs), with split tiles after the timeout, with a split tile whose first piece ran
    before it (its partial must not be stored), and TileSync's K-group waits."""
    from overlap.policies import Segment, build_multi_tile_table, build_tile_table, split_tail
    from tests.kernels._interp_common import CFG, CFG32, ErrorWord, _table, launch_tile_gemm, split_workspace

    g = torch.Generator().manual_seed(46)
    m, n, k = 40, 24, 32  # the last row tile 8 rows, the last column tile 8 columns
    segs = [Segment(a_src=0, a_row=0, c_row=0, rows=16),
            Segment(a_src=0, a_row=16, c_row=16, rows=16, wait_idx=1),
            Segment(a_src=0, a_row=32, c_row=32, rows=8, wait_idx=2)]
    for dt in (torch.float16, torch.float32):
        a = torch.randn(m, k, generator=g).to(dt)
        w = torch.randn(n, k, generator=g).to(dt)
        want = a.double() @ w.double().t()
        flags = torch.tensor([0, 6, 7], dtype=torch.int32)  # flag 1 at the last call's epoch
        ew = ErrorWord("cpu", what="poison")
        big, c = _c((m, n), dt)
        launch_tile_gemm(a, w.t(), c, _table(segs, n), flags=flags, err=ew.word, epoch=7, rank=1, grid=1,
                         config=CFG, wait=True, max_spins=50)
        _timed_out(ew, 1, 7)
        _check(big, c, want, slice(16, None), (dt, "one weight"))

    # two weights of different N: each weight's C of the skipped rows is NaN
    ns = [24, 16]
    ws = [torch.randn(nn, k, generator=g).half() for nn in ns]
    a = torch.randn(m, k, generator=g).half()
    tab = torch.tensor(build_multi_tile_table(segs, ns, 16, 16, 2), dtype=torch.int32)
    ew = ErrorWord("cpu", what="poison")
    bigs, cs = zip(*[_c((m, nn), torch.float16) for nn in ns])
    launch_tile_gemm(a, [x.t() for x in ws], list(cs), tab, flags=torch.tensor([0, 6, 7], dtype=torch.int32),
                     err=ew.word, epoch=7, grid=1, config=CFG, wait=True, max_spins=50)
    _timed_out(ew, 1, 7)
    for i, (big, c, x) in enumerate(zip(bigs, cs, ws)):
        _check(big, c, a.double() @ x.double().t(), slice(16, None), ("weight", i))

    # split tiles: rows 64-95 (no wait) in K pieces after rows 32-63 that time out
    m2, k2 = 96, 64
    a = torch.randn(m2, k2, generator=g).half()
    w = torch.randn(n, k2, generator=g).half()
    want = a.double() @ w.double().t()
    segs2 = [Segment(a_src=0, a_row=0, c_row=0, rows=32),
             Segment(a_src=0, a_row=32, c_row=32, rows=32, wait_idx=1),
             Segment(a_src=0, a_row=64, c_row=64, rows=32)]
    base = build_tile_table(segs2, n, CFG32.block_m, CFG32.block_n, 2)
    rows, start = split_tail(base, 2, 2)  # the last row block's 2 column tiles, 2 pieces each
    tab = torch.tensor(rows, dtype=torch.int32)
    ew = ErrorWord("cpu", what="poison")
    big, c = _c((m2, n), torch.float16)
    counter = torch.zeros(3, dtype=torch.int32)
    launch_tile_gemm(a, w.t(), c, tab, flags=torch.tensor([0, 0], dtype=torch.int32), err=ew.word, epoch=3, grid=1,
                     config=CFG32, wait=True, max_spins=50, counter=counter, split=(start, 2),
                     workspace=split_workspace((start, 2), len(rows), CFG32, "cpu"))
    _timed_out(ew, 1, 3)
    _check(big, c, want, slice(32, None), "split tiles after the timeout")
    # a split tile whose first piece ran and counted, its second timed out: not the first
    # piece's partial sum, NaN (no piece sees the count complete, so no sum is stored)
    rows, start = split_tail(build_tile_table([Segment(0, 0, 0, m2)], n, 32, 16, 2), 1, 2)
    tab = torch.tensor(rows, dtype=torch.int32)
    tab[-1, 5], tab[-1, 6] = 0, 1  # the last piece waits on flag 0 (>= epoch), never posted
    ew = ErrorWord("cpu", what="poison")
    big, c = _c((m2, n), torch.float16)
    counter = torch.zeros(2, dtype=torch.int32)
    launch_tile_gemm(a, w.t(), c, tab, flags=torch.zeros(1, dtype=torch.int32), err=ew.word, epoch=3, grid=1,
                     config=CFG32, wait=True, max_spins=50, counter=counter, split=(start, 2),
                     workspace=split_workspace((start, 2), len(rows), CFG32, "cpu"))
    _timed_out(ew, 0, 3)
    assert counter[1].item() == 1, counter  # the first piece counted, the second did not
    r0, c0 = tab[-1, 2].item(), tab[-1, 4].item() * 16
    bad = torch.zeros(m2, n, dtype=torch.bool)
    bad[r0:r0 + 32, c0:c0 + 16] = True
    assert torch.isnan(c[bad]).all(), "a split tile's first piece turned a poisoned tile into numbers"
    assert not torch.isnan(c[~bad]).any() and (c[~bad].double() - want[~bad]).abs().max() < 0.1
    # TileSync: a tile's K loop waits per group of K steps; its second group's flag never
    # comes after its first group's ran
    m3, k3 = 16, 64
    a = torch.randn(m3, k3, generator=g).half()
    w = torch.randn(n, k3, generator=g).half()
    tab = torch.tensor(build_tile_table([Segment(0, 0, 0, m3, wait_idx=0)], n, 16, 16, 2), dtype=torch.int32)
    ew = ErrorWord("cpu", what="poison")
    big, c = _c((m3, n), torch.float16)
    launch_tile_gemm(a, w.t(), c, tab, flags=torch.tensor([5, 4, 5, 5], dtype=torch.int32), err=ew.word, epoch=5,
                     grid=1, config=CFG, wait=True, k_wait=1, max_spins=50)
    _timed_out(ew, 1, 5)
    _check(big, c, a.double() @ w.double().t(), slice(0, None), "TileSync")


@interpreted
def test_flat_expired_wait_stores_nan() -> None:
    """Flattened kernel, per group of rows: the group behind a flag that never comes and
    the group after it are NaN, the group before right, at one program and at three."""
    from overlap.policies import Segment, flat_groups
    from tests.kernels._interp_common import CFG, ErrorWord, _table, launch_tile_gemm

    g = torch.Generator().manual_seed(47)
    cfg = replace(CFG, flatten=True)
    m, n, k = 56, 24, 32
    segs = [Segment(a_src=0, a_row=0, c_row=0, rows=32),
            Segment(a_src=1, a_row=0, c_row=32, rows=16, wait_idx=0, wait_mult=1),
            Segment(a_src=1, a_row=16, c_row=48, rows=8, wait_idx=1, wait_mult=1)]
    rows = _table(segs, n, cfg).numpy()
    groups = torch.tensor(flat_groups(rows))
    w = torch.randn(n, k, generator=g, dtype=torch.float16)
    for grid in (1, 3):
        a, a2 = torch.randn(32, k, generator=g).half(), torch.randn(24, k, generator=g).half()
        want = torch.cat([a, a2]).double() @ w.double().t()
        ew = ErrorWord("cpu", what="flat poison")
        big, c = _c((m, n), torch.float16)
        launch_tile_gemm(a, w.t(), c, torch.tensor(rows), a2=a2, flags=torch.tensor([4, 5], dtype=torch.int32),
                         err=ew.word, epoch=5, grid=grid, config=cfg, wait=True, groups=groups, max_spins=50)
        _timed_out(ew, 0, 5)
        if grid == 1:
            _check(big, c, want, slice(32, None), "flat, one program")
        else:  # programs the interpreter runs after the timeout skip their rows of every group
            assert torch.isnan(c[32:48]).all(), "a skipped group left the buffer's values"
            done = ~torch.isnan(c)
            assert (c[done].double() - want[done]).abs().max() < 0.05, "a row of C left as it was"
            assert done.any() and not done.all()


@interpreted
def test_reduce_expired_wait_stores_nan() -> None:
    """The peer-copy all-reduce's reduce kernel: the chunk whose peer rows never land is
    NaN in h and in y (or in the folded norm's row statistics) for every block shape and
    statistics path, the chunk before it right, and every chunk still posted (a consumer
    GEMM then reads NaN, not stale rows)."""
    from overlap.kernels.add_norm import ReduceShape, launch_reduce_norm
    from tests.kernels._interp_common import TOL, ErrorWord

    g = torch.Generator().manual_seed(48)
    m, k = 12, 40
    starts = torch.tensor([0, 7, 12], dtype=torch.int32)  # chunk 1: rows 7-11, a ragged block
    for dt in (torch.float16, torch.float32):
        for kind, out, shape in ((None, "h", ReduceShape(rows=4)), ("layernorm", "y", ReduceShape(rows=4, segment=0)),
                                 ("layernorm", "y", ReduceShape(rows=4, block_k=16, segment=0)),
                                 ("rmsnorm", "y", ReduceShape(rows=4, segment=8)),
                                 ("layernorm", "stats", ReduceShape(rows=4, segment=0))):
            x, peer, res = (torch.randn(m, k, generator=g).to(dt) for _ in range(3))
            w = torch.randn(k, generator=g).to(dt)
            h = torch.full((m, k), GARBAGE, dtype=dt)
            y = torch.full((m, k), GARBAGE, dtype=dt) if out == "y" else None
            stats = torch.full((m, 2), GARBAGE) if out == "stats" else None
            ready = torch.zeros(2, dtype=torch.int32)
            ew = ErrorWord("cpu", what="reduce poison")
            launch_reduce_norm(x, peer[None].contiguous(), h, starts=starts,
                               rflags=torch.tensor([5, 4], dtype=torch.int32), ready=ready, err=ew.word, epoch=5,
                               rank=0, world=2, programs=1, residual=res, norm=kind,
                               weight=w if kind and out == "y" else None, y=y, stats=stats, max_spins=50, shape=shape)
            _timed_out(ew, 1, 5)
            what = (dt, kind, out, shape)
            assert ready.tolist() == [1, 1], (what, ready)
            h_ref = ((x.float() + peer.float()).to(dt).float() + res.float()).to(dt)
            assert torch.isnan(h[7:]).all(), (what, "h of the missing chunk left as it was")
            assert (h[:7].float() - h_ref[:7].float()).abs().max() <= TOL[dt] * 10, what
            if out == "y":
                hf = h_ref.float()
                if kind == "layernorm":
                    y_ref = torch.nn.functional.layer_norm(hf, (k,), w.float(), None, 1e-5)
                else:
                    y_ref = hf * torch.rsqrt(hf.pow(2).mean(1, keepdim=True) + 1e-5) * w.float()
                assert torch.isnan(y[7:]).all(), (what, "y of the missing chunk left as it was")
                assert (y[:7].float() - y_ref[:7]).abs().max() < 2e-2, what
            if out == "stats":
                assert torch.isnan(stats[7:]).all(), (what, "the missing chunk's statistics left as they were")
                assert torch.isfinite(stats[:7]).all() and (stats[:7] != GARBAGE).all(), what


@interpreted
def test_ops_return_nan_where_a_call_had_no_data() -> None:
    """The peer-copy ops on the stand-in runtime (rank 0 of 2, kernels interpreted), the
    peer's signature words for the call differing (its tiles and chunks skip their work),
    the error not raised by the call (``check="none"``: what a call returns before its
    error is seen): the all-gather's C and gathered rows right in this rank's rows and
    NaN in the peer's; the all-reduce's h and C NaN everywhere, one-shot and two-shot
    (whose peer rows of h are copied from its gather buffer); the errors recorded. Each
    disagreeing call comes after a right one with new inputs."""
    from overlap.flags import RanksDisagreeError
    from overlap.ops import OverlapConfig
    from overlap.ops import all_gather_p2p as agp
    from overlap.ops import all_reduce_p2p as arp
    from tests.kernels._interp_common import CFG, TOL, _StandIn, _rel

    def recorded(rt):
        n = 0
        for ew in rt.errs.values():
            try:
                ew.check()
            except RanksDisagreeError:
                n += 1
        return n

    rt = _StandIn()
    g = torch.Generator().manual_seed(49)
    ms, n, k = 64, 32, 48
    cfg = OverlapConfig(chunks=2, check="none", transport="p2p", gemm=CFG, reduce_ctas=4)
    lin = (torch.randn(n, k, generator=g) / k ** 0.5).half()
    with rt.patched():
        for disagree in (False, True):
            rt.disagree = disagree
            a, peer, x, xp = (torch.randn(ms, k, generator=g).half() for _ in range(4))
            rt.recv("all_gather_matmul", (2 * ms, k), torch.float16)[ms:].copy_(peer)
            rt.recv("all_reduce_matmul", (1, ms, k), torch.float16)[0].copy_(xp)
            c, gathered = agp._fused_p2p(rt, a, lin.t(), True, cfg)
            c2, h = arp._fused_p2p(rt, x, lin.t(), None, None, cfg)
            want = torch.cat([a, peer]).double() @ lin.t().double()
            assert _rel(c[:ms], want[:ms]) < TOL[torch.float16], disagree
            assert torch.equal(gathered[:ms], a), disagree
            if not disagree:
                assert _rel(c, want) < TOL[torch.float16] and torch.equal(gathered[ms:], peer)
                assert _rel(h, x.double() + xp.double()) < TOL[torch.float16]
                continue
            assert torch.isnan(c[ms:]).all(), "the all-gather returned the peer's rows' C as numbers"
            assert torch.isnan(gathered[ms:]).all(), "the all-gather returned the buffer's rows as the peer's"
            assert torch.isnan(h).all() and torch.isnan(c2).all(), "the all-reduce returned numbers"
        assert recorded(rt) == 2  # one record per op
        # two-shot: rank 0 reduces rows 0..255, rank 1 rows 256..299 (its reduced rows land
        # in the gather buffer and are copied into h)
        m2, k2 = 300, 64
        cfg2 = OverlapConfig(chunks=3, reduce_ctas=2, two_shot=True, check="none", transport="p2p", gemm=CFG)
        b = ((torch.randn(n, k2, generator=g) / k2 ** 0.5).half()).t()
        blk = rt.block("all_reduce_matmul.two_shot", 0)
        for disagree in (False, True):
            rt.disagree = disagree
            x, peer = torch.randn(m2, k2, generator=g).half(), torch.randn(m2, k2, generator=g).half()
            h_ref = (x.float() + peer.float()).half()
            blk.tensor(0, 0, (1, 256, k2), torch.float16)[0].copy_(peer[:256])  # the peer's partial of my rows
            blk.tensor(0, 0, (m2, k2), torch.float16)[256:].copy_(h_ref[256:])  # the peer's reduced rows
            c, h = arp._fused_p2p(rt, x, b, None, None, cfg2)
            if not disagree:
                assert torch.equal(h, h_ref) and _rel(c, h_ref.double() @ b.double()) < TOL[torch.float16]
                continue
            assert torch.isnan(h[256:]).all(), "two-shot: the peer's rows of h returned from the buffer as numbers"
            assert torch.isnan(h).all() and torch.isnan(c).all(), "two-shot: the all-reduce returned numbers"
        assert recorded(rt) == 1
