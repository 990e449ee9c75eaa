"""Distributed start-up: one ``init()`` for torchrun, mpirun and a single process.

What it gives every layer above it:

- a torch.distributed default group (nccl on GPUs, gloo on CPU) plus contiguous
  tensor-parallel groups and strided data-parallel groups::

      world 8, tp_size 4:   tp groups [0 1 2 3] [4 5 6 7]    dp groups [0 4] [1 5] [2 6] [3 7]

- the library's own NCCL communicators (``nccl_comm``), made over the same ranks as a
  torch group. They are separate from torch's so the comm layer can drive NCCL on its own
  stream with capped CTAs (the GEMM grid is sized to the SMs NCCL leaves free; see
  DESIGN.md), and their bootstrap rides on the same store, with the same timeout.

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
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import math
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as tdist

from .._env import require

if TYPE_CHECKING:  # overlap._nccl needs cupy; never import it at module load
    from .._nccl import NcclCommunicator, NcclConfig

__all__ = [
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

Launcher = Literal["torchrun", "mpirun", "single"]
_LAUNCHERS = ("torchrun", "mpirun", "single")


class DistInitError(ValueError):
    """Distributed start-up failed: bad launch environment, bad arguments, or a timeout."""


# --------------------------------------------------------------------------------------
# Launch environment
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    """Who this process is, as the launcher told it through the environment."""

    launcher: Launcher
    """'torchrun' (env:// variables), 'mpirun' (MPI variables) or 'single' (none)."""
    rank: int
    """Global rank, 0 <= rank < world_size."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank among the processes on this node; picks the GPU."""
    local_world_size: int
    """Number of processes on this node."""
    master_addr: str | None = None
    """Host of the rendezvous store (torchrun: required when world_size > 1)."""
    master_port: int | None = None
    """Port of the rendezvous store."""

    def __post_init__(self) -> None:
        if self.launcher not in _LAUNCHERS:
            raise DistInitError(f"launcher must be one of {_LAUNCHERS}, got {self.launcher!r}")
        _check_ranks(
            self.rank, self.world_size, self.local_rank, self.local_world_size,
            names=("rank", "world_size", "local_rank", "local_world_size"),
        )
        if self.launcher == "single" and self.world_size != 1:
            raise DistInitError(f"a 'single' launch has world_size 1, got {self.world_size}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise DistInitError(f"master_port must be in 1..65535, got {self.master_port}")
        if self.launcher == "torchrun" and self.world_size > 1:
            if not self.master_addr or self.master_port is None:
                raise DistInitError(
                    "a torchrun launch with world_size > 1 needs master_addr and master_port"
                )


def _check_ranks(
    rank: int, size: int, local_rank: int, local_size: int, *, names: tuple[str, str, str, str]
) -> None:
    """Raise DistInitError unless the four numbers describe a valid place in a job."""
    n_rank, n_size, n_lrank, n_lsize = names
    if size < 1:
        raise DistInitError(f"{n_size}={size} must be >= 1")
    if not 0 <= rank < size:
        raise DistInitError(f"{n_rank}={rank} must be in 0..{n_size}-1 = 0..{size - 1}")
    if not 1 <= local_size <= size:
        raise DistInitError(f"{n_lsize}={local_size} must be in 1..{n_size} = 1..{size}")
    if not 0 <= local_rank < local_size:
        raise DistInitError(
            f"{n_lrank}={local_rank} must be in 0..{n_lsize}-1 = 0..{local_size - 1}"
        )


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise DistInitError(f"{name}={raw!r} is not an integer") from None


# Each MPI flavour: (label, rank, size, local rank, local size). Open MPI and Hydra (MPICH,
# Intel MPI, MVAPICH) are checked against each other when both are present.
_MPI_FLAVOURS: tuple[tuple[str, str, str, str, str], ...] = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("Hydra/PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)
# PMIx alone (srun --mpi=pmix, prterun) exports the rank but not the size; the size then
# comes from Slurm. Only used when no flavour above is present: Open MPI 4 sets PMIX_RANK
# too, and inside an allocation SLURM_NTASKS can describe the allocation, not this mpirun.
_PMIX_SIZE_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")

_TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _detect_mpi(env: Mapping[str, str]) -> tuple[str, int, int, int | None, int | None] | None:
    """(label, rank, size, local_rank, local_size) from MPI variables, or None."""
    found: list[tuple[str, int, int, int | None, int | None]] = []
    for label, v_rank, v_size, v_lrank, v_lsize in _MPI_FLAVOURS:
        rank = _env_int(env, v_rank)
        if rank is None:
            continue
        size = _env_int(env, v_size)
        if size is None:
            raise DistInitError(f"{v_rank} is set ({label}) but {v_size} is not")
        found.append((label, rank, size, _env_int(env, v_lrank), _env_int(env, v_lsize)))
    if not found:
        rank = _env_int(env, "PMIX_RANK")
        if rank is None:
            return None
        size = next((s for v in _PMIX_SIZE_VARS if (s := _env_int(env, v)) is not None), None)
        if size is None:
            raise DistInitError(
                "PMIX_RANK is set but no world size is ("
                + ", ".join(("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", *_PMIX_SIZE_VARS))
                + ")"
            )
        return ("PMIx", rank, size, _env_int(env, "SLURM_LOCALID"), None)
    first = found[0]
    for other in found[1:]:
        if other[1:3] != first[1:3]:
            raise DistInitError(
                f"{first[0]} says rank {first[1]} of {first[2]} but {other[0]} says rank "
                f"{other[1]} of {other[2]}"
            )
    local_rank = next((f[3] for f in found if f[3] is not None), None)
    local_size = next((f[4] for f in found if f[4] is not None), None)
    return (first[0], first[1], first[2], local_rank, local_size)


def detect_launch(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the launcher's variables from ``environ`` (default ``os.environ``).

    A pure function of the mapping: it opens no sockets and imports no MPI.

    - torchrun / env:// : RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
      MASTER_PORT. Without LOCAL_RANK the job is taken to be one node (local = global);
      without LOCAL_WORLD_SIZE, local_world_size is world_size.
    - mpirun : OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE} (Open MPI), PMI_RANK,
      PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS (Hydra), or PMIX_RANK with Slurm's
      task count. Missing local variables are filled in by ``init`` from MPI itself.
    - single : none of them.

    When both torchrun and MPI variables are present (a script that exports RANK from
    OMPI_COMM_WORLD_RANK) they must agree; the launcher is 'torchrun' if MASTER_ADDR and
    MASTER_PORT are set, else 'mpirun'.

    Raises:
        DistInitError: a variable is missing, not an integer, out of range, or two
            launchers' variables disagree.
    """
    env = os.environ if environ is None else environ
    master_addr = (env.get("MASTER_ADDR") or "").strip() or None
    master_port = _env_int(env, "MASTER_PORT")
    if master_port is not None and not 0 < master_port < 65536:
        raise DistInitError(f"MASTER_PORT={master_port} must be in 1..65535")

    torch_vals = {name: _env_int(env, name) for name in _TORCH_VARS}
    has_torch = any(v is not None for v in torch_vals.values())
    if has_torch:
        rank, size = torch_vals["RANK"], torch_vals["WORLD_SIZE"]
        lrank, lsize = torch_vals["LOCAL_RANK"], torch_vals["LOCAL_WORLD_SIZE"]
        if rank is None or size is None:
            missing = "RANK" if rank is None else "WORLD_SIZE"
            present = [n for n, v in torch_vals.items() if v is not None]
            raise DistInitError(f"{', '.join(present)} set but {missing} is not")
        if lrank is None and lsize is not None:
            raise DistInitError("LOCAL_WORLD_SIZE is set but LOCAL_RANK is not")
        local_given = lrank is not None
        if lrank is None:
            lrank, lsize = rank, size
        elif lsize is None:
            lsize = size
        _check_ranks(rank, size, lrank, lsize, names=_TORCH_VARS)  # type: ignore[arg-type]

    mpi = _detect_mpi(env)
    if mpi is not None:
        label, m_rank, m_size, m_lrank, m_lsize = mpi
        _check_ranks(
            m_rank, m_size,
            0 if m_lrank is None else m_lrank,
            m_size if m_lsize is None else m_lsize,
            names=(f"{label} rank", f"{label} size", f"{label} local rank", f"{label} local size"),
        )

    if has_torch and mpi is not None:
        local_clash = local_given and m_lrank is not None and m_lrank != lrank
        if (rank, size) != (m_rank, m_size) or local_clash:
            local = f", LOCAL_RANK={lrank}" if local_given else ""
            raise DistInitError(
                f"torchrun variables (RANK={rank}, WORLD_SIZE={size}{local}) disagree with "
                f"{label} (rank {m_rank} of {m_size}, local rank {m_lrank}); unset one "
                "launcher's variables"
            )
        if not local_given and m_lrank is not None:  # MPI knows the node layout
            lrank, lsize = m_lrank, size if m_lsize is None else m_lsize
        if master_addr is None or master_port is None:
            has_torch = False  # nothing to rendezvous on: treat it as an MPI launch

    if has_torch:
        if size > 1 and (master_addr is None or master_port is None):
            missing = "MASTER_ADDR" if master_addr is None else "MASTER_PORT"
            raise DistInitError(
                f"RANK/WORLD_SIZE are set (world size {size}) but {missing} is not; torchrun "
                "sets it, set it yourself when starting processes by hand"
            )
        return LaunchEnv(
            launcher="torchrun", rank=rank, world_size=size, local_rank=lrank,
            local_world_size=lsize, master_addr=master_addr, master_port=master_port,
        )
    if mpi is not None:
        # Local numbers unknown here (e.g. Hydra without MPI_LOCALRANKID): provisional
        # one-node guess, replaced by init() with MPI's own shared-memory split.
        return LaunchEnv(
            launcher="mpirun", rank=m_rank, world_size=m_size,
            local_rank=m_rank if m_lrank is None else m_lrank,
            local_world_size=m_size if m_lsize is None else m_lsize,
            master_addr=master_addr, master_port=master_port,
        )
    return LaunchEnv(
        launcher="single", rank=0, world_size=1, local_rank=0, local_world_size=1,
        master_addr=master_addr, master_port=master_port,
    )


# --------------------------------------------------------------------------------------
# Context
# --------------------------------------------------------------------------------------


@dataclass(eq=False)
class DistContext:
    """What ``init`` set up. One per process; ``get_context()`` returns it.

    Rank layout: tp groups are contiguous ranks, dp groups are strided, so
    ``rank == dp_rank * tp_size + tp_rank`` and a tp group stays on one node when
    tp_size divides the GPUs per node (NVLink carries the tensor-parallel traffic).
    """

    launch: LaunchEnv
    """The launch environment, completed by init: under mpirun the local numbers come
    from MPI and master_addr/master_port are the store rank 0 actually hosts."""
    device: torch.device
    """This rank's device: cuda:<local_rank> with GPUs, else cpu."""
    backend: str
    """torch.distributed backend of every group here ('nccl' or 'gloo')."""
    world_group: tdist.ProcessGroup
    """All ranks (torch's default group)."""
    tp_group: tdist.ProcessGroup
    """This rank's tensor-parallel group: ranks [dp_rank*tp_size, (dp_rank+1)*tp_size)."""
    dp_group: tdist.ProcessGroup
    """This rank's data-parallel group: ranks tp_rank, tp_rank + tp_size, ..."""
    tp_size: int
    tp_rank: int
    dp_size: int
    dp_rank: int
    timeout_s: float = 60.0
    """Bound on every rendezvous wait and on torch collectives of these groups."""
    _store: Any = field(default=None, repr=False)
    _owns_pg: bool = field(default=True, repr=False)
    _comms: dict[tuple[Any, ...], Any] = field(default_factory=dict, repr=False)
    _comm_counts: dict[tuple[int, ...], int] = field(default_factory=dict, repr=False)
    _store_desc: str = field(default="", repr=False)

    @property
    def rank(self) -> int:
        """Global rank."""
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the rank that prints, checks and writes results."""
        return self.launch.rank == 0

    def barrier(self, group: tdist.ProcessGroup | None = None) -> None:
        """Block until every rank of ``group`` (default: world) gets here."""
        if self.backend == "nccl" and self.device.type == "cuda":
            tdist.barrier(group=group, device_ids=[self.device.index])
        else:
            tdist.barrier(group=group)


_lock = threading.RLock()
_ctx: DistContext | None = None
# Bumped by every init in this process; all ranks call init the same number of times,
# so it names this attempt's keys in a store that outlives it (torchrun's agent store).
_generation = 0
_nccl_backend: Any = None
# How the last nccl_comm() got its unique id: "store", "mpi" or "local" (one rank).
# Tests read it to prove the MPI path ran under mpirun.
_last_uid_exchange: str | None = None


def get_context() -> DistContext | None:
    """The context made by ``init``, or None before ``init`` / after ``shutdown``."""
    return _ctx


# --------------------------------------------------------------------------------------
# init
# --------------------------------------------------------------------------------------


def init(
    *,
    tp_size: int | None = None,
    backend: str | None = None,
    timeout_s: float = 60.0,
    device: str | None = None,
) -> DistContext:
    """Join the job, make the world / tensor-parallel / data-parallel groups, return them.

    Args:
        tp_size: ranks per tensor-parallel group (contiguous ranks); None = world size.
            Must divide the world size.
        backend: torch.distributed backend; None = 'nccl' on a CUDA device, else 'gloo'.
        timeout_s: bound on every wait for other ranks (store connect, arrival, NCCL id
            exchange) and the timeout of the process groups, so it also bounds torch
            collectives on them.
        device: 'cpu', 'cuda' or 'cuda:N'; None = cuda:<local_rank> when CUDA is
            available, else cpu.

    Idempotent: a second call with the same arguments returns the same context; an
    argument left None matches whatever the first call chose; any other difference
    raises. ``shutdown()`` first to start over.

    If torch.distributed was already initialized by the caller, its default group is
    adopted (and left alone by ``shutdown``) provided rank and world size agree with
    the launch environment.

    Raises:
        DistInitError: bad environment or arguments (before any group is created), a
            rank that does not arrive within ``timeout_s``, or conflicting re-init.
    """
    global _ctx, _generation
    with _lock:
        if _ctx is not None:
            _check_same_init(_ctx, tp_size=tp_size, backend=backend, timeout_s=timeout_s,
                             device=device)
            return _ctx

        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
            math.isfinite(timeout_s) and timeout_s > 0
        ):
            raise DistInitError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        launch = detect_launch()
        tp = _resolve_tp_size(tp_size, launch.world_size)

        mpi = None
        if launch.launcher == "mpirun":
            mpi = require("mpi4py.MPI", "mpi", purpose="start-up under mpirun")
            launch = _mpi_confirm(mpi, launch, timeout_s)

        dev = _resolve_device(device, launch)
        be = _resolve_backend(backend, dev)
        timeout = timedelta(seconds=float(timeout_s))
        _generation += 1

        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        owns_pg = not tdist.is_initialized()
        if owns_pg:
            store, desc, addr, port = _rendezvous(launch, mpi, timeout, _generation)
            launch = dataclasses.replace(launch, master_addr=addr, master_port=port)
            try:
                tdist.init_process_group(
                    backend=be, store=store.pg_store, rank=launch.rank,
                    world_size=launch.world_size, timeout=timeout,
                    # NCCL: bind the device now (eager init; subgroups split from it)
                    device_id=dev if dev.type == "cuda" else None,
                )
            except Exception as exc:
                raise DistInitError(
                    f"rank {launch.rank} of {launch.world_size}: init_process_group("
                    f"{be!r}) failed after every rank reached the store at {desc}: {exc}"
                ) from exc
            lib_store = store.lib_store
        else:
            _check_adopted(launch, backend)
            be = str(tdist.get_backend())
            lib_store = tdist.PrefixStore(
                f"overlap/{_generation}", tdist.distributed_c10d._get_default_store()
            )
            desc = "the default store of the caller's process group"

        try:
            tp_group, dp_group = _make_groups(launch.world_size, tp, timeout)
        except BaseException:
            if owns_pg:  # leave nothing half-made behind for a retry to adopt
                tdist.destroy_process_group()
            raise
        world_group = tdist.group.WORLD
        ws = launch.world_size

        _ctx = DistContext(
            launch=launch, device=dev, backend=be, world_group=world_group,
            tp_group=tp_group, dp_group=dp_group, tp_size=tp, tp_rank=launch.rank % tp,
            dp_size=ws // tp, dp_rank=launch.rank // tp, timeout_s=float(timeout_s),
            _store=lib_store, _owns_pg=owns_pg, _store_desc=desc,
        )
        return _ctx


def _make_groups(ws: int, tp: int, timeout: timedelta
                 ) -> tuple[tdist.ProcessGroup, tdist.ProcessGroup]:
    """This rank's (tp group, dp group). Every rank creates every group, in the same
    order (torch's rule for new_group); a group equal to the world is the world group."""
    world = tdist.group.WORLD
    tp_group = world if tp == ws else tdist.new_subgroups_by_enumeration(
        [list(range(s, s + tp)) for s in range(0, ws, tp)], timeout=timeout  # contiguous
    )[0]
    dp_group = world if tp == 1 else tdist.new_subgroups_by_enumeration(
        [list(range(t, ws, tp)) for t in range(tp)], timeout=timeout  # strided
    )[0]
    assert tp_group is not None and dp_group is not None
    return tp_group, dp_group


def _check_same_init(ctx: DistContext, *, tp_size: int | None, backend: str | None,
                     timeout_s: float, device: str | None) -> None:
    conflicts = []
    if tp_size is not None and tp_size != ctx.tp_size:
        conflicts.append(f"tp_size={tp_size!r} (now {ctx.tp_size})")
    if backend is not None and backend.lower() != ctx.backend.lower():
        conflicts.append(f"backend={backend!r} (now {ctx.backend!r})")
    if float(timeout_s) != ctx.timeout_s:
        conflicts.append(f"timeout_s={timeout_s!r} (now {ctx.timeout_s!r})")
    if device is not None:
        want = torch.device(device)
        if want.type != ctx.device.type or (want.index is not None and want != ctx.device):
            conflicts.append(f"device={device!r} (now {str(ctx.device)!r})")
    if conflicts:
        raise DistInitError(
            "overlap.dist.init() was already called with other arguments: "
            + ", ".join(conflicts) + "; call overlap.dist.shutdown() first to change them"
        )


def _resolve_tp_size(tp_size: int | None, world_size: int) -> int:
    if tp_size is None:
        return world_size
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise DistInitError(f"tp_size must be a positive int, got {tp_size!r}")
    if world_size % tp_size:
        raise DistInitError(
            f"tp_size={tp_size} does not divide world_size={world_size}; tensor-parallel "
            f"groups are contiguous blocks of tp_size ranks"
        )
    return tp_size


def _resolve_device(device: str | None, launch: LaunchEnv) -> torch.device:
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise DistInitError(f"device={device!r} but CUDA is not available")
            if dev.index is None:
                dev = torch.device("cuda", launch.local_rank)
            if dev.index >= torch.cuda.device_count():
                raise DistInitError(
                    f"device {dev} does not exist: {torch.cuda.device_count()} GPU(s) visible"
                )
        return dev
    if not torch.cuda.is_available():
        return torch.device("cpu")
    n_gpu = torch.cuda.device_count()
    if launch.local_rank >= n_gpu:
        # Two ranks on one GPU break NCCL ("duplicate GPU"); say so before NCCL does.
        raise DistInitError(
            f"rank {launch.rank} has local rank {launch.local_rank} but only {n_gpu} GPU(s) "
            f"are visible on this node ({launch.local_world_size} processes here); start at "
            f"most {n_gpu} processes per node, or pass device='cpu' with backend='gloo'"
        )
    return torch.device("cuda", launch.local_rank)


def _resolve_backend(backend: str | None, dev: torch.device) -> str:
    if backend is None:
        return "nccl" if dev.type == "cuda" else "gloo"
    be = backend.lower()
    if be == "nccl" and dev.type != "cuda":
        raise DistInitError(f"backend 'nccl' needs a CUDA device, this rank has {dev}")
    return be


def _check_adopted(launch: LaunchEnv, backend: str | None) -> None:
    rank, ws = tdist.get_rank(), tdist.get_world_size()
    if (rank, ws) != (launch.rank, launch.world_size):
        raise DistInitError(
            f"torch.distributed is already initialized as rank {rank} of {ws}, but the "
            f"{launch.launcher} environment says rank {launch.rank} of {launch.world_size}; "
            "launch with torchrun/mpirun or let overlap.dist.init create the process group"
        )
    have = str(tdist.get_backend()).lower()
    if backend is not None and backend.lower() != have:
        raise DistInitError(
            f"torch.distributed is already initialized with backend {have!r}, not {backend!r}"
        )


# --------------------------------------------------------------------------------------
# Rendezvous
# --------------------------------------------------------------------------------------


@dataclass
class _Stores:
    pg_store: Any   # handed to init_process_group
    lib_store: Any  # this library's keys (nccl ids, exit barrier)


def _rendezvous(launch: LaunchEnv, mpi: Any, timeout: timedelta, generation: int
                ) -> tuple[_Stores, str, str | None, int | None]:
    """Connect to (or host) the store, wait (bounded) until every rank has arrived.

    Returns the stores, a description for error messages, and the store's address and
    port (None for the in-process store of a single process).
    """
    if launch.launcher == "single":
        # No port, no file: an in-process store is all a one-rank group needs.
        base = tdist.HashStore()
        stores = _Stores(tdist.PrefixStore("pg", base), tdist.PrefixStore("overlap", base))
        return stores, "in-process HashStore (single)", None, None

    rank, ws = launch.rank, launch.world_size
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if launch.launcher == "torchrun":
        addr, port = launch.master_addr, launch.master_port
        assert addr is not None and port is not None
        # torchrun's agent hosts the store; without the agent, rank 0 does.
        base = _connect_store(addr, port, rank, ws, host=(rank == 0 and not agent),
                              timeout=timeout)
    else:
        base, addr, port = _mpi_store(mpi, launch, timeout)
    desc = f"{addr}:{port} ({launch.launcher})"
    # The agent's store outlives worker restarts: name this attempt's keys.
    attempt = (f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}."
               f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '')}" if agent else "")
    root = tdist.PrefixStore(f"overlap{attempt}/{generation}", base)
    _arrival_barrier(root, "init", rank, ws, timeout, what="overlap.dist.init()", desc=desc)
    return _Stores(tdist.PrefixStore("pg", root), tdist.PrefixStore("lib", root)), desc, addr, port


def _connect_store(addr: str, port: int, rank: int, ws: int, *, host: bool,
                   timeout: timedelta) -> Any:
    if not host:
        _wait_for_listener(addr, port, rank, ws, timeout)
    try:
        # wait_for_workers=False: the arrival barrier below waits instead, so a missing
        # rank is reported by number rather than as a bare TCPStore timeout.
        return tdist.TCPStore(addr, port, ws, is_master=host, timeout=timeout,
                              wait_for_workers=False, multi_tenant=True)
    except Exception as exc:
        if host:
            raise DistInitError(
                f"rank {rank} of {ws} could not host the rendezvous store on port {port} "
                f"(MASTER_ADDR={addr}): {exc}"
            ) from exc
        raise DistInitError(
            f"rank {rank} of {ws} could not reach the rendezvous store at {addr}:{port} within "
            f"{timeout.total_seconds():g} s: is rank 0 (or the launcher's agent) running, and "
            f"is {addr}:{port} reachable from this node? ({exc})"
        ) from exc


def _wait_for_listener(addr: str, port: int, rank: int, ws: int, timeout: timedelta) -> None:
    """Poll until something listens on addr:port, or raise at the deadline.

    TCPStore's own client retries with back-off and can take about twice its timeout to
    give up, printing C++ stack traces on the way; this keeps the bound at timeout_s.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    last: Exception | None = None
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(0.05, min(1.0, left))):
                return
        except OSError as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise DistInitError(
                f"rank {rank} of {ws} could not reach the rendezvous store at {addr}:{port} "
                f"within {timeout.total_seconds():g} s: is rank 0 (or the launcher's agent) "
                f"running, and is {addr}:{port} reachable from this node? ({last})"
            )
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def _arrival_barrier(store: Any, name: str, rank: int, n: int, timeout: timedelta, *,
                     what: str, desc: str, ranks: Sequence[int] | None = None,
                     value: bytes = b"1") -> bytes:
    """Each of n members posts ``<name>/<i>``; wait (bounded) for all; return member 0's value.

    ``rank`` is this member's index in 0..n-1; ``ranks`` maps indices to global ranks
    for the error message. O(n) store operations in all: a counter, and one "all here"
    key set by the last member to arrive; the per-member keys are read only to name
    the missing members when the wait times out.
    """
    store.set(f"{name}/{rank}", value)
    if store.add(f"{name}/count", 1) == n:
        store.set(f"{name}/all", b"1")
    try:
        store.wait([f"{name}/all"], timeout)
    except Exception as exc:
        missing = [i for i in range(n) if not _store_has(store, f"{name}/{i}")]
        named = [ranks[i] for i in missing] if ranks is not None else missing
        me = ranks[rank] if ranks is not None else rank
        world = f" of a group of {n} (ranks {list(ranks)})" if ranks is not None else f" of {n}"
        raise DistInitError(
            f"rank {me}{world} waited {timeout.total_seconds():g} s at the store {desc} in "
            f"{what} for rank(s) {named or '?'} that never arrived; check that all of them "
            f"started and reach the same call ({exc})"
        ) from exc
    return value if rank == 0 else store.get(f"{name}/0")


def _store_has(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:
        return False


def _wait_mpi(req: Any, deadline: float) -> bool:
    while not req.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _mpi_confirm(mpi: Any, launch: LaunchEnv, timeout_s: float) -> LaunchEnv:
    """Check MPI agrees with the environment; take local numbers from MPI itself."""
    comm = mpi.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (launch.rank, launch.world_size):
        raise DistInitError(
            f"MPI.COMM_WORLD says rank {comm.Get_rank()} of {comm.Get_size()}, the environment "
            f"says rank {launch.rank} of {launch.world_size}"
        )
    # Bounded arrival first: every later MPI call here is a blocking collective.
    if not _wait_mpi(comm.Ibarrier(), time.monotonic() + timeout_s):
        raise DistInitError(
            f"rank {launch.rank} of {launch.world_size}: not every rank of MPI.COMM_WORLD "
            f"reached overlap.dist.init() within {timeout_s:g} s (mpirun)"
        )
    local = comm.Split_type(mpi.COMM_TYPE_SHARED, key=launch.rank)
    try:
        lrank, lsize = local.Get_rank(), local.Get_size()
    finally:
        local.Free()
    return dataclasses.replace(launch, local_rank=lrank, local_world_size=lsize)


def _mpi_store(mpi: Any, launch: LaunchEnv, timeout: timedelta) -> tuple[Any, str, int]:
    """Rank 0 hosts a TCPStore and broadcasts where; the others connect."""
    comm = mpi.COMM_WORLD
    rank, ws = launch.rank, launch.world_size
    one_node = comm.allreduce(1 if launch.local_rank == 0 else 0) == 1
    store = None
    msg: tuple[str, str, int]
    if rank == 0:
        try:
            addr = launch.master_addr or ("127.0.0.1" if one_node else _routable_host_ip())
            # Port 0: the OS picks a free port and nothing can race us for it.
            store = _connect_store(addr, launch.master_port or 0, rank, ws, host=True,
                                   timeout=timeout)
            msg = ("ok", addr, int(store.port))
        except Exception as exc:  # tell the others before raising, or they would wait
            msg = ("error", str(exc), 0)
    else:
        msg = ("", "", 0)
    msg = comm.bcast(msg, root=0)
    if msg[0] == "error":
        raise DistInitError(f"rank {rank} of {ws}: rank 0 could not host the store: {msg[1]}")
    _, addr, port = msg
    if store is None:
        store = _connect_store(addr, port, rank, ws, host=False, timeout=timeout)
    return store, addr, port


def _routable_host_ip() -> str:
    """An address of this host that other nodes can reach (not loopback)."""
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            ip = info[4][0]
            if not ip.startswith("127."):
                return ip
    except OSError:
        pass
    try:  # the interface of the default route; connect() on UDP sends nothing
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
            if not ip.startswith("127."):
                return ip
    except OSError:
        pass
    raise DistInitError(
        "could not find an address of this host that other nodes can reach; set MASTER_ADDR"
    )


# --------------------------------------------------------------------------------------
# Groups and NCCL communicators
# --------------------------------------------------------------------------------------


def group_ranks(group: tdist.ProcessGroup | Sequence[int] | None = None) -> list[int]:
    """Global ranks of ``group`` in group-rank order; validates the argument.

    ``group`` is a torch ProcessGroup, None (the world group, torch's convention) or a
    sequence of distinct global ranks.

    Raises:
        DistInitError: torch.distributed is not initialized.
        ValueError: this rank is not in the group, or the ranks are invalid.
        TypeError: ``group`` is none of the above.
    """
    if not tdist.is_initialized():
        raise DistInitError("torch.distributed is not initialized; call overlap.dist.init() first")
    if group is None:
        return list(range(tdist.get_world_size()))
    if isinstance(group, tdist.ProcessGroup):
        try:
            return list(tdist.get_process_group_ranks(group))
        except KeyError:
            raise ValueError(
                "unknown process group (destroyed, or not made by torch.distributed)"
            ) from None
    if isinstance(group, int) and group == tdist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            "this rank is not a member of the group (new_group returned NON_GROUP_MEMBER)"
        )
    if isinstance(group, (str, bytes)) or not isinstance(group, Sequence):
        raise TypeError(
            f"group must be a ProcessGroup, a sequence of ranks or None, got {type(group).__name__}"
        )
    ranks = list(group)
    ws = tdist.get_world_size()
    if not ranks:
        raise ValueError("group has no ranks")
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"ranks must be ints, got {r!r}")
        if not 0 <= r < ws:
            raise ValueError(f"rank {r} is outside the world (size {ws})")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"group ranks repeat: {ranks}")
    return ranks


def set_nccl_backend(backend: Any | None) -> Any:
    """Replace the module that makes NCCL communicators; None restores ``overlap._nccl``.

    ``backend`` needs what ``overlap._nccl`` has: ``get_unique_id() -> bytes``,
    ``check_nccl_versions()`` and ``NcclCommunicator(unique_id, nranks, rank, *,
    config=None)``. Tests pass a fake so the bootstrap (who makes the id, how it travels,
    timeouts) runs on CPU under gloo. Returns the previous backend.
    """
    global _nccl_backend
    with _lock:
        prev, _nccl_backend = _nccl_backend, backend
        return prev


def _get_nccl_backend() -> Any:
    if _nccl_backend is not None:
        return _nccl_backend
    return importlib.import_module("overlap._nccl")


def nccl_comm(
    group: tdist.ProcessGroup | Sequence[int] | None = None,
    *,
    config: NcclConfig | None = None,
) -> NcclCommunicator:
    """The library's NCCL communicator over the ranks of ``group`` (default: tp group).

    Collective over the members of ``group`` (only they call it). Cached per (ranks,
    config): later calls return the same communicator, so call it freely.

    Bootstrap: group rank 0 makes the unique id (``overlap._nccl.get_unique_id()``);
    it travels through the rendezvous store (torchrun, single) or an MPI broadcast on a
    communicator of the same ranks (mpirun). Before that, every member posts its arrival
    and config to the store and waits, bounded by ``timeout_s``, for all the others, so
    a missing member or one that asked for another config is an error, not a hang
    inside NCCL's init. ``check_nccl_versions()`` runs first: cupy and torch must load
    the same libnccl.

    Raises:
        DistInitError: not initialized, a member missing, or members disagree on config.
        ValueError: this rank is not in ``group``.
    """
    global _last_uid_exchange
    ctx = _ctx
    if ctx is None:
        raise DistInitError("call overlap.dist.init() before overlap.dist.nccl_comm()")
    ranks = group_ranks(ctx.tp_group if group is None else group)
    if ctx.rank not in ranks:
        raise ValueError(f"rank {ctx.rank} is not in the group {ranks}")
    if config is not None and getattr(config, "is_default", False):
        config = None  # NcclConfig() and None make the same communicator: share it
    key = (tuple(ranks), config)
    with _lock:
        comm = ctx._comms.get(key)
        if comm is not None:
            return comm
        backend = _get_nccl_backend()
        backend.check_nccl_versions()
        n, me = len(ranks), ranks.index(ctx.rank)
        # Unique per group and per communicator made over it; the same on every member
        # because members make communicators over a group in the same order.
        count = ctx._comm_counts.get(key[0], 0)
        ctx._comm_counts[key[0]] = count + 1
        tag = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
        name = f"nccl/{tag}/{count}"
        timeout = timedelta(seconds=ctx.timeout_s)

        if n == 1:
            uid, how = backend.get_unique_id(), "local"
        else:
            cfg = repr(config).encode()
            arrive = dict(ranks=ranks, what="overlap.dist.nccl_comm()", desc=ctx._store_desc)
            cfg0 = _arrival_barrier(ctx._store, f"{name}/arrive", me, n, timeout, value=cfg,
                                    **arrive)
            # Every member compares its config with group rank 0's, then all learn whether
            # anyone differed: raising on one rank only would leave the others inside
            # NCCL's init, which has no timeout.
            if cfg0 != cfg:
                ctx._store.add(f"{name}/mismatch", 1)
            _arrival_barrier(ctx._store, f"{name}/checked", me, n, timeout, **arrive)
            bad = ctx._store.add(f"{name}/mismatch", 0)
            if bad:
                raise DistInitError(
                    f"rank {ctx.rank}: nccl_comm over ranks {ranks}: {bad} member(s) asked for "
                    f"another config than the group's rank 0 (rank {ranks[0]}: "
                    f"{cfg0.decode()}); this rank asked for {config!r}"
                )
            if ctx.launch.launcher == "mpirun":
                uid, how = _mpi_bcast_uid(backend, ranks, me, count), "mpi"
            else:
                uid, how = _store_bcast_uid(backend, ctx._store, name, me, timeout, ranks,
                                            ctx._store_desc), "store"
        if not isinstance(uid, (bytes, bytearray)):
            raise TypeError(f"get_unique_id() must return bytes, got {type(uid).__name__}")
        comm = backend.NcclCommunicator(bytes(uid), n, me, config=config)
        ctx._comms[key] = comm
        _last_uid_exchange = how
        return comm


def _store_bcast_uid(backend: Any, store: Any, name: str, me: int, timeout: timedelta,
                     ranks: Sequence[int], desc: str) -> bytes:
    key = f"{name}/uid"
    if me == 0:
        uid = backend.get_unique_id()
        store.set(key, bytes(uid))
        return uid
    try:
        store.wait([key], timeout)
    except Exception as exc:
        raise DistInitError(
            f"rank {ranks[me]}: the NCCL unique id from rank {ranks[0]} (group {list(ranks)}) "
            f"did not reach the store {desc} within {timeout.total_seconds():g} s ({exc})"
        ) from exc
    return store.get(key)


def _mpi_bcast_uid(backend: Any, ranks: Sequence[int], me: int, count: int) -> bytes:
    mpi = require("mpi4py.MPI", "mpi", purpose="start-up under mpirun")
    world = mpi.COMM_WORLD
    wgroup = world.Get_group()
    sub = wgroup.Incl(list(ranks))
    # Create_group is collective over the members only (nccl_comm is called by members
    # only); every member arrived at the store barrier just before, so it cannot hang.
    comm = world.Create_group(sub, tag=count % 32768)
    try:
        uid = backend.get_unique_id() if me == 0 else None
        return comm.bcast(uid, root=0)
    finally:
        comm.Free()
        sub.Free()
        wgroup.Free()


# --------------------------------------------------------------------------------------
# shutdown
# --------------------------------------------------------------------------------------


_shutdown_hooks: list[Callable[[], None]] = []


def on_shutdown(hook: Callable[[], None]) -> None:
    """Call ``hook()`` at the start of every ``shutdown`` (before the communicators go)."""
    if hook not in _shutdown_hooks:
        _shutdown_hooks.append(hook)


def shutdown() -> None:
    """Destroy the NCCL communicators made here and the process groups ``init`` made.

    Collective: call it on every rank. Safe to call twice or before ``init``. Rank 0
    hosts the store when no launcher agent does, so it waits (bounded) until every rank
    has said goodbye before tearing the store down under them.
    """
    global _ctx
    with _lock:
        ctx = _ctx
        if ctx is None:
            return
        _ctx = None
        for hook in list(_shutdown_hooks):  # e.g. the ops forget state built on these communicators
            try:
                hook()
            except Exception as exc:
                warnings.warn(f"overlap.dist.shutdown: a shutdown hook failed: {exc}", stacklevel=2)
        for comm in ctx._comms.values():
            try:
                comm.destroy()
            except Exception as exc:  # keep going: the process group must still go
                warnings.warn(f"overlap.dist.shutdown: destroying an NCCL communicator failed: {exc}",
                              stacklevel=2)
        ctx._comms.clear()
        if not ctx._owns_pg:
            return
        if ctx.world_size > 1 and ctx._store is not None:
            # Every rank destroys its process group first: NCCL's teardown can wait on
            # the peers' teardown, so no rank may sit in a store wait meanwhile. Then
            # ranks other than 0 say goodbye, and rank 0 (which may host the store) waits
            # for them before letting the store go: a rank still tearing down after the
            # store's host exited can die in the store client ("terminate called ...").
            # The store object outlives the group: this context holds it.
            try:
                if tdist.is_initialized():
                    tdist.destroy_process_group()
                if ctx.rank != 0:
                    ctx._store.set(f"exit/{ctx.rank}", b"1")
                else:
                    ctx._store.wait([f"exit/{r}" for r in range(1, ctx.world_size)],
                                    timedelta(seconds=ctx.timeout_s))
            except Exception as exc:
                warnings.warn(f"overlap.dist.shutdown: not every rank reached shutdown: {exc}",
                              stacklevel=2)
        if tdist.is_initialized():
            tdist.destroy_process_group()
