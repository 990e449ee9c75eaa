"""Shared by the GPU checks written for one GPU per rank: what they do in shared-GPU mode
(``overlap.dist.shared``: ranks on one GPU, gloo, the peer-copy transport, NCCL refused)."""

from __future__ import annotations

import sys

REASON = ("shared-GPU mode: NCCL refuses two ranks on one device ('Duplicate GPU detected'), and "
          "this check runs NCCL (the NCCL transport, the chunked baselines or a communicator of "
          "its own); launch/shared_gpu.sh runs the peer-copy checks in this mode")


def shared_gpu() -> bool:
    """Ranks of the group share a GPU (after ``overlap.dist.init``)."""
    from overlap import dist

    ctx = dist.get_context()
    return bool(ctx is not None and getattr(ctx, "shared_gpu", False) and ctx.world_size > 1)


def exit_if_shared(script: str, needs: str) -> None:
    """A check that needs NCCL (``needs``: for what), started in shared-GPU mode: say so on
    rank 0 (``SKIP <script>: <reason>``), shut down, and exit 0 on every rank, before any
    op picks NCCL (the mode would refuse it mid-check)."""
    if not shared_gpu():
        return
    from overlap import dist

    if dist.get_context().rank == 0:
        print(f"SKIP {script}: it needs NCCL ({needs}); {REASON}", flush=True)
    dist.shutdown()
    sys.exit(0)
