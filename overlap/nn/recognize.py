"""What ``parallelize`` does to a model given without a plan: found from the module structure
and the head counts, never from a list of module names.

    decoder stack   the ``nn.ModuleList`` (or ``ModuleDict``, torchtitan's) whose every entry
                    holds one attention module
    attention       a module with a head count (``num_heads``, ``n_head``, ...; or the model
                    config's) or a ``head_dim``, whose direct linear children are its input
                    projections (q, k, v; or one fused [q | k | v]) and its output projection
    MLP             any other module of a block with two or more direct linear children:
                    input projections (up; gate and up; or one fused [gate | up]) and the
                    output projection (down)
    linear          ``nn.Linear`` or a subclass keeping its forward, or transformers' Conv1D

The output projection is the child whose output width is the block's hidden size and whose
input is the heads' (the MLP's inner) width; where two children fit, the last registered.
Every input projection reads the hidden size. Anything in a block that does not fit (a
linear outside a unit, a router, parameters on the attention module itself, a module
holding parameters that is neither a unit nor a norm) raises ``ValueError`` naming it:
then pass a ``plan``.

A fused projection's output is assumed laid out in whole segments ([q | k | v] as GPT-2,
nanoGPT and gpt-fast do; [gate | up] as Phi-3 does), and each rank takes its part of every
segment, so that the module's own ``split`` / ``chunk`` of its local output gives its own
heads (``split_size`` and the head counts set to the local ones). Fewer key/value heads
than ranks, the ranks a multiple of them: each one replicated on the ranks whose query
heads read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .layers import is_conv1d

__all__ = ["Segment", "Unit", "Recognized", "recognize", "is_linear", "is_attention", "head_counts", "local_attrs"]

HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
KV_ATTRS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_local_heads")
WIDTH_ATTRS = ("embed_dim", "split_size", "all_head_size", "dim", "n_embd", "inner_dim")
GROUP_ATTRS = ("num_key_value_groups", "n_rep")

Segment = tuple[int, "int | None"]
"""A part of a projection's output: (width, None) split over the ranks in contiguous blocks;
(width, n) n key/value heads each replicated on world / n ranks (rank r takes head r n / world)."""


def is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or is_conv1d(m)


def _dims(m: nn.Module) -> tuple[int, int]:
    """(in, out) of a linear-like module."""
    if isinstance(m, nn.Linear):
        return m.in_features, m.out_features
    return m.weight.shape[0], m.weight.shape[1]  # Conv1D: [K, N]


def _int_attr(obj: Any, names: tuple[str, ...]) -> int | None:
    for n in names:
        v = getattr(obj, n, None) if obj is not None else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _config_of(model: nn.Module) -> Any:
    for name in ("config", "model_args", "args", "params"):
        c = getattr(model, name, None)
        if c is not None and not isinstance(c, (nn.Module, torch.Tensor)):
            return c
    return None


def head_counts(attn: nn.Module, config: Any) -> tuple[int | None, int | None, int | None]:
    """(query heads, key/value heads, head dim) of an attention module: its own attributes
    first, then the model config's; None where neither says."""
    own = getattr(attn, "config", None)
    nh = _int_attr(attn, HEAD_ATTRS) or _int_attr(own, HEAD_ATTRS) or _int_attr(config, HEAD_ATTRS)
    nkv = _int_attr(attn, KV_ATTRS) or _int_attr(own, KV_ATTRS[:3]) or _int_attr(config, KV_ATTRS[:3]) or nh
    hd = _int_attr(attn, ("head_dim",)) or _int_attr(own, ("head_dim",)) or _int_attr(config, ("head_dim",))
    return nh, nkv, hd


def local_attrs(m: nn.Module, nh: int, nkv: int, hd: int, world: int) -> dict[str, int]:
    """The attention module's head counts and head widths, as the local ones: attribute -> value."""
    attrs: dict[str, int] = {}
    for names, glob in ((HEAD_ATTRS, nh), (KV_ATTRS, nkv), (WIDTH_ATTRS, nh * hd)):
        for a in names:
            if _int_attr(m, (a,)) == glob:
                attrs[a] = glob // world
    return attrs


def is_attention(m: nn.Module) -> bool:
    """A module with a head count or a head_dim of its own."""
    return _int_attr(m, HEAD_ATTRS) is not None or _int_attr(m, ("head_dim",)) is not None


