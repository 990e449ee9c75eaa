"""The ops' host side with their kernels interpreted, on stand-in runtimes: the peer-copy
transport's pushes, reduce and signatures, a late peer with a new M every call, and the
NCCL transport's producer ops and block boundary.

Each test runs in a child process with TRITON_INTERPRET=1 (``tests._interp``)."""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from tests._interp import interpreted
from tests.kernels._interp_common import (CFG, CFG32, ErrorWord, FlagTimeoutError, GemmConfig, TOL, _NcclStandIn, _StandIn, _rel, _table, _torch_norm, all_gather_push_layout, launch_tile_gemm)


@interpreted
def test_push_layout() -> None:
    """The p2p all-gather: peers' chunks land in natural row order, each with its
    own flag (sender * chunks + c); with one sender's last chunk missing, only
    those rows are NaN and the timeout names that flag."""
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
                assert torch.isnan(c_out[lo:hi]).all(), "a tile of a missing push stored numbers"
                # rows scheduled before the missing chunk's tiles were computed
                assert _rel(c_out[rank * ms:(rank + 1) * ms], ref[rank * ms:(rank + 1) * ms]) < 1e-5
                try:
                    ew.check()
                except FlagTimeoutError as e:
                    assert (e.flag_idx, e.expected, e.seen) == (peer_late * nch + nch - 1, 7, 6), e
                else:
                    raise AssertionError("timeout not reported")



@interpreted
def test_p2p_all_reduce_op() -> None:
    """The p2p all-reduce op's host side (``_fused_p2p``) on a stand-in runtime, its
    kernels interpreted: rank 0 of 2, the peer's pushes already landed (its partial in
    the receive slot, its flags at the call's epoch), streams and pushes recorded only.
    Calls with changing inputs over both call parities, with and without residual,
    LayerNorm / RMSNorm, the norm folded or not, both B layouts, give-back on and off,
    the reduce kernel beside the GEMM (its short column blocks), the last chunk's
    tiles split along K or not: c and h match torch, and each call
    queues one push per chunk of the local partial, and the GEMM grid is queued behind a
    gate on chunk 0's ready flag at the reduce programs' count."""
    from unittest import mock

    from overlap.kernels import gate as gate_mod
    from overlap.ops import Norm, OverlapConfig
    from overlap.ops import all_reduce as ar
    from overlap.ops import all_reduce_p2p as arp

    real_gate = gate_mod.launch_gate
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
                gates, only = [], []
                real_plan = arp.gemm_plan
                with mock.patch.object(gate_mod, "launch_gate",
                                       lambda *a_, **kw: (gates.append(a_[1:3]), real_gate(*a_, **kw))), \
                        mock.patch.object(arp, "gemm_plan",
                                          lambda *a_, **kw: (only.append(kw.get("tile_only")), real_plan(*a_, **kw))[1]):
                    c, h = arp._fused_p2p(rt, x, b, res, norm, cfg)
                assert gates == [(0, ar._plan(rt, m, n, k, cfg, "p2p").reduce_programs)], gates
                # the reduce programs beside the GEMM's count on the tile GEMM's room: never Gluon
                assert only == [arp.SHARED_SMS if give_back == "shared" else None], only
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
                c, h = arp._fused_p2p(rt, x, b, res, norm, cfg)
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
            arp._fused_p2p(rt, x, b, None, Norm("rmsnorm", torch.ones(k).half()),
                          OverlapConfig(two_shot=True, transport="p2p", gemm=CFG))
        except ValueError as e:
            assert "fold_norm" in str(e), e
        else:
            raise AssertionError("two_shot with an unfolded norm accepted")



@interpreted
def test_p2p_all_gather_op() -> None:
    """The p2p all-gather op's host side on the stand-in runtime, kernels interpreted:
    rank 0 of 2 with the peer's shard landed in its rows of the gathered buffer; over
    both call parities, both B layouts, one and two chunks, ``return_gathered``, the
    tiles after the last full wave split along K or not: C is the gathered A times B,
    the gathered copy holds both shards, and each call queues one push per chunk of
    the local shard. The per-tile GEMM runs as the local shard's grid, then a gate on the
    first peer chunk's flag at the call's epoch, then the peer's grid (and one grid with
    the gates off)."""
    import os
    from unittest import mock

    from overlap.kernels import gate as gate_mod
    from overlap.ops import OverlapConfig
    from overlap.ops import all_gather as ag
    from overlap.ops import all_gather_p2p as agp

    real_gate = gate_mod.launch_gate
    rt = _StandIn()
    g = torch.Generator().manual_seed(4)
    ms, n, k = 150, 40, 48
    with rt.patched():
        calls = 0
        for chunks, layout, ret, split, flat in ((1, "wt", False, 0, False), (2, "kn", True, 0, False),
                                                 (2, "wt", True, 0, False), (1, "kn", False, 8, False),
                                                 (2, "wt", True, 2, False), (2, "kn", True, 0, True)):
            cfg = OverlapConfig(chunks=chunks, check="sync", transport="p2p",
                                gemm=replace(CFG32 if split else CFG, flatten=flat), split_tail=split,
                                give_back=not flat)
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
                gates = []
                # the second call with the gates off (OVERLAP_STREAM_GATE=0): one grid over the
                # whole table, which must not take the gated calls' launch plans
                with mock.patch.object(gate_mod, "launch_gate",
                                       lambda *a_, **kw: (gates.append(a_[1:3]), real_gate(*a_, **kw))), \
                        mock.patch.dict(os.environ, {"OVERLAP_STREAM_GATE": "0" if it == 1 else "1"}):
                    out = agp._fused_p2p(rt, a, b, ret, cfg)
                epoch = rt.flags("all_gather_matmul", 1).epoch
                assert gates == ([] if flat or it == 1 else [(rt.STRIDE, epoch)]), (flat, gates)  # the peer's chunk 0
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



