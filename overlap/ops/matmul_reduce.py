"""GEMM -> reduce-scatter and GEMM -> all-reduce: a chunk's communication starts as its tiles finish.

    matmul_reduce_scatter(a, b)  ==  reduce_scatter(a @ b, dim=0)           (sum over ranks)
    matmul_all_reduce(a, b)      ==  all_reduce(a @ b) (+ residual)

    tensor      shape          on each of R ranks
    a           [M, K/R]       this rank's columns of the activations (row-parallel input)
    b           [K/R, N]       this rank's rows of the weight; any nn.Linear layout (w.t())
    returns     [M/R, N]       reduce-scatter: rows r*M/R .. (r+1)*M/R of the sum
                [M, N]         all-reduce: the sum (+ residual [M, N])

The producer half of a tensor-parallel layer (the row-parallel GEMM whose partial sums
the ranks must add up), and in the backward pass the column-parallel layer's input
gradient. The schedule (R = 2, 2 chunks; P = a tile's post, a release add after its
stores; W = a stream wait on a chunk's count, no SM):

    GEMM grid    | chunk0 tiles (P c0) ... | chunk1 tiles (P c1) ... |     (persistent, all SMs but NCCL's)
    comm stream  |W c0 = tiles(c0)| RS/AR chunk0 |W c1| RS/AR chunk1 |     (library communicator, CTAs capped)

The GEMM is launched once; its tiles come from one atomic counter in table order, chunk
by chunk, so chunk 0's tiles finish first. Each tile adds 1 to its chunk's counter after
its stores. The comm stream waits until a chunk's counter holds the chunk's tile count
(``cuStreamWaitValue32``), then reduces that chunk with NCCL while the GEMM computes the
next ones. Nothing waits in a circle: the GEMM waits on nothing, so it always ends; the
NCCL kernels find SMs because the grid leaves ``nccl_ctas`` (+ margin) of them.

For the reduce-scatter, chunk c is rows [c0, c0 + rows) of every rank's block of M/R
rows, so NCCL needs them contiguous: the GEMM writes C chunk-major,

    C_perm[chunk c] = [block 0 rows c0.., block 1 rows c0.., ...]      ([R, rows, N])

and the reduce-scatter of that chunk lands rows c0.. of this rank's block of the output.
For the all-reduce the chunks are row ranges of C itself, reduced in place.

The counters are local words, zeroed by each call on its stream (``_runtime.LocalWords``):
a captured call replays correctly, and an exception leaves the next call correct.

On one node, ``transport="p2p"`` (or ``PeerCopyTransport(reduce_ctas=..., reduce_shared=...)``,
or ``OVERLAP_TRANSPORT=p2p``) moves the chunks with the copy engines instead of NCCL: the
same GEMM and counters; a copy stream pushes each chunk's rows to its destination behind
the chunk's count, and a reduce kernel on the destination sums them as they land
(``matmul_reduce_p2p.py``, where the schedule is drawn). A config that names no transport
takes NCCL here (unlike the consumer ops, where p2p is the default): the peer-copy path
has not been timed against it on GPUs yet. Where peer memory is unavailable (one rank,
several nodes, no peer access) asking for p2p raises ``RuntimeError``, as on the
all-reduce op; inside a CUDA graph capture a p2p call runs the reference, with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .. import flags as _flags
from ..observe import gpu_range
from ..policies import Segment, build_tile_table, flat_groups, split_rows, table_tensor, upload
from ..protocol import COL_POST
from . import _calls, _graphs
from ._agree import check_dtype, collective_done, group_call
from ._calls import CallPlan, aligned, run_planned
from ._plans import wait_count
from ._runtime import (LRU, SEQUENTIAL, OverlapCaptureError, OverlapConfig, Path, Runtime, Sequential, bucketed,
                       plan_rows_for,
                       agree_on_reference, capturing, check_agree, dtype_code, flat_variants, fused_call, gemm_plan,
                       get_runtime, get_runtime_if_made, observed, on_stream, refuse_grad, resolve_group, run_p2p,
                       serial_phases, tune_paths, warn_once)

__all__ = [
    "matmul_reduce_scatter",
    "matmul_reduce_scatter_ref",
    "matmul_reduce_scatter_chunked",
    "matmul_all_reduce",
    "matmul_all_reduce_ref",
    "matmul_all_reduce_chunked",
    "reduce_scatter_layout",
    "stats",
    "tune_matmul_all_reduce",
    "tune_matmul_reduce_scatter",
]

stats: dict[str, int] = {"fused": 0, "p2p": 0, "reference": 0, "chunked": 0}
"""How many calls took each path (proof that the fast path ran)."""

CHUNK_ALIGN = 128
"""Chunks are multiples of this many rows (except the last), independent of the GEMM config."""


def _reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    import torch.distributed as tdist

    fn = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor
    fn(out, inp, group=group)


def _check_inputs(op: str, a: torch.Tensor, b: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    for name, t in (("a", a), ("b", b)) + ((("residual", residual),) if residual is not None else ()):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{op}: a must be [M, K/R] and b [K/R, N]; got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{op}: K mismatch: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    check_dtype(op, "a", a.dtype)
    if a.dtype != b.dtype:
        raise TypeError(f"{op}: dtype mismatch: a {a.dtype}, b {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"{op}: device mismatch: a on {a.device}, b on {b.device}")
    if a.numel() == 0 or b.numel() == 0:
        raise ValueError(f"{op}: empty operand: a {tuple(a.shape)}, b {tuple(b.shape)}")
    if residual is not None:
        if tuple(residual.shape) != (a.shape[0], b.shape[1]):
            raise ValueError(f"{op}: residual must be [M, N] = {(a.shape[0], b.shape[1])}, "
                             f"got {tuple(residual.shape)}")
        if residual.dtype != a.dtype or residual.device != a.device:
            raise TypeError(f"{op}: residual is {residual.dtype} on {residual.device}; a is {a.dtype} on {a.device}")


def _world(group: Any) -> int:
    import torch.distributed as tdist

    return tdist.get_world_size(group)


# --------------------------------------------------------------------------
# references and the chunked baseline
# --------------------------------------------------------------------------

def matmul_reduce_scatter_ref(a: torch.Tensor, b: torch.Tensor, *, group: Any = None) -> torch.Tensor:
    """Plain reference: ``torch.matmul``, then one NCCL (or gloo) reduce-scatter over rows."""
    _check_inputs("matmul_reduce_scatter", a, b)
    group = resolve_group(group)
    world = _world(group)
    m = a.shape[0]
    if m % world:
        raise ValueError(f"matmul_reduce_scatter: M={m} is not a multiple of the {world} ranks")
    tm = serial_phases("matmul_reduce_scatter", (m, b.shape[1], b.shape[0]), "reference", a.device)
    if tm:
        tm.start("gemm")
    c = a @ b
    if tm:
        tm.stop("gemm")
        tm.start("comm")
    out = c.new_empty((m // world, c.shape[1]))
    _reduce_scatter_single(out, c.contiguous(), group)
    collective_done()
    if tm:
        tm.stop("comm")
        tm.commit()
    stats["reference"] += 1
    return out


def matmul_all_reduce_ref(a: torch.Tensor, b: torch.Tensor, *, group: Any = None,
                          residual: torch.Tensor | None = None) -> torch.Tensor:
    """Plain reference: ``torch.matmul``, one NCCL (or gloo) all-reduce, then the residual add."""
    import torch.distributed as tdist

    _check_inputs("matmul_all_reduce", a, b, residual)
    group = resolve_group(group)
    tm = serial_phases("matmul_all_reduce", (a.shape[0], b.shape[1], b.shape[0]), "reference", a.device)
    if tm:
        tm.start("gemm")
    c = a @ b
    if tm:
        tm.stop("gemm")
        tm.start("comm")
    tdist.all_reduce(c, group=group)
    collective_done()
    if tm:
        tm.stop("comm")
        tm.commit()
    if residual is not None:
        c += residual
    stats["reference"] += 1
    return c


def _chunked(op: str, a: torch.Tensor, b: torch.Tensor, group: Any, chunks: int,
             residual: torch.Tensor | None) -> torch.Tensor:
    """Per chunk on the current stream a cuBLAS GEMM of the chunk's rows (of every block, for
    the reduce-scatter), an event, and on the comm stream the chunk's NCCL call (the
    library's uncapped communicator) behind it.

        compute  | mm c0 | mm c1 | ...
        comm             | RS/AR c0 (wait e0) | RS/AR c1 (wait e1) |

    ``group``: resolved (``resolve_group``) by the caller.
    """
    rt = get_runtime(group, a.device)
    comm = rt.comm(None)
    world = rt.world
    m, n = a.shape[0], b.shape[1]
    rs = op == "matmul_reduce_scatter"
    ms = m // world if rs else m
    sizes = split_rows(ms, chunks, CHUNK_ALIGN)
    cur = torch.cuda.current_stream(a.device)
    cs = rt.comm_stream
    out = a.new_empty((ms, n)) if rs else a.new_empty((m, n))
    parts = []  # alive until the join below: freed earlier, the next chunk could reuse one NCCL still reads
    start = 0
    for rows in sizes:
        if rs:
            # the chunk's rows of every destination's block, contiguous for NCCL (a buffer
            # per chunk: the comm stream reads it while the next chunk's GEMMs run)
            part = a.new_empty((world, rows, n))
            parts.append(part)
            for d in range(world):
                torch.mm(a[d * ms + start: d * ms + start + rows], b, out=part[d])
            ev = torch.cuda.Event()
            ev.record(cur)
            cs.wait_event(ev)
            comm.reduce_scatter(part.view(world * rows, n), out[start:start + rows], stream=cs)
        else:
            torch.mm(a[start:start + rows], b, out=out[start:start + rows])
            ev = torch.cuda.Event()
            ev.record(cur)
            cs.wait_event(ev)
            comm.all_reduce(out[start:start + rows], out[start:start + rows], stream=cs)
            if residual is not None:
                with on_stream(cs, cur):
                    out[start:start + rows] += residual[start:start + rows]
        start += rows
    rt.join(cur, cs)  # no record_stream needed (Runtime.join)
    stats["chunked"] += 1
    return out


def matmul_reduce_scatter_chunked(a: torch.Tensor, b: torch.Tensor, *, group: Any = None,
                                  chunks: int = 2) -> torch.Tensor:
    """Chunked stream-overlap baseline of ``matmul_reduce_scatter`` (see ``_chunked``)."""
    _check_inputs("matmul_reduce_scatter", a, b)
    group = resolve_group(group)
    if not a.is_cuda:
        return matmul_reduce_scatter_ref(a, b, group=group)
    if a.shape[0] % _world(group):
        raise ValueError(f"matmul_reduce_scatter: M={a.shape[0]} is not a multiple of the ranks")
    return _chunked("matmul_reduce_scatter", a, b, group, chunks, None)


def matmul_all_reduce_chunked(a: torch.Tensor, b: torch.Tensor, *, group: Any = None,
                              residual: torch.Tensor | None = None, chunks: int = 2) -> torch.Tensor:
    """Chunked stream-overlap baseline of ``matmul_all_reduce`` (see ``_chunked``)."""
    _check_inputs("matmul_all_reduce", a, b, residual)
    group = resolve_group(group)
    if not a.is_cuda:
        return matmul_all_reduce_ref(a, b, group=group, residual=residual)
    return _chunked("matmul_all_reduce", a, b, group, chunks, residual)


# --------------------------------------------------------------------------
# the plan: chunk map and tile table
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class ChunkMap:
    """Where the rows of each chunk are: ``chunk_rows[c]`` rows from ``chunk_starts[c]``
    of every destination's block (reduce-scatter) or of C (all-reduce); the GEMM's
    segments in the order the comm stream needs them, each posting to its chunk's
    counter; ``c_rows`` the rows of the GEMM's output buffer."""

    chunk_starts: tuple[int, ...]
    chunk_rows: tuple[int, ...]
    segments: tuple[tuple[Segment, int], ...]
    """(segment, chunk) in schedule order."""
    c_rows: int


