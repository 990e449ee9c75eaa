"""Drop-in for PyTorch's async-TP ops (``torch.ops.symm_mem.*``), with their schemas.

Code written for PyTorch's async tensor parallelism switches by changing the namespace:

    torch.ops.symm_mem.fused_all_gather_matmul(A_shard, Bs, gather_dim, group_name, return_A=True)
    torch.ops.overlap.fused_all_gather_matmul(A_shard, Bs, gather_dim, group_name, return_A=True)

or the import (``from overlap.compat import fused_all_gather_matmul``). Importing this
module registers, under the ``overlap`` namespace, with torch's schemas and the
``needs_fixed_stride_order`` tag:

    fused_all_gather_matmul(Tensor A, Tensor[] Bs, int gather_dim, str group_name, *,
                            bool return_A=True) -> (Tensor?, Tensor[])
        (all_gather(A, gather_dim), [all_gather(A, gather_dim) @ B for B in Bs])
    fused_matmul_reduce_scatter(Tensor A, Tensor B, str reduce_op, int scatter_dim,
                                str group_name) -> Tensor
        reduce_scatter(A @ B, reduce_op, scatter_dim)
    fused_all_gather_scaled_matmul(...), fused_scaled_matmul_reduce_scatter(...)
        torch's FP8 signatures; they raise NotImplementedError (no FP8 path yet)

The values, shapes and strides are those of torch's fallbacks (checked by
tests/ops/test_compat.py). They run ``overlap.all_gather_matmul`` and
``overlap.matmul_reduce_scatter`` (tile-flag overlap on CUDA in fp16 / bf16, the
reference elsewhere); the last dim (torch's column gather, or a scatter of the output's
columns) takes the reference, with a one-time warning. Like torch's ops they have no
backward; an input that requires grad raises (torch's warn and drop the gradient). Any
process group works: no symmetric memory is needed.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import _library as _lib_ops
from . import _shapes
from .ops._runtime import warn_once

_OPS = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter", "fused_all_gather_scaled_matmul",
        "fused_scaled_matmul_reduce_scatter")
__all__ = [*_OPS, "enable_inductor_async_tp"]

_lib = torch.library.Library("overlap", "FRAGMENT")
_FIXED = (torch._C.Tag.needs_fixed_stride_order,)
_lib.define("fused_all_gather_matmul(Tensor A, Tensor[] Bs, int gather_dim, str group_name, *, "
            "bool return_A=True) -> (Tensor?, Tensor[])", tags=_FIXED)
_lib.define("fused_matmul_reduce_scatter(Tensor A, Tensor B, str reduce_op, int scatter_dim, str group_name) "
            "-> Tensor", tags=_FIXED)
_lib.define("fused_all_gather_scaled_matmul(Tensor A, Tensor[] Bs, Tensor A_scale, Tensor[] B_scales, "
            "int gather_dim, str group_name, Tensor?[] biases, Tensor?[] result_scales, "
            "ScalarType?[] out_dtypes, bool[] use_fast_accum) -> (Tensor, Tensor[])", tags=_FIXED)
_lib.define("fused_scaled_matmul_reduce_scatter(Tensor A, Tensor B, Tensor A_scale, Tensor B_scale, "
            "str reduce_op, int orig_scatter_dim, int scatter_dim_after_maybe_reshape, str group_name, "
            "SymInt[]? output_shape, Tensor? bias=None, Tensor? result_scale=None, ScalarType? out_dtype=None, "
            "bool use_fast_accum=False) -> Tensor", tags=_FIXED)


def _group(group_name: str) -> Any:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def _world(group_name: str) -> int:
    import torch.distributed as tdist

    return tdist.get_world_size(_group(group_name))


def _check_ag(A: torch.Tensor, Bs: list[torch.Tensor], gather_dim: int, group_name: str) -> int:
    op = "fused_all_gather_matmul"
    if A.dim() < 2:
        raise ValueError(f"{op}: A_shard must have at least 2 dims [..., K], got {tuple(A.shape)}")
    d = _shapes.norm_dim(op, gather_dim, A.dim(), "gather_dim", last_ok=True)
    k = A.shape[-1]
    if d == A.dim() - 1:  # column gather: B's rows are the gathered features
        k *= _world(group_name)
    _shapes.weights(op, list(Bs), k, A.dtype)
    return d


# ---- fused_all_gather_matmul ------------------------------------------------------------

def _ag_last(A: torch.Tensor, Bs: list[torch.Tensor], group_name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The column gather: A_mm = cat(all_gather(A), dim=-1), then matmuls (the reference)."""
    from .ops._runtime import all_gather_single

    warn_once("compat-ag-last", "overlap.compat.fused_all_gather_matmul: gather_dim is the last dim; no "
              "overlapped path for a column gather, running the reference (all-gather, concatenate, matmul)")
    world = _world(group_name)
    g = A.new_empty((world * A.shape[0], *A.shape[1:]))
    all_gather_single(g, A.contiguous(), group=_group(group_name))
    a_mm = torch.cat(g.chunk(world), dim=-1)
    return a_mm, [a_mm @ b for b in Bs]


