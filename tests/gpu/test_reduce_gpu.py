"""The p2p all-reduce's reduce kernel on one GPU: h bit for bit as the fp32 sum rounded.

At two ranks the kernel adds the two partials (and then the residual) in their own
16-bit type, one rounding each; this must give the bits of the fp32 sum rounded,
which is what the reference (and the kernel at more ranks) computes. Values are
drawn over a wide exponent range, with exact cancellations and terms far below
half an ulp of the other, in bf16 and fp16; the folded norm's statistics are
checked against torch's on the same rows.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def _wide(g, shape, dt, device):
    import torch

    # magnitudes over 2^-20 .. 2^20 (2^-12 .. 2^12 for fp16: no overflow), either sign
    span = 20 if dt == torch.bfloat16 else 12
    mag = torch.exp2(torch.randint(-span, span + 1, shape, generator=g).float())
    v = (torch.rand(shape, generator=g) + 0.5) * mag * torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    return v.to(dt).to(device)


@pytest.mark.parametrize("dt_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("world", [2, 3])
def test_reduce_bits(dt_name: str, world: int) -> None:
    import torch

    from overlap.kernels.add_norm import ReducePlan
    from overlap.policies import push_slot

    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    dev = torch.device("cuda", 0)
    dt = getattr(torch, dt_name)
    g = torch.Generator().manual_seed(7)
    m, k, chunks, rank = 300, 1024, 3, world - 1
    parts = [_wide(g, (m, k), dt, dev) for _ in range(world)]
    parts[1][:7] = -parts[0][:7]  # exact cancellation
    parts[1][7:14] = parts[0][7:14] * 2.0 ** -13  # a term below half an ulp of the other
    res = _wide(g, (m, k), dt, dev)
    recv = torch.empty(world - 1, m, k, dtype=dt, device=dev)
    for r in range(world):
        if r != rank:
            recv[push_slot(r, rank, world)] = parts[r]
    starts = torch.tensor([i * m // chunks for i in range(chunks + 1)], dtype=torch.int32, device=dev)
    rflags = torch.ones((world - 1) * chunks, dtype=torch.int32, device=dev)
    tot = torch.zeros(m, k, device=dev)
    for p in parts:  # rank order, fp32, one rounding
        tot += p.float()
    want = (tot.to(dt).float() + res.float()).to(dt)
    for norm in (None, "layernorm", "rmsnorm"):
        h = torch.full((m, k), float("nan"), dtype=dt, device=dev)
        stats = torch.full((m, 2), float("nan"), device=dev) if norm else None
        ready = torch.zeros(chunks, dtype=torch.int32, device=dev)
        err = torch.zeros(8, dtype=torch.int32, device=dev)
        plan = ReducePlan(parts[rank], recv, h, starts=starts, rflags=rflags, ready=ready, err=err, rank=rank,
                          world=world, programs=5, residual=res, norm=norm, stats=stats)
        plan.launch(parts[rank], recv, h, epoch=1, residual=res, stats=stats)
        torch.cuda.synchronize()
        assert int(err[0]) == 0 and ready.tolist() == [5] * chunks
        bad = (h.view(torch.int16) != want.view(torch.int16)).nonzero()
        assert bad.numel() == 0, (norm, bad[:4].tolist(), h[tuple(bad[0])].item(), want[tuple(bad[0])].item())
        if norm:
            hf = want.double()
            mean = hf.mean(1) if norm == "layernorm" else torch.zeros(m, dtype=torch.float64, device=dev)
            var = hf.var(1, unbiased=False) if norm == "layernorm" else (hf * hf).mean(1)
            rstd = 1.0 / (var + 1e-5).sqrt()
            torch.testing.assert_close(stats[:, 0].double(), rstd, rtol=1e-4, atol=0)
            torch.testing.assert_close(stats[:, 1].double(), mean * rstd, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dt_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("k", [1024, 3072, 12288])
def test_reduce_normed_rows(dt_name: str, k: int) -> None:
    """y = norm(h) written by the kernel: from segment statistics (the default) and from
    whole rows (segment 0), against torch's norm of the same h; h bit for bit."""
    import torch

    from overlap.kernels.add_norm import ReducePlan, ReduceShape

    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    dev = torch.device("cuda", 0)
    dt = getattr(torch, dt_name)
    g = torch.Generator().manual_seed(11)
    m, chunks, world, rank = 300, 3, 2, 0
    parts = [(torch.randn(m, k, generator=g) + 3.0).to(dt).to(dev) for _ in range(world)]
    res = torch.randn(m, k, generator=g).to(dt).to(dev)
    w = (torch.rand(k, generator=g) + 0.5).to(dt).to(dev)
    bias = torch.randn(k, generator=g).to(dt).to(dev)
    recv = parts[1].unsqueeze(0).clone()
    starts = torch.tensor([i * m // chunks for i in range(chunks + 1)], dtype=torch.int32, device=dev)
    rflags = torch.ones(chunks, dtype=torch.int32, device=dev)
    want = ((parts[0].float() + parts[1].float()).to(dt).float() + res.float()).to(dt)
    tol = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dt]
    for norm in ("layernorm", "rmsnorm"):
        b = bias if norm == "layernorm" else None
        hf = want.float()
        if norm == "layernorm":
            ref = torch.nn.functional.layer_norm(hf, (k,), w.float(), b.float(), eps=1e-5)
        else:
            ref = hf * torch.rsqrt((hf * hf).mean(1, keepdim=True) + 1e-5) * w.float()
        for segment in (None, 0):
            h = torch.full((m, k), float("nan"), dtype=dt, device=dev)
            y = torch.full((m, k), float("nan"), dtype=dt, device=dev)
            ready = torch.zeros(chunks, dtype=torch.int32, device=dev)
            err = torch.zeros(8, dtype=torch.int32, device=dev)
            plan = ReducePlan(parts[rank], recv, h, starts=starts, rflags=rflags, ready=ready, err=err, rank=rank,
                              world=world, programs=5, residual=res, norm=norm, weight=w, bias=b, y=y,
                              shape=ReduceShape(segment=segment))
            assert (plan.seg is not None) == (segment is None), (k, segment)
            plan.launch(parts[rank], recv, h, epoch=1, residual=res, weight=w, bias=b, y=y)
            torch.cuda.synchronize()
            assert int(err[0]) == 0 and ready.tolist() == [5] * chunks
            assert torch.equal(h, want), (norm, segment)
            torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol, msg=lambda s: f"{norm} {segment}: {s}")
