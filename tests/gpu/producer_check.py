"""GPU checks of the producer ops (GEMM -> reduce-scatter / all-reduce), one process.

Under torchrun / mpirun with R ranks (``producer2_check.py`` wraps it at 2), or alone at
world size 1: each op against one unsharded reference (A [M, K] and W [N, K] the same on
every rank, sharded along K), inputs new on every call, several chunkings, both B
layouts, fp16 and bf16, the residual; captured in a CUDA graph and replayed with new
inputs; the op on two streams at once. Prints ``PASS producer world=<R> ...``.
"""

from __future__ import annotations

import itertools
import os
import sys

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from overlap import dist  # noqa: E402
from tests.gpu._mode import exit_if_shared  # noqa: E402
from overlap.ops import (SEQUENTIAL, Norm, OverlapConfig, check_errors, matmul_all_reduce, matmul_all_reduce_matmul,  # noqa: E402
                         matmul_reduce_scatter)
from overlap.kernels.tile_gemm import GemmConfig  # noqa: E402
from overlap.ops import boundary as bd  # noqa: E402
from overlap.ops import matmul_reduce as mr  # noqa: E402


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()


def shared(*shape: int, seed: int, dev: torch.device, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=dev, dtype=dtype) * scale


def check_boundary(world: int, rank: int, dev: torch.device) -> tuple[int, float]:
    """matmul_all_reduce_matmul: h = all_reduce(a @ b) + residual, c = norm(h) @ b_next,
    against one unsharded reference (A [M, K], W [N, K], W2 [N2, N] the same on every rank):
    chunkings, norms, dtypes, the default config; then captured and replayed with new inputs."""
    calls, worst = 0, 0.0

    def case(m: int, n: int, k: int, n2: int, dt: torch.dtype, seed: int, kind: str | None) -> tuple:
        ks, n2s = k // world, n2 // world
        a_full = shared(m, k, seed=seed, dev=dev, dtype=dt)
        w = shared(n, k, seed=seed + 1, dev=dev, dtype=dt, scale=k ** -0.5)
        w2 = shared(n2, n, seed=seed + 2, dev=dev, dtype=dt, scale=n ** -0.5)
        res = shared(m, n, seed=seed + 3, dev=dev, dtype=dt)
        nw = shared(n, seed=seed + 4, dev=dev, dtype=dt, scale=0.2) + 1
        nb = shared(n, seed=seed + 5, dev=dev, dtype=dt) if kind == "layernorm" else None
        a = a_full[:, rank * ks:(rank + 1) * ks].contiguous()
        b = w[:, rank * ks:(rank + 1) * ks].t()
        b2 = w2[rank * n2s:(rank + 1) * n2s].t()
        h = (a_full.double() @ w.double().t() + res.double())
        if kind == "layernorm":
            y = torch.nn.functional.layer_norm(h, (n,), nw.double(), nb.double())
        elif kind == "rmsnorm":
            y = torch.nn.functional.rms_norm(h, (n,), nw.double())
        else:
            y = h
        norm = None if kind is None else Norm(kind, nw, nb)
        return a, b, b2, res, norm, y @ b2.double(), h

    for (m, n, k, n2, dt, chunks, kind) in ((1024, 512, 256, 768, torch.bfloat16, 1, "layernorm"),
                                            (2048, 768, 512, 1024, torch.float16, 2, "rmsnorm"),
                                            (1000 * world, 384, 384, 512, torch.bfloat16, 3, None),
                                            (4096, 1024, 2048, 2048, torch.bfloat16, 4, "layernorm"),
                                            (4096, 1024, 1024, 1024, torch.bfloat16, 0, "layernorm")):
        cfg = OverlapConfig(chunks=chunks, nccl_ctas=8, check="sync") if chunks else None  # 0: the default
        for it in range(3):
            a, b, b2, res, norm, c_want, h_want = case(m, n, k, n2, dt, 300 * it + m + n2, kind)
            c, h = matmul_all_reduce_matmul(a, b, b2, residual=res, norm=norm, config=cfg)
            errs = (rel(c, c_want), rel(h, h_want))
            assert max(errs) < 2e-2, (m, n, k, n2, chunks, kind, it, errs)
            calls += 1
    m, n, k, n2 = 2048, 1024, 1024, 1024
    cfg = OverlapConfig(chunks=2, nccl_ctas=8)
    ins = list(case(m, n, k, n2, torch.bfloat16, 11, "layernorm")[:5])
    matmul_all_reduce_matmul(*ins[:3], residual=ins[3], norm=ins[4], config=cfg)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        oc, oh = matmul_all_reduce_matmul(*ins[:3], residual=ins[3], norm=ins[4], config=cfg)
    for i in range(50):
        new = case(m, n, k, n2, torch.bfloat16, 20 + i, "layernorm")
        for t, u in zip(ins[:4], new[:4]):
            t.copy_(u)
        ins[4].weight.copy_(new[4].weight)
        ins[4].bias.copy_(new[4].bias)
        g.replay()
        errs = (rel(oc, new[5]), rel(oh, new[6]))
        worst = max(worst, *errs)
        assert max(errs) < 2e-2, ("replay", i, errs)
    # the tuner: whatever it picks (a config, or the sequential reference), a later call
    # without a config takes it; inputs change every call
    from overlap.ops import tune_matmul_all_reduce_matmul

    m, n, k, n2 = 4096, 1024, 1024, 2048
    a, b, b2, res, norm = case(m, n, k, n2, torch.bfloat16, 77, "layernorm")[:5]
    best = tune_matmul_all_reduce_matmul(a, b, b2, residual=res, norm=norm, iters=3)
    assert best is SEQUENTIAL or isinstance(best, OverlapConfig), best
    for it in range(3):
        a, b, b2, res, norm, c_want, h_want = case(m, n, k, n2, torch.bfloat16, 500 + it, "layernorm")
        c, h = matmul_all_reduce_matmul(a, b, b2, residual=res, norm=norm)
        errs = (rel(c, c_want), rel(h, h_want))
        assert max(errs) < 2e-2, ("tuned", best, it, errs)
        calls += best is not SEQUENTIAL  # the fused calls the stats must count
    return calls, worst


