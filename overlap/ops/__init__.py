"""Fused communication + GEMM operations, each with a plain ``*_ref``."""

from ._agree import RanksOutOfStepError, RanksRefusedError
from ._runtime import (SEQUENTIAL, Chunked, NcclTransport, OverlapCaptureError, OverlapConfig, Path, PeerCopyTransport,
                       Sequential, check_errors, reset)
from ._calls import clear_call_plans
from .all_gather import (
    all_gather_matmul,
    all_gather_matmul_chunked,
    all_gather_matmul_ref,
    tune_all_gather_matmul,
)
from .chain import ChainConfig, mlp_chain, mlp_chain_ref, mlp_chain_stream_sync, tune_mlp_chain
from .matmul_reduce import (
    matmul_all_reduce,
    matmul_all_reduce_chunked,
    matmul_all_reduce_ref,
    matmul_reduce_scatter,
    matmul_reduce_scatter_chunked,
    matmul_reduce_scatter_ref,
    tune_matmul_all_reduce,
    tune_matmul_reduce_scatter,
)
from .boundary import matmul_all_reduce_matmul, matmul_all_reduce_matmul_ref, tune_matmul_all_reduce_matmul
from .all_reduce import (
    Norm,
    all_reduce_matmul,
    all_reduce_matmul_chunked,
    all_reduce_matmul_ref,
    tune_all_reduce_matmul,
)

__all__ = [
    "SEQUENTIAL",
    "Chunked",
    "Path",
    "Sequential",
    "ChainConfig",
    "NcclTransport",
    "OverlapCaptureError",
    "RanksOutOfStepError",
    "RanksRefusedError",
    "check_errors",
    "clear_call_plans",
    "reset",
    "Norm",
    "OverlapConfig",
    "PeerCopyTransport",
    "all_gather_matmul",
    "all_gather_matmul_chunked",
    "all_gather_matmul_ref",
    "all_reduce_matmul",
    "all_reduce_matmul_chunked",
    "all_reduce_matmul_ref",
    "matmul_all_reduce",
    "matmul_all_reduce_chunked",
    "matmul_all_reduce_matmul",
    "matmul_all_reduce_matmul_ref",
    "matmul_all_reduce_ref",
    "matmul_reduce_scatter",
    "matmul_reduce_scatter_chunked",
    "matmul_reduce_scatter_ref",
    "mlp_chain",
    "mlp_chain_ref",
    "mlp_chain_stream_sync",
    "tune_all_gather_matmul",
    "tune_all_reduce_matmul",
    "tune_matmul_all_reduce",
    "tune_matmul_all_reduce_matmul",
    "tune_matmul_reduce_scatter",
    "tune_mlp_chain",
]
