"""All-gather -> GEMM:  ``c = all_gather(a_shard, dim=0) @ b``.

    tensor      shape      on each of R ranks
    a_shard     [M/R, K]   this rank's rows (sequence-parallel activations)
    b           [K, N]     replicated (column shard of a weight); any nn.Linear layout
    c           [M, N]     rows of rank r at r*M/R .. (r+1)*M/R
    gathered    [M, K]     all_gather(a_shard), returned when asked (backward needs it)

The tile-flag schedule (R = 2, 2 chunks; W = flag write, no SM):

    comm stream  | AG chunk0 |W0| AG chunk1 |W1| give-back grid (NCCL's SMs) |
    GEMM grid    | local-shard tiles (no wait) |gate f0| chunk0 tiles (wait f0) | chunk1 tiles (wait f1) |
                 ^ persistent grids on SMs - NCCL CTAs: the local shard's, then behind a
                   one-program gate the peers' rows', tiles from an atomic counter each

The gathered buffer is chunk-major (chunk c of every rank lands contiguously by
one NCCL all-gather) and laid out for M/R's row bucket (``policies.plan_rows``);
the GEMM writes C in natural row order, so only ``return_gathered`` pays a row
permutation (more than one chunk) or a copy (M/R under its bucket's top).

On one node the rows can move without NCCL (``transport="p2p"``, the default
where peers can map each other's memory): every rank pushes its chunks into
each peer's buffer with the copy engines and writes the peer's flag for that
chunk from the same stream (``overlap._p2p``). No SM moves data, so the GEMM
grid covers every SM and there is no give-back launch:

    copy stream  | push c0 -> peers |W| push c1 -> peers |W|      (copy engines; W = peer flag write)
    GEMM grid    | local-shard tiles | peer c0 tiles (wait) | peer c1 tiles (wait) |   (all SMs)

This module holds the op's front, its reference and chunked baseline, the plans, the NCCL
transport and the tuner; the peer-copy transport is in ``all_gather_p2p.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import flags as _flags
from ..observe import gpu_range
from ..protocol import COL_WAIT, COL_WAIT_MULT
from ..policies import (AllGatherLayout, all_gather_layout, all_gather_push_layout, build_multi_tile_table,
                        build_tile_table, flat_groups, split_tail, table_rows, table_tensor, tail_parts,
                        upload)
from . import _calls, _graphs
from ._agree import check_dtype, collective_done, group_call
from ._calls import CallPlan, aligned, run_planned
from ._runtime import (LRU, SEQUENTIAL, OverlapCaptureError, OverlapConfig, Path, Runtime, Sequential, bucketed,
                       plan_rows_for,
                       agree_on_reference, all_gather_single, keep_for_capture, capturing, check_agree, observed,
                       serial_phases, dtype_code, fused_call, gemm_plan, get_runtime, get_runtime_if_made, on_stream,
                       refuse_grad, resolve_group, run_p2p, split_variants, tune_paths, warn_once, ws_variants)

__all__ = [
    "all_gather_matmul",
    "all_gather_matmul_ref",
    "all_gather_matmul_chunked",
    "stats",
    "tune_all_gather_matmul",
]

stats: dict[str, int] = {"fused": 0, "p2p": 0, "reference": 0, "chunked": 0, "sequential_by_tuner": 0,
                         "reference_in_capture": 0, "many": 0, "many_widest": 0}
"""How many calls took each path (proof that the fast path ran). ``many``: calls with a
list of weights whose GEMMs ran as one grid (also counted in ``fused``); ``many_widest``:
calls with a list that the one grid does not take (``_many_refusal``): the widest weight's
GEMM fused, the others by ``torch.matmul`` after it."""

MAX_WEIGHTS = 4
"""Weights one grid takes (``overlap.kernels.tile_gemm.MAX_WEIGHTS``); a longer list runs
the widest weight's GEMM fused and the others after it, the reason in ``overlap.report()``."""


_group = resolve_group


def _world(group: Any) -> tuple[int, int]:
    import torch.distributed as tdist

    return tdist.get_world_size(group), tdist.get_rank(group)


def _check_inputs(a_shard: torch.Tensor, b: torch.Tensor) -> None:
    op = "all_gather_matmul"
    for name, t in (("a_shard", a_shard), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if a_shard.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{op}: a_shard must be [M/R, K] and b [K, N]; got {tuple(a_shard.shape)} and "
                         f"{tuple(b.shape)}")
    if a_shard.shape[1] != b.shape[0]:
        raise ValueError(f"{op}: K mismatch: a_shard is {tuple(a_shard.shape)} (K={a_shard.shape[1]}), "
                         f"b is {tuple(b.shape)} (K={b.shape[0]})")
    check_dtype(op, "a_shard", a_shard.dtype)
    if a_shard.dtype != b.dtype:
        raise TypeError(f"{op}: dtype mismatch: a_shard {a_shard.dtype}, b {b.dtype}")
    if a_shard.device != b.device:
        raise ValueError(f"{op}: device mismatch: a_shard on {a_shard.device}, b on {b.device}")
    if a_shard.shape[0] == 0 or b.shape[1] == 0 or b.shape[0] == 0:
        raise ValueError(f"{op}: empty operand: a_shard {tuple(a_shard.shape)}, b {tuple(b.shape)}")


def check_weight_list(op: str, x: torch.Tensor, x_name: str, bs: list[torch.Tensor], check_one: Any) -> None:
    """A list of weights on one call of ``op`` (the all-gather's or the all-reduce's): not
    empty, tensors of ``x``'s dtype, each passing ``check_one(w)`` (the op's checks of one
    weight); ValueError naming the weight."""
    if not bs:
        raise ValueError(f"{op}: an empty list of weights")
    for i, w in enumerate(bs):
        if not isinstance(w, torch.Tensor):
            raise ValueError(f"{op}: b[{i}] is a {type(w).__name__}, not a tensor [K, N]")
        if w.dtype != x.dtype:
            raise ValueError(f"{op}: b[{i}] is {w.dtype}, {x_name} is {x.dtype}: the weights of one call share "
                             "its dtype")
        try:
            check_one(w)
        except (ValueError, TypeError) as e:
            why = str(e).removeprefix(f"{op}: ")
            raise ValueError(f"{op}: b[{i}]: {why}") from None


