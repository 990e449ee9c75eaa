"""Tensor-parallel linears with autograd: one ``torch.autograd.Function`` per change of region.

Each Function names its pair (what the forward communicates, what the backward does), as
Megatron-LM's ``mappings.py``; the fused ones run the library's ops for both passes:

    function                 forward                               backward (grad_input)
    all_gather_linear        all_gather(x_shard) @ w.t()           reduce_scatter(grad @ w)
                             (all_gather_matmul)                   (matmul_reduce_scatter)
    linear_reduce_scatter    reduce_scatter(x @ w.t())             all_gather(grad) @ w
                             (matmul_reduce_scatter)               (all_gather_matmul)
    copy_linear              x @ w.t()       (local)               all_reduce(grad @ w)
                                                                   (matmul_all_reduce)
    linear_all_reduce        all_reduce(x @ w.t())                 grad @ w        (local)
                             (matmul_all_reduce)
    all_reduce_norm_linear   h = all_reduce(x) + res;              all_reduce(grad @ w) through
                             norm(h) @ w.t() (all_reduce_matmul)   the norm; grad_x = grad_h

Two take a list of weights that read one input (q, k, v; gate, up): one gather (or
none), one GEMM grid over the weights, and in backward one reduction of the summed
input gradient:

    all_gather_linear_many   all_gather(x_shard) @ [w_i.t()]       reduce_scatter(cat(grad_i) @ cat(w_i))
    copy_linear_many         x @ [w_i.t()]   (local)               all_reduce(cat(grad_i) @ cat(w_i))

and three small ones on plain collectives for the edges of a region:

    copy_to_region           identity                              all_reduce(grad)
    gather_from_region       all_gather(x, dim)                    grad's own slice
    scatter_to_region        x's own slice along dim               all_gather(grad, dim)

Every function takes 2-D ``[tokens, features]`` tensors and a resolved group (the layers
flatten leading dimensions and resolve the group once, at construction). ``fused=False``
runs the same autograd with the ops' plain references (``overlap.ops.*_ref``: one
torch.distributed collective and ``torch.matmul``): the tests' reference.

Under ``torch.compile`` the forward and backward call the library's custom ops
(``torch.ops.overlap.*``), which Dynamo traces whole; the edge collectives use
``torch.distributed._functional_collectives`` there.

``all_gather_linear``'s weight gradient reads the gathered input: ``save_gathered`` keeps
it from forward (memory) or all-gathers the shard again in backward behind the input
gradient's GEMM (time, hidden where the GEMM is longer); ``"auto"`` picks per shape by
``regather_plan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Union

import torch

from .. import _library as _lib
from ..ops import all_gather as _ag
from ..ops import all_reduce as _ar
from ..ops import matmul_reduce as _mr
from ..ops._runtime import all_gather_single as _all_gather_single

__all__ = [
    "all_gather_linear",
    "linear_reduce_scatter",
    "copy_linear",
    "linear_all_reduce",
    "all_reduce_norm_linear",
    "all_gather_linear_many",
    "copy_linear_many",
    "copy_to_region",
    "gather_from_region",
    "scatter_to_region",
    "norm_backward",
    "regather_plan",
    "RegatherPlan",
    "LINK_BYTES_PER_S",
    "GEMM_FLOPS_PER_S",
    "GEMM_FLOPS_PER_S_FP32",
    "COLLECTIVE_FIXED_S",
]

_compiling = torch.compiler.is_compiling


# ---- what a call needs, decided once; the ops, fused or plain ----------------------------

class _Plan:
    """What the autograd functions of one layer read on every call, decided when the layer
    (or a functional call) is set up: the group, the fused ops or their references, the
    ops' config, the group's size where known, and (sequence-parallel column layers)
    whether the gathered input is kept for the weight gradient. One argument and one
    ``ctx`` field in place of four or five on every call."""

    __slots__ = ("group", "world", "fused", "config", "save_gathered", "norm")

    def __init__(self, group: Any, fused: bool, config: Any, *, save_gathered: bool = True,
                 world: int | None = None, norm: Any = None) -> None:
        self.group, self.fused, self.config = group, bool(fused), config
        self.save_gathered, self.world, self.norm = bool(save_gathered), world, norm

    def world_size(self) -> int:
        if self.world is None:
            self.world = _rank_world(self.group)[1]
        return self.world

    def __repr__(self) -> str:
        return (f"_Plan(world={self.world}, fused={self.fused}, config={self.config!r}, "
                f"save_gathered={self.save_gathered})")


# Each helper runs with grad mode off (forward always; backward unless create_graph, see
# _grads_off), so the library's refusal of inputs that require grad never fires. Eager
# calls go to the ops themselves; compiling, through the custom ops of overlap._library.

def _ag_mm(a: torch.Tensor, b: Any, plan: _Plan, return_gathered: bool) -> Any:
    if not plan.fused:
        return _ag.all_gather_matmul_ref(a, b, group=plan.group, return_gathered=return_gathered)
    if _compiling() or not isinstance(b, torch.Tensor):  # (a list of weights: the wrapper's path)
        return _lib.all_gather_matmul(a, b, group=plan.group, return_gathered=return_gathered, config=plan.config)
    return _ag.all_gather_matmul(a, b, group=plan.group, return_gathered=return_gathered, config=plan.config)


def _mm_rs(a: torch.Tensor, b: torch.Tensor, plan: _Plan) -> torch.Tensor:
    if not plan.fused:
        return _mr.matmul_reduce_scatter_ref(a, b, group=plan.group)
    if _compiling():
        return _lib.matmul_reduce_scatter(a, b, group=plan.group, config=plan.config)
    return _mr.matmul_reduce_scatter(a, b, group=plan.group, config=plan.config)


def _mm_ar(a: torch.Tensor, b: torch.Tensor, plan: _Plan) -> torch.Tensor:
    if not plan.fused:
        return _mr.matmul_all_reduce_ref(a, b, group=plan.group)
    if _compiling():
        return _lib.matmul_all_reduce(a, b, group=plan.group, config=plan.config)
    return _mr.matmul_all_reduce(a, b, group=plan.group, config=plan.config)


def _grads_off(backward: Any) -> Any:
    """A Function's backward run with grad mode off. Autograd runs a backward with grad
    mode off unless ``create_graph=True``; only then does this pay for ``torch.no_grad``."""

    def run(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled():
            with torch.no_grad():
                return backward(ctx, *grads)
        return backward(ctx, *grads)

    run.__doc__, run.__name__, run.__qualname__ = backward.__doc__, backward.__name__, backward.__qualname__
    return run


def _all_gather_rows(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``torch.cat(all_gather(x), dim=0)`` on a plain collective: [M/R, K] -> [M, K]."""
    import torch.distributed as tdist

    if _compiling():
        from torch.distributed import _functional_collectives as funcol

        ag = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # (deprecated in 2.13)
        return ag(x.contiguous(), 0, group)
    x = x.contiguous()
    out = x.new_empty((tdist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x, group=group)
    return out


def _start_gather_rows(x: torch.Tensor, group: Any) -> tuple[torch.Tensor, Any]:
    """Start ``torch.cat(all_gather(x), dim=0)`` ([M/R, K] -> [M, K]) and return at once;
    ``_finish_gather`` gives the result. Eager: ``async_op=True`` on the group's torch
    communicator (NCCL: torch's own stream, which waits for the current stream's work so
    far; the output is allocated on the current stream, and ``work.wait()`` makes the
    current stream, not the host, wait for the gather). Compiled: the functional
    collective with its ``wait_tensor`` left for later, where the result is used."""
    import torch.distributed as tdist

    x = x.contiguous()
    if _compiling():
        return torch.ops._c10d_functional.all_gather_into_tensor(x, tdist.get_world_size(group),
                                                                 group.group_name), None
    out = x.new_empty((tdist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    fn = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor  # (deprecated in 2.13)
    return out, fn(out, x, group=group, async_op=True)


def _finish_gather(pending: tuple[torch.Tensor, Any]) -> torch.Tensor:
    out, work = pending
    if work is None:
        return torch.ops._c10d_functional.wait_tensor(out)
    work.wait()
    return out


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``sum over ranks of x`` on a plain collective (a new tensor; x is not modified)."""
    import torch.distributed as tdist

    if _compiling():
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(x.contiguous(), "sum", group)
    out = x.clone(memory_format=torch.contiguous_format)
    tdist.all_reduce(out, group=group)
    return out


def _rank_world(group: Any) -> tuple[int, int]:
    import torch.distributed as tdist

    return tdist.get_rank(group), tdist.get_world_size(group)


# ---- the weight gradient's input: kept from forward, or all-gathered again --------------

SaveGathered = Union[bool, Literal["auto"]]

LINK_BYTES_PER_S = 210e9
"""Bytes per second a rank receives in an NCCL all-gather (NCCL-tests bus bandwidth): 204-235
GB/s measured through torch at 2 ranks on 2x H200 NV18, M x K of 8192 x 8192 to 16384 x 8192
in bf16 (``benchmarks/results/2026-11-30_2xH200_d172e09``, the "busbw" column of
``benchmarks/RESULTS.md``'s all-gather table)."""

GEMM_FLOPS_PER_S = 680e12
"""cuBLAS bf16 / fp16 on one H200: 677-686 TFLOP/s at 8192 x {14336, 18432, 24576} x
{8192, 12288} (the "cuBLAS GEMM" column, same folder), the GPT layers' kind of shape; the
smaller comm-heavy shapes ran 740-770."""

GEMM_FLOPS_PER_S_FP32 = 46e12
"""fp32 GEMMs (torch's default: no TF32): ``GEMM_FLOPS_PER_S`` scaled by the H200
datasheet's FP32 / BF16-dense ratio (67 / 989); not measured here."""

COLLECTIVE_FIXED_S = 20e-6
"""The fixed cost of one more collective, whatever its size: about one torch call's host
time on the GPU machines (14-28 us per small ``torch.mm``, the run contexts of
``benchmarks/RESULTS.md``). Below it the gather of a small input is not worth its launch."""


@dataclass(frozen=True)
class RegatherPlan:
    """What ``regather_plan`` decided for one ``all_gather_linear`` and why (seconds, bytes)."""

    regather: bool
    """True: keep the shard, all-gather it again in backward behind the input gradient's GEMM."""
    gather_s: float
    """The extra all-gather of [M, K]: ``COLLECTIVE_FIXED_S + (R-1)/R * bytes(M, K) / LINK_BYTES_PER_S``."""
    reduce_scatter_s: float
    """The input gradient's own reduce-scatter, on the same links at the same time: ``(R-1)/R * bytes(M, K) / LINK``."""
    gemm_s: float
    """The input gradient's GEMM ``grad [M, N/R] @ w_shard [N/R, K]``: ``2 M (N/R) K / GEMM rate``."""
    saved_bytes: int
    """Activation memory kept from forward to backward less per layer by regathering: bytes of [M, K] - [M/R, K]."""


def regather_plan(m: int, n_shard: int, k: int, world: int, dtype: torch.dtype) -> RegatherPlan:
    """Keep the gathered input [M, K] for the weight gradient, or gather it again? Pure:
    depends on the shape only, so every rank of the group decides the same.

    Rule: gather again when both transfers of the backward, the new all-gather and the
    input gradient's reduce-scatter (the same bytes over the same links), fit under the
    input gradient's GEMM: ``gather_s + reduce_scatter_s <= gemm_s``; keep it otherwise
    (and at one rank). With the module's rates the byte terms cancel M and K, so at 2 ranks
    in bf16 the rule is ``N/R >= GEMM rate / link rate`` (about 3240), plus the fixed cost
    for small M x K: every GPT-size column layer regathers; narrow layers keep. The rates
    are module constants, read at each call.

    ========  ======================================================
    arg       meaning
    ========  ======================================================
    m         M, rows after the gather (every rank's tokens)
    n_shard   N/R, this rank's output features
    k         K, input features
    world     R, the group's size
    dtype     the input's dtype (its size; bf16/fp16 or fp32 rate)
    ========  ======================================================
    """
    elt = dtype.itemsize
    moved = (world - 1) / world * m * k * elt  # bytes a rank receives, all-gather or reduce-scatter
    rate = GEMM_FLOPS_PER_S if elt <= 2 else GEMM_FLOPS_PER_S_FP32
    gather_s = COLLECTIVE_FIXED_S + moved / LINK_BYTES_PER_S
    rs_s = moved / LINK_BYTES_PER_S
    gemm_s = 2.0 * m * n_shard * k / rate
    saved = (m - m // world) * k * elt if world > 1 else 0
    return RegatherPlan(world > 1 and gather_s + rs_s <= gemm_s, gather_s, rs_s, gemm_s, saved)


def _check_save_gathered(save_gathered: Any) -> None:
    if not (isinstance(save_gathered, bool) or save_gathered == "auto"):
        raise ValueError(f"save_gathered must be True, False or 'auto', got {save_gathered!r}")


# ---- sequence-parallel column / row -----------------------------------------------------

class _AllGatherLinear(torch.autograd.Function):
    """forward: all-gather rows, then GEMM; backward: GEMM, then reduce-scatter rows."""

    @staticmethod
    def forward(ctx: Any, x_shard: torch.Tensor, w_shard: torch.Tensor, bias: torch.Tensor | None,
                plan: _Plan) -> torch.Tensor:
        y, gathered = _ag_mm(x_shard, w_shard.t(), plan, True)  # [M, N/R], [M, K]
        if bias is not None:
            y = y + bias
        ctx.plan = plan
        # the weight gradient reads the gathered input: keeping it costs [M, K] per layer until
        # backward; save_gathered=False keeps the shard [M/R, K] and all-gathers it again there
        ctx.save_for_backward(gathered if plan.save_gathered else x_shard, w_shard)
        return y

    @staticmethod
    @_grads_off
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        saved, w_shard = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        plan = ctx.plan
        grad_x = grad_w = grad_b = None
        grad_y = grad_y.contiguous()  # [M, N/R]
        # save_gathered=False: the gather of the kept shard starts first, on torch's
        # communicator, and runs behind the input gradient's GEMM -> reduce-scatter:
        #
        #   torch's NCCL stream | AG(x_shard) -> gathered [M, K] |
        #   current stream      | GEMM grad @ w -> RS (the op's own comm) |wait| grad^T @ gathered |
        #
        # Every rank issues the two in the same order, and the GEMM's tiles wait on
        # nothing, so the two communicators' kernels cannot wait on each other in a circle.
        pending = _start_gather_rows(saved, plan.group) if need_w and not plan.save_gathered else None
        if need_x:
            grad_x = _mm_rs(grad_y, w_shard, plan)  # [M/R, K]
        if need_w:
            gathered = saved if pending is None else _finish_gather(pending)  # [M, K]
            grad_w = torch.mm(grad_y.t(), gathered)  # [N/R, K]
        if need_b:
            grad_b = grad_y.sum(0)  # [N/R]
        return grad_x, grad_w, grad_b, None


class _LinearReduceScatter(torch.autograd.Function):
    """forward: GEMM, then reduce-scatter rows (+ bias, replicated); backward: all-gather
    rows, then GEMM; the bias's gradient summed over every rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w_shard: torch.Tensor, bias: torch.Tensor | None,
                plan: _Plan) -> torch.Tensor:
        y_shard = _mm_rs(x, w_shard.t(), plan)  # [M/R, N]
        if bias is not None:
            y_shard = y_shard + bias  # after the sum: once, on this rank's rows
        ctx.plan = plan
        ctx.save_for_backward(x, w_shard)
        return y_shard

    @staticmethod
    @_grads_off
    def backward(ctx: Any, grad_y_shard: torch.Tensor) -> tuple:
        x, w_shard = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        plan = ctx.plan
        grad_x = grad_w = grad_b = None
        grad_y_shard = grad_y_shard.contiguous()  # [M/R, N]
        if need_x:
            # one all-gather serves both: the GEMM's input and (returned) the weight gradient's
            out = _ag_mm(grad_y_shard, w_shard, plan, need_w)
            grad_x, grad_y = out if need_w else (out, None)  # [M, K/R], [M, N]
        elif need_w:
            grad_y = _all_gather_rows(grad_y_shard, plan.group)  # [M, N]
        if need_w:
            grad_w = torch.mm(grad_y.t(), x)  # [N, K/R]
        if need_b:
            # each rank's rows give a part: the sum over ranks (copy_to_region's backward)
            grad_b = _all_reduce(grad_y_shard.sum(0), plan.group)  # [N]
        return grad_x, grad_w, grad_b, None


def all_gather_linear(x_shard: torch.Tensor, w_shard: torch.Tensor, bias: torch.Tensor | None = None, *,
                      group: Any, fused: bool = True, config: Any = None,
                      save_gathered: SaveGathered = "auto") -> torch.Tensor:
    """``all_gather(x_shard, dim=0) @ w_shard.t() + bias``: a sequence-parallel column-parallel linear.

    forward: all-gather -> GEMM (``all_gather_matmul``); backward: GEMM -> reduce-scatter
    (``matmul_reduce_scatter``) for the input's gradient, ``grad^T @ gathered`` for the weight's.

    ==========  =========  ===================================================
    tensor      shape      meaning
    ==========  =========  ===================================================
    x_shard     [M/R, K]   this rank's tokens
    w_shard     [N/R, K]   this rank's output rows of an nn.Linear weight
    bias        [N/R]      this rank's slice of the bias, or None
    returns     [M, N/R]   every token, this rank's output features
    ==========  =========  ===================================================

    ``save_gathered``: True keeps the gathered input [M, K] from forward to backward for
    the weight gradient (memory: no second all-gather); False keeps only ``x_shard``
    [M/R, K] and all-gathers it again in backward, started before the input gradient's
    GEMM -> reduce-scatter and waited for after it (hidden where that GEMM is longer);
    "auto" (default) is False where ``regather_plan(M, N/R, K, R, dtype).regather``.
    Anything else raises ``ValueError``.
    """
    _check_save_gathered(save_gathered)
    world = None
    if save_gathered == "auto":
        world = _rank_world(group)[1]
        save_gathered = not regather_plan(world * x_shard.shape[0], w_shard.shape[0], x_shard.shape[1], world,
                                          x_shard.dtype).regather
    return _AllGatherLinear.apply(x_shard, w_shard, bias,
                                  _Plan(group, fused, config, save_gathered=save_gathered, world=world))


def linear_reduce_scatter(x: torch.Tensor, w_shard: torch.Tensor, bias: torch.Tensor | None = None, *, group: Any,
                          fused: bool = True, config: Any = None) -> torch.Tensor:
    """``reduce_scatter(x @ w_shard.t(), dim=0) + bias``: a sequence-parallel row-parallel linear.

    forward: GEMM -> reduce-scatter (``matmul_reduce_scatter``); backward: all-gather -> GEMM
    (``all_gather_matmul``, whose gathered ``grad`` also gives ``grad_w = grad^T @ x``).

    ==========  =========  ===================================================
    tensor      shape      meaning
    ==========  =========  ===================================================
    x           [M, K/R]   every token, this rank's input features
    w_shard     [N, K/R]   this rank's input columns of an nn.Linear weight
    bias        [N]        replicated, or None: added once, after the reduction
    returns     [M/R, N]   this rank's tokens of the sum over ranks
    ==========  =========  ===================================================

    The bias's gradient is the sum over every rank's rows (one all-reduce of [N] in
    backward, none at one rank), as ``copy_to_region``'s.
    """
    return _LinearReduceScatter.apply(x, w_shard, bias, _Plan(group, fused, config))


# ---- tensor-parallel column / row (activations replicated) ------------------------------

class _CopyLinear(torch.autograd.Function):
    """forward: identity (copy into the region), then GEMM; backward: GEMM, then all-reduce."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w_shard: torch.Tensor, bias: torch.Tensor | None,
                plan: _Plan) -> torch.Tensor:
        y = torch.nn.functional.linear(x, w_shard, bias)  # [M, N/R]
        ctx.plan = plan
        ctx.save_for_backward(x, w_shard)
        return y

    @staticmethod
    @_grads_off
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        x, w_shard = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        grad_y = grad_y.contiguous()  # [M, N/R]
        if need_x:
            grad_x = _mm_ar(grad_y, w_shard, ctx.plan)  # [M, K]
        if need_w:
            grad_w = torch.mm(grad_y.t(), x)  # [N/R, K]
        if need_b:
            grad_b = grad_y.sum(0)
        return grad_x, grad_w, grad_b, None


class _LinearAllReduce(torch.autograd.Function):
    """forward: GEMM, then all-reduce (+ bias once); backward: identity for the reduction, GEMM."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w_shard: torch.Tensor, bias: torch.Tensor | None,
                plan: _Plan) -> torch.Tensor:
        y = _mm_ar(x, w_shard.t(), plan)  # [M, N]
        if bias is not None:
            y = y + bias  # after the sum: once, not R times
        ctx.save_for_backward(x, w_shard)
        return y

    @staticmethod
    @_grads_off
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        x, w_shard = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        # the all-reduce's backward is the identity: every rank's partial gets all of grad_y
        if need_x:
            grad_x = torch.mm(grad_y, w_shard)  # [M, K/R]
        if need_w:
            grad_w = torch.mm(grad_y.t(), x)  # [N, K/R]
        if need_b:
            grad_b = grad_y.sum(0)  # grad_y is the same on every rank, so is this
        return grad_x, grad_w, grad_b, None


def copy_linear(x: torch.Tensor, w_shard: torch.Tensor, bias: torch.Tensor | None = None, *, group: Any,
                fused: bool = True, config: Any = None) -> torch.Tensor:
    """``x @ w_shard.t() + bias``: a column-parallel linear whose input is the same on every rank.

    forward: local GEMM (copy into the region); backward: GEMM -> all-reduce
    (``matmul_all_reduce``) for the input's gradient.

    ==========  =========  ===================================================
    tensor      shape      meaning
    ==========  =========  ===================================================
    x           [M, K]     replicated
    w_shard     [N/R, K]   this rank's output rows
    bias        [N/R]      this rank's slice, or None
    returns     [M, N/R]   this rank's output features
    ==========  =========  ===================================================
    """
    return _CopyLinear.apply(x, w_shard, bias, _Plan(group, fused, config))


def linear_all_reduce(x: torch.Tensor, w_shard: torch.Tensor, bias: torch.Tensor | None = None, *, group: Any,
                      fused: bool = True, config: Any = None) -> torch.Tensor:
    """``all_reduce(x @ w_shard.t()) + bias``: a row-parallel linear, output replicated.

    forward: GEMM -> all-reduce (``matmul_all_reduce``), the bias added once after it;
    backward: identity for the reduction, a local GEMM for the input's gradient.

    ==========  =========  ===================================================
    tensor      shape      meaning
    ==========  =========  ===================================================
    x           [M, K/R]   this rank's input features
    w_shard     [N, K/R]   this rank's input columns
    bias        [N]        replicated, or None
    returns     [M, N]     the sum over ranks (+ bias), on every rank
    ==========  =========  ===================================================
    """
    return _LinearAllReduce.apply(x, w_shard, bias, _Plan(group, fused, config))


# ---- several column layers on one input (q, k, v; gate, up) -----------------------------

def _grads_or_zeros(grads: tuple, outs_shapes: list[tuple[int, int]], like: torch.Tensor) -> list[torch.Tensor]:
    """An output nobody used has no gradient: zeros of its shape (its rows still add nothing)."""
    return [g.contiguous() if g is not None else like.new_zeros(shape) for g, shape in zip(grads, outs_shapes)]


class _AllGatherLinearMany(torch.autograd.Function):
    """forward: one all-gather of the rows, then a GEMM per weight (one grid); backward:
    one GEMM over the concatenated gradients and weights, then one reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, x_shard: torch.Tensor, plan: _Plan, n: int,
                *params: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        ws, bs = params[:n], params[n:]
        ys, gathered = _ag_mm(x_shard, [w.t() for w in ws], plan, True)
        ys = [y if b is None else y + b for y, b in zip(ys, bs)]  # [M, N_i/R]
        ctx.plan, ctx.n = plan, n
        ctx.save_for_backward(gathered if plan.save_gathered else x_shard, *ws)
        return tuple(ys)

    @staticmethod
    @_grads_off
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        saved, *ws = ctx.saved_tensors
        need = ctx.needs_input_grad
        plan, n = ctx.plan, ctx.n
        m = saved.shape[0] if plan.save_gathered else saved.shape[0] * plan.world_size()
        gs = _grads_or_zeros(grads, [(m, w.shape[0]) for w in ws], saved)  # [M, N_i/R]
        need_w = any(need[3:3 + n])
        pending = _start_gather_rows(saved, plan.group) if need_w and not plan.save_gathered else None
        grad_x = None
        if need[0]:
            # sum_i grad_i @ w_i = cat(grad_i) @ cat(w_i): one GEMM, one reduce-scatter
            grad_x = _mm_rs(torch.cat(gs, 1), torch.cat(ws, 0), plan)  # [M/R, K]
        gathered = None
        if need_w:
            gathered = saved if pending is None else _finish_gather(pending)  # [M, K]
        grad_ws = [torch.mm(g.t(), gathered) if need[3 + i] else None for i, g in enumerate(gs)]  # [N_i/R, K]
        grad_bs = [g.sum(0) if need[3 + n + i] else None for i, g in enumerate(gs)]
        return (grad_x, None, None, *grad_ws, *grad_bs)


class _CopyLinearMany(torch.autograd.Function):
    """forward: a local GEMM per weight; backward: one GEMM over the concatenated gradients
    and weights, then one all-reduce."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, plan: _Plan, n: int, *params: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        ws, bs = params[:n], params[n:]
        ys = [torch.nn.functional.linear(x, w, b) for w, b in zip(ws, bs)]  # [M, N_i/R]
        ctx.plan, ctx.n = plan, n
        ctx.save_for_backward(x, *ws)
        return tuple(ys)

    @staticmethod
    @_grads_off
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        x, *ws = ctx.saved_tensors
        need, n = ctx.needs_input_grad, ctx.n
        gs = _grads_or_zeros(grads, [(x.shape[0], w.shape[0]) for w in ws], x)
        grad_x = _mm_ar(torch.cat(gs, 1), torch.cat(ws, 0), ctx.plan) if need[0] else None
        grad_ws = [torch.mm(g.t(), x) if need[3 + i] else None for i, g in enumerate(gs)]
        grad_bs = [g.sum(0) if need[3 + n + i] else None for i, g in enumerate(gs)]
        return (grad_x, None, None, *grad_ws, *grad_bs)


def _check_many(what: str, ws: list[torch.Tensor], biases: list[torch.Tensor | None] | None) -> list:
    if not ws:
        raise ValueError(f"{what}: an empty list of weights")
    biases = [None] * len(ws) if biases is None else list(biases)
    if len(biases) != len(ws):
        raise ValueError(f"{what}: {len(ws)} weights but {len(biases)} biases")
    return biases


def all_gather_linear_many(x_shard: torch.Tensor, w_shards: list[torch.Tensor],
                           biases: list[torch.Tensor | None] | None = None, *, group: Any, fused: bool = True,
                           config: Any = None, save_gathered: SaveGathered = "auto") -> list[torch.Tensor]:
    """``[all_gather(x_shard, dim=0) @ w.t() + b for w, b in zip(w_shards, biases)]`` with one gather.

    forward: ``all_gather_matmul`` with the list of weights (one gather, one GEMM grid);
    backward: ``matmul_reduce_scatter(cat(grad_i, 1), cat(w_i, 0))``, the summed input
    gradient in one GEMM and one reduce-scatter, and ``grad_i^T @ gathered`` per weight.

    ==========  ===========  =================================================
    tensor      shape        meaning
    ==========  ===========  =================================================
    x_shard     [M/R, K]     this rank's tokens
    w_shards    [N_i/R, K]   this rank's output rows of each weight
    biases      [N_i/R]      each weight's slice, or None (the list or an entry)
    returns     [M, N_i/R]   every token, this rank's features of each weight
    ==========  ===========  =================================================

    ``save_gathered`` as ``all_gather_linear``'s, "auto" deciding on the weights' summed N/R.
    """
    biases = _check_many("all_gather_linear_many", w_shards, biases)
    _check_save_gathered(save_gathered)
    world = None
    if save_gathered == "auto":
        world = _rank_world(group)[1]
        save_gathered = not regather_plan(world * x_shard.shape[0], sum(w.shape[0] for w in w_shards),
                                          x_shard.shape[1], world, x_shard.dtype).regather
    plan = _Plan(group, fused, config, save_gathered=save_gathered, world=world)
    return list(_AllGatherLinearMany.apply(x_shard, plan, len(w_shards), *w_shards, *biases))


def copy_linear_many(x: torch.Tensor, w_shards: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None,
                     *, group: Any, fused: bool = True, config: Any = None) -> list[torch.Tensor]:
    """``[x @ w.t() + b for w, b in zip(w_shards, biases)]``: column layers on one replicated input.

    forward: local GEMMs; backward: ``matmul_all_reduce(cat(grad_i, 1), cat(w_i, 0))``, one
    all-reduce of the summed input gradient (not one per weight).

    ==========  ===========  =================================================
    tensor      shape        meaning
    ==========  ===========  =================================================
    x           [M, K]       replicated
    w_shards    [N_i/R, K]   this rank's output rows of each weight
    biases      [N_i/R]      each weight's slice, or None
    returns     [M, N_i/R]   this rank's features of each weight
    ==========  ===========  =================================================
    """
    biases = _check_many("copy_linear_many", w_shards, biases)
    return list(_CopyLinearMany.apply(x, _Plan(group, fused, config), len(w_shards), *w_shards, *biases))


# ---- the block boundary: all-reduce -> residual -> norm -> column-parallel GEMM ---------

def norm_backward(grad_n: torch.Tensor, h: torch.Tensor, kind: str, weight: torch.Tensor,
                  bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``torch.autograd.grad(norm(h), (h, weight, bias), grad_n)``, without autograd.

    LayerNorm with one dtype throughout: torch's own kernels (``aten.native_layer_norm`` for
    the statistics, then ``aten.native_layer_norm_backward``), two launches where the closed
    form takes some twenty. Else (RMSNorm: torch's fused backward is not on every backend and
    version) in closed form, in fp32:
    LayerNorm ``xh = (h - mean) * rstd``, ``g = grad_n * weight``,
    ``dh = rstd * (g - mean(g) - xh * mean(g * xh))``; RMSNorm the same without the means
    of ``h`` and ``g``; ``dweight = sum(grad_n * xh)``, ``dbias = sum(grad_n)`` over rows.
    Aten ops and plain tensor code, so torch.compile traces the backward whole; the tests
    check both forms against torch's autograd."""
    return _norm_backward_with_out(grad_n, h, kind, weight, bias, eps)[:3]


def _fused_norm_ok(grad_n: torch.Tensor, h: torch.Tensor, kind: str, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> bool:
    """torch's LayerNorm backward takes these: a LayerNorm, one dtype throughout."""
    if kind != "layernorm" or grad_n.dtype != h.dtype or weight.dtype != h.dtype:
        return False
    return bias is None or bias.dtype == h.dtype


def _norm_backward_with_out(grad_n: torch.Tensor, h: torch.Tensor, kind: str, weight: torch.Tensor,
                            bias: torch.Tensor | None, eps: float,
                            fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Any]:
    """``norm_backward``'s (dh, dweight, dbias) and ``norm(h)`` where the fused route made it
    on the way (else None). ``fused``: force a route (tests), default where it applies."""
    k = h.shape[-1]
    if fused is None:
        fused = _fused_norm_ok(grad_n, h, kind, weight, bias)
    if fused and kind == "layernorm":
        out, mean, rstd = torch.native_layer_norm(h, [k], weight, bias, eps)
        dh, dw, db = torch.ops.aten.native_layer_norm_backward.default(grad_n, h, [k], mean, rstd, weight, bias,
                                                                       [True, True, bias is not None])
        return dh, dw, db if bias is not None else None, out
    hf, gf, wf = h.float(), grad_n.float(), weight.float()
    if kind == "layernorm":
        mu = hf.mean(-1, keepdim=True)
        rstd = torch.rsqrt(hf.var(-1, unbiased=False, keepdim=True) + eps)
        xh = (hf - mu) * rstd  # [M, K]
        g = gf * wf
        dh = rstd * (g - g.mean(-1, keepdim=True) - xh * (g * xh).mean(-1, keepdim=True))
    else:
        rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        xh = hf * rstd
        g = gf * wf
        dh = rstd * (g - xh * (g * xh).mean(-1, keepdim=True))
    dw = (gf * xh).sum(0).to(weight.dtype)
    db = gf.sum(0).to(bias.dtype) if bias is not None else None
    return dh.to(h.dtype), dw, db, None


def _apply_norm(h: torch.Tensor, kind: str, weight: torch.Tensor, bias: torch.Tensor | None,
                eps: float) -> torch.Tensor:
    k = h.shape[-1]
    if kind == "layernorm":
        return torch.nn.functional.layer_norm(h, (k,), weight, bias, eps)
    return torch.nn.functional.rms_norm(h, (k,), weight, eps)


class _AllReduceNormLinear(torch.autograd.Function):
    """forward: all-reduce (+ residual), norm, then GEMM; backward: GEMM, then all-reduce,
    then the norm's backward; the first all-reduce's backward is the identity."""

    @staticmethod
    def forward(ctx: Any, x_partial: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                norm_bias: torch.Tensor | None, w_shard: torch.Tensor, bias: torch.Tensor | None,
                plan: _Plan) -> tuple[torch.Tensor, torch.Tensor]:
        norm = plan.norm  # an ops.Norm of these very parameters (all_reduce_norm_linear, the layer)
        if plan.fused:
            if _compiling():
                y, h = _lib.all_reduce_matmul(x_partial, w_shard.t(), group=plan.group, residual=residual,
                                              norm=norm, config=plan.config)
            else:
                y, h = _ar.all_reduce_matmul(x_partial, w_shard.t(), group=plan.group, residual=residual,
                                             norm=norm, config=plan.config)
        else:
            y, h = _ar.all_reduce_matmul_ref(x_partial, w_shard.t(), group=plan.group, residual=residual, norm=norm)
        if bias is not None:
            y = y + bias  # [M, N/R]
        ctx.plan = plan
        # h [M, K] is kept (it is an output, alive anyway in the residual stream); norm(h)
        # is recomputed in backward for the weight gradient instead of kept
        ctx.save_for_backward(h, norm_weight, norm_bias, w_shard)
        return y, h

    @staticmethod
    @_grads_off
    def backward(ctx: Any, grad_y: torch.Tensor | None, grad_h: torch.Tensor | None) -> tuple:
        h, nw, nb, w_shard = ctx.saved_tensors
        need = ctx.needs_input_grad
        plan = ctx.plan
        kind, eps = plan.norm.kind, plan.norm.eps
        grad_w = grad_b = dnw = dnb = None
        if grad_y is not None:
            grad_y = grad_y.contiguous()  # [M, N/R]
            # the norm's output feeds every rank's columns: its gradient is the sum over ranks
            grad_n = _mm_ar(grad_y, w_shard, plan)  # [M, K]
            dh, dnw, dnb, normed = _norm_backward_with_out(grad_n, h, kind, nw, nb, eps)
            grad_h = dh if grad_h is None else grad_h + dh  # [M, K]
            if need[4]:
                if normed is None:
                    normed = _apply_norm(h, kind, nw, nb, eps)
                grad_w = torch.mm(grad_y.t(), normed)  # [N/R, K]
            if need[5]:
                grad_b = grad_y.sum(0)
        if grad_h is None:
            grad_h = torch.zeros_like(h)
        # h = sum_r x_partial_r + residual: each rank's partial and the residual get all of grad_h
        return (grad_h if need[0] else None, grad_h if need[1] else None, dnw if need[2] else None,
                dnb if need[3] else None, grad_w, grad_b, None)


def _norm_plan(group: Any, fused: bool, config: Any, kind: str, weight: torch.Tensor, bias: torch.Tensor | None,
               eps: float) -> _Plan:
    from ..ops import Norm

    return _Plan(group, fused, config, norm=Norm(kind, weight, bias, float(eps)))


def all_reduce_norm_linear(x_partial: torch.Tensor, w_shard: torch.Tensor, bias: torch.Tensor | None = None, *,
                           residual: torch.Tensor | None, norm_kind: str, norm_weight: torch.Tensor,
                           norm_bias: torch.Tensor | None = None, eps: float = 1e-5, group: Any,
                           fused: bool = True, config: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = all_reduce(x_partial) + residual; return norm(h) @ w_shard.t() + bias, h``.

    The non-sequence-parallel block boundary (``all_reduce_matmul``): a row-parallel
    layer's partial sums reduced into the residual stream, normed, into a column-parallel
    GEMM. backward: GEMM -> all-reduce (``matmul_all_reduce``) gives the norm's output
    gradient, then the norm's backward (``norm_backward``) adds into ``h``'s gradient;
    ``x_partial``'s and ``residual``'s gradients are ``h``'s (the reduction's backward is
    the identity for each rank's partial).

    ============  =========  =================================================
    tensor        shape      meaning
    ============  =========  =================================================
    x_partial     [M, K]     this rank's partial sums
    residual      [M, K]     the residual stream (replicated), or None
    norm_weight   [K]        LayerNorm / RMSNorm weight (replicated)
    norm_bias     [K]        LayerNorm bias, or None
    w_shard       [N/R, K]   this rank's output rows
    bias          [N/R]      this rank's slice, or None
    returns                  y [M, N/R], h [M, K] (the new residual stream)
    ============  =========  =================================================
    """
    return _AllReduceNormLinear.apply(x_partial, residual, norm_weight, norm_bias, w_shard, bias,
                                      _norm_plan(group, fused, config, norm_kind, norm_weight, norm_bias, eps))


# ---- the edges of a region, on plain collectives ----------------------------------------

class _CopyToRegion(torch.autograd.Function):
    """forward: identity; backward: all-reduce. For a replicated tensor (a parameter) used
    on rank-local data, whose gradient is the sum of every rank's part."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        with torch.no_grad():
            return _all_reduce(grad, ctx.group), None


class _CopyToRegionMany(torch.autograd.Function):
    """``_CopyToRegion`` of several tensors of one dtype and device (a norm's weight and
    bias): forward identity each; backward one all-reduce of their gradients concatenated,
    not one each."""

    @staticmethod
    def forward(ctx: Any, group: Any, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.shapes = group, [x.shape for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    @_grads_off
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        # (autograd hands an unused output's gradient in as zeros: materialize_grads)
        flat = torch.cat([g.reshape(-1) for g in grads])  # a new tensor: reduced in place
        if _compiling():
            from torch.distributed import _functional_collectives as funcol

            flat = funcol.all_reduce(flat, "sum", ctx.group)
        else:
            import torch.distributed as tdist

            tdist.all_reduce(flat, group=ctx.group)
        parts = flat.split([shape.numel() for shape in ctx.shapes])
        return (None, *(part.view(shape) for part, shape in zip(parts, ctx.shapes)))


def _copy_to_region_many(xs: list[torch.Tensor], group: Any) -> tuple[torch.Tensor, ...]:
    """``[copy_to_region(x) for x in xs]`` with one all-reduce in backward (one dtype and device)."""
    return _CopyToRegionMany.apply(group, *xs)


class _GatherFromRegion(torch.autograd.Function):
    """forward: all-gather along ``dim``; backward: this rank's slice of the gradient (split)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        with torch.no_grad():
            return _gather_dim(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _split_dim(grad, ctx.group, ctx.dim), None, None


class _ScatterToRegion(torch.autograd.Function):
    """forward: this rank's slice along ``dim`` (split); backward: all-gather the gradient along it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _split_dim(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        with torch.no_grad():
            return _gather_dim(grad, ctx.group, ctx.dim), None, None


def _gather_dim(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """``torch.cat(all_gather(x), dim)``."""
    _, world = _rank_world(group)
    dim = dim % x.dim()
    g = _all_gather_rows(x, group)  # [R * x.shape[0], ...]
    # (R, *x.shape) -> R next to dim -> merged into it
    return g.view(world, *x.shape).movedim(0, dim).reshape(
        *x.shape[:dim], world * x.shape[dim], *x.shape[dim + 1:])


def _split_dim(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """``x.chunk(R, dim)[rank]`` (contiguous)."""
    rank, world = _rank_world(group)
    if x.shape[dim] % world:
        raise ValueError(f"cannot split dim {dim} of {tuple(x.shape)} over {world} ranks")
    n = x.shape[dim] // world
    return x.narrow(dim, rank * n, n).contiguous()


def copy_to_region(x: torch.Tensor, *, group: Any) -> torch.Tensor:
    """``x`` (identity) forward; ``all_reduce(grad)`` backward. For a replicated parameter
    applied to this rank's tokens only (a sequence-parallel norm's weight, a row-parallel
    bias added after the reduce-scatter): its true gradient sums every rank's tokens."""
    return _CopyToRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, *, group: Any, dim: int = -1) -> torch.Tensor:
    """``torch.cat(all_gather(x), dim)`` forward; this rank's slice of ``grad`` backward.
    ``[..., n, ...] -> [..., R * n, ...]`` (a column-parallel output gathered, ``dim=-1``;
    a sequence shard gathered before the head, ``dim`` = the sequence dim)."""
    return _GatherFromRegion.apply(x, group, dim)


def scatter_to_region(x: torch.Tensor, *, group: Any, dim: int = -1) -> torch.Tensor:
    """``x.chunk(R, dim)[rank]`` forward; ``torch.cat(all_gather(grad), dim)`` backward.
    ``[..., n, ...] -> [..., n / R, ...]`` (a replicated input into a row-parallel layer,
    ``dim=-1``; the residual stream split into sequence shards, ``dim`` = the sequence dim)."""
    return _ScatterToRegion.apply(x, group, dim)