def _ag_impl(A: torch.Tensor, Bs: list[torch.Tensor], gather_dim: int, group_name: str, *,
             return_A: bool = True) -> tuple[Optional[torch.Tensor], list[torch.Tensor]]:
    d = _check_ag(A, Bs, gather_dim, group_name)
    with torch.no_grad():
        if d == A.dim() - 1:
            a_mm, outs = _ag_last(A, list(Bs), group_name)
            return (a_mm if return_A else None), outs
        got = _lib_ops.all_gather_matmul(A, list(Bs), group=_group(group_name), gather_dim=d,
                                         return_gathered=return_A)
    outs, a = got if return_A else (got, None)
    return a, outs


def _ag_meta(A: torch.Tensor, Bs: list[torch.Tensor], gather_dim: int, group_name: str, *,
             return_A: bool = True) -> tuple[Optional[torch.Tensor], list[torch.Tensor]]:
    d = _check_ag(A, Bs, gather_dim, group_name)
    world = _world(group_name)
    if d == A.dim() - 1:
        a_mm = A.new_empty((*A.shape[:-1], world * A.shape[-1]))
        return (a_mm if return_A else None), [A.new_empty((*A.shape[:-1], b.shape[1])) for b in Bs]
    lead = tuple(A.movedim(d, 0).shape[:-1])
    lead = (world * lead[0], *lead[1:])
    outs = [A.new_empty((*lead, b.shape[1])).movedim(0, d) for b in Bs]
    return (A.new_empty((*lead, A.shape[-1])).movedim(0, d) if return_A else None), outs


# ---- fused_matmul_reduce_scatter --------------------------------------------------------

def _rs_check(A: torch.Tensor, B: torch.Tensor, reduce_op: str, scatter_dim: int) -> tuple[str, int]:
    op = "fused_matmul_reduce_scatter"
    reduce_op = reduce_op.lower()  # as torch's op
    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"{op}: reduce_op must be 'sum' or 'avg', got {reduce_op!r}")
    if A.dim() < 2:
        raise ValueError(f"{op}: A must have at least 2 dims [..., K], got {tuple(A.shape)}")
    d = _shapes.norm_dim(op, scatter_dim, A.dim(), "scatter_dim", last_ok=True)
    _shapes.weights(op, B, A.shape[-1], A.dtype, many_ok=False)
    return reduce_op, d


def _rs_impl(A: torch.Tensor, B: torch.Tensor, reduce_op: str, scatter_dim: int, group_name: str) -> torch.Tensor:
    reduce_op, d = _rs_check(A, B, reduce_op, scatter_dim)
    with torch.no_grad():
        if d == A.dim() - 1:  # a scatter of the output's columns: the reference
            from torch.distributed import _functional_collectives as funcol

            warn_once("compat-rs-last", "overlap.compat.fused_matmul_reduce_scatter: scatter_dim is the last dim; "
                      "no overlapped path for a column scatter, running the reference (matmul, reduce-scatter)")
            rs = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor  # (deprecated)
            return funcol.wait_tensor(rs(A @ B, reduce_op, d, _group(group_name)))
        return _lib_ops.matmul_reduce_scatter(A, B, group=_group(group_name), scatter_dim=d, reduce_op=reduce_op)


