"""The baselines every op is compared with, in one place (also importable from
``overlap.ops`` under the same names):

    *_ref           the plain reference: the collective, then ``torch.matmul`` (or the
                    reverse for the producer ops); what the tests check the ops against
    *_chunked       per-chunk stream overlap: each chunk's cuBLAS GEMM behind its
                    collective's event (the usual hand-written overlap)
    mlp_chain_stream_sync
                    the chain's own kernels, ordered by the stream instead of flags
"""

from .all_gather import all_gather_matmul_chunked, all_gather_matmul_ref
from .all_reduce import all_reduce_matmul_chunked, all_reduce_matmul_ref
from .boundary import matmul_all_reduce_matmul_ref
from .chain import mlp_chain_ref, mlp_chain_stream_sync
from .matmul_reduce import (matmul_all_reduce_chunked, matmul_all_reduce_ref, matmul_reduce_scatter_chunked,
                            matmul_reduce_scatter_ref)

__all__ = [
    "all_gather_matmul_ref",
    "all_gather_matmul_chunked",
    "all_reduce_matmul_ref",
    "all_reduce_matmul_chunked",
    "matmul_reduce_scatter_ref",
    "matmul_reduce_scatter_chunked",
    "matmul_all_reduce_ref",
    "matmul_all_reduce_chunked",
    "matmul_all_reduce_matmul_ref",
    "mlp_chain_ref",
    "mlp_chain_stream_sync",
]
