"""Shared by the GPU checks: make one rank's p2p pushes late, to provoke a peer's timeout."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def late_pushes(delayed: bool, cycles: int = 400_000_000) -> Iterator[None]:
    """While active and ``delayed``, every copy-engine push of ``overlap._p2p`` is
    preceded on its stream by a sleep of ``cycles`` GPU clocks (~0.2 s on H200)."""
    import overlap._p2p as p2pmod

    orig = p2pmod.memcpy_async

    def _late(dst: int, src: int, nbytes: int, stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)
        orig(dst, src, nbytes, stream)

    if delayed:
        p2pmod.memcpy_async = _late
    try:
        yield
    finally:
        p2pmod.memcpy_async = orig
