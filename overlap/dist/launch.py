"""Who this process is, read from the launcher's environment variables.

``detect_launch`` turns torchrun's env:// variables (RANK, WORLD_SIZE, LOCAL_RANK, ...),
Open MPI's (OMPI_COMM_WORLD_*), Hydra's (PMI_*, MPI_LOCAL*) or PMIx's with Slurm's task
count into a ``LaunchEnv``, checking that launchers whose variables are both present
agree. A pure function of the mapping: it opens no sockets and imports no MPI, so it is
tested on any machine. ``DistInitError``, the error of every start-up step, lives here
because this is the first of them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = ["DistInitError", "LaunchEnv", "Launcher", "detect_launch"]

Launcher = Literal["torchrun", "mpirun", "single"]
_LAUNCHERS = ("torchrun", "mpirun", "single")


class DistInitError(ValueError):
    """Distributed start-up failed: bad launch environment, bad arguments, or a timeout."""



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

