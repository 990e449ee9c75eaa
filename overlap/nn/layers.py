"""Tensor-parallel linear layers (Megatron-LM semantics and weight layout).

    layer                     weight          bias      input                 output
    ColumnParallelLinear      [N/R, K]        [N/R]     [..., K]  replicated  [..., N/R]   (gather_output: [..., N])
      sequence_parallel                                 [T/R, ..., K] shard   [T, ..., N/R]
    RowParallelLinear         [N, K/R]        [N]       [..., K/R]            [..., N]     replicated
      sequence_parallel                                 [T, ..., K/R]         [T/R, ..., N] shard
    NormColumnParallelLinear  [N/R, K]        [N/R]     partial sums [..., K] (y [..., N/R], h [..., K])
      sequence_parallel                                 [T/R, ..., K] shard   (y [T, ..., N/R], h [T/R, ..., K])

R is the group's size; N = ``out_features``, K = ``in_features``. Inputs are 2-D
``[tokens, features]`` or N-D ``[..., features]``: the leading dimensions are flattened into
tokens. Sequence parallel shards dimension ``sequence_dim`` (default 0, Megatron's
``[T, B, C]``; 1 for a batch-first ``[B, T, C]`` stream, which costs a copy of the input and
output to bring T first), which must be a multiple of R at the row-parallel layers.

``overlap=True`` runs the library's fused ops (forward and backward); ``overlap=False``
the same autograd on their plain references (one torch.distributed collective and
``torch.matmul``). On a CPU / gloo group, or dtypes without a tile-flag path, the fused
ops run their references too (with the ops' one-time warning).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..ops._runtime import resolve_group
from . import functional as F

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "NormColumnParallelLinear", "linear_parts"]

_compiling = torch.compiler.is_compiling
_MAX_PLANS = 64  # input signatures a layer keeps a call plan for (token counts vary in inference)


class _CallPlans:
    """A layer's call plans (``functional._Plan``): what its autograd functions read on every
    call (group, fused or plain, config, the group's size, ``save_gathered`` decided),
    made once per input signature and layer setting and looked up by a tuple after.
    The key holds every attribute a plan is made from, so setting ``overlap``, ``config``
    or ``save_gathered`` on the layer makes a new plan; the config by identity (a plan
    keeps it, so its id cannot be reused while the plan lives)."""

    def __init__(self) -> None:
        self.plans: dict[tuple, F._Plan] = {}

    def get(self, key: Any, config: Any, make: Any) -> F._Plan:
        """The plan at ``key()`` (a callable: built only outside a compile, where Dynamo
        traces no ``id()`` of a constant), made by ``make()`` where there is none."""
        if _compiling():  # traced once into the graph: nothing to look up, nothing kept
            return make()
        key = key()
        plan = self.plans.get(key)
        if plan is None or plan.config is not config:
            if len(self.plans) >= _MAX_PLANS:
                self.plans.clear()
            plan = self.plans[key] = make()
        return plan

    def __repr__(self) -> str:
        return f"_CallPlans({len(self.plans)}: {list(self.plans.values())})"


def _group_info(group: Any) -> tuple[Any, int, int]:
    import torch.distributed as tdist

    if not tdist.is_initialized():
        raise RuntimeError("tensor-parallel layers need torch.distributed initialized (overlap.dist.init())")
    group = resolve_group(group)
    return group, tdist.get_world_size(group), tdist.get_rank(group)


def _divisible(what: str, n: int, world: int) -> None:
    if n % world:
        raise ValueError(f"{what}={n} is not a multiple of the tensor-parallel size {world}")


def _init_linear(weight: torch.Tensor, bias: torch.Tensor | None, fan_in: int) -> None:
    """nn.Linear's init for a weight of fan-in ``fan_in`` (the unsharded layer's), on a shard."""
    with torch.no_grad():
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        weight.uniform_(-bound, bound)  # kaiming_uniform(a=sqrt(5)) of nn.Linear: U(-1/sqrt(fan_in), ...)
        if bias is not None:
            bias.uniform_(-bound, bound)


class _MoveRows(torch.autograd.Function):
    """(..., T, ..., C) with T at ``dim`` -> (T * ..., C) contiguous, and back; each pass's
    output and each backward's gradient contiguous in its natural layout. (Autograd's own
    ``movedim`` backward hands the layer's input a gradient in the moved layout: legal,
    but some kernels read such strides wrongly; torch 2.11's CUDA attention backward in
    bf16 did, see docs/experiments.md.)"""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, lead: tuple[int, ...] | None) -> torch.Tensor:
        ctx.dim, ctx.to_rows = dim, lead is None
        if lead is None:  # to rows
            ctx.lead = tuple(x.movedim(dim, 0).shape[:-1])
            return x.movedim(dim, 0).reshape(-1, x.shape[-1])
        ctx.lead = lead
        return x.view(*lead, x.shape[-1]).movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        if ctx.to_rows:
            return g.reshape(*ctx.lead, g.shape[-1]).movedim(0, ctx.dim).contiguous(), None, None
        return g.movedim(ctx.dim, 0).reshape(-1, g.shape[-1]), None, None


class _SequenceDim:
    """Moves the sequence dim first and flattens tokens; and back."""

    @staticmethod
    def to_rows(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, tuple[int, ...]]:
        if dim % x.dim() == x.dim() - 1:
            raise ValueError(f"sequence_dim={dim} is the feature dim of an input of shape {tuple(x.shape)}")
        dim %= x.dim()
        if dim and any(d != 1 for d in x.shape[:dim]):  # (T, ..., C): the rows of one rank's tokens contiguous
            return _MoveRows.apply(x, dim, None), tuple(x.movedim(dim, 0).shape[:-1])  # (T * ..., C)
        # only dims of size 1 before T (batch 1): moving T first is a view, rows already T-major
        lead = (x.shape[dim], *x.shape[:dim], *x.shape[dim + 1:-1])
        return (x if x.dim() == 2 else x.reshape(-1, x.shape[-1])), lead  # (T * ..., C)

    @staticmethod
    def from_rows(y: torch.Tensor, lead: tuple[int, ...], dim: int) -> torch.Tensor:
        dim %= len(lead) + 1
        if dim and any(d != 1 for d in lead[1:dim + 1]):
            return _MoveRows.apply(y, dim, lead)
        if len(lead) == 1:
            return y  # (T', N)
        return y.view(*lead[1:dim + 1], lead[0], *lead[dim + 1:], y.shape[-1])  # (1, ..., T', ..., N)


def linear_parts(linear: nn.Module) -> tuple[int, int, torch.Tensor, torch.Tensor | None]:
    """``(in_features, out_features, weight [N, K], bias)`` of a linear-like module: an
    ``nn.Linear`` or a subclass that keeps ``nn.Linear.forward`` (torchtitan's), or a GPT-2
    ``Conv1D`` (``x @ weight + bias``, weight [K, N]: returned transposed, a view). Anything
    else raises ``TypeError`` naming the class."""
    if isinstance(linear, nn.Linear):
        if type(linear).forward is not nn.Linear.forward:
            raise TypeError(f"{type(linear).__name__} subclasses nn.Linear but overrides forward; its forward "
                            "would be lost: convert it yourself or leave it out of the plan")
        return linear.in_features, linear.out_features, linear.weight, linear.bias
    if is_conv1d(linear):
        return linear.weight.shape[0], linear.weight.shape[1], linear.weight.t(), linear.bias
    raise TypeError(f"{type(linear).__name__} is not nn.Linear (or a subclass keeping its forward) nor "
                    "transformers' Conv1D")


def is_conv1d(m: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2): ``x @ weight + bias`` with weight [K, N]."""
    t = type(m)
    return (t.__name__ == "Conv1D" and t.__module__.startswith("transformers.")
            and getattr(m, "weight", None) is not None and m.weight.dim() == 2 and m.weight.shape[1] == m.nf)


class ColumnParallelLinear(nn.Module):
    """``y = x @ w.t() + b`` with the output features split over ranks: ``w_shard_n = w[rank rows]``.

    =================  =============  ==============================================
    tensor             shape          meaning
    =================  =============  ==============================================
    weight             [N/R, K]       this rank's output rows of the nn.Linear weight
    bias               [N/R]          this rank's slice
    x                  [..., K]       replicated (sequence_parallel: [T/R, ..., K])
    returns            [..., N/R]     this rank's features (sequence_parallel: all T;
                                      gather_output: all N features)
    =================  =============  ==============================================

    Autograd pairs (``overlap.nn.functional``): ``copy_linear`` (forward local GEMM,
    backward GEMM -> all-reduce), or with ``sequence_parallel`` ``all_gather_linear``
    (forward all-gather -> GEMM, backward GEMM -> reduce-scatter). ``save_gathered``
    (sequence parallel): True keeps the gathered input for the weight gradient, False keeps
    the input shard and all-gathers it again in backward behind the input gradient's GEMM,
    "auto" (default) picks per shape (``overlap.nn.functional.regather_plan``).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, group: Any = None,
                 sequence_parallel: bool = False, gather_output: bool = False, config: Any = None,
                 overlap: bool = True, device: Any = None, dtype: torch.dtype | None = None,
                 save_gathered: F.SaveGathered = "auto", sequence_dim: int = 0) -> None:
        super().__init__()
        self.group, self.tp_size, self.tp_rank = _group_info(group)
        _divisible("out_features", out_features, self.tp_size)
        F._check_save_gathered(save_gathered)
        if sequence_parallel and gather_output:
            raise ValueError("gather_output=True with sequence_parallel=True: a sequence-parallel column layer's "
                             "output feeds a row-parallel layer, split by features")
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel, self.gather_output = sequence_parallel, gather_output
        self.config, self.overlap = config, overlap
        self.save_gathered, self.sequence_dim = save_gathered, sequence_dim
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features // self.tp_size, in_features, **kw))  # [N/R, K]
        self.bias = nn.Parameter(torch.empty(out_features // self.tp_size, **kw)) if bias else None
        _init_linear(self.weight, self.bias, in_features)
        self._fusion: Any = None  # set by parallelize: the layers that share this one's input
        self._plans = _CallPlans()

    def _plan(self, x2: torch.Tensor) -> F._Plan:
        """The call plan for input rows ``x2`` [tokens, K] at the layer's settings."""
        sp, save = self.sequence_parallel, self.save_gathered

        def key() -> tuple:
            if sp and save == "auto":
                return x2.shape[0], x2.dtype, self.overlap, id(self.config), save
            return self.overlap, id(self.config), save

        def make() -> F._Plan:
            keep = save
            if sp and save == "auto":
                world = self.tp_size
                keep = not F.regather_plan(world * x2.shape[0], self.weight.shape[0], x2.shape[1], world,
                                           x2.dtype).regather
            F._check_save_gathered(keep)
            return F._Plan(self.group, self.overlap, self.config, save_gathered=keep, world=self.tp_size)

        return self._plans.get(key, self.config, make)

    @classmethod
    def from_linear(cls, linear: nn.Module, *, group: Any = None, sequence_parallel: bool = False,
                    index: torch.Tensor | None = None, **kwargs: Any) -> "ColumnParallelLinear":
        """This rank's output rows of ``linear`` (the same on every rank that passes the same layer):
        an ``nn.Linear`` (or a subclass that keeps its forward) or a GPT-2 ``Conv1D`` (weight
        [K, N]). ``index``: the N/R rows to take (a fused projection's per-rank blocks);
        default the rank's contiguous block. Kept as ``shard_index``."""
        k, n_all, w, b = linear_parts(linear)  # w [N, K]
        # with an index, the rank holds its rows (replicated key/value heads: more than N/R)
        n_layer = n_all if index is None else len(index) * _group_info(group)[1]
        m = cls(k, n_layer, bias=b is not None, group=group, sequence_parallel=sequence_parallel, device=w.device,
                dtype=w.dtype, **kwargs)
        m.out_features = n_all
        n = m.weight.shape[0]
        idx = torch.arange(m.tp_rank * n, (m.tp_rank + 1) * n) if index is None else index
        if index is not None and (idx.min() < 0 or idx.max() >= n_all):
            raise ValueError(f"index rows outside [0, {n_all})")
        with torch.no_grad():
            m.weight.copy_(w[idx.to(w.device)])
            if m.bias is not None:
                m.bias.copy_(b[idx.to(b.device)])
        m.shard_index, m.source_transposed = idx, w is not linear.weight
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fusion is not None:  # one of several column layers on one input (parallelize)
            return self._fusion(self, x)
        if self.sequence_parallel:
            x2, lead = _SequenceDim.to_rows(x, self.sequence_dim)  # [T/R * ..., K]
            y = F._AllGatherLinear.apply(x2, self.weight, self.bias, self._plan(x2))  # [T * ..., N/R]
            return _SequenceDim.from_rows(y, (self.tp_size * lead[0], *lead[1:]), self.sequence_dim)
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [tokens, K]
        y = F._CopyLinear.apply(x2, self.weight, self.bias, self._plan(x2))  # [tokens, N/R]
        if x2 is not x:
            y = y.view(*x.shape[:-1], y.shape[-1])  # (..., N/R)
        return F.gather_from_region(y, group=self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (/{self.tp_size}), "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}, "
                f"gather_output={self.gather_output}, overlap={self.overlap}"
                + (f", save_gathered={self.save_gathered}" if self.sequence_parallel else ""))


class RowParallelLinear(nn.Module):
    """``y = x @ w.t() + b`` with the input features split over ranks: ``w_shard_k = w[:, rank columns]``.

    =================  =============  ==============================================
    tensor             shape          meaning
    =================  =============  ==============================================
    weight             [N, K/R]       this rank's input columns of the nn.Linear weight
    bias               [N]            replicated, added once after the reduction
    x                  [..., K/R]     this rank's features (input_is_parallel=False:
                                      [..., K], split here)
    returns            [..., N]       the sum over ranks (sequence_parallel: this rank's
                                      T/R tokens of it; reduce_output=False: this rank's
                                      partial sum, no bias)
    =================  =============  ==============================================

    Autograd pairs: ``linear_all_reduce`` (forward GEMM -> all-reduce, backward local GEMM),
    or with ``sequence_parallel`` ``linear_reduce_scatter`` (forward GEMM -> reduce-scatter,
    backward all-gather -> GEMM; the bias through ``copy_to_region``, whose backward sums
    every rank's tokens). ``reduce_output=False`` leaves the reduction to the next layer
    (``NormColumnParallelLinear``, which takes this layer's bias as ``input_bias``).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, group: Any = None,
                 sequence_parallel: bool = False, input_is_parallel: bool = True, config: Any = None,
                 overlap: bool = True, device: Any = None, dtype: torch.dtype | None = None,
                 reduce_output: bool = True, sequence_dim: int = 0) -> None:
        super().__init__()
        self.group, self.tp_size, self.tp_rank = _group_info(group)
        _divisible("in_features", in_features, self.tp_size)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True: the input of a "
                             "sequence-parallel row layer comes split by features from a column layer")
        if sequence_parallel and not reduce_output:
            raise ValueError("reduce_output=False with sequence_parallel=True: the reduce-scatter is the "
                             "sequence-parallel layer's output")
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel, self.input_is_parallel = sequence_parallel, input_is_parallel
        self.config, self.overlap = config, overlap
        self.reduce_output, self.sequence_dim = reduce_output, sequence_dim
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features // self.tp_size, **kw))  # [N, K/R]
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        _init_linear(self.weight, self.bias, in_features)
        self._plans = _CallPlans()

    def _plan(self) -> F._Plan:
        return self._plans.get(lambda: (self.overlap, id(self.config)), self.config,
                               lambda: F._Plan(self.group, self.overlap, self.config, world=self.tp_size))

    @classmethod
    def from_linear(cls, linear: nn.Module, *, group: Any = None, sequence_parallel: bool = False,
                    **kwargs: Any) -> "RowParallelLinear":
        """This rank's input columns of ``linear`` (an ``nn.Linear``, a subclass that keeps its
        forward, or a GPT-2 ``Conv1D``); the bias whole (the same on every rank)."""
        k_all, n_all, w, b = linear_parts(linear)  # w [N, K]
        m = cls(k_all, n_all, bias=b is not None, group=group, sequence_parallel=sequence_parallel,
                device=w.device, dtype=w.dtype, **kwargs)
        k = m.in_features // m.tp_size
        with torch.no_grad():
            m.weight.copy_(w[:, m.tp_rank * k:(m.tp_rank + 1) * k])
            if m.bias is not None:
                m.bias.copy_(b)
        m.shard_index, m.source_transposed = torch.arange(m.tp_rank * k, (m.tp_rank + 1) * k), w is not linear.weight
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = F.scatter_to_region(x, group=self.group)  # (..., K) -> (..., K/R)
        if self.sequence_parallel:
            x2, lead = _SequenceDim.to_rows(x, self.sequence_dim)  # [T * ..., K/R]
            if lead[0] % self.tp_size:
                raise ValueError(f"sequence_parallel: the sequence dim ({lead[0]} tokens) is not a multiple of "
                                 f"the tensor-parallel size {self.tp_size}")
            # (+ bias after the reduction; its gradient summed over every rank's rows)
            y = F._LinearReduceScatter.apply(x2, self.weight, self.bias, self._plan())  # [T/R * ..., N]
            return _SequenceDim.from_rows(y, (lead[0] // self.tp_size, *lead[1:]), self.sequence_dim)
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [tokens, K/R]
        if not self.reduce_output:
            # the partial sum; its all-reduce's backward (the identity) is plain autograd's
            y = torch.nn.functional.linear(x2, self.weight)
        else:
            y = F._LinearAllReduce.apply(x2, self.weight, self.bias, self._plan())  # [tokens, N]
        return y if x2 is x else y.view(*x.shape[:-1], y.shape[-1])  # (..., N)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (/{self.tp_size}), out_features={self.out_features}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}, "
                f"input_is_parallel={self.input_is_parallel}, reduce_output={self.reduce_output}, "
                f"overlap={self.overlap}")


class NormColumnParallelLinear(nn.Module):
    """The block boundary as one layer:
    ``h = all_reduce(x_partial) + input_bias + residual; return norm(h) @ w_shard.t() + b, h``.

    =================  =============  ==============================================
    tensor             shape          meaning
    =================  =============  ==============================================
    norm.weight/bias   [K]            replicated LayerNorm / RMSNorm parameters
    weight             [N/R, K]       this rank's output rows
    bias               [N/R]          this rank's slice
    x                  [..., K]       this rank's partial sums (from a
                                      ``RowParallelLinear(reduce_output=False)``);
                                      sequence_parallel: [T/R, ..., K], already
                                      reduce-scattered, so h = x + input_bias + residual
    residual           like x         the residual stream, or None
    input_bias         [K]            the producing row layer's bias, added once, or None
    returns                           y [..., N/R] (sequence_parallel: all T tokens),
                                      h like x (the new residual stream)
    =================  =============  ==============================================

    Not sequence-parallel: one ``all_reduce_matmul`` forward (``all_reduce_norm_linear``;
    backward GEMM -> all-reduce, then the norm's backward). Sequence-parallel: the add and
    the norm on this rank's tokens (torch ops; the norm's parameters through
    ``copy_to_region``, whose backward sums every rank's part), then ``all_gather_linear``.
    ``norm``: "layernorm" or "rmsnorm". ``save_gathered``: as ``ColumnParallelLinear``'s.
    """

    def __init__(self, in_features: int, out_features: int, *, norm: str = "layernorm", eps: float = 1e-5,
                 norm_bias: bool = True, bias: bool = True, group: Any = None, sequence_parallel: bool = False,
                 config: Any = None, overlap: bool = True, device: Any = None, dtype: torch.dtype | None = None,
                 save_gathered: F.SaveGathered = "auto", sequence_dim: int = 0) -> None:
        super().__init__()
        self.group, self.tp_size, self.tp_rank = _group_info(group)
        _divisible("out_features", out_features, self.tp_size)
        F._check_save_gathered(save_gathered)
        if norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {norm!r}")
        if norm == "rmsnorm" and norm_bias:
            norm_bias = False  # RMSNorm has none
        kw = {"device": device, "dtype": dtype}
        self.norm_kind, self.eps = norm, float(eps)
        self.norm = (nn.LayerNorm(in_features, eps=eps, bias=norm_bias, **kw) if norm == "layernorm"
                     else nn.RMSNorm(in_features, eps=eps, **kw))
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel, self.config, self.overlap = sequence_parallel, config, overlap
        self.save_gathered, self.sequence_dim = save_gathered, sequence_dim
        self.weight = nn.Parameter(torch.empty(out_features // self.tp_size, in_features, **kw))  # [N/R, K]
        self.bias = nn.Parameter(torch.empty(out_features // self.tp_size, **kw)) if bias else None
        _init_linear(self.weight, self.bias, in_features)
        self._plans = _CallPlans()

    _plan = ColumnParallelLinear._plan  # sequence-parallel: the column layer's, on the normed rows

    def _norm_plan(self, nw: torch.Tensor, nb: torch.Tensor | None) -> F._Plan:
        """Not sequence-parallel: the call plan with the op's ``Norm`` of these parameters."""
        # (the plan's Norm keeps nw and nb alive: their ids in the key cannot be reused meanwhile)
        return self._plans.get(lambda: (self.overlap, id(self.config), self.norm_kind, self.eps, id(nw), id(nb)),
                               self.config, lambda: F._norm_plan(self.group, self.overlap, self.config,
                                                                 self.norm_kind, nw, nb, self.eps))

    @classmethod
    def from_modules(cls, norm: nn.Module, linear: nn.Linear, *, group: Any = None,
                     sequence_parallel: bool = False, **kwargs: Any) -> "NormColumnParallelLinear":
        """From a ``nn.LayerNorm`` / ``nn.RMSNorm`` and the ``nn.Linear`` it feeds: the norm
        copied, this rank's output rows of the linear."""
        kind = "layernorm" if isinstance(norm, nn.LayerNorm) else "rmsnorm"
        eps = norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps
        w = linear.weight
        m = cls(linear.in_features, linear.out_features, norm=kind, eps=eps,
                norm_bias=getattr(norm, "bias", None) is not None, bias=linear.bias is not None, group=group,
                sequence_parallel=sequence_parallel, device=w.device, dtype=w.dtype, **kwargs)
        n = m.out_features // m.tp_size
        with torch.no_grad():
            m.norm.load_state_dict(norm.state_dict())
            m.weight.copy_(w[m.tp_rank * n:(m.tp_rank + 1) * n])
            if m.bias is not None:
                m.bias.copy_(linear.bias[m.tp_rank * n:(m.tp_rank + 1) * n])
        return m

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, *,
                input_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        nw, nb = self.norm.weight, getattr(self.norm, "bias", None)
        if residual is not None and residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must have the input's shape {tuple(x.shape)}")
        if self.sequence_parallel:
            # this rank's tokens only: the replicated parameters' gradients sum over ranks
            h = x
            if input_bias is not None:
                h = h + F.copy_to_region(input_bias, group=self.group)
            if residual is not None:
                h = h + residual
            k = h.shape[-1]
            nw_ = F.copy_to_region(nw, group=self.group)
            nb_ = None if nb is None else F.copy_to_region(nb, group=self.group)
            n = (torch.nn.functional.layer_norm(h, (k,), nw_, nb_, self.eps) if self.norm_kind == "layernorm"
                 else torch.nn.functional.rms_norm(h, (k,), nw_, self.eps))
            n2, lead = _SequenceDim.to_rows(n, self.sequence_dim)  # [T/R * ..., K]
            y = F._AllGatherLinear.apply(n2, self.weight, self.bias, self._plan(n2))  # [T * ..., N/R]
            return _SequenceDim.from_rows(y, (self.tp_size * lead[0], *lead[1:]), self.sequence_dim), h
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [tokens, K]
        r2 = None if residual is None else residual.reshape(x2.shape)  # [tokens, K]
        if input_bias is not None:
            r2 = input_bias.expand(x2.shape) if r2 is None else r2 + input_bias  # once, after the reduction
        y, h = F._AllReduceNormLinear.apply(x2, r2, nw, nb, self.weight, self.bias,
                                            self._norm_plan(nw, nb))  # [tokens, N/R], [tokens, K]
        if x2 is x:
            return y, h
        return y.view(*x.shape[:-1], y.shape[-1]), h.view(x.shape)  # (..., N/R), (..., K)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (/{self.tp_size}), "
                f"norm={self.norm_kind}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}, overlap={self.overlap}"
                + (f", save_gathered={self.save_gathered}" if self.sequence_parallel else ""))
