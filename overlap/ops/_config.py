"""The ops' configuration: ``OverlapConfig`` with its transports' options
(``NcclTransport``, ``PeerCopyTransport``), the tuners' other picks (``Sequential``,
``Chunked``) and the environment's settings (``OVERLAP_SM_MARGIN``, ``OVERLAP_TRANSPORT``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from .._fields import bool_field, choice_field, float_field, int_field

__all__ = ["OverlapConfig", "NcclTransport", "PeerCopyTransport", "Sequential", "Chunked", "SEQUENTIAL", "Path",
           "env_sm_margin", "check_gemm_field", "MAX_SMS", "MAX_CHUNKS", "MIN_TIMEOUT_MS", "MAX_TIMEOUT_MS"]


MAX_SMS = 512
"""Bound of the config fields that count SMs (margins, reduce programs): more than any GPU has."""
MAX_CHUNKS = 64
"""Bound of ``OverlapConfig.chunks`` (each chunk is an NCCL call or a push and a flag)."""
MIN_TIMEOUT_MS = 1e-3
"""Shortest wait bound a config takes (1 us; a shorter one rounds to no wait at all)."""
MAX_TIMEOUT_MS = 7 * 24 * 3600 * 1000.0
"""Longest wait bound a config takes (a week: a bound, never a hang)."""


def check_gemm_field(owner: str, name: str, v: Any) -> None:
    """``v`` None or an ``overlap.kernels.tile_gemm.GemmConfig`` (looked up only where that
    module is loaded: a GemmConfig cannot exist before)."""
    if v is None:
        return
    import sys

    mod = sys.modules.get("overlap.kernels.tile_gemm")
    if mod is None or not isinstance(v, mod.GemmConfig):
        raise TypeError(f"{owner}.{name} must be an overlap.kernels.tile_gemm.GemmConfig or None, got {v!r} "
                        f"({type(v).__name__})")


@dataclass(frozen=True, kw_only=True)
class NcclTransport:
    """The NCCL transport and its options, for ``OverlapConfig(transport=NcclTransport(...))``
    (the same config as ``transport="nccl"`` with ``nccl_ctas``): rows move in chunked NCCL
    collectives on the library's communicator, whose CTAs hold SMs."""

    name: ClassVar[str] = "nccl"
    ctas: int | None = None
    """Cap on NCCL's CTAs for the op's communicator (``OverlapConfig.nccl_ctas``; its
    bandwidth grows with them; each is an SM the GEMM does not get: docs/design.md, the SM
    budget); ``None``: 16."""

    def __post_init__(self) -> None:
        int_field("NcclTransport", "ctas", self.ctas, 1, 64, none_ok=True)


@dataclass(frozen=True, kw_only=True)
class PeerCopyTransport:
    """The peer-copy transport and its options, for
    ``OverlapConfig(transport=PeerCopyTransport(...))`` (the same config as
    ``transport="p2p"`` with the flat fields of the same names): copy-engine pushes into
    peer memory on one node (``overlap._p2p``; no SM). The options are the all-reduce's;
    the all-gather takes none."""

    name: ClassVar[str] = "p2p"
    reduce_ctas: int | None = None
    """SMs left to the kernel that sums the pushed partials (and adds the residual and
    norms) chunk by chunk, one program each; with ``reduce_shared`` the number of reduce
    programs. ``None``: 16."""
    reduce_shared: bool = False
    """The reduce kernel runs in small programs (4 warps, short column blocks, few
    registers) *beside* the GEMM's programs on the same SMs, instead of on SMs of its own:
    the GEMM grid covers every SM and no give-back grid runs; ``reduce_ctas`` then counts
    the reduce programs. A GEMM program leaves room on its SM for one such program
    (registers and shared memory), so they are resident whichever is dispatched first. Not
    with a warp-specialized GEMM (``GemmConfig.warp_specialize``: ValueError)."""
    two_shot: bool = False
    """Reduce-scatter, then all-gather (instead of every rank summing all rows): each
    rank's reduce kernel sums the 1/R of the rows it owns and pushes each reduced chunk
    back to every peer. With a norm it needs ``fold_norm``; the residual must be the same
    on every rank (``OverlapConfig.two_shot`` has the details)."""
    fold_norm: bool = False
    """With a norm: fold it into the GEMM instead of writing the normed rows (the reduce
    kernel writes each row's statistics, B is replaced by diag(norm weight) B once per
    call, the GEMM's epilogue applies the rest). Ignored without a norm."""

    def __post_init__(self) -> None:
        int_field("PeerCopyTransport", "reduce_ctas", self.reduce_ctas, 1, MAX_SMS, none_ok=True)
        for f in ("reduce_shared", "two_shot", "fold_norm"):
            bool_field("PeerCopyTransport", f, getattr(self, f))