def reduce_scatter_layout(world: int, m: int, chunks: int, align: int = CHUNK_ALIGN,
                          scatter: bool = True) -> ChunkMap:
    """The chunk map of a reduce-scatter (``scatter``) or all-reduce of an [M, N] product.

    Reduce-scatter: each destination's block has M / world rows, cut into ``chunks``
    row chunks (multiples of ``align`` but the last); chunk c of destination d is A rows
    d * M/R + start_c .. and lands in the chunk-major output buffer at
    ``(world * start_c + d * rows_c)``, so a chunk is one contiguous [world, rows_c, N]
    block for NCCL. All-reduce: ``chunks`` row ranges of M, C in natural order."""
    if scatter:
        if m % world:
            raise ValueError(f"M={m} is not a multiple of the {world} ranks")
        ms = m // world
    else:
        ms = m
    sizes = split_rows(ms, chunks, align)
    starts, s = [], 0
    for r in sizes:
        starts.append(s)
        s += r
    segs: list[tuple[Segment, int]] = []
    for c, (st, rows) in enumerate(zip(starts, sizes)):
        if scatter:
            for d in range(world):
                segs.append((Segment(a_src=0, a_row=d * ms + st, c_row=world * st + d * rows, rows=rows), c))
        else:
            segs.append((Segment(a_src=0, a_row=st, c_row=st, rows=rows), c))
    return ChunkMap(tuple(starts), tuple(sizes), tuple(segs), m)


