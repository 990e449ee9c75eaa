"""A call plan per signature: what a fused op decides once for calls that look alike.

The first call of an op at a signature (its inputs' shapes, strides, dtypes and device,
its options, its resolved config and transport, on one runtime) runs the op's checks and
decisions in full and, once the call has returned, records them as a ``CallPlan``: the
values the ranks agree on, the capture signature, the path and reason the report counts.
A later call of that signature finds the plan by one tuple of its inputs' attributes and
goes straight to the agreement point (``check_agree``: the call counted, the key found)
and the op's fused body::

    first call   checks -> runtime -> tuned pick -> transport -> chunks -> agree -> fused body
                                                                      \\-> CallPlan (on success)
    later calls  key -> CallPlan -> agree (counted) -> fused body

Still looked at on every call: the inputs' types and autograd (a refusal takes the full
path, which raises), a CUDA graph capture (the full path: it checks that the signature
ran eagerly), the tuned pick and the transport (a tuner run or ``OVERLAP_TRANSPORT`` may
change either between calls; both enter the key), and the inputs' 16-byte alignment
(what TMA needs of a pointer; an unaligned one takes the full path, which refuses it).
Everything else the full path checks is a function of the key.
"""

from __future__ import annotations

from typing import Any

import torch

from ._runtime import LRU, Runtime, check_agree, observed

__all__ = ["CallPlan", "call_plans", "find", "keep", "run_planned", "aligned", "tensor_key", "grad_refused", "stats"]

stats: dict[str, int] = {"made": 0, "planned": 0}
"""Call plans made, and calls that ran from one (proof that the short path ran)."""

CALLS_CAP = 256
"""Call plans a runtime keeps per op (the most recently used)."""


class CallPlan:
    """What the full path of one op decided for one signature (see the module docstring)."""

    __slots__ = ("op", "names", "values", "rows_at", "sig", "shape", "path", "why", "config", "transport")

    def __init__(self, op: str, names: tuple[str, ...], values: tuple[int, ...], rows_at: int | None, sig: tuple,
                 shape: tuple[int, ...], path: str, why: str, config: Any, transport: str) -> None:
        self.op, self.names, self.values, self.rows_at, self.sig = op, names, values, rows_at, sig
        self.shape, self.path, self.why, self.config, self.transport = shape, path, why, config, transport

    def __repr__(self) -> str:
        agreed = ", ".join(f"{n}={v}" for n, v in zip(self.names, self.values))
        return (f"CallPlan({self.op} {'x'.join(str(x) for x in self.shape)} on {self.path} ({self.why}); "
                f"ranks agree on {agreed})")


def call_plans(rt: Runtime, op: str) -> LRU:
    """The call plans of ``op`` on ``rt`` by signature key."""
    return rt.cache(f"{op}.calls", CALLS_CAP)


def find(rt: Runtime, op: str, key: tuple) -> CallPlan | None:
    """The plan of ``key`` for ``op`` on ``rt``, or None (also for a key that cannot be
    hashed: a config holding a list, which then always takes the full path)."""
    try:
        return call_plans(rt, op).get(key)
    except TypeError:
        return None


def keep(rt: Runtime, key: tuple, cp: CallPlan) -> None:
    """Remember ``cp`` under ``key`` (a call of its signature has returned); an unhashable
    key is not kept."""
    try:
        call_plans(rt, cp.op)[key] = cp
    except TypeError:
        return
    stats["made"] += 1


def run_planned(rt: Runtime, cp: CallPlan, fn: Any, *args: Any) -> Any:
    """One call of ``cp.op`` as the full path ends it, the same steps in the same order: the
    agreement point, then ``fn(*args)`` observed, then the signature remembered as run
    eagerly (for a later capture)."""
    check_agree(rt, cp.op, cp.names, cp.values, rows_at=cp.rows_at)
    return rt.mark_warm(cp.op, cp.sig, observed(cp.op, cp.shape, cp.path, cp.why, rt.device, fn, *args))


def aligned(*ts: torch.Tensor | None) -> bool:
    """Every tensor given starts on a 16-byte boundary (what TMA and the cached launches need)."""
    for t in ts:
        if t is not None and t.data_ptr() % 16:
            return False
    return True


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """What the full path's checks read of an optional tensor: shape, strides, dtype, device."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def grad_refused(*ts: torch.Tensor | None) -> bool:
    """Autograd would track a result of these inputs (the full path then refuses the call)."""
    if not torch.is_grad_enabled():
        return False
    for t in ts:
        if t is not None and t.requires_grad:
            return True
    return False