@dataclass
class Unit:
    """An attention or MLP module: what its linears become."""

    name: str
    module: nn.Module
    kind: str  # "attention" | "mlp"
    inputs: list[str]  # the column children, registration order
    segments: dict[str, list[Segment]]  # child -> its output's segments (one entry: not fused)
    output: str  # the row child
    attrs: dict[str, int] = field(default_factory=dict)  # attribute -> local value (heads, widths)
    per_head: list[str] = field(default_factory=list)  # children with per-head parameters (q_norm, k_norm)
    local_width: int | None = None  # attention: this rank's query heads x head_dim


@dataclass
class Recognized:
    units: list[Unit]
    stack_name: str
    blocks: list[nn.Module]  # in call order (the list's, or the dict's insertion order)
    norms: list[str]  # qualified names of the parameter-holding non-unit modules inside blocks


def _fail(name: str, what: str) -> ValueError:
    return ValueError(f"parallelize: {name or 'the model'}: {what}. Pass a plan "
                      "(overlap.nn.parallelize(model, plan={pattern: kind})) for this model, see docs/nn.md")


def _split_unit(name: str, m: nn.Module) -> tuple[list[tuple[str, int, int]], tuple[str, int, int]]:
    """The input projections and the output projection among ``m``'s direct linear children."""
    lins = [(c, *_dims(ch)) for c, ch in m.named_children() if is_linear(ch)]
    c_in = lins[0][1]  # the first registered projection reads the hidden size
    outs = [l for l in lins[1:] if l[2] == c_in]
    if not outs:
        raise _fail(name, f"no linear child maps back to the hidden size {c_in} (children: {lins})")
    wide = [l for l in outs if l[1] != c_in]
    out = (wide or outs)[-1]
    ins = [l for l in lins if l is not out]
    bad = [l for l in ins if l[1] != c_in]
    if bad:
        raise _fail(name, f"linear children {[b[0] for b in bad]} read {[b[1] for b in bad]} features, "
                          f"not the hidden size {c_in}")
    return ins, out


