"""The warp-specialized Gluon GEMM on the GPU (``benchmarks/gluon_gemm_bench.py``'s checks):
fresh inputs and NaN-poisoned outputs every call, both B layouts, bf16 and fp16, ragged
edges, two A sources; tiles waiting on flags already set, set late by another stream, never
set (error word, bounded) and set two epochs ahead; tiles from a dispatch counter shared by
two launches."""

from __future__ import annotations

import pytest
import torch


def _need_gluon() -> None:
    from overlap.kernels import gluon_gemm

    if not gluon_gemm.AVAILABLE:
        pytest.skip(gluon_gemm.REASON)
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon GEMM is built for sm_90")


@pytest.mark.gpu
def test_gluon_gemm_matches_torch() -> None:
    _need_gluon()
    from benchmarks.gluon_gemm_bench import check_plain

    log: list[str] = []
    check_plain(log)
    assert log and "right" in log[0]


@pytest.mark.gpu
def test_gluon_gemm_tiles_wait() -> None:
    _need_gluon()
    from benchmarks.gluon_gemm_bench import check_waits

    log: list[str] = []
    check_waits(log)
    from benchmarks.gluon_gemm_bench import VARIANTS

    assert len(log) == len(VARIANTS)


@pytest.mark.gpu
def test_gluon_gemm_dispatch_counter() -> None:
    _need_gluon()
    from benchmarks.gluon_gemm_bench import DYNAMIC_VARIANTS, VARIANTS, check_dynamic

    log: list[str] = []
    check_dynamic(log, {kk: VARIANTS[kk] for kk in DYNAMIC_VARIANTS})
    assert len(log) == len(DYNAMIC_VARIANTS)


@pytest.mark.gpu
def test_gluon_gemm_split_tail() -> None:
    """The last wave's tiles split along K (``split_tail``): plans launched again and again
    on split grids, a flag never set in the tail's chunk and the next call, two grids on one
    counter, a row cut."""
    _need_gluon()
    from benchmarks.gluon_gemm_bench import VARIANTS, check_split

    split = {kk: v for kk, v in VARIANTS.items() if v.get("split_tail")}
    log: list[str] = []
    check_split(log, split)
    assert len(split) >= 3 and len(log) == len(split), log


@pytest.mark.gpu
def test_gluon_gemm_posts() -> None:
    """Tiles that post (the producer ops' GEMM): flags at their tile counts, rows read after
    their flag whole, two grids on one counter, dead tiles of a row cut counted."""
    _need_gluon()
    from benchmarks.gluon_gemm_bench import POST_VARIANTS, VARIANTS, check_posts

    log: list[str] = []
    check_posts(log, {kk: VARIANTS[kk] for kk in POST_VARIANTS})
    assert len(log) == len(POST_VARIANTS)


