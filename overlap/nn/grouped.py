"""What an attention / MLP module runs through once ``parallelize`` converted it: its column
layers computed together from one input (one gather, one GEMM grid), the stand-in input
the module sees, and the gradient of replicated key/value heads summed over their copies.

    call of the module        its pre-hook: this call's input kept; the module gets a stand-in
      first column layer      every column layer's output from the input, in one call
      other column layers     take theirs
    its post-hook             nothing of the call kept
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import functional as F
from .layers import ColumnParallelLinear, _SequenceDim

__all__ = ["ColumnGroup", "input_slot", "take_input"]

_SHAPE_OPS: set[Any] = set()


class _StandIn(torch.Tensor):
    """The input an attention module (and under sequence parallelism an MLP) sees: the whole
    sequence's shape (an attention's: its local heads' width), dtype and device, and no
    values (its column layers read the real input, gathering this rank's tokens under
    sequence parallelism). Anything but a shape query raises, naming the module: a module
    that computes on its input other than through its projections cannot be run this way."""

    owner: str

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], like: torch.Tensor, owner: str) -> "_StandIn":
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=like.dtype, device=like.device)
        t.owner = owner
        return t

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not _SHAPE_OPS:
            T = torch.Tensor
            _SHAPE_OPS.update({T.size, T.dim, T.shape.__get__, T.dtype.__get__, T.device.__get__, T.ndim.__get__,
                               T.is_cuda.__get__, T.requires_grad.__get__, T.__repr__, T.layout.__get__})
        if func in _SHAPE_OPS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        owner = next((a.owner for a in args if isinstance(a, _StandIn)), "?")
        raise RuntimeError(f"parallelize: {owner} used its input in {getattr(func, '__name__', func)} other than "
                           "through its projections; only its column layers can read it (they gather this "
                           "rank's tokens under sequence parallelism). Use a plan for this model")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise RuntimeError(f"parallelize(sequence_parallel=True): a stand-in input reached {func}")

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: D105
        return f"StandIn(shape={tuple(self.shape)}, for={self.owner})"


def input_slot(module: nn.Module) -> str | None:
    """The name of ``module.forward``'s first parameter (its input, when passed by keyword)."""
    try:
        ps = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    return ps[0].name if ps and ps[0].kind in (ps[0].POSITIONAL_ONLY, ps[0].POSITIONAL_OR_KEYWORD) else None


def take_input(what: str, slot: str | None, args: tuple, kwargs: dict) -> tuple[torch.Tensor, Callable]:
    """The module's input (first positional, or by keyword) and a function putting a new one in its place."""
    if args:
        x = args[0]
        put = lambda v: ((v, *args[1:]), kwargs)  # noqa: E731
    elif slot is not None and slot in kwargs:
        x = kwargs[slot]
        put = lambda v: (args, {**kwargs, slot: v})  # noqa: E731
    else:
        raise RuntimeError(f"parallelize: {what} was called without its input ({slot!r}) positionally or by keyword")
    if not isinstance(x, torch.Tensor):
        raise RuntimeError(f"parallelize: {what}'s input is {type(x).__name__}, not a tensor")
    return x, put


