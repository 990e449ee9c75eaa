"""All-reduce -> GEMM:  ``h = all_reduce(x_partial) (+ residual);  c = norm(h) @ b``.

    tensor      shape    on each of R ranks
    x_partial   [M, K]   this rank's partial sums (output of a row-parallel GEMM)
    residual    [M, K]   optional; the residual stream, added after the reduction
    norm        Norm     optional LayerNorm / RMSNorm over K (weight [K], bias [K])
    b           [K, N]   replicated (column shard of the next weight); any nn.Linear layout
    c           [M, N]   norm(h) @ b
    h           [M, K]   all_reduce(x_partial) + residual: the new residual stream

The tile-flag schedule (2 chunks; W = flag write, no SM):

    comm stream  | AR rows0 | AR rows1 |
    norm stream             | add+norm rows0 |W0| add+norm rows1 |W1| give-back grid |
    GEMM grid    | rows0 tiles (wait f0) ........ | rows1 tiles (wait f1) ........ |
                 ^ one persistent launch on SMs - NCCL CTAs; tiles from one atomic counter

The residual add and the norm of a chunk run on their own stream, so the
all-reduce of the next chunk is not held up behind them; their programs are
small and take whatever SM room is free. Without a residual or a norm the flag
is written on the comm stream right after the chunk's all-reduce and the GEMM
reads ``h`` itself.

On one node (``transport="p2p"``, the default where peers can map each other's
memory) no NCCL kernel runs: every rank pushes each row chunk of its partial
sums into every peer's buffer with the copy engines and writes the peer's flag
for it (``overlap._p2p``; a one-shot all-reduce, which for 2 ranks moves the
same bytes as a ring). One persistent kernel on a few SMs waits for each chunk
of every peer, sums the partials in rank order (the same bits on every rank),
adds the residual, norms, and posts the chunk's flag for the GEMM:

    copy stream  | push rows0 -> peers |W| push rows1 -> peers |W|        (copy engines)
    reduce grid  | wait rows0; sum+add+norm; post | wait rows1; ... | give-back grid |
    GEMM grid    | rows0 tiles (wait) ............ | rows1 tiles (wait) .............. |

With ``OverlapConfig(fold_norm=True)`` the reduce kernel writes no normed rows:
only each row's rstd and mean * rstd. The GEMM reads h and B' = diag(norm
weight) B, made by one pass over B per call (``overlap.kernels.norm_fold``), and
its epilogue finishes the norm. The reduce kernel then writes 8 bytes per row
instead of the normed row (and above 8192 columns skips its output pass); the
tuner weighs that against the pass over B.

Three more choices the tuner weighs (``OverlapConfig``): ``reduce_shared`` runs the
reduce kernel in small programs beside the GEMM's on every SM instead of on SMs of
its own; ``split_tail`` cuts the last chunk's GEMM tiles along K so that they
spread over the GPU when they all become ready at the end; ``two_shot`` (above 2
ranks) has each rank reduce only its share of the rows and push them back
(``_fused_two_shot``). The peer-copy paths are in ``all_reduce_p2p.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import flags as _flags
from ..observe import gpu_range
from ..protocol import COL_WAIT, COL_WAIT_MULT
from ..policies import (build_multi_tile_table, build_tile_table, flat_groups, row_chunk_segments, split_rows, split_tail, table_tensor,
                        tail_parts, upload)
from . import _calls, _graphs
from ._agree import check_dtype, collective_done, float_code, group_call
from ._calls import CallPlan, run_planned, tensor_key
from ._runtime import (LRU, SEQUENTIAL, Chunked, OverlapCaptureError, OverlapConfig, Path, Runtime, Sequential,
                       agree_on_reference, capturing, check_agree, observed, serial_phases, dtype_code, fused_call,
                       gemm_plan, get_runtime, get_runtime_if_made, on_stream, refuse_grad, resolve_group, run_p2p,
                       bucketed, plan_rows_for, split_variants, tune_paths, warn_once)

__all__ = [
    "Norm",
    "all_reduce_matmul",
    "all_reduce_matmul_ref",
    "all_reduce_matmul_chunked",
    "tune_all_reduce_matmul",
    "stats",
]

stats: dict[str, int] = {"fused": 0, "p2p": 0, "reference": 0, "chunked": 0, "sequential_by_tuner": 0, "chunked_by_tuner": 0,
                         "many": 0, "many_widest": 0,
                         "reference_in_capture": 0}
"""How many calls took each path (proof that the fast path ran)."""


@dataclass(frozen=True, eq=False)
class Norm:
    """LayerNorm or RMSNorm over the last dimension K, applied to ``h`` before the GEMM.

    ``kind``: "layernorm" (``(h - mean) / sqrt(var + eps) * weight + bias``) or
    "rmsnorm" (``h / sqrt(mean(h^2) + eps) * weight``; no bias).
    """

    kind: str
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    eps: float = 1e-5

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in ("layernorm", "rmsnorm"):
            raise ValueError(f"Norm.kind must be 'layernorm' or 'rmsnorm', got {self.kind!r}")
        if self.kind == "rmsnorm" and self.bias is not None:
            raise ValueError("rmsnorm takes no bias")
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not (0 < self.eps < 1):
            raise ValueError(f"Norm.eps must be a number in (0, 1), got {self.eps!r}")
        if not isinstance(self.weight, torch.Tensor):
            raise TypeError(f"Norm.weight must be a tensor [K], got {type(self.weight).__name__}")

    @classmethod
    def from_module(cls, m: torch.nn.Module) -> "Norm":
        """From a ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` over one dimension."""
        shape = tuple(getattr(m, "normalized_shape", ()))
        if len(shape) != 1 or getattr(m, "weight", None) is None:
            raise ValueError(f"need a norm over one dimension with a weight, got {m}")
        if isinstance(m, torch.nn.LayerNorm):
            return cls("layernorm", m.weight, m.bias, m.eps)
        if type(m).__name__ == "RMSNorm":
            # torch's RMSNorm with eps=None uses the input dtype's eps; the weight's
            # dtype stands in for it here (the same in the usual case)
            eps = m.eps if m.eps is not None else torch.finfo(m.weight.dtype).eps
            return cls("rmsnorm", m.weight, None, eps)
        raise ValueError(f"unsupported norm module {type(m).__name__}")

    def apply(self, h: torch.Tensor) -> torch.Tensor:
        """torch's own norm of ``h`` (the reference)."""
        k = h.shape[-1]
        if self.kind == "layernorm":
            return torch.nn.functional.layer_norm(h, (k,), self.weight, self.bias, self.eps)
        return torch.nn.functional.rms_norm(h, (k,), self.weight, self.eps)


def _check_inputs(x: torch.Tensor, b: torch.Tensor, residual: torch.Tensor | None, norm: Norm | None,
                  op: str = "all_reduce_matmul") -> None:
    for name, t in (("x_partial", x), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if x.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{op}: x_partial must be [M, K] and b [K, N]; got {tuple(x.shape)} and {tuple(b.shape)}")
    if x.shape[1] != b.shape[0]:
        raise ValueError(f"{op}: K mismatch: x_partial is {tuple(x.shape)} (K={x.shape[1]}), "
                         f"b is {tuple(b.shape)} (K={b.shape[0]})")
    check_dtype(op, "x_partial", x.dtype)
    if x.dtype != b.dtype:
        raise TypeError(f"{op}: dtype mismatch: x_partial {x.dtype}, b {b.dtype}")
    if x.device != b.device:
        raise ValueError(f"{op}: device mismatch: x_partial on {x.device}, b on {b.device}")
    if x.numel() == 0 or b.numel() == 0:
        raise ValueError(f"{op}: empty operand: x_partial {tuple(x.shape)}, b {tuple(b.shape)}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"{op}: residual must be a tensor or None, got {type(residual).__name__}")
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(f"{op}: residual must be {tuple(x.shape)} like x_partial, got {tuple(residual.shape)}")
        if residual.dtype != x.dtype or residual.device != x.device:
            raise TypeError(f"{op}: residual is {residual.dtype} on {residual.device}; "
                            f"x_partial is {x.dtype} on {x.device}")
    check_norm(op, norm, x, "x_partial", x.shape[1])


def check_norm(op: str, norm: "Norm | None", x: torch.Tensor, x_name: str, k: int, dim: str = "K") -> None:
    """``norm`` fits the rows it normalizes (of ``x``'s dtype and device, ``k`` wide) in
    ``op``: an ``overlap.ops.Norm`` whose weight and bias are [k] on x's device, of x's dtype
    or float32 with a float16 / bfloat16 input (what torch's norms and the kernels take);
    else an error naming the op and the norm."""
    if norm is None:
        return
    if not isinstance(norm, Norm):
        raise TypeError(f"{op}: norm must be overlap.ops.Norm or None, got {type(norm).__name__}")
    for name, t in (("weight", norm.weight), ("bias", norm.bias)):
        if t is None:
            continue
        what, which = f"{op}: norm {name}", f"the {norm.kind}'s {name}"
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} must be a tensor, got {type(t).__name__} ({which})")
        if tuple(t.shape) != (k,):
            raise ValueError(f"{what} must be [{dim}] = [{k}], got {tuple(t.shape)} ({which})")
        if t.device != x.device:
            raise ValueError(f"{what} is on {t.device}, {x_name} on {x.device} ({which})")
        if t.dtype != x.dtype and not (t.dtype == torch.float32 and x.dtype in (torch.float16, torch.bfloat16)):
            raise TypeError(f"{what} is {t.dtype}, {x_name} is {x.dtype} ({which}): a norm's weight and bias "
                            "take the input's dtype (or float32 with a float16 / bfloat16 input)")


def _finish(h: torch.Tensor, residual: torch.Tensor | None, norm: Norm | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y) from the all-reduced sum, with torch ops."""
    if residual is not None:
        h = h + residual
    y = norm.apply(h) if norm is not None else h
    return h, y


def all_reduce_matmul_ref(x_partial: torch.Tensor, b: torch.Tensor, *, group: Any = None,
                          residual: torch.Tensor | None = None,
                          norm: Norm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain reference: one NCCL (or gloo) all-reduce, the residual add, the norm,
    then ``torch.matmul``. Returns ``(c, h)``."""
    import torch.distributed as tdist

    _check_inputs(x_partial, b, residual, norm)
    group = resolve_group(group)
    s = x_partial.clone(memory_format=torch.contiguous_format)
    tm = serial_phases("all_reduce_matmul", (s.shape[0], b.shape[1], b.shape[0]), "reference", s.device)
    if tm:
        tm.start("comm")
    tdist.all_reduce(s, group=group)
    collective_done()
    if tm:
        tm.stop("comm")
        tm.start("gemm")
    h, y = _finish(s, residual, norm)
    c = y @ b
    if tm:
        tm.stop("gemm")
        tm.commit()
    stats["reference"] += 1
    return c, h


def all_reduce_matmul_chunked(x_partial: torch.Tensor, b: torch.Tensor, *, group: Any = None,
                              residual: torch.Tensor | None = None, norm: Norm | None = None,
                              chunks: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked stream-overlap baseline: per-chunk NCCL all-reduces on a side
    stream (the library's uncapped communicator); on the current stream, per
    chunk: wait for its event, add, norm and cuBLAS matmul with torch ops.

        comm     | AR c0 | AR c1 | ...
        compute          | add+norm+mm c0 (wait e0) | add+norm+mm c1 (wait e1) |
    """
    _check_inputs(x_partial, b, residual, norm)
    if not x_partial.is_cuda:
        return all_reduce_matmul_ref(x_partial, b, group=group, residual=residual, norm=norm)
    group = resolve_group(group)
    rt = get_runtime(group, x_partial.device)
    comm = rt.comm(None)
    x = x_partial.contiguous()
    m, k = x.shape
    sizes = split_rows(m, chunks, CHUNK_ALIGN)
    h = torch.empty_like(x)
    c = x.new_empty((m, b.shape[1]))
    cur = torch.cuda.current_stream(x.device)
    rt.comm_stream.wait_stream(cur)
    events = []
    start = 0
    for rows in sizes:
        comm.all_reduce(x[start:start + rows], h[start:start + rows], stream=rt.comm_stream)
        ev = torch.cuda.Event()
        ev.record(rt.comm_stream)
        events.append((ev, start, rows))
        start += rows
    for ev, s, rows in events:
        cur.wait_event(ev)
        hs = h[s:s + rows]
        if residual is not None:
            hs.add_(residual[s:s + rows])
        ys = norm.apply(hs) if norm is not None else hs
        torch.mm(ys, b, out=c[s:s + rows])
    x.record_stream(rt.comm_stream)
    h.record_stream(rt.comm_stream)
    stats["chunked"] += 1
    return c, h


# --------------------------------------------------------------------------
# the fused op
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    chunk_rows: tuple[int, ...]
    table: torch.Tensor
    grid: int
    give_back_grid: int
    nccl_ctas: int
    gemm: Any
    reduce_programs: int = 0
    starts: torch.Tensor | None = None
    ready: Any = None
    """p2p: the chunks' ready flags, which the reduce kernel's programs count up.
    Counted flags need every flag posted on every call with the same count, so
    each plan (chunking, programs) owns its own."""
    split: tuple[int, int] | None = None
    """The GEMM's split tail (first split table row, K pieces per tile), or None."""
    counters: int = 1
    """Counter words the GEMM uses: dispatch, then one per split tile."""
    reduce_shared: bool = False
    """p2p: the reduce kernel's small programs run beside the GEMM's (``OverlapConfig.reduce_shared``)."""
    two_shot: "_peer._TwoShot | None" = None
    """p2p two-shot: who reduces which rows (``OverlapConfig.two_shot``), or None."""
    groups: torch.Tensor | None = None
    """A flattened GEMM's (``GemmConfig.flatten``) runs of rows per flag (``flat_groups``)."""
    first_wait: tuple[int, int] = (0, 1)
    """(flag, expected per epoch) of the table's first row: what the stream gate before the
    GEMM grid waits for (the p2p transport's ready flags count the reduce programs)."""
    launches: LRU = field(default_factory=lambda: LRU(16))
    """Made on first use: launch plans of the call's kernels (``_runtime.gemm_plan``) and, on
    the p2p transport, per call parity the shared buffer's view and the push list."""


def _plans(rt: Runtime) -> LRU:
    """Plans on ``rt`` by shape and config, the 64 most recently used (a new M costs a new
    plan: its tile table, built with numpy and uploaded, well under a millisecond at 2048
    tiles)."""
    return rt.cache("all_reduce_matmul.plans", 64)


def _tuned(rt: Runtime) -> LRU:
    """The tuner's picks on ``rt`` (``tune_all_reduce_matmul``, ``_tune_key``), the 256 most
    recently used."""
    return rt.cache("all_reduce_matmul.tuned", 256)


CHUNK_ALIGN = 128
"""Row chunks are multiples of this (except the last), independent of the GEMM config."""


def _default_chunks(m: int) -> int:
    return max(1, min(4, m // 2048))


def _plan(rt: Runtime, m: int, n: Any, k: int, cfg: OverlapConfig, transport: str = "nccl") -> _Plan:
    """The call's plan, cached on ``rt``; ``n``: N of one weight, or a tuple of the Ns of a
    list of weights (one grid over their GEMMs, NCCL transport only)."""
    from ..kernels.tile_gemm import DEFAULT_CONFIG

    gemm = cfg.gemm or DEFAULT_CONFIG
    if gemm.flatten and isinstance(n, tuple):
        raise ValueError("all_reduce_matmul: a flattened GEMM (GemmConfig.flatten) takes one weight, not a list")
    chunks = cfg.chunks or _default_chunks(m)
    # SMs the communication side holds: NCCL's CTAs, or the p2p reduce kernel's programs
    nccl_ctas = (cfg.nccl_ctas or 16) if transport == "nccl" else 0
    reduce_ctas = (cfg.reduce_ctas or 16) if transport == "p2p" else 0
    shared = bool(reduce_ctas and cfg.reduce_shared)
    two = _peer._two_shot_layout(rt.world, rt.rank, m, chunks) if reduce_ctas and cfg.two_shot else None
    margin = cfg.margin(transport)
    key = (transport, m, n, k, chunks, nccl_ctas, reduce_ctas, margin, cfg.give_back, gemm, cfg.split_tail, shared,
           two is not None)
    plans = _plans(rt)
    p = plans.get(key)
    if p is None:
        if capturing():  # evicted since its eager call: building it uploads a table (not capturable)
            raise OverlapCaptureError(f"all_reduce_matmul: the plan for M={m}, N={n}, K={k} is not cached "
                                      "(evicted, or never run); call it once outside the capture first")
        if shared and reduce_ctas > rt.num_sms:
            raise ValueError(f"reduce_shared: at most one reduce program per SM ({rt.num_sms}), "
                             f"got reduce_ctas={reduce_ctas}")
        # the config's rules for this transport (reduce_shared with a warp-specialized GEMM):
        # checked at construction where the config names the transport, here where the call chose it
        cfg.check_for(transport)
        programs = reduce_ctas if shared else reduce_ctas * _peer.REDUCE_PROGRAMS_PER_SM
        if two is not None:
            # this rank's own row chunks (reduced here), then the peers' (gathered)
            sizes, segs, last = list(two.chunks[rt.rank]), two.segments(), rt.world - 1
        else:
            # chunk sizes must agree across ranks whatever GEMM config each rank runs:
            # align to a fixed 128 rows (a tile never straddles a chunk either way)
            sizes, segs = row_chunk_segments(m, chunks, CHUNK_ALIGN)
            last = 1
            if reduce_ctas:  # a chunk is ready when every reduce program posted it
                segs = [replace(sg, wait_mult=programs) for sg in segs]
        ns = n if isinstance(n, tuple) else (n,)
        if len(ns) > 1:
            if reduce_ctas:
                raise ValueError("all_reduce_matmul: a list of weights runs on the NCCL transport only")
            rows = build_multi_tile_table(segs, ns, gemm.block_m, gemm.block_n, array=True)
        else:
            rows = build_tile_table(segs, ns[0], gemm.block_m, gemm.block_n, array=True)
        # SMs of their own for the reduce programs, unless they run beside the GEMM's
        grid = rt.num_sms - nccl_ctas - (0 if shared else reduce_ctas) - margin
        if grid < 1:
            raise ValueError(f"no SMs left for the GEMM: {rt.num_sms} SMs, nccl_ctas={nccl_ctas}, "
                             f"reduce_ctas={reduce_ctas}, margin {margin}")
        # the last chunk's tiles all become ready at the end, when the give-back grid
        # (if any) holds the other SMs too: in K pieces they spread over them
        tail = sum(-(-sg.rows // gemm.block_m) for sg in segs[-last:]) * sum(-(-x // gemm.block_n) for x in ns)
        give_back = rt.num_sms - grid if cfg.give_back and not shared else 0
        parts = tail_parts(tail, grid + give_back, -(-k // gemm.block_k), cfg.split_tail)
        rows, split_start = split_tail(rows, tail, parts)
        split = (split_start, parts) if split_start is not None else None
        table = table_tensor(rows, rt.device)
        starts = ready = None
        if reduce_ctas:
            acc = [0]
            for r in sizes:
                acc.append(acc[-1] + r)
            starts = upload(torch.tensor(acc, dtype=torch.int32).numpy(), rt.device)
            ready = _flags.FlagArray(len(sizes), rt.device)
        groups = upload(flat_groups(rows), rt.device) if gemm.flatten else None
        # the first row's wait: chunk 0's flag (the table is in chunk order)
        first_wait = (int(rows[0][COL_WAIT]), int(rows[0][COL_WAIT_MULT])) if len(rows) else (0, 1)
        p = _Plan(tuple(sizes), table, grid, give_back, nccl_ctas, gemm, programs, starts, ready, split,
                  1 + (tail if split else 0), shared, two, groups, first_wait)
        plans[key] = p
    return p


def _tune_key(x: torch.Tensor, n: int, residual: Any, norm: Norm | None) -> tuple:
    return (x.shape[0], n, x.shape[1], x.dtype, residual is not None, norm.kind if norm else None)


@group_call("all_reduce_matmul")
def all_reduce_matmul(x_partial: torch.Tensor, b: torch.Tensor, *, group: Any = None,
                      residual: torch.Tensor | None = None, norm: Norm | None = None,
                      config: OverlapConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = all_reduce(x_partial) (+ residual)``, ``c = norm(h) @ b``, GEMM tiles
    starting as row chunks of the all-reduce land. Returns ``(c, h)``.

    ==========  ======  ====================================================
    tensor      shape   meaning
    ==========  ======  ====================================================
    x_partial   [M, K]  this rank's partial sums; M and K equal on every rank
    b           [K, N]  row-major, or ``w.t()`` of an nn.Linear weight
                        ``w`` [N, K] (never copied)
    residual    [M, K]  optional, added to the sum (not modified)
    norm        Norm    optional LayerNorm / RMSNorm over K
    returns             c [M, N], h [M, K] (the new residual stream)
    ==========  ======  ====================================================

    fp16 and bf16 on CUDA take the tile-flag path; other inputs (a CPU / gloo
    group, fp32) take ``all_reduce_matmul_ref`` with a one-time warning.
    ``config`` overrides the tuned transport ("p2p" pushes and a reduce kernel on
    ``reduce_ctas`` SMs, or "nccl"), chunking, NCCL CTA cap and GEMM config.

    ``b`` may be a list of weights (Q, K, V; SwiGLU's gate and up) that read the same normed
    rows: one all-reduce and norm, and on the NCCL transport (a list's default) their GEMMs as
    one grid, every weight's tiles of a chunk waiting on the chunk's flag; returns (the list
    of outputs, h). See ``_many``.
    """
    if isinstance(b, (list, tuple)):
        return _many(x_partial, list(b), group, residual, norm, config)
    out = _planned(x_partial, b, group, residual, norm, config)
    if out is not None:
        return out
    _check_inputs(x_partial, b, residual, norm)
    refuse_grad("all_reduce_matmul", x_partial, b, residual, *((norm.weight, norm.bias) if norm else ()))
    group = resolve_group(group)
    m, k = x_partial.shape
    n = b.shape[1]
    if not x_partial.is_cuda or x_partial.dtype not in (torch.float16, torch.bfloat16):
        warn_once(f"armm-ref-{x_partial.device.type}-{x_partial.dtype}",
                  f"all_reduce_matmul: no tile-flag path for {x_partial.dtype} on {x_partial.device.type}; "
                  "running the reference (all-reduce, add, norm, then matmul)")
        agree_on_reference(group, "all_reduce_matmul", ("M", "K", "N", "dtype", "residual", "norm"),
                           (m, k, n, dtype_code(x_partial.dtype), int(residual is not None), _norm_code(norm)),
                           x_partial.device)
        why = "no GPU" if not x_partial.is_cuda else f"dtype {x_partial.dtype}"
        return observed("all_reduce_matmul", (m, n, k), "reference", why, x_partial.device,
                        lambda: all_reduce_matmul_ref(x_partial, b, group=group, residual=residual, norm=norm))
    esize = x_partial.element_size()
    if (k * esize) % 16 or (n * esize) % 16:
        raise ValueError(f"all_reduce_matmul: K={k} and N={n} must be multiples of {16 // esize} "
                         f"for {x_partial.dtype} (16-byte rows for TMA)")
    from ..kernels.tile_gemm import check_b

    check_b(b)  # before any work is queued: a refusal later would leave streams mid-flight
    if capturing() and get_runtime_if_made(group, x_partial.device) is None:
        raise OverlapCaptureError("all_reduce_matmul: call it once outside the CUDA graph capture first")
    rt = get_runtime(group, x_partial.device)
    rt.p2p()  # collective on the first call, the same on every rank whichever path follows
    given = config is not None
    tuned = _tuned(rt).get(_tune_key(x_partial, n, residual, norm)) if config is None else None
    if config is None and not isinstance(tuned, (Sequential, Chunked)):
        config = tuned if isinstance(tuned, OverlapConfig) else OverlapConfig()
    transport = rt.transport(config) if config is not None else "nccl"
    if config is not None:
        chunks = config.chunks or _default_chunks(plan_rows_for(m, config, transport))
    else:  # the tuner's pick: the reference (one all-reduce) or the chunked baseline
        chunks = tuned.chunks if isinstance(tuned, Chunked) else 1
    # NCCL call sizes and pushed rows come from (M, K) and the chunks: ranks must agree or peers hang
    names = ("M", "K", "N", "dtype", "residual", "norm", "chunks", "p2p", "bucketed")
    values = (m, k, n, dtype_code(x_partial.dtype), int(residual is not None), _norm_code(norm), chunks,
              int(transport == "p2p"), bucketed(config, transport))
    check_agree(rt, "all_reduce_matmul", names, values, rows_at=0)
    shape = (m, n, k)

    def ref() -> tuple[torch.Tensor, torch.Tensor]:
        return all_reduce_matmul_ref(x_partial, b, group=group, residual=residual, norm=norm)

    if isinstance(tuned, Sequential):
        stats["sequential_by_tuner"] += 1
        return observed("all_reduce_matmul", shape, "sequential", "tuner pick", x_partial.device, ref)
    if capturing() and (config is None or transport == "p2p"):
        # the peer-copy transport's flags are written by the peers' copy engines with
        # epochs the host counts per call (a replay would repeat the captured epoch);
        # the chunked baseline records streams for the allocator
        warn_once("armm-capture", "all_reduce_matmul: the peer-copy transport and the chunked path cannot be "
                  "captured in a CUDA graph; the captured call runs the reference (all-reduce, add, norm, then "
                  "matmul); OverlapConfig(transport='nccl') captures the tile-flag path")
        stats["reference_in_capture"] += 1
        return observed("all_reduce_matmul", shape, "reference", "capture (p2p or chunked)", x_partial.device, ref)
    if config is None:
        stats["chunked_by_tuner"] += 1
        return observed("all_reduce_matmul", shape, f"chunked x{chunks}", "tuner pick", x_partial.device,
                        lambda: all_reduce_matmul_chunked(x_partial, b, group=group, residual=residual, norm=norm,
                                                          chunks=chunks))
    sig = (m, k, n, x_partial.dtype, b.stride(), residual is not None,
           None if norm is None else (norm.kind, norm.weight.dtype, norm.bias is not None, norm.eps), config, transport)
    rt.require_warm("all_reduce_matmul", sig)
    path = f"{transport}{' two-shot' if config.two_shot and transport == 'p2p' else ''} x{chunks}"
    why = "config given" if given else ("tuner pick" if tuned is not None else "default config")
    if transport == "p2p":
        out = rt.mark_warm("all_reduce_matmul", sig, observed(
            "all_reduce_matmul", shape, path, why, x_partial.device, run_p2p, rt, "all_reduce_matmul", _peer._fused_p2p,
            rt, x_partial.contiguous(), b, residual, norm, config))
    else:
        out = rt.mark_warm("all_reduce_matmul", sig, observed(
            "all_reduce_matmul", shape, path, why, x_partial.device, _fused, rt, x_partial.contiguous(), b, residual,
            norm, config))
    if x_partial.is_contiguous() and type(norm) in (Norm, type(None)):
        # the call returned: later ones of its signature take its plan (``_calls``)
        _calls.keep(rt, _call_key(x_partial, b, residual, norm, config, transport, given, tuned),
                    CallPlan("all_reduce_matmul", names, values, 0, sig, shape, path, why, config, transport))
    return out


def _call_key(x: torch.Tensor, b: torch.Tensor, residual: torch.Tensor | None, norm: Norm | None,
              cfg: OverlapConfig, transport: str, given: bool, tuned: Any) -> tuple:
    """A call's signature for its ``CallPlan``: everything the full path's checks and
    decisions read, but the pointers (``_calls.aligned``, per call)."""
    nk = None if norm is None else (norm.kind, norm.eps, tensor_key(norm.weight), tensor_key(norm.bias))
    return (tensor_key(x), tensor_key(b), tensor_key(residual), nk, cfg, transport, given, tuned is not None)


def _planned(x: Any, b: Any, group: Any, residual: Any, norm: Any, config: OverlapConfig | None) -> Any:
    """The call run from its signature's ``CallPlan`` (``_calls``), or None where it has
    none or needs the full path (a capture, autograd, an unaligned pointer, another
    tuned pick or transport than the plan's)."""
    if not isinstance(x, torch.Tensor) or not isinstance(b, torch.Tensor) or not x.is_cuda:
        return None
    if (residual is not None and not isinstance(residual, torch.Tensor)) or type(norm) not in (Norm, type(None)):
        return None
    if norm is not None and not (isinstance(norm.weight, torch.Tensor)
                                 and (norm.bias is None or isinstance(norm.bias, torch.Tensor))):
        return None
    nw, nb = (norm.weight, norm.bias) if norm is not None else (None, None)
    if capturing():
        return None
    seen = _calls.scan(x, b, residual, nw, nb)  # (None: autograd, or an unaligned pointer)
    if seen is None:
        return None
    keys, ptrs = seen
    g = resolve_group(group)
    # the index: one dict read for a signature seen before (``_calls.index_lookup``)
    ikey = ("all_reduce_matmul", id(g), id(config), keys, None if norm is None else (norm.kind, norm.eps))
    hit = _calls.index_lookup(ikey, g, config)
    if hit is not None:
        rt, cp, cfg, transport = hit
    else:  # the full lookup, indexed where it finds a plan
        # (not asked of an index hit: its key holds the shapes it was made for)
        if x.dim() != 2 or b.dim() != 2:  # the full path's checks say what is wrong
            return None
        gen, env = _calls.generation(), _calls.transport_env()
        rt = get_runtime_if_made(g, x.device)
        if rt is None:
            return None
        tuned = tcache = tkey = None
        cfg = config
        if config is None:
            tcache, tkey = _tuned(rt), _tune_key(x, b.shape[1], residual, norm)
            tuned = tcache.get(tkey)
            if isinstance(tuned, (Sequential, Chunked)):
                return None
            cfg = tuned if isinstance(tuned, OverlapConfig) else OverlapConfig()
        transport = rt.transport(cfg)
        key = _call_key(x, b, residual, norm, cfg, transport, config is not None, tuned)
        cp = _calls.find(rt, "all_reduce_matmul", key)
        if cp is None:
            return None
        _calls.index(ikey, gen, g, config, env, rt, cp, cfg, transport, tcache if tuned is not None else None,
                     tkey, key)
    _calls.stats["planned"] += 1
    if transport == "p2p":
        return run_planned(rt, cp, run_p2p, rt, "all_reduce_matmul", _peer._fused_p2p, rt, x, b, residual, norm, cfg)
    body = cp.body
    if body is None and not (cfg.gemm is not None and cfg.gemm.flatten):
        body = cp.body = _Bound(rt, x, b, residual, norm, cfg)
    if body is not None:
        # the inputs a graph reads in place (every one not in ``_Bound.moving``): b, the norm's weight and bias
        out = _graphs.replay_or_capture(rt, cp, body, (x, b, residual, norm), (ptrs[1], ptrs[3], ptrs[4]))
        if out is not _graphs.NO:
            return out
        if body.ready():
            return _calls.run_bound(rt, cp, x, b, residual, norm)
    return run_planned(rt, cp, _fused, rt, x, b, residual, norm, cfg)


class _Bound(_calls.BoundBody):
    """``_fused`` for one call signature (one weight), bound (``_calls``): the op plan of its
    row bucket, the GEMM plan, communicator, error word, wait bound, words, streams, events
    and the gate decided once; each chunk's all-reduce, add+norm launch and flag post and
    the GEMM's launches with their arguments made. A call allocates h, y and C, then
    queues what ``_fused`` queues, in its order::

        comm stream | AR chunk0 (bound) | AR chunk1 | ...                 [give-back grid]
        aux stream  |       ev | add+norm 0 |W0| ev | add+norm 1 |W1|    [give-back grid]
        caller      | zero | fork | gate | grid (waits per chunk) | join |"""

    moving = (0, 2)
    """The arguments a plan graph copies in per call (``_graphs``); the others are read in place."""

    def __init__(self, rt: Runtime, x: torch.Tensor, b: torch.Tensor, residual: torch.Tensor | None,
                 norm: Norm | None, cfg: OverlapConfig) -> None:
        from ..kernels import gate as _gate

        m, k = x.shape
        n = b.shape[1]
        self.rt, self.m, self.k, self.n = rt, m, k, n
        self.mb = mb = plan_rows_for(m, cfg, "nccl")
        self.p = p = _plan(rt, mb, n, k, cfg)
        comm = rt.comm(p.nccl_ctas)
        self.err = err = rt.err("all_reduce_matmul")
        self.check = cfg.check
        # a plan graph (``_graphs``): its config and GEMM work (``auto`` graphs the small ones)
        self.cfg, self.flops = cfg, 2 * m * k * n
        self.timeout_ns = timeout_ns = int((cfg.timeout_ms or _flags.default_timeout_ms(rt.group)) * 1e6)
        # the kernels read the residual and the norm's weight and bias contiguous (``_contiguous``)
        self.copies = (residual is not None and not residual.is_contiguous(),
                       norm is not None and not norm.weight.is_contiguous(),
                       norm is not None and norm.bias is not None and not norm.bias.is_contiguous())
        self.prepare = self._copy_strided if any(self.copies) else None
        residual, norm = _contiguous(residual, norm)
        self.has_res, self.has_norm = residual is not None, norm is not None
        self.prologue = prologue = residual is not None or norm is not None
        self.cs, self.ns = cs, ns = rt.comm_stream, rt.aux_stream
        self.side = (cs, ns) if prologue else (cs,)
        with rt.order.lock:
            self.words = w = rt.local_words("all_reduce_matmul", p.counters, len(p.chunk_rows))
        self.bind_frame()
        self.gated = _gate.enabled()
        self.cut = (m, mb)
        h = torch.empty_like(x)
        y = torch.empty_like(x) if norm is not None else h
        c = x.new_empty((m, n))
        chunks = []
        start = 0
        post_on = ns if prologue else cs
        for c_idx, rows in enumerate(p.chunk_rows):
            live = min(rows, m - start)
            reduce = None
            if live > 0:
                bound = getattr(comm, "bound", None)
                reduce = bound("all_reduce", x[start:start + live], h[start:start + live], cs) if bound is not None \
                    else (lambda s_, r_, comm=comm: comm.all_reduce(s_, r_, stream=cs))
            ev = rt.event(("chunk", c_idx)) if prologue and live > 0 else None
            # (start, live, the bound all-reduce, the chunk's event, the bound flag post)
            chunks.append((start, live, reduce, ev, _flags.bound_write_value(post_on, w.flags, c_idx, 1)))
            start += rows
        self.chunks = tuple(chunks)
        self.norm_args = (norm.kind if norm else None, norm.eps if norm else 1e-5)
        self.gp = gemm_plan(p.launches, y, b, c, p.table, flags=w.flags, err=err.word, timeout_ns=timeout_ns,
                            counter=w.counters, rank=rt.rank, config=p.gemm, wait=True, split=p.split,
                            groups=p.groups, clip=True)
        self.b_kn = getattr(self.gp, "b_kn", True)
        self.bound, self.whole = False, False
        self.bl_norm: tuple = ()
        self.bl_gate = self.bl = self.bl_back = None

    def _tensors(self, h: torch.Tensor, y: torch.Tensor, residual: Any, norm: Any) -> tuple:
        return (h, residual if residual is not None else h, y if self.has_norm else h,
                norm.weight if norm is not None else h, norm.bias if norm is not None and norm.bias is not None else h)

    def _bind_launches(self, x: torch.Tensor, b: torch.Tensor, h: torch.Tensor, y: torch.Tensor, c: torch.Tensor,
                       residual: Any, norm: Any) -> None:
        """Bind the launches (after a general launch of each); one that cannot be bound
        leaves the body on its general launches."""
        from ..kernels import gate as _gate
        from ..kernels.add_norm import bind_add_norm

        self.bound = True
        p, w = self.p, self.words
        bind = _calls.gemm_bind(self.gp)
        if bind is None:
            return
        if self.prologue:
            kind, eps = self.norm_args
            bl_norm = tuple(bind_add_norm(h, start, live, residual=residual, norm=kind,
                                          weight=norm.weight if norm else None, bias=norm.bias if norm else None,
                                          eps=eps, y=y if norm is not None else None)
                            for start, live, _, _, _ in self.chunks if live > 0)
            if any(bl is None for bl in bl_norm):
                return
            self.bl_norm = bl_norm
        if self.gated:
            self.bl_gate = _gate.bind_gate(w.flags, 0, 1, 3, self.err.word, rank=self.rt.rank,
                                           timeout_ns=self.timeout_ns)
            if self.bl_gate is None:
                return
        self.bl = bind(y, b, c, epoch=1, grid=p.grid, rows=self.cut)
        if p.give_back_grid:
            self.bl_back = bind(y, b, c, epoch=1, grid=p.give_back_grid, rows=self.cut)
        self.whole = self.bl is not None and (self.bl_back is not None or not p.give_back_grid)

    def _copy_strided(self, args: tuple) -> tuple:
        """``prepare``: the strided residual and norm parameters copied on the caller's
        stream before the frame forks (the aux stream's add+norm reads them), as ``_fused``
        copies them before its ``fused_call``."""
        x, b, residual, norm = args
        copies = self.copies
        if copies[0]:
            residual = residual.contiguous()
        if copies[1] or copies[2]:
            residual, norm = _contiguous(residual, norm)
        return x, b, residual, norm

    def run(self, raw: int, cur: Any, x: torch.Tensor, b: torch.Tensor, residual: Any, norm: Any) -> Any:
        h = torch.empty_like(x)
        y = torch.empty_like(x) if self.has_norm else h
        c = x.new_empty((self.m, self.n))
        whole = self.whole and not c.data_ptr() % 16
        t_norm = self._tensors(h, y, residual, norm) if whole and self.prologue else None
        cs, ns, i = self.cs, self.ns, 0
        for start, live, reduce, ev, post in self.chunks:
            if live > 0:
                reduce(x[start:start + live], h[start:start + live])
                if ev is not None:
                    self.rec(ev, cs)
                    self.wait(ev, ns)
                    if whole:
                        self.bl_norm[i](ns.cuda_stream, t_norm)
                    else:
                        body_add_norm(ns, cur, h, start, live, residual, norm, self.norm_args, y)
                    i += 1
            post()
        if whole:
            t = (y, None, b if self.b_kn else b.t(), c, None, None)
            if self.bl_gate is not None:
                self.bl_gate(raw, ())
            self.bl(raw, t)
            if self.bl_back is not None:
                self.bl_back((ns if self.prologue else cs).cuda_stream, t)
        else:
            gp, p = self.gp, self.p
            descs = gp.operands(y, b)
            if self.gated:
                from ..kernels import gate as _gate

                _gate.launch_gate(self.words.flags, 0, 1, 3, self.err.word, rank=self.rt.rank,
                                  timeout_ns=self.timeout_ns)
            gp.launch(descs, c, epoch=1, grid=p.grid, rows=self.cut)
            if p.give_back_grid:
                with on_stream(ns if self.prologue else cs, cur):
                    gp.launch(descs, c, epoch=1, grid=p.give_back_grid, rows=self.cut)
            if not self.bound:
                self._bind_launches(x, b, h, y, c, residual, norm)
        stats["fused"] += 1
        return c, h

    def fused(self, x: torch.Tensor, b: torch.Tensor, residual: torch.Tensor | None, norm: Norm | None) -> Any:
        """The call as the fused body runs it (what a plan graph captures)."""
        return _fused(self.rt, x, b, residual, norm, self.cfg)

    def __repr__(self) -> str:
        p = self.p
        prologue = ("residual + " if self.has_res else "") + (f"{self.norm_args[0]}" if self.has_norm else "")
        return (f"all_reduce_matmul body: M {self.m} (plan of {self.mb} rows), N {self.n}, K {self.k}, "
                f"{len(self.chunks)} chunk(s) on NCCL ({p.nccl_ctas} CTAs)"
                + (f", {prologue.rstrip(' +')} per chunk on the aux stream" if self.prologue else "")
                + f", grid {p.grid}" + (f" + give-back {p.give_back_grid}" if p.give_back_grid else "")
                + (", gate first" if self.gated else "") + f", launches {'bound' if self.whole else 'general'}, "
                f"wait bound {self.timeout_ns / 1e6:g} ms, check {self.check!r}")


def _many(x_partial: torch.Tensor, bs: list[torch.Tensor], group: Any, residual: torch.Tensor | None,
          norm: Norm | None, config: OverlapConfig | None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``all_reduce_matmul`` with a list of weights. One all-reduce, add and norm; the
    weights' GEMMs as one grid over the normed rows (``build_multi_tile_table``: per chunk,
    weight 0's tiles, then 1's, ..., all waiting on the chunk's flag) on the NCCL transport,
    which a list takes unless the config asks for the peer-copy one. Up to ``MAX_WEIGHTS``
    weights of one B layout. Otherwise (more weights, mixed layouts, ``transport="p2p"``,
    CPU or fp32) the widest weight's GEMM runs in the op and the others read the normed
    rows after it, with the reason in ``overlap.report()``. Not tuned: ``config`` or the
    default chunking on NCCL."""
    from ..kernels.tile_gemm import check_b
    from .all_gather import _many_refusal, check_weight_list

    check_weight_list("all_reduce_matmul", x_partial, "x_partial", bs,
                      lambda w: _check_inputs(x_partial, w, residual, norm))
    refuse_grad("all_reduce_matmul", x_partial, residual, *bs, *((norm.weight, norm.bias) if norm else ()))
    group = resolve_group(group)
    m, k = x_partial.shape
    ns = tuple(w.shape[1] for w in bs)
    why = _many_refusal(bs)
    if why is None and (not x_partial.is_cuda or x_partial.dtype not in (torch.float16, torch.bfloat16)):
        why = "no tile-flag path"
    if why is None and config is not None and config.transport == "p2p":
        why = "the peer-copy transport takes one weight"
    if why is None and (config is None or config.transport is None):
        rt = get_runtime(group, x_partial.device)
        rt.p2p()  # collective on the first call (as below): finds ranks sharing this GPU
        if rt.shared_gpu and rt.world > 1:  # the one grid runs on NCCL, which the mode refuses
            why = "shared-GPU mode: the peer-copy transport takes one weight"
    if why is not None:
        return _widest(x_partial, bs, group, residual, norm, config, why)
    esize = x_partial.element_size()
    if (k * esize) % 16 or any((x * esize) % 16 for x in ns):
        raise ValueError(f"all_reduce_matmul: K={k} and N={ns} must be multiples of {16 // esize} "
                         f"for {x_partial.dtype} (16-byte rows for TMA)")
    for w in bs:
        check_b(w)  # before any work is queued
    if capturing() and get_runtime_if_made(group, x_partial.device) is None:
        raise OverlapCaptureError("all_reduce_matmul: call it once outside the CUDA graph capture first")
    rt = get_runtime(group, x_partial.device)
    rt.p2p()  # collective on the first call, the same on every rank whichever path follows
    given = config is not None
    config = replace(config or OverlapConfig(), transport="nccl") if (config is None or config.transport is None) \
        else config
    chunks = config.chunks or _default_chunks(plan_rows_for(m, config, "nccl"))
    check_agree(rt, "all_reduce_matmul", ("M", "K", "N", "dtype", "residual", "norm", "chunks", "p2p", "bucketed")
                + tuple(f"N{i}" for i in range(1, len(ns))),
                (m, k, ns[0], dtype_code(x_partial.dtype), int(residual is not None), _norm_code(norm), chunks, 0,
                 bucketed(config, "nccl")) + ns[1:], rows_at=0)
    sig = (m, k, ns, x_partial.dtype, tuple(w.stride() for w in bs), residual is not None,
           None if norm is None else (norm.kind, norm.weight.dtype, norm.bias is not None, norm.eps), config, "nccl")
    rt.require_warm("all_reduce_matmul", sig)
    stats["many"] += 1
    return rt.mark_warm("all_reduce_matmul", sig, observed(
        "all_reduce_matmul", (m, sum(ns), k), f"nccl x{chunks}, {len(bs)} weights in one grid",
        "config given" if given else "default config", x_partial.device, _fused, rt, x_partial.contiguous(), bs,
        residual, norm, config))


def _widest(x_partial: torch.Tensor, bs: list[torch.Tensor], group: Any, residual: torch.Tensor | None,
            norm: Norm | None, config: OverlapConfig | None, why: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A list of weights not run as one grid: the widest weight's GEMM in the op (the first
    of equals), the others on the normed rows after it (recomputed from h with torch ops).
    Counted in ``overlap.report()`` with ``why``; warned once where the one grid was possible
    on this input."""
    first = max(range(len(bs)), key=lambda i: (bs[i].shape[1], -i))
    if why != "no tile-flag path":
        warn_once(f"armm-widest-{why}", f"all_reduce_matmul: a list of weights not run as one grid ({why}); the "
                  "widest weight's GEMM is overlapped, the others run by torch.matmul after it")
        stats["many_widest"] += 1

    def run() -> tuple[list[torch.Tensor], torch.Tensor]:
        c0, h = all_reduce_matmul(x_partial, bs[first], group=group, residual=residual, norm=norm, config=config)
        y = norm.apply(h) if norm is not None else h
        return [c0 if i == first else y @ w for i, w in enumerate(bs)], h

    return observed("all_reduce_matmul", (x_partial.shape[0], sum(w.shape[1] for w in bs), x_partial.shape[1]),
                    f"widest fused, {len(bs) - 1} by torch.matmul", why, x_partial.device, run)


def _norm_code(norm: Norm | None) -> int:
    """The norm as one int for the ranks' agreement: 0 none, else a CRC-32 (never 0) of its
    kind, eps (its exact bits) and the weight's and bias's dtypes, the same on every rank."""
    if norm is None:
        return 0
    import zlib

    bias = None if norm.bias is None else str(norm.bias.dtype)
    return zlib.crc32(repr((norm.kind, float_code(norm.eps), str(norm.weight.dtype), bias)).encode()) | 1


def _contiguous(residual: torch.Tensor | None, norm: Norm | None) -> tuple[torch.Tensor | None, Norm | None]:
    """The residual and the norm's weight and bias as the kernels read them (contiguous)."""
    if residual is not None:
        residual = residual.contiguous()
    if norm is not None:
        norm = Norm(norm.kind, norm.weight.contiguous(), None if norm.bias is None else norm.bias.contiguous(),
                    norm.eps)
    return residual, norm


def gate(flags: torch.Tensor, err: Any, rank: int, timeout_ns: int, *, idx: int = 0, expected: int = 1,
         ahead: int = 3) -> None:
    """Before a grid whose first tiles wait on flag ``idx`` (by default chunk 0's, posted
    once per call, so expected 1): a one-program bounded wait for it on the current stream,
    so that the grid does not hold its SMs while the first chunk is late (a peer seconds
    behind); ``overlap.kernels.gate``. Off with ``OVERLAP_STREAM_GATE=0``."""
    from ..kernels import gate as _gate

    if _gate.enabled():
        with gpu_range("gate", "chunk", 0):
            _gate.launch_gate(flags, idx, expected, ahead, err.word, rank=rank, timeout_ns=timeout_ns)


def chunk_ready(cur: Any, cs: Any, ns: Any, h: torch.Tensor, y: torch.Tensor, start: int, rows: int,
                residual: torch.Tensor | None, norm: Norm | None, flags: torch.Tensor, idx: int,
                event: Any = None) -> None:
    """Rows [start, start + rows) of ``h`` were reduced on the comm stream ``cs``: add the
    residual and write ``norm(h)`` to ``y`` on the aux stream ``ns`` behind them, then post
    flag ``idx`` there; without a prologue (``ns`` None) post it on ``cs`` right away. The
    NCCL consumer half of ``all_reduce_matmul`` and of the block boundary."""
    from ..kernels.add_norm import launch_add_norm

    if ns is None:
        _flags.stream_write_value(cs, flags, idx, 1)
        return
    # ``event``: the runtime's of the chunk (``Runtime.event``, reused call after call), or
    # None: a new one
    ev = event if event is not None else torch.cuda.Event()
    ev.record(cs)
    ns.wait_event(ev)
    with on_stream(ns, cur), gpu_range("aux", "add+norm", idx):
        launch_add_norm(h, start, rows, residual=residual, norm=norm.kind if norm else None,
                        weight=norm.weight if norm else None, bias=norm.bias if norm else None,
                        eps=norm.eps if norm else 1e-5, y=y)
        _flags.stream_write_value(ns, flags, idx, 1)


def body_add_norm(ns: Any, cur: Any, h: torch.Tensor, start: int, rows: int, residual: torch.Tensor | None,
                  norm: Norm | None, norm_args: tuple, y: torch.Tensor) -> None:
    """A bound body's add+norm of rows [start, start + rows) on the aux stream ``ns`` through
    the general launch (``norm_args``: the body's (kind, eps)); the body has posted nothing
    for these rows yet. ``all_reduce_matmul``'s body and the block boundary's."""
    from ..kernels.add_norm import launch_add_norm

    kind, eps = norm_args
    with on_stream(ns, cur):
        launch_add_norm(h, start, rows, residual=residual, norm=kind, weight=norm.weight if norm else None,
                        bias=norm.bias if norm else None, eps=eps, y=y if norm is not None else None)


def _fused(rt: Runtime, x: torch.Tensor, b: Any, residual: torch.Tensor | None, norm: Norm | None,
           cfg: OverlapConfig) -> tuple[Any, torch.Tensor]:
    """The NCCL transport; ``b`` one weight (c a tensor) or a list of them (one grid over
    their GEMMs, every weight's tiles of a chunk waiting on its flag; c their list)."""
    m, k = x.shape
    many = isinstance(b, list)
    n = tuple(w.shape[1] for w in b) if many else b.shape[1]
    # the plan of m's row bucket: chunks, tile table and launches shared by every M in it
    mb = plan_rows_for(m, cfg, "nccl")
    p = _plan(rt, mb, n, k, cfg)
    comm = rt.comm(p.nccl_ctas)
    err = rt.err("all_reduce_matmul")
    timeout_ns = int((cfg.timeout_ms or _flags.default_timeout_ms(rt.group)) * 1e6)
    residual, norm = _contiguous(residual, norm)
    prologue = residual is not None or norm is not None
    cs, ns = rt.comm_stream, rt.aux_stream
    # the dispatch counter (and split tiles' counts) and the chunk flags, zeroed on the
    # caller's stream before the side streams fork: no epoch (``_runtime.LocalWords``)
    with fused_call(rt, err, cfg.check, (cs, ns) if prologue else (cs,),
                    ("all_reduce_matmul", p.counters, len(p.chunk_rows))) as (cur, (w,)):
        h = torch.empty_like(x)
        y = torch.empty_like(x) if norm is not None else h
        c = [x.new_empty((m, ni)) for ni in n] if many else x.new_empty((m, n))
        # the bucket's chunks cut at m: the chunks past it reduce nothing, their flags
        # posted all the same; the GEMM's tiles are cut at m
        start = 0
        for c_idx, rows in enumerate(p.chunk_rows):
            live = min(rows, m - start)
            if live > 0:
                with gpu_range("comm", "chunk", c_idx):
                    comm.all_reduce(x[start:start + live], h[start:start + live], stream=cs)
                chunk_ready(cur, cs, ns if prologue else None, h, y, start, live, residual, norm, w.flags, c_idx,
                            rt.event(("chunk", c_idx)) if prologue else None)
            else:
                _flags.stream_write_value(ns if prologue else cs, w.flags, c_idx, 1)
            start += rows
        clip = not p.gemm.flatten
        gp = gemm_plan(p.launches, y, b, c, p.table, flags=w.flags, err=err.word, timeout_ns=timeout_ns,
                       counter=w.counters, rank=rt.rank, config=p.gemm, wait=True, split=p.split, groups=p.groups,
                       clip=clip)
        descs = gp.operands(y, b)
        cut = (m, mb) if clip else None
        gate(w.flags, err, rt.rank, timeout_ns)
        with gpu_range("gemm", "grid"):
            gp.launch(descs, c, epoch=1, grid=p.grid, rows=cut)
        last = ns if prologue else cs
        if p.give_back_grid:
            # queued behind the last chunk: NCCL's SMs are free by then
            with on_stream(last, cur), gpu_range("giveback", "grid"):
                gp.launch(descs, c, epoch=1, grid=p.give_back_grid, rows=cut)
    stats["fused"] += 1
    return c, h


# --------------------------------------------------------------------------
# tuner
# --------------------------------------------------------------------------

def tune_all_reduce_matmul(x_partial: torch.Tensor, b: torch.Tensor, *, group: Any = None,
                           residual: torch.Tensor | None = None, norm: Norm | None = None,
                           candidates: list[OverlapConfig] | None = None, iters: int = 10,
                           verbose: bool = False, split_pass: bool | None = None) -> Path:
    """Time candidate configs (collectively: every rank must call), the plain
    sequential path and the chunked stream-overlap path (2 and 4 chunks); cache
    the winner for this shape, residual and norm kind. Returns the winning
    ``OverlapConfig``, ``SEQUENTIAL`` or ``Chunked(2)`` / ``Chunked(4)``;
    for the last three the op warns once and runs that path for this case.

    Default candidates: 1, 2, 4 chunks x 16, 24, 32 NCCL CTAs; with a residual
    or a norm also 2 and 4 chunks x 24, 32 CTAs with 20 SMs more left free (the
    add + norm kernels run on the SMs the GEMM grid leaves free); where peer
    memory is available, the p2p transport in 4, 8 and 16 chunks x 16, 24, 32, 48 SMs
    for the reduce kernel, 2 chunks x 24, 32, two probes without the give-back grid,
    without a norm 8 and 16 chunks x 12 SMs, and with a norm the norm folded into the
    GEMM (``OverlapConfig.fold_norm``) in 4, 8 and 16 chunks x 16, 20, 24, 32 SMs, and the reduce
    kernel beside the GEMM on every SM (``OverlapConfig.reduce_shared``) in 4, 8 and 16 chunks
    x 66 and 132 programs, folded or not, and above 2 ranks two-shot (``OverlapConfig.two_shot``;
    folded with a norm) in 4, 8 and 16 chunks x 8 and 16 SMs (16 and 24 with a norm). ``split_pass`` (default: with the default
    candidates only): time the two fastest configs again with the last chunk's tiles split
    along K (``OverlapConfig.split_tail`` 2 and 8). A warp-specialized GEMM
    (``GemmConfig.warp_specialize``) is not tried: on the SMs the reduce kernel leaves it
    was no faster in any pair of configs timed with and without it (README). Inputs with
    no tile-flag path (CPU, fp32, unaligned K or N) return ``SEQUENTIAL`` untimed."""
    _check_inputs(x_partial, b, residual, norm)
    group = resolve_group(group)
    m, k = x_partial.shape
    n = b.shape[1]
    esize = x_partial.element_size()
    if (not x_partial.is_cuda or x_partial.dtype not in (torch.float16, torch.bfloat16)
            or (k * esize) % 16 or (n * esize) % 16):
        return SEQUENTIAL  # no tile-flag path for these inputs: nothing to tune
    from ..kernels.tile_gemm import check_b

    check_b(b)
    rt = get_runtime(group, x_partial.device)
    x = x_partial.contiguous()
    split_pass = candidates is None if split_pass is None else split_pass
    if candidates is None:
        candidates = [OverlapConfig(chunks=ch, nccl_ctas=ct, transport="nccl") for ch in (1, 2, 4)
                      for ct in (16, 24, 32)]
        if residual is not None or norm is not None:  # the add + norm kernels need free SMs
            candidates += [OverlapConfig(chunks=ch, nccl_ctas=ct, sm_margin=24, transport="nccl")
                           for ch in (2, 4) for ct in (24, 32)]
        if rt.transport(OverlapConfig()) == "p2p":
            candidates = ([OverlapConfig(chunks=ch, reduce_ctas=rc, transport="p2p") for ch in (4, 8, 16)
                           for rc in (16, 24, 32, 48)]
                          + [OverlapConfig(chunks=2, reduce_ctas=rc, transport="p2p") for rc in (24, 32)]
                          + [OverlapConfig(chunks=8, reduce_ctas=rc, give_back=False, transport="p2p")
                             for rc in (24, 32)]
                          # without a norm the reduce kernel keeps up with the pushes on fewer SMs
                          + ([OverlapConfig(chunks=ch, reduce_ctas=12, transport="p2p") for ch in (8, 16)]
                             if norm is None else [])
                          # with a norm folded into the GEMM, the reduce kernel writes no normed rows,
                          # only statistics, summed per segment in one warp (add_norm): 16-32 SMs keep up
                          + ([OverlapConfig(chunks=ch, reduce_ctas=rc, fold_norm=True, transport="p2p")
                              for ch in (4, 8, 16) for rc in (16, 20, 24, 32)] if norm is not None else [])
                          # the reduce kernel's small programs beside the GEMM's, on every SM
                          + [OverlapConfig(chunks=ch, reduce_ctas=rc, reduce_shared=True, fold_norm=fold,
                                           transport="p2p")
                             for fold in ((False, True) if norm is not None else (False,))
                             for ch in (4, 8, 16) for rc in (66, 132)]
                          # two-shot: each rank reduces 1/R of the rows (a norm folded). At 2 ranks the
                          # reduced chunk's push back adds a copy to the last rows' path and it lost to
                          # the one-shot push (docs/experiments.md), so only past 2 ranks, where the
                          # one-shot push moves R - 1 times a rank's rows
                          + ([OverlapConfig(chunks=ch, reduce_ctas=rc, two_shot=True, fold_norm=norm is not None,
                                            transport="p2p")
                              for ch in (4, 8, 16) for rc in ((16, 24) if norm is not None else (8, 16))]
                             if rt.world > 2 else [])
                          + candidates)
    def run(cand: OverlapConfig) -> Any:
        fused = _peer._fused_p2p if rt.transport(cand) == "p2p" else _fused
        return fused(rt, x, b, residual, norm, cand)

    def describe(cand: OverlapConfig) -> str:
        return (f"  tune armm {m}x{n}x{k}: {rt.transport(cand)}, {cand.chunks} chunks, {cand.nccl_ctas} ctas, "
                f"reduce {cand.reduce_ctas}{' shared' if cand.reduce_shared else ''}, margin {cand.sm_margin}"
                + (", two-shot" if cand.two_shot else "")
                + (", norm folded" if cand.fold_norm else "")
                + (f", split tail {cand.split_tail}" if cand.split_tail > 1 else "")
                + (", warp-specialized GEMM" if getattr(cand.gemm, "warp_specialize", False) else ""))

    def chunked(c: int) -> Any:
        return lambda: all_reduce_matmul_chunked(x, b, group=group, residual=residual, norm=norm, chunks=c)

    return tune_paths(rt, "all_reduce_matmul", (m, n, k), f"armm {m}x{n}x{k}",
                      ref=lambda: all_reduce_matmul_ref(x, b, group=group, residual=residual, norm=norm),
                      baselines={Chunked(c): chunked(c) for c in (2, 4)}, candidates=candidates, run=run,
                      describe=describe, iters=iters, group=group, verbose=verbose, cache=_tuned(rt),
                      key=_tune_key(x, n, residual, norm), passes=(split_variants,) if split_pass else ())


from . import all_reduce_p2p as _peer  # noqa: E402  (it reads this module at call time)
