"""What an op module declares: its shapes, and per shape a Case of variants to time.

An op module (``benchmarks/suite/op_<name>.py``) defines ``OP = OpSpec(...)``. For every
shape the runner calls ``OP.setup(shape, env)``, which builds the inputs and returns a
``Case``: the variants (zero-argument callables, each one call of the op), the parts the
floor is made of (communication alone, GEMM alone; or producer and consumer alone), the
FLOPs and the bytes of the collective. The runner times everything, derives TFLOP/s, bus
bandwidth and the fraction of communication hidden, and writes the reports.

``setup`` imports the library lazily; an ``ImportError`` there (the op is not in this
checkout) makes the runner print ``op <name> unavailable: <error>`` and go on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

ROLES = ("reference", "library", "baseline", "external")


@dataclass(frozen=True)
class Shape:
    """One benchmark shape. ``dims`` are named (M, N, K for every op so far); ``params``
    are extra case parameters (e.g. ``{"ln": True}``), shown as a label suffix."""

    set: str
    dims: dict[str, int]
    params: dict[str, Any] = field(default_factory=dict)
    name: str = ""  # a short name of what the shape is (e.g. "gpt3 fc1"), optional

    @property
    def label(self) -> str:
        s = "x".join(str(v) for v in self.dims.values())
        return s + "".join(f"+{k}" for k, v in self.params.items() if v is True)

    def scaled(self, max_dim: int, quantum: int) -> Shape:
        """The same shape with every dim scaled by one factor so the largest is at most
        ``max_dim``; each dim rounded to a multiple of ``quantum`` (at least one)."""
        f = max(1.0, max(self.dims.values()) / max_dim)
        dims = {k: max(quantum, int(round(v / f / quantum)) * quantum) for k, v in self.dims.items()}
        return Shape(self.set, dims, dict(self.params), self.name)


def mnk(set_: str, m: int, n: int, k: int, name: str = "", **params: Any) -> Shape:
    return Shape(set_, {"M": m, "N": n, "K": k}, dict(params), name)


@dataclass
class Variant:
    """One way of computing the op.

    role: ``reference`` (the plain sequential path: the figure "hidden" is measured
    against), ``library`` (the library's path), ``baseline`` (e.g. chunked stream
    overlap), ``external`` (e.g. torch's symmetric-memory op).
    """

    title: str
    fn: Callable[[], Any] | None = None
    role: str = "baseline"
    na: str | None = None  # why it is not run here ("needs CUDA"); then fn is None
    note: str | None = None  # how to read its figure ("CPU: falls back to the reference")
    synced: bool = False  # also time every call alone (host launch latency shows)
    prepare: Callable[[], Any] | None = None  # run once before timing (a tuner); result recorded
    counter: Callable[[], int] | None = None  # calls that took the fast path, read around timing

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if (self.fn is None) == (self.na is None):
            raise ValueError(f"variant {self.title!r}: give exactly one of fn and na")


@dataclass
class Case:
    """Everything the runner times for one shape of one op."""

    variants: dict[str, Variant]
    parts: dict[str, Callable[[], Any]]  # timed alone; the floor is their max (or sum)
    flops: float  # per call, per rank
    comm_bytes: int = 0  # NCCL-tests "size" of the collective (all-gather: the gathered buffer)
    extra: dict[str, Callable[[], Any]] = field(default_factory=dict)  # other timings, recorded
    check: Callable[[], dict[str, float]] | None = None  # accuracy of the library path, fresh data
    finish: Callable[[], None] | None = None  # after timing (raise a deferred kernel error)
    info: dict[str, Any] = field(default_factory=dict)  # recorded as-is


@dataclass(frozen=True)
class OpSpec:
    """An op of the library, as the benchmark runner sees it."""

    name: str  # what --ops takes
    title: str
    comm: str | None  # "all_gather" | "reduce_scatter" | "all_reduce" | None (no communication)
    shapes: dict[str, list[Shape]]  # named set -> shapes
    setup: Callable[[Shape, Env], Case]
    library: str = "tile_flag"  # the variant that is the library's path
    floor: str = "max"  # "max": max(parts) (overlap floor); "sum": parts back to back
    part_titles: dict[str, str] = field(default_factory=lambda: {"comm": "comm alone", "gemm": "GEMM alone"})
    floor_title: str = "floor"
    speedup: tuple[str, str] | None = None  # (fast, slow): report t(slow) / t(fast)
    dims_doc: str = "M x N x K"
    params_from_suffix: Callable[[str], dict[str, Any]] | None = None  # "+ln" -> {"ln": True}
    observed: str | None = None  # the op's name in overlap.report() (``--profile``)

    def knows_suffix(self, suffix: str) -> bool:
        if self.params_from_suffix is None:
            return False
        try:
            self.params_from_suffix(suffix)
        except ValueError:
            return False
        return True

    def custom_shape(self, text: str) -> tuple[Shape, list[str]]:
        """``--shape 8192x1024x8192[+suffix]`` for this op, and the suffixes it ignores
        (meant for another op, e.g. armm's ``+ln``)."""
        dims_s, *suffixes = text.split("+")
        try:
            vals = [int(v) for v in dims_s.lower().split("x")]
        except ValueError:
            vals = []
        if len(vals) != 3 or min(vals) < 1:
            raise ValueError(f"--shape wants M x N x K, e.g. 8192x1024x8192; got {text!r}")
        params: dict[str, Any] = {}
        ignored = []
        for s in suffixes:
            if self.knows_suffix(s):
                params.update(self.params_from_suffix(s))
            else:
                ignored.append(s)
        return mnk("custom", *vals, **params), ignored


@dataclass
class Env:
    """Where and how the cases run."""

    device: torch.device
    dtype: torch.dtype
    group: Any  # the process group the ops run over
    world: int
    rank: int
    tune: bool = True
    verbose: bool = False  # this rank prints (rank 0)

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def randn(self, *shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
        """Deterministic random data on the device in the run's dtype."""
        g = torch.Generator(device=self.device).manual_seed(seed)
        t = torch.randn(*shape, device=self.device, dtype=torch.float32, generator=g)
        if scale != 1.0:
            t *= scale
        return t.to(self.dtype)

    def rel_err(self, got: torch.Tensor, ref: torch.Tensor) -> float:
        got, ref = got.float(), ref.float()
        return float((got - ref).norm() / ref.norm().clamp_min(1e-30))
