"""torch's tensor-parallel styles as ``parallelize`` plan entries (the plans torchtitan users
write for ``parallelize_module``), mapped to overlap's kinds:

=====================================================  ===================================
torch style (on the module the key names)              overlap kind
=====================================================  ===================================
ColwiseParallel()                                      "column"
ColwiseParallel(input_layouts=Shard(1))                "column" (sequence-parallel: gathers)
ColwiseParallel(input_layouts=Shard(1),                "gather_sequence" (an output head:
                output_layouts=Replicate())            the stream gathered, the head whole)
RowwiseParallel()                                      "row"
RowwiseParallel(output_layouts=Shard(1))               "row" (sequence-parallel: reduce-scatter)
RowwiseParallel(input_layouts=Replicate(),             "scatter_sequence" (an embedding: kept
                output_layouts=Shard(1))               whole, its output split)
SequenceParallel()                                     "sequence_norm"
PrepareModuleInput(input_layouts=(Shard(1), ...),      "sequence_input": the module's column
                   desired_input_layouts=(Replicate(),  children read its input through one
                   ...))  (or the kwarg forms)         gather (one GEMM grid)
=====================================================  ===================================

The embedding and the output head stay whole on every rank (vocab-parallel layouts, e.g.
an output head left ``Shard(-1)`` for a loss-parallel cross-entropy, raise). The sequence
is dim 1 (``Shard(1)``, batch-first); any other layout raises ``ValueError`` naming the key.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_style", "kind_of_style", "SEQUENCE_KINDS"]

SEQUENCE_KINDS = ("sequence_norm", "scatter_sequence", "gather_sequence", "sequence_input")


def is_style(v: Any) -> bool:
    """A ``torch.distributed.tensor.parallel`` style object (not one of overlap's kind strings)."""
    return type(v).__module__.startswith("torch.distributed.tensor.parallel")


def _shard(p: Any, dim: int) -> bool:
    from torch.distributed.tensor import Shard

    return isinstance(p, Shard) and p.dim == dim


def _replicate(p: Any) -> bool:
    from torch.distributed.tensor import Replicate

    return isinstance(p, Replicate)


def _first(layouts: Any) -> Any:
    if isinstance(layouts, (tuple, list)):
        return layouts[0] if layouts else None
    return layouts


def kind_of_style(key: str, style: Any) -> tuple[str, bool]:
    """``(kind, sequence_parallel)`` for one plan entry holding a torch style."""
    name = type(style).__name__
    bad = ValueError(f"plan[{key!r}] = {style!r}: layouts overlap does not map (see overlap.nn.styles: "
                     "Shard(1) is the sequence, Shard(-1) the features; vocab-parallel layouts are not supported)")
    if name == "ColwiseParallel":
        inp, out = _first(style.input_layouts), _first(style.output_layouts)
        if _replicate(inp) and _shard(out, -1):
            return "column", False
        if _shard(inp, 1) and _shard(out, -1):
            return "column", True
        if _shard(inp, 1) and _replicate(out):
            return "gather_sequence", True
        raise bad
    if name == "RowwiseParallel":
        inp, out = _first(style.input_layouts), _first(style.output_layouts)
        if _shard(inp, -1) and _replicate(out):
            return "row", False
        if _shard(inp, -1) and _shard(out, 1):
            return "row", True
        if _replicate(inp) and _shard(out, 1):
            return "scatter_sequence", True
        raise bad
    if name == "SequenceParallel":
        if not _shard(_first(style.sequence_sharding), 1):
            raise bad
        return "sequence_norm", True
    if name == "PrepareModuleInput":
        src = _first(style.input_layouts) if style.input_layouts else next(iter(style.input_kwarg_layouts.values()),
                                                                           None)
        dst = (_first(style.desired_input_layouts) if style.desired_input_layouts
               else next(iter(style.desired_input_kwarg_layouts.values()), None))
        if _shard(src, 1) and _replicate(dst):
            return "sequence_input", True
        raise bad
    raise ValueError(f"plan[{key!r}] = {style!r}: {name} is not mapped (ColwiseParallel, RowwiseParallel, "
                     "SequenceParallel, PrepareModuleInput are)")
