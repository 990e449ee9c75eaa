"""Tile-flag GEMM scenarios under the Triton interpreter (run by test_kernels_interp.py).

Usage: TRITON_INTERPRET=1 python tests/_kernel_interp_worker.py SCENARIO
Prints "PASS <scenario>"; a failed check raises.
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from overlap.flags import ErrorWord, FlagProtocolError, FlagTimeoutError  # noqa: E402
from overlap.kernels.tile_gemm import GemmConfig, launch_tile_gemm, split_workspace  # noqa: E402
from overlap.kernels.add_norm import ReducePlan, launch_add_norm, launch_reduce_norm  # noqa: E402
from overlap.policies import (RowSync, Segment, all_gather_layout, all_gather_push_layout,  # noqa: E402
                              build_tile_table, push_slot, row_block_segments, row_chunk_segments,
                              rowsync_chain_tables, split_tail, tilesync_chain_tables)

CFG = GemmConfig(block_m=16, block_n=16, block_k=16, num_stages=1, num_warps=4)
CFG32 = GemmConfig(block_m=32, block_n=16, block_k=16, num_stages=1, num_warps=4)  # split tiles need 32 rows
TOL = {torch.float16: 2e-3, torch.float32: 1e-5}


def _table(segs, n, cfg=CFG, group_m=2):
    return torch.tensor(build_tile_table(segs, n, cfg.block_m, cfg.block_n, group_m), dtype=torch.int32)


def _rel(x, y):
    return ((x.double() - y.double()).norm() / y.double().norm()).item()


def scenario_schedules() -> None:
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
    print("PASS schedules")


def scenario_all_gather_layout() -> None:
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
    print("PASS all_gather_layout")


def scenario_push_layout() -> None:
    """The p2p all-gather: peers' chunks land in natural row order, each with its
    own flag (sender * chunks + c); with one sender's last chunk missing, only
    those rows stay unwritten and the timeout names that flag."""
    g = torch.Generator().manual_seed(11)
    world, ms, k, n = 3, 37, 32, 24
    for rank in range(world):
        for chunks in (1, 3):
            full = torch.randn(world * ms, k, generator=g, dtype=torch.float32)
            w = torch.randn(n, k, generator=g, dtype=torch.float32)
            lay = all_gather_push_layout(world, rank, ms, chunks, CFG.block_m)
            assert lay.gathered_to_natural() == list(range(world * ms))
            nch = len(lay.chunk_rows)
            peer_late = (rank + 1) % world
            for missing in (False, True):
                buf = torch.zeros_like(full)
                flags = torch.full((world * nch,), 6, dtype=torch.int32)  # the previous call's epoch
                for r in range(world):
                    if r == rank:
                        continue
                    for c, (start, rows) in enumerate(zip(lay.chunk_starts, lay.chunk_rows)):
                        if missing and r == peer_late and c == nch - 1:
                            continue  # this push never lands
                        buf[r * ms + start: r * ms + start + rows] = full[r * ms + start: r * ms + start + rows]
                        flags[r * nch + c] = 7
                ew = ErrorWord("cpu", what="push")
                c_out = torch.full((world * ms, n), float("nan"))
                launch_tile_gemm(full[rank * ms:(rank + 1) * ms].clone(), w.t(), c_out, _table(lay.segments, n),
                                 a2=buf, flags=flags, err=ew.word, epoch=7, rank=rank, grid=1 if missing else 4,
                                 config=CFG, wait=True, max_spins=100)
                ref = full.double() @ w.double().t()
                if not missing:
                    ew.check()
                    assert _rel(c_out, ref) < 1e-5, (rank, chunks)
                    continue
                start, rows = lay.chunk_starts[-1], lay.chunk_rows[-1]
                lo, hi = peer_late * ms + start, peer_late * ms + start + rows
                assert torch.isnan(c_out[lo:hi]).all(), "a tile of a missing push wrote"
                # rows scheduled before the missing chunk's tiles were computed
                assert _rel(c_out[rank * ms:(rank + 1) * ms], ref[rank * ms:(rank + 1) * ms]) < 1e-5
                try:
                    ew.check()
                except FlagTimeoutError as e:
                    assert (e.flag_idx, e.expected, e.seen) == (peer_late * nch + nch - 1, 7, 6), e
                else:
                    raise AssertionError("timeout not reported")
    print("PASS push_layout")


def scenario_reduce_norm() -> None:
    """The p2p all-reduce's consumer kernel: the partials pushed into slots are
    summed with the local one in rank order, the residual added, the norm taken,
    and every program posts every chunk once; with one peer's chunk missing, the
    timeout names its flag, those rows stay unwritten, and the chunk is still posted."""
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
                                       y=y, max_spins=50, block_k=block_k, rows=4, flag_stride=stride)
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
                    assert torch.isnan(h[done:].float()).all(), "rows of a missing chunk were written"
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
                              norm=kind, weight=w, bias=bias, y=y, block_k=block_k, rows=2, segment=seg,
                              y_rows=y_rows)
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
                   weight=w, y=y, rows=2, y_rows=6)
    except ValueError as e:
        assert "y_rows" in str(e), e
    else:
        raise AssertionError("y_rows 6 accepted")
    print("PASS reduce_norm")


def scenario_norm_fold() -> None:
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
                                  residual=res, norm=kind, stats=stats, block_k=block_k, rows=4, eps=eps,
                                  segment=seg)
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
    # segments with the last chunk missing: its rows stay unwritten (h and statistics),
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
    assert torch.isnan(h[done:]).all() and torch.isnan(stats[done:]).all(), "rows of a missing chunk were written"
    try:
        ew.check()
    except FlagTimeoutError as e:
        assert (e.flag_idx, e.expected, e.seen) == (chunks - 1, 1, 0), e
    else:
        raise AssertionError("timeout not reported")
    for bad in (24, 128):
        try:
            ReducePlan(parts[rank], recv, h, starts=starts, rflags=rflags, ready=ready, err=ew.word, rank=rank,
                       world=world, programs=1, residual=res, norm="layernorm", stats=stats, segment=bad)
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
    print("PASS norm_fold")


class _StandIn:
    """A stand-in for the runtime of a p2p op on rank 0 of 2 (``overlap.ops._runtime.Runtime``
    and its ``PeerHeap``), for the ops' ``_fused_p2p`` with kernels interpreted: the
    peer's pushes have landed when a call starts (its flags at the call's epoch, its rows
    where the test put them with ``recv``), this rank's pushes and stream work are only
    recorded. ``with stand_in.patched():`` replaces the CUDA stream calls."""

    class Stream:
        pass

    class Flags:
        def __init__(self, n):
            self.local = torch.zeros(n, dtype=torch.int32)
            self.remote = torch.zeros(n, dtype=torch.int32)
            self.epoch = 0

        def next_epoch(self):
            self.epoch += 1
            self.local.fill_(self.epoch)
            return self.epoch

        def peer(self, r):
            return self.remote

    class Block:
        def __init__(self, nbytes):
            self.nbytes, self.ptrs, self.bufs = nbytes, [1 << 20, 1 << 30], {}

        def tensor(self, rank, off, shape, dtype):  # both parities share one buffer here
            return self.bufs.setdefault((tuple(shape), dtype), torch.zeros(shape, dtype=dtype))

    world, rank, ranks, device, num_sms = 2, 0, (0, 1), torch.device("cpu"), 12
    group = None  # the default wait bound's group (no process group here)

    STRIDE = 512  # overlap._p2p.flag_stride(2)

    def __init__(self):
        self.blocks, self.fl, self.errs, self.counters, self.pushes = {}, {}, {}, {}, []
        self.disagree = False  # the peer's signature words differ from this rank's
        self.comm_stream, self.aux_stream, self.copy_stream = self.Stream(), self.Stream(), self.Stream()
        self.copies = []  # memcpy_async calls made outside push (dst, src, nbytes)

    def recv(self, name, shape, dtype):
        """The peer's landing buffer of op ``name`` (made on first use)."""
        return self.block(name, 0).tensor(0, 0, shape, dtype)

    def p2p(self):
        return self

    def block(self, name, nbytes):
        return self.blocks.setdefault(name, self.Block(nbytes))

    def flags(self, name, n):  # a region of 1024 flags per name, as overlap._p2p.PeerHeap's
        assert n <= 1024, n
        return self.fl.setdefault(name, self.Flags(1024))

    def err(self, name):
        return self.errs.setdefault(name, ErrorWord("cpu", what=name))

    def counter(self, name, n=1):
        c = self.counters.get(name)
        if c is None or c.numel() < n:
            c = self.counters[name] = torch.zeros(n, dtype=torch.int32)
        return c

    def push(self, dst, src, nbytes, flags, idx, value):
        self.pushes.append((dst, src, nbytes, idx, value))

    def p2p_begin(self, *a):
        pass

    fork = join = p2p_end = p2p_begin

    def patched(self):
        import contextlib
        from unittest import mock

        from overlap import flags as fl

        def write_value(stream, flags, idx, value):
            flags[idx] = value
            # a signature word this rank writes into the peer's flags: the peer makes the
            # same call (or, with ``disagree``, another one) and writes its own into every
            # region of this rank's flags at the same word
            off = idx % self.STRIDE
            if off >= self.STRIDE - 2:
                for f in self.fl.values():
                    if flags is f.remote:
                        v = value ^ 2 if self.disagree else value
                        for r in range(0, f.local.numel(), self.STRIDE):
                            f.local[r + off] = v

        def zero(stream, t, n):
            t[:n] = 0

        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(torch.cuda, "current_stream", lambda *a: self.Stream()))
        stack.enter_context(mock.patch.object(torch.cuda, "set_stream", lambda s: None))
        stack.enter_context(mock.patch.object(fl, "stream_write_value", write_value))
        stack.enter_context(mock.patch.object(fl, "stream_zero", zero))
        stack.enter_context(mock.patch.object(fl, "stream_wait_value", lambda *a: None))
        from overlap import _p2p
        stack.enter_context(mock.patch.object(_p2p, "memcpy_async",
                                              lambda dst, src, nbytes, stream: self.copies.append((dst, src, nbytes))))
        return stack