# each typed transport's options: (its field, OverlapConfig's flat field of the same meaning)
_TRANSPORT_FIELDS: dict[type, tuple[tuple[str, str], ...]] = {
    NcclTransport: (("ctas", "nccl_ctas"),),
    PeerCopyTransport: (("reduce_ctas", "reduce_ctas"), ("reduce_shared", "reduce_shared"),
                        ("two_shot", "two_shot"), ("fold_norm", "fold_norm")),
}
_FLAT_DEFAULTS = {"nccl_ctas": None, "reduce_ctas": None, "reduce_shared": False, "two_shot": False,
                  "fold_norm": False}


@dataclass(frozen=True)
class Sequential:
    """A tuner's pick that runs the op's reference (``*_ref``): the collective and the GEMM
    one after the other, for a shape where overlap does not pay. ``str()`` is its label
    in reports and results: ``"sequential"``."""

    def __str__(self) -> str:
        return "sequential"


@dataclass(frozen=True)
class Chunked:
    """A tuner's pick that runs the op's chunked stream-overlap baseline (``*_chunked``)
    in ``chunks`` pieces. ``str()``: ``"chunked x4"``."""

    chunks: int

    def __post_init__(self) -> None:
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 2:
            raise ValueError(f"Chunked: chunks must be an int >= 2, got {self.chunks!r}")

    def __str__(self) -> str:
        return f"chunked x{self.chunks}"


SEQUENTIAL = Sequential()


