"""The public ops as ``torch.library`` custom ops, so ``torch.compile`` traces them whole.

    overlap.all_gather_matmul(...)   eager: overlap.ops.all_gather_matmul(...)
                                     compiling: torch.ops.overlap.all_gather_matmul(...)
    (the same for all_reduce_matmul and mlp_chain)

Eager calls go straight to the Python op: these ops are host-bound at small shapes,
and the dispatcher's round trip through a custom op would add to every call. Under
``torch.compile`` the wrapper calls the custom op instead, whose fake implementation
gives Dynamo and AOTAutograd the output shapes without running anything.

A schema holds only tensors and scalars, so the wrapper flattens what the op takes:

    group      -> its name (``group.group_name``; "" for None: the op's default group)
    config     -> an int id into a table of interned configs (0 for None)
    Norm       -> kind, weight, bias, eps as separate optional arguments

None of the ops has a backward yet: with grad mode on, a tensor input that requires
grad raises at forward time (the wrapper in eager; the custom op while compiling).
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch

from . import _shapes
from .ops import all_gather as _ag
from .ops import all_reduce as _ar
from .ops import boundary as _boundary
from .ops import chain as _chain
from .ops import matmul_reduce as _mr
from .ops._agree import raise_in_step as _raise_in_step
from .ops._agree import step_of as _step_of
from .ops._runtime import resolve_group as _resolve_default
from .ops import ChainConfig, Norm, OverlapConfig

__all__ = ["all_gather_matmul", "all_reduce_matmul", "mlp_chain", "matmul_reduce_scatter", "matmul_all_reduce",
           "matmul_all_reduce_matmul", "config_id", "config_for"]

# bound once: the eager wrappers' whole cost is these calls and a few attribute reads
# (Dynamo knows is_compiling by the function, not by the name it is called through)
_ag_impl = _ag.all_gather_matmul
_ar_impl = _ar.all_reduce_matmul
_chain_impl = _chain._mlp_chain  # with the test hooks, which the custom op's schema carries
_chain_eager = _chain.mlp_chain  # (a planned call first: its call plan, its plan graph)
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


def _no_backward(op: str) -> RuntimeError:
    return RuntimeError(
        f"overlap.{op}: an input requires grad, but {op} has no backward yet; call it under "
        "torch.no_grad() (or with inputs that do not require grad). The overlap.nn layers "
        "will carry the backward.")


# ---- configs as ints ------------------------------------------------------------------

_configs: list[Any] = [None]
_config_ids: dict[Any, int] = {}
_config_lock = threading.Lock()


def config_id(config: Any) -> int:
    """``_configs.index(config)``, appending it first if new (0 for None)."""
    if config is None:
        return 0
    with _config_lock:
        try:
            i = _config_ids.get(config)
        except TypeError:  # an unhashable config (a field holding a list): by identity
            i = next((j for j, c in enumerate(_configs) if c is config), None)
            if i is None:
                _configs.append(config)
                i = len(_configs) - 1
            return i
        if i is None:
            _configs.append(config)
            i = _config_ids[config] = len(_configs) - 1
        return i


# Dynamo runs config_id while tracing and puts its result in the graph as a constant
# (what torch.compiler.assume_constant_result sets, without importing torch._dynamo and
# with it triton at ``import overlap``). Traced instead, the table's append would be
# replayed only after the graph ran, and the op would look up an id not there yet.
config_id._dynamo_marked_constant = True  # type: ignore[attr-defined]


def config_for(i: int) -> Any:
    """``_configs[i]``: the config that ``config_id`` gave id ``i``."""
    return _configs[i]


# ---- groups as names ------------------------------------------------------------------

def _group_name(group: Any) -> str:
    return "" if group is None else group.group_name


def _group(name: str) -> Any:
    """The group named ``name``; None ("": the op's default, ``resolve_group(None)``)."""
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _world_size(name: str) -> int:
    import torch.distributed as tdist

    return tdist.get_world_size(_resolve_default(_group(name)))


def _refuse_grad(op: str, *ts: Any) -> None:
    if _grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in ts):
        raise _no_backward(op)


