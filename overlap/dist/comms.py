"""The library's own NCCL communicators, made over the ranks of a torch group.

``group_ranks`` resolves a group argument (a ProcessGroup, a list of global ranks or None)
to global ranks. ``nccl_comm`` makes one communicator per (ranks, config) and caches it on
the ``DistContext``, so ``shutdown`` destroys it; its unique id travels through the
rendezvous store (torchrun, single) or an MPI broadcast (mpirun), after a bounded arrival
check that also compares the members' configs. ``set_nccl_backend`` swaps the module that
makes the communicators (``overlap._nccl`` by default, imported only when first used) for
a fake, so the bootstrap runs on CPU.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as tdist

from .._env import require
from .context import _lock, get_context
from .launch import DistInitError
from .shared import nccl_refusal
from .store import _arrival_barrier

if TYPE_CHECKING:  # overlap._nccl needs cupy; never import it at module load
    from .._nccl import NcclCommunicator, NcclConfig

__all__ = ["group_ranks", "nccl_comm", "set_nccl_backend"]

_nccl_backend: Any = None
# How the last nccl_comm() got its unique id: "store", "mpi" or "local" (one rank).
# Tests read it to prove the MPI path ran under mpirun.
_last_uid_exchange: str | None = None


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
        raise DistInitError("torch.distributed is not initialized; call overlap.init() first")
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
        DistInitError: not initialized, a member missing, members disagree on config, or
            shared-GPU mode (``overlap.dist.shared``: NCCL refuses two ranks on one device)
            with more than one member.
        ValueError: this rank is not in ``group``.
    """
    global _last_uid_exchange
    ctx = get_context()
    if ctx is None:
        raise DistInitError("call overlap.init() before overlap.nccl_comm()")
    ranks = group_ranks(ctx.tp_group if group is None else group)
    if ctx.rank not in ranks:
        raise ValueError(f"rank {ctx.rank} is not in the group {ranks}")
    if getattr(ctx, "shared_gpu", False) and len(ranks) > 1:
        raise DistInitError(nccl_refusal("overlap.dist.nccl_comm()", ctx.rank, ranks))
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

