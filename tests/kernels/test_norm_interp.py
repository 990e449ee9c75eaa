"""The add / reduce / norm kernels and the norm fold under the Triton interpreter.

Each test runs in a child process with TRITON_INTERPRET=1 (``tests._interp``)."""

from __future__ import annotations

import torch

from tests._interp import interpreted
from tests.kernels._interp_common import (CFG, ErrorWord, FlagTimeoutError, ReducePlan, ReduceShape, Segment, TOL, _rel, _table, _torch_norm, launch_add_norm, launch_reduce_norm, launch_tile_gemm, push_slot, row_chunk_segments)


@interpreted
def test_add_norm() -> None:
    """Residual add in place and LayerNorm / RMSNorm of a row range, against torch;
    rows outside the range are untouched; K not a multiple of the K block."""
    g = torch.Generator().manual_seed(5)
    m, k, row0, rows = 12, 40, 3, 6
    for dt in (torch.float32, torch.float16):
        for kind, with_bias in ((None, False), ("layernorm", True), ("layernorm", False), ("rmsnorm", False)):
            for with_res in (True, False):
                if kind is None and not with_res:
                    continue
                h0 = (torch.randn(m, k, generator=g) * 3 + 1).to(dt)
                res = torch.randn(m, k, generator=g).to(dt) if with_res else None
                w = torch.randn(k, generator=g).to(dt)
                b = torch.randn(k, generator=g).to(dt) if with_bias else None
                h = h0.clone()
                y = torch.full((m, k), float("nan"), dtype=dt)
                launch_add_norm(h, row0, rows, residual=res, norm=kind, weight=w if kind else None, bias=b,
                                eps=1e-5, y=y if kind else None, block_k=16)
                sl = slice(row0, row0 + rows)
                h_ref = h0[sl] + res[sl] if with_res else h0[sl]
                assert torch.equal(h[sl], h_ref), (dt, kind, "h rows")
                assert torch.equal(h[:row0], h0[:row0]) and torch.equal(h[row0 + rows:], h0[row0 + rows:]), \
                    "rows outside the range changed"
                if kind:
                    y_ref = _torch_norm(h_ref, kind, w, b, 1e-5)
                    tol = 1e-5 if dt == torch.float32 else 2e-3
                    torch.testing.assert_close(y[sl].float(), y_ref, atol=tol * 4, rtol=tol)
                    assert torch.isnan(y[:row0]).all() and torch.isnan(y[row0 + rows:]).all()
    # a row mean far above its spread: the variance must not come from E[x^2] - mean^2
    h = torch.randn(4, 64, generator=g) + 3000.0
    w = torch.ones(64)
    y = torch.empty_like(h)
    launch_add_norm(h, 0, 4, norm="layernorm", weight=w, y=y, block_k=16)
    torch.testing.assert_close(y, _torch_norm(h, "layernorm", w, None, 1e-5), atol=1e-3, rtol=1e-3)



