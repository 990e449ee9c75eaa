"""Tensor parallelism applied to a plain single-device model from outside (gpt-fast's ``tp.py``).

The model holds no distributed code; ``parallelize`` swaps its ``nn.Linear`` modules for
column- / row-parallel layers in place, by a plan of module-name patterns.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from . import functional as F
from .layers import ColumnParallelLinear, RowParallelLinear, _group_info

__all__ = ["parallelize", "DEFAULT_PLAN", "SEQUENCE_PARALLEL_PLAN", "SequenceParallelNorm"]

DEFAULT_PLAN: dict[str, str] = {
    "*attn.qkv": "column",
    "*attn.proj": "row",
    "*mlp.fc1": "column",
    "*mlp.fc2": "row",
}
"""``overlap.models.gpt.GPT``: attention heads and the MLP's hidden features split over ranks."""

SEQUENCE_PARALLEL_PLAN: dict[str, str] = {
    **DEFAULT_PLAN,
    "*ln_1": "sequence_norm",
    "*ln_2": "sequence_norm",
    "drop": "scatter_sequence",
    "ln_f": "gather_sequence",
}
"""The default plan with ``sequence_parallel=True``: the residual stream split into sequence
shards after the embeddings' dropout and gathered before the final norm; the blocks' norms
run on this rank's tokens."""

_KINDS = ("column", "row", "sequence_norm", "scatter_sequence", "gather_sequence")


class SequenceParallelNorm(nn.Module):
    """A LayerNorm / RMSNorm run on this rank's tokens: ``norm(x)`` with the parameters through
    ``copy_to_region`` (forward identity, backward all-reduce: their gradients sum every
    rank's tokens, and stay the same on every rank). Holds the norm's own parameters under
    the same names (``weight``, ``bias``), so a state dict keeps its keys."""

    def __init__(self, norm: nn.Module, group: Any) -> None:
        super().__init__()
        if not isinstance(norm, (nn.LayerNorm, nn.RMSNorm)) or len(norm.normalized_shape) != 1:
            raise TypeError(f"sequence_norm needs a LayerNorm or RMSNorm over one dim, got {norm}")
        self.kind = "layernorm" if isinstance(norm, nn.LayerNorm) else "rmsnorm"
        self.eps = norm.eps
        self.weight = norm.weight
        self.bias = getattr(norm, "bias", None)
        self.group, self.tp_size, self.tp_rank = _group_info(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        w = None if self.weight is None else F.copy_to_region(self.weight, group=self.group)
        if self.kind == "layernorm":
            b = None if self.bias is None else F.copy_to_region(self.bias, group=self.group)
            return torch.nn.functional.layer_norm(x, (k,), w, b, self.eps)
        return torch.nn.functional.rms_norm(x, (k,), w, self.eps)


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern)


def parallelize(model: nn.Module, group: Any = None, plan: Mapping[str, str] | None = None, *,
                sequence_parallel: bool = False, config: Any = None, overlap: bool = True,
                sequence_dim: int = 1) -> nn.Module:
    """Apply tensor parallelism to ``model`` in place and return it.

    ``plan`` maps module-name patterns (``fnmatch`` on the qualified name, e.g. ``"*attn.qkv"``
    matches ``h.0.attn.qkv``) to what the module becomes:

    ==================  ===========================================================
    kind                the module (must be) -> becomes
    ==================  ===========================================================
    "column"            nn.Linear -> ``ColumnParallelLinear.from_linear`` (this rank's
                        output rows; its outputs [..., N/R])
    "row"               nn.Linear -> ``RowParallelLinear.from_linear`` (this rank's
                        input columns; its outputs reduced)
    "sequence_norm"     LayerNorm / RMSNorm -> ``SequenceParallelNorm`` (sequence_parallel)
    "scatter_sequence"  any: its output split along ``sequence_dim`` (this rank's shard)
    "gather_sequence"   any: its input gathered along ``sequence_dim`` first
    ==================  ===========================================================

    Default: ``DEFAULT_PLAN`` (the GPT of ``overlap.models.gpt``: attention ``qkv`` column,
    ``proj`` row, MLP ``fc1`` column, ``fc2`` row), ``SEQUENCE_PARALLEL_PLAN`` with
    ``sequence_parallel=True`` (adds the norms and the edges of the sequence-parallel region).

    What the model must do (coordination): modules are replaced in place (``setattr`` on
    the parent), so the model must read the sizes it needs at run time, not cache them at
    construction: attention reads its local head count from the qkv output,
    ``nh = qkv.shape[-1] // (3 * head_dim)``, and the qkv output features must be laid out
    per head so that a contiguous slice is whole heads. Every replaced layer, and the
    model, gets ``.tp_size`` (and the layers ``.tp_rank``, ``.group``). With
    ``sequence_parallel`` the residual stream between the scatter and the gather is
    ``[B, T/R, C]`` (``sequence_dim=1``, batch-first; T a multiple of R), and a column
    layer returns the whole sequence ``[B, T, N/R]``. Dropout inside that region draws
    per-rank masks.

    Deterministic: every rank must pass the same unsharded model (same seed); each keeps
    its slices. Raises ``ValueError`` for a pattern that matches nothing, a kind it does not
    know, or sizes not divisible by the group's size.
    """
    group, world, _ = _group_info(group)
    if plan is None:
        plan = SEQUENCE_PARALLEL_PLAN if sequence_parallel else DEFAULT_PLAN
    for pattern, kind in plan.items():
        if kind not in _KINDS:
            raise ValueError(f"plan[{pattern!r}] = {kind!r}; kinds: {_KINDS}")
        if kind in ("sequence_norm", "scatter_sequence", "gather_sequence") and not sequence_parallel:
            raise ValueError(f"plan[{pattern!r}] = {kind!r} needs sequence_parallel=True")
    hits = {p: 0 for p in plan}
    for name, module in list(model.named_modules()):
        kinds = [(p, k) for p, k in plan.items() if name and _matches(name, p)]
        if not kinds:
            continue
        if len(kinds) > 1:
            raise ValueError(f"module {name!r} matches several plan entries: {kinds}")
        pattern, kind = kinds[0]
        hits[pattern] += 1
        new = _convert(name, module, kind, group, sequence_parallel, config, overlap, sequence_dim)
        if new is not module:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    missing = [p for p, n in hits.items() if not n]
    if missing:
        raise ValueError(f"plan patterns matched no module: {missing}")
    model.tp_size = world
    return model


def _convert(name: str, module: nn.Module, kind: str, group: Any, sequence_parallel: bool, config: Any,
             overlap: bool, sequence_dim: int) -> nn.Module:
    if kind in ("column", "row"):
        if type(module) is not nn.Linear:
            raise TypeError(f"plan: {name!r} is {type(module).__name__}, not nn.Linear")
        cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
        try:
            return cls.from_linear(module, group=group, sequence_parallel=sequence_parallel, config=config,
                                   overlap=overlap, sequence_dim=sequence_dim if sequence_parallel else 0)
        except ValueError as e:
            raise ValueError(f"plan: {name!r}: {e}") from None
    if kind == "sequence_norm":
        return SequenceParallelNorm(module, group)
    if kind == "scatter_sequence":
        module.register_forward_hook(
            lambda _m, _args, out: F.scatter_to_region(out, group=group, dim=sequence_dim))
        return module
    module.register_forward_pre_hook(  # gather_sequence
        lambda _m, args: (F.gather_from_region(args[0], group=group, dim=sequence_dim), *args[1:]))
    return module
