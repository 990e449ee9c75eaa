"""A copy of a few device words into pinned host memory by an SM, not a copy engine.

``ErrorWord`` uses it once, to check that a kernel's stores reach its pinned host
mirror (pinned host memory is addressable from the device under unified
addressing); the kernels' waits then store a failure's code there themselves.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from ._launch import CachedLauncher

__all__ = ["copy_words_kernel", "copy_words", "HostWords"]


@triton.jit
def copy_words_kernel(src_ptr, dst_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, volatile=True))


class HostWords:
    """Pinned host int32 words passed to a Triton kernel as a raw pointer."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self.dtype = host.dtype

    def data_ptr(self) -> int:
        return self.host.data_ptr()


def copy_words(src: Any, dst: HostWords) -> None:
    """Enqueue ``dst[:] = src[:]`` (int32, power-of-two length) on the current stream."""
    n = src.numel()
    _launcher.launch(1, (src, dst), {"N": n}, key=(n, src.dtype, dst.dtype), num_warps=1, aligned=(src, dst))


_launcher = CachedLauncher(copy_words_kernel)
