"""Tensor parallelism applied to a plain single-device model from outside (gpt-fast's ``tp.py``).

The model holds no distributed code. ``parallelize(model)`` finds its decoder stack, its
attention and MLP modules and its norms (``recognize.py``: HF transformers' Llama, Mistral,
Qwen2/3 and GPT-2, and models built like them), or follows a plan of module-name patterns,
and converts it in place, whole or not at all:

    attention / MLP      its input projections -> column-parallel (a fused one reordered
                         into per-rank blocks), computed together from one input (one
                         gather, one GEMM grid; one reduction of the input gradient); its
                         output projection -> row-parallel; head counts set to the local ones
    sequence_parallel    the residual stream split along the sequence from the first block's
                         input to the last block's output; each block's norms run on this
                         rank's tokens with their gradients summed over the group; attention
                         and MLP modules see the whole sequence's shape (rotary embeddings and
                         masks are built outside the blocks, for every token)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import functional as F
from .grouped import ColumnGroup, input_slot, take_input
from .layers import ColumnParallelLinear, RowParallelLinear, _group_info
from .norms import ReplicatedParameters, SequenceParallelNorm
from .recognize import Recognized, Segment, head_counts, is_attention, is_linear, local_attrs, recognize
from .styles import SEQUENCE_KINDS, is_style, kind_of_style

__all__ = ["parallelize", "unshard", "DEFAULT_PLAN", "SEQUENCE_PARALLEL_PLAN", "SequenceParallelNorm",
           "ReplicatedParameters", "ParallelInfo"]

DEFAULT_PLAN: dict[str, str] = {
    "*attn.qkv": "column",
    "*attn.proj": "row",
    "*mlp.fc1": "column",
    "*mlp.fc2": "row",
}
"""``overlap.models.gpt.GPT``: attention heads and the MLP's hidden features split over ranks
(its qkv laid out per head, so a contiguous slice is whole heads)."""

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

_KINDS = ("column", "column_fused", "row", "sequence_norm", "scatter_sequence", "gather_sequence", "sequence_input")


@dataclass(frozen=True)
class ParallelInfo:
    """What ``parallelize`` did to a model (``model.overlap_parallel``)."""

    tp_size: int
    """The group's size."""
    sequence_parallel: bool
    """The residual stream split along ``sequence_dim`` inside the decoder stack."""
    recognized: bool
    """True: no plan given, the structure recognized; False: a plan followed."""
    units: tuple[str, ...]
    """Attention and MLP modules converted (recognized), or the modules the plan matched."""


# ---- parallelize -------------------------------------------------------------------------------