def scenario_p2p_all_reduce_op() -> None:
    """The p2p all-reduce op's host side (``_fused_p2p``) on a stand-in runtime, its
    kernels interpreted: rank 0 of 2, the peer's pushes already landed (its partial in
    the receive slot, its flags at the call's epoch), streams and pushes recorded only.
    Calls with changing inputs over both call parities, with and without residual,
    LayerNorm / RMSNorm, the norm folded or not, both B layouts, give-back on and off,
    the reduce kernel beside the GEMM (its short column blocks), the last chunk's
    tiles split along K or not: c and h match torch, and each call
    queues one push per chunk of the local partial."""
    from overlap.ops import Norm, OverlapConfig
    from overlap.ops import all_reduce as ar

    rt = _StandIn()
    g = torch.Generator().manual_seed(3)
    m, n, k = 300, 48, 64  # row chunks of 128 (the op's alignment), 128, 44
    with rt.patched():
        calls = 0
        for kind, with_res, fold, layout, give_back, split in (
                (None, False, False, "wt", True, 0), ("layernorm", True, False, "wt", True, 0),
                ("layernorm", True, True, "wt", True, 0), ("layernorm", True, True, "kn", False, 0),
                ("rmsnorm", False, True, "wt", True, 0), (None, True, False, "kn", True, 4),
                ("layernorm", True, True, "wt", True, 2), ("layernorm", True, False, "wt", "shared", 0),
                ("layernorm", True, True, "kn", "shared", 2)):
            cfg = OverlapConfig(chunks=3, reduce_ctas=2, fold_norm=fold, give_back=give_back is True, check="sync",
                                transport="p2p", gemm=CFG32 if split else CFG, split_tail=split,
                                reduce_shared=give_back == "shared")
            if give_back == "shared":  # the GEMM on every SM, the reduce kernel's 2 programs beside it
                p = ar._plan(rt, m, n, k, cfg, "p2p")
                assert (p.grid, p.give_back_grid, p.reduce_programs) == (12, 0, 2), p
                try:  # one reduce program per SM at most
                    ar._plan(rt, m, n, k, OverlapConfig(reduce_ctas=13, reduce_shared=True), "p2p")
                except ValueError as e:
                    assert "one reduce program per SM" in str(e), e
                else:
                    raise AssertionError("13 shared reduce programs on 12 SMs accepted")
                try:  # the small reduce programs fit beside the plain GEMM's only
                    ar._plan(rt, m, n, k, OverlapConfig(reduce_ctas=2, reduce_shared=True,
                                                        gemm=GemmConfig(warp_specialize=True)), "p2p")
                except ValueError as e:
                    assert "warp-specialized" in str(e), e
                else:
                    raise AssertionError("reduce_shared with a warp-specialized GEMM accepted")
            if split:  # the last chunk's 2 x 3 tiles, in 2 K pieces each on the 12 SMs
                assert ar._plan(rt, m, n, k, cfg, "p2p").split == (ar._plan(rt, m, n, k, cfg, "p2p").table.shape[0]
                                                                   - 12, 2)
            lin = (torch.randn(n, k, generator=g) / k ** 0.5).half()
            b = lin.t() if layout == "wt" else lin.t().contiguous()
            norm = None
            if kind:
                norm = Norm(kind, (torch.rand(k, generator=g) + 0.5).half(),
                            torch.randn(k, generator=g).half() if kind == "layernorm" else None)
            for it in range(3):  # both call parities, then the first again: plans reused
                x = torch.randn(m, k, generator=g).half()
                peer = torch.randn(m, k, generator=g).half()
                res = torch.randn(m, k, generator=g).half() if with_res else None
                rt.recv("all_reduce_matmul", (1, m, k), torch.float16)[0].copy_(peer)
                before = len(rt.pushes)
                c, h = ar._fused_p2p(rt, x, b, res, norm, cfg)
                pushes = rt.pushes[before:]
                assert [(src - x.data_ptr(), nb) for _, src, nb, _, _ in pushes] == \
                    [(0, 128 * k * 2), (128 * k * 2, 128 * k * 2), (256 * k * 2, 44 * k * 2)], pushes
                h_ref = (x.float() + peer.float()).half()
                if res is not None:
                    h_ref = (h_ref.float() + res.float()).half()
                assert torch.equal(h, h_ref), (kind, fold, it)
                y = h_ref.float()
                if norm is not None:
                    y = _torch_norm(h_ref, kind, norm.weight, norm.bias, norm.eps).half().float()
                ref = y.double() @ b.double()
                assert _rel(c, ref) < 1e-2, (kind, with_res, fold, layout, it, _rel(c, ref))
                calls += 1
    assert ar.stats["p2p"] >= calls, ar.stats
    with rt.patched():
        # two-shot: rank 0 reduces rows 0..255 (2 chunks), rank 1 rows 256..299 (the peer's
        # reduced rows, and their statistics, land in the gather buffer)
        for kind, with_res, mode, split in ((None, False, True, 0), ("layernorm", True, True, 2),
                                            ("rmsnorm", True, "shared", 0), (None, True, False, 4)):
            cfg = OverlapConfig(chunks=3, reduce_ctas=2, fold_norm=kind is not None, give_back=mode is True,
                                reduce_shared=mode == "shared", two_shot=True, check="sync", transport="p2p",
                                gemm=CFG32 if split else CFG, split_tail=split)
            p = ar._plan(rt, m, n, k, cfg, "p2p")
            assert p.two_shot.rows == (256, 44) and p.chunk_rows == (128, 128), p
            b = ((torch.randn(n, k, generator=g) / k ** 0.5).half()).t()
            norm = None
            if kind:
                norm = Norm(kind, (torch.rand(k, generator=g) + 0.5).half(),
                            torch.randn(k, generator=g).half() if kind == "layernorm" else None)
            blk = rt.block("all_reduce_matmul.two_shot", 0)
            for it in range(3):
                x = torch.randn(m, k, generator=g).half()
                peer = torch.randn(m, k, generator=g).half()
                res = torch.randn(m, k, generator=g).half() if with_res else None
                h_ref = (x.float() + peer.float()).half()
                if res is not None:
                    h_ref = (h_ref.float() + res.float()).half()
                blk.tensor(0, 0, (1, 256, k), torch.float16)[0].copy_(peer[:256])  # peer's partial of my rows
                blk.tensor(0, 0, (m, k), torch.float16)[256:].copy_(h_ref[256:])  # peer's reduced rows
                if norm is not None:
                    hf = h_ref[256:].float()
                    mean = hf.mean(1) if kind == "layernorm" else torch.zeros(hf.shape[0])
                    rstd = torch.rsqrt((hf - mean[:, None]).pow(2).mean(1) + norm.eps)
                    blk.tensor(0, 0, (m, 2), torch.float32)[256:].copy_(torch.stack([rstd, mean * rstd], 1))
                before, cbefore = len(rt.pushes), len(rt.copies)
                c, h = ar._fused_p2p(rt, x, b, res, norm, cfg)
                assert torch.equal(h, h_ref), (kind, mode, it)
                y = h_ref.float() if norm is None else _torch_norm(h_ref, kind, norm.weight, norm.bias,
                                                                   norm.eps).half().float()
                assert _rel(c, y.double() @ b.double()) < 1e-2, (kind, mode, it, _rel(c, y.double() @ b.double()))
                # my partial of the peer's rows goes out (one chunk of 44 rows); my 2 reduced
                # chunks (and their statistics with a norm) go back
                assert [(src - x.data_ptr(), nb) for _, src, nb, _, _ in rt.pushes[before:]] == \
                    [(256 * k * 2, 44 * k * 2)], rt.pushes[before:]
                copies = rt.copies[cbefore:]
                want = [(h.data_ptr() + r0 * k * 2, 128 * k * 2) for r0 in (0, 128)]
                assert [(src, nb) for _, src, nb in copies if nb == 128 * k * 2] == want, copies
                assert len(copies) == (4 if norm is not None else 2), copies
        try:
            ar._fused_p2p(rt, x, b, None, Norm("rmsnorm", torch.ones(k).half()),
                          OverlapConfig(two_shot=True, transport="p2p", gemm=CFG))
        except ValueError as e:
            assert "fold_norm" in str(e), e
        else:
            raise AssertionError("two_shot with an unfolded norm accepted")
    print("PASS p2p_all_reduce_op")