@dataclass(frozen=True, kw_only=True)
class OverlapConfig:
    """How an overlapped op runs; fields left ``None`` come from the tuner or defaults.

    A transport's options can be given with it, typed: ``transport=NcclTransport(ctas=8)``
    or ``transport=PeerCopyTransport(reduce_ctas=24, fold_norm=True)``. Construction turns
    them into the flat fields (``transport="nccl"``, ``nccl_ctas=8``), so the two spellings
    make equal configs; ``transport_options`` gives the typed form back. Fields that only
    one transport reads are refused with the other one (ValueError); with ``transport=None``
    (chosen at call time) both transports' fields may be set, each read where its
    transport is chosen."""

    chunks: int | None = None
    """NCCL calls the collective is cut into (each followed by a flag post)."""
    nccl_ctas: int | None = None
    """NCCL transport: cap on NCCL's CTAs for the op's communicator (its bandwidth grows
    with them; each is an SM the GEMM does not get: docs/design.md, the SM budget);
    ``None``: 16. ``NcclTransport.ctas``; not with ``transport="p2p"`` (ValueError)."""
    sm_margin: int | None = None
    """SMs left idle beyond NCCL's CTAs (or the reduce kernel's programs); ``None``:
    ``OVERLAP_SM_MARGIN`` (``env_sm_margin``) where set, else 4 on the NCCL transport and 0
    on the peer-copy transport. Where other NCCL traffic shares the GPU (a data-parallel
    all-reduce on torch's communicator), leave at least that communicator's CTA cap free
    (docs/guarantees.md, "Other NCCL traffic")."""
    give_back: bool = True
    """After the last chunk lands (or the p2p all-reduce's reduce kernel ends), launch a
    second GEMM grid on the SMs the first one left, taking tiles from the same dispatch
    counter. Ignored by the p2p all-gather, whose GEMM holds every SM."""
    gemm: Any = None
    """``overlap.kernels.tile_gemm.GemmConfig``; ``None``: the tuned or default one."""
    timeout_ms: float | None = None
    """Bound of one tile's flag wait; ``None``: ``overlap.flags.default_timeout_ms(group)``
    (``OVERLAP_WAIT_TIMEOUT_MS``, else the process groups' timeout: minutes, so that a rank
    arriving seconds late is waited for)."""
    transport: str | NcclTransport | PeerCopyTransport | None = None
    """How rows move between GPUs: "nccl" (chunked NCCL collectives on the
    library's communicator; their CTAs hold SMs) or "p2p" (copy-engine pushes into
    peer memory on one node, ``overlap._p2p``; no SM). ``None``: "p2p" where the
    group's ranks can map each other's memory (``OVERLAP_TRANSPORT`` overrides).
    A ``NcclTransport`` or ``PeerCopyTransport`` gives the transport with its options;
    after construction this field is always the name ("nccl", "p2p") or ``None``."""
    reduce_ctas: int | None = None
    """p2p all-reduce: SMs left to the kernel that sums the pushed partials (and adds
    the residual and norms) chunk by chunk, one program each; ``None``: 16.
    ``PeerCopyTransport.reduce_ctas``; not with ``transport="nccl"`` (ValueError)."""
    reduce_shared: bool = False
    """p2p all-reduce: the reduce kernel runs in small programs (4 warps, short column
    blocks, few registers) *beside* the GEMM's programs on the same SMs, instead of on
    SMs of its own: the GEMM grid covers every SM and no give-back grid runs;
    ``reduce_ctas`` then counts the reduce programs. A GEMM program leaves room on its
    SM for one such program (registers and shared memory), so they are resident
    whichever is dispatched first. Not with a warp-specialized GEMM
    (``GemmConfig.warp_specialize``: ValueError, at construction where the transport is
    "p2p", else when the call picks it: ``check_for``). Not with ``transport="nccl"``."""
    two_shot: bool = False
    """p2p all-reduce: reduce-scatter, then all-gather (instead of every rank summing all
    rows). Each rank's reduce kernel sums only the rows it owns (1/R of them, pushed to it
    by every peer), and its copy stream pushes each reduced chunk (with the folded norm's
    row statistics) back to every peer as soon as it is ready; the GEMM reads its own rows
    from h and the peers' from the shared buffer. The same bytes cross the links as in the
    one-shot push; the reduce kernel does 1/R of the work. With a norm it needs
    ``fold_norm`` (the GEMM must read h, not normed rows; ValueError at the call). The
    residual is added by the rank that reduces a row, so it must be the same on every rank
    (the replicated residual stream of tensor parallelism is). Not with
    ``transport="nccl"``."""
    split_tail: int = 0
    """Split the GEMM's tail tiles along K into at most this many pieces (0 or 1: none):
    on the all-reduce op the tiles of the last row chunk, which all become ready at once
    at the end; on the all-gather op the tiles left over after the grid's last full wave.
    Each tail tile is cut into enough pieces to spread the tail over the GEMM's SMs
    (``overlap.policies.tail_parts``); the piece that finishes last sums the pieces'
    fp32 partials and stores the tile (``overlap.policies.split_tail``)."""
    fold_norm: bool = False
    """p2p all-reduce with a norm: fold the norm into the GEMM instead of writing the
    normed rows. The reduce kernel writes each row's statistics, B is replaced by
    diag(norm weight) B once per call (``overlap.kernels.norm_fold``), and the GEMM
    applies the rest in its epilogue. The reduce kernel then moves the bytes of the
    no-norm case plus the residual, at the cost of one pass over B per call.
    Ignored without a norm, and where ``transport=None`` resolves to NCCL; not with
    ``transport="nccl"``."""
    check: str = "async"
    """Timeout reporting: 'sync' (check after every call; synchronizes), 'async'
    (raise on a later call once the copy of the error word has landed), 'none'. A call
    that returns before its timeout is raised holds NaN where it had no data, with the
    exceptions of docs/guarantees.md, "What a call whose wait expired returns"."""

    def __post_init__(self) -> None:
        self._check_fields()
        typed = self.transport
        if isinstance(typed, (NcclTransport, PeerCopyTransport)):
            # the typed form into the flat fields: equal (and hashing equal) to the flat spelling
            for tf, ff in _TRANSPORT_FIELDS[type(typed)]:
                mine, flat = getattr(typed, tf), getattr(self, ff)
                if flat != _FLAT_DEFAULTS[ff] and flat != mine:
                    raise ValueError(f"transport={typed!r} and {ff}={flat!r} disagree: give the "
                                     f"{typed.name} transport's options in {type(typed).__name__} only")
                if mine != _FLAT_DEFAULTS[ff]:
                    object.__setattr__(self, ff, mine)
            object.__setattr__(self, "transport", typed.name)
        if getattr(self.gemm, "tail_block_m", 0):
            raise ValueError("GemmConfig.tail_block_m/n is for the GEMM alone (launch_gemm): an op's GEMM is one "
                             "launch over its table")
        if getattr(self.gemm, "flatten", False) and (self.give_back or self.split_tail > 1 or self.fold_norm):
            # the flattened kernel takes rows statically: a second grid on the same table
            # would compute them again; it has no split tiles and no folded-norm epilogue
            raise ValueError("a flattened GEMM (GemmConfig.flatten) takes no give-back grid, split tail or folded "
                             "norm: give_back=False, split_tail 0 or 1, fold_norm=False")
        if self.transport is not None:  # else each transport's rules apply where the call picks it
            self.check_for(self.transport)

    def _check_fields(self) -> None:
        """Every field's type and range (``overlap._fields``); the cross-field rules follow."""
        o = "OverlapConfig"
        int_field(o, "chunks", self.chunks, 1, MAX_CHUNKS, none_ok=True)
        int_field(o, "nccl_ctas", self.nccl_ctas, 1, 64, none_ok=True)
        int_field(o, "sm_margin", self.sm_margin, 0, MAX_SMS, none_ok=True)
        bool_field(o, "give_back", self.give_back)
        check_gemm_field(o, "gemm", self.gemm)
        float_field(o, "timeout_ms", self.timeout_ms, MIN_TIMEOUT_MS, MAX_TIMEOUT_MS, none_ok=True)
        if not (self.transport is None or isinstance(self.transport, (NcclTransport, PeerCopyTransport))
                or (isinstance(self.transport, str) and self.transport in ("nccl", "p2p"))):
            raise ValueError("OverlapConfig.transport must be 'nccl', 'p2p', NcclTransport(...), "
                             f"PeerCopyTransport(...) or None, got {self.transport!r}")
        int_field(o, "reduce_ctas", self.reduce_ctas, 1, MAX_SMS, none_ok=True)
        for f in ("reduce_shared", "two_shot", "fold_norm"):
            bool_field(o, f, getattr(self, f))
        int_field(o, "split_tail", self.split_tail, 0, 64)
        choice_field(o, "check", self.check, ("sync", "async", "none"))

    def __hash__(self) -> int:
        """The fields' hash (as the dataclass would make it), computed once per config: a
        replayed call hashes its signature, config included, to mark it warm. Not pickled
        (``__getstate__``): a string's hash differs between processes."""
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f) for f in _FIELD_NAMES))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    def check_for(self, transport: str) -> None:
        """Raise ValueError where a field set here cannot apply on ``transport`` ("nccl" or
        "p2p"), or where fields of that transport conflict whatever the call's inputs.
        Construction runs it for a given transport; an op runs it when the call picks the
        transport of a config that left it ``None`` (there the other transport's fields are
        ignored, not refused)."""
        if transport == "nccl" and self.transport == "nccl":
            wrong = [f for f in ("reduce_ctas", "reduce_shared", "two_shot", "fold_norm")
                     if getattr(self, f) != _FLAT_DEFAULTS[f]]
            if wrong:
                raise ValueError(f"{', '.join(wrong)}: peer-copy transport options (PeerCopyTransport), "
                                 "not read on transport='nccl'; leave them unset, or transport=None to "
                                 "let the call choose")
        if transport == "p2p":
            if self.transport == "p2p" and self.nccl_ctas is not None:
                raise ValueError("nccl_ctas: an NCCL transport option (NcclTransport.ctas), not read on "
                                 "transport='p2p'; leave it unset, or transport=None to let the call choose")
            if self.reduce_shared and getattr(self.gemm, "warp_specialize", False):
                # the small reduce programs are sized to fit beside the plain GEMM's; a GEMM
                # program that filled its SM would leave them queued behind tiles that wait on them
                raise ValueError("reduce_shared runs the reduce programs beside the GEMM's; not with a "
                                 "warp-specialized GEMM (GemmConfig.warp_specialize)")
            if self.reduce_shared and getattr(self.gemm, "flatten", False):
                # the same, for a GEMM whose registers and shared memory beside them were not measured
                raise ValueError("reduce_shared runs the reduce programs beside the GEMM's; not with a "
                                 "flattened GEMM (GemmConfig.flatten)")

    @property
    def transport_options(self) -> NcclTransport | PeerCopyTransport | None:
        """The transport with its options, typed (``NcclTransport`` or
        ``PeerCopyTransport``), or ``None`` where the call chooses the transport."""
        if self.transport is None:
            return None
        cls = NcclTransport if self.transport == "nccl" else PeerCopyTransport
        return cls(**{tf: getattr(self, ff) for tf, ff in _TRANSPORT_FIELDS[cls]})

    def margin(self, transport: str) -> int:
        """``sm_margin`` resolved for ``transport``."""
        if self.sm_margin is not None:
            return self.sm_margin
        env = env_sm_margin()
        if env is not None:
            return env
        return 4 if transport == "nccl" else 0


