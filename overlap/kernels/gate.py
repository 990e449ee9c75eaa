"""A stream gate: one program that waits, bounded, for a flag, so that the grid queued
behind it on the same stream is not resident while the flag is late.

A persistent GEMM whose first tiles wait on the first chunk holds every SM it was given
for as long as that chunk is late: with a peer seconds behind (a GC pause, a checkpoint
write), work on the GPU's other streams runs on what is left. ``cuStreamWaitValue32``
would hold the stream instead, on no SM, but it has no bound: a dead peer would hang the
caller's stream rather than raise. The gate is the bounded form of it: a one-program
kernel that waits with the op's bound (``tile_gemm._wait``: the same poll, back-off,
timer and error record as a tile's wait) and then ends, whether the flag came or the
bound passed. The grid launched behind it starts as soon as it ends. On a timeout the
gate records it in the error word (tile -1), and every tile's wait of the grid behind it
sees the record and stops at once, so a late peer costs one bound, not two.
"""

from __future__ import annotations

import os
from typing import Any

import triton
import triton.language as tl

from ._launch import CachedLauncher
from .tile_gemm import _wait, interpreting

__all__ = ["gate_kernel", "launch_gate", "GATE_TILE", "enabled", "bind_gate"]

GATE_TILE = -1
"""The tile index a gate's timeout records (``ErrorWord``'s tile slot)."""


@triton.jit(do_not_specialize=["idx", "expected", "ahead", "rank", "timeout_ns", "max_spins"])
def gate_kernel(flags_ptr, err_ptr, idx, expected, ahead, rank, timeout_ns, max_spins,
                USE_TIMER: tl.constexpr, FENCE_ASYNC: tl.constexpr):
    _wait(flags_ptr, err_ptr, idx, expected, ahead, rank, -1, timeout_ns, max_spins, USE_TIMER, FENCE_ASYNC)


_launcher = CachedLauncher(gate_kernel)


def enabled() -> bool:
    """Whether the ops put a gate before a grid whose first tiles wait (default on;
    ``OVERLAP_STREAM_GATE=0`` turns it off; read per call by the ops' full path, once by a
    call plan's bound body, when it is made)."""
    return os.environ.get("OVERLAP_STREAM_GATE", "1") != "0"


def launch_gate(flags: Any, idx: int, expected: int, ahead: int, err: Any, *, rank: int, timeout_ns: int,
                max_spins: int = 2_000_000) -> None:
    """Queue on the current stream: wait until ``flags[idx] >= expected`` (int32 differences,
    as the tiles compare), at most ``timeout_ns``; a value at or past ``ahead`` is a
    protocol error. Either failure is recorded in ``err`` (tile -1). One program, one warp."""
    interp = interpreting()
    meta = {"USE_TIMER": not interp, "FENCE_ASYNC": not interp}
    args = (flags, err, int(idx), int(expected), int(ahead), int(rank), int(timeout_ns), int(max_spins))
    _launcher.prepared((flags.dtype, err.dtype, interp), meta, num_warps=1, interpret=interp).launch(
        1, args, aligned=(flags, err))


def bind_gate(flags: Any, idx: int, expected: int, ahead: int, err: Any, *, rank: int, timeout_ns: int,
              max_spins: int = 2_000_000) -> Any:
    """``launch_gate``'s launch with every argument fixed (``_launch.BoundLaunch``, called as
    ``bl(stream, ())``), or None where it cannot be bound yet (not launched once, the
    interpreter, another launcher form)."""
    from ._launch import BoundLaunch

    interp = interpreting()
    if interp or flags.data_ptr() % 16 or err.data_ptr() % 16:
        return None
    meta = {"USE_TIMER": True, "FENCE_ASYNC": True}
    args = (flags, err, int(idx), int(expected), int(ahead), int(rank), int(timeout_ns), int(max_spins))
    pl = _launcher.prepared((flags.dtype, err.dtype, interp), meta, num_warps=1, interpret=interp)
    return BoundLaunch.of(pl, 1, args, ())
