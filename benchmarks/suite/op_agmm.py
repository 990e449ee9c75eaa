"""All-gather -> GEMM: ``c = all_gather(a_shard, dim=0) @ b`` (overlap.ops.all_gather_matmul).

Shapes M x N x K with M the rows after the gather (each rank holds M/R rows of A).
Variants: sequential reference (NCCL all-gather, then cuBLAS), chunked stream overlap x2
and x4, the library's op (tuned first on CUDA: tile-flag or sequential), torch's symm_mem
fused_all_gather_matmul (CUDA only). Parts: the library communicator's all-gather alone
(NCCL's default CTAs; torch's all_gather_into_tensor alone is recorded beside it) and the
cuBLAS GEMM [M, K] x [K, N] alone.
"""

from __future__ import annotations

import torch

from .oputil import (CPU_FALLBACK, describe_config, library_comm, p2p_push_alone, raise_kernel_errors,
                     symm_mem_variant, tile_gemm_alone, torch_all_gather)
from .spec import Case, Env, OpSpec, Shape, Variant, mnk

SHAPES = {
    "comm-heavy": [mnk("comm-heavy", 16384, 2048, 8192), mnk("comm-heavy", 8192, 1024, 8192)],
    "gpt3-175b": [mnk("gpt3-175b", 8192, 18432, 12288, name="fc1 / 8"),
                  mnk("gpt3-175b", 8192, 24576, 12288, name="qkv-like")],
    "llama-70b": [mnk("llama-70b", 8192, 14336, 8192, name="fc1")],
}

# the tuner's candidates: NCCL chunk counts x CTA caps, plus an SM-budget and a give-back
# probe; with peer memory, copy-engine pushes in 1..8 chunks
TUNE_GRID = [dict(chunks=ch, nccl_ctas=ct, transport="nccl") for ch in (1, 2, 4) for ct in (16, 24, 32)] + [
    dict(chunks=2, nccl_ctas=8, sm_margin=12, transport="nccl"),
    dict(chunks=2, nccl_ctas=24, give_back=False, transport="nccl")]
TUNE_GRID_P2P = [dict(chunks=ch, transport="p2p") for ch in (1, 2, 4, 8)]


def setup(shape: Shape, env: Env) -> Case:
    from overlap.ops import all_gather_matmul, all_gather_matmul_chunked, all_gather_matmul_ref

    m, n, k = shape.dims["M"], shape.dims["N"], shape.dims["K"]
    if m % env.world:
        raise ValueError(f"M={m} is not a multiple of the {env.world} ranks")
    g, ms = env.group, m // env.world
    a = env.randn(ms, k, seed=1000 * env.rank + m + n + k)
    b = env.randn(n, k, seed=7, scale=k ** -0.5).t()  # nn.Linear weight [N, K], used as w.t()
    gathered = a.new_empty(m, k)
    full = env.randn(m, k, seed=11)
    cpu_note = None if env.on_gpu else CPU_FALLBACK
    tile = Variant("library (tuned)", fn=lambda: all_gather_matmul(a, b, group=g), role="library", synced=True,
                   note=None if env.on_gpu else "CPU: no tile-flag path, runs the reference")
    if env.on_gpu:
        from overlap.ops import OverlapConfig, tune_all_gather_matmul
        from overlap.ops import all_gather as agmod

        tile.counter = lambda: agmod.stats["fused"]
        from overlap.ops._runtime import get_runtime

        grid = TUNE_GRID + (TUNE_GRID_P2P if get_runtime(g, env.device).p2p() is not None else [])
        if env.tune:
            tile.prepare = lambda: describe_config(tune_all_gather_matmul(
                a, b, group=g, candidates=[OverlapConfig(**c) for c in grid], verbose=env.verbose,
                split_pass=True, ws_pass=True))
        comm = library_comm(env)
        parts = {"comm": lambda: comm.all_gather(a, gathered), "gemm": lambda: full @ b}
    else:
        parts = {"comm": torch_all_gather(env, gathered, a), "gemm": lambda: full @ b}

    def check() -> dict[str, float]:
        a2 = torch.randn_like(a)
        return {"rel_err": env.rel_err(all_gather_matmul(a2, b, group=g), all_gather_matmul_ref(a2, b, group=g))}

    variants = {
        "reference": Variant("sequential", fn=lambda: all_gather_matmul_ref(a, b, group=g), role="reference",
                             synced=True),
        "chunked2": Variant("chunked x2", fn=lambda: all_gather_matmul_chunked(a, b, group=g, chunks=2),
                            note=cpu_note),
        "chunked4": Variant("chunked x4", fn=lambda: all_gather_matmul_chunked(a, b, group=g, chunks=4),
                            note=cpu_note),
        "tile_flag": tile,
        "symm_mem": symm_mem_variant(env, "symm_mem fused", lambda name: (
            lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], gather_dim=0, group_name=name))),
    }
    return Case(variants=variants, parts=parts, flops=2.0 * m * n * k, comm_bytes=m * k * a.element_size(),
                extra={k: v for k, v in (("comm_torch", torch_all_gather(env, gathered, a)),
                                         ("tile_gemm", tile_gemm_alone(env, full, b)),
                                         ("comm_p2p_push", p2p_push_alone(env, a))) if v is not None}
                if env.on_gpu else {},
                check=check, finish=lambda: raise_kernel_errors(env))


OP = OpSpec(name="agmm", title="All-gather -> GEMM", comm="all_gather", shapes=SHAPES, setup=setup,
            part_titles={"comm": "all-gather", "gemm": "cuBLAS GEMM"},
            floor_title="floor = max(all-gather, GEMM)", observed="all_gather_matmul")
