"""The process's distributed context: ``init``, ``get_context``, ``shutdown``.

``init`` reads the launch environment (``launch.py``), meets the other ranks at the
rendezvous store (``store.py``), makes torch's default group and the tensor-parallel and
data-parallel groups, and keeps them in one ``DistContext`` per process. ``shutdown``
runs the ``on_shutdown`` hooks, destroys the NCCL communicators made by ``nccl_comm``
(``comms.py``, cached on the context) and the process groups, with a bounded goodbye so
the store's host leaves last.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from .._env import require
from .launch import DistInitError, LaunchEnv, detect_launch
from .shared import forget_gpu_peers, nccl_refusal, place_on_gpus, shared_gpu_env
from .store import _mpi_confirm, _rendezvous

__all__ = ["DistContext", "SHUTDOWN_BOUND_S", "get_context", "init", "on_shutdown", "shutdown"]


@dataclass(eq=False)
class DistContext:
    """What ``init`` set up. One per process; ``get_context()`` returns it.

    Rank layout: tp groups are contiguous ranks, dp groups are strided, so
    ``rank == dp_rank * tp_size + tp_rank`` and a tp group stays on one node when
    tp_size divides the GPUs per node (NVLink carries the tensor-parallel traffic).
    After ``shutdown()`` its groups are None.
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
    shared_gpu: bool = False
    """Shared-GPU mode (``overlap.dist.shared``): ranks of a node share GPUs; groups on
    gloo, the ops on the peer-copy transport, NCCL refused."""
    gpu_share: int = 1
    """Ranks of this node on this rank's GPU (1: a GPU of its own)."""
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

        dev, share, shared = _resolve_device(device, launch)
        be = _resolve_backend(backend, dev, shared, launch)
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
                    device_id=_bound_device(be, dev),
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
            shared_gpu=shared, gpu_share=share, _store=lib_store, _owns_pg=owns_pg, _store_desc=desc,
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
            "overlap.init() was already called with other arguments: "
            + ", ".join(conflicts) + "; call overlap.shutdown() first to change them"
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


def _resolve_device(device: str | None, launch: LaunchEnv) -> tuple[torch.device, int, bool]:
    """(this rank's device, ranks of this node on it, shared-GPU mode): ``place_on_gpus``
    where no device is given and CUDA is there (``overlap.dist.shared``)."""
    want = shared_gpu_env()
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise DistInitError(f"device={device!r} but CUDA is not available")
            n_gpu = torch.cuda.device_count()
            if dev.index is None:
                gpu, share, shared = place_on_gpus(launch.rank, launch.local_rank, launch.local_world_size, n_gpu,
                                                   want)
                dev = torch.device("cuda", gpu)
            else:  # the caller placed the rank: shared only where asked for
                _, share, shared = (place_on_gpus(launch.rank, launch.local_rank, launch.local_world_size, n_gpu,
                                                  True) if want else (0, 1, False))
            if dev.index >= n_gpu:
                raise DistInitError(
                    f"device {dev} does not exist: {n_gpu} GPU(s) visible"
                )
            return dev, share, shared
        return dev, 1, False
    if not torch.cuda.is_available():
        return torch.device("cpu"), 1, False
    gpu, share, shared = place_on_gpus(launch.rank, launch.local_rank, launch.local_world_size,
                                       torch.cuda.device_count(), want)
    return torch.device("cuda", gpu), share, shared


def _bound_device(backend: str, dev: torch.device) -> torch.device | None:
    """The device to bind the default group to: NCCL's (eager init; subgroups split from
    it). None on gloo, also with a CUDA device (shared-GPU mode): a bound gloo group makes
    torch 2.11's ``new_group`` split it, which gloo cannot (``perform_nocolor_split``)."""
    return dev if backend == "nccl" and dev.type == "cuda" else None


def _resolve_backend(backend: str | None, dev: torch.device, shared: bool = False,
                     launch: LaunchEnv | None = None) -> str:
    if backend is None:
        return "nccl" if dev.type == "cuda" and not shared else "gloo"
    be = backend.lower()
    if be == "nccl" and dev.type != "cuda":
        raise DistInitError(f"backend 'nccl' needs a CUDA device, this rank has {dev}")
    if be == "nccl" and shared:
        rank = launch.rank if launch is not None else 0
        raise DistInitError(nccl_refusal("overlap.dist.init(backend='nccl')", rank, "of this node"))
    return be


def _check_adopted(launch: LaunchEnv, backend: str | None) -> None:
    rank, ws = tdist.get_rank(), tdist.get_world_size()
    if (rank, ws) != (launch.rank, launch.world_size):
        raise DistInitError(
            f"torch.distributed is already initialized as rank {rank} of {ws}, but the "
            f"{launch.launcher} environment says rank {launch.rank} of {launch.world_size}; "
            "launch with torchrun/mpirun or let overlap.init create the process group"
        )
    have = str(tdist.get_backend()).lower()
    if backend is not None and backend.lower() != have:
        raise DistInitError(
            f"torch.distributed is already initialized with backend {have!r}, not {backend!r}"
        )