class _Edits:
    """Every change to the model, gathered first and made at the end (nothing in between
    can fail), so that a model that cannot be converted is left as it was."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.swaps: list[tuple[str, nn.Module]] = []
        self.attrs: list[tuple[nn.Module, str, Any]] = []
        self.hooks: list[Callable[[], Any]] = []

    def swap(self, name: str, new: nn.Module) -> None:
        self.swaps.append((name, new))

    def commit(self) -> None:
        for name, new in self.swaps:
            parent, _, child = name.rpartition(".")
            setattr(self.model.get_submodule(parent) if parent else self.model, child, new)
        for obj, attr, value in self.attrs:
            setattr(obj, attr, value)
        for h in self.hooks:
            h()


def _segment_index(segments: list[Segment], rank: int, world: int) -> tuple[torch.Tensor, Any]:
    """The rows this rank takes of an output made of ``segments`` (its part of each one, or
    its replicated key/value head), and for replicated rows ``(local rows, head, heads)``
    (their gradient is summed over the ranks holding the same head), else None."""
    parts, shared, off, local = [], [], 0, 0
    head = heads = 0
    for width, n_heads in segments:
        if n_heads is None:
            n = width // world
            parts.append(torch.arange(off + rank * n, off + (rank + 1) * n))
        else:
            n, heads = width // n_heads, n_heads
            head = rank * n_heads // world
            parts.append(torch.arange(off + head * n, off + (head + 1) * n))
            shared.append(torch.arange(local, local + n))
        off, local = off + width, local + n
    return torch.cat(parts), ((torch.cat(shared), head, heads) if shared else None)


def _scatter_hook(group: Any, world: int, dim: int, where: str) -> Callable:
    slot = None

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        x, put = take_input(where, slot, args, kwargs)
        if x.shape[dim % x.dim()] % world:
            raise ValueError(f"parallelize(sequence_parallel=True): {where}'s input {tuple(x.shape)} has a sequence "
                             f"(dim {dim}) that is not a multiple of the tensor-parallel size {world}")
        return put(F.scatter_to_region(x, group=group, dim=dim))

    def bind(module: nn.Module) -> Callable:
        nonlocal slot
        slot = input_slot(module)
        return hook

    return bind


def _gather_output(group: Any, dim: int, where: str) -> Callable:
    def hook(_module: nn.Module, _args: tuple, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return F.gather_from_region(out, group=group, dim=dim)
        if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            return type(out)((F.gather_from_region(out[0], group=group, dim=dim), *out[1:]))
        raise RuntimeError(f"parallelize(sequence_parallel=True): {where} returned {type(out).__name__}; the "
                           "sequence-parallel region ends at a block returning a tensor (or a tuple starting "
                           "with one)")
    return hook


def _recognized(model: nn.Module, found: Recognized, group: Any, world: int, rank: int, sp: bool, config: Any,
                overlap: bool, seq_dim: int, edits: _Edits) -> None:
    kw = {"group": group, "config": config, "overlap": overlap}
    for u in found.units:
        members = []
        for c in u.inputs:
            lin = u.module.get_submodule(c)
            index, shared = _segment_index(u.segments[c], rank, world)
            try:
                col = ColumnParallelLinear.from_linear(lin, sequence_parallel=sp, sequence_dim=seq_dim if sp else 0,
                                                       index=index, **kw)
            except (ValueError, TypeError) as e:
                raise type(e)(f"parallelize: {u.name}.{c}: {e}") from None
            edits.attrs.append((col, "shared_rows", shared))
            members.append((f"{u.name}.{c}", col))
            edits.swap(f"{u.name}.{c}", col)
        try:
            row = RowParallelLinear.from_linear(u.module.get_submodule(u.output), sequence_parallel=sp,
                                                sequence_dim=seq_dim if sp else 0, **kw)
        except (ValueError, TypeError) as e:
            raise type(e)(f"parallelize: {u.name}.{u.output}: {e}") from None
        edits.swap(f"{u.name}.{u.output}", row)
        fusion = ColumnGroup(u.name, members, sp, seq_dim, input_slot(u.module), u.local_width)
        for _, col in members:
            edits.attrs.append((col, "_fusion", fusion))
        edits.hooks.append(lambda m=u.module, f=fusion: m.register_forward_pre_hook(f.pre_hook, with_kwargs=True))
        edits.hooks.append(lambda m=u.module, f=fusion: m.register_forward_hook(f.post_hook, with_kwargs=True))
        for a, v in u.attrs.items():
            edits.attrs.append((u.module, a, v))
        for c in u.per_head:  # applied to this rank's heads: gradients summed over the group
            edits.swap(f"{u.name}.{c}", ReplicatedParameters(u.module.get_submodule(c), group))
    if sp:
        for name in found.norms:
            edits.swap(name, SequenceParallelNorm(model.get_submodule(name), group, name))
        first, last = found.blocks[0], found.blocks[-1]
        names = {id(m): n for n, m in model.named_modules()}
        bind = _scatter_hook(group, world, seq_dim, names[id(first)])
        edits.hooks.append(lambda: first.register_forward_pre_hook(bind(first), with_kwargs=True))
        hook = _gather_output(group, seq_dim, names[id(last)])
        edits.hooks.append(lambda: last.register_forward_hook(hook))


def _vocab_parallel(model: nn.Module, found: Recognized, group: Any, edits: _Edits) -> None:
    """The input embedding and the output head split over the vocabulary (tied: still one
    parameter); an HF causal LM's loss computed on the split logits."""
    from .recognize import _dims
    from .vocab import VocabParallelEmbedding, causal_lm_loss

    names = {id(m): n for n, m in model.named_modules()}
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if callable(get_in) and callable(get_out):
        emb, head = get_in(), get_out()
        pairs = [(emb, head)] if emb is not None and head is not None else []
    else:
        inside = {id(m) for b in found.blocks for m in b.modules()}
        heads = [m for m in model.modules() if is_linear(m) and id(m) not in inside]
        embs = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        pairs = [(e, h) for e in embs for h in heads if _dims(h) == (e.embedding_dim, e.num_embeddings)]
    if len(pairs) != 1 or not isinstance(pairs[0][0], nn.Embedding) or not is_linear(pairs[0][1]):
        raise ValueError("parallelize(vocab_parallel=True): no single input embedding (nn.Embedding [V, C]) and "
                         f"output head (a linear C -> V) found ({len(pairs)} candidates); use vocab_parallel=False")
    emb, head = pairs[0]
    if _dims(head) != (emb.embedding_dim, emb.num_embeddings):
        raise ValueError(f"parallelize(vocab_parallel=True): the head {names[id(head)]} maps {_dims(head)}, the "
                         f"embedding {names[id(emb)]} is {tuple(emb.weight.shape)}")
    hf = hasattr(type(model), "loss_function")
    if hf and not type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")):
        raise ValueError(f"parallelize(vocab_parallel=True): {type(model).__name__} is not a causal LM; its loss "
                         "is not mapped to the vocab-parallel cross-entropy. Use vocab_parallel=False")
    vpe = VocabParallelEmbedding(emb, group)
    col = ColumnParallelLinear.from_linear(head, group=group)  # the same rows: rank-major V/R blocks
    edits.swap(names[id(emb)], vpe)
    edits.swap(names[id(head)], col)
    if head.weight is emb.weight:  # tied: still one parameter
        edits.attrs.append((col, "weight", vpe.weight))
    if hf:
        edits.attrs.append((model, "loss_function", causal_lm_loss(group)))


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern)