def _nd_call(group: Any, op: str, fn: Any, x: Any = None) -> Any:
    """``fn()``, an N-D wrapper's call: eager, inside the op's step on the group, so that a
    refusal of the wrapper's own checks (a dim, a weight) reaches the peers as the op's do
    (``overlap.ops._agree``); compiling, as it is."""
    if _compiling():
        return fn()
    with _step_of(group, op, x):
        return fn()


def _forward_only(op: Any, name: str) -> None:
    """Raise at forward time (setup_context runs as the op's forward returns, before any
    graph is built on it) when autograd would have to record the op."""

    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        raise _no_backward(name)

    def backward(ctx: Any, *grads: Any) -> Any:
        raise _no_backward(name)

    op.register_autograd(backward, setup_context=setup_context)


# ---- all_gather_matmul ----------------------------------------------------------------

@torch.library.custom_op("overlap::all_gather_matmul", mutates_args=())
def _all_gather_matmul_op(a_shard: torch.Tensor, b: torch.Tensor, group_name: str, return_gathered: bool,
                          config: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(all_gather(a_shard) @ b, all_gather(a_shard) or an empty tensor)``."""
    out = _ag_impl(a_shard, b, group=_group(group_name), return_gathered=return_gathered, config=_configs[config])
    return out if return_gathered else (out, a_shard.new_empty(0))


@_all_gather_matmul_op.register_fake
def _(a_shard: torch.Tensor, b: torch.Tensor, group_name: str, return_gathered: bool,
      config: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(a_shard.dim() == 2 and b.dim() == 2, lambda: "all_gather_matmul: a_shard and b must be 2-D")
    torch._check(a_shard.shape[1] == b.shape[0],
                 lambda: f"all_gather_matmul: K mismatch, a_shard {a_shard.shape}, b {b.shape}")
    m = _world_size(group_name) * a_shard.shape[0]
    c = a_shard.new_empty((m, b.shape[1]))
    return c, a_shard.new_empty((m, a_shard.shape[1]) if return_gathered else (0,))


_forward_only(_all_gather_matmul_op, "all_gather_matmul")


@torch.library.custom_op("overlap::all_gather_matmul_many", mutates_args=())
def _all_gather_matmul_many_op(a_shard: torch.Tensor, bs: list[torch.Tensor], group_name: str,
                               return_gathered: bool, config: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``([all_gather(a_shard) @ b for b in bs], all_gather(a_shard) or an empty tensor)``:
    one gather, one grid over the weights' GEMMs (``overlap.ops.all_gather_matmul`` with a list)."""
    out = _ag_impl(a_shard, list(bs), group=_group(group_name), return_gathered=return_gathered,
                   config=_configs[config])
    cs, gathered = out if return_gathered else (out, a_shard.new_empty(0))
    # outputs may not alias each other or the inputs (a custom op's contract): each its own tensor
    return [c.clone() if any(c is x for x in bs) else c for c in cs], gathered


@_all_gather_matmul_many_op.register_fake
def _(a_shard: torch.Tensor, bs: list[torch.Tensor], group_name: str, return_gathered: bool,
      config: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    torch._check(a_shard.dim() == 2 and len(bs) > 0 and all(b.dim() == 2 for b in bs),
                 lambda: "all_gather_matmul: a_shard and each weight must be 2-D, and the list not empty")
    for b in bs:
        torch._check(a_shard.shape[1] == b.shape[0],
                     lambda: f"all_gather_matmul: K mismatch, a_shard {a_shard.shape}, b {b.shape}")
    m = _world_size(group_name) * a_shard.shape[0]
    return ([a_shard.new_empty((m, b.shape[1])) for b in bs],
            a_shard.new_empty((m, a_shard.shape[1]) if return_gathered else (0,)))


_forward_only(_all_gather_matmul_many_op, "all_gather_matmul")


def all_gather_matmul(a_shard: torch.Tensor, b: Any, *, group: Any = None, return_gathered: bool = False,
                      config: OverlapConfig | None = None, gather_dim: int = 0) -> Any:
    """``all_gather(a_shard, dim=gather_dim) @ b``: ``overlap.ops.all_gather_matmul``, traceable by
    torch.compile. ``a_shard`` [..., K] with any ``gather_dim`` but the last; ``b`` [K, N] or a
    list of such weights (one gather; a list of outputs). See ``overlap._shapes``."""
    if not _shapes.simple(a_shard, b, gather_dim):
        # a list of weights goes to the op whole (one grid over their GEMMs); compiled, through
        # the list-taking custom op
        def many(rows: torch.Tensor, bs: list[torch.Tensor], need_g: bool) -> Any:
            if _compiling():
                cs, g = _all_gather_matmul_many_op(rows, bs, _group_name(group), need_g, config_id(config))
                return (cs, g) if need_g else cs
            return _ag_impl(rows, bs, group=group, return_gathered=need_g, config=config)

        def nd() -> Any:
            _refuse_grad("all_gather_matmul", a_shard, *(b if isinstance(b, (list, tuple)) else [b]))
            return _shapes.all_gather_matmul(
                lambda rows, b0, need_g: all_gather_matmul(rows, b0, group=group, return_gathered=need_g,
                                                           config=config),
                a_shard, b, gather_dim=gather_dim, return_gathered=return_gathered, fused_many=many)

        return _nd_call(group, "all_gather_matmul", nd, a_shard)
    if _compiling():
        c, gathered = _all_gather_matmul_op(a_shard, b, _group_name(group), return_gathered, config_id(config))
        return (c, gathered) if return_gathered else c
    if (a_shard.requires_grad or b.requires_grad) and _grad_enabled():
        _raise_in_step(group, "all_gather_matmul", _no_backward("all_gather_matmul"), a_shard)
    return _ag_impl(a_shard, b, group=group, return_gathered=return_gathered, config=config)


# ---- all_reduce_matmul ----------------------------------------------------------------

@torch.library.custom_op("overlap::all_reduce_matmul", mutates_args=())
def _all_reduce_matmul_op(x_partial: torch.Tensor, b: torch.Tensor, group_name: str,
                          residual: Optional[torch.Tensor], norm_kind: Optional[str],
                          norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor], norm_eps: float,
                          config: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(all_reduce(x_partial) + residual) @ b, all_reduce(x_partial) + residual)``."""
    norm = None if norm_kind is None else Norm(norm_kind, norm_weight, norm_bias, norm_eps)
    return _ar_impl(x_partial, b, group=_group(group_name), residual=residual, norm=norm, config=_configs[config])


@_all_reduce_matmul_op.register_fake
def _(x_partial: torch.Tensor, b: torch.Tensor, group_name: str, residual: Optional[torch.Tensor],
      norm_kind: Optional[str], norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor],
      norm_eps: float, config: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(x_partial.dim() == 2 and b.dim() == 2, lambda: "all_reduce_matmul: x_partial and b must be 2-D")
    torch._check(x_partial.shape[1] == b.shape[0],
                 lambda: f"all_reduce_matmul: K mismatch, x_partial {x_partial.shape}, b {b.shape}")
    m, k = x_partial.shape
    return x_partial.new_empty((m, b.shape[1])), x_partial.new_empty((m, k))


_forward_only(_all_reduce_matmul_op, "all_reduce_matmul")


@torch.library.custom_op("overlap::all_reduce_matmul_many", mutates_args=())
def _all_reduce_matmul_many_op(x_partial: torch.Tensor, bs: list[torch.Tensor], group_name: str,
                               residual: Optional[torch.Tensor], norm_kind: Optional[str],
                               norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor],
                               norm_eps: float, config: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``([norm(h) @ b for b in bs], h)``, ``h = all_reduce(x_partial) + residual``: one
    all-reduce and norm, one grid over the weights' GEMMs."""
    norm = None if norm_kind is None else Norm(norm_kind, norm_weight, norm_bias, norm_eps)
    cs, h = _ar_impl(x_partial, list(bs), group=_group(group_name), residual=residual, norm=norm,
                     config=_configs[config])
    return list(cs), h


@_all_reduce_matmul_many_op.register_fake
def _(x_partial: torch.Tensor, bs: list[torch.Tensor], group_name: str, residual: Optional[torch.Tensor],
      norm_kind: Optional[str], norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor],
      norm_eps: float, config: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    torch._check(x_partial.dim() == 2 and len(bs) > 0 and all(b.dim() == 2 for b in bs),
                 lambda: "all_reduce_matmul: x_partial and each weight must be 2-D, and the list not empty")
    for b in bs:
        torch._check(x_partial.shape[1] == b.shape[0],
                     lambda: f"all_reduce_matmul: K mismatch, x_partial {x_partial.shape}, b {b.shape}")
    m, k = x_partial.shape
    return [x_partial.new_empty((m, b.shape[1])) for b in bs], x_partial.new_empty((m, k))


_forward_only(_all_reduce_matmul_many_op, "all_reduce_matmul")


def all_reduce_matmul(x_partial: torch.Tensor, b: Any, *, group: Any = None,
                      residual: torch.Tensor | None = None, norm: Norm | None = None,
                      config: OverlapConfig | None = None) -> tuple[Any, torch.Tensor]:
    """``h = all_reduce(x_partial) (+ residual); return norm(h) @ b, h``: ``overlap.ops.all_reduce_matmul``,
    traceable by torch.compile. ``x_partial`` [..., K]; ``b`` [K, N] or a list of such weights
    (one all-reduce and norm; a list of outputs)."""
    if not _shapes.simple(x_partial, b):

        # a list of weights goes to the op whole (one all-reduce and norm, one grid over the
        # GEMMs); compiled, through the list-taking custom op
        def many(rows: torch.Tensor, bs: list[torch.Tensor], res: torch.Tensor | None) -> Any:
            if _compiling():
                kind, w, bias, eps = (None, None, None, 0.0) if norm is None else (
                    norm.kind, norm.weight, norm.bias, float(norm.eps))
                return _all_reduce_matmul_many_op(rows, bs, _group_name(group), res, kind, w, bias, eps,
                                                  config_id(config))
            return _ar_impl(rows, bs, group=group, residual=res, norm=norm, config=config)

        def nd() -> Any:
            _refuse_grad("all_reduce_matmul", *(b if isinstance(b, (list, tuple)) else [b]))
            return _shapes.all_reduce_matmul(
                lambda rows, b0, res: all_reduce_matmul(rows, b0, group=group, residual=res, norm=norm,
                                                        config=config),
                x_partial, b, residual=residual, norm=norm, fused_many=many)

        return _nd_call(group, "all_reduce_matmul", nd, x_partial)
    if _compiling():
        if norm is None:
            return _all_reduce_matmul_op(x_partial, b, _group_name(group), residual, None, None, None, 0.0,
                                         config_id(config))
        return _all_reduce_matmul_op(x_partial, b, _group_name(group), residual, norm.kind, norm.weight, norm.bias,
                                     float(norm.eps), config_id(config))
    if (x_partial.requires_grad or b.requires_grad or (residual is not None and residual.requires_grad)
            or (norm is not None and (norm.weight.requires_grad
                                      or (norm.bias is not None and norm.bias.requires_grad)))) and _grad_enabled():
        _raise_in_step(group, "all_reduce_matmul", _no_backward("all_reduce_matmul"), x_partial)
    return _ar_impl(x_partial, b, group=group, residual=residual, norm=norm, config=config)


# ---- mlp_chain ------------------------------------------------------------------------

@torch.library.custom_op("overlap::mlp_chain", mutates_args=())
def _mlp_chain_op(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation: Optional[str], config: int,
                  sync: Optional[str], consumer_first: bool, producer_delay_cycles: int) -> torch.Tensor:
    """``act(x @ w1) @ w2``."""
    return _chain_impl(x, w1, w2, activation=activation, config=_configs[config], sync=sync,
                       consumer_first=consumer_first, producer_delay_cycles=producer_delay_cycles)


@_mlp_chain_op.register_fake
def _(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation: Optional[str], config: int,
      sync: Optional[str], consumer_first: bool, producer_delay_cycles: int) -> torch.Tensor:
    torch._check(x.dim() == 2 and w1.dim() == 2 and w2.dim() == 2, lambda: "mlp_chain: x, w1, w2 must be 2-D")
    torch._check(x.shape[1] == w1.shape[0], lambda: f"mlp_chain: K mismatch, x {x.shape}, w1 {w1.shape}")
    torch._check(w1.shape[1] == w2.shape[0], lambda: f"mlp_chain: F mismatch, w1 {w1.shape}, w2 {w2.shape}")
    return x.new_empty((x.shape[0], w2.shape[1]))


_forward_only(_mlp_chain_op, "mlp_chain")


def mlp_chain(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *, activation: str | None = "gelu",
              config: ChainConfig | None = None, sync: str | None = None) -> torch.Tensor:
    """``act(x @ w1) @ w2``: ``overlap.ops.mlp_chain``, traceable by torch.compile."""
    if _compiling():
        # the schema's last two: the test hooks of ``overlap.ops.chain._mlp_chain``, off
        return _mlp_chain_op(x, w1, w2, activation, config_id(config), sync, False, 0)
    if (x.requires_grad or w1.requires_grad or w2.requires_grad) and _grad_enabled():
        raise _no_backward("mlp_chain")
    return _chain_eager(x, w1, w2, activation=activation, config=config, sync=sync)



# ---- matmul_reduce_scatter / matmul_all_reduce ------------------------------------------

@torch.library.custom_op("overlap::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter_op(a: torch.Tensor, b: torch.Tensor, group_name: str, config: int) -> torch.Tensor:
    """``reduce_scatter(a @ b, dim=0)``."""
    return _mr.matmul_reduce_scatter(a, b, group=_group(group_name), config=_configs[config])


@_matmul_reduce_scatter_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, group_name: str, config: int) -> torch.Tensor:
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "matmul_reduce_scatter: a and b must be 2-D")
    torch._check(a.shape[1] == b.shape[0], lambda: f"matmul_reduce_scatter: K mismatch, a {a.shape}, b {b.shape}")
    world = _world_size(group_name)
    return a.new_empty((a.shape[0] // world, b.shape[1]))


_forward_only(_matmul_reduce_scatter_op, "matmul_reduce_scatter")


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, *, group: Any = None,
                          config: OverlapConfig | None = None, scatter_dim: int = 0,
                          reduce_op: str = "sum") -> torch.Tensor:
    """``reduce_scatter(a @ b, dim=scatter_dim)`` (``reduce_op`` "sum" or "avg"):
    ``overlap.ops.matmul_reduce_scatter``, traceable by torch.compile. ``a`` [..., K] with any
    ``scatter_dim`` but the last."""
    if reduce_op != "sum" or not _shapes.simple(a, b, scatter_dim):
        return _nd_call(group, "matmul_reduce_scatter", lambda: _shapes.matmul_reduce_scatter(
            lambda rows, b0: matmul_reduce_scatter(rows, b0, group=group, config=config),
            a, b, scatter_dim=scatter_dim, reduce_op=reduce_op,
            world=None if _compiling() else _world_size(_group_name(group))), a)
    if _compiling():
        return _matmul_reduce_scatter_op(a, b, _group_name(group), config_id(config))
    if (a.requires_grad or b.requires_grad) and _grad_enabled():
        _raise_in_step(group, "matmul_reduce_scatter", _no_backward("matmul_reduce_scatter"), a)
    return _mr.matmul_reduce_scatter(a, b, group=group, config=config)


@torch.library.custom_op("overlap::matmul_all_reduce", mutates_args=())
def _matmul_all_reduce_op(a: torch.Tensor, b: torch.Tensor, group_name: str, residual: Optional[torch.Tensor],
                          config: int) -> torch.Tensor:
    """``all_reduce(a @ b) (+ residual)``."""
    return _mr.matmul_all_reduce(a, b, group=_group(group_name), residual=residual, config=_configs[config])


@_matmul_all_reduce_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, group_name: str, residual: Optional[torch.Tensor],
      config: int) -> torch.Tensor:
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "matmul_all_reduce: a and b must be 2-D")
    torch._check(a.shape[1] == b.shape[0], lambda: f"matmul_all_reduce: K mismatch, a {a.shape}, b {b.shape}")
    return a.new_empty((a.shape[0], b.shape[1]))


