"""Replicated parameters applied to this rank's part of the data (a norm on this rank's
tokens, a per-head norm on this rank's heads): their gradients summed over the group."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import functional as F
from .layers import _group_info

__all__ = ["ReplicatedParameters", "SequenceParallelNorm", "check_norm_like"]


class ReplicatedParameters(nn.Module):
    """Runs ``module`` with its parameters through ``copy_to_region`` (forward identity,
    backward all-reduce): for replicated parameters applied to this rank's part of the data
    only (a norm on this rank's tokens, a per-head norm on this rank's heads), whose true
    gradient sums every rank's part. Holds the parameters under their own names, so a
    state dict keeps its keys; the module itself is kept outside the module tree."""

    def __init__(self, module: nn.Module, group: Any) -> None:
        super().__init__()
        self.__dict__["inner"] = module  # not a submodule: its parameters are registered here, once
        for n, p in module.named_parameters(recurse=False):
            self.register_parameter(n, p)
        self.group, self.tp_size, self.tp_rank = _group_info(group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = self.inner
        if len(args) == 1 and not kwargs and type(inner) in (nn.LayerNorm, nn.RMSNorm) and not _hooked(inner):
            # torch's own norms called directly: functional_call swaps every parameter of the
            # module in and out on each call, some two hundred Python calls for a norm (a
            # module with hooks or a replaced forward goes through its own call, below)
            p = self._parameters
            w, b = p.get("weight"), p.get("bias") if type(inner) is nn.LayerNorm else None
            if w is not None and b is not None and w.dtype == b.dtype and w.device == b.device:
                w, b = F._copy_to_region_many([w, b], self.group)  # one all-reduce of both gradients
            else:
                w = None if w is None else F.copy_to_region(w, group=self.group)
                b = None if b is None else F.copy_to_region(b, group=self.group)
            if type(inner) is nn.LayerNorm:
                return torch.nn.functional.layer_norm(args[0], inner.normalized_shape, w, b, inner.eps)
            return torch.nn.functional.rms_norm(args[0], inner.normalized_shape, w, inner.eps)
        params = {n: F.copy_to_region(p, group=self.group) for n, p in self._parameters.items() if p is not None}
        return torch.func.functional_call(self.inner, params, args, kwargs)

    def train(self, mode: bool = True) -> "ReplicatedParameters":
        self.inner.train(mode)  # outside the module tree: told here
        return super().train(mode)

    def extra_repr(self) -> str:
        return f"{self.inner!r}, gradients summed over {self.tp_size} ranks"


from torch.nn.modules import module as _mm  # noqa: E402

_GLOBAL_HOOKS = tuple(getattr(_mm, g, {}) for g in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                                    "_global_backward_hooks", "_global_backward_pre_hooks"))
"""torch's global module hooks (dicts it fills in place)."""


def _hooked(m: nn.Module) -> bool:
    """``m`` has hooks of its own or global ones, or a forward set on the instance: calling
    torch's norm directly would skip what its call runs."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                or "forward" in m.__dict__ or any(_GLOBAL_HOOKS))


def check_norm_like(name: str, m: nn.Module) -> None:
    """A LayerNorm- or RMSNorm-like module: parameters ``weight`` [C] (and ``bias`` [C]) only,
    no children, no buffers, and row-wise (an output row depends on its input row only)."""
    params = dict(m.named_parameters())
    ok = ("weight" in params and set(params) <= {"weight", "bias"} and not list(m.children())
          and not list(m.buffers()) and all(p.dim() == 1 and p.shape == params["weight"].shape
                                            for p in params.values()))
    if not ok:
        raise ValueError(f"parallelize: {name} ({type(m).__name__}, parameters "
                         f"{ {n: tuple(p.shape) for n, p in params.items()} }) holds parameters inside the "
                         "sequence-parallel region and is not a norm (weight [C], optional bias [C]); its "
                         "gradient would be wrong. Pass a plan, or use sequence_parallel=False")
    w = params["weight"]
    if w.device.type == "meta":
        return
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, w.shape[0], generator=g).to(w.device, w.dtype)
    x2 = x.clone()
    x2[1] = torch.randn(w.shape[0], generator=g).to(w.device, w.dtype)
    try:
        with torch.no_grad():
            y, y2 = m(x), m(x2)
    except Exception as e:  # noqa: BLE001 - any failure means: not a norm we can run on a shard
        raise ValueError(f"parallelize: {name} ({type(m).__name__}) failed on a [3, {w.shape[0]}] input ({e}); "
                         "sequence parallelism needs its norms row-wise") from None
    if not (isinstance(y, torch.Tensor) and y.shape == x.shape and torch.allclose(y[0], y2[0])
            and torch.allclose(y[2], y2[2])):
        raise ValueError(f"parallelize: {name} ({type(m).__name__}) is not row-wise (an output row depends on "
                         "other rows); sequence parallelism cannot run it on this rank's tokens")


class SequenceParallelNorm(ReplicatedParameters):
    """A norm of any class (LayerNorm- or RMSNorm-like: ``weight`` [C], optional ``bias``
    [C], row-wise) run on this rank's tokens, its parameters' gradients summed over the
    group (and so the same on every rank)."""

    def __init__(self, norm: nn.Module, group: Any, name: str = "norm") -> None:
        check_norm_like(name, norm)
        super().__init__(norm, group)
