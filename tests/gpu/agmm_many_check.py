"""GPU check of all_gather_matmul with a list of weights (one grid over their GEMMs) on R
ranks, under torchrun. bf16, QKV-like weights of different N (and gate / up), both B
layouts, fresh inputs every call (a tile that read before its chunk landed would read the
last call's rows), each transport and chunking, a split tail and the warp-specialized K
loop; against torch.matmul of the gathered rows. Proves the one-grid path ran
(``stats["many"]``, the report's path), and that a list of 5 weights takes the widest-fused
path with its reason in the report. Prints ``PASS agmm_many world=R`` on success."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import overlap  # noqa: E402
import overlap.compat  # noqa: E402,F401
from overlap import dist  # noqa: E402
from tests.gpu._mode import exit_if_shared  # noqa: E402
from overlap.kernels.tile_gemm import GemmConfig, warp_specialize_supported  # noqa: E402
from overlap.ops import all_gather as agmod  # noqa: E402
from overlap.ops import all_reduce as armod  # noqa: E402
from overlap.ops._runtime import OverlapConfig  # noqa: E402


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item()


def main() -> None:
    dist.init()
    exit_if_shared("agmm_many_check.py", "its configs on the NCCL transport")
    world, rank = tdist.get_world_size(), tdist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(1234)  # the same weights and inputs on every rank
    configs = [None, OverlapConfig(transport="nccl", chunks=2, nccl_ctas=8, check="sync"),
               OverlapConfig(transport="nccl", chunks=3, nccl_ctas=8, split_tail=4, check="sync")]
    if world > 1:
        configs.append(OverlapConfig(transport="p2p", chunks=2, split_tail=2, check="sync"))
    if warp_specialize_supported():
        configs.append(OverlapConfig(transport="nccl", chunks=2, nccl_ctas=8, check="sync",
                                     gemm=GemmConfig(warp_specialize=True)))
    shapes = [(1024, 1024, [1024, 256, 256]),   # Q, K, V of a GQA layer (M/R, K, Ns)
              (1000, 512, [1536, 1536]),        # SwiGLU gate, up; a shard that does not fill the tiles
              (512, 256, [128, 384, 256, 64])]  # four weights
    many0, calls = agmod.stats["many"], 0
    for cfg in configs:
        for ms, k, ns in shapes:
            for layout in ("wt", "kn"):
                lins = [torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) / k ** 0.5 for n in ns]
                bs = [w.t() if layout == "wt" else w.t().contiguous() for w in lins]
                for it in range(3):  # new inputs every call
                    full = torch.randn(world * ms, k, device=dev, dtype=torch.bfloat16, generator=g)
                    a = full[rank * ms:(rank + 1) * ms].contiguous()
                    cs, gathered = agmod.all_gather_matmul(a, bs, return_gathered=True, config=cfg)
                    assert torch.equal(gathered, full), ("gathered", cfg, ms, it)
                    for i, (c, b) in enumerate(zip(cs, bs)):
                        want = full @ b
                        assert c.shape == want.shape, (c.shape, want.shape)
                        assert rel(c, want) < 1e-2, (cfg, ms, ns, layout, it, i, rel(c, want))
                    calls += 1
    assert agmod.stats["many"] - many0 == calls, (agmod.stats, calls)
    # the N-D entry points (overlap.all_gather_matmul, compat) hand the list to the one grid too
    x = torch.randn(2, 256, 512, device=dev, dtype=torch.bfloat16, generator=g)  # [B, T/R, K]
    lins = [torch.randn(n, 512, device=dev, dtype=torch.bfloat16, generator=g) for n in (512, 128, 128)]
    before = agmod.stats["many"]
    a_g, outs = overlap.compat.fused_all_gather_matmul(x, [w.t() for w in lins], 1, tdist.group.WORLD.group_name)
    full = torch.cat(list(_gather(x)), dim=1)  # [B, T, K]
    assert torch.equal(a_g, full)
    for o, w in zip(outs, lins):
        # torch's fallback convention (docs/ops/compat.md): a view of the dim-major product
        want = torch.matmul(full.movedim(1, 0).contiguous(), w.t()).movedim(0, 1)
        assert o.shape == want.shape and o.stride() == want.stride(), (o.stride(), want.stride())
        assert rel(o, want) < 1e-2
    assert agmod.stats["many"] == before + 1, agmod.stats
    # five weights: the widest fused, the others after it, the reason in the report
    widest0 = agmod.stats["many_widest"]
    lins = [torch.randn(n, 512, device=dev, dtype=torch.bfloat16, generator=g) for n in (128, 256, 128, 128, 128)]
    a = torch.randn(256, 512, device=dev, dtype=torch.bfloat16, generator=g)
    cs = agmod.all_gather_matmul(a, [w.t() for w in lins])
    full = _gather(a).reshape(-1, 512)
    for c, w in zip(cs, lins):
        assert rel(c, full @ w.t()) < 1e-2
    assert agmod.stats["many_widest"] == widest0 + 1
    text = str(overlap.report())
    assert "weights in one grid" in text and "at most 4" in text, text
    # all_reduce_matmul with a list: one all-reduce and norm, one grid over the GEMMs (NCCL),
    # every rank's partial sums different, inputs changing every call
    armm_many0 = armod.stats["many"]
    norm_w = torch.rand(1024, device=dev, dtype=torch.bfloat16, generator=g) + 0.5
    norm_b = torch.randn(1024, device=dev, dtype=torch.bfloat16, generator=g)
    lins = [torch.randn(n, 1024, device=dev, dtype=torch.bfloat16, generator=g) / 32 for n in (1024, 256, 256)]
    for cfg in (None, OverlapConfig(transport="nccl", chunks=3, nccl_ctas=8, check="sync")):
        for it in range(3):
            parts = torch.randn(world, 2048, 1024, device=dev, dtype=torch.bfloat16, generator=g)
            res = torch.randn(2048, 1024, device=dev, dtype=torch.bfloat16, generator=g)
            cs, h = armod.all_reduce_matmul(parts[rank], [w.t() for w in lins], residual=res,
                                            norm=armod.Norm("layernorm", norm_w, norm_b), config=cfg)
            h_want = parts.float().sum(0) + res.float()
            y = torch.nn.functional.layer_norm(h_want, (1024,), norm_w.float(), norm_b.float())
            assert rel(h, h_want) < 1e-2, ("armm list h", cfg, it, rel(h, h_want))
            for c, w in zip(cs, lins):
                assert rel(c, y @ w.float().t()) < 2e-2, ("armm list", cfg, it, rel(c, y @ w.float().t()))
    assert armod.stats["many"] - armm_many0 == 6, armod.stats
    torch.cuda.synchronize()
    tdist.barrier()
    print(f"PASS agmm_many world={world} rank={rank} calls={calls}", flush=True)
    dist.shutdown()


def _gather(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(tdist.get_world_size(), *x.shape, device=x.device, dtype=x.dtype)
    tdist.all_gather_into_tensor(out, x.contiguous())
    return out


if __name__ == "__main__":
    main()
