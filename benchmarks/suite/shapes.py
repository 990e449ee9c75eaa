"""Named shape sets and how ``--shapes`` / ``--shape`` / CPU scaling pick from them.

Sets (every op declares its own shapes per set; an op with none in a set skips it):

    gpt3-175b    GPT-3 175B (H = 12288), tensor-parallel slices at TP = 8
    llama-70b    LLaMA-70B-like (H = 8192; the MLP chain uses the LLaMA-65B slice)
    comm-heavy   small N: the collective costs as much as the GEMM or more

Dims are M x N x K (M rows of the GEMM, after the gather where there is one).
"""

from __future__ import annotations

from .spec import OpSpec, Shape

SETS = ("gpt3-175b", "llama-70b", "comm-heavy")
ALIASES = {"gpt3": "gpt3-175b", "gpt-3": "gpt3-175b", "llama": "llama-70b", "llama-70b-like": "llama-70b",
           "llama-65b": "llama-70b", "comm": "comm-heavy"}

CPU_MAX_DIM = 256


def canonical_set(name: str) -> str:
    name = ALIASES.get(name.lower(), name.lower())
    if name != "all" and name not in SETS:
        raise ValueError(f"unknown shape set {name!r}; known: {', '.join(SETS)}, all (aliases: "
                         f"{', '.join(sorted(ALIASES))})")
    return name


def select(op: OpSpec, sets: list[str], custom: list[str]) -> tuple[list[Shape], list[str]]:
    """The op's shapes for the requested sets plus custom ``MxNxK`` shapes; and a note per
    requested set the op has no shapes in."""
    names: list[str] = []
    for s in sets:
        c = canonical_set(s)
        for n in (SETS if c == "all" else (c,)):
            if n not in names:
                names.append(n)
    shapes: list[Shape] = []
    notes: list[str] = []
    for n in names:
        got = op.shapes.get(n, [])
        if not got:
            notes.append(f"op {op.name}: no shapes in set {n} (skipped)")
        shapes.extend(got)
    for t in custom:
        shape, ignored = op.custom_shape(t)
        if ignored:
            notes.append(f"op {op.name}: ignores {' '.join('+' + s for s in ignored)} of --shape {t}")
        if all(shape != s for s in shapes):
            shapes.append(shape)
    return shapes, notes


def check_suffixes(ops: list[OpSpec], custom: list[str]) -> None:
    """Every ``+suffix`` of a ``--shape`` must mean something to one of the ops."""
    for t in custom:
        for s in t.split("+")[1:]:
            if not any(op.knows_suffix(s) for op in ops):
                raise ValueError(f"--shape {t}: no op of this run takes +{s} "
                                 f"(+ln: residual + LayerNorm, op armm)")


def for_cpu(shape: Shape, world: int, max_dim: int = CPU_MAX_DIM) -> Shape:
    """A small stand-in for a GPU shape (gloo, CPU matmuls): every dim scaled by one factor
    to at most ``max_dim``, rounded to multiples of 8 x world (rows divide evenly)."""
    return shape.scaled(max_dim, max(16, 8 * world))