def _planned(model: nn.Module, plan: Mapping[str, Any], group: Any, world: int, rank: int, sp: bool, config: Any,
             overlap: bool, seq_dim: int, edits: _Edits) -> list[str]:
    kinds_of: dict[str, str] = {}
    for pattern, kind in plan.items():
        if is_style(kind):
            kind, needs_sp = kind_of_style(pattern, kind)
            if needs_sp and not sp:
                raise ValueError(f"plan[{pattern!r}] = {plan[pattern]!r} shards the sequence: pass "
                                 "sequence_parallel=True")
        elif kind not in _KINDS:
            raise ValueError(f"plan[{pattern!r}] = {kind!r}; kinds: {_KINDS} or torch's tensor-parallel styles")
        if kind in SEQUENCE_KINDS and not sp:
            raise ValueError(f"plan[{pattern!r}] = {kind!r} needs sequence_parallel=True")
        kinds_of[pattern] = kind
    hits = {p: 0 for p in plan}
    done, owners = [], []
    for name, module in model.named_modules():
        kinds = [(p, k) for p, k in kinds_of.items() if name and _matches(name, p)]
        if not kinds:
            continue
        if len(kinds) > 1:
            raise ValueError(f"module {name!r} matches several plan entries: {kinds}")
        pattern, kind = kinds[0]
        hits[pattern] += 1
        done.append(name)
        if kind == "sequence_input":
            owners.append(name)
            continue
        index = None
        if kind in ("column", "column_fused"):
            index = _fused_index(model, name, kind, world, rank)
        _convert(name, module, "column" if kind == "column_fused" else kind, group, sp, config, overlap, seq_dim,
                 edits, index)
    missing = [p for p, n in hits.items() if not n]
    if missing:
        raise ValueError(f"plan patterns matched no module: {missing}")
    _plan_gaps(model, done, kinds_of, group, world, sp, edits)
    new = dict(edits.swaps)
    for owner in owners:  # its column children read its input through one gather
        members = [(n, m) for n, m in new.items() if isinstance(m, ColumnParallelLinear) and n.rpartition(".")[0] == owner]
        if not members:
            raise ValueError(f"plan: {owner!r} takes a sequence-sharded input (PrepareModuleInput) but none of its "
                             "children is planned column-parallel; plan its input projections ColwiseParallel()")
        module = model.get_submodule(owner)
        fusion = ColumnGroup(owner, members, True, seq_dim, input_slot(module))
        for _, col in members:
            edits.attrs.append((col, "_fusion", fusion))
        edits.hooks.append(lambda m=module, f=fusion: m.register_forward_pre_hook(f.pre_hook, with_kwargs=True))
        edits.hooks.append(lambda m=module, f=fusion: m.register_forward_hook(f.post_hook, with_kwargs=True))
    _plan_head_counts(model, new, world, edits)
    return done


