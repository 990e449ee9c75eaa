"""Tensor-parallel layers with autograd over the library's ops (docs/nn.md).

    ColumnParallelLinear      weight [N/R, K]   forward: copy (or all-gather, sequence parallel) -> GEMM
    RowParallelLinear         weight [N, K/R]   forward: GEMM -> all-reduce (or reduce-scatter)
    NormColumnParallelLinear  all-reduce -> residual -> norm -> column GEMM, one layer
    parallelize(model, ...)   makes a plain model (HF Llama-family, GPT-2, ...) tensor-parallel, in place
    unshard(model)            its parameters (or gradients) in the unsharded layout, gathered
    VocabParallelEmbedding    V/R rows of an embedding; vocab_parallel_cross_entropy on [N, V/R] logits

``overlap.nn.functional`` holds the autograd Functions, one per change of region.
"""

from . import functional
from .functional import (RegatherPlan, all_gather_linear, all_gather_linear_many, all_reduce_norm_linear,
                         copy_linear, copy_linear_many, copy_to_region, gather_from_region, linear_all_reduce,
                         linear_reduce_scatter, regather_plan, scatter_to_region)
from .layers import ColumnParallelLinear, NormColumnParallelLinear, RowParallelLinear
from .vocab import VocabParallelEmbedding, reduce_from_region, vocab_parallel_cross_entropy
from .parallelize import (DEFAULT_PLAN, SEQUENCE_PARALLEL_PLAN, ParallelInfo, ReplicatedParameters,
                          SequenceParallelNorm, parallelize, unshard)

__all__ = [
    "functional",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "NormColumnParallelLinear",
    "SequenceParallelNorm",
    "parallelize",
    "unshard",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "reduce_from_region",
    "ParallelInfo",
    "ReplicatedParameters",
    "DEFAULT_PLAN",
    "SEQUENCE_PARALLEL_PLAN",
    "all_gather_linear",
    "linear_reduce_scatter",
    "copy_linear",
    "all_gather_linear_many",
    "copy_linear_many",
    "linear_all_reduce",
    "all_reduce_norm_linear",
    "copy_to_region",
    "gather_from_region",
    "scatter_to_region",
    "regather_plan",
    "RegatherPlan",
]