def producer_table(cmap: ChunkMap, n: int, block_m: int, block_n: int,
                   group_m: int = 8) -> tuple[list[list[int]], list[int]]:
    """The GEMM's tile table in schedule order, every tile posting to its chunk's counter
    (``protocol.COL_POST``), and the tile count per chunk (what the comm stream waits for)."""
    table: list[list[int]] = []
    counts = [0] * len(cmap.chunk_rows)
    for seg, c in cmap.segments:
        rows = build_tile_table([seg], n, block_m, block_n, group_m)
        for r in rows:
            r[COL_POST] = c
        counts[c] += len(rows)
        table += rows
    return table, counts


@dataclass(frozen=True)
class _Plan:
    cmap: ChunkMap
    table: torch.Tensor
    counts: tuple[int, ...]
    grid: int
    nccl_ctas: int
    gemm: Any
    groups: torch.Tensor | None = None
    """A flattened GEMM's (``GemmConfig.flatten``) runs of tiles per chunk (``flat_groups``)."""
    launches: LRU = field(default_factory=lambda: LRU(16))
    """Made on first use: launch plans of the call's GEMM (``_runtime.gemm_plan``)."""


def _plans(rt: Runtime) -> LRU:
    """Plans of both ops on ``rt`` by op, shape and config, the 64 most recently used."""
    return rt.cache("matmul_reduce.plans", 64)


def _tuned(rt: Runtime) -> LRU:
    """The tuners' picks on ``rt`` by op, shape, dtype and residual, the 256 most recently used."""
    return rt.cache("matmul_reduce.tuned", 256)


