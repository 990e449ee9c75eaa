"""overlap: hide tensor-parallel communication behind GEMM work on NVIDIA GPUs.

Consumer GEMM tiles wait on per-chunk flags that the comm stream posts as each chunk of
an NCCL collective lands, so one persistent GEMM launch overlaps the whole collective.

Importing the package needs only torch and numpy: cupy, cuda-bindings, triton and mpi4py
are imported where they are used (see ``overlap._env.require``), so this works on a
machine with no GPU.
"""

from . import dist
from .dist import (
    DistContext,
    DistInitError,
    LaunchEnv,
    detect_launch,
    get_context,
    group_ranks,
    init,
    nccl_comm,
    shutdown,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "dist",
    "DistContext",
    "DistInitError",
    "LaunchEnv",
    "detect_launch",
    "get_context",
    "group_ranks",
    "init",
    "nccl_comm",
    "shutdown",
]

# ---- operations -----------------------------------------------------------------------
# The fused ops are torch.library custom ops at this level (eager calls go straight to the
# Python op; torch.compile traces the custom op), same signatures as in overlap.ops.
from . import ops
from ._library import (all_gather_matmul, all_reduce_matmul, matmul_all_reduce, matmul_all_reduce_matmul,
                       matmul_reduce_scatter, mlp_chain)
from .ops import (SEQUENTIAL, ChainConfig, Chunked, NcclTransport, Norm, OverlapConfig, Path, PeerCopyTransport,
                  Sequential, reset, tune_all_gather_matmul,
                  tune_all_reduce_matmul, tune_matmul_all_reduce, tune_matmul_reduce_scatter, tune_mlp_chain)
from .ops import tune_matmul_all_reduce_matmul

# ---- what ran ---------------------------------------------------------------------------
# overlap.profile(True) (or OVERLAP_PROFILE=1) turns on NVTX ranges and CUDA-event phase
# timing; print(overlap.report()) shows per op and shape the paths taken and why, tuning,
# warnings, timeouts and the hidden fraction (docs/observability.md).
from . import observe
from .observe import profile, report, reset_report

# ---- tensor-parallel layers with autograd (docs/nn.md) -----------------------------------
from . import nn
from .nn import parallelize

check_errors = getattr(ops, "check_errors", None) or getattr(ops._runtime, "check_errors", None)
if check_errors is None:  # an older overlap.ops: looked up when called

    def check_errors(*, block: bool = True) -> None:
        """Raise the first flag-wait timeout an op recorded: ``overlap.ops.check_errors(block=block)``."""
        return ops.check_errors(block=block)


__all__ += [
    "ops",
    "all_gather_matmul",
    "all_reduce_matmul",
    "mlp_chain",
    "matmul_reduce_scatter",
    "matmul_all_reduce",
    "matmul_all_reduce_matmul",
    "tune_all_gather_matmul",
    "tune_all_reduce_matmul",
    "tune_matmul_reduce_scatter",
    "tune_matmul_all_reduce",
    "tune_matmul_all_reduce_matmul",
    "tune_mlp_chain",
    "reset",
    "OverlapConfig",
    "NcclTransport",
    "PeerCopyTransport",
    "Path",
    "Sequential",
    "Chunked",
    "SEQUENTIAL",
    "ChainConfig",
    "Norm",
    "check_errors",
    "observe",
    "profile",
    "report",
    "reset_report",
    "nn",
    "parallelize",
]
