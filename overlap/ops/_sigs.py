"""Signatures and the ranks' agreement: what a call's ranks must pass alike, checked on the
host at the agreement point (``check_agree``, ``agree_on_reference``; the exchange itself
is ``overlap.ops._agree``) and, on the peer-copy transport, written beside the pushed rows
for the peers' kernels (``call_sig``, ``post_sig``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import flags as _flags
from . import _agree
from ._state import OverlapCaptureError, capturing

if TYPE_CHECKING:
    from ._runtime import Runtime

__all__ = ["call_sig", "post_sig", "REFRESH_EVERY", "dtype_code", "every_call_checked", "AGREED_CAP", "check_agree",
           "all_gather_single", "gather_ints", "refuse_grad", "agree_on_reference", "agree_key", "check_agreed"]


def call_sig(op: str, values: tuple[int, ...]) -> int:
    """The signature of a peer-copy call: a nonzero int32 of the op and the values every
    rank must pass alike (CRC-32 of their text, the same on every rank; never 0, the
    flags' value before any write). Written beside the pushed rows and compared by the
    peer's kernels: ranks that disagree get ``overlap.flags.RanksDisagreeError`` with no
    host synchronization, also where the host's agreement check was cached."""
    import zlib

    return _flags.wrap32(zlib.crc32(repr((op, tuple(int(v) for v in values))).encode()) | 1)


def post_sig(cur: torch.cuda.Stream, targets: list[tuple[torch.Tensor, int]], epoch: int, stride: int,
             sig: int) -> None:
    """Write ``sig`` into each (flags, region start) of ``targets`` (the peers' shared flags,
    this rank's region in each), in the word of the call's parity, on ``cur`` before the
    push streams fork from it: every push of the call, on any stream, comes after it."""
    off = stride - 1 - (epoch & 1)
    refresh = (epoch & (REFRESH_EVERY - 1)) == 0
    for flags, base in targets:
        _flags.stream_write_value(cur, flags, base + off, sig)
        if refresh:
            # A chunk flag is written only by calls that use that chunk; one left alone for
            # 2**31 calls would compare as ahead (and at 2**32 as landed). Once per
            # REFRESH_EVERY calls this sender sets every chunk flag of its region to the
            # previous epoch: no wait of this call or the peer's previous one is released
            # by it (their flags hold that epoch already, or are not read), and a later
            # wait compares against a value at most REFRESH_EVERY calls old.
            prev = _flags.wrap32(epoch - 1)
            for i in range(stride - 2):
                _flags.stream_write_value(cur, flags, base + i, prev)


REFRESH_EVERY = 1 << 24
"""Calls between refreshes of a peer-copy sender's idle chunk flags (``post_sig``)."""


def dtype_code(dtype: torch.dtype) -> int:
    """A number for ``dtype`` that every rank computes alike (for ``check_agree``)."""
    return _agree.dtype_code(dtype)


_EVERY_CALL: list[bool] = []


def every_call_checked() -> bool:
    """``OVERLAP_CHECK_RANKS=every`` (read on the first call): check the ranks' agreement
    on every call, not once per signature (a blocking all-gather per call; for debugging)."""
    if not _EVERY_CALL:
        import os

        _EVERY_CALL.append(os.environ.get("OVERLAP_CHECK_RANKS", "").strip().lower() == "every")
    return _EVERY_CALL[0]


AGREED_CAP = 1024
"""Agreement keys a runtime remembers (``check_agree``)."""


def check_agree(rt: Runtime, op: str, names: tuple[str, ...], values: tuple[int, ...],
                rows_at: int | None = None) -> None:
    """The call's agreement point on the tile-flag path (``overlap.ops._agree``): sizes that
    must agree across the group's ranks (else NCCL sizes disagree and peers hang). Checked
    with a tiny blocking all-gather on torch's group the first time a key is seen; the
    exchange also carries every rank's verdict, the group's call counter and the calling
    thread, and a rank that disagrees (or refused the call) makes every rank raise.

    ``rows_at``: the index in ``values`` of the row count (M or M/R), which enters the
    key by its bucket (``overlap.policies.row_bucket``): a new M in a bucket seen before
    costs no collective, so a server whose M changes every call pays the check once per
    bucket. What is compared when the check runs is every value, M included. Between
    checks, ranks that pass different M of one bucket are caught on the peer-copy
    transport by the kernels' signature comparison (``RanksDisagreeError``); on the NCCL
    transport they are not: where the NCCL calls then differ in size (the all-reduce ops)
    a flag timeout, bounded; where they match (the all-gather and the reduce-scatter send
    their bucket's chunks whole) a wrong result (docs/guarantees.md, "NCCL transport").
    ``OVERLAP_CHECK_RANKS=every`` checks every call."""
    key = agree_key(op, names, values, rows_at)
    agreed = rt.cache("agreed", AGREED_CAP)
    if capturing():
        if not agreed.get(key):
            raise OverlapCaptureError(f"{op}: the call {dict(zip(names, values))} has not run outside a CUDA graph "
                                      "capture yet; call it once with the same shapes before capturing it")
        _agree.count_call(rt.group)  # counted as its eager call was; never an exchange in a capture
        return
    _agree.agreement(rt.group, rt.world, rt.device, op, names, values, agreed=agreed, key=key,
                     every=every_call_checked(), then_collective=False)


def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> Any:
    """torch's all-gather into one tensor: ``all_gather_single`` where torch has it,
    else ``all_gather_into_tensor`` (deprecated from torch 2.13 on, warning on every call)."""
    import torch.distributed as tdist

    fn = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
    return fn(out, inp, group=group)


def gather_ints(group: Any, world: int, values: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's ``values`` (same length everywhere), in group rank order; collective,
    synchronizes. Uses ``all_gather_single`` where torch has it (``all_gather_into_tensor``
    is deprecated from torch 2.13 on and warns on every call)."""
    import torch.distributed as tdist

    n = len(values)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    alls = torch.empty(world * n, dtype=torch.int64, device=device)
    all_gather_single(alls, mine, group=group)
    return alls.view(world, n).tolist()


def refuse_grad(op: str, *tensors: Any) -> None:
    """Raise if autograd would track a result of ``op``, which has no backward yet: a
    result silently detached from the graph would train wrong."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(f"{op}: an input requires grad, and this op has no backward yet; call it under "
                           "torch.no_grad() or on detached inputs (the overlap.nn layers carry the backward)")


def agree_on_reference(group: Any, op: str, names: tuple[str, ...], values: tuple[int, ...],
                       device: torch.device) -> None:
    """The ranks' agreement on a call the op sends to its reference path (a plain
    collective, where sizes that differ make gloo abort a rank and NCCL hang or
    corrupt): exchanged on every such call (a small all-gather; the reference path is
    not the fast path) with every rank's verdict and the group's call counter
    (``overlap.ops._agree``), every rank raising the same error. The reference's data
    collective follows it (``_agree.collective_done``). Not inside a capture."""
    import torch.distributed as tdist

    if capturing():
        return
    if tdist.get_rank(group) < 0:
        raise ValueError(f"{op}: this process (global rank {tdist.get_rank()}) is not in the group "
                         f"{tdist.get_process_group_ranks(group)}")
    world = tdist.get_world_size(group)
    if world == 1:
        return
    dev = device if tdist.get_backend(group) == "nccl" else torch.device("cpu")
    _agree.agreement(group, world, dev, op, names, values, then_collective=True)


def agree_key(op: str, names: tuple[str, ...], values: tuple[int, ...], rows_at: int | None = None) -> tuple:
    """The key under which ``check_agree`` remembers an agreement (the row count by its bucket)."""
    if rows_at is not None:
        from ..policies import row_bucket

        values = values[:rows_at] + (-row_bucket(values[rows_at]),) + values[rows_at + 1:]
    return (op, names, values)


def check_agreed(rt: Runtime, op: str, names: tuple[str, ...], values: tuple[int, ...], key: tuple) -> None:
    """``check_agree`` with its key made (``agree_key``), outside a capture: a call plan's
    agreement point (a capture takes the full path, which checks it there). A key agreed
    before takes ``_agree.agreed_before`` (one frame)."""
    agreed = rt._caches.get("agreed")
    if agreed is not None and _EVERY_CALL and not _EVERY_CALL[0] and _agree.agreed_before(agreed, rt.world, key):
        return
    _agree.agreement(rt.group, rt.world, rt.device, op, names, values, agreed=rt.cache("agreed", AGREED_CAP),
                     key=key, every=every_call_checked(), then_collective=False)
