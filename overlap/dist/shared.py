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

A process that exits with GPU work in flight under MPS faults every other process on
that GPU (MPS reports the fatal error to all its clients on the device; measured on one
H200, ``benchmarks/diag/mps_kill_diag.py``): their CUDA contexts are lost, whatever
peer memory they hold. So the ranks sharing a GPU note each other's process
(``note_gpu_peers``, when the group's peer memory is opened), and a lost context is
reported as ``overlap.flags.GpuContextLostError`` naming the peers that have exited
(``gone_gpu_peers``, ``lost_context_message``).

The rest are pure functions of their arguments (and ``os.environ``), tested on any machine.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from .launch import DistInitError

__all__ = ["SHARED_WAIT_FLOOR_MS", "shared_gpu_env", "place_on_gpus", "sm_share", "library_wait_ms",
           "nccl_refusal", "GpuPeer", "process_start", "this_process", "note_gpu_peers", "gpu_peers",
           "gone_gpu_peers", "forget_gpu_peers", "lost_context_message"]

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


class GpuPeer(NamedTuple):
    """A rank's process on this node: global ``rank``, ``pid`` and its start time
    (``process_start``), which tells a dead process from a new one given the same pid."""

    rank: int
    pid: int
    start: str


def process_start(pid: int, proc: str = "/proc") -> str | None:
    """The start time of live process ``pid`` (field 22 of ``/proc/PID/stat``, clock ticks
    since boot); None where there is no such process, or it has exited and not been reaped
    (a zombie), or ``/proc`` cannot be read."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state is field 3
    if len(fields) < 20 or fields[0] in ("Z", "X", "x"):
        return None
    return fields[19]


def this_process(rank: int) -> GpuPeer:
    """This process as a ``GpuPeer`` of global rank ``rank``."""
    pid = os.getpid()
    return GpuPeer(rank, pid, process_start(pid) or "")


_peers_lock = threading.Lock()
_gpu_peers: dict[int, GpuPeer] = {}
_me: list[int] = []


def note_gpu_peers(me: int, peers: Iterable[GpuPeer]) -> None:
    """Note the other ranks' processes on this rank's GPU (global rank ``me``): kept until
    ``forget_gpu_peers`` (``overlap.dist.shutdown``); every group's peers add up."""
    with _peers_lock:
        _me[:] = [me]
        for p in peers:
            if p.rank != me:
                _gpu_peers[p.rank] = p


def gpu_peers() -> list[GpuPeer]:
    """The noted processes of other ranks on this rank's GPU (none: the mode is off, or no
    group's peer memory was opened yet)."""
    with _peers_lock:
        return sorted(_gpu_peers.values())


def forget_gpu_peers() -> None:
    with _peers_lock:
        _gpu_peers.clear()
        _me.clear()


def gone_gpu_peers(proc: str = "/proc") -> list[GpuPeer]:
    """The noted peers whose process has exited (or was replaced under the same pid)."""
    return [p for p in gpu_peers() if process_start(p.pid, proc) != p.start]


def lost_context_message(what: str, cause: str, gone: list[GpuPeer]) -> str:
    """The message of ``overlap.flags.GpuContextLostError``: ``cause``, the CUDA error seen."""
    me = f"rank {_me[0]}" if _me else "this rank"
    if gone:
        who = ", ".join(f"rank {p.rank} (pid {p.pid})" for p in gone)
        why = (f"{who}, which shared this GPU, has exited. Under MPS a process that exits with GPU work in "
               "flight faults every process on its GPU (MPS reports the fatal error to all its clients there), "
               "so this is that exit's doing, not a fault of this rank's work")
    else:
        why = ("no rank sharing this GPU has exited as far as this rank can see; under MPS a fault in any "
               "process on the GPU is reported to every process on it")
    return (f"{what}: {me}: the CUDA context failed ({cause}): {why}. The context cannot be used again and "
            "reset() cannot help: end this process and restart the job (under MPS the server takes new "
            "processes on this GPU once every process on it has exited)")