def main() -> None:
    ctx = dist.init()
    exit_if_shared("producer_check.py", "the producer ops' NCCL transport; producer_p2p_check.py is the peer-copy one")
    world, rank = tdist.get_world_size(), tdist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    calls = 0
    for (m, n, k, dt, chunks, layout) in ((1024, 512, 256, torch.bfloat16, 1, "wt"),
                                          (2048, 768, 512, torch.float16, 2, "kn"),
                                          (1000 * world, 384, 384, torch.bfloat16, 3, "wt"),
                                          (4096, 1024, 2048, torch.bfloat16, 4, "wt")):
        ks = k // world
        # the per-tile GEMM and the flattened one (GemmConfig.flatten, posting per chunk)
        for it, flat in itertools.product(range(3), (False, True)):
            cfg = OverlapConfig(chunks=chunks, nccl_ctas=8, check="sync", give_back=not flat,
                                gemm=GemmConfig(flatten=True) if flat else None)
            seed = 100 * it + m + n + k + 17 * flat
            a_full = shared(m, k, seed=seed, dev=dev, dtype=dt)
            w = shared(n, k, seed=seed + 1, dev=dev, dtype=dt, scale=k ** -0.5)
            res = shared(m, n, seed=seed + 2, dev=dev, dtype=dt)
            a = a_full[:, rank * ks:(rank + 1) * ks].contiguous()
            wr = w[:, rank * ks:(rank + 1) * ks]
            b = wr.t() if layout == "wt" else wr.t().contiguous()
            full = a_full.double() @ w.double().t()
            mine = full[rank * (m // world):(rank + 1) * (m // world)]
            e1 = rel(matmul_reduce_scatter(a, b, config=cfg), mine)
            e2 = rel(matmul_all_reduce(a, b, residual=res, config=cfg), full + res.double())
            assert e1 < 2e-2 and e2 < 2e-2, (m, n, k, chunks, it, flat, e1, e2)
            calls += 2
    # graphs: the same call captured and replayed with new inputs
    m, n, k = 2048, 1024, 1024
    ks = k // world
    cfg = OverlapConfig(chunks=2, nccl_ctas=8)
    a = torch.empty(m, ks, device=dev, dtype=torch.bfloat16)
    b = (shared(n, k, seed=5, dev=dev, dtype=torch.bfloat16, scale=k ** -0.5)[:, rank * ks:(rank + 1) * ks]).t()
    res = torch.empty(m, n, device=dev, dtype=torch.bfloat16)

    def refill(i: int) -> torch.Tensor:
        a_full = shared(m, k, seed=7000 + i, dev=dev, dtype=torch.bfloat16)
        a.copy_(a_full[:, rank * ks:(rank + 1) * ks])
        res.copy_(shared(m, n, seed=9000 + i, dev=dev, dtype=torch.bfloat16))
        wf = shared(n, k, seed=5, dev=dev, dtype=torch.bfloat16, scale=k ** -0.5)
        return a_full.double() @ wf.double().t()

    refill(0)
    matmul_reduce_scatter(a, b, config=cfg)
    matmul_all_reduce(a, b, residual=res, config=cfg)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o1 = matmul_reduce_scatter(a, b, config=cfg)
        o2 = matmul_all_reduce(a, b, residual=res, config=cfg)
    worst = 0.0
    for i in range(100):
        full = refill(1 + i)
        g.replay()
        errs = (rel(o1, full[rank * (m // world):(rank + 1) * (m // world)]), rel(o2, full + res.double()))
        worst = max(worst, *errs)
        assert max(errs) < 2e-2, (i, errs)
    # two streams at once
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for i in range(10):
        full = refill(500 + i)
        torch.cuda.synchronize()
        with torch.cuda.stream(s1):
            r1 = matmul_reduce_scatter(a, b, config=cfg)
        with torch.cuda.stream(s2):
            r2 = matmul_all_reduce(a, b, config=cfg)
        torch.cuda.synchronize()
        assert rel(r1, full[rank * (m // world):(rank + 1) * (m // world)]) < 2e-2
        assert rel(r2, full) < 2e-2
    # the tuners: whatever wins, a later call without a config takes it
    from overlap.ops import tune_matmul_all_reduce, tune_matmul_reduce_scatter

    for tune, op in ((tune_matmul_reduce_scatter, matmul_reduce_scatter), (tune_matmul_all_reduce, matmul_all_reduce)):
        best = tune(a, b, iters=3)
        full = refill(900)
        got = op(a, b)
        want = full[rank * (m // world):(rank + 1) * (m // world)] if op is matmul_reduce_scatter else full
        assert rel(got, want) < 2e-2, (best, rel(got, want))
    bcalls, bworst = check_boundary(world, rank, dev)
    check_errors()
    assert mr.stats["fused"] >= calls, mr.stats
    assert bd.stats["fused"] >= bcalls, bd.stats
    tdist.barrier()
    if rank == 0:
        print(f"PASS producer world={world} {ctx.launch.launcher} calls={calls} replays=100 worst={worst:.1e} "
              f"stats={mr.stats}; boundary calls={bcalls} replays=50 worst={bworst:.1e} stats={bd.stats}", flush=True)
    dist.shutdown()


if __name__ == "__main__":
    main()