def scenario_p2p_all_gather_op() -> None:
    """The p2p all-gather op's host side on the stand-in runtime, kernels interpreted:
    rank 0 of 2 with the peer's shard landed in its rows of the gathered buffer; over
    both call parities, both B layouts, one and two chunks, ``return_gathered``, the
    tiles after the last full wave split along K or not: C is the gathered A times B,
    the gathered copy holds both shards, and each call queues one push per chunk of
    the local shard."""
    from overlap.ops import OverlapConfig
    from overlap.ops import all_gather as ag

    rt = _StandIn()
    g = torch.Generator().manual_seed(4)
    ms, n, k = 150, 40, 48
    with rt.patched():
        calls = 0
        for chunks, layout, ret, split in ((1, "wt", False, 0), (2, "kn", True, 0), (2, "wt", True, 0),
                                           (1, "kn", False, 8), (2, "wt", True, 2)):
            cfg = OverlapConfig(chunks=chunks, check="sync", transport="p2p", gemm=CFG32 if split else CFG,
                                split_tail=split)
            if split:  # 5 + 5 row tiles x 3 column tiles: 30 % 12 = 6 left, in 2 pieces each
                p = ag._plan(rt, ms, n, k, cfg, "p2p")
                assert p.split == (p.table.shape[0] - 12, 2), p.split
            lin = (torch.randn(n, k, generator=g) / k ** 0.5).half()
            b = lin.t() if layout == "wt" else lin.t().contiguous()
            for it in range(3):
                a = torch.randn(ms, k, generator=g).half()
                peer = torch.randn(ms, k, generator=g).half()
                rt.recv("all_gather_matmul", (2 * ms, k), torch.float16)[ms:].copy_(peer)
                before = len(rt.pushes)
                out = ag._fused_p2p(rt, a, b, ret, cfg)
                c, gathered = out if ret else (out, None)
                pushes = rt.pushes[before:]
                assert sum(nb for _, _, nb, _, _ in pushes) == ms * k * 2 and len(pushes) == chunks, pushes
                assert min(src for _, src, _, _, _ in pushes) == a.data_ptr(), pushes
                full = torch.cat([a, peer])
                assert _rel(c, full.double() @ b.double()) < 1e-2, (chunks, layout, it)
                if ret:
                    assert torch.equal(gathered, full), "the gathered copy differs"
                calls += 1
    assert ag.stats["p2p"] >= calls, ag.stats
    print("PASS p2p_all_gather_op")