@interpreted
def test_reduce_norm() -> None:
    """The p2p all-reduce's consumer kernel: the partials pushed into slots are
    summed with the local one in rank order, the residual added, the norm taken,
    and every program posts every chunk once; with one peer's chunk missing, the
    timeout names its flag, those rows are NaN, and the chunk is still posted."""
    g = torch.Generator().manual_seed(12)
    m, chunks, programs = 23, 3, 4
    sizes, _ = row_chunk_segments(m, chunks, 8)
    starts = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    # K = 40: a row block in registers with masked columns; K = 32: the block is exactly K
    for world, rank, k in ((2, 0, 40), (3, 1, 40), (4, 3, 40), (2, 1, 32)):
        for dt in (torch.float32, torch.float16):
            for kind, with_res in ((None, False), (None, True), ("layernorm", True), ("rmsnorm", False)):
                parts = [(torch.randn(m, k, generator=g) * (r + 1)).to(dt) for r in range(world)]
                res = torch.randn(m, k, generator=g).to(dt) if with_res else None
                w = torch.randn(k, generator=g).to(dt)
                bias = torch.randn(k, generator=g).to(dt) if kind == "layernorm" else None
                recv = torch.zeros(world - 1, m, k, dtype=dt)
                for r in range(world):
                    if r != rank:
                        recv[push_slot(r, rank, world)] = parts[r]
                stride = chunks + 2  # each sender owns a fixed run of flags, longer than this call's chunking
                rflags = torch.full(((world - 1) * stride,), 4, dtype=torch.int32)
                # one program with 4-row blocks: several blocks per chunk, the last one ragged
                for missing, block_k, progs in ((False, 16, programs), (False, None, programs), (False, None, 1),
                                                (True, 16, 1), (True, None, 1)):
                    rflags.fill_(5)
                    late_slot = push_slot((rank + 1) % world, rank, world)
                    if missing:
                        rflags[late_slot * stride + chunks - 1] = 4
                    ready = torch.zeros(chunks, dtype=torch.int32)
                    ew = ErrorWord("cpu", what="reduce")
                    h = torch.full((m, k), float("nan"), dtype=dt)
                    y = torch.full((m, k), float("nan"), dtype=dt) if kind else None
                    # (the interpreter runs programs one after another and a timeout makes
                    # later programs skip their rows: one program when a chunk is missing)
                    launch_reduce_norm(parts[rank], recv, h, starts=starts, rflags=rflags, ready=ready,
                                       err=ew.word, epoch=5, rank=rank, world=world, programs=progs,
                                       residual=res, norm=kind, weight=w if kind else None, bias=bias,
                                       y=y, max_spins=50, shape=ReduceShape(block_k=block_k, rows=4),
                                       flag_stride=stride)
                    assert ready.tolist() == [progs] * chunks, ready  # every program posts every chunk
                    tot = torch.zeros(m, k)
                    for r in range(world):  # rank order, fp32, one rounding: the same bits on every rank
                        tot += parts[r].float()
                    h_ref = tot.to(dt)
                    if with_res:
                        h_ref = (h_ref.float() + res.float()).to(dt)
                    done = m - sizes[-1] if missing else m
                    assert torch.equal(h[:done], h_ref[:done]), (world, rank, dt, kind, missing)
                    if kind:
                        tol = 1e-5 if dt == torch.float32 else 2e-3
                        torch.testing.assert_close(y[:done].float(), _torch_norm(h_ref[:done], kind, w, bias, 1e-5),
                                                   atol=tol * 4, rtol=tol)
                    if not missing:
                        ew.check()
                        continue
                    assert torch.isnan(h[done:].float()).all(), "rows of a missing chunk hold numbers"
                    try:
                        ew.check()
                    except FlagTimeoutError as e:
                        assert (e.flag_idx, e.expected, e.seen) == (late_slot * stride + chunks - 1, 5, 4), e
                    else:
                        raise AssertionError("timeout not reported")
    # rows whose mean is far above their spread: the merged statistics must not cancel
    # (E[x^2] - mean^2 would). K in several blocks, whole-row statistics (segment 0) and
    # segments; K = 96 in 32-column segments is 3 to a row (a masked merge). With a
    # segment width the rows' (rstd, mean) go to the plan's scratch and y is written
    # from h read back; over 3 chunks and 3 programs a program's rows are not contiguous
    # y_rows 4: the output pass takes two of a program's 2-row blocks at a time (3
    # programs, so a program's blocks are 6 rows apart)
    st3 = torch.tensor([0, 11, 13, 16], dtype=torch.int32)
    for k2, block_k, seg, seg_taken, y_rows in ((64, 16, None, 0, None), (64, None, None, 16, None),
                                                (64, None, 0, 0, None), (96, None, 32, 32, 4),
                                                (96, 32, 16, 16, None), (64, 16, 16, 16, 4)):
        m2_ = 16
        parts = [torch.randn(m2_, k2, generator=g) + 1500.0 for _ in range(2)]
        res = torch.randn(m2_, k2, generator=g)
        for kind in ("layernorm", "rmsnorm"):
            w = torch.rand(k2, generator=g) + 0.5
            bias = torch.randn(k2, generator=g) if kind == "layernorm" else None
            h = torch.full((m2_, k2), float("nan"))
            y = torch.full((m2_, k2), float("nan"))
            ready = torch.zeros(3, dtype=torch.int32)
            plan = ReducePlan(parts[0], parts[1].unsqueeze(0).clone(), h, starts=st3,
                              rflags=torch.ones(3, dtype=torch.int32), ready=ready,
                              err=torch.zeros(8, dtype=torch.int32), rank=0, world=2, programs=3, residual=res,
                              norm=kind, weight=w, bias=bias, y=y,
                              shape=ReduceShape(block_k=block_k, rows=2, segment=seg, y_rows=y_rows))
            assert (plan.seg is None) == (seg_taken == 0) and (plan.row_stats is None) == (seg_taken == 0), (k2, seg)
            plan.launch(parts[0], parts[1].unsqueeze(0).clone(), h, epoch=1, residual=res, weight=w, bias=bias, y=y)
            assert ready.tolist() == [3, 3, 3], ready
            h_ref = (parts[0] + parts[1]) + res
            assert torch.equal(h, h_ref), (k2, block_k, seg, kind)
            torch.testing.assert_close(y, _torch_norm(h_ref.double(), kind, w.double(), None if bias is None
                                                      else bias.double(), 1e-5).float(), atol=2e-3, rtol=2e-3)
    try:
        ReducePlan(parts[0], parts[1].unsqueeze(0).clone(), h, starts=st3, rflags=torch.ones(3, dtype=torch.int32),
                   ready=ready, err=torch.zeros(8, dtype=torch.int32), rank=0, world=2, programs=2, norm="rmsnorm",
                   weight=w, y=y, shape=ReduceShape(rows=2, y_rows=6))
    except ValueError as e:
        assert "y_rows" in str(e), e
    else:
        raise AssertionError("y_rows 6 accepted")