@interpreted
def test_p2p_disagree() -> None:
    """The peer-copy ops' signature check on the stand-in runtime, kernels interpreted:
    the peer's signature words for this call differ from this rank's (the ranks disagree
    on the call although the host's check was cached): the all-gather's GEMM and the
    all-reduce's reduce kernel record it, the call raises RanksDisagreeError naming the
    signatures, and the next call, the ranks agreeing again, is correct."""
    from dataclasses import replace

    from overlap.flags import RanksDisagreeError
    from overlap.ops import OverlapConfig
    from overlap.ops import all_gather_p2p as agp
    from overlap.ops import all_reduce_p2p as arp

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
                c = agp._fused_p2p(rt, a, lin.t(), False, cfg)
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
                c2, h = arp._fused_p2p(rt, x, lin.t(), None, None, replace(cfg, reduce_ctas=4))
            except RanksDisagreeError as e:
                assert disagree and "disagree" in str(e), e
            else:
                assert not disagree, "a peer's other signature was not caught (all-reduce)"
                assert _rel(h, x.double() + xp.double()) < 1e-2



@interpreted
def test_late_peer_new_m() -> None:
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
    from overlap.ops import all_gather_p2p as agp
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
    with rt.patched(), mock.patch.object(agp, "gemm_plan", gemm_plan):
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
            c = agp._fused_p2p(rt, a, lin.t(), False, cfg)
            th.join()
            assert time.monotonic() - t0 >= 1.5
            assert _rel(c, torch.cat([a, peer]).double() @ lin.t().double()) < 1e-2, ms
    assert bounds and all(b == int(default_ms * 1e6) for b in bounds), bounds
    row_bytes = k * 2
    assert asked == [2 * (-(-2 * row_bucket(ms) * row_bytes // 1024) * 1024) for ms in (40, 100, 77, 130, 200, 150)]
    assert len(set(asked)) == 2, asked  # two buckets (128, 256 rows), six M



@interpreted
def test_nccl_pipeline() -> None:
    """The NCCL transport's host side, kernels interpreted, at world size 1: the producer
    ops (``matmul_reduce_scatter`` / ``matmul_all_reduce``, per-chunk counters the comm
    stream waits on) and the block boundary (``matmul_all_reduce_matmul``: the producer's
    counters, each chunk all-reduced, added and normed, its flag, the consumer's tiles),
    with new inputs every call, 1-4 chunks, residual and LayerNorm / RMSNorm or none, both
    B layouts, the consumer's split tail and give-back grid: outputs against torch, one
    wait per chunk for that chunk's tile count, one collective per chunk. M changes call
    to call within a row bucket: the producer ops share the bucket's plan (its chunks cut
    at M, every tile counted, cut or not); the boundary's plans are per M."""
    from overlap.ops import Norm, OverlapConfig
    from overlap.ops import boundary as bd
    from overlap.ops import matmul_reduce as mr
    from overlap.policies import plan_rows

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
            w1 = (torch.randn(n, k, generator=g) / k ** 0.5).half()
            w2 = (torch.randn(n2, n, generator=g) / n ** 0.5).half()
            b = w1.t() if layout == "wt" else w1.t().contiguous()
            b2 = w2.t() if layout == "wt" else w2.t().contiguous()
            norm = None
            if kind:
                norm = Norm(kind, (torch.rand(n, generator=g) + 0.5).half(),
                            torch.randn(n, generator=g).half() if kind == "layernorm" else None)
            for it in range(2):  # new inputs; plans and words reused
                m = (300, 290)[it]  # one bucket (320 rows)
                sizes = mr.reduce_scatter_layout(1, m, chunks, mr.CHUNK_ALIGN, scatter=False).chunk_rows
                bucket = mr.reduce_scatter_layout(1, plan_rows(m), chunks, mr.CHUNK_ALIGN, scatter=False).chunk_rows
                plans0 = len(mr._plans(rt))
                a = torch.randn(m, k, generator=g).half()
                res = torch.randn(m, n, generator=g).half() if with_res else None
                want = a.float() @ w1.float().t()
                # the producer ops
                del rt.log[:], rt.waits[:]
                got = mr._fused(rt, "matmul_reduce_scatter", a, b, None, cfg)
                assert got.shape == (m, n) and _rel(got, want) < TOL[torch.float16], ("mmrs", chunks, it)
                got = mr._fused(rt, "matmul_all_reduce", a, b, res, cfg)
                want_h = want + (res.float() if res is not None else 0)
                assert got.shape == (m, n) and _rel(got, want_h) < TOL[torch.float16], ("mmar", chunks, it)
                if it:  # the second M of the bucket made no plan
                    assert len(mr._plans(rt)) == plans0, "a plan per M, not per bucket"
                counts = mr._plan(rt, "matmul_all_reduce", plan_rows(m), n, k, cfg).counts
                tiles = [-(-r // cfg.gemm.block_m) * -(-n // cfg.gemm.block_n) for r in bucket]
                assert list(counts) == tiles, (counts, tiles)
                live = [min(r, m - sum(bucket[:i])) for i, r in enumerate(bucket)]
                assert [v for _, v in rt.waits] == tiles * 2 and rt.log == [("reduce_scatter", r) for r in bucket] + \
                    [("all_reduce", r) for r in live], (rt.waits, rt.log)
                tiles = [-(-r // cfg.gemm.block_m) * -(-n // cfg.gemm.block_n) for r in sizes]
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



def _sent(rows: int, chunks: int, exact: bool, whole: bool = False) -> list[int]:
    """The rows of each collective a consumer op's NCCL path sends for ``rows``: its row
    bucket's chunks cut at ``rows`` (``whole``: the chunk holding the last row sent whole,
    as the all-gather does), or with ``exact`` the chunks of ``rows`` itself."""
    from overlap.ops import matmul_reduce as mr
    from overlap.policies import plan_rows

    if exact:
        return mr.split_rows(rows, chunks, mr.CHUNK_ALIGN)
    sent, start = [], 0
    for r in mr.split_rows(plan_rows(rows), chunks, mr.CHUNK_ALIGN):
        if start < rows:
            sent.append(r if whole else min(r, rows - start))
        start += r
    return sent


@interpreted
def test_nccl_consumer_ops() -> None:
    """The consumer ops' NCCL-transport host side (``all_gather_matmul``'s and
    ``all_reduce_matmul``'s ``_fused``) with kernels interpreted, as rank 0 of 2 on a
    stand-in runtime: the peer's shard (or partial sums) arrives through the stand-in's
    collectives, chunk by chunk. New inputs every call, 1-3 chunks, both B layouts, the
    give-back grid, a split tail, return_gathered; residual and LayerNorm / RMSNorm or
    none: outputs against torch, one collective per chunk, every chunk flag posted.
    The all-gather's grid gated and not. M changes call to call within a row bucket
    (``plan_rows``): the per-tile GEMM's calls share the bucket's plan, its chunks cut at M (the chunk holding the last row
    sent padded, the peer's pad NaN, never stored)."""
    import os
    from unittest import mock

    from overlap.kernels import gate as gate_mod
    from overlap.ops import Norm, OverlapConfig
    from overlap.ops import all_gather as ag
    from overlap.ops import all_reduce as ar

    real_gate = gate_mod.launch_gate
    rt = _NcclStandIn(world=2)
    g = torch.Generator().manual_seed(7)
    ms, m, n, k = 150, 300, 48, 64  # all-gather: 150 rows per rank; all-reduce: 300 rows
    with rt.patched():
        # the last case: the flattened GEMM (GemmConfig.flatten), waiting per chunk
        for chunks, kind, with_res, layout, give_back, split, flat in (
                (1, None, False, "wt", True, 0, False), (2, "layernorm", True, "wt", True, 0, False),
                (3, "rmsnorm", False, "kn", False, 0, False), (2, "layernorm", True, "kn", True, 2, False),
                (3, "layernorm", True, "wt", False, 0, True)):
            gemm = replace(CFG32 if split else CFG, flatten=flat)
            cfg = OverlapConfig(chunks=chunks, nccl_ctas=2, sm_margin=0, give_back=give_back, check="sync",
                                transport="nccl", gemm=gemm, split_tail=split)
            lin = (torch.randn(n, k, generator=g) / k ** 0.5).half()
            b = lin.t() if layout == "wt" else lin.t().contiguous()
            norm = None
            if kind:
                norm = Norm(kind, (torch.rand(k, generator=g) + 0.5).half(),
                            torch.randn(k, generator=g).half() if kind == "layernorm" else None)
            for it in range(2):
                ms, m = (150, 300) if it == 0 else (137, 290)  # a new M in the same buckets
                plans0 = (len(ag._plans(rt)), len(ar._plans(rt)))
                # all-gather -> GEMM: this rank's rows first, then the peer's
                a = torch.randn(ms, k, generator=g).half()
                rt.peer, rt.base = torch.randn(ms, k, generator=g).half(), a
                del rt.log[:]
                # the first call gated (the local shard's grid, the gate, the rest's grid), the
                # second not (OVERLAP_STREAM_GATE=0: one grid over the whole table)
                gates = []
                before = os.environ.get("OVERLAP_STREAM_GATE")
                os.environ["OVERLAP_STREAM_GATE"] = "1" if it == 0 else "0"
                try:
                    with mock.patch.object(gate_mod, "launch_gate",
                                           lambda *a_, **kw: (gates.append(a_[1]), real_gate(*a_, **kw))):
                        c, gathered = ag._fused(rt, a, b, True, cfg)
                finally:
                    if before is None:
                        os.environ.pop("OVERLAP_STREAM_GATE")
                    else:
                        os.environ["OVERLAP_STREAM_GATE"] = before
                assert gates == ([0] if it == 0 and not flat else []), ("gates", chunks, it, gates)
                full = torch.cat([a, rt.peer])
                assert torch.equal(gathered, full), ("gathered", chunks, it)
                assert _rel(c, full.float() @ lin.float().t()) < TOL[torch.float16], ("agmm", chunks, it)
                assert rt.log == [("all_gather", r) for r in _sent(ms, chunks, flat, whole=True)], rt.log
                # all-reduce (+ residual, norm) -> GEMM
                x = torch.randn(m, k, generator=g).half()
                rt.peer, rt.base = torch.randn(m, k, generator=g).half(), x
                res = torch.randn(m, k, generator=g).half() if with_res else None
                del rt.log[:]
                c, h = ar._fused(rt, x, b, res, norm, cfg)
                h_want = (x.float() + rt.peer.float()).half().float() + (res.float() if res is not None else 0)
                assert _rel(h, h_want) < TOL[torch.float16], ("armm h", chunks, kind, it)
                y = h_want if norm is None else (
                    torch.nn.functional.layer_norm(h_want, (k,), norm.weight.float(), norm.bias.float())
                    if kind == "layernorm" else torch.nn.functional.rms_norm(h_want, (k,), norm.weight.float()))
                assert _rel(c, y @ lin.float().t()) < 5e-3, ("armm c", chunks, kind, it)
                sizes = _sent(m, chunks, flat)
                assert rt.log == [("all_reduce", r) for r in sizes], rt.log
                # one plan per bucket: the second M made none (the flattened GEMM's are exact)
                made = (len(ag._plans(rt)) - plans0[0], len(ar._plans(rt)) - plans0[1])
                assert made == ((1, 1) if it == 0 or flat else (0, 0)), (chunks, it, made)
                if not flat and it == 0:  # a list of weights: one all-reduce, one grid over both GEMMs
                    lin2 = (torch.randn(32, k, generator=g) / k ** 0.5).half()
                    b2 = lin2.t() if layout == "wt" else lin2.t().contiguous()
                    x = torch.randn(m, k, generator=g).half()
                    rt.peer, rt.base = torch.randn(m, k, generator=g).half(), x
                    del rt.log[:]
                    cs, h = ar._fused(rt, x, [b, b2], res, norm, cfg)
                    h_want = (x.float() + rt.peer.float()).half().float() + (res.float() if res is not None else 0)
                    y = h_want if norm is None else (
                        torch.nn.functional.layer_norm(h_want, (k,), norm.weight.float(), norm.bias.float())
                        if kind == "layernorm" else torch.nn.functional.rms_norm(h_want, (k,), norm.weight.float()))
                    assert _rel(h, h_want) < TOL[torch.float16], ("armm list h", chunks, kind, it)
                    for ci, w in zip(cs, (lin, lin2)):
                        assert _rel(ci, y @ w.float().t()) < 5e-3, ("armm list c", chunks, kind, it)
                    assert rt.log == [("all_reduce", r) for r in sizes], rt.log


@interpreted
def test_many_weights_one_grid() -> None:
    """A list of weights on one gather (Q, K, V of different N), both transports' host side
    with kernels interpreted, as rank 0 of 2: NCCL (the peer's chunks through the stand-in's
    all-gathers, the give-back grid, a split tail, return_gathered) and p2p (the peer's
    pushes landed, both call parities). New inputs every call: every output against torch,
    one collective per chunk (the shard gathered once), the calls counted as one grid."""
    from overlap.ops import OverlapConfig
    from overlap.ops import all_gather as ag
    from overlap.ops import all_gather_p2p as agp

    g = torch.Generator().manual_seed(13)
    ms, k = 150, 48
    many0 = ag.stats["many"]
    calls = 0
    rt = _NcclStandIn(world=2)
    with rt.patched():
        for ns, chunks, layout, split in (([48, 16], 2, "wt", 0), ([32, 16, 48], 3, "kn", 2), ([16] * 4, 1, "wt", 0)):
            cfg = OverlapConfig(chunks=chunks, nccl_ctas=2, sm_margin=0, give_back=True, check="sync",
                                transport="nccl", gemm=CFG32 if split else CFG, split_tail=split)
            ws = [(torch.randn(n, k, generator=g) / k ** 0.5).half() for n in ns]
            bs = [w.t() if layout == "wt" else w.t().contiguous() for w in ws]
            for it in range(2):
                a = torch.randn(ms, k, generator=g).half()
                rt.peer, rt.base = torch.randn(ms, k, generator=g).half(), a
                del rt.log[:]
                cs, gathered = ag._fused(rt, a, bs, True, cfg)
                full = torch.cat([a, rt.peer])
                assert torch.equal(gathered, full)
                assert [tuple(c.shape) for c in cs] == [(2 * ms, n) for n in ns]
                for i, (c, w) in enumerate(zip(cs, ws)):
                    assert _rel(c, full.float() @ w.float().t()) < TOL[torch.float16], (ns, it, i)
                assert rt.log == [("all_gather", r) for r in _sent(ms, chunks, False, whole=True)], rt.log
                calls += 1
    rt = _StandIn()
    with rt.patched():
        for ns, chunks in (([48, 16, 32], 2), ([16, 32], 1)):
            cfg = OverlapConfig(chunks=chunks, check="sync", transport="p2p", gemm=CFG)
            ws = [(torch.randn(n, k, generator=g) / k ** 0.5).half() for n in ns]
            for it in range(3):
                a = torch.randn(ms, k, generator=g).half()
                peer = torch.randn(ms, k, generator=g).half()
                rt.recv("all_gather_matmul", (2 * ms, k), torch.float16)[ms:].copy_(peer)
                cs = agp._fused_p2p(rt, a, [w.t() for w in ws], False, cfg)
                full = torch.cat([a, peer])
                for i, (c, w) in enumerate(zip(cs, ws)):
                    assert _rel(c, full.float() @ w.float().t()) < TOL[torch.float16], (ns, it, i)
                calls += 1
    assert ag.stats["many"] - many0 == calls, (ag.stats, calls)


@interpreted
def test_nccl_bound_body() -> None:
    """``all_gather_matmul``'s bound body (``_Bound``, what a call plan runs) on the
    stand-in runtime as rank 0 of 2, kernels interpreted: made once per case, then called
    with new tensors every call (new A, new B storage, so new pointers each call): C and
    the gathered rows against torch, one collective per chunk, every chunk flag posted;
    gated and not, give-back on and off, 1-3 chunks, both B layouts, an M under its
    bucket's top (the chunk that holds the last row sent padded)."""
    from overlap.ops import OverlapConfig
    from overlap.ops import all_gather as ag

    rt = _NcclStandIn(world=2)
    g = torch.Generator().manual_seed(17)
    n, k = 48, 64
    with rt.patched():
        for chunks, layout, give_back, gate, ms in ((1, "wt", True, "1", 150), (2, "kn", False, "0", 137),
                                                    (3, "wt", False, "1", 150), (2, "wt", True, "0", 150)):
            cfg = OverlapConfig(chunks=chunks, nccl_ctas=2, sm_margin=0, give_back=give_back, check="sync",
                                transport="nccl", gemm=CFG)
            before = os.environ.get("OVERLAP_STREAM_GATE")
            os.environ["OVERLAP_STREAM_GATE"] = gate
            try:
                a0 = torch.randn(ms, k, generator=g).half()
                lin = (torch.randn(n, k, generator=g) / k ** 0.5).half()
                b0 = lin.t() if layout == "wt" else lin.t().contiguous()
                body = ag._Bound(rt, a0, b0, True, cfg)
            finally:
                if before is None:
                    os.environ.pop("OVERLAP_STREAM_GATE")
                else:
                    os.environ["OVERLAP_STREAM_GATE"] = before
            assert body.gated == (gate == "1"), body
            assert "all_gather_matmul body" in repr(body)
            assert body.finish is not None, "the gathered rows put in order after the frame's join"
            for it in range(3):
                a = torch.randn(ms, k, generator=g).half()
                lin = (torch.randn(n, k, generator=g) / k ** 0.5).half()
                b = lin.t() if layout == "wt" else lin.t().contiguous()
                rt.peer, rt.base = torch.randn(ms, k, generator=g).half(), a
                del rt.log[:]
                c, gathered = body(a, b)
                full = torch.cat([a, rt.peer])
                assert torch.equal(gathered, full), ("gathered", chunks, it)
                assert _rel(c, full.float() @ lin.float().t()) < TOL[torch.float16], ("c", chunks, it)
                assert rt.log == [("all_gather", r) for r in _sent(ms, chunks, False, whole=True)], rt.log
                assert body.words.flags[:len(body.chunks)].tolist() == [1] * len(body.chunks)


@interpreted
def test_nccl_bound_body_all_reduce() -> None:
    """``all_reduce_matmul``'s bound body on the stand-in runtime as rank 0 of 2, kernels
    interpreted: made once per case, then called with new tensors every call (x, b,
    residual and the norm's weight and bias all new storage): h and C against torch, one
    all-reduce per live chunk; residual and LayerNorm / RMSNorm or none, an M under its
    bucket's top (the chunks past it reduce nothing), gated and not."""
    from overlap.ops import Norm, OverlapConfig
    from overlap.ops import all_reduce as ar

    rt = _NcclStandIn(world=2)
    g = torch.Generator().manual_seed(19)
    n, k = 48, 64
    with rt.patched():
        for chunks, kind, with_res, gate, m in ((1, None, True, "1", 300), (2, "layernorm", True, "0", 290),
                                                (3, "rmsnorm", False, "1", 300)):
            cfg = OverlapConfig(chunks=chunks, nccl_ctas=2, sm_margin=0, give_back=True, check="sync",
                                transport="nccl", gemm=CFG)

            def inputs():
                x = torch.randn(m, k, generator=g).half()
                lin = (torch.randn(n, k, generator=g) / k ** 0.5).half()
                res = torch.randn(m, k, generator=g).half() if with_res else None
                if with_res and chunks == 2:  # a strided residual: copied before the frame forks
                    res = torch.randn(m, 2 * k, generator=g).half()[:, :k]
                norm = None
                if kind:
                    norm = Norm(kind, (torch.rand(k, generator=g) + 0.5).half(),
                                torch.randn(k, generator=g).half() if kind == "layernorm" else None)
                return x, lin, res, norm

            x, lin, res, norm = inputs()
            before = os.environ.get("OVERLAP_STREAM_GATE")
            os.environ["OVERLAP_STREAM_GATE"] = gate
            try:
                body = ar._Bound(rt, x, lin.t(), res, norm, cfg)
            finally:
                if before is None:
                    os.environ.pop("OVERLAP_STREAM_GATE")
                else:
                    os.environ["OVERLAP_STREAM_GATE"] = before
            assert "all_reduce_matmul body" in repr(body)
            assert (body.prepare is not None) == (res is not None and not res.is_contiguous()), body.prepare
            for it in range(3):
                x, lin, res, norm = inputs()
                rt.peer, rt.base = torch.randn(m, k, generator=g).half(), x
                del rt.log[:]
                c, h = body(x, lin.t(), res, norm)
                h_want = (x.float() + rt.peer.float()).half().float() + (res.float() if res is not None else 0)
                assert _rel(h, h_want) < TOL[torch.float16], ("h", chunks, kind, it)
                y = h_want if norm is None else (
                    torch.nn.functional.layer_norm(h_want, (k,), norm.weight.float(), norm.bias.float())
                    if kind == "layernorm" else torch.nn.functional.rms_norm(h_want, (k,), norm.weight.float()))
                assert _rel(c, y @ lin.float().t()) < 5e-3, ("c", chunks, kind, it)
                assert rt.log == [("all_reduce", r) for r in _sent(m, chunks, False)], rt.log


@interpreted
def test_nccl_bound_body_producers() -> None:
    """``matmul_reduce_scatter``'s and ``matmul_all_reduce``'s bound bodies on the stand-in
    runtime at world size 1, kernels interpreted: made once per case, then called with new
    tensors every call (a, b, residual): outputs against torch, one wait per chunk for its
    tile count, one collective per chunk; 1-3 chunks, an M under its bucket's top."""
    from overlap.ops import OverlapConfig
    from overlap.ops import matmul_reduce as mr
    from overlap.policies import plan_rows

    rt = _NcclStandIn()
    g = torch.Generator().manual_seed(23)
    n, k = 48, 64
    with rt.patched():
        for chunks, with_res, m in ((1, False, 300), (3, True, 290), (2, True, 300)):
            cfg = OverlapConfig(chunks=chunks, nccl_ctas=2, sm_margin=0, check="sync", transport="nccl", gemm=CFG)
            bucket = mr.reduce_scatter_layout(1, plan_rows(m), chunks, mr.CHUNK_ALIGN, scatter=False).chunk_rows
            live = [min(r, m - sum(bucket[:i])) for i, r in enumerate(bucket)]
            for op in ("matmul_reduce_scatter", "matmul_all_reduce"):
                a = torch.randn(m, k, generator=g).half()
                w = (torch.randn(n, k, generator=g) / k ** 0.5).half()
                res = torch.randn(m, n, generator=g).half() if with_res and op == "matmul_all_reduce" else None
                body = mr._Bound(rt, op, a, w.t(), res, cfg)
                assert op in repr(body)
                for it in range(3):
                    a = torch.randn(m, k, generator=g).half()
                    w = (torch.randn(n, k, generator=g) / k ** 0.5).half()
                    res = torch.randn(m, n, generator=g).half() if res is not None else None
                    del rt.log[:], rt.waits[:]
                    got = body(a, w.t(), res)
                    want = a.float() @ w.float().t() + (res.float() if res is not None else 0)
                    assert got.shape == (m, n) and _rel(got, want) < TOL[torch.float16], (op, chunks, it)
                    counts = list(body.p.counts)
                    assert [v for _, v in rt.waits] == counts, (rt.waits, counts)
                    sizes = bucket if op == "matmul_reduce_scatter" else live
                    kind = "reduce_scatter" if op == "matmul_reduce_scatter" else "all_reduce"
                    assert rt.log == [(kind, r) for r in sizes], rt.log


@interpreted
def test_nccl_bound_body_boundary() -> None:
    """``matmul_all_reduce_matmul``'s bound body on the stand-in runtime at world size 1,
    kernels interpreted: made once per case, then called with new tensors every call (a,
    both weights, residual, the norm's weight and bias): h and C against torch, one wait per
    chunk for its tile count, one all-reduce per chunk, every consumer flag posted;
    residual and LayerNorm / RMSNorm or none, give-back on and off, gated and not."""
    from overlap.ops import Norm, OverlapConfig
    from overlap.ops import boundary as bd

    rt = _NcclStandIn()
    g = torch.Generator().manual_seed(29)
    m, n, k, n2 = 300, 48, 64, 32
    with rt.patched():
        for chunks, kind, with_res, give_back, gate in ((1, None, False, True, "1"), (3, "layernorm", True, True, "0"),
                                                        (2, "rmsnorm", False, False, "1")):
            cfg = OverlapConfig(chunks=chunks, nccl_ctas=2, sm_margin=0, give_back=give_back, check="sync",
                                transport="nccl", gemm=CFG)

            def inputs():
                a = torch.randn(m, k, generator=g).half()
                w1 = (torch.randn(n, k, generator=g) / k ** 0.5).half()
                w2 = (torch.randn(n2, n, generator=g) / n ** 0.5).half()
                res = torch.randn(m, n, generator=g).half() if with_res else None
                norm = None
                if kind:
                    norm = Norm(kind, (torch.rand(n, generator=g) + 0.5).half(),
                                torch.randn(n, generator=g).half() if kind == "layernorm" else None)
                return a, w1, w2, res, norm

            a, w1, w2, res, norm = inputs()
            before = os.environ.get("OVERLAP_STREAM_GATE")
            os.environ["OVERLAP_STREAM_GATE"] = gate
            try:
                body = bd._Bound(rt, a, w1.t(), w2.t(), res, norm, cfg)
            finally:
                if before is None:
                    os.environ.pop("OVERLAP_STREAM_GATE")
                else:
                    os.environ["OVERLAP_STREAM_GATE"] = before
            assert "matmul_all_reduce_matmul body" in repr(body)
            for it in range(3):
                a, w1, w2, res, norm = inputs()
                del rt.log[:], rt.waits[:]
                c, h = body(a, w1.t(), w2.t(), res, norm)
                want_h = a.float() @ w1.float().t() + (res.float() if res is not None else 0)
                y = want_h if norm is None else (
                    torch.nn.functional.layer_norm(want_h, (n,), norm.weight.float(), norm.bias.float())
                    if kind == "layernorm" else torch.nn.functional.rms_norm(want_h, (n,), norm.weight.float()))
                assert _rel(h, want_h) < TOL[torch.float16], ("h", chunks, kind, it)
                assert _rel(c, y @ w2.float().t()) < 5e-3, ("c", chunks, kind, it)
                assert [v for _, v in rt.waits] == list(body.p1.counts), rt.waits
                assert rt.log == [("all_reduce", r) for r in body.p1.cmap.chunk_rows], rt.log
                assert body.words[1].flags[:chunks].tolist() == [1] * chunks


@interpreted
def test_bound_body_python_calls_are_few() -> None:
    """A bound body's call is a short straight line: with its launches bound (stubbed here:
    the C launcher is Triton 3.6's on a GPU) and the stand-in's collectives and flag posts,
    a call of ``all_gather_matmul``'s body (2 chunks, give-back grid, gate) runs at most 20
    Python frames of the library and 80 calls in all (cProfile; the stand-in's own work
    included), and every stubbed launch gets this call's tensors, never a previous call's."""
    import cProfile
    import pstats

    from overlap.ops import OverlapConfig
    from overlap.ops import all_gather as ag

    rt = _NcclStandIn(world=2)
    g = torch.Generator().manual_seed(31)
    ms, n, k = 150, 48, 64
    with rt.patched():
        cfg = OverlapConfig(chunks=2, nccl_ctas=2, sm_margin=0, give_back=True, check="sync", transport="nccl",
                            gemm=CFG)
        a = torch.randn(ms, k, generator=g).half()
        lin = torch.randn(n, k, generator=g).half()
        body = ag._Bound(rt, a, lin.t(), False, cfg)
        got: list = []
        body.bl = body.bl_local = body.bl_back = lambda raw, t: got.append(t)
        body.bl_gate = lambda raw, t: None
        body.whole = body.bound = True
        calls = 10
        ins = [(torch.randn(ms, k, generator=g).half(), torch.randn(n, k, generator=g).half()) for _ in range(calls)]
        pr = cProfile.Profile()
        for i, (a, lin) in enumerate(ins):
            rt.peer, rt.base = torch.randn(ms, k, generator=g).half(), a
            pr.enable()
            c = body(a, lin.t())
            pr.disable()
            # each launch of this call (local grid, grid, give-back) got this call's A, B and C
            assert len(got) == 3 * (i + 1) and all(t[0] is a and t[3] is c and t[2].data_ptr() == lin.data_ptr()
                                                   for t in got[-3:]), i
        import overlap

        pkg = os.path.dirname(os.path.abspath(overlap.__file__))
        st = pstats.Stats(pr)
        total = sum(nc for (_, _, _), (_, nc, _, _, _) in st.stats.items()) / calls
        lib = sum(nc for (f, _, _), (_, nc, _, _, _) in st.stats.items() if os.path.abspath(f).startswith(pkg)) / calls
        assert 5 <= lib <= 20 and total <= 80, (lib, total)


@interpreted
def test_chain_fused_consumer_on_the_engine() -> None:
    """``mlp_chain``'s fused body (``chain._fused``) on a stand-in runtime, its kernels
    interpreted: RowSync and TileSync, gelu and none, fc2's B in both layouts, new inputs
    every call. y matches torch; fc2 is made once per tables and words by the consumer
    ops' engine (``gemm_plan`` -> ``engine_plan``, waiting on the chain's row flags and
    counting with its own counter; the interpreter's pick is the tile GEMM) and reused;
    the stream-synced baseline's fc2 takes the same engine, without waits."""
    from unittest import mock

    from overlap.kernels import engine
    from overlap.ops import chain

    class Stream(_NcclStandIn.Stream):
        def wait_stream(self, other):
            pass

    rt = _NcclStandIn()
    rt.Stream, rt.seen = Stream, set()
    rt.comm_stream = rt.aux_stream = Stream()
    made = []
    real = engine.engine_plan

    def engine_plan(a, b, c, table, **kw):
        made.append(kw)
        return real(a, b, c, table, **kw)

    g = torch.Generator().manual_seed(9)
    m, k, f, n = 40, 32, 48, 32
    fused0, synced0 = chain.stats["fused"], chain.stats["stream_sync"]
    with rt.patched(), mock.patch.object(torch.cuda, "current_stream", lambda *a: Stream()), \
            mock.patch.object(engine, "engine_plan", engine_plan), \
            mock.patch.object(chain, "_runtime", lambda device: rt), \
            mock.patch.object(chain, "_takes_fast_path", lambda x: True), \
            mock.patch.object(chain, "_validate_cuda", lambda *a: None):
        for sync, act, kn in (("row", "gelu", False), ("tile", None, True), ("row", None, True)):
            cfg = chain.ChainConfig(producer=CFG, sync=sync, check="sync")
            w1 = (torch.randn(f, k, generator=g) / k ** 0.5).t()
            w2 = (torch.randn(n, f, generator=g) / f ** 0.5).t()
            if kn:
                w2 = w2.contiguous()
            del made[:]
            for it in range(3):
                x = torch.randn(m, k, generator=g)
                want = x @ w1
                if act == "gelu":
                    want = torch.nn.functional.gelu(want)
                want = want @ w2
                y = chain._fused(rt, x, w1, w2, act, cfg, False, 0)
                assert _rel(y, want) < TOL[torch.float32], (sync, act, kn, it, _rel(y, want))
                ref0 = chain.stats["reference"]
                y = chain.mlp_chain_stream_sync(x, w1, w2, activation=act, config=cfg)
                assert _rel(y, want) < TOL[torch.float32], ("stream sync", sync, act, kn, it)
                assert chain.stats["reference"] == ref0, "the baseline ran torch"
            # one plan per consumer kind, made at the first call and reused by the next two
            assert len(made) == 2, (sync, made)
            waits, plain = made
            words = rt.local_words(chain.OP, 8, 1)
            assert waits["wait"] is True and waits["counter"].data_ptr() == words.counters[4:5].data_ptr(), waits
            assert waits["flags"].data_ptr() == words.flags.data_ptr()
            assert waits["k_wait"] == (0 if sync == "row" else chain._tables(rt, m, f, n, cfg)[4]) and \
                waits["config"] == CFG
            assert not plain.get("wait") and plain.get("counter") is None and plain["config"] == CFG, plain
    assert chain.stats["fused"] == fused0 + 9 and chain.stats["stream_sync"] == synced0 + 9
