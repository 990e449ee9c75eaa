"""All-gather -> three GEMMs (Q, K and V, or gate / up / a third): one gathered input,
``[all_gather(a_shard, dim=0) @ b for b in (bq, bk, bv)]`` (overlap.all_gather_matmul with
a list of weights, docs/ops/compat.md).

Shapes M x N x K with N each weight's columns (three weights; M the rows after the
gather). Variants: sequential reference (NCCL all-gather, then three cuBLAS GEMMs), the
library's op with the list (the first weight's GEMM overlapped, the other two after it),
the library's op on the weights concatenated [K, 3N] (one overlapped GEMM; the
concatenation copied every call, inside the timing), torch's symm_mem
fused_all_gather_matmul with three Bs (CUDA only). Parts: the all-gather alone and the three
cuBLAS GEMMs alone.
"""

from __future__ import annotations

import torch

from .oputil import library_comm, raise_kernel_errors, symm_mem_variant, torch_all_gather
from .spec import Case, Env, OpSpec, Shape, Variant, mnk

SHAPES = {
    "llama-70b": [mnk("llama-70b", 8192, 1024, 8192, name="qkv / 8 (q share)")],
    "gpt3-175b": [mnk("gpt3-175b", 8192, 1536, 12288, name="qkv / 8"),
                  mnk("gpt3-175b", 8192, 6144, 12288, name="qkv / 2")],
    "comm-heavy": [mnk("comm-heavy", 16384, 512, 4096)],
}


def setup(shape: Shape, env: Env) -> Case:
    import overlap
    from overlap.ops import all_gather_matmul_ref

    m, n, k = shape.dims["M"], shape.dims["N"], shape.dims["K"]
    if m % env.world:
        raise ValueError(f"M={m} is not a multiple of the {env.world} ranks")
    g, ms = env.group, m // env.world
    a = env.randn(ms, k, seed=1000 * env.rank + m + n + k)
    ws = [env.randn(n, k, seed=7 + i, scale=k ** -0.5) for i in range(3)]  # nn.Linear weights [N, K]
    bs = [w.t() for w in ws]
    gathered = a.new_empty(m, k)
    full = env.randn(m, k, seed=11)

    def sequential() -> list[torch.Tensor]:
        x = all_gather_matmul_ref(a, bs[0], group=g, return_gathered=True)
        return [x[0]] + [x[1] @ b for b in bs[1:]]

    def concatenated() -> torch.Tensor:
        return overlap.all_gather_matmul(a, torch.cat(ws).t(), group=g)  # [M, 3N]

    lib = Variant("library, list", fn=lambda: overlap.all_gather_matmul(a, bs, group=g), role="library",
                  synced=True, note=None if env.on_gpu else "CPU: no tile-flag path, runs the reference")
    cat = Variant("library, weights concatenated", fn=concatenated, synced=True,
                  note=None if env.on_gpu else "CPU: no tile-flag path, runs the reference")
    if env.on_gpu:
        from overlap.ops import all_gather as agmod

        lib.counter = lambda: agmod.stats["fused"]
        comm = library_comm(env)
        parts = {"comm": lambda: comm.all_gather(a, gathered), "gemm": lambda: [full @ b for b in bs]}
    else:
        parts = {"comm": torch_all_gather(env, gathered, a), "gemm": lambda: [full @ b for b in bs]}

    def check() -> dict[str, float]:
        a2 = torch.randn_like(a)
        got = overlap.all_gather_matmul(a2, bs, group=g)
        g2 = all_gather_matmul_ref(a2, bs[0], group=g, return_gathered=True)[1]
        return {"rel_err": max(env.rel_err(c, g2 @ b) for c, b in zip(got, bs))}

    variants = {
        "reference": Variant("sequential", fn=sequential, role="reference", synced=True),
        "tile_flag": lib,
        "concat": cat,
        "symm_mem": symm_mem_variant(env, "symm_mem fused", lambda name: (
            lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, bs, gather_dim=0, group_name=name))),
    }
    return Case(variants=variants, parts=parts, flops=2.0 * m * 3 * n * k, comm_bytes=m * k * a.element_size(),
                check=check, finish=lambda: raise_kernel_errors(env))


OP = OpSpec(name="agmm3", title="All-gather -> three GEMMs (QKV)", comm="all_gather", shapes=SHAPES, setup=setup,
            part_titles={"comm": "all-gather", "gemm": "3 cuBLAS GEMMs"},
            floor_title="floor = max(all-gather, 3 GEMMs)", dims_doc="M x N x K (N per weight, 3 weights)",
            observed="all_gather_matmul")
