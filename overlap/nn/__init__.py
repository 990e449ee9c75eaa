"""Tensor-parallel layers with autograd over the library's ops (docs/nn.md).

    ColumnParallelLinear      weight [N/R, K]   forward: copy (or all-gather, sequence parallel) -> GEMM
    RowParallelLinear         weight [N, K/R]   forward: GEMM -> all-reduce (or reduce-scatter)
    NormColumnParallelLinear  all-reduce -> residual -> norm -> column GEMM, one layer
    parallelize(model, ...)   swaps a plain model's nn.Linear modules for them, in place

``overlap.nn.functional`` holds the autograd Functions, one per change of region.
"""

from . import functional
from .functional import (RegatherPlan, all_gather_linear, all_reduce_norm_linear, copy_linear, copy_to_region,
                         gather_from_region, linear_all_reduce, linear_reduce_scatter, regather_plan,
                         scatter_to_region)
from .layers import ColumnParallelLinear, NormColumnParallelLinear, RowParallelLinear
from .parallelize import DEFAULT_PLAN, SEQUENCE_PARALLEL_PLAN, SequenceParallelNorm, parallelize

__all__ = [
    "functional",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "NormColumnParallelLinear",
    "SequenceParallelNorm",
    "parallelize",
    "DEFAULT_PLAN",
    "SEQUENCE_PARALLEL_PLAN",
    "all_gather_linear",
    "linear_reduce_scatter",
    "copy_linear",
    "linear_all_reduce",
    "all_reduce_norm_linear",
    "copy_to_region",
    "gather_from_region",
    "scatter_to_region",
    "regather_plan",
    "RegatherPlan",
]