def scenario_p2p_disagree() -> None:
    """The peer-copy ops' signature check on the stand-in runtime, kernels interpreted:
    the peer's signature words for this call differ from this rank's (the ranks disagree
    on the call although the host's check was cached): the all-gather's GEMM and the
    all-reduce's reduce kernel record it, the call raises RanksDisagreeError naming the
    signatures, and the next call, the ranks agreeing again, is correct."""
    from dataclasses import replace

    from overlap.flags import RanksDisagreeError
    from overlap.ops import OverlapConfig
    from overlap.ops import all_gather as ag
    from overlap.ops import all_reduce as ar

    rt = _StandIn()
    g = torch.Generator().manual_seed(9)
    ms, n, k = 64, 32, 48
    cfg = OverlapConfig(chunks=2, check="sync", transport="p2p", gemm=CFG)
    lin = (torch.randn(n, k, generator=g) / k ** 0.5).half()
    with rt.patched():
        for disagree in (False, True, False, True, False):
            rt.disagree = disagree
            a = torch.randn(ms, k, generator=g).half()
            peer = torch.randn(ms, k, generator=g).half()
            rt.recv("all_gather_matmul", (2 * ms, k), torch.float16)[ms:].copy_(peer)
            try:
                c = ag._fused_p2p(rt, a, lin.t(), False, cfg)
            except RanksDisagreeError as e:
                assert disagree and "disagree" in str(e) and e.rank == 0, e
                assert e.flag_idx % rt.STRIDE >= rt.STRIDE - 2, e.flag_idx
            else:
                assert not disagree, "a peer's other signature was not caught (all-gather)"
                assert _rel(c, torch.cat([a, peer]).double() @ lin.t().double()) < 1e-2
            x = torch.randn(ms, k, generator=g).half()
            xp = torch.randn(ms, k, generator=g).half()
            rt.recv("all_reduce_matmul", (1, ms, k), torch.float16)[0].copy_(xp)
            try:
                c2, h = ar._fused_p2p(rt, x, lin.t(), None, None, replace(cfg, reduce_ctas=4))
            except RanksDisagreeError as e:
                assert disagree and "disagree" in str(e), e
            else:
                assert not disagree, "a peer's other signature was not caught (all-reduce)"
                assert _rel(h, x.double() + xp.double()) < 1e-2
    print("PASS p2p_disagree")