def _engine_call(m_span: int, cap: int, n: int, k: int, layout: str, tile: tuple = (128, 128)) -> dict:
    """The all-gather op's kind of call at world size 2, as rank 0: its shard's rows (A, no
    wait) then the peer's from the gathered buffer laid out for the bucket (A2, rows
    ``m_span`` on, waiting on flag 0 at 3x the epoch), C rows cut at ``cap`` per rank."""
    from overlap.kernels.tile_gemm import GemmConfig
    from overlap.policies import Segment, build_tile_table, table_tensor

    cfg = GemmConfig(block_m=tile[0], block_n=tile[1])
    segs = [Segment(a_src=0, a_row=0, c_row=0, rows=m_span),
            Segment(a_src=1, a_row=m_span, c_row=m_span, rows=m_span, wait_idx=0, wait_mult=3)]
    table = table_tensor(build_tile_table(segs, n, cfg.block_m, cfg.block_n, 8), "cuda")
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    b = w.t() if layout == "nk" else w.t().contiguous()
    return dict(cfg=cfg, table=table, b=b, flags=torch.zeros(4, dtype=torch.int32, device="cuda"),
                err=torch.zeros(8, dtype=torch.int32, device="cuda"),
                counter=torch.zeros(4, dtype=torch.int32, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["gluon", "auto", "halves", "row_halves", "wide", "regs", "ahead"])
def test_engine_plan_keeps_the_guarantees(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The consumer GEMM's plan on the engine ``OVERLAP_GEMM_ENGINE`` gives (forced Gluon, or
    measured; ``halves`` / ``row_halves``: a table of 128x256 / 256x128 tiles run as its
    column / row halves on ping-pong 128x128, the pick set instead of measured; ``wide``: a
    table of 128x256 tiles retiled to 192 columns, ``OVERLAP_GLUON_EXPERIMENTAL=1``, set alike;
    ``regs``: the 128x256 table on 4 stages with C stored from registers, set alike;
    ``ahead``: forced, the 128x128 table's config with ``ahead``):
    right with new inputs every call and rows cut per bucket, both B layouts;
    the give-back grid joining by the counter on another stream; a flag never set: code 1
    within the bound and NaN, never old values, where tiles were skipped; a CUDA graph of
    the call (flags zeroed and posted inside it) replayed with new inputs."""
    _need_gluon()
    from overlap import observe
    from overlap.kernels import engine

    monkeypatch.delenv(engine.EXPERIMENTAL_ENV, raising=False)
    monkeypatch.delenv("OVERLAP_GEMM_CACHE", raising=False)
    for name, value in (("_measured", {}), ("_picks", {}), ("_derived", engine.OrderedDict())):
        monkeypatch.setattr(engine, name, value)  # (a pick kept by another mode's case is not this one's)
    halves = mode in ("halves", "row_halves", "wide", "regs")
    monkeypatch.setenv(engine.ENGINE_ENV, "auto" if halves else ("gluon" if mode == "ahead" else mode))
    if mode == "ahead":
        from overlap.kernels.gluon_gemm import GluonGemmConfig

        monkeypatch.setitem(engine.TILE_CONFIGS, (128, 128),
                            (GluonGemmConfig(block_m=128, block_n=128, stages=4, ahead=True),))
    if mode in ("wide", "regs"):
        monkeypatch.setenv(engine.EXPERIMENTAL_ENV, "1")
    if halves:
        pick = (lambda cfgs: next(g for g in cfgs if not g.tma_epilogue)) if mode == "regs" else \
            (lambda cfgs: cfgs[-1])
        monkeypatch.setattr(engine.EnginePlan, "_measure",
                            lambda self, ops, c, grid, rows: (pick(self.configs), "set by the test"))
    observe.reset_report()
    span, n, k = 512, 640, 384
    side = torch.cuda.Stream()
    for layout in ("nk", "kn"):
        x = _engine_call(span, span, n, k, layout,
                         {"halves": (128, 256), "row_halves": (256, 128), "wide": (128, 256),
                          "regs": (128, 256)}.get(mode, (128, 128)))
        flags, err, counter, b = x["flags"], x["err"], x["counter"], x["b"]
        gathered = torch.empty(2 * span, k, device="cuda", dtype=torch.bfloat16)
        c0 = torch.empty(2 * span, n, device="cuda", dtype=torch.bfloat16)
        a0 = torch.empty(span, k, device="cuda", dtype=torch.bfloat16)
        gp = engine.engine_plan(a0, b, c0, x["table"], a2=gathered, flags=flags, err=err, counter=counter,
                                timeout_ns=2_000_000_000, config=x["cfg"], wait=True, clip=True)
        assert isinstance(gp, engine.EnginePlan), gp
        for it, cap in enumerate((span, 300, 437, 129)):
            a = torch.randn(cap, k, device="cuda", dtype=torch.bfloat16)
            gathered.normal_()
            c = torch.full((2 * cap, n), 7.0, device="cuda", dtype=torch.bfloat16)
            counter.zero_()
            flags[0] = 3
            ops = gp.operands(a, b, gathered)
            gp.launch(ops, c, epoch=1, grid=100, rows=(cap, span))
            if it % 2:  # the give-back grid: the same table and counter, another stream
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    gp.launch(ops, c, epoch=1, grid=32, rows=(cap, span))
                torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            assert int(err[0]) == 0, err.tolist()
            want = torch.cat([a, gathered[span:span + cap]]).float() @ b.float()
            rel = ((c.float() - want).norm() / want.norm()).item()
            assert rel < 1e-2, (mode, layout, cap, rel)
            n_tiles = x["table"].shape[0]
            if halves:
                assert gp.engine == {"wide": "gluon 128x192x64 s4 retiled", "regs": "gluon 128x256x64 s4 regs"}.get(
                    mode, "gluon pp128x128x64 s5 halves"), gp.engine
                n_tiles = gp._table_for(gp.gluon).shape[0]
                # 640 columns: 3 tiles of 256, 5 of 128, 4 of 192; 2 x 512 rows: 4 tiles of 256, 8 of 128
                want = {"halves": x["table"].shape[0] * 5 // 3, "row_halves": x["table"].shape[0] * 2,
                        "wide": x["table"].shape[0] * 4 // 3, "regs": x["table"].shape[0]}[mode]
                assert n_tiles == want, (n_tiles, x["table"].shape)
            # every tile taken once, and one failed take per program (the grids capped at the tiles)
            assert int(counter[0]) == n_tiles + min(100, n_tiles) + (min(32, n_tiles) if it % 2 else 0), (
                int(counter[0]), n_tiles)
        assert gp.engine != "undecided" and (gp.engine.startswith("gluon") or mode == "auto"), gp.engine
        assert "not the tile GEMM's" not in gp.why, gp.why  # (measured: each config's C checked first)
        assert (mode == "ahead") == gp.engine.endswith(" ahead"), gp.engine
        if gp.engine == "tile":
            continue  # (auto picked the tile GEMM: its guarantees are its own tests')
        # a flag never set: bounded, code 1, NaN over the peer's rows, no old value anywhere
        gp2 = engine.engine_plan(a0, b, c0, x["table"], a2=gathered, flags=flags, err=err, counter=counter,
                                 timeout_ns=50_000_000, config=x["cfg"], wait=True, clip=True)
        cap = 300
        a = torch.randn(cap, k, device="cuda", dtype=torch.bfloat16)
        c = torch.full((2 * cap, n), 7.0, device="cuda", dtype=torch.bfloat16)
        counter.zero_()
        flags[0] = 2  # the last call's epoch (3 x 1 wanted... at epoch 1: 3; 2 is stale)
        gp2.launch(gp2.operands(a, b, gathered), c, epoch=1, grid=100, rows=(cap, span))
        torch.cuda.synchronize()
        e = err.tolist()
        assert e[0] == 1 and e[2] == 0 and e[3] == 3 and e[4] == 2, e
        assert torch.isnan(c[cap:]).all(), "a tile that never got its data stored numbers"
        want = a.float() @ b.float()
        ok = torch.isnan(c[:cap]) | ((c[:cap].float() - want).abs() < 0.05 + 0.02 * want.abs())
        assert ok.all(), "a tile stored neither NaN nor its result (old values left?)"
        err.zero_()
        # a CUDA graph of a call: the flag zeroed and posted inside it, new inputs per replay
        cap = 437
        a = torch.empty(cap, k, device="cuda", dtype=torch.bfloat16)
        src_a, src_g = torch.empty_like(a), torch.empty_like(gathered)
        c = torch.empty(2 * cap, n, device="cuda", dtype=torch.bfloat16)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            with torch.cuda.graph(g, stream=s):
                counter.zero_()
                flags.zero_()
                a.copy_(src_a)
                gathered.copy_(src_g)
                flags[0:1].fill_(3)
                gp.launch(gp.operands(a, b, gathered), c, epoch=1, grid=100, rows=(cap, span))
        for _ in range(3):
            src_a.normal_()
            src_g.normal_()
            c.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert int(err[0]) == 0, err.tolist()
            want = torch.cat([src_a, src_g[span:span + cap]]).float() @ b.float()
            rel = ((c.float() - want).norm() / want.norm()).item()
            assert rel < 1e-2, ("graph", mode, layout, rel)
    rep = observe.report()
    assert rep.engines and all(e["engine"] != "undecided" for e in rep.engines), rep.engines
    print(mode, [(e["gemm"], e["engine"], e["why"]) for e in rep.engines])