def _rs_meta(A: torch.Tensor, B: torch.Tensor, reduce_op: str, scatter_dim: int, group_name: str) -> torch.Tensor:
    _, d = _rs_check(A, B, reduce_op, scatter_dim)
    shape = [*A.shape[:-1], B.shape[1]]
    shape[d] //= _world(group_name)
    return A.new_empty(shape)


# ---- FP8 ----------------------------------------------------------------------------------

def _no_fp8(op: str) -> NotImplementedError:
    return NotImplementedError(f"overlap.compat.{op}: FP8 (scaled) matmuls are not supported yet; "
                               f"torch.ops.symm_mem.{op} runs them")


def _ag_scaled(*args: Any, **kw: Any) -> Any:
    raise _no_fp8("fused_all_gather_scaled_matmul")


def _rs_scaled(*args: Any, **kw: Any) -> Any:
    raise _no_fp8("fused_scaled_matmul_reduce_scatter")


for _key in ("CPU", "CUDA"):
    _lib.impl("fused_all_gather_matmul", _ag_impl, _key)
    _lib.impl("fused_matmul_reduce_scatter", _rs_impl, _key)
    _lib.impl("fused_all_gather_scaled_matmul", _ag_scaled, _key)
    _lib.impl("fused_scaled_matmul_reduce_scatter", _rs_scaled, _key)
def _no_backward_for(name: str) -> None:
    def setup_context(ctx: Any, inputs: Any, *rest: Any, **kw: Any) -> None:  # (keyword-only inputs, output)
        raise RuntimeError(f"overlap.compat.{name}: an input requires grad, and the op has no backward (as "
                           f"torch.ops.symm_mem.{name}); call it under torch.no_grad(), or let torch.compile "
                           "place it after autograd (enable_inductor_async_tp)")

    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(f"overlap.compat.{name} has no backward")

    torch.library.register_autograd(f"overlap::{name}", backward, setup_context=setup_context, lib=_lib)


for _name in _OPS[:2]:
    _no_backward_for(_name)
_lib.impl("fused_all_gather_matmul", _ag_meta, "Meta")
_lib.impl("fused_matmul_reduce_scatter", _rs_meta, "Meta")
_lib.impl("fused_all_gather_scaled_matmul", _ag_scaled, "Meta")
_lib.impl("fused_scaled_matmul_reduce_scatter", _rs_scaled, "Meta")


# ---- Python entry points: torch's call forms ----------------------------------------------

def _name(group: Any) -> str:
    return group if isinstance(group, str) else group.group_name


def fused_all_gather_matmul(A_shard: torch.Tensor, Bs: list[torch.Tensor], gather_dim: int, group_name: Any, *,
                            return_A: bool = True) -> tuple[Optional[torch.Tensor], list[torch.Tensor]]:
    """``torch.ops.symm_mem.fused_all_gather_matmul``'s call on overlap's ops: returns
    ``(all_gather(A_shard, gather_dim) or None, [that @ B for B in Bs])``. ``group_name``: a
    group's name (or the group)."""
    return torch.ops.overlap.fused_all_gather_matmul(A_shard, list(Bs), gather_dim, _name(group_name),
                                                     return_A=return_A)


def fused_matmul_reduce_scatter(A: torch.Tensor, B: torch.Tensor, reduce_op: str, scatter_dim: int,
                                group_name: Any) -> torch.Tensor:
    """``torch.ops.symm_mem.fused_matmul_reduce_scatter``'s call on overlap's ops:
    ``reduce_scatter(A @ B, reduce_op, scatter_dim)``."""
    return torch.ops.overlap.fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, _name(group_name))


