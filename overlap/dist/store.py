"""The rendezvous: where ranks meet before any process group exists, with bounded waits.

``_rendezvous`` connects to (or hosts) the store for ``init``: torchrun's agent store or a
TCPStore rank 0 hosts on MASTER_PORT (torchrun), a TCPStore whose address rank 0
broadcasts over MPI.COMM_WORLD (mpirun, ``_mpi_store``), or an in-process HashStore (a
single process). ``_arrival_barrier`` is the bounded wait every start-up step uses: a rank
that never arrives becomes a ``DistInitError`` naming it, the group and the store address,
never a hang. ``_mpi_confirm`` checks that MPI agrees with the environment (after a
bounded MPI barrier) and takes the node-local ranks from MPI itself.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as tdist

from .launch import DistInitError, LaunchEnv

__all__: list[str] = []  # internal to overlap.dist

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
    _arrival_barrier(root, "init", rank, ws, timeout, what="overlap.init()", desc=desc)
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
            f"reached overlap.init() within {timeout_s:g} s (mpirun)"
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