@interpreted
def test_norm_fold() -> None:
    """A norm folded into the GEMM: the reduce kernel writes each row's rstd and
    mean * rstd instead of the normed rows, fold_norm makes diag(w) B and its column
    vectors, and the GEMM's epilogue (waiting on the reduce kernel's posts) gives
    norm(h) @ B; rows whose mean is far above their spread do not cancel."""
    from dataclasses import replace

    from overlap.kernels.norm_fold import fold_norm

    g = torch.Generator().manual_seed(21)
    world, rank, chunks, progs, eps = 2, 1, 3, 2, 1e-5
    # (m, n, k, block_k, segment, segment the plan takes). K = 40: whole-row statistics
    # (no segment width divides it), a row block in registers with masked columns;
    # K = 64 in 16-column segments, and in 16-column blocks with merged statistics
    # (segment=0); K = 96 in 32-column segments, 3 to a row (a masked merge); K = 512
    # in the width the plan picks (8 warps, 4 x 512 blocks: 256), and in segments of
    # two 256-column pieces
    for (m, n, k, block_k, seg, seg_taken) in ((21, 24, 40, None, None, 0), (19, 40, 64, 16, 16, 16),
                                               (19, 40, 64, 16, 0, 0), (17, 24, 96, None, 32, 32),
                                               (19, 16, 512, None, None, 256), (19, 16, 512, None, 512, 512)):
        sizes, segs = row_chunk_segments(m, chunks, 8)
        starts = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
        table = _table([replace(sg, wait_mult=progs) for sg in segs], n)
        for dt, shift in ((torch.float32, 0.0), (torch.float16, 0.0), (torch.float32, 1500.0)):
            for kind, with_bias, layout in (("layernorm", True, "wt"), ("layernorm", False, "kn"),
                                            ("rmsnorm", False, "wt")):
                parts = [(torch.randn(m, k, generator=g) + shift / world).to(dt) for _ in range(world)]
                res = torch.randn(m, k, generator=g).to(dt)
                w = (torch.rand(k, generator=g) + 0.5).to(dt)
                bias = torch.randn(k, generator=g).to(dt) if with_bias else None
                lin = torch.randn(n, k, generator=g).to(dt)
                b = lin.t() if layout == "wt" else lin.t().contiguous()
                recv = parts[1 - rank].unsqueeze(0).clone()
                h = torch.full((m, k), float("nan"), dtype=dt)
                stats = torch.full((m, 2), float("nan"))
                ready = torch.zeros(chunks, dtype=torch.int32)
                ew = ErrorWord("cpu", what="fold")
                plan = ReducePlan(parts[rank], recv, h, starts=starts, rflags=torch.ones(chunks, dtype=torch.int32),
                                  ready=ready, err=ew.word, rank=rank, world=world, programs=progs,
                                  residual=res, norm=kind, stats=stats, eps=eps,
                                  shape=ReduceShape(block_k=block_k, rows=4, segment=seg))
                assert (plan.seg is None) == (seg_taken == 0), (k, seg, plan.seg)
                if seg_taken:
                    assert plan.seg.numel() == 2 * m * (k // seg_taken)
                plan.launch(parts[rank], recv, h, epoch=1, residual=res, stats=stats)
                assert ready.tolist() == [progs] * chunks, ready
                h_ref = ((parts[0].float() + parts[1].float()).to(dt).float() + res.float()).to(dt)
                assert torch.equal(h, h_ref), (m, k, dt, kind)
                hf = h_ref.double()
                mean = hf.mean(1) if kind == "layernorm" else torch.zeros(m, dtype=torch.float64)
                var = hf.var(1, unbiased=False) if kind == "layernorm" else (hf * hf).mean(1)
                rstd = 1.0 / (var + eps).sqrt()
                torch.testing.assert_close(stats[:, 0].double(), rstd, rtol=1e-4, atol=0)
                torch.testing.assert_close(stats[:, 1].double(), mean * rstd, rtol=1e-4, atol=1e-4)
                bw, vec = fold_norm(b, w, bias, num_sms=4)
                assert bw.stride() == b.stride() and bw.dtype == dt
                assert torch.equal(bw, (b.float() * w.float()[:, None]).to(dt)), "B' is not w * B rounded"
                torch.testing.assert_close(vec[0].double(), bw.double().sum(0), rtol=1e-5, atol=1e-4)
                v_ref = (bias.double() @ b.double()) if bias is not None else torch.zeros(n, dtype=torch.float64)
                torch.testing.assert_close(vec[1].double(), v_ref, rtol=1e-5, atol=1e-4)
                c = torch.full((m, n), float("nan"), dtype=dt)
                launch_tile_gemm(h, bw, c, table, flags=ready, err=ew.word, epoch=1, grid=3, config=CFG,
                                 wait=True, rowstat=stats, colvec=vec)
                ew.check()
                y64 = _torch_norm(hf, kind, w.double(), None if bias is None else bias.double(), eps).double()
                ref = y64 @ b.double()
                # the reference's own error: y rounded to dt before its GEMM; and the folded
                # product's: h @ B' - mean * u in fp32 loses about eps32 * |mean| / std
                e_ref = _rel(y64.to(dt).double() @ b.double(), ref)
                tol = TOL[dt] + 8 * 2.0 ** -24 * shift
                assert _rel(c, ref) <= 2 * e_ref + tol, (m, k, dt, shift, kind, _rel(c, ref), e_ref)
    # segments with the last chunk missing: its rows are NaN (h and statistics),
    # every chunk is still posted, and the timeout names the flag; a bad width is refused
    m, k = 19, 64
    sizes, _ = row_chunk_segments(m, chunks, 8)
    starts = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    parts = [torch.randn(m, k, generator=g) for _ in range(world)]
    res = torch.randn(m, k, generator=g)
    rflags = torch.ones(chunks, dtype=torch.int32)
    rflags[chunks - 1] = 0
    h, stats = torch.full((m, k), float("nan")), torch.full((m, 2), float("nan"))
    ready = torch.zeros(chunks, dtype=torch.int32)
    ew = ErrorWord("cpu", what="fold")
    recv = parts[1 - rank].unsqueeze(0).clone()
    plan = ReducePlan(parts[rank], recv, h, starts=starts, rflags=rflags, ready=ready, err=ew.word, rank=rank,
                      world=world, programs=1, residual=res, norm="layernorm", stats=stats, max_spins=50)
    assert plan.seg is not None
    plan.launch(parts[rank], recv, h, epoch=1, residual=res, stats=stats)
    done = m - sizes[-1]
    assert ready.tolist() == [1] * chunks, ready
    h_ref = (parts[0] + parts[1]) + res
    assert torch.equal(h[:done], h_ref[:done])
    torch.testing.assert_close(stats[:done, 0].double(), 1.0 / (h_ref[:done].double().var(1, unbiased=False)
                                                                + eps).sqrt(), rtol=1e-4, atol=0)
    assert torch.isnan(h[done:]).all() and torch.isnan(stats[done:]).all(), "rows of a missing chunk hold numbers"
    try:
        ew.check()
    except FlagTimeoutError as e:
        assert (e.flag_idx, e.expected, e.seen) == (chunks - 1, 1, 0), e
    else:
        raise AssertionError("timeout not reported")
    for bad in (24, 128):
        try:
            ReducePlan(parts[rank], recv, h, starts=starts, rflags=rflags, ready=ready, err=ew.word, rank=rank,
                       world=world, programs=1, residual=res, norm="layernorm", stats=stats,
                       shape=ReduceShape(segment=bad))
        except ValueError as e:
            assert "segment" in str(e), e
        else:
            raise AssertionError(f"segment {bad} accepted")
    # the epilogue's vectors come together and in fp32
    a = torch.randn(16, 32, dtype=torch.float16)
    for rs, cv in ((torch.ones(16, 2), None), (torch.ones(16, 2, dtype=torch.float16), torch.ones(2, 16))):
        try:
            launch_tile_gemm(a, torch.randn(32, 16, dtype=torch.float16), torch.empty(16, 16, dtype=torch.float16),
                             _table([Segment(0, 0, 0, 16)], 16), grid=1, config=CFG, rowstat=rs, colvec=cv)
        except ValueError as e:
            assert "rowstat" in str(e), e
        else:
            raise AssertionError("bad rowstat/colvec accepted")

