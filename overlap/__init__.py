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
# Fused ops are re-exported here as they land, e.g.
#   from .ops import all_gather_matmul, all_gather_matmul_ref
#   __all__ += ["all_gather_matmul", "all_gather_matmul_ref"]
# ---------------------------------------------------------------------------------------