def _check_many(a_shard: torch.Tensor, bs: list[torch.Tensor]) -> None:
    """A list of weights on one gather: each as ``_check_inputs`` checks one."""
    check_weight_list("all_gather_matmul", a_shard, "a_shard", bs, lambda w: _check_inputs(a_shard, w))


def _ns(b: Any) -> Any:
    """N of one weight (an int), or of a list of them (a tuple): a plan's and a tuned pick's key."""
    return tuple(w.shape[1] for w in b) if isinstance(b, list) else b.shape[1]


def all_gather_matmul_ref(a_shard: torch.Tensor, b: Any, *, group: Any = None,
                          return_gathered: bool = False) -> Any:
    """Plain reference: one NCCL (or gloo) all-gather, then ``torch.matmul`` (with a list of
    weights: one gather, a matmul per weight, the list of outputs)."""

    many = isinstance(b, list)
    if many:
        _check_many(a_shard, b)
    else:
        _check_inputs(a_shard, b)
    group = _group(group)
    world, _ = _world(group)
    a_shard = a_shard.contiguous()
    gathered = a_shard.new_empty((world * a_shard.shape[0], a_shard.shape[1]))
    n = sum(_ns(b)) if many else b.shape[1]
    tm = serial_phases("all_gather_matmul", (gathered.shape[0], n, a_shard.shape[1]), "reference", a_shard.device)
    if tm:
        tm.start("comm")
    all_gather_single(gathered, a_shard, group=group)
    collective_done()
    if tm:
        tm.stop("comm")
        tm.start("gemm")
    c = [gathered @ w for w in b] if many else gathered @ b
    if tm:
        tm.stop("gemm")
        tm.commit()
    stats["reference"] += 1
    return (c, gathered) if return_gathered else c


def all_gather_matmul_chunked(a_shard: torch.Tensor, b: torch.Tensor, *, group: Any = None, chunks: int = 2,
                              return_gathered: bool = False) -> Any:
    """Chunked stream-overlap baseline: per-chunk NCCL all-gathers on a side
    stream (the library's uncapped communicator), per-chunk cuBLAS matmuls on
    the current stream, each waiting on its chunk's event; the local shard's
    matmul runs first, overlapping chunk 0.

        comm     | AG c0 | AG c1 | ...
        compute  | mm local | mm c0 (wait e0) | mm c1 (wait e1) |
    """
    _check_inputs(a_shard, b)
    if not a_shard.is_cuda:
        return all_gather_matmul_ref(a_shard, b, group=group, return_gathered=return_gathered)
    group = _group(group)
    rt = get_runtime(group, a_shard.device)
    comm = rt.comm(None)
    a_shard = a_shard.contiguous()
    ms, k = a_shard.shape
    world, rank = rt.world, rt.rank
    layout = all_gather_layout(world, rank, ms, chunks, 1)
    gathered = a_shard.new_empty((world * ms, k))
    c = a_shard.new_empty((world * ms, b.shape[1]))
    cur = torch.cuda.current_stream(a_shard.device)
    rt.comm_stream.wait_stream(cur)
    events = []
    with torch.cuda.stream(rt.comm_stream):
        for start, rows in zip(layout.chunk_starts, layout.chunk_rows):
            comm.all_gather(a_shard[start:start + rows], gathered[world * start: world * (start + rows)],
                            stream=rt.comm_stream)
            ev = torch.cuda.Event()
            ev.record(rt.comm_stream)
            events.append(ev)
    torch.mm(a_shard, b, out=c[rank * ms:(rank + 1) * ms])
    for ev, start, rows in zip(events, layout.chunk_starts, layout.chunk_rows):
        cur.wait_event(ev)
        blk = gathered[world * start: world * (start + rows)]
        for r in range(world):
            if r != rank:
                torch.mm(blk[r * rows:(r + 1) * rows], b, out=c[r * ms + start: r * ms + start + rows])
    cur.wait_stream(rt.comm_stream)
    a_shard.record_stream(rt.comm_stream)
    gathered.record_stream(rt.comm_stream)
    stats["chunked"] += 1
    if return_gathered:
        return c, _natural(rt, gathered, layout)
    return c


def _perms(rt: Runtime) -> LRU:
    """The gathered rows' permutations on ``rt`` by layout, the 16 most recently used."""
    return rt.cache("all_gather_matmul.perms", 16)


def _natural(rt: Runtime, gathered: torch.Tensor, layout: AllGatherLayout, ms: int | None = None) -> torch.Tensor:
    """The gathered rows in rank order, [world * ms, K], from ``gathered`` laid out as
    ``layout`` says (for a plan of a row bucket, ``layout.m_shard`` rows per rank of which
    the first ``ms`` are this call's)."""
    w, mb = layout.world, layout.m_shard
    ms = mb if ms is None else ms
    if len(layout.chunk_rows) == 1 or w == 1 or layout.natural:  # in rank order already (one rank: chunk by chunk)
        return gathered if ms == mb else gathered.view(w, mb, -1)[:, :ms].reshape(w * ms, -1)
    # the permutation is a Python loop over M rows: build it once per layout (on rt's device)
    key = (layout.world, layout.rank, layout.m_shard, layout.chunk_rows)
    perms = _perms(rt)
    perm = perms.get(key)
    if perm is None:
        if capturing():
            raise OverlapCaptureError("all_gather_matmul: the gathered rows' permutation for this shape is not "
                                      "cached (evicted, or never run); call it once outside the capture first")
        perm = perms[key] = upload(torch.tensor(layout.gathered_to_natural()).numpy(), gathered.device)
    perm = keep_for_capture(perm)
    if ms != mb:  # each rank's first ms rows of the bucket's
        perm = perm.view(w, mb)[:, :ms].reshape(w * ms)
    return gathered.index_select(0, perm)