Path = OverlapConfig | Sequential | Chunked
"""What a tuner picks for a shape, and what an op then runs: the tile-flag path with an
``OverlapConfig``, the reference (``Sequential``) or the chunked baseline (``Chunked``)."""


def env_sm_margin() -> int | None:
    """``OVERLAP_SM_MARGIN``: SMs every op's grids leave free for other work on the GPU
    (``OverlapConfig.sm_margin`` where a config sets none; the chain's grids too), or None
    where unset. A job that runs data-parallel NCCL collectives beside the ops sets it to
    at least their CTA cap (``NCCL_MAX_CTAS``): then every kernel of both can be resident
    at once, and no wait of one can hold the SMs the other needs."""
    import os

    v = os.environ.get("OVERLAP_SM_MARGIN", "").strip()
    if not v:
        return None
    try:
        out = int(v)
    except ValueError:
        raise ValueError(f"OVERLAP_SM_MARGIN must be an integer, got {v!r}") from None
    if out < 0:
        raise ValueError(f"OVERLAP_SM_MARGIN must be >= 0, got {v!r}")
    return out


def _env_transport() -> str | None:
    import os

    v = os.environ.get("OVERLAP_TRANSPORT", "").strip().lower()
    if v in ("", "auto"):
        return None
    if v not in ("nccl", "p2p"):
        raise ValueError(f"OVERLAP_TRANSPORT must be 'nccl', 'p2p' or 'auto', got {v!r}")
    return v


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(OverlapConfig))
"""``OverlapConfig``'s fields, in the order its hash reads them."""