def _attention(name: str, m: nn.Module, config: Any, world: int) -> Unit:
    ins, out = _split_unit(name, m)
    nh, nkv, hd = head_counts(m, config)
    if nh is None:
        raise _fail(name, "an attention module (it has a head_dim) but no head count on it or in the config")
    hd = hd or out[1] // nh
    if out[1] != nh * hd:
        raise _fail(name, f"the output projection {out[0]!r} reads {out[1]} features, not heads x head_dim "
                          f"= {nh} x {hd}")
    # fewer key/value heads than ranks: each kv head replicated on the world / nkv ranks whose
    # query heads read it (Megatron's way); then a rank's query heads all fall in one group
    replicate = nkv < world and world % nkv == 0 and nh % world == 0
    for what, n in (("query heads", nh), ("key/value heads", nkv)):
        if n % world and not (replicate and what == "key/value heads"):
            raise _fail(name, f"{n} {what} do not divide over the tensor-parallel size {world} (nor does the size "
                              "divide by them); use a tensor-parallel size that divides both head counts")
    kv_seg: Segment = (nkv * hd, nkv if replicate else None)
    segments: dict[str, list[Segment]] = {}
    if len(ins) == 1:
        fused = (nh + 2 * nkv) * hd
        if ins[0][2] != fused:
            raise _fail(name, f"one input projection {ins[0][0]!r} of {ins[0][2]} features; a fused [q | k | v] "
                              f"of {nh} + 2 x {nkv} heads of {hd} has {fused}")
        segments[ins[0][0]] = [(nh * hd, None), kv_seg, kv_seg]
    elif len(ins) == 3:
        widths = [l[2] for l in ins]
        if sorted(widths) != sorted([nh * hd, nkv * hd, nkv * hd]):
            raise _fail(name, f"input projections {[l[0] for l in ins]} of {widths} features; q, k, v of {nh}, "
                              f"{nkv}, {nkv} heads of {hd} have {[nh * hd, nkv * hd, nkv * hd]}")
        segments = {l[0]: [kv_seg if (replicate and l[2] == nkv * hd) else (l[2], None)] for l in ins}
    else:
        raise _fail(name, f"{len(ins)} input projections ({[l[0] for l in ins]}); attention has q, k, v or one "
                          "fused qkv")
    attrs = local_attrs(m, nh, nkv, hd, world)
    if replicate:  # one kv head per rank; the query heads per kv head are this rank's
        attrs.update({a: 1 for a in KV_ATTRS if _int_attr(m, (a,)) == nkv})
        attrs.update({a: nh // world for a in GROUP_ATTRS if _int_attr(m, (a,)) == nh // nkv})
    per_head = []
    for c, ch in m.named_children():
        if is_linear(ch) or not any(True for _ in ch.parameters()):
            continue
        shapes = [tuple(p.shape) for p in ch.parameters()]
        if any(s != (hd,) for s in shapes):
            raise _fail(f"{name}.{c}", f"parameters {shapes} inside the attention module that are not per head "
                                       f"([{hd}])")
        per_head.append(c)
    own = [n for n, _ in m.named_parameters(recurse=False)]
    if own:
        raise _fail(name, f"the attention module holds parameters {own} of its own")
    return Unit(name, m, "attention", [l[0] for l in ins], segments, out[0], attrs, per_head, nh * hd // world)


def _mlp(name: str, m: nn.Module, world: int) -> Unit:
    ins, out = _split_unit(name, m)
    inner = out[1]
    if len(ins) == 1 and ins[0][2] == 2 * inner:
        segments = {ins[0][0]: [(inner, None), (inner, None)]}  # fused [gate | up]
    elif len(ins) in (1, 2) and all(l[2] == inner for l in ins):
        segments = {l[0]: [(inner, None)] for l in ins}
    else:
        raise _fail(name, f"input projections {[(l[0], l[2]) for l in ins]} do not fit an output projection "
                          f"{out[0]!r} of {inner} inputs")
    if inner % world:
        raise _fail(name, f"the inner size {inner} does not divide over the tensor-parallel size {world}")
    extra = [c for c, ch in m.named_children() if not is_linear(ch) and any(True for _ in ch.parameters())]
    own = [n for n, _ in m.named_parameters(recurse=False)]
    if extra or own:
        raise _fail(name, f"parameters outside its projections: {extra + own}")
    return Unit(name, m, "mlp", [l[0] for l in ins], segments, out[0])


def recognize(model: nn.Module, world: int) -> Recognized:
    """Find the decoder stack, its attention and MLP modules and its norms; raise where the
    model does not fit (see the module's doc). Changes nothing."""
    config = _config_of(model)
    names = {id(m): n for n, m in model.named_modules()}
    stacks = []
    for sname, lst in model.named_modules():
        if not isinstance(lst, (nn.ModuleList, nn.ModuleDict)) or not len(lst):
            continue
        blks = list(lst.values()) if isinstance(lst, nn.ModuleDict) else list(lst)
        if all(any(is_attention(s) and sum(is_linear(c) for c in s.children()) >= 2 for s in blk.modules())
               for blk in blks):
            stacks.append((sname, blks))
    if not stacks:
        raise _fail("", "no decoder stack found (an nn.ModuleList of blocks, each with an attention module: "
                        "linear q, k, v (or a fused qkv) and an output projection, and a head count)")
    if len(stacks) > 1:
        raise _fail("", f"several decoder stacks: {[s for s, _ in stacks]}")
    sname, blocks = stacks[0]
    units: list[Unit] = []
    norms: list[str] = []
    for blk in blocks:
        taken: set[int] = set()
        mods = list(blk.named_modules())
        for _, m in mods:
            if id(m) in taken:
                continue
            n_lin = sum(is_linear(c) for c in m.children())
            if n_lin >= 2 or (n_lin and is_attention(m)):
                qual = names[id(m)]
                u = _attention(qual, m, config, world) if is_attention(m) else _mlp(qual, m, world)
                units.append(u)
                taken.update(id(x) for x in m.modules())
        for _, m in mods:
            if id(m) in taken:
                continue
            qual = names[id(m)]
            if is_linear(m) or isinstance(m, nn.Linear):
                raise _fail(qual, "a linear layer in a block outside any attention or MLP module")
            if any(True for _ in m.parameters(recurse=False)):
                norms.append(qual)
    if not sum(u.kind == "attention" for u in units) == len(blocks):
        raise _fail(sname, "a block holds more or less than one attention module")
    return Recognized(units, sname, blocks, norms)