# --------------------------------------------------------------------------
# the fused op
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    layout: AllGatherLayout
    table: torch.Tensor
    grid: int
    give_back_grid: int
    nccl_ctas: int
    gemm: Any
    flag_count: int
    split: tuple[int, int] | None = None
    """The GEMM's split tail (first split table row, K pieces per tile), or None."""
    counters: int = 1
    """Counter words the GEMM uses: dispatch, then one per split tile."""
    groups: torch.Tensor | None = None
    """A flattened GEMM's (``GemmConfig.flatten``) runs of rows per flag (``flat_groups``)."""
    launches: LRU = field(default_factory=lambda: LRU(16))
    """Made on first use: launch plans of the call's kernels (``_runtime.gemm_plan``) and, on
    the p2p transport, per call parity the shared buffer's view and the push list."""
    local: int = 0
    """Table rows of the local shard (first, waiting on nothing), run as a grid of their
    own, the rest as a grid behind the stream gate (``_fused``, ``_fused_p2p``); 0: one grid
    over the whole table (a flattened GEMM, a split tail reaching into them, one rank)."""
    local_launches: LRU = field(default_factory=lambda: LRU(16))
    """The local grid's launch plans (another table than ``launches``'s)."""
    first_wait: tuple[int, int] = (0, 1)
    """(flag, expected per epoch) of the first table row after the local ones: what the
    gate before the peers' grid waits for."""
    local_table: torch.Tensor | None = None
    """``table[:local]`` and ``table[local:]`` (views made once: the two grids' tables)."""
    rest_table: torch.Tensor | None = None


def _plans(rt: Runtime) -> LRU:
    """Plans on ``rt`` by shape and config, the 64 most recently used (a new M costs a new
    plan: its tile table, built with numpy and uploaded, well under a millisecond at 2048
    tiles)."""
    return rt.cache("all_gather_matmul.plans", 64)


def _tuned(rt: Runtime) -> LRU:
    """The tuner's picks on ``rt`` (``tune_all_gather_matmul``) by shape and dtype, the 256
    most recently used."""
    return rt.cache("all_gather_matmul.tuned", 256)


CHUNK_ALIGN = 128
"""Chunks are multiples of this many rows (except the last), independent of the GEMM config."""