class ColumnGroup:
    """The column layers of one attention / MLP module (q, k, v; gate, up; or one fused):
    the first one called computes every one's output from the shared input, in one call
    (``all_gather_linear_many`` / ``copy_linear_many``), the others take theirs. The owner's
    hooks open and close each call. Under sequence parallelism the owner's input is this
    rank's tokens and the owner sees a stand-in of the whole sequence's shape; an attention
    module always sees one, ``width`` wide (its local heads' width, which a module sizing
    its output from its input's width, as nanoGPT's ``view(B, T, C)``, needs)."""

    def __init__(self, owner: str, members: list[tuple[str, ColumnParallelLinear]], sp: bool, seq_dim: int,
                 slot: str | None, width: int | None = None) -> None:
        self.owner, self.sp, self.seq_dim, self.slot, self.width = owner, sp, seq_dim, slot, width
        self.members = [m for _, m in members]
        self.names = {id(m): n for n, m in members}
        self._reset()

    def _reset(self) -> None:
        self.shard: torch.Tensor | None = None
        self.stand_in: torch.Tensor | None = None
        self.src: torch.Tensor | None = None
        self.version = -1
        self.outs: dict[int, torch.Tensor] = {}

    def pre_hook(self, _module: nn.Module, args: tuple, kwargs: dict) -> Any:
        self._reset()
        if not self.sp and self.width is None:
            return None
        x, put = take_input(self.owner, self.slot, args, kwargs)
        m0 = self.members[0]
        d = self.seq_dim % x.dim()
        shape = [s * m0.tp_size if i == d and self.sp else s for i, s in enumerate(x.shape)]
        if self.width is not None:
            shape[-1] = self.width
        self.shard, self.stand_in = x, _StandIn(tuple(shape), x, self.owner)
        return put(self.stand_in)

    def post_hook(self, _module: nn.Module, _args: tuple, _kwargs: dict, out: Any) -> Any:
        self._reset()  # nothing of this call kept past it
        return out

    def __call__(self, member: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
        if self.sp or self.width is not None:
            if self.stand_in is None or x is not self.stand_in:
                raise RuntimeError(f"parallelize: {self.names[id(member)]} was called on a tensor other than "
                                   f"{self.owner}'s input; its output would be wrong. Use a plan for this model"
                                   + (" or sequence_parallel=False" if self.sp and self.width is None else ""))
            src = self.shard
        else:
            src = x
        if src is not self.src or src._version != self.version or id(member) not in self.outs:
            self.src, self.version = src, src._version
            self.outs = dict(zip((id(m) for m in self.members), self._compute(src)))
        return self.outs.pop(id(member))

    def _compute(self, x: torch.Tensor) -> list[torch.Tensor]:
        ms = self.members
        m0 = ms[0]
        ws, bs = [_copies(m, m.weight) for m in ms], [_copies(m, m.bias) for m in ms]
        if self.sp:
            x2, lead = _SequenceDim.to_rows(x, self.seq_dim)  # [T/R * ..., K]
            ys = F._AllGatherLinearMany.apply(x2, self._plan(x2, ws), len(ws), *ws, *bs)  # [T * ..., N_i/R]
            full = (m0.tp_size * lead[0], *lead[1:])
            return [_SequenceDim.from_rows(y, full, self.seq_dim) for y in ys]
        lead = x.shape[:-1]
        ys = F._CopyLinearMany.apply(x.reshape(-1, x.shape[-1]), self._plan(x, ws), len(ws), *ws,
                                     *bs)  # [tokens, N_i/R]
        return [y.view(*lead, y.shape[-1]) for y in ys]

    def _plan(self, x2: torch.Tensor, ws: list[torch.Tensor]) -> F._Plan:
        """The first member's call plan for the group's call (``save_gathered`` "auto" on the
        members' summed output features), kept with the member's own plans."""
        m0 = self.members[0]
        n, save = sum(w.shape[0] for w in ws), m0.save_gathered
        auto = self.sp and save == "auto"

        def make() -> F._Plan:
            keep = save
            if auto:
                world = m0.tp_size
                keep = not F.regather_plan(world * x2.shape[0], n, x2.shape[-1], world, x2.dtype).regather
            F._check_save_gathered(keep)
            return F._Plan(m0.group, m0.overlap, m0.config, save_gathered=keep, world=m0.tp_size)

        return m0._plans.get(lambda: ("many", x2.shape[0] if auto else None, x2.dtype, n, m0.overlap,
                                      id(m0.config), save), m0.config, make)


def _copies(m: ColumnParallelLinear, p: torch.Tensor | None) -> torch.Tensor | None:
    """``p``, with the gradient of its replicated key/value rows (if any) summed over their copies."""
    shared = getattr(m, "shared_rows", None)
    if p is None or shared is None:
        return p
    return _SumOverCopies.apply(p, shared[0], shared[1], shared[2], m.group)


class _SumOverCopies(torch.autograd.Function):
    """forward: identity; backward: the rows of replicated key/value heads summed over the
    ranks that hold the same head (each one's gradient covers only its own query heads)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, rows: torch.Tensor, head: int, heads: int, group: Any) -> torch.Tensor:
        ctx.rows, ctx.head, ctx.heads, ctx.group = rows, head, heads, group
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        import torch.distributed as tdist

        rows = ctx.rows.to(g.device)
        full = g.new_zeros((ctx.heads, len(rows), *g.shape[1:]))  # [kv heads, rows, ...]
        full[ctx.head] = g[rows]
        tdist.all_reduce(full, group=ctx.group)  # one slot per head: the sum over its ranks
        g = g.clone()
        g[rows] = full[ctx.head]
        return g, None, None, None, None