def _plan_head_counts(model: nn.Module, new: dict[str, nn.Module], world: int, edits: _Edits) -> None:
    """Attention modules whose projections a plan split: their head counts set to the local ones."""
    config = getattr(model, "config", None)
    parents = {n.rpartition(".")[0] for n, m in new.items() if isinstance(m, ColumnParallelLinear)}
    for p in sorted(parents):
        m = model.get_submodule(p)
        if not is_attention(m):
            continue
        nh, nkv, hd = head_counts(m, config)
        if nh is None or hd is None:
            continue
        if nh % world or nkv % world:
            raise ValueError(f"plan: {p}: {nh} query / {nkv} key-value heads do not divide over the "
                             f"tensor-parallel size {world}")
        for a, v in local_attrs(m, nh, nkv, hd, world).items():
            edits.attrs.append((m, a, v))


def _plan_gaps(model: nn.Module, done: list[str], kinds_of: dict[str, str], group: Any, world: int, sp: bool,
               edits: _Edits) -> None:
    """What a plan leaves out that would give wrong gradients, where ``recognize`` reads the
    model: a block's norm not planned "sequence_norm" under sequence parallelism raises;
    per-head parameters of an attention module whose projections it splits (Qwen3's q/k
    norms, which see this rank's heads only) get their gradients summed over the group."""
    try:
        found = recognize(model, world)
    except ValueError:
        return  # a model recognize does not read: the plan is taken as written
    planned = {n: next(k for p, k in kinds_of.items() if _matches(n, p)) for n in done}
    if sp:
        left = [n for n in found.norms if planned.get(n) != "sequence_norm"]
        if left:
            raise ValueError(f"plan: the norms {left} run on this rank's tokens under sequence parallelism but are "
                             "not planned 'sequence_norm' (SequenceParallel()); their gradients would be wrong. "
                             "Add them to the plan")
    for u in found.units:
        if any(planned.get(f"{u.name}.{c}") in ("column", "column_fused") for c in u.inputs):
            for c in u.per_head:
                if f"{u.name}.{c}" not in planned:
                    edits.swap(f"{u.name}.{c}", ReplicatedParameters(u.module.get_submodule(c), group))


def _fused_index(model: nn.Module, name: str, kind: str, world: int, rank: int) -> torch.Tensor | None:
    """A planned column layer that is a fused projection (``recognize``: [q | k | v] of an
    attention, [gate | up] of an MLP): "column" would cut it into contiguous slices, which
    are not whole heads of each part, and raises; "column_fused" takes this rank's part of
    every segment. None: a plain column (overlap's own GPT, whose qkv is laid out per head,
    and modules ``recognize`` does not read)."""
    from .recognize import _attention, _mlp

    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    segments = None
    if type(parent).__module__ != "overlap.models.gpt" and sum(is_linear(c) for c in parent.children()) >= 2:
        try:
            unit = (_attention(parent_name, parent, getattr(model, "config", None), world) if is_attention(parent)
                    else _mlp(parent_name, parent, world))
            segments = unit.segments.get(child)
        except ValueError:
            segments = None
    fused = segments is not None and len(segments) > 1
    if kind == "column":
        if fused:
            raise ValueError(f"plan: {name!r} is a fused projection (segments {[w for w, _ in segments]}); a "
                             "contiguous slice of its rows is not this rank's part of each: plan it "
                             "'column_fused', or give no plan")
        return None
    if not fused:
        raise ValueError(f"plan: {name!r} = 'column_fused', but it is not a fused projection overlap recognizes "
                         "(a [q | k | v] of an attention module with head counts, or a [gate | up])")
    if any(h is not None for _, h in segments):
        raise ValueError(f"plan: {name!r}: replicated key/value heads are not supported with a plan; give no plan")
    return _segment_index(segments, rank, world)[0]


