"""One benchmark runner for every op of the library (``benchmarks/run.py``).

    spec.py      OpSpec / Case / Variant / Shape: what an op module declares
    shapes.py    named shape sets (gpt3-175b, llama-70b, comm-heavy), CPU stand-ins
    timing.py    CUDA-event and CPU timers, median, slowest rank
    report.py    table, JSON, markdown, PNG
    runner.py    the command line and the loop over ops and shapes
    observed.py  --profile: what overlap.report() saw of each variant
    op_*.py      one module per op, each defining ``OP = OpSpec(...)``

Adding an op: write ``op_<name>.py`` with ``OP``; it is found by its file name.
"""

from __future__ import annotations

import importlib
import pkgutil

from .spec import Case, Env, OpSpec, Shape, Variant, mnk

__all__ = ["Case", "Env", "OpSpec", "Shape", "Variant", "available_ops", "load_op", "mnk"]

# the order ops run in and appear in reports; ops found later go after these
_ORDER = ("agmm", "armm", "mmrs", "mmar", "chain")


def available_ops() -> list[str]:
    """Names of the op modules in this package (``op_<name>.py``)."""
    found = [m.name[3:] for m in pkgutil.iter_modules(__path__) if m.name.startswith("op_")]
    return sorted(found, key=lambda n: (_ORDER.index(n) if n in _ORDER else len(_ORDER), n))


def load_op(name: str) -> OpSpec:
    if name not in available_ops():
        raise ValueError(f"unknown op {name!r}; known: {', '.join(available_ops())}")
    op = importlib.import_module(f"{__name__}.op_{name}").OP
    if op.name != name:
        raise ValueError(f"op_{name}.py declares OP.name={op.name!r}")
    return op