_forward_only(_matmul_all_reduce_op, "matmul_all_reduce")


def matmul_all_reduce(a: torch.Tensor, b: torch.Tensor, *, group: Any = None, residual: torch.Tensor | None = None,
                      config: OverlapConfig | None = None) -> torch.Tensor:
    """``all_reduce(a @ b) (+ residual)``: ``overlap.ops.matmul_all_reduce``, traceable by torch.compile.
    ``a`` [..., K], ``residual`` [..., N]."""
    if not isinstance(a, torch.Tensor) or a.dim() != 2 or not isinstance(b, torch.Tensor):
        return _nd_call(group, "matmul_all_reduce", lambda: _shapes.matmul_all_reduce(
            lambda rows, b0, res: matmul_all_reduce(rows, b0, group=group, residual=res, config=config),
            a, b, residual=residual), a)
    if _compiling():
        return _matmul_all_reduce_op(a, b, _group_name(group), residual, config_id(config))
    if (a.requires_grad or b.requires_grad or (residual is not None and residual.requires_grad)) and _grad_enabled():
        _raise_in_step(group, "matmul_all_reduce", _no_backward("matmul_all_reduce"), a)
    return _mr.matmul_all_reduce(a, b, group=group, residual=residual, config=config)


# ---- matmul_all_reduce_matmul (the block boundary) ----------------------------------------