def scenario_posts_and_gelu() -> None:
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
    print("PASS posts_and_gelu")


def scenario_wrap() -> None:
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
    print("PASS wrap")


def scenario_timeout() -> None:
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
        assert torch.isnan(c[16:]).all(), "a tile that timed out must not write"
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
    print("PASS timeout")


def scenario_dispatch_counter() -> None:
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
    print("PASS dispatch_counter")


def _torch_norm(h, kind, w, b, eps):
    if kind == "layernorm":
        return torch.nn.functional.layer_norm(h.float(), (h.shape[1],), w.float(), None if b is None else b.float(),
                                              eps)
    return torch.nn.functional.rms_norm(h.float(), (h.shape[1],), w.float(), eps)


def scenario_add_norm() -> None:
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
    print("PASS add_norm")


def scenario_row_chunks() -> None:
    """The all-reduce op's pipeline, one rank, no NCCL: chunks land one by one
    (add + norm, then a flag); each GEMM tile waits on its own chunk only. With
    the last chunk's flag never set, exactly that chunk's rows stay unwritten
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
            assert torch.isnan(c[done:]).all(), "a tile of an unlanded chunk wrote"
            try:
                ew.check()
            except FlagTimeoutError as e:
                assert (e.flag_idx, e.expected, e.seen) == (chunks - 1, 9, 8), e
            else:
                raise AssertionError("timeout not reported")
    print("PASS row_chunks")


def scenario_chain() -> None:
    """fc1 (GeLU epilogue, posts) -> fc2 (RowSync waits) through the chain's tables:
    the result matches torch; fc2 run before fc1 (the interpreter runs one kernel
    to the end before the next) times out on row block 0 instead of hanging,
    and the previous call's flags do not satisfy it."""
    g = torch.Generator().manual_seed(7)
    m, k, f, n = 40, 32, 48, 24
    x = torch.randn(m, k, generator=g, dtype=torch.float16)
    w1 = torch.randn(f, k, generator=g, dtype=torch.float16) / k ** 0.5  # nn.Linear layouts
    w2 = torch.randn(n, f, generator=g, dtype=torch.float16) / f ** 0.5
    prod_l, cons_l = rowsync_chain_tables(m, f, n, CFG.block_m, CFG.block_n, CFG.block_n)
    prod, cons = (torch.tensor(t, dtype=torch.int32) for t in (prod_l, cons_l))
    n_prod = -(-f // CFG.block_n)
    flags = torch.zeros(8, dtype=torch.int32)
    for epoch in (1, 2):
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
    print("PASS chain")


def scenario_tilesync() -> None:
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
    assert torch.isnan(y[:16]).all(), "a tile whose K group timed out must not write"
    try:
        launch_tile_gemm(mid, w2.t(), y, cons, flags=flags, err=ew.word, epoch=3, grid=1, config=CFG,
                         k_wait=2)
    except ValueError as e:
        assert "k_wait" in str(e)
    else:
        raise AssertionError("k_wait without waits accepted")
    print("PASS tilesync")


def scenario_split_tail() -> None:
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
    print("PASS split_tail")


def scenario_late_peer_new_m() -> None:
    """A peer that arrives late, and M that changes every call, on the p2p all-gather op's
    host side (stand-in runtime, kernels interpreted). Each call's peer rows and flags
    land 1.5 s after the call starts (past the old 500 ms default bound), from another
    thread, while this rank's GEMM waits: with default settings every call is correct and
    raises nothing, and the bound the op hands its kernels is the process groups' timeout
    (minutes; the interpreter itself bounds a wait by its spins, not by time). The M/R of
    the calls changes every call within two buckets: the shared buffer is asked for the
    bucket's size (``row_bucket``), so it grows once per bucket, not once per M."""
    import threading
    import time
    from unittest import mock

    from overlap import flags as fl
    from overlap.ops import OverlapConfig
    from overlap.ops import _runtime as rtm
    from overlap.ops import all_gather as ag
    from overlap.policies import row_bucket

    os.environ.pop("OVERLAP_WAIT_TIMEOUT_MS", None)
    default_ms = fl.default_timeout_ms()
    assert default_ms >= 60_000, default_ms

    class LateFlags(_StandIn.Flags):
        def next_epoch(self):  # the peer's flags land later, from the thread below
            self.epoch += 1
            return self.epoch

    rt = _StandIn()
    rt.Flags = LateFlags
    asked = []
    block = rt.block

    def sized_block(name, nbytes):
        if nbytes:  # (not the test's own ``recv``)
            asked.append(nbytes)
        return block(name, nbytes)

    rt.block = sized_block
    bounds = []
    real_plan = rtm.gemm_plan

    def gemm_plan(*a, **kw):
        bounds.append(kw["timeout_ns"])
        return real_plan(*a, **kw)

    g = torch.Generator().manual_seed(11)
    n, k = 32, 48
    cfg = OverlapConfig(chunks=2, check="sync", transport="p2p", gemm=CFG)
    lin = (torch.randn(n, k, generator=g) / k ** 0.5).half()
    with rt.patched(), mock.patch.object(ag, "gemm_plan", gemm_plan):
        for ms in (40, 100, 77, 130, 200, 150):
            a = torch.randn(ms, k, generator=g).half()
            peer = torch.randn(ms, k, generator=g).half()
            recv = rt.recv("all_gather_matmul", (2 * ms, k), torch.float16)
            recv[ms:].fill_(float("nan"))  # not landed yet
            f = rt.flags("all_gather_matmul", 1)

            def land(epoch=f.epoch + 1, recv=recv, peer=peer, ms=ms, f=f):
                time.sleep(1.5)
                recv[ms:].copy_(peer)
                words = torch.arange(f.local.numel())
                chunk_words = (words % rt.STRIDE) < rt.STRIDE - 2  # not the signature words
                f.local[chunk_words] = epoch

            th = threading.Thread(target=land)
            t0 = time.monotonic()
            th.start()
            c = ag._fused_p2p(rt, a, lin.t(), False, cfg)
            th.join()
            assert time.monotonic() - t0 >= 1.5
            assert _rel(c, torch.cat([a, peer]).double() @ lin.t().double()) < 1e-2, ms
    assert bounds and all(b == int(default_ms * 1e6) for b in bounds), bounds
    row_bytes = k * 2
    assert asked == [2 * (-(-2 * row_bucket(ms) * row_bytes // 1024) * 1024) for ms in (40, 100, 77, 130, 200, 150)]
    assert len(set(asked)) == 2, asked  # two buckets (128, 256 rows), six M
    print("PASS late_peer_new_m")



class _NcclStandIn:
    """A stand-in for the runtime of an NCCL-transport op at world size 1, for the ops'
    ``_fused`` host side with kernels interpreted. The interpreter runs a grid to its end
    at launch, so stream order is program order: a stream wait on a chunk's counter
    asserts that the counter is complete (every tile of the chunk posted), and the
    collectives copy (one rank)."""

    class Stream:
        def wait_event(self, ev):
            pass

    class Event:
        def record(self, stream=None):
            pass

    class Comm:
        def __init__(self, log):
            self.log = log

        def all_reduce(self, send, recv, stream=None):
            self.log.append(("all_reduce", send.shape[0]))
            if recv.data_ptr() != send.data_ptr():
                recv.copy_(send)

        def reduce_scatter(self, send, recv, stream=None):
            self.log.append(("reduce_scatter", send.shape[0]))
            recv.copy_(send)

    class Order:
        def __init__(self):
            import threading

            self.lock = threading.RLock()

        def begin(self, cur):
            pass

        end = begin

    world, rank, ranks, device, num_sms, group = 1, 0, (0,), torch.device("cpu"), 12, None

    def __init__(self):
        from overlap.ops._runtime import LocalWords

        self.comm_stream, self.aux_stream = self.Stream(), self.Stream()
        self.order, self._local, self.errs, self.log, self.waits = self.Order(), LocalWords(self.device), {}, [], []

    def local_words(self, name, n_counters, n_flags):
        return self._local.get(name, n_counters, n_flags)

    def comm(self, max_ctas):
        return self.Comm(self.log)

    def err(self, name):
        return self.errs.setdefault(name, ErrorWord("cpu", what=name))

    def fork(self, *streams):
        pass

    join = fork

    def patched(self):
        import contextlib
        from unittest import mock

        from overlap import flags as fl

        def wait_value(stream, flags, idx, value):
            self.waits.append((idx, value))
            assert int(flags[idx]) >= value, f"the comm stream would wait on counter {idx}: {int(flags[idx])} < {value}"

        def write_value(stream, flags, idx, value):
            flags[idx] = value

        def zero(stream, t, n):
            t[:n] = 0

        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(torch.cuda, "current_stream", lambda *a: self.Stream()))
        stack.enter_context(mock.patch.object(torch.cuda, "set_stream", lambda s: None))
        stack.enter_context(mock.patch.object(torch.cuda, "Event", self.Event))
        stack.enter_context(mock.patch.object(fl, "stream_write_value", write_value))
        stack.enter_context(mock.patch.object(fl, "stream_zero", zero))
        stack.enter_context(mock.patch.object(fl, "stream_wait_value", wait_value))
        return stack


def scenario_nccl_pipeline() -> None:
    """The NCCL transport's host side, kernels interpreted, at world size 1: the producer
    ops (``matmul_reduce_scatter`` / ``matmul_all_reduce``, per-chunk counters the comm
    stream waits on) and the block boundary (``matmul_all_reduce_matmul``: the producer's
    counters, each chunk all-reduced, added and normed, its flag, the consumer's tiles),
    with new inputs every call, 1-4 chunks, residual and LayerNorm / RMSNorm or none, both
    B layouts, the consumer's split tail and give-back grid: outputs against torch, one
    wait per chunk for that chunk's tile count, one collective per chunk."""
    from overlap.ops import Norm, OverlapConfig
    from overlap.ops import boundary as bd
    from overlap.ops import matmul_reduce as mr

    rt = _NcclStandIn()
    g = torch.Generator().manual_seed(5)
    m, n, k, n2 = 300, 48, 64, 32  # row chunks of 128 (the ops' alignment)
    with rt.patched():
        for chunks, kind, with_res, layout, give_back, split in (
                (1, None, False, "wt", True, 0), (3, "layernorm", True, "wt", True, 0),
                (2, "rmsnorm", False, "kn", False, 0), (3, "layernorm", True, "kn", True, 2),
                (3, None, True, "wt", True, 0)):
            cfg = OverlapConfig(chunks=chunks, nccl_ctas=2, sm_margin=0, give_back=give_back, check="sync",
                                transport="nccl", gemm=CFG32 if split else CFG, split_tail=split)
            sizes = mr.reduce_scatter_layout(1, m, chunks, mr.CHUNK_ALIGN, scatter=False).chunk_rows
            w1 = (torch.randn(n, k, generator=g) / k ** 0.5).half()
            w2 = (torch.randn(n2, n, generator=g) / n ** 0.5).half()
            b = w1.t() if layout == "wt" else w1.t().contiguous()
            b2 = w2.t() if layout == "wt" else w2.t().contiguous()
            norm = None
            if kind:
                norm = Norm(kind, (torch.rand(n, generator=g) + 0.5).half(),
                            torch.randn(n, generator=g).half() if kind == "layernorm" else None)
            for it in range(2):  # new inputs; plans and words reused
                a = torch.randn(m, k, generator=g).half()
                res = torch.randn(m, n, generator=g).half() if with_res else None
                want = a.float() @ w1.float().t()
                # the producer ops
                del rt.log[:], rt.waits[:]
                got = mr._fused(rt, "matmul_reduce_scatter", a, b, None, cfg)
                assert _rel(got, want) < TOL[torch.float16], ("mmrs", chunks, it)
                got = mr._fused(rt, "matmul_all_reduce", a, b, res, cfg)
                want_h = want + (res.float() if res is not None else 0)
                assert _rel(got, want_h) < TOL[torch.float16], ("mmar", chunks, it)
                counts = mr._plan(rt, "matmul_all_reduce", m, n, k, cfg).counts
                tiles = [-(-r // cfg.gemm.block_m) * -(-n // cfg.gemm.block_n) for r in sizes]
                assert list(counts) == tiles, (counts, tiles)
                assert [v for _, v in rt.waits] == tiles * 2 and rt.log == [("reduce_scatter", r) for r in sizes] + \
                    [("all_reduce", r) for r in sizes], (rt.waits, rt.log)
                # the boundary
                del rt.log[:], rt.waits[:]
                c, h = bd._fused(rt, a, b, b2, res, norm, cfg)
                y = want_h if norm is None else (torch.nn.functional.layer_norm(want_h, (n,), norm.weight.float(),
                                                                                 norm.bias.float())
                                                 if kind == "layernorm" else
                                                 torch.nn.functional.rms_norm(want_h, (n,), norm.weight.float()))
                assert _rel(h, want_h) < TOL[torch.float16], ("boundary h", chunks, kind, it)
                assert _rel(c, y @ w2.float().t()) < 5e-3, ("boundary c", chunks, kind, it, _rel(c, y @ w2.float().t()))
                assert [v for _, v in rt.waits] == tiles and rt.log == [("all_reduce", r) for r in sizes], \
                    (rt.waits, rt.log)
                p2 = bd._ar._plan(rt, m, n2, n, cfg)
                words = rt.local_words(bd.OP + ".consumer", p2.counters, chunks)
                assert words.flags[:chunks].tolist() == [1] * chunks, words  # every chunk's flag posted once
    print("PASS nccl_pipeline")

if __name__ == "__main__":
    globals()["scenario_" + sys.argv[1]]()
