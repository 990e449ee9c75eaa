"""Distributed start-up: one ``init()`` for torchrun, mpirun and a single process.

What it gives every layer above it:

- a torch.distributed default group (nccl on GPUs, gloo on CPU) plus contiguous
  tensor-parallel groups and strided data-parallel groups::

      world 8, tp_size 4:   tp groups [0 1 2 3] [4 5 6 7]    dp groups [0 4] [1 5] [2 6] [3 7]

- the library's own NCCL communicators (``nccl_comm``), made over the same ranks as a
  torch group. They are separate from torch's so the comm layer can drive NCCL on its own
  stream with capped CTAs (the GEMM grid is sized to the SMs NCCL leaves free; see
  docs/design.md, the SM budget), and their bootstrap rides on the same store, with the
  same timeout.

Nothing here may hang: every wait on other ranks is bounded by ``timeout_s`` and a rank that
never arrives becomes a ``DistInitError`` naming the ranks, the world size and the store
address.

How each launcher meets the others (the "rendezvous"):

=========  ==========================================================================
torchrun   env:// variables. Under torchrun's agent the store lives in the agent
           (``TORCHELASTIC_USE_AGENT_STORE=True``) and every rank is a client; when the
           variables were set by hand, rank 0 hosts a TCPStore on MASTER_PORT.
mpirun     mpi4py. After a bounded MPI barrier, rank 0 hosts a TCPStore on MASTER_PORT
           (or on a free port the OS picks) and broadcasts its address and port over
           MPI.COMM_WORLD; everyone else connects to it.
single     No launcher variables: a world of one rank over an in-process HashStore, so
           code written for the distributed case (collectives, groups, ``nccl_comm``)
           runs unchanged, without binding a port.
=========  ==========================================================================

The modules, one concern each; each imports only those listed before it:

- ``launch``: ``LaunchEnv`` and ``detect_launch``, the launcher's variables.
- ``shared``: shared-GPU mode (ranks of a node on one GPU): placement, the SM share,
  wait bounds, the NCCL refusal.
- ``store``: the rendezvous store and the bounded arrival checks.
- ``context``: ``DistContext``, ``init``, ``get_context``, ``shutdown``, ``on_shutdown``.
- ``comms``: ``group_ranks``, ``nccl_comm`` and its cache, ``set_nccl_backend``.
"""

from __future__ import annotations

from typing import Any

from . import comms as _comms_module
from . import context as _context_module
from .comms import group_ranks, nccl_comm, set_nccl_backend
from .context import (  # _lock and _shutdown_hooks: shared objects, never rebound
    SHUTDOWN_BOUND_S,
    DistContext,
    _lock,  # noqa: F401
    _shutdown_hooks,  # noqa: F401
    get_context,
    init,
    on_shutdown,
    shutdown,
)
from .launch import DistInitError, LaunchEnv, Launcher, detect_launch

__all__ = [
    "SHUTDOWN_BOUND_S",
    "DistContext",
    "DistInitError",
    "LaunchEnv",
    "Launcher",
    "detect_launch",
    "get_context",
    "group_ranks",
    "init",
    "nccl_comm",
    "on_shutdown",
    "set_nccl_backend",
    "shutdown",
]

# Per-process state that its module rebinds, read where it lives so that
# ``overlap.dist._ctx`` and ``overlap.dist._last_uid_exchange`` (tests read it to prove
# which path carried the NCCL id) stay current. Writes go to the owning module.
_STATE = {"_ctx": _context_module, "_generation": _context_module,
          "_nccl_backend": _comms_module, "_last_uid_exchange": _comms_module}


def __getattr__(name: str) -> Any:
    owner = _STATE.get(name)
    if owner is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(owner, name)
