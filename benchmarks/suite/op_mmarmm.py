"""The block boundary: ``h = all_reduce(a @ b) + residual; c = layer_norm(h) @ b_next``
(overlap.ops.matmul_all_reduce_matmul): fc2's row-parallel GEMM, the all-reduce, the
residual add and LayerNorm, and the next layer's column-parallel GEMM.

Shapes M x N x K: a [M, K] (K per rank), b [K, N], b_next [N, N2] with N2 = 4N / R (a fc1
shard after fc2's output; M x N x K of fc2). Variants: sequential reference (cuBLAS, NCCL
all-reduce, add + LayerNorm, cuBLAS), the two ops one after the other
(``matmul_all_reduce`` with the residual, then LayerNorm and cuBLAS), the pipeline (both
GEMMs overlapped with the all-reduce, chunk by chunk; tuned first on CUDA:
``tune_matmul_all_reduce_matmul``, which may pick the sequential reference). Parts: the all-reduce alone and
the two cuBLAS GEMMs alone.
"""

from __future__ import annotations

from typing import Any

import torch

from .oputil import describe_config, library_comm, raise_kernel_errors
from .spec import Case, Env, OpSpec, Shape, Variant, mnk

SHAPES = {
    "gpt3-175b": [mnk("gpt3-175b", 8192, 12288, 6144, name="fc2 / 8 -> fc1 / 8")],
    "llama-70b": [mnk("llama-70b", 8192, 8192, 3584, name="fc2 / 8 -> fc1 / 8")],
    "comm-heavy": [mnk("comm-heavy", 8192, 8192, 1024)],
}


def setup(shape: Shape, env: Env) -> Case:
    from overlap.ops import Norm, matmul_all_reduce, matmul_all_reduce_matmul, matmul_all_reduce_matmul_ref
    from overlap.ops import boundary as bd

    m, n, k = shape.dims["M"], shape.dims["N"], shape.dims["K"]
    n2 = max(8, 4 * n // env.world)
    g = env.group
    a = env.randn(m, k, seed=1000 * env.rank + m + n + k)
    b = env.randn(n, k, seed=7 + env.rank, scale=k ** -0.5).t()  # this rank's nn.Linear columns, as w.t()
    b2 = env.randn(n2, n, seed=9 + env.rank, scale=n ** -0.5).t()  # the next layer's rows, as w.t()
    res = env.randn(m, n, seed=11)
    ln = Norm("layernorm", env.randn(n, seed=12, scale=0.1) + 1, env.randn(n, seed=13, scale=0.1))

    def two_ops() -> Any:
        h = matmul_all_reduce(a, b, group=g, residual=res)
        return ln.apply(h) @ b2, h

    lib = Variant("library (pipeline, tuned)", fn=lambda: matmul_all_reduce_matmul(a, b, b2, group=g, residual=res, norm=ln),
                  role="library", synced=True, note=None if env.on_gpu else "CPU: no tile-flag path, runs the reference")
    if env.on_gpu:
        lib.counter = lambda: bd.stats["fused"]
        if env.tune:
            lib.prepare = lambda: describe_config(bd.tune_matmul_all_reduce_matmul(
                a, b, b2, group=g, residual=res, norm=ln, verbose=env.verbose))
        comm = library_comm(env)
        c = a @ b
        parts: dict[str, Any] = {"comm": lambda: comm.all_reduce(c, c), "gemm": lambda: (a @ b, c @ b2)}
    else:
        import torch.distributed as tdist

        c = a @ b
        parts = {"comm": lambda: tdist.all_reduce(c, group=g), "gemm": lambda: (a @ b, c @ b2)}

    def check() -> dict[str, float]:
        a2 = torch.randn_like(a)
        got = matmul_all_reduce_matmul(a2, b, b2, group=g, residual=res, norm=ln)
        want = matmul_all_reduce_matmul_ref(a2, b, b2, group=g, residual=res, norm=ln)
        return {"rel_err": max(env.rel_err(got[0], want[0]), env.rel_err(got[1], want[1]))}

    variants = {
        "reference": Variant("sequential", fn=lambda: matmul_all_reduce_matmul_ref(a, b, b2, group=g, residual=res,
                                                                                   norm=ln),
                             role="reference", synced=True),
        "two_ops": Variant("matmul_all_reduce, then LN + cuBLAS", fn=two_ops, synced=True,
                           note=None if env.on_gpu else "CPU: no tile-flag path, runs the reference"),
        "tile_flag": lib,
    }
    return Case(variants=variants, parts=parts, flops=2.0 * m * n * k + 2.0 * m * n2 * n,
                comm_bytes=m * n * a.element_size(), check=check, finish=lambda: raise_kernel_errors(env))


OP = OpSpec(name="mmarmm", title="GEMM -> all-reduce -> LN -> GEMM (block boundary)", comm="all_reduce", shapes=SHAPES,
            setup=setup, part_titles={"comm": "all-reduce", "gemm": "2 cuBLAS GEMMs"},
            floor_title="floor = max(all-reduce, 2 GEMMs)", dims_doc="M x N x K of the first GEMM (K per rank)",
            observed="matmul_all_reduce_matmul")
