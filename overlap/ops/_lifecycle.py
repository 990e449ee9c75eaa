"""The end of the ops' per-group state: ``overlap.reset`` (the ranks back in step after a
timeout) and ``reset_runtimes`` (every runtime dropped at ``overlap.dist.shutdown``), both
bounded by ``shutdown_timeout_s``. Its names are importable from ``_runtime`` as well."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .. import flags as _flags
from . import _agree, _state
from ._runtime import Runtime, _lock, _runtimes, _by_group, group_key, resolve_group

__all__ = ["shutdown_timeout_s", "reset", "reset_runtimes"]


def _drain(rt: Runtime, timeout_s: float) -> bool:
    """True once the runtime's streams and the device's last op call have finished,
    False if they have not within ``timeout_s`` (polled: never a blocking wait on a
    stream that may not finish, such as an NCCL kernel whose peer died)."""
    import time

    evs = []
    for s in (rt.comm_stream, rt.aux_stream, rt.copy_stream):
        ev = torch.cuda.Event()
        ev.record(s)
        evs.append(ev)
    last = rt.order.last_stream()
    if last is not None:
        ev = torch.cuda.Event()
        ev.record(last)
        evs.append(ev)
    deadline = time.monotonic() + timeout_s
    while not all(ev.query() for ev in evs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def shutdown_timeout_s(group: Any = None) -> float:
    """How long shutdown and ``reset`` wait for the ops' work to end: the wait bound
    (every tile's wait ends by then) plus 5 s, at most 60 s. The default bound is the
    process groups' timeout (minutes), so this is usually the 60 s cap: past it, shutdown
    aborts the library's NCCL communicators rather than wait out a dead peer's bound."""
    return min(60.0, _flags.default_timeout_ms(group) / 1000.0 + 5.0)


def reset(group: Any = None) -> None:
    """Bring the ops of ``group`` back in step on every rank after a timeout (collective:
    every rank of the group calls it, at the same point).

    After a ``FlagTimeoutError`` on the peer-copy transport the ranks may be out of
    step (a rank whose wait timed out went on; its peers' later flags then look two
    calls ahead: ``FlagProtocolError``). Every output of the group's peer-copy ops on
    every rank from the call that timed out until this reset is invalid. The reset
    waits (bounded by ``shutdown_timeout_s``) until this rank's work of the ops has
    ended, meets the other ranks, zeroes this rank's shared flags and epochs and the
    error words, and meets them again; the next call of every op is then epoch 1 on
    every rank. It also ends an out-of-step state (``overlap.ops._agree``: the group's call
    counters start again from 0 and a group ended on a rank is usable again). The NCCL
    transport and the chain keep no other state across calls. Raises ``RuntimeError`` if
    the work does not end in time (an NCCL kernel whose peer is gone): then
    ``overlap.dist.shutdown`` is the way out."""
    import torch.distributed as tdist

    group = resolve_group(group)
    rt = None
    ranks, _ = group_key(group)
    if torch.cuda.is_available():
        with _lock:
            rt = next((r for (rk, _), r in _runtimes.items() if rk == ranks), None)
    if rt is not None and not _drain(rt, shutdown_timeout_s(group)):
        raise RuntimeError(f"overlap.reset: rank {rt.rank}: the ops' work did not end within "
                           f"{shutdown_timeout_s(group):.0f} s; shut down instead (overlap.dist.shutdown)")
    tdist.barrier(group=group)  # every rank's pushes have ended: nothing lands after this
    _agree.reset_steps(ranks)  # the group's call counters from 0, the group no longer ended here
    if rt is not None:
        with rt.order.lock:
            if rt._heap is not None:
                for f in rt._heap._flags.values():
                    f.local.zero_()
                    f.epoch = 0
            for err in rt._errs.values():
                err.clear()
            rt._p2p_done.clear()
            _state.generation[0] += 1  # the transport is decided again: no indexed call plan trusted
            torch.cuda.synchronize(rt.device)
    tdist.barrier(group=group)  # every rank zeroed its flags before any rank pushes again


def reset_runtimes() -> None:
    """Forget every runtime, and with them everything the ops keep per group and device:
    plans, tuned configs, the ranks' agreements, the chain's state. ``dist.shutdown`` calls
    this before it destroys the communicators the runtimes hold, so ops after a new
    ``init`` build fresh ones and check the ranks again. Bounded: where the ops' work has
    not ended within ``shutdown_timeout_s`` (a peer died mid-call), the runtime's NCCL
    communicators are aborted (which ends their kernels) and its peer memory is left
    mapped rather than freed under a running kernel. The plan graphs (``_graphs``) are
    freed before the communicators they captured are destroyed (kept unfreed where those
    were aborted). What a user's CUDA graph captured stays (``keep_for_capture``, the
    captured words, the error words)."""
    from . import _graphs

    with _lock:
        for rt in _runtimes.values():
            try:
                if rt.device.type != "cuda" or _drain(rt, shutdown_timeout_s()):
                    _graphs.drop_graphs(rt)  # before the communicators their collectives were captured on
                    rt.close()
                else:
                    who = f"rank {rt.rank} of group {rt.ranks}" if rt.group is not None else f"device {rt.device}"
                    warnings.warn(f"overlap: {who}: the ops' work did not end within "
                                  f"{shutdown_timeout_s():.0f} s; aborting the library's NCCL communicators",
                                  stacklevel=3)
                    _graphs.drop_graphs(rt, free=False)
                    for comm in rt._comms.values():
                        comm.abort()
                rt._caches.clear()  # gone also for whoever still holds the runtime
            except Exception:  # noqa: BLE001 - teardown is best effort
                pass
        _runtimes.clear()
        _by_group.clear()
        _state.generation[0] += 1  # no call plan of a runtime gone is found again
        _state.call_index.clear()  # nor held: its entries hold their runtimes
    _agree.reset_steps()


def _register() -> None:
    from .. import dist

    dist.on_shutdown(reset_runtimes)


_register()