@torch.library.custom_op("overlap::matmul_all_reduce_matmul", mutates_args=())
def _matmul_all_reduce_matmul_op(a: torch.Tensor, b: torch.Tensor, b_next: torch.Tensor, group_name: str,
                                 residual: Optional[torch.Tensor], norm_kind: Optional[str],
                                 norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor],
                                 norm_eps: float, config: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(h) @ b_next, h)`` with ``h = all_reduce(a @ b) (+ residual)``."""
    norm = None if norm_kind is None else Norm(norm_kind, norm_weight, norm_bias, norm_eps)
    return _boundary.matmul_all_reduce_matmul(a, b, b_next, group=_group(group_name), residual=residual, norm=norm,
                                              config=_configs[config])


@_matmul_all_reduce_matmul_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, b_next: torch.Tensor, group_name: str, residual: Optional[torch.Tensor],
      norm_kind: Optional[str], norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor],
      norm_eps: float, config: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(a.dim() == 2 and b.dim() == 2 and b_next.dim() == 2,
                 lambda: "matmul_all_reduce_matmul: a, b and b_next must be 2-D")
    torch._check(a.shape[1] == b.shape[0] and b.shape[1] == b_next.shape[0],
                 lambda: f"matmul_all_reduce_matmul: shapes a {a.shape}, b {b.shape}, b_next {b_next.shape}")
    return a.new_empty((a.shape[0], b_next.shape[1])), a.new_empty((a.shape[0], b.shape[1]))


_forward_only(_matmul_all_reduce_matmul_op, "matmul_all_reduce_matmul")


def matmul_all_reduce_matmul(a: torch.Tensor, b: torch.Tensor, b_next: torch.Tensor, *, group: Any = None,
                             residual: torch.Tensor | None = None, norm: Any = None,
                             config: OverlapConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = all_reduce(a @ b) (+ residual); return norm(h) @ b_next, h``: the block boundary as one
    pipeline, ``overlap.ops.matmul_all_reduce_matmul``, traceable by torch.compile."""
    if _compiling():
        if norm is None:
            return _matmul_all_reduce_matmul_op(a, b, b_next, _group_name(group), residual, None, None, None, 0.0,
                                                config_id(config))
        return _matmul_all_reduce_matmul_op(a, b, b_next, _group_name(group), residual, norm.kind, norm.weight,
                                            norm.bias, float(norm.eps), config_id(config))
    try:
        _refuse_grad("matmul_all_reduce_matmul", a, b, b_next, residual,
                     *(() if norm is None else (norm.weight, norm.bias)))
    except RuntimeError as e:
        _raise_in_step(group, "matmul_all_reduce_matmul", e)
    return _boundary.matmul_all_reduce_matmul(a, b, b_next, group=group, residual=residual, norm=norm, config=config)