def _convert(name: str, module: nn.Module, kind: str, group: Any, sp: bool, config: Any, overlap: bool,
             seq_dim: int, edits: _Edits, index: torch.Tensor | None = None) -> None:
    if kind in ("column", "row"):
        if not is_linear(module):
            raise TypeError(f"plan: {name!r} is {type(module).__name__}, not nn.Linear (or transformers' Conv1D)")
        cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
        extra = {"index": index} if index is not None else {}
        try:
            edits.swap(name, cls.from_linear(module, group=group, sequence_parallel=sp, config=config,
                                             overlap=overlap, sequence_dim=seq_dim if sp else 0, **extra))
        except (ValueError, TypeError) as e:
            raise type(e)(f"plan: {name!r}: {e}") from None
    elif kind == "sequence_norm":
        edits.swap(name, SequenceParallelNorm(module, group, name))
    elif kind == "scatter_sequence":
        edits.hooks.append(lambda: module.register_forward_hook(
            lambda _m, _args, out: F.scatter_to_region(out, group=group, dim=seq_dim)))
    else:  # gather_sequence
        slot = input_slot(module)

        def pre(_m: nn.Module, args: tuple, kwargs: dict) -> Any:
            x, put = take_input(name, slot, args, kwargs)
            return put(F.gather_from_region(x, group=group, dim=seq_dim))

        edits.hooks.append(lambda: module.register_forward_pre_hook(pre, with_kwargs=True))


def parallelize(model: nn.Module, group: Any = None, plan: Mapping[str, Any] | None = None, *,
                sequence_parallel: bool = False, config: Any = None, overlap: bool = True,
                sequence_dim: int = 1, vocab_parallel: bool = False) -> nn.Module:
    """Apply tensor parallelism to ``model`` in place and return it; all of it or, where
    anything does not fit, none of it (a ``ValueError`` / ``TypeError`` naming the module
    and what to do, the model unchanged).

    No ``plan``: the model's structure is recognized (``overlap.nn.recognize``): HF
    transformers' decoders of the Llama family (Llama, Mistral, Qwen2/3: GQA, q/k/v biases,
    tied embeddings), GPT-2 (Conv1D, fused ``c_attn``), and models built like them: each
    attention's q/k/v (or fused qkv) column-parallel over whole heads, read from one gather,
    its output projection row-parallel, its head counts set to the local ones (fewer
    key/value heads than ranks, R a multiple of them: each replicated, Megatron's way, its
    gradient summed over its copies); each MLP's
    gate/up (or up, or fused gate/up) column-parallel from one gather, its down projection
    row-parallel. Embeddings, the final norm and the head stay replicated. A model whose
    names match ``DEFAULT_PLAN`` (``overlap.models.GPT``: qkv laid out per head) follows
    that plan (``SEQUENCE_PARALLEL_PLAN`` with ``sequence_parallel``).

    ``vocab_parallel`` (opt in, no plan): the input embedding and the output head hold V/R
    rows of the vocabulary (tied ones stay one parameter); the logits are this rank's
    columns ``[B, T, V/R]``, never whole on one rank; an HF causal LM's loss becomes
    ``vocab_parallel_cross_entropy`` (other models: call it on the logits yourself).

    ``sequence_parallel``: the residual stream ``[B, T/R, C]`` (``sequence_dim=1``) from
    the first block's input to the last one's output, T a multiple of R; norms of any
    class (LayerNorm- or RMSNorm-like, checked by parameters and behavior) run on this
    rank's tokens with their gradients summed over the group. Position embeddings and
    masks built before the first block see every token.

    ``plan`` maps module-name patterns (``fnmatch`` on the qualified name, e.g.
    ``"*attn.qkv"`` matches ``h.0.attn.qkv``) to what the module becomes:

    ==================  ===========================================================
    kind                the module (must be) -> becomes
    ==================  ===========================================================
    "column"            linear -> ``ColumnParallelLinear.from_linear`` (this rank's
                        output rows; its outputs [..., N/R]); a fused projection
                        (recognized: [q | k | v], [gate | up]) raises
    "column_fused"      a fused projection -> column-parallel, this rank's part of
                        every segment (whole heads of q, k and v)
    "row"               linear -> ``RowParallelLinear.from_linear`` (this rank's
                        input columns; its outputs reduced)
    "sequence_norm"     a norm -> ``SequenceParallelNorm`` (sequence_parallel)
    "scatter_sequence"  any: its output split along ``sequence_dim`` (this rank's shard)
    "gather_sequence"   any: its input gathered along ``sequence_dim`` first
    "sequence_input"    any: its column children read its sequence-sharded input
                        through one gather (it sees the whole sequence's shape)
    ==================  ===========================================================

    A plan's value may also be one of torch's styles (``ColwiseParallel``,
    ``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``: the plans torchtitan
    users write), mapped as ``overlap.nn.styles`` says; ``PrepareModuleInput`` from
    ``Shard(1)`` to ``Replicate()`` on a module makes its column children read its input
    through one gather. With a plan, an attention module whose projections it splits gets
    its head counts set to the local ones; a column layer takes a contiguous slice of its
    rows (a fused qkv must be laid out per head), and with ``sequence_parallel`` one not
    under a ``sequence_input`` module returns the whole sequence ``[B, T, N/R]``.

    Deterministic: every rank must pass the same unsharded model (same seed); each keeps
    its slices (``unshard`` puts them back together). ``model.overlap_parallel`` records
    what was done (``ParallelInfo``); ``model.tp_size`` is set where the model has no
    ``tp_size`` of its own.
    """
    group, world, rank = _group_info(group)
    if getattr(model, "overlap_parallel", None) is not None:
        raise ValueError(f"parallelize: {type(model).__name__} is already parallelized ({model.overlap_parallel})")
    edits = _Edits(model)
    legacy = plan is None and all(any(_matches(n, p) for n, _ in model.named_modules() if n) for p in DEFAULT_PLAN)
    if plan is None and not legacy:
        found = recognize(model, world)
        _recognized(model, found, group, world, rank, sequence_parallel, config, overlap, sequence_dim, edits)
        if vocab_parallel:
            _vocab_parallel(model, found, group, edits)
        units = tuple(u.name for u in found.units)
    else:
        if vocab_parallel:
            raise ValueError("parallelize: vocab_parallel=True with a plan (or a model following DEFAULT_PLAN) is "
                             "not supported; it applies to recognized models")
        if plan is None:
            plan = SEQUENCE_PARALLEL_PLAN if sequence_parallel else DEFAULT_PLAN
        units = tuple(_planned(model, plan, group, world, rank, sequence_parallel, config, overlap, sequence_dim,
                               edits))
    edits.commit()
    model.overlap_parallel = ParallelInfo(world, sequence_parallel, plan is None, units)
    if not hasattr(type(model), "tp_size"):  # HF models have their own (a read-only property)
        model.tp_size = world
    return model


