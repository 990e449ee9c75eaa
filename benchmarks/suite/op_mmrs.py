"""GEMM -> reduce-scatter: ``reduce_scatter(a @ b)`` (overlap.ops.matmul_reduce_scatter).

Shapes M x N x K with K the per-rank K (each rank holds a [M, K] and b [K, N]; the output
is M/R rows). Variants: sequential reference (cuBLAS, then NCCL reduce-scatter), chunked
stream overlap x2 and x4, the library's op (tuned first on CUDA), torch's symm_mem
fused_matmul_reduce_scatter (CUDA only). Parts: the library communicator's reduce-scatter
alone (NCCL's default CTAs) and the cuBLAS GEMM alone. ``op_mmar`` is the all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch

from .oputil import CPU_FALLBACK, describe_config, library_comm, raise_kernel_errors, symm_mem_variant
from .spec import Case, Env, OpSpec, Shape, Variant, mnk

SHAPES = {
    "gpt3-175b": [mnk("gpt3-175b", 8192, 12288, 6144, name="fc2 / 8"),
                  mnk("gpt3-175b", 8192, 12288, 24576, name="fc2 / 2")],
    "llama-70b": [mnk("llama-70b", 8192, 8192, 3584, name="fc2 / 8")],
    "comm-heavy": [mnk("comm-heavy", 16384, 8192, 1024), mnk("comm-heavy", 8192, 8192, 2048)],
}


def make_case(shape: Shape, env: Env, scatter: bool) -> Case:
    from overlap.ops import (matmul_all_reduce, matmul_all_reduce_chunked, matmul_all_reduce_ref,
                             matmul_reduce_scatter, matmul_reduce_scatter_chunked, matmul_reduce_scatter_ref)
    from overlap.ops import matmul_reduce as mr

    m, n, k = shape.dims["M"], shape.dims["N"], shape.dims["K"]
    if scatter and m % env.world:
        raise ValueError(f"M={m} is not a multiple of the {env.world} ranks")
    g = env.group
    a = env.randn(m, k, seed=1000 * env.rank + m + n + k)
    b = env.randn(n, k, seed=7 + env.rank, scale=k ** -0.5).t()  # this rank's nn.Linear columns, as w.t()
    op, ref, chunked = ((matmul_reduce_scatter, matmul_reduce_scatter_ref, matmul_reduce_scatter_chunked) if scatter
                        else (matmul_all_reduce, matmul_all_reduce_ref, matmul_all_reduce_chunked))
    cpu_note = None if env.on_gpu else CPU_FALLBACK
    lib = Variant("library (tuned)", fn=lambda: op(a, b, group=g), role="library", synced=True,
                  note=None if env.on_gpu else "CPU: no tile-flag path, runs the reference")
    if env.on_gpu:
        lib.counter = lambda: mr.stats["fused"]
        if env.tune:
            from overlap.ops import tune_matmul_all_reduce, tune_matmul_reduce_scatter

            tune = tune_matmul_reduce_scatter if scatter else tune_matmul_all_reduce
            lib.prepare = lambda: describe_config(tune(a, b, group=g, verbose=env.verbose))
    c = a @ b
    if env.on_gpu:
        comm = library_comm(env)
        out = c.new_empty(m // env.world, n)
        parts: dict[str, Any] = {"comm": (lambda: comm.reduce_scatter(c, out)) if scatter
                                 else (lambda: comm.all_reduce(c, c)), "gemm": lambda: a @ b}
    else:
        import torch.distributed as tdist

        out = c.new_empty(m // env.world, n)
        parts = {"comm": (lambda: tdist.reduce_scatter_tensor(out, c, group=g)) if scatter
                 else (lambda: tdist.all_reduce(c, group=g)), "gemm": lambda: a @ b}

    def check() -> dict[str, float]:
        a2 = torch.randn_like(a)
        return {"rel_err": env.rel_err(op(a2, b, group=g), ref(a2, b, group=g))}

    variants = {
        "reference": Variant("sequential", fn=lambda: ref(a, b, group=g), role="reference", synced=True),
        "chunked2": Variant("chunked x2", fn=lambda: chunked(a, b, group=g, chunks=2), note=cpu_note),
        "chunked4": Variant("chunked x4", fn=lambda: chunked(a, b, group=g, chunks=4), note=cpu_note),
        "tile_flag": lib,
    }
    if scatter:
        variants["symm_mem"] = symm_mem_variant(env, "symm_mem fused", lambda name: (
            lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, name)))
    return Case(variants=variants, parts=parts, flops=2.0 * m * n * k, comm_bytes=m * n * a.element_size(),
                check=check, finish=lambda: raise_kernel_errors(env))


def setup(shape: Shape, env: Env) -> Case:
    return make_case(shape, env, scatter=True)


OP = OpSpec(name="mmrs", title="GEMM -> reduce-scatter", comm="reduce_scatter", shapes=SHAPES, setup=setup,
            part_titles={"comm": "reduce-scatter", "gemm": "cuBLAS GEMM"},
            floor_title="floor = max(reduce-scatter, GEMM)", dims_doc="M x N x K (K per rank)",
            observed="matmul_reduce_scatter")