def _default_chunks(rows: int) -> int:
    # one chunk per ~1024 rows of a block, 1..4 (the consumer ops' rule)
    return max(1, min(4, rows // 1024))


def _plan(rt: Runtime, op: str, m: int, n: int, k: int, cfg: OverlapConfig) -> _Plan:
    from ..kernels.tile_gemm import DEFAULT_CONFIG

    scatter = op == "matmul_reduce_scatter"
    gemm = cfg.gemm or DEFAULT_CONFIG
    chunks = cfg.chunks or _default_chunks(m // rt.world if scatter else m)
    nccl_ctas = cfg.nccl_ctas or 16
    margin = cfg.margin("nccl")
    key = (op, m, n, k, chunks, nccl_ctas, margin, gemm)
    plans = _plans(rt)
    p = plans.get(key)
    if p is None:
        if capturing():
            raise OverlapCaptureError(f"{op}: M={m}, N={n}, K={k} with this config has not run outside a CUDA "
                                      "graph capture yet; call it once before capturing it")
        cmap = reduce_scatter_layout(rt.world, m, chunks, CHUNK_ALIGN, scatter)
        rows, counts = producer_table(cmap, n, gemm.block_m, gemm.block_n, gemm.group_m)
        grid = rt.num_sms - nccl_ctas - margin
        if grid < 1:
            raise ValueError(f"{op}: no SMs left for the GEMM: {rt.num_sms} SMs, nccl_ctas={nccl_ctas}, "
                             f"margin {margin}")
        table = table_tensor(rows, rt.device)
        groups = upload(flat_groups(rows), rt.device) if gemm.flatten else None
        p = _Plan(cmap, table, tuple(counts), grid, nccl_ctas, gemm, groups)
        plans[key] = p
    return p


def _fused(rt: Runtime, op: str, a: torch.Tensor, b: torch.Tensor, residual: torch.Tensor | None,
           cfg: OverlapConfig) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[1]
    scatter = op == "matmul_reduce_scatter"
    world = rt.world
    # the plan of the row bucket (per destination for the reduce-scatter): chunks, table
    # and launches shared by every M in it, the GEMM's tiles cut at this call's rows
    # (a cut tile still posts its chunk's counter)
    rows_m = m // world if scatter else m
    rows_b = plan_rows_for(rows_m, cfg, "nccl")
    clip = ("a" if scatter else "c") if bucketed(cfg, "nccl") else None
    p = _plan(rt, op, rows_b * world if scatter else rows_b, n, k, cfg)
    comm = rt.comm(p.nccl_ctas)
    err = rt.err(op)
    timeout_ns = int((cfg.timeout_ms or _flags.default_timeout_ms(rt.group)) * 1e6)
    chunks = len(p.cmap.chunk_rows)
    cs = rt.comm_stream
    # the dispatch counter, then a counter per chunk, zeroed on the caller's stream
    with fused_call(rt, err, cfg.check, (cs,), (op, 1, chunks)) as (cur, (w,)):
        # the reduce-scatter's C chunk-major for the bucket, its output the bucket's rows of
        # which the first M/R are returned; the all-reduce's C this call's M rows
        c = a.new_empty((p.cmap.c_rows if scatter else m, n))
        out = a.new_empty((rows_b, n)) if scatter else c
        gp = gemm_plan(p.launches, a, b, c, p.table, flags=w.flags, err=err.word, timeout_ns=1, counter=w.counters,
                       rank=rt.rank, config=p.gemm, post=True, groups=p.groups, clip=clip)
        with gpu_range("gemm", "grid"):
            gp.launch(gp.operands(a, b), c, epoch=1, grid=p.grid, rows=(rows_m, rows_b) if clip else None)
        for ci, (start, rows) in enumerate(zip(p.cmap.chunk_starts, p.cmap.chunk_rows)):
            live = min(rows, rows_m - start)
            with gpu_range("comm", "chunk", ci):
                # every tile of the chunk stored (each posted once, with release)
                wait_count(cs, w.flags, ci, p.counts[ci], err, rt.rank, timeout_ns)
                if live <= 0:
                    continue  # past this call's rows: nothing to reduce
                if scatter:
                    # whole: rows past M/R of each destination's block are never read
                    comm.reduce_scatter(c[world * start: world * (start + rows)], out[start:start + rows],
                                        stream=cs)
                else:
                    comm.all_reduce(c[start:start + live], c[start:start + live], stream=cs)
                    if residual is not None:
                        with on_stream(cs, cur):
                            c[start:start + live] += residual[start:start + live]
    stats["fused"] += 1
    # the reduce-scatter's rows: a view of the first M/R rows of the bucket's output
    return out[:rows_m] if scatter else out



# --------------------------------------------------------------------------
# the public ops
# --------------------------------------------------------------------------

def _run(op: str, a: torch.Tensor, b: torch.Tensor, group: Any, residual: torch.Tensor | None,
         config: OverlapConfig | None, ref: Any) -> torch.Tensor:
    """One call of ``op``; ``group`` resolved (``resolve_group``) by the caller, ``ref`` its reference."""
    refuse_grad(op, a, b, residual)
    m, k = a.shape
    n = b.shape[1]
    scatter = op == "matmul_reduce_scatter"
    if not a.is_cuda or a.dtype not in (torch.float16, torch.bfloat16):
        warn_once(f"{op}-ref-{a.device.type}-{a.dtype}",
                  f"{op}: no tile-flag path for {a.dtype} on {a.device.type}; running the reference "
                  f"(matmul, then {'reduce-scatter' if scatter else 'all-reduce'})")
        if scatter and m % _world(group):  # before the agreement: a refusal, not a failed collective
            raise ValueError(f"{op}: M={m} is not a multiple of the {_world(group)} ranks")
        agree_on_reference(group, op, ("M", "K/R", "N", "dtype", "residual"),
                           (m, k, n, dtype_code(a.dtype), int(residual is not None)), a.device)
        why = "no GPU" if not a.is_cuda else f"dtype {a.dtype}"
        return observed(op, (m, n, k), "reference", why, a.device, ref)
    esize = a.element_size()
    if (k * esize) % 16 or (n * esize) % 16:
        raise ValueError(f"{op}: K/R={k} and N={n} must be multiples of {16 // esize} for {a.dtype} "
                         "(16-byte rows for TMA)")
    from ..kernels.tile_gemm import check_b, check_tma

    check_b(b)  # before any work is queued
    check_tma("a", a.contiguous())
    if capturing() and get_runtime_if_made(group, a.device) is None:
        raise OverlapCaptureError(f"{op}: call it once outside the CUDA graph capture first")
    rt = get_runtime(group, a.device)
    rt.p2p()  # collective on the first call, the same on every rank whichever transport follows
    tuned = None
    if config is None:
        tuned = _tuned(rt).get((op, m, n, k, a.dtype, residual is not None))
    sequential = isinstance(tuned, Sequential)  # the tuner's pick: the sequential reference
    cfg = config or (None if sequential else tuned) or OverlapConfig()
    transport = "nccl" if sequential else _transport(rt, cfg)
    if scatter and m % rt.world:
        raise ValueError(f"{op}: M={m} is not a multiple of the {rt.world} ranks")
    chunks = 0 if sequential else (cfg.chunks or _default_chunks(
        plan_rows_for(m // rt.world if scatter else m, cfg, transport)))
    # the NCCL calls' and the pushes' sizes come from (M, N) and the chunks (0: the
    # sequential path): ranks must agree or peers hang
    names = ("M", "K/R", "N", "dtype", "residual", "chunks", "p2p", "bucketed")
    values = (m, k, n, dtype_code(a.dtype), int(residual is not None), chunks, int(transport == "p2p"),
              bucketed(None if sequential else cfg, transport))
    check_agree(rt, op, names, values, rows_at=0)
    if sequential:
        return observed(op, (m, n, k), "sequential", "tuner pick", a.device, ref)
    if transport == "p2p" and capturing():
        # the peer-copy transport's flags are written by the peers' copy engines with
        # epochs the host counts per call (a replay would repeat the captured epoch)
        warn_once(f"{op}-p2p-capture", f"{op}: the peer-copy transport cannot be captured in a CUDA graph; the "
                  f"captured call runs the reference; OverlapConfig(transport='nccl') captures the tile-flag path")
        return observed(op, (m, n, k), "reference", "capture (p2p)", a.device, ref)
    sig = (m, k, n, a.dtype, b.stride(), residual is not None, cfg, transport)
    rt.require_warm(op, sig)
    why = "config given" if config is not None else ("tuner pick" if tuned is not None else "default config")
    res = None if residual is None else residual.contiguous()
    if transport == "p2p":
        from . import matmul_reduce_p2p as _peer

        out = rt.mark_warm(op, sig, observed(op, (m, n, k), f"p2p x{chunks}", why, a.device, run_p2p, rt, op,
                                             _peer._fused_p2p, rt, op, a.contiguous(), b, res, cfg))
    else:
        out = rt.mark_warm(op, sig, observed(op, (m, n, k), f"nccl x{chunks}", why, a.device, _fused, rt, op,
                                             a.contiguous(), b, res, cfg))
    if a.is_contiguous() and (residual is None or residual.is_contiguous()):
        # the call returned: later ones of its signature take its plan (``_calls``)
        _calls.keep(rt, _call_key(a, b, residual, cfg, transport, config is not None, tuned),
                    CallPlan(op, names, values, 0, sig, (m, n, k), f"{transport} x{chunks}", why, cfg, transport))
    return out


def _call_key(a: torch.Tensor, b: torch.Tensor, residual: torch.Tensor | None, cfg: OverlapConfig, transport: str,
              given: bool, tuned: Any) -> tuple:
    """A call's signature for its ``CallPlan``: everything the full path's checks and
    decisions read, but the pointers (``_calls.aligned``, per call)."""
    return (a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype, b.device,
            None if residual is None else (residual.shape, residual.stride(), residual.dtype, residual.device),
            cfg, transport, given, tuned is not None)


def _planned(op: str, a: Any, b: Any, group: Any, residual: Any, config: OverlapConfig | None) -> Any:
    """The call run from its signature's ``CallPlan`` (``_calls``), or None where it has
    none or needs the full path (a capture, autograd, an unaligned pointer, another
    tuned pick or transport than the plan's)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or not a.is_cuda:
        return None
    if a.dim() != 2 or b.dim() != 2:  # the full path's checks say what is wrong
        return None
    if residual is not None and not isinstance(residual, torch.Tensor):
        return None
    if capturing() or (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or (
            residual is not None and residual.requires_grad))):
        return None
    g = resolve_group(group)
    # the index: one dict read for a signature seen before (``_calls.index_lookup``)
    ikey = (op, id(g), id(config), a.shape, a.stride(), a.dtype, a.device, b.shape, b.stride(), b.dtype, b.device,
            None if residual is None else (residual.shape, residual.stride(), residual.dtype, residual.device))
    hit = _calls.index_lookup(ikey, g, config)
    if hit is not None:
        rt, cp, cfg, transport = hit
    else:  # the full lookup, indexed where it finds a plan
        gen, env = _calls.generation(), _calls.transport_env()
        rt = get_runtime_if_made(g, a.device)
        if rt is None:
            return None
        tuned = tcache = tkey = None
        if config is None:
            tcache, tkey = _tuned(rt), (op, a.shape[0], b.shape[1], a.shape[1], a.dtype, residual is not None)
            tuned = tcache.get(tkey)
            if isinstance(tuned, Sequential):
                return None
        cfg = config or tuned or OverlapConfig()
        transport = _transport(rt, cfg)
        key = _call_key(a, b, residual, cfg, transport, config is not None, tuned)
        cp = _calls.find(rt, op, key)
        if cp is None:
            return None
        _calls.index(ikey, gen, g, config, env, rt, cp, cfg, transport, tcache if tuned is not None else None,
                     tkey, key)
    if not aligned(a, b, residual):
        return None
    _calls.stats["planned"] += 1
    if transport == "p2p":
        from . import matmul_reduce_p2p as _peer

        return run_planned(rt, cp, run_p2p, rt, op, _peer._fused_p2p, rt, op, a, b, residual, cfg)
    body = cp.body
    if body is None and not (cfg.gemm is not None and cfg.gemm.flatten):
        body = cp.body = _Bound(rt, op, a, b, residual, cfg)
    if body is not None:
        out = _graphs.replay_or_capture(rt, cp, body, (a, b, residual))
        if out is not _graphs.NO:
            return out
        if body.ready():
            return _calls.run_bound(rt, cp, a, b, residual)
    return run_planned(rt, cp, _fused, rt, op, a, b, residual, cfg)


class _Bound(_calls.BoundBody):
    """``_fused`` for one call signature, bound (``_calls``): the op plan of its row bucket,
    the GEMM plan, communicator, error word and words decided once; the GEMM's launch, each
    chunk's counter wait and its reduce-scatter or all-reduce made with their arguments.
    A call allocates C (and the scattered output), then queues what ``_fused`` queues::

        caller      | zero | fork | GEMM grid (tiles post per-chunk counters) | join |
        comm stream |        wait n0 | RS/AR chunk0 (bound) | wait n1 | RS/AR chunk1 | ..."""

    moving = (0, 2)
    """The arguments a plan graph copies in per call (``_graphs``); the others are read in place."""

    def __init__(self, rt: Runtime, op: str, a: torch.Tensor, b: torch.Tensor, residual: torch.Tensor | None,
                 cfg: OverlapConfig) -> None:
        m, k = a.shape
        n = b.shape[1]
        world = rt.world
        self.rt, self.op, self.m, self.n, self.k = rt, op, m, n, k
        self.scatter = scatter = op == "matmul_reduce_scatter"
        self.rows_m = rows_m = m // world if scatter else m
        self.rows_b = rows_b = plan_rows_for(rows_m, cfg, "nccl")
        self.clip = clip = ("a" if scatter else "c") if bucketed(cfg, "nccl") else None
        self.p = p = _plan(rt, op, rows_b * world if scatter else rows_b, n, k, cfg)
        comm = rt.comm(p.nccl_ctas)
        self.err = err = rt.err(op)
        self.check = cfg.check
        # a plan graph (``_graphs``): its config and GEMM work (``auto`` graphs the small ones)
        self.cfg, self.flops = cfg, 2 * m * k * n
        self.cs = cs = rt.comm_stream
        self.side = (cs,)
        with rt.order.lock:
            self.words = w = rt.local_words(op, 1, len(p.cmap.chunk_rows))
        self.bind_frame()
        self.c_rows = p.cmap.c_rows if scatter else m
        c = a.new_empty((self.c_rows, n))
        out = a.new_empty((rows_b, n)) if scatter else c
        bound = getattr(comm, "bound", None)
        chunks = []
        for ci, (start, rows) in enumerate(zip(p.cmap.chunk_starts, p.cmap.chunk_rows)):
            live = min(rows, rows_m - start)
            wait = _flags.bound_wait_value(cs, w.flags, ci, p.counts[ci])
            coll = None
            if live > 0 and scatter:
                coll = bound("reduce_scatter", c[world * start: world * (start + rows)], out[start:start + rows],
                             cs) if bound is not None else \
                    (lambda s_, r_, comm=comm: comm.reduce_scatter(s_, r_, stream=cs))
            elif live > 0:
                coll = bound("all_reduce", c[start:start + live], c[start:start + live], cs) if bound is not None \
                    else (lambda s_, r_, comm=comm: comm.all_reduce(s_, r_, stream=cs))
            # (start, rows, live, the bound counter wait, the bound collective)
            chunks.append((start, rows, live, wait, coll))
        self.chunks = tuple(chunks)
        self.gp = gemm_plan(p.launches, a, b, c, p.table, flags=w.flags, err=err.word, timeout_ns=1,
                            counter=w.counters, rank=rt.rank, config=p.gemm, post=True, groups=p.groups, clip=clip)
        self.cut = (rows_m, rows_b) if clip else None
        self.b_kn = getattr(self.gp, "b_kn", True)
        self.bound, self.bl = False, None

    def run(self, raw: int, cur: Any, a: torch.Tensor, b: torch.Tensor, residual: torch.Tensor | None) -> Any:
        n, world, scatter, cs = self.n, self.rt.world, self.scatter, self.cs
        c = a.new_empty((self.c_rows, n))
        out = a.new_empty((self.rows_b, n)) if scatter else c
        bl = self.bl
        if bl is not None and not c.data_ptr() % 16:
            bl(raw, (a, None, b if self.b_kn else b.t(), c, None, None))
        else:
            gp = self.gp
            gp.launch(gp.operands(a, b), c, epoch=1, grid=self.p.grid, rows=self.cut)
            if not self.bound:
                self.bound = True
                bind = _calls.gemm_bind(gp)
                self.bl = bind(a, b, c, epoch=1, grid=self.p.grid, rows=self.cut) if bind is not None else None
        for start, rows, live, wait, coll in self.chunks:
            wait()  # every tile of the chunk stored (each posted once, with release)
            if live <= 0:
                continue  # past this call's rows: nothing to reduce
            if scatter:
                coll(c[world * start: world * (start + rows)], out[start:start + rows])
            else:
                part = c[start:start + live]
                coll(part, part)
                if residual is not None:
                    with on_stream(cs, cur):
                        part += residual[start:start + live]
        stats["fused"] += 1
        return out[:self.rows_m] if scatter else out

    def fused(self, a: torch.Tensor, b: torch.Tensor, residual: torch.Tensor | None) -> Any:
        """The call as the fused body runs it (what a plan graph captures)."""
        return _fused(self.rt, self.op, a, b, residual, self.cfg)

    def __repr__(self) -> str:
        p = self.p
        return (f"{self.op} body: M {self.m}, N {self.n}, K/R {self.k}, {len(self.chunks)} chunk(s) on NCCL "
                f"({p.nccl_ctas} CTAs), grid {p.grid}, launches {'bound' if self.bl is not None else 'general'}, "
                f"check {self.check!r}")


def _transport(rt: Runtime, cfg: OverlapConfig) -> str:
    """The call's transport: what ``cfg`` (else ``OVERLAP_TRANSPORT``) asks for, resolved by
    ``Runtime.transport`` (p2p asked for where peer memory is unavailable: RuntimeError);
    NCCL where neither names one (the peer-copy path is chosen, not the default, here),
    except in shared-GPU mode, where NCCL cannot run."""
    from ._runtime import _env_transport

    if cfg.transport is None and _env_transport() is None and not (rt.shared_gpu and rt.world > 1):
        return "nccl"
    return rt.transport(cfg)


@group_call("matmul_reduce_scatter")
def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, *, group: Any = None,
                          config: OverlapConfig | None = None) -> torch.Tensor:
    """``reduce_scatter(a @ b, dim=0)``: each chunk's reduce-scatter starts as its tiles finish.

    ==========  =========  ===================================================
    tensor      shape      meaning
    ==========  =========  ===================================================
    a           [M, K/R]   this rank's columns of the input (row-parallel)
    b           [K/R, N]   this rank's rows of the weight: row-major, or
                           ``w.t()`` of an nn.Linear weight ``w`` [N, K/R]
    returns     [M/R, N]   rows r*M/R .. (r+1)*M/R of the sum over ranks
    ==========  =========  ===================================================

    fp16 and bf16 on CUDA take the tile-flag path: NCCL (``config`` sets chunks, NCCL
    CTAs, SM margin and the GEMM config) or, asked for with ``transport="p2p"`` on one
    node, copy-engine pushes summed by a reduce kernel on ``reduce_ctas`` SMs
    (``matmul_reduce_p2p``); other inputs (a CPU / gloo group, fp32) take
    ``matmul_reduce_scatter_ref`` with a one-time warning. M must be a multiple of R.
    """
    out = _planned("matmul_reduce_scatter", a, b, group, None, config)
    if out is not None:
        return out
    _check_inputs("matmul_reduce_scatter", a, b)
    group = resolve_group(group)
    return _run("matmul_reduce_scatter", a, b, group, None, config,
                lambda: matmul_reduce_scatter_ref(a, b, group=group))


@group_call("matmul_all_reduce")
def matmul_all_reduce(a: torch.Tensor, b: torch.Tensor, *, group: Any = None, residual: torch.Tensor | None = None,
                      config: OverlapConfig | None = None) -> torch.Tensor:
    """``all_reduce(a @ b) (+ residual)``: each chunk's all-reduce starts as its tiles finish.

    ==========  =========  ===================================================
    tensor      shape      meaning
    ==========  =========  ===================================================
    a           [M, K/R]   this rank's columns of the input (row-parallel)
    b           [K/R, N]   this rank's rows of the weight (any nn.Linear layout)
    residual    [M, N]     optional, added to the sum (not modified)
    returns     [M, N]     the sum over ranks (+ residual)
    ==========  =========  ===================================================

    As ``matmul_reduce_scatter`` for paths and config.
    """
    out = _planned("matmul_all_reduce", a, b, group, residual, config)
    if out is not None:
        return out
    _check_inputs("matmul_all_reduce", a, b, residual)
    group = resolve_group(group)
    return _run("matmul_all_reduce", a, b, group, residual, config,
                lambda: matmul_all_reduce_ref(a, b, group=group, residual=residual))


# --------------------------------------------------------------------------
# tuners
# --------------------------------------------------------------------------

def _tune(op: str, a: torch.Tensor, b: torch.Tensor, group: Any, residual: torch.Tensor | None,
          candidates: list[OverlapConfig] | None, iters: int, verbose: bool) -> Path:
    _check_inputs(op, a, b, residual)
    group = resolve_group(group)
    m, k = a.shape
    n = b.shape[1]
    esize = a.element_size()
    if not a.is_cuda or a.dtype not in (torch.float16, torch.bfloat16) or (k * esize) % 16 or (n * esize) % 16:
        return SEQUENTIAL  # no tile-flag path for these inputs: nothing to tune
    rt = get_runtime(group, a.device)
    a = a.contiguous()
    scatter = op == "matmul_reduce_scatter"

    def ref() -> Any:
        return (matmul_reduce_scatter_ref(a, b, group=group) if scatter
                else matmul_all_reduce_ref(a, b, group=group, residual=residual))

    flat_pass = candidates is None
    if candidates is None:
        candidates = [OverlapConfig(chunks=ch, nccl_ctas=ct, transport="nccl") for ch in (1, 2, 4)
                      for ct in (8, 16, 24)]
        if rt.transport(OverlapConfig()) == "p2p":  # peer memory: the copy-engine pushes too
            candidates += [OverlapConfig(chunks=ch, reduce_ctas=rc, transport="p2p") for ch in (2, 4, 8)
                           for rc in (8, 16)]

    def run(cand: OverlapConfig) -> Any:
        if _transport(rt, cand) == "p2p":
            from . import matmul_reduce_p2p as _peer

            res = None if residual is None else residual.contiguous()
            return run_p2p(rt, op, _peer._fused_p2p, rt, op, a, b, res, cand)
        return _fused(rt, op, a, b, residual, cand)

    def describe(cand: OverlapConfig) -> str:
        flat = ", flattened GEMM" if cand.gemm is not None and cand.gemm.flatten else ""
        if cand.transport == "p2p":
            return f"  tune {op} {m}x{n}x{k}: p2p, {cand.chunks} chunks, reduce {cand.reduce_ctas}{flat}"
        return f"  tune {op} {m}x{n}x{k}: nccl, {cand.chunks} chunks, {cand.nccl_ctas} ctas{flat}"

    # the producer GEMM waits on nothing: the two fastest again with a flattened GEMM
    return tune_paths(rt, op, (m, n, k), f"{op} {m}x{n}x{k}", ref=ref, candidates=candidates, run=run,
                      describe=describe, iters=iters, group=group, verbose=verbose, cache=_tuned(rt),
                      key=(op, m, n, k, a.dtype, residual is not None),
                      passes=(flat_variants,) if flat_pass else ())


def tune_matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, *, group: Any = None,
                               candidates: list[OverlapConfig] | None = None, iters: int = 10,
                               verbose: bool = False) -> Path:
    """Time candidate configs (collectively: every rank must call; default 1, 2, 4 chunks
    x 8, 16, 24 NCCL CTAs, and where peer memory is available the peer-copy transport in
    2, 4, 8 chunks x 8, 16 reduce SMs) and the sequential reference, with the default candidates
    the two fastest again with a flattened GEMM (``GemmConfig.flatten``: the producer's tiles
    wait on nothing), then the three fastest again in interleaved rounds; cache the winner for this shape (later calls without a config use
    it). Returns the ``OverlapConfig`` or ``SEQUENTIAL`` (then the op warns once and runs
    the reference for this shape). Inputs with no tile-flag path return ``SEQUENTIAL``
    untimed."""
    return _tune("matmul_reduce_scatter", a, b, group, None, candidates, iters, verbose)


def tune_matmul_all_reduce(a: torch.Tensor, b: torch.Tensor, *, group: Any = None,
                           residual: torch.Tensor | None = None, candidates: list[OverlapConfig] | None = None,
                           iters: int = 10, verbose: bool = False) -> Path:
    """``tune_matmul_reduce_scatter`` for ``matmul_all_reduce`` (keyed with the residual or not)."""
    return _tune("matmul_all_reduce", a, b, group, residual, candidates, iters, verbose)
