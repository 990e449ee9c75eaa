"""A flag post as a kernel: one thread's release store of a word, queued on a stream.

Outside a CUDA graph a flag post is ``cuStreamWriteValue32`` and a words' zeroing one
``cuMemsetD32Async``: no SM, and less host time than a kernel launch. Inside a graph it
is the other way round. A graph's launch costs the host about 1 us per stream memory
operation node and 0.6 us per memset node, and next to nothing per kernel node (one H100,
``benchmarks/diag/graph_node_cost.py``: eight small kernels 2.5 us a launch, with two
write-values 4.6, with two waits 4.8, with two one-word memsets 3.7, with two one-warp
kernels 2.5). So the ops queue these forms while their stream is captured (a plan
graph's capture, or a user's): ``flags.stream_write_value`` this kernel,
``flags.stream_zero`` a fill kernel, a wait for a producer's count a gate
(``kernels.gate``).

The store is a release at system scope (a peer GPU may read the word), made once the
stream's earlier work has ended, as the write-value's memory barrier orders it: a GEMM
tile that acquires the flag sees what that work wrote.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from ._launch import CachedLauncher
from .tile_gemm import interpreting

__all__ = ["post_kernel", "launch_post"]


@triton.jit(do_not_specialize=["idx", "value"])
def post_kernel(flags_ptr, idx, value):
    tl.atomic_xchg(flags_ptr + idx, value, sem="release", scope="sys")


_launcher = CachedLauncher(post_kernel)


def launch_post(flags: Any, idx: int, value: int) -> None:
    """Queue ``flags[idx] = value`` (int32) on the current stream: one program, one warp."""
    interp = interpreting()
    args = (flags, int(idx), int(value))
    _launcher.prepared((flags.dtype, interp), {}, num_warps=1, interpret=interp).launch(1, args, aligned=(flags,))