def fused_all_gather_scaled_matmul(*args: Any, **kw: Any) -> Any:
    """torch's FP8 signature; raises NotImplementedError."""
    return torch.ops.overlap.fused_all_gather_scaled_matmul(*args, **kw)


def fused_scaled_matmul_reduce_scatter(*args: Any, **kw: Any) -> Any:
    """torch's FP8 signature; raises NotImplementedError."""
    return torch.ops.overlap.fused_scaled_matmul_reduce_scatter(*args, **kw)


# ---- torch.compile's async-TP pass, emitting these ops --------------------------------------

def enable_inductor_async_tp(group: Any = None) -> None:
    """Turn on Inductor's async-TP pass (``torch._inductor.config._micro_pipeline_tp``) for
    ``group`` (default: overlap's tensor-parallel group), with its fused nodes retargeted from
    ``torch.ops.symm_mem.*`` to ``torch.ops.overlap.*``: a compiled model's all-gather -> mm and
    mm -> reduce-scatter run overlap's ops. What torchtitan's ``enable_async_tensor_parallel``
    does (docs/ops/compat.md), plus the retargeting pass. Call it before the first compiled
    call (Inductor reads its config when it compiles).

    The pass fires only for a group that torch's ``is_symm_mem_enabled_for_group`` accepts:
    this calls ``enable_symm_mem_for_group`` (which records the group's store; it allocates
    nothing), and torch's symmetric memory is never used, since no symm_mem node is left.
    It also needs a torch built with NCCL (``torch.distributed.is_nccl_available()``)."""
    import warnings

    from torch._inductor import config as inductor_config
    from torch.distributed import _symmetric_memory as symm

    from .ops._runtime import resolve_group

    group = resolve_group(group)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in recent torch, still the gate
        symm.enable_symm_mem_for_group(group.group_name)
    inductor_config._micro_pipeline_tp = True
    cls = _retarget_class()
    cur = inductor_config.post_grad_custom_post_pass
    passes = list(cur) if isinstance(cur, (list, tuple)) else ([] if cur is None else [cur])
    if any(isinstance(p, cls) for p in passes):
        return
    try:
        from torch._inductor.custom_graph_pass import get_custom_graph_passes  # noqa: F401 (a torch that runs lists)
    except ImportError:  # a single pass only: ours calls the one there first
        inductor_config.post_grad_custom_post_pass = cls(cur)
        return
    inductor_config.post_grad_custom_post_pass = [*passes, cls()]


_RETARGET: Any = None


def _retarget_class() -> Any:
    """``Retarget``: a post-grad pass (after the async-TP pass) replacing each fused symm_mem
    node by the overlap op of the same schema, same arguments; chains the pass it replaces."""
    global _RETARGET
    if _RETARGET is not None:
        return _RETARGET
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class Retarget(CustomGraphPass):
        def __init__(self, prev: Any = None) -> None:
            self.prev = prev

        def __call__(self, graph: torch.fx.Graph) -> None:
            if self.prev is not None:
                self.prev(graph)
            sm, ov = torch.ops.symm_mem, torch.ops.overlap
            # the unscaled two; FP8 nodes stay torch's (ours would raise)
            table = {getattr(sm, n).default: getattr(ov, n).default for n in _OPS[:2]}
            for node in list(graph.nodes):
                if node.op == "call_function" and node.target in table:
                    with graph.inserting_before(node):
                        new = graph.call_function(table[node.target], node.args, dict(node.kwargs))
                    new.meta.update(node.meta)
                    node.replace_all_uses_with(new)
                    graph.erase_node(node)

        def uuid(self) -> Any:
            # Inductor's graph cache keys on it; a chained pass without a key of its own
            # makes the whole pass unkeyed (None: Inductor bypasses its cache, as for that pass)
            if self.prev is None:
                return get_hash_for_files((__file__,))
            if isinstance(self.prev, CustomGraphPass) and self.prev.uuid() is not None:
                return (get_hash_for_files((__file__,)), self.prev.uuid())
            return None

    _RETARGET = Retarget
    return Retarget
