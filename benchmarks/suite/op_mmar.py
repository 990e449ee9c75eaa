"""GEMM -> all-reduce: ``all_reduce(a @ b)`` (overlap.ops.matmul_all_reduce).

Shapes M x N x K with K the per-rank K. Variants and parts as ``op_mmrs`` (no torch
symm_mem op for this one).
"""

from __future__ import annotations

from .op_mmrs import SHAPES, make_case
from .spec import Case, Env, OpSpec, Shape


def setup(shape: Shape, env: Env) -> Case:
    return make_case(shape, env, scatter=False)


OP = OpSpec(name="mmar", title="GEMM -> all-reduce", comm="all_reduce", shapes=SHAPES, setup=setup,
            part_titles={"comm": "all-reduce", "gemm": "cuBLAS GEMM"},
            floor_title="floor = max(all-reduce, GEMM)", dims_doc="M x N x K (K per rank)",
            observed="matmul_all_reduce")