# --------------------------------------------------------------------------------------
# shutdown
# --------------------------------------------------------------------------------------


_shutdown_hooks: list[Callable[[], None]] = []

SHUTDOWN_BOUND_S = 60.0
"""The most ``shutdown`` takes, whatever ``timeout_s`` is (docs/guarantees.md)."""
FAILED_GOODBYE_S = 2.0
"""How long a failing rank 0 waits for the others' goodbyes: enough when every rank
fails at the same point (they arrive within milliseconds), short when a peer is blocked
in a collective with it and never will."""


def on_shutdown(hook: Callable[[], None]) -> None:
    """Call ``hook()`` at the start of every ``shutdown`` (before the communicators go)."""
    if hook not in _shutdown_hooks:
        _shutdown_hooks.append(hook)


def shutdown(*, failed: bool | None = None) -> None:
    """Destroy the NCCL communicators made here and the process groups ``init`` made.

    Collective: call it on every rank. Safe to call twice or before ``init``. Takes at
    most ``SHUTDOWN_BOUND_S`` (60 s) whatever ``timeout_s`` is.

    Rank 0 hosts the store when no launcher agent does, so on a clean exit it waits
    (bounded: ``timeout_s``, within the 60 s) until every rank has said goodbye before
    tearing the store down under them. A failing rank 0 waits ``FAILED_GOODBYE_S`` (2 s)
    at most: its peers may be blocked in a collective with it and never say goodbye, and
    waiting longer would keep the whole job up. Its process exiting closes its
    connections (gloo peers fail at once with "Connection closed by peer") and launchers
    (torchrun, mpirun) end the other ranks.

    Afterwards the context's groups and store are None: a context the caller keeps does
    not keep the process groups and their threads alive.

    Args:
        failed: this rank is leaving because of an error. None (the default): True when
            an exception is in flight (``shutdown()`` in a ``finally`` or ``except``
            block while an exception propagates), else False.
    """
    global _ctx
    if failed is None:
        failed = sys.exc_info()[1] is not None
    deadline = time.monotonic() + SHUTDOWN_BOUND_S
    with _lock:
        ctx = _ctx
        if ctx is None:
            return
        _ctx = None
        forget_gpu_peers()
        for hook in list(_shutdown_hooks):  # e.g. the ops forget state built on these communicators
            try:
                hook()
            except Exception as exc:
                warnings.warn(f"overlap.shutdown: a shutdown hook failed: {exc}", stacklevel=2)
        for comm in ctx._comms.values():
            try:
                comm.destroy()
            except Exception as exc:  # keep going: the process group must still go
                warnings.warn(f"overlap.shutdown: destroying an NCCL communicator failed: {exc}",
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
                    ctx._store.set(f"exit/{ctx.rank}", b"failed" if failed else b"1")
                else:
                    wait_s = min(ctx.timeout_s, deadline - time.monotonic(),
                                 FAILED_GOODBYE_S if failed else math.inf)
                    if wait_s > 0:
                        ctx._store.wait([f"exit/{r}" for r in range(1, ctx.world_size)],
                                        timedelta(seconds=wait_s))
            except Exception as exc:
                warnings.warn(f"overlap.shutdown: rank {ctx.rank}: not every rank reached shutdown "
                              f"within the bound: {exc}", stacklevel=2)
        if tdist.is_initialized():
            tdist.destroy_process_group()
        # The caller may keep the context; its references would keep the process groups
        # (gloo's socket loop and worker threads) and the store client alive until the
        # interpreter exits, where tearing them down can meet a joinable thread and abort
        # ("terminate called without an active exception", seen on a rank whose peer had
        # died). Dropped here, they go now, while Python is alive.
        ctx.world_group = ctx.tp_group = ctx.dp_group = None  # type: ignore[assignment]
        ctx._store = None
        # A failed collective's traceback holds the group in its torch.distributed frames'
        # locals: in the exception in flight (cleared here), or in a reference cycle of an
        # exception already handled (collected now, not whenever the collector next runs).
        _clear_tdist_frames(sys.exc_info()[1])
        gc.collect()


_TDIST_DIR = os.path.dirname(tdist.__file__)


def _clear_tdist_frames(exc: BaseException | None) -> None:
    """Drop the locals of torch.distributed's finished frames in ``exc``'s traceback (and
    in the exceptions it chains): they hold the process group and its work. The
    traceback still prints (code and line numbers stay); the caller's frames are kept."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_code.co_filename.startswith(_TDIST_DIR):
                try:
                    frame.clear()
                except RuntimeError:  # still executing
                    pass
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
