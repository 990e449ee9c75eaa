"""``launch_gemm`` on the GPU: the GEMM alone with and without a tail launch against torch,
new inputs every call; replayed in a CUDA graph with changing inputs; a shape's first call
inside a capture refused with a clear error."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch


def _rel(c, a, w):
    ref = a.float() @ w.float().t()
    return ((c.float() - ref).norm() / ref.norm()).item()


@pytest.mark.gpu
def test_launch_gemm_tail_matches_torch_and_replays() -> None:
    from overlap.kernels.tile_gemm import GemmConfig, launch_gemm, tail_rows

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    big = GemmConfig(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, flatten=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for m, n, k in ((8192, 3696, 2048), (1024, 9216, 1024), (300, 512, 256)):
        for dtype in (torch.bfloat16, torch.float16):
            w = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) / k ** 0.5
            for tail in ((0, 0), (64, 256), (128, 128)):
                cfg = replace(big, tail_block_m=tail[0], tail_block_n=tail[1])
                for b in (w.t(), w.t().contiguous()):
                    for _ in range(2):
                        a = torch.randn(m, k, device="cuda", dtype=dtype, generator=g)
                        c = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
                        launch_gemm(a, b, c, grid=sms, config=cfg)
                        torch.cuda.synchronize()
                        assert not torch.isnan(c).any(), (m, n, tail, "an element not written")
                        assert _rel(c, a, w) < 1e-2, (m, n, k, tail, dtype, _rel(c, a, w))
    cfg = replace(big, tail_block_m=128, tail_block_n=128)
    m, n, k = 8192, 3696, 1024
    assert 0 < tail_rows(m, n, cfg, sms) < m
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    launch_gemm(a, w.t(), c, grid=sms, config=cfg)  # the shape's tables made before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_gemm(a, w.t(), c, grid=sms, config=cfg)
    for _ in range(3):
        a.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g))
        c.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(c, a, w) < 1e-2
    a2 = torch.randn(m + 128, k, device="cuda", dtype=torch.bfloat16, generator=g)
    c2 = torch.empty(m + 128, n, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="before capturing"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            launch_gemm(a2, w.t(), c2, grid=sms, config=cfg)