def _default_chunks(ms: int) -> int:
    # one chunk per ~1024 rows of a shard, 1..4: each NCCL call has a fixed cost, and
    # past a few chunks it outweighs what they hide (docs/experiments.md)
    return max(1, min(4, ms // 1024))


def _plan(rt: Runtime, ms: int, n: Any, k: int, cfg: OverlapConfig, transport: str = "nccl") -> _Plan:
    """``n``: the N of one weight, or a tuple of N of several (one grid over their GEMMs,
    their tiles interleaved chunk by chunk: ``build_multi_tile_table``). ``ms``: the rows
    the plan is made for (``_runtime.plan_rows_for`` of the call's)."""
    from ..kernels.tile_gemm import DEFAULT_CONFIG

    gemm = cfg.gemm or DEFAULT_CONFIG
    if gemm.flatten and isinstance(n, tuple):
        raise ValueError("all_gather_matmul: a flattened GEMM (GemmConfig.flatten) takes one weight, not a list")
    chunks = cfg.chunks or _default_chunks(ms)
    nccl_ctas = (cfg.nccl_ctas or 16) if transport == "nccl" else 0
    margin = cfg.margin(transport)
    key = (transport, ms, n, k, chunks, nccl_ctas, margin, cfg.give_back, gemm, cfg.split_tail)
    plans = _plans(rt)
    p = plans.get(key)
    if p is None:
        if capturing():  # evicted since its eager call: building it uploads a table (not capturable)
            raise OverlapCaptureError(f"all_gather_matmul: the plan for M/R={ms}, N={n}, K={k} is not cached "
                                      "(evicted, or never run); call it once outside the capture first")
        # chunk sizes must agree across ranks whatever GEMM config each rank runs
        if transport == "p2p":
            from .._p2p import flag_stride

            stride = flag_stride(rt.world)
            if chunks > stride - 2:  # the last two flags of a sender's region: its signature words
                raise ValueError(f"all_gather_matmul: at most {stride - 2} chunks on the p2p transport at {rt.world} "
                                 "ranks")
            layout = all_gather_push_layout(rt.world, rt.rank, ms, chunks, CHUNK_ALIGN, flag_stride=stride)
            flag_count = rt.world * stride
        else:
            layout = all_gather_layout(rt.world, rt.rank, ms, chunks, CHUNK_ALIGN)
            flag_count = len(layout.chunk_rows)
        if isinstance(n, tuple):
            # every weight's tiles of a chunk before any tile of the next chunk
            rows = build_multi_tile_table(layout.segments, n, gemm.block_m, gemm.block_n, array=True)
        else:
            rows = build_tile_table(layout.segments, n, gemm.block_m, gemm.block_n, array=True)
        grid = rt.num_sms - nccl_ctas - margin
        if grid < 1:
            raise ValueError(f"all_gather_matmul: no SMs left for the GEMM: {rt.num_sms} SMs, nccl_ctas={nccl_ctas}, "
                             f"margin {margin}")
        # the give-back grid takes every SM the main grid left: NCCL's and the margin
        give_back = rt.num_sms - grid if (cfg.give_back and transport == "nccl") else 0
        # the tiles left after the last full wave of the GEMM's SMs run on a part of the
        # GPU while the rest idles: in K pieces they spread over more of it
        sms = grid + give_back
        tail = len(rows) % sms
        parts = tail_parts(tail, sms, -(-k // gemm.block_k), cfg.split_tail)
        rows, split_start = split_tail(rows, tail, parts)
        split = (split_start, parts) if split_start is not None else None
        table = table_tensor(rows, rt.device)
        groups = upload(flat_groups(rows), rt.device) if gemm.flatten else None
        # the local shard's rows lead the table and wait on nothing
        import numpy as np

        local = int(np.argmax(rows[:, COL_WAIT] >= 0)) if (rows[:, COL_WAIT] >= 0).any() else 0
        if gemm.flatten or (split is not None and split[0] < local):
            local = 0
        first_wait = (int(rows[local, COL_WAIT]), int(rows[local, COL_WAIT_MULT])) if local else (0, 1)
        p = _Plan(layout, table, grid, give_back, nccl_ctas, gemm, flag_count, split, 1 + (tail if split else 0),
                  groups, local=local, first_wait=first_wait, local_table=table_rows(table, 0, local) if local else None,
                  rest_table=table_rows(table, local) if local else None)
        plans[key] = p
    return p


@group_call("all_gather_matmul")
def all_gather_matmul(a_shard: torch.Tensor, b: Any, *, group: Any = None, return_gathered: bool = False,
                      config: OverlapConfig | None = None) -> Any:
    """``all_gather(a_shard, dim=0) @ b`` with GEMM tiles starting as chunks land.

    ==========  =========  ===================================================
    tensor      shape      meaning
    ==========  =========  ===================================================
    a_shard     [M/R, K]   this rank's rows; M/R equal on every rank
    b           [K, N]     row-major, or a transposed view (``w.t()``) of an
                           nn.Linear weight ``w`` [N, K], never copied; or a
                           list of such weights [K, N_i] (Q, K, V; gate, up)
    returns     [M, N]     c; with ``return_gathered``: (c, gathered [M, K]);
                           for a list, the list of c_i [M, N_i] in its order
    ==========  =========  ===================================================

    fp16 and bf16 on CUDA take the tile-flag path; other inputs (a CPU / gloo
    group, fp32) take ``all_gather_matmul_ref`` with a one-time warning.
    ``config`` overrides the tuned transport ("p2p" copy-engine pushes on one node,
    or "nccl"), chunking, NCCL CTA cap and GEMM config.

    A list of weights is gathered once and its GEMMs run as one persistent grid: for
    each chunk as it lands, every weight's tiles of those rows (weight 0's, then 1's,
    ...), all waiting on the chunk's flag (``build_multi_tile_table``). Up to
    ``MAX_WEIGHTS`` weights of one B layout; others (``_many_refusal``) run the widest
    weight's GEMM overlapped and the rest by ``torch.matmul`` after it, with the reason
    in ``overlap.report()``.
    """
    many = isinstance(b, (list, tuple))
    if not many:
        out = _planned(a_shard, b, group, return_gathered, config)
        if out is not None:
            return out
    if many:
        b = list(b)
        _check_many(a_shard, b)
        refuse_grad("all_gather_matmul", a_shard, *b)
    else:
        _check_inputs(a_shard, b)
        refuse_grad("all_gather_matmul", a_shard, b)
    group = _group(group)
    ms, k = a_shard.shape
    n = _ns(b)
    n_all = sum(n) if many else n
    bs = b if many else [b]
    if not a_shard.is_cuda or a_shard.dtype not in (torch.float16, torch.bfloat16):
        warn_once(f"agmm-ref-{a_shard.device.type}-{a_shard.dtype}",
                  f"all_gather_matmul: no tile-flag path for {a_shard.dtype} on {a_shard.device.type}; "
                  "running the reference (all-gather, then matmul)")
        agree_on_reference(group, "all_gather_matmul", ("M/R", "K", "N", "dtype"),
                           (ms, k, n_all, dtype_code(a_shard.dtype)), a_shard.device)
        why = "no GPU" if not a_shard.is_cuda else f"dtype {a_shard.dtype}"
        return observed("all_gather_matmul", (ms * _world(group)[0], n_all, k), "reference", why, a_shard.device,
                        lambda: all_gather_matmul_ref(a_shard, b, group=group, return_gathered=return_gathered))
    if many:
        why = _many_refusal(bs)
        if why is not None:
            return _widest(a_shard, bs, group, return_gathered, config, why)
    esize = a_shard.element_size()
    if (k * esize) % 16 or any((x * esize) % 16 for x in (n if many else (n,))):
        raise ValueError(f"all_gather_matmul: K={k} and N={n} must be multiples of {16 // esize} "
                         f"for {a_shard.dtype} (16-byte rows for TMA)")
    from ..kernels.tile_gemm import check_b, check_tma

    for w in bs:
        check_b(w)  # before any work is queued: a refusal later would leave streams mid-flight
    check_tma("a_shard", a_shard.contiguous())  # the GEMM reads the local shard in place
    if capturing() and get_runtime_if_made(group, a_shard.device) is None:
        raise OverlapCaptureError("all_gather_matmul: call it once outside the CUDA graph capture first")
    rt = get_runtime(group, a_shard.device)
    rt.p2p()  # collective on the first call, the same on every rank whichever path follows
    given = config is not None
    tuned = _tuned(rt).get((ms, n, k, a_shard.dtype)) if config is None else None
    if config is None and not isinstance(tuned, Sequential):
        config = tuned if isinstance(tuned, OverlapConfig) else OverlapConfig()
    transport = rt.transport(config) if config is not None else "nccl"
    # NCCL call sizes and pushed rows come from (M/R, K) and the chunks (0: the
    # sequential path): ranks must agree or peers hang; with a list, on every weight's N
    ns = n if many else (n,)
    chunks = 0 if config is None else (config.chunks or _default_chunks(plan_rows_for(ms, config, transport)))
    names = ("M/R", "K", "N", "dtype", "chunks", "p2p", "bucketed") + tuple(f"N{i}" for i in range(1, len(ns)))
    values = (ms, k, ns[0], dtype_code(a_shard.dtype), chunks, int(transport == "p2p"),
              bucketed(config, transport)) + ns[1:]
    check_agree(rt, "all_gather_matmul", names, values, rows_at=0)
    shape = (ms * rt.world, n_all, k)
    if config is None:  # the tuner picked the sequential path
        stats["sequential_by_tuner"] += 1
        return observed("all_gather_matmul", shape, "sequential", "tuner pick", a_shard.device,
                        lambda: all_gather_matmul_ref(a_shard, b, group=group, return_gathered=return_gathered))
    if transport == "p2p" and capturing():
        # the peer-copy transport's flags are written by the peers' copy engines with
        # epochs the host counts per call: a replay would repeat the captured epoch
        warn_once("agmm-p2p-capture", "all_gather_matmul: the peer-copy transport cannot be captured in a CUDA "
                  "graph; the captured call runs the reference (all-gather, then matmul); "
                  "OverlapConfig(transport='nccl') captures the tile-flag path")
        stats["reference_in_capture"] += 1
        return observed("all_gather_matmul", shape, "reference", "capture (p2p)", a_shard.device,
                        lambda: all_gather_matmul_ref(a_shard, b, group=group, return_gathered=return_gathered))
    strides = tuple(w.stride() for w in b) if many else b.stride()
    sig = (ms, k, n, a_shard.dtype, strides, return_gathered, config, transport)
    rt.require_warm("all_gather_matmul", sig)
    path = f"{transport} x{chunks}" + (f", {len(b)} weights in one grid" if many else "")
    why = "config given" if given else ("tuner pick" if tuned is not None else "default config")
    if transport == "p2p":
        out = rt.mark_warm("all_gather_matmul", sig, observed(
            "all_gather_matmul", shape, path, why, a_shard.device, run_p2p, rt, "all_gather_matmul", _peer._fused_p2p,
            rt, a_shard.contiguous(), b, return_gathered, config))
    else:
        out = rt.mark_warm("all_gather_matmul", sig, observed(
            "all_gather_matmul", shape, path, why, a_shard.device, _fused, rt, a_shard.contiguous(), b,
            return_gathered, config))
    if not many and a_shard.is_contiguous():  # the call returned: later ones of its signature take its plan
        _calls.keep(rt, _call_key(a_shard, b, return_gathered, config, transport, given, tuned),
                    CallPlan("all_gather_matmul", names, values, 0, sig, shape, path, why, config, transport))
    return out


def _call_key(a_shard: torch.Tensor, b: torch.Tensor, return_gathered: bool, cfg: OverlapConfig, transport: str,
              given: bool, tuned: Any) -> tuple:
    """A call's signature for its ``CallPlan``: everything the full path's checks and
    decisions read, but the pointers (``_calls.aligned``, per call)."""
    return (a_shard.shape, a_shard.stride(), a_shard.dtype, a_shard.device, b.shape, b.stride(), b.dtype, b.device,
            return_gathered, cfg, transport, given, tuned is not None)


def _planned(a_shard: Any, b: Any, group: Any, return_gathered: bool, config: OverlapConfig | None) -> Any:
    """The call run from its signature's ``CallPlan`` (``_calls``), or None where it has
    none or needs the full path (a capture, autograd, an unaligned pointer, another
    tuned pick or transport than the plan's)."""
    if not isinstance(a_shard, torch.Tensor) or not isinstance(b, torch.Tensor) or not a_shard.is_cuda:
        return None
    if a_shard.dim() != 2 or b.dim() != 2:  # the full path's checks say what is wrong
        return None
    if capturing() or (torch.is_grad_enabled() and (a_shard.requires_grad or b.requires_grad)):
        return None
    g = resolve_group(group)
    # the index: one dict read for a signature seen before (``_calls.index_lookup``)
    ikey = ("all_gather_matmul", id(g), id(config), a_shard.shape, a_shard.stride(), a_shard.dtype, a_shard.device,
            b.shape, b.stride(), b.dtype, b.device, return_gathered)
    hit = _calls.index_lookup(ikey, g, config)
    if hit is not None:
        rt, cp, cfg, transport = hit
    else:  # the full lookup, indexed where it finds a plan
        gen, env = _calls.generation(), _calls.transport_env()
        rt = get_runtime_if_made(g, a_shard.device)
        if rt is None:
            return None
        tuned = tcache = tkey = None
        if config is None:
            tcache, tkey = _tuned(rt), (a_shard.shape[0], b.shape[1], a_shard.shape[1], a_shard.dtype)
            tuned = tcache.get(tkey)
            if isinstance(tuned, Sequential):
                return None
            cfg = tuned if isinstance(tuned, OverlapConfig) else OverlapConfig()
        else:
            cfg = config
        transport = rt.transport(cfg)
        key = _call_key(a_shard, b, return_gathered, cfg, transport, config is not None, tuned)
        cp = _calls.find(rt, "all_gather_matmul", key)
        if cp is None:
            return None
        _calls.index(ikey, gen, g, config, env, rt, cp, cfg, transport, tcache if tuned is not None else None,
                     tkey, key)
    if not aligned(a_shard, b):
        return None
    _calls.stats["planned"] += 1
    if transport == "p2p":
        return run_planned(rt, cp, run_p2p, rt, "all_gather_matmul", _peer._fused_p2p, rt, a_shard, b,
                           return_gathered, cfg)
    body = cp.body
    if body is None and not (cfg.gemm is not None and cfg.gemm.flatten):
        body = cp.body = _Bound(rt, a_shard, b, return_gathered, cfg)
    if body is not None:
        out = _graphs.replay_or_capture(rt, cp, body, (a_shard, b))
        if out is not _graphs.NO:
            return out
        if body.ready():
            return _calls.run_bound(rt, cp, a_shard, b)
    return run_planned(rt, cp, _fused, rt, a_shard, b, return_gathered, cfg)


class _Bound(_calls.BoundBody):
    """``_fused`` for one call signature (one weight), bound (``_calls``): the op plan of
    its row bucket, the GEMM plans, communicator, error word, wait bound, words, streams
    and the gate decided once; each chunk's all-gather, flag post and every launch with
    its arguments made. A call allocates gathered and C, then queues what ``_fused``
    queues, in its order::

        comm stream  | AG chunk0 (bound) |W0 (bound)| ... | give-back grid |
        caller       | zero | fork | [local grid | gate] | grid |  ...  join |"""

    moving = (0,)
    """The arguments a plan graph copies in per call (``_graphs``); the others are read in place."""

    def __init__(self, rt: Runtime, a_shard: torch.Tensor, b: torch.Tensor, return_gathered: bool,
                 cfg: OverlapConfig) -> None:
        from ..kernels import gate as _gate

        ms, k = a_shard.shape
        n = b.shape[1]
        world = rt.world
        self.rt, self.ms, self.k, self.n, self.return_gathered = rt, ms, k, n, return_gathered
        self.finish = self._natural_after if return_gathered else None
        self.msb = msb = plan_rows_for(ms, cfg, "nccl")
        self.p = p = _plan(rt, msb, n, k, cfg)
        if p.gemm.flatten:
            raise ValueError("all_gather_matmul: a flattened GEMM is not bound")  # the caller keeps _fused
        self.comm = comm = rt.comm(p.nccl_ctas)
        self.err = err = rt.err("all_gather_matmul")
        self.check = cfg.check
        # a plan graph (``_graphs``): its config and GEMM work (``auto`` graphs the small ones)
        self.cfg, self.flops = cfg, 2 * world * ms * k * n
        self.timeout_ns = timeout_ns = int((cfg.timeout_ms or _flags.default_timeout_ms(rt.group)) * 1e6)
        self.cs = cs = rt.comm_stream
        self.side = (cs,)
        with rt.order.lock:
            self.words = w = rt.local_words("all_gather_matmul", p.counters + 4, p.flag_count)
        self.bind_frame()
        self.gated = gated = p.local > 0 and _gate.enabled()
        self.cut = (ms, msb)
        # a sample of the call's tensors, for the bound collectives' checks and the launches' layouts
        gathered = a_shard.new_empty((world * msb, k))
        c = a_shard.new_empty((world * ms, n))
        chunks = []
        for c_idx, (start, rows) in enumerate(zip(p.layout.chunk_starts, p.layout.chunk_rows)):
            live = min(rows, ms - start)
            dst = (world * start, world * (start + rows))
            send = a_shard[start:start + rows] if live == rows else a_shard.new_empty((rows, k))
            gather = None
            if live > 0:
                bound = getattr(comm, "bound", None)
                gather = bound("all_gather", send, gathered[dst[0]:dst[1]], cs) if bound is not None else \
                    (lambda s_, r_, comm=comm: comm.all_gather(s_, r_, stream=cs))
            # (start, rows, live, gathered rows, the bound all-gather, the bound flag post)
            chunks.append((start, rows, live, dst, gather, _flags.bound_write_value(cs, w.flags, c_idx, 1)))
        self.chunks = tuple(chunks)
        if gated:
            self.gl = gemm_plan(p.local_launches, a_shard, b, c, p.local_table, a2=gathered, flags=w.flags,
                                err=err.word, timeout_ns=timeout_ns, counter=w.counters[:1], rank=rt.rank,
                                config=p.gemm, wait=True, clip=True)
            self.gp = gemm_plan(p.launches, a_shard, b, c, p.rest_table, a2=gathered, flags=w.flags, err=err.word,
                                timeout_ns=timeout_ns, counter=w.counters[4:], rank=rt.rank, config=p.gemm, wait=True,
                                split=None if p.split is None else (p.split[0] - p.local, p.split[1]), clip=True)
            idx, mult = p.first_wait
            self.gate_args = ((w.flags, idx, mult, 3 * mult, err.word), dict(rank=rt.rank, timeout_ns=timeout_ns))
        else:
            self.gl = None
            self.gp = gemm_plan(p.launches, a_shard, b, c, p.table, a2=gathered, flags=w.flags, err=err.word,
                                timeout_ns=timeout_ns, counter=w.counters, rank=rt.rank, config=p.gemm, wait=True,
                                split=p.split, groups=p.groups, clip=True)
        self.b_kn = getattr(self.gp, "b_kn", True)
        self.bl_local = self.bl_gate = self.bl = self.bl_back = None
        self.whole = False
        self.bound = False  # the launches bound (tried once, after the first general launch)

    def _bind_launches(self, a: torch.Tensor, b: torch.Tensor, gathered: torch.Tensor, c: torch.Tensor) -> None:
        """Bind the launches (after a general launch of each: a kernel is compiled and its
        launcher known only then). A plan that cannot be bound keeps its general launch."""
        from ..kernels import gate as _gate

        p, cut = self.p, self.cut
        self.bound = True
        bind = _calls.gemm_bind(self.gp)
        if bind is None:  # (not a GEMM plan that binds: its general launch)
            return
        if self.gated:
            bind_local = _calls.gemm_bind(self.gl)
            self.bl_local = bind_local(a, b, c, a2=gathered, epoch=1, grid=p.grid, rows=cut) if bind_local else None
            a_, kw = self.gate_args
            self.bl_gate = _gate.bind_gate(*a_, **kw)
        self.bl = bind(a, b, c, a2=gathered, epoch=1, grid=p.grid, rows=cut)
        if p.give_back_grid:
            self.bl_back = bind(a, b, c, a2=gathered, epoch=1, grid=p.give_back_grid, rows=cut)
        # every grid bound, or the general launches for all (never a mix of two argument sets)
        self.whole = (self.bl_local is not None or not self.gated) and \
            (self.bl_back is not None or not p.give_back_grid)

    def run(self, raw: int, cur: Any, a_shard: torch.Tensor, b: torch.Tensor) -> Any:
        k, n, ms, world, cs = self.k, self.n, self.ms, self.rt.world, self.cs
        gathered = a_shard.new_empty((world * self.msb, k))
        c = a_shard.new_empty((world * ms, n))
        for start, rows, live, dst, gather, post in self.chunks:
            if live == rows:
                gather(a_shard[start:start + rows], gathered[dst[0]:dst[1]])
            elif live > 0:
                src = a_shard.new_empty((rows, k))
                with on_stream(cs, cur):  # its rows past ms are sent and never stored (see _fused)
                    src[:live].copy_(a_shard[start:ms])
                    src[live:].fill_(float("nan"))
                gather(src, gathered[dst[0]:dst[1]])
            post()
        bl = self.bl
        if bl is not None and self.whole and not c.data_ptr() % 16:
            t = (a_shard, gathered, b if self.b_kn else b.t(), c, None, None)
            if self.gated:
                self.bl_local(raw, t)
                if self.bl_gate is not None:
                    self.bl_gate(raw, ())
                else:
                    from ..kernels import gate as _gate

                    a_, kw = self.gate_args
                    _gate.launch_gate(*a_, **kw)
            bl(raw, t)
            if self.bl_back is not None:
                self.bl_back(cs.cuda_stream, t)
        else:
            self._launch(cur, a_shard, b, gathered, c)
            if not self.bound:
                self._bind_launches(a_shard, b, gathered, c)
        stats["fused"] += 1
        return (c, gathered) if self.return_gathered else c

    def fused(self, a_shard: torch.Tensor, b: torch.Tensor) -> Any:
        """The call as the fused body runs it (what a plan graph captures)."""
        return _fused(self.rt, a_shard, b, self.return_gathered, self.cfg)

    def _natural_after(self, out: tuple) -> tuple:
        """``finish``: the gathered rows in natural order, made on the caller's stream once
        the comm stream (whose all-gathers write them) is joined, as ``_fused`` makes them
        after its ``fused_call``."""
        c, gathered = out
        return c, _natural(self.rt, gathered, self.p.layout, self.ms)

    def _launch(self, cur: Any, a_shard: torch.Tensor, b: torch.Tensor, gathered: torch.Tensor,
                c: torch.Tensor) -> None:
        """The general launches, as ``_fused`` makes them."""
        from ..kernels import gate as _gate

        p, cut, gp = self.p, self.cut, self.gp
        if self.gated:
            descs = self.gl.operands(a_shard, b, gathered)
            self.gl.launch(descs, c, epoch=1, grid=p.grid, rows=cut)
            a_, kw = self.gate_args
            _gate.launch_gate(*a_, **kw)
            descs = _operands_of(gp, self.gl, descs, a_shard, b, gathered)
        else:
            descs = gp.operands(a_shard, b, gathered)
        gp.launch(descs, c, epoch=1, grid=p.grid, rows=cut)
        if p.give_back_grid:
            with on_stream(self.cs, cur):
                gp.launch(descs, c, epoch=1, grid=p.give_back_grid, rows=cut)

    def __repr__(self) -> str:
        p = self.p
        launches = "bound" if self.bl is not None and self.whole else "general"
        return (f"all_gather_matmul body: M/R {self.ms} (plan of {self.msb} rows), N {self.n}, K {self.k}, "
                f"{len(self.chunks)} chunk(s) on NCCL ({p.nccl_ctas} CTAs), grid {p.grid}"
                + (f" + give-back {p.give_back_grid}" if p.give_back_grid else "")
                + (", local grid and gate first" if self.gated else "") + f", launches {launches}, "
                f"wait bound {self.timeout_ns / 1e6:g} ms, check {self.check!r}")


def _operands_of(gp: Any, gl: Any, descs: Any, a_shard: torch.Tensor, b: Any, gathered: torch.Tensor) -> Any:
    """The operands of the peers' grid ``gp`` where ``descs`` are the local grid ``gl``'s:
    the same where both plans are of one kind, else its own (a split tail keeps ``gp`` on
    the tile GEMM while ``gl`` may be an engine plan, and each takes only its own kind)."""
    return descs if type(gp) is type(gl) else gp.operands(a_shard, b, gathered)


def _many_refusal(bs: list[torch.Tensor]) -> str | None:
    """Why a list of weights cannot run as one grid, or None (it can)."""
    if len(bs) > MAX_WEIGHTS:
        return f"{len(bs)} weights (one grid takes at most {MAX_WEIGHTS})"
    # the layout class ``tile_gemm.b_operand`` gives (B's TMA block shape): a transposed view of
    # an [N, K] weight, or else row-major [K, N] (other layouts are copied to it)
    if len({w.stride(0) == 1 and w.stride(1) >= w.shape[0] and not (w.stride(1) == 1 and w.stride(0) >= w.shape[1])
            for w in bs}) != 1:
        return "weights of mixed layouts (one grid reads all as row-major [K, N] or all as w.t())"
    return None


def _widest(a_shard: torch.Tensor, bs: list[torch.Tensor], group: Any, return_gathered: bool,
            config: OverlapConfig | None, why: str) -> Any:
    """A list of weights the one grid does not take: the widest weight's GEMM overlapped with
    the gather (the first of equals), the others by ``torch.matmul`` on the gathered rows
    after it. Counted in ``overlap.report()`` with ``why``, warned once."""
    first = 0
    for i in range(1, len(bs)):
        if bs[i].shape[1] > bs[first].shape[1]:
            first = i
    warn_once(f"agmm-widest-{why}", f"all_gather_matmul: a list of weights not run as one grid ({why}); the widest "
              "weight's GEMM is overlapped, the others run by torch.matmul after it")
    stats["many_widest"] += 1

    def run() -> Any:
        c0, g = all_gather_matmul(a_shard, bs[first], group=group, return_gathered=True, config=config)
        cs = [c0 if i == first else g @ w for i, w in enumerate(bs)]
        return (cs, g) if return_gathered else cs

    shape = (a_shard.shape[0] * _world(group)[0], sum(w.shape[1] for w in bs), a_shard.shape[1])
    return observed("all_gather_matmul", shape, f"widest fused, {len(bs) - 1} by torch.matmul", why,
                    a_shard.device, run)


def _fused(rt: Runtime, a_shard: torch.Tensor, b: Any, return_gathered: bool,
           cfg: OverlapConfig) -> Any:
    """The NCCL transport; ``b`` one weight (c is a tensor) or a list of them (one grid, c
    the list of their outputs)."""
    ms, k = a_shard.shape
    n = _ns(b)
    world = rt.world
    # the plan of ms's row bucket: chunks, tile table and launches shared by every M/R in it
    msb = plan_rows_for(ms, cfg, "nccl")
    p = _plan(rt, msb, n, k, cfg)
    comm = rt.comm(p.nccl_ctas)
    err = rt.err("all_gather_matmul")
    timeout_ns = int((cfg.timeout_ms or _flags.default_timeout_ms(rt.group)) * 1e6)
    cs = rt.comm_stream
    from ..kernels import gate as _gate

    gated = p.local > 0 and _gate.enabled()
    # the dispatch counter (and split tiles' counts; gated, the local grid's counter first and
    # the rest's 4 words on: 16-byte aligned, as the cached launch wants its tensors) and the
    # chunk flags, zeroed on the caller's stream before the side streams fork: no epoch
    # (``_runtime.LocalWords``)
    with fused_call(rt, err, cfg.check, (cs,), ("all_gather_matmul", p.counters + 4, p.flag_count)) as (cur, (w,)):
        # laid out for the bucket (chunk c's rows of every rank at world * start_c, rank r's
        # r * rows_c on): the chunk that holds row ms is sent whole from a padded copy, the
        # chunks past it not at all; C is this call's, the GEMM's tiles cut at ms per rank
        gathered = a_shard.new_empty((world * msb, k))
        c = [a_shard.new_empty((world * ms, x)) for x in n] if isinstance(n, tuple) else \
            a_shard.new_empty((world * ms, n))
        for c_idx, (start, rows) in enumerate(zip(p.layout.chunk_starts, p.layout.chunk_rows)):
            live = min(rows, ms - start)
            with gpu_range("comm", "chunk", c_idx):
                if live == rows:
                    src = a_shard[start:start + rows]
                elif live > 0:
                    src = a_shard.new_empty((rows, k))
                    with on_stream(cs, cur):  # its rows past ms are sent and never stored
                        src[:live].copy_(a_shard[start:ms])
                        # NaN: a peer that passed another M of the bucket (unchecked between
                        # the ranks' agreement checks) gets NaN rows, not plausible ones
                        src[live:].fill_(float("nan"))
                if live > 0:
                    comm.all_gather(src, gathered[world * start: world * (start + rows)], stream=cs)
                _flags.stream_write_value(cs, w.flags, c_idx, 1)
        cut = None if p.gemm.flatten else (ms, msb)
        if gated:
            # the local shard's tiles now, on a grid of their own; behind it on this stream a
            # one-program gate on chunk 0's flag, then the peers' grid: while a peer is late
            # no grid waits on the SMs, and the two grids never hold more than the GEMM's SMs
            # (a grid on another stream beside the local one could take NCCL's and the margin)
            gl = gemm_plan(p.local_launches, a_shard, b, c, p.local_table, a2=gathered, flags=w.flags,
                           err=err.word, timeout_ns=timeout_ns, counter=w.counters[:1], rank=rt.rank,
                           config=p.gemm, wait=True, clip=True)
            gp = gemm_plan(p.launches, a_shard, b, c, p.rest_table, a2=gathered, flags=w.flags, err=err.word,
                           timeout_ns=timeout_ns, counter=w.counters[4:], rank=rt.rank, config=p.gemm, wait=True,
                           split=None if p.split is None else (p.split[0] - p.local, p.split[1]), clip=True)
            descs = gl.operands(a_shard, b, gathered)
            with gpu_range("gemm", "local grid"):
                gl.launch(descs, c, epoch=1, grid=p.grid, rows=cut)
            with gpu_range("gate", "chunk", 0):
                idx, mult = p.first_wait  # chunk 0's flag, posted once a call
                _gate.launch_gate(w.flags, idx, mult, 3 * mult, err.word, rank=rt.rank, timeout_ns=timeout_ns)
            descs = _operands_of(gp, gl, descs, a_shard, b, gathered)
            with gpu_range("gemm", "grid"):
                gp.launch(descs, c, epoch=1, grid=p.grid, rows=cut)
        else:
            gp = gemm_plan(p.launches, a_shard, b, c, p.table, a2=gathered, flags=w.flags, err=err.word,
                           timeout_ns=timeout_ns, counter=w.counters, rank=rt.rank, config=p.gemm, wait=True,
                           split=p.split, groups=p.groups, clip=not p.gemm.flatten)
            descs = gp.operands(a_shard, b, gathered)
            with gpu_range("gemm", "grid"):
                gp.launch(descs, c, epoch=1, grid=p.grid, rows=cut)
        if p.give_back_grid:
            with on_stream(cs, cur), gpu_range("giveback", "grid"):
                gp.launch(descs, c, epoch=1, grid=p.give_back_grid, rows=cut)
    stats["fused"] += 1
    stats["many"] += isinstance(n, tuple)
    if return_gathered:
        return c, _natural(rt, gathered, p.layout, ms)
    return c


# --------------------------------------------------------------------------
# tuner
# --------------------------------------------------------------------------

def tune_all_gather_matmul(a_shard: torch.Tensor, b: Any, *, group: Any = None,
                           candidates: list[OverlapConfig] | None = None, iters: int = 10,
                           verbose: bool = False, split_pass: bool | None = None,
                           ws_pass: bool | None = None) -> Path:
    """Time candidate configs (collectively: every rank must call) and the plain
    sequential path; cache the winner for this shape. Returns the winning
    ``OverlapConfig`` or ``SEQUENTIAL`` (then the op warns once and runs the
    reference for this shape). ``split_pass`` (default: with the default candidates
    only): time the two fastest configs again with the tiles after their GEMM's last
    full wave split along K (``OverlapConfig.split_tail`` 2 and 8). ``ws_pass`` (the same
    default): then the two fastest so far again with the GEMM's K loop warp-specialized
    (``GemmConfig.warp_specialize``), where Triton and the GPU support it. Inputs with no
    tile-flag path (CPU, fp32, K or N not 16-byte rows) return ``SEQUENTIAL`` untimed,
    as the other tuners do. ``b`` a list of weights: the one grid over their GEMMs is tuned,
    its pick cached under every weight's N (a list the one grid does not take: ValueError)."""
    if isinstance(b, (list, tuple)):
        b = list(b)
        _check_many(a_shard, b)
        why = _many_refusal(b)
        if why is not None:
            raise ValueError(f"tune_all_gather_matmul: {why}; tune the widest weight alone")
    else:
        _check_inputs(a_shard, b)
    group = _group(group)
    esize = a_shard.element_size()
    n = _ns(b)
    n_all = sum(n) if isinstance(n, tuple) else n
    if (not a_shard.is_cuda or a_shard.dtype not in (torch.float16, torch.bfloat16)
            or (a_shard.shape[1] * esize) % 16 or any((x * esize) % 16 for x in (n if isinstance(n, tuple) else (n,)))):
        return SEQUENTIAL  # no tile-flag path for these inputs: nothing to tune
    rt = get_runtime(group, a_shard.device)
    ms, k = a_shard.shape
    split_pass = candidates is None if split_pass is None else split_pass
    ws_pass = candidates is None if ws_pass is None else ws_pass
    if candidates is None:
        candidates = [OverlapConfig(chunks=ch, nccl_ctas=ct, transport="nccl") for ch in (1, 2, 4)
                      for ct in (16, 24, 32)]
        if rt.transport(OverlapConfig()) == "p2p":
            candidates = [OverlapConfig(chunks=ch, transport="p2p") for ch in (1, 2, 4, 8)] + candidates
    def run(cand: OverlapConfig) -> Any:
        fused = _peer._fused_p2p if rt.transport(cand) == "p2p" else _fused
        return fused(rt, a_shard, b, False, cand)

    def describe(cand: OverlapConfig) -> str:
        return (f"  tune agmm {ms * rt.world}x{n}x{k}: {rt.transport(cand)}, {cand.chunks} chunks, "
                f"{cand.nccl_ctas} ctas, margin {cand.sm_margin}, give_back {cand.give_back}"
                + (f", split tail {cand.split_tail}" if cand.split_tail > 1 else "")
                + (", warp-specialized GEMM" if getattr(cand.gemm, "warp_specialize", False) else ""))

    passes = ((split_variants,) if split_pass else ()) + ((lambda r: ws_variants(r, rt.device),) if ws_pass else ())
    return tune_paths(rt, "all_gather_matmul", (ms * rt.world, n_all, k), f"agmm {ms * rt.world}x{n}x{k}",
                      ref=lambda: all_gather_matmul_ref(a_shard, b, group=group), candidates=candidates, run=run,
                      describe=describe, iters=iters, group=group, verbose=verbose, cache=_tuned(rt),
                      key=(ms, n, k, a_shard.dtype), passes=passes)


from . import all_gather_p2p as _peer  # noqa: E402  (it reads this module at call time)
