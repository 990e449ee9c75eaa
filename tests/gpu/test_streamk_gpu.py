"""GemmConfig.stream_k on the GPU: the stream-K GEMM alone against torch on shapes below
one wave, with a partial wave and with full waves; new inputs every call; the same bits
twice; replayed in a CUDA graph with changing inputs; two launches at once on two
streams; the fix-up counters zero after every launch."""

from __future__ import annotations

import pytest
import torch

SHAPES = ((2048, 1536, 4096), (1000, 3000, 1024), (512, 3584, 1792), (4096, 4096, 2048), (300, 256, 8192))
"""96 tiles of 128x256 (below a wave), partial tiles, a partial wave past the first, full
waves (128 tiles: data-parallel only at 128x256, or 256 at 128x128), one row of tiles."""


def _setup(m, n, k, cfg, dtype=torch.bfloat16, seed=0):
    from overlap.policies import Segment, build_tile_table

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k ** 0.5
    table = torch.tensor(build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, cfg.block_m, cfg.block_n,
                                          group_m=cfg.group_m), dtype=torch.int32, device="cuda")
    return g, w, table


def _rel(c, a, w):
    ref = a.float() @ w.float().t()
    return ((c.float() - ref).norm() / ref.norm()).item()


def _counters_zero():
    from overlap.kernels import streamk

    torch.cuda.synchronize()
    for ws, cnt in streamk._buffers.by.values():
        assert int(cnt.abs().sum()) == 0, cnt[:32].tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(128, 256, 3), (128, 128, 4), (64, 256, 4)])
def test_streamk_matches_torch(tile) -> None:
    from overlap.kernels.tile_gemm import GemmConfig, launch_tile_gemm

    bm, bn, st = tile
    cfg = GemmConfig(block_m=bm, block_n=bn, block_k=64, num_stages=st, num_warps=8 if bm * bn > 128 * 128 else 4,
                     stream_k=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m, n, k in SHAPES:
        for dtype in (torch.bfloat16, torch.float16):
            g, w, table = _setup(m, n, k, cfg, dtype)
            for b in (w.t(), w.t().contiguous()):
                outs = []
                for call in range(3):
                    a = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
                    c = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                    launch_tile_gemm(a, b, c, table, grid=sms, config=cfg)
                    torch.cuda.synchronize()
                    assert not torch.isnan(c).any(), (m, n, k, tile, "an element not written")
                    assert _rel(c, a, w) < 1e-2, (m, n, k, tile, dtype, call, _rel(c, a, w))
                    outs.append((a, c))
                a, c = outs[-1]
                again = torch.empty_like(c)
                launch_tile_gemm(a, b, again, table, grid=sms, config=cfg)
                torch.cuda.synchronize()
                assert torch.equal(again, c), (m, n, k, tile, "not the same bits twice")
                _counters_zero()


@pytest.mark.gpu
def test_streamk_graph_and_streams() -> None:
    from overlap.kernels.tile_gemm import GemmConfig, launch_tile_gemm

    cfg = GemmConfig(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, stream_k=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m, n, k = 2048, 1536, 4096
    g, w, table = _setup(m, n, k, cfg)
    b = w.t()
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch_tile_gemm(a, b, c, table, grid=sms, config=cfg)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_tile_gemm(a, b, c, table, grid=sms, config=cfg)
    for _ in range(4):
        a.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g))
        c.fill_(float("nan"))
        graph.replay()
        # an eager launch on the same stream between replays shares nothing with them
        c2 = torch.empty_like(c)
        a2 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        launch_tile_gemm(a2, b, c2, table, grid=sms, config=cfg)
        torch.cuda.synchronize()
        assert _rel(c, a, w) < 1e-2 and _rel(c2, a2, w) < 1e-2, (_rel(c, a, w), _rel(c2, a2, w))
    # two launches at once on two streams, each many times: buffers per stream
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2)]
    ys = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    torch.cuda.synchronize()
    for _ in range(20):
        for s, x, y in zip((s1, s2), xs, ys):
            with torch.cuda.stream(s):
                launch_tile_gemm(x, b, y, table, grid=sms, config=cfg)
    torch.cuda.synchronize()
    for x, y in zip(xs, ys):
        assert _rel(y, x, w) < 1e-2, _rel(y, x, w)
    _counters_zero()
