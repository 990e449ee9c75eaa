"""N-D inputs, any gather / scatter dim and several weights for the top-level ops.

The fused ops work on row-major 2-D operands: ``all_gather`` concatenates the ranks'
rows, ``reduce_scatter`` hands rank r the r-th block of rows. An activation of shape
``[B, T, C]`` sharded (or to be scattered) along T (``dim=1``) becomes rows by moving T
first and flattening: ``x.movedim(dim, 0).reshape(-1, C)`` holds rank r's tokens as one
contiguous block of rows, which is what the 2-D op moves. The result is viewed back:

    all_gather_matmul    [T/R, ..., K] rows -> c [T, ..., N] rows -> c.movedim(0, dim)
    matmul_reduce_scatter [T, ..., K] rows  -> y [T/R, ..., N] rows -> movedim, contiguous

The strides are those of PyTorch's async-TP fallbacks (``torch.distributed.
_symmetric_memory``): an all-gather output is a view of a T-major tensor (as
``torch.matmul(A, B).movedim(0, gather_dim)`` there), a reduce-scatter output is
contiguous (as ``reduce_scatter_tensor`` along a dim there).

Several weights on one gather: given ``fused_many`` (eager calls), the 2-D op takes the
whole list and runs their GEMMs as one grid whose tiles of every weight wait on the same
chunk flags (or, for lists it does not take, falls back itself: docs/ops/compat.md).
Without it (a compiled call: the custom op takes one weight), and on the all-reduce op,
the GEMM of the weight with the most columns (the longest, the first of equals) is the
fused one, its tiles starting as the chunks land; the others read the gathered (reduced,
normed) rows that call returns, with ``torch.matmul``, after it. The input is gathered
once; the outputs come back in the weights' order, each its own tensor.
"""

from __future__ import annotations

import zlib
from typing import Any, Sequence

import torch


def agreed(lead: tuple[int, ...], dim: int | None, what: str = "gather_dim") -> Any:
    """The N-D call's own values for the 2-D op's agreement across ranks (the leading shape,
    and the dim moved first): ranks whose rows match but whose leading shape or dim differ
    would combine rows that do not belong together. A context for the 2-D op's call; eager
    calls only (a compiled call reaches the 2-D custom op, which takes rows)."""
    if torch.compiler.is_compiling():
        import contextlib

        return contextlib.nullcontext()
    from .ops._agree import agree_extra

    code = zlib.crc32(repr(tuple(int(x) for x in lead)).encode())
    if dim is None:
        return agree_extra(("dims", "leading shape"), (len(lead) + 1, code))
    return agree_extra(("dims", what, "leading shape"), (len(lead) + 1, dim, code))


def norm_dim(op: str, dim: int, nd: int, what: str, last_ok: bool = False) -> int:
    """``dim`` in ``[0, nd)``; ValueError for one out of range, or the feature dim."""
    if not -nd <= dim < nd:
        raise ValueError(f"{op}: {what}={dim} is out of range for an input with {nd} dims")
    d = dim % nd
    if d == nd - 1 and not last_ok:
        raise ValueError(f"{op}: {what}={dim} is the feature (last) dim; any other dim can be "
                         f"{'gathered' if what == 'gather_dim' else 'scattered'}")
    return d