def unshard(model: nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor | None]:
    """Every parameter (``grads=True``: its gradient) of a parallelized model in the unsharded
    model's layout, by name (a fused projection's rows back in their order, a Conv1D's
    weight [K, N] again): ``model.state_dict()`` of the model before ``parallelize``.
    Collective: every rank of the group calls it, and every rank gets the whole."""
    import torch.distributed as tdist

    from .vocab import VocabParallelEmbedding

    out: dict[str, torch.Tensor | None] = {}
    for name, p in model.named_parameters():
        parent, _, leaf = name.rpartition(".")
        mod = model.get_submodule(parent) if parent else model
        t = p.grad if grads else p.detach()
        idx = getattr(mod, "shard_index", None)
        if t is None:
            out[name] = None
            continue
        dim = size = None
        if isinstance(mod, ColumnParallelLinear) and idx is not None:
            dim, size = 0, mod.out_features
        elif isinstance(mod, VocabParallelEmbedding):
            dim, size = 0, mod.num_embeddings
        elif isinstance(mod, RowParallelLinear) and idx is not None and leaf == "weight":
            dim, size = 1, mod.in_features
        if dim is not None:
            world = tdist.get_world_size(mod.group)
            ts = [torch.empty_like(t) for _ in range(world)]
            tdist.all_gather(ts, t.contiguous(), group=mod.group)
            ids = [torch.empty_like(idx) for _ in range(world)]
            tdist.all_gather(ids, idx.to(t.device), group=mod.group)
            full_shape = list(t.shape)
            full_shape[dim] = size
            # replicated key/value rows arrive from each of their copies, equal: any one lands
            t = t.new_zeros(full_shape).index_copy_(dim, torch.cat(ids).to(t.device), torch.cat(ts, dim))
        if getattr(mod, "source_transposed", False) and leaf == "weight":
            t = t.t()
        out[name] = t
    return out
