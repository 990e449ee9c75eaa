"""Shared-GPU mode: several ranks of a group on one GPU.

Production puts one rank on each GPU. A machine with fewer GPUs than ranks (one GPU
lent for testing, a laptop) can still run the multi-rank paths when the ranks share a
device: two processes on one GPU can open each other's memory with CUDA IPC, a
copy-engine push from one lands in the other's buffer, and a kernel spinning on a flag
in its own memory is released by the other process's write. NCCL, however, refuses two
ranks on one device ("Duplicate GPU detected"). So in this mode:

- host collectives (torch's process groups) run on gloo;
- the ops move data and flags over the peer-copy transport (``overlap._p2p``); the
  NCCL transport, and anything that would make an NCCL communicator, raise an error
  that names the mode;
- each rank's grids take ``num_sms // share`` SMs (``sm_share``), so the persistent
  kernels of all ranks on the device fit at once: under MPS their CTAs share the SMs,
  and a grid over every SM, spinning on a flag that another rank's kernel must set,
  could keep that kernel from ever starting; without MPS the contexts are time-sliced
  and the smaller grid costs only speed;
- wait bounds the library picks itself (the tuner's) are at least
  ``SHARED_WAIT_FLOOR_MS``: a healthy peer's work may wait a time slice or more behind
  this rank's. A bound the caller sets (``timeout_ms``, ``OVERLAP_WAIT_TIMEOUT_MS``) is
  kept as given.

The mode is on with ``OVERLAP_SHARED_GPU=1``, or when a node has more ranks than
visible GPUs (``OVERLAP_SHARED_GPU`` unset or ``auto``); ``OVERLAP_SHARED_GPU=0``
keeps the old refusal. Ranks are placed round-robin: local rank ``r`` on GPU
``r % n_gpu``. Times measured in this mode are not performance figures.

Pure functions of their arguments (and ``os.environ``), tested on any machine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .launch import DistInitError

__all__ = ["SHARED_WAIT_FLOOR_MS", "shared_gpu_env", "place_on_gpus", "sm_share", "library_wait_ms",
           "nccl_refusal"]

ENV = "OVERLAP_SHARED_GPU"

SHARED_WAIT_FLOOR_MS = 30_000.0
"""Least wait bound the library picks for itself in shared-GPU mode (the tuner's timed
calls): a healthy peer's pushes can wait behind this rank's kernels for whole time
slices (a naive flag wait across two processes on one H200 took about 2 s)."""

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def shared_gpu_env(environ: Mapping[str, str] | None = None) -> bool | None:
    """``OVERLAP_SHARED_GPU``: True (on), False (off) or None (unset / ``auto``: on when a
    node has more ranks than GPUs).

    Raises:
        DistInitError: any other value.
    """
    environ = os.environ if environ is None else environ
    given = environ.get("OVERLAP_SHARED_GPU")
    raw = (given or "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    raise DistInitError(f"{ENV} must be 1, 0 or auto, got {given!r}")


def place_on_gpus(rank: int, local_rank: int, local_world_size: int, n_gpu: int,
                  want: bool | None) -> tuple[int, int, bool]:
    """Where a rank runs: (GPU index, ranks of this node on that GPU, shared-GPU mode).

    One GPU per rank where there are enough (``want`` not True): GPU ``local_rank``,
    share 1, mode off. Otherwise (``want`` True, or None with more local ranks than
    GPUs) round-robin: GPU ``local_rank % n_gpu``, shared by every local rank that maps
    to it, mode on.

    Raises:
        DistInitError: no GPU, or more local ranks than GPUs with the mode off.
    """
    if n_gpu < 1:
        raise DistInitError(f"rank {rank}: no CUDA GPU visible")
    if want is not True and local_world_size <= n_gpu:
        return local_rank, 1, False
    if want is False:
        # NCCL fails on two ranks of one device ("duplicate GPU"): say so before it does.
        raise DistInitError(
            f"rank {rank} has local rank {local_rank} but only {n_gpu} GPU(s) are visible: "
            f"{local_world_size} processes on this node share {n_gpu} GPU(s), and {ENV}=0 turns "
            f"shared-GPU mode off. Launch at most {n_gpu} processes per node, unset {ENV} (or set "
            "it to 1) to run the ranks on shared GPUs over gloo and the peer-copy transport, or "
            "pass device='cpu' with backend='gloo'"
        )
    gpu = local_rank % n_gpu
    share = len(range(gpu, local_world_size, n_gpu))
    return gpu, share, True


def sm_share(num_sms: int, share: int) -> int:
    """SMs one rank's grids may take on a GPU that ``share`` ranks use: an equal part,
    so that every rank's persistent grid fits at once (MPS) and none can keep another's
    kernels from starting.

    Raises:
        ValueError: ``share`` or ``num_sms`` below 1, or fewer SMs than ranks.
    """
    if share < 1 or num_sms < 1:
        raise ValueError(f"sm_share: num_sms ({num_sms}) and share ({share}) must be >= 1")
    if share > num_sms:
        raise ValueError(f"sm_share: {share} ranks on one GPU of {num_sms} SMs: fewer SMs than ranks")
    return num_sms // share


def library_wait_ms(ms: float, shared: bool) -> float:
    """A wait bound the library picks for itself (not the caller's), raised to
    ``SHARED_WAIT_FLOOR_MS`` in shared-GPU mode."""
    return max(float(ms), SHARED_WAIT_FLOOR_MS) if shared else float(ms)


def nccl_refusal(what: str, rank: int, ranks: object) -> str:
    """The message of every refusal of NCCL in shared-GPU mode."""
    return (f"{what}: rank {rank}: shared-GPU mode ({ENV}, or more ranks than GPUs on a node): ranks "
            f"{ranks} share a GPU, and NCCL refuses two ranks on one device ('Duplicate GPU "
            "detected'). Use the peer-copy transport (transport='p2p' or None); host collectives "
            "run on gloo")