def weights(op: str, b: Any, k: int, dtype: torch.dtype, many_ok: bool = True) -> tuple[list[torch.Tensor], bool]:
    """(the weights as a list, whether a list was given); ValueError for bad ones, and for a
    list where the op takes one weight (``many_ok=False``)."""
    many = isinstance(b, (list, tuple))
    if many and not many_ok:
        raise ValueError(f"{op}: b must be one weight [K, N]; a list of weights is taken by the gather ops")
    bs = list(b) if many else [b]
    if not bs:
        raise ValueError(f"{op}: an empty list of weights")
    for i, w in enumerate(bs):
        name = f"b[{i}]" if many else "b"
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise ValueError(f"{op}: {name} must be a 2-D tensor [K, N], got "
                             f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
        if w.shape[0] != k:
            raise ValueError(f"{op}: {name} has {w.shape[0]} rows, the input's last dim is K={k}")
        if w.dtype != dtype:
            raise ValueError(f"{op}: {name} is {w.dtype}, the input is {dtype}")
    return bs, many


def longest(bs: list[torch.Tensor]) -> int:
    """The weight whose GEMM the communication hides behind: the most columns, the first of
    equals."""
    best = 0
    for i in range(1, len(bs)):  # a loop, not max(key=): torch.compile traces this
        if bs[i].shape[1] > bs[best].shape[1]:
            best = i
    return best


def to_rows(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``x`` [..., K] with ``dim`` moved first, as rows [prod(lead), K]; and ``lead``."""
    if dim:
        x = x.movedim(dim, 0)
    lead = tuple(x.shape[:-1])
    return x.reshape(-1, x.shape[-1]), lead


def from_rows(y: torch.Tensor, lead: tuple[int, ...], dim: int) -> torch.Tensor:
    """Rows [prod(lead), N] viewed as ``lead + (N,)`` with the first dim moved to ``dim``."""
    y = y.view(*lead, y.shape[-1])
    return y.movedim(0, dim) if dim else y


def all_gather_matmul(fused: Any, a_shard: torch.Tensor, b: Any, *, gather_dim: int,
                      return_gathered: bool, fused_many: Any = None) -> Any:
    """``fused(rows, b0, need_gathered)`` is the 2-D op; ``fused_many(rows, bs,
    need_gathered)``, where given, the 2-D op on a list of weights (returning the list of
    outputs, and the gathered rows when asked); see the module docstring."""
    op = "all_gather_matmul"
    if not isinstance(a_shard, torch.Tensor) or a_shard.dim() < 2:
        raise ValueError(f"{op}: a_shard must be a tensor of at least 2 dims [..., K], got "
                         f"{tuple(a_shard.shape) if isinstance(a_shard, torch.Tensor) else type(a_shard).__name__}")
    d = norm_dim(op, gather_dim, a_shard.dim(), "gather_dim")
    bs, many = weights(op, b, a_shard.shape[-1], a_shard.dtype)
    rows, lead = to_rows(a_shard, d)
    if len(bs) > 1 and fused_many is not None:
        with agreed(lead, d):
            out = fused_many(rows, bs, return_gathered)
        cs, g = out if return_gathered else (out, None)
    else:
        need_g = return_gathered or len(bs) > 1
        first = longest(bs)
        with agreed(lead, d):
            out = fused(rows, bs[first], need_g)
        c0, g = out if need_g else (out, None)
        cs = [c0 if i == first else g @ w for i, w in enumerate(bs)]
    world = cs[0].shape[0] // rows.shape[0]
    lead_out = (world * lead[0], *lead[1:])
    cs = [from_rows(c, lead_out, d) for c in cs]
    res = cs if many else cs[0]
    if return_gathered:
        return res, from_rows(g, lead_out, d)
    return res


def matmul_reduce_scatter(fused: Any, a: torch.Tensor, b: torch.Tensor, *, scatter_dim: int,
                          reduce_op: str, world: int | None = None) -> torch.Tensor:
    """``fused(rows, b)`` is the 2-D op. ``world``, when the caller knows it (eager calls),
    lets a scattered dim the ranks do not divide raise before any work."""
    op = "matmul_reduce_scatter"
    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"{op}: reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
    if not isinstance(a, torch.Tensor) or a.dim() < 2:
        raise ValueError(f"{op}: a must be a tensor of at least 2 dims [..., K], got "
                         f"{tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__}")
    d = norm_dim(op, scatter_dim, a.dim(), "scatter_dim")
    weights(op, b, a.shape[-1], a.dtype, many_ok=False)

    def check(world: int) -> None:
        if a.shape[d] % world:
            # each rank's block of rows would cut through the scattered dim: the same error on every rank
            raise ValueError(f"{op}: dim {d} of a {tuple(a.shape)} ({a.shape[d]}) is not a multiple of the "
                             f"{world} ranks")

    if world is not None:
        check(world)
    rows, lead = to_rows(a, d)
    with agreed(lead, d, "scatter_dim"):
        y = fused(rows, b)  # raises unless the rows divide by the ranks
    world = rows.shape[0] // y.shape[0]
    check(world)  # (traced calls: after the call, the same on every rank)
    if reduce_op == "avg":
        y = y / world
    y = from_rows(y, (lead[0] // world, *lead[1:]), d)
    return y.contiguous() if d else y


def flat(op: str, x: torch.Tensor, name: str) -> tuple[torch.Tensor, tuple[int, ...]]:
    """[..., K] -> [prod(...), K] and the leading shape."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"{op}: {name} must be a tensor of at least 2 dims [..., K], got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    return x.reshape(-1, x.shape[-1]), tuple(x.shape[:-1])


def like_rows(op: str, t: torch.Tensor | None, lead: tuple[int, ...], name: str) -> torch.Tensor | None:
    """A residual [..., X] with the input's leading shape, as rows."""
    if t is None:
        return None
    if tuple(t.shape[:-1]) != lead:
        raise ValueError(f"{op}: {name} {tuple(t.shape)} does not match the input's leading dims {lead}")
    return t.reshape(-1, t.shape[-1])


def all_reduce_matmul(fused: Any, x_partial: torch.Tensor, b: Any, *, residual: torch.Tensor | None,
                      norm: Any, fused_many: Any = None) -> tuple[Any, torch.Tensor]:
    """``fused(rows, b0, residual_rows)`` is the 2-D op, returning (c, h); ``fused_many(rows,
    bs, residual_rows)``, where given, the 2-D op on a list of weights, returning (the list
    of outputs, h)."""
    op = "all_reduce_matmul"
    x2, lead = flat(op, x_partial, "x_partial")
    bs, many = weights(op, b, x2.shape[1], x2.dtype)
    res2 = like_rows(op, residual, lead, "residual")
    if len(bs) > 1 and fused_many is not None:
        with agreed(lead, None):
            cs, h = fused_many(x2, bs, res2)
        return [c.view(*lead, c.shape[-1]) for c in cs], h.view(*lead, h.shape[-1])
    first = longest(bs)
    with agreed(lead, None):
        c0, h = fused(x2, bs[first], res2)
    if len(bs) > 1:
        y = norm.apply(h) if norm is not None else h
        cs = [c0 if i == first else y @ w for i, w in enumerate(bs)]
    else:
        cs = [c0]
    cs = [c.view(*lead, c.shape[-1]) for c in cs]
    return (cs if many else cs[0]), h.view(*lead, h.shape[-1])


def matmul_all_reduce(fused: Any, a: torch.Tensor, b: torch.Tensor, *, residual: torch.Tensor | None) -> torch.Tensor:
    op = "matmul_all_reduce"
    a2, lead = flat(op, a, "a")
    weights(op, b, a2.shape[1], a2.dtype, many_ok=False)
    res2 = like_rows(op, residual, lead, "residual")
    with agreed(lead, None):
        c = fused(a2, b, res2)
    return c.view(*lead, c.shape[-1])


def simple(x: torch.Tensor, b: Any, dim: int = 0) -> bool:
    """The 2-D, dim 0, one-weight call: straight to the op."""
    return isinstance(x, torch.Tensor) and x.dim() == 2 and dim in (0, -2) and isinstance(b, torch.Tensor)


__all__: Sequence[str] = ("all_gather_matmul", "matmul_reduce_scatter", "all_reduce_matmul", "matmul_all_reduce")
