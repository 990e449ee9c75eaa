"""The non-sequence-parallel block boundary as one overlapped pipeline:

    h = all_reduce(a @ b) (+ residual);  c = norm(h) @ b_next

That is a row-parallel GEMM (fc2, attn.proj) -> all-reduce -> residual add -> LayerNorm /
RMSNorm -> the next layer's column-parallel GEMM (fc1, qkv), with both halves overlapped:

    caller stream  | producer GEMM (tiles post chunk counters) | consumer GEMM (tiles wait chunk flags) |
    comm stream    |   wait count c0 | AR c0 | wait count c1 | AR c1 | ...
    aux stream     |                 | add+norm c0, flag f0 |          | add+norm c1, flag f1 |

The producer half is ``matmul_all_reduce``'s (each chunk's NCCL all-reduce starts as the
GEMM tiles that write its rows are stored: ``cuStreamWaitValue32`` on the chunk's
counter, no SM); the consumer half is ``all_reduce_matmul``'s (each chunk's tiles start
as its rows are reduced, added and normed). Both use the same row chunks, so a chunk
flows from the first GEMM to the second without waiting for the whole all-reduce. The
consumer grid is queued behind the producer grid on the caller's stream: the two never
compete for SMs, and the consumer's first chunks are usually ready when it starts.

NCCL transport only (``transport="p2p"`` raises), except in shared-GPU mode, where NCCL
cannot run and the op runs as ``matmul_all_reduce`` on the peer-copy transport, then the
norm and the second GEMM (``_shared_gpu``). One
``OverlapConfig`` serves both halves (chunks, NCCL CTAs, SM margin, the GEMM config of
both GEMMs, the consumer's give-back grid and split tail); ``fold_norm`` does not apply
(the norm runs on the aux stream). ``tune_matmul_all_reduce_matmul`` times chunk counts and
NCCL CTA caps against the sequential reference and caches the pick per shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import flags as _flags
from ..observe import gpu_range
from . import all_reduce as _ar
from . import matmul_reduce as _mr
from . import _calls, _graphs
from ._agree import group_call
from ._calls import CallPlan, run_planned, tensor_key
from ._plans import wait_count
from ._runtime import (LRU, SEQUENTIAL, OverlapCaptureError, OverlapConfig, Path, Runtime, Sequential,
                       agree_on_reference, capturing, check_agree, dtype_code, fused_call, gemm_plan, get_runtime,
                       get_runtime_if_made, observed, on_stream, refuse_grad, resolve_group, tune_paths, warn_once)

__all__ = ["matmul_all_reduce_matmul", "matmul_all_reduce_matmul_ref", "tune_matmul_all_reduce_matmul", "stats"]

OP = "matmul_all_reduce_matmul"
stats: dict[str, int] = {"fused": 0, "reference": 0, "shared_gpu": 0}
"""How many calls took each path."""


def _check(a: torch.Tensor, b: torch.Tensor, b_next: torch.Tensor, residual: torch.Tensor | None,
           norm: Any) -> None:
    for name, t in (("a", a), ("b", b), ("b_next", b_next)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{OP}: {name} must be a 2-D tensor, got {type(t).__name__}")
    _mr._check_inputs(OP, a, b, residual)
    n = b.shape[1]
    if b_next.dim() != 2 or b_next.shape[0] != n:
        raise ValueError(f"{OP}: b_next must be [N, N2] with N={n} (b's columns), got {tuple(b_next.shape)}")
    if b_next.dtype != a.dtype or b_next.device != a.device:
        raise TypeError(f"{OP}: b_next is {b_next.dtype} on {b_next.device}; a is {a.dtype} on {a.device}")
    if b_next.numel() == 0:
        raise ValueError(f"{OP}: empty operand: b_next {tuple(b_next.shape)}")
    _ar.check_norm(OP, norm, a, "a", n, "N")


def matmul_all_reduce_matmul_ref(a: torch.Tensor, b: torch.Tensor, b_next: torch.Tensor, *, group: Any = None,
                                 residual: torch.Tensor | None = None,
                                 norm: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain reference: ``torch.matmul``, one all-reduce, the residual add, the norm,
    ``torch.matmul``. Returns ``(c, h)``."""
    _check(a, b, b_next, residual, norm)
    h = _mr.matmul_all_reduce_ref(a, b, group=group, residual=residual)
    y = norm.apply(h) if norm is not None else h
    stats["reference"] += 1
    return y @ b_next, h


@group_call(OP)  # opens peer memory in shared-GPU mode only (``_agree.NCCL_ONLY``)
def matmul_all_reduce_matmul(a: torch.Tensor, b: torch.Tensor, b_next: torch.Tensor, *, group: Any = None,
                             residual: torch.Tensor | None = None, norm: Any = None,
                             config: OverlapConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = all_reduce(a @ b) (+ residual)``, ``c = norm(h) @ b_next``, both GEMMs overlapped
    with the all-reduce chunk by chunk. Returns ``(c, h)``.

    ==========  ==========  ==================================================
    tensor      shape       meaning
    ==========  ==========  ==================================================
    a           [M, K/R]    this rank's columns of the input
    b           [K/R, N]    this rank's rows of the weight (any nn.Linear layout)
    b_next      [N, N2]     the next layer's weight shard (any nn.Linear layout)
    residual    [M, N]      optional, added to the sum
    norm        Norm        optional LayerNorm / RMSNorm over N, before b_next
    returns     c [M, N2], h [M, N] (the new residual stream)
    ==========  ==========  ==================================================

    fp16 and bf16 on CUDA take the pipeline (NCCL transport), or in shared-GPU mode
    ``matmul_all_reduce`` on the peer-copy transport and then the norm and the second GEMM;
    other inputs take the reference with a one-time warning."""
    out = _planned(a, b, b_next, group, residual, norm, config)
    if out is not None:
        return out
    refuse_grad(OP, a, b, b_next, residual, *(() if norm is None else (norm.weight, norm.bias)))
    _check(a, b, b_next, residual, norm)
    group = resolve_group(group)
    m, k = a.shape
    n, n2 = b.shape[1], b_next.shape[1]

    def ref() -> tuple[torch.Tensor, torch.Tensor]:
        return matmul_all_reduce_matmul_ref(a, b, b_next, group=group, residual=residual, norm=norm)

    if not a.is_cuda or a.dtype not in (torch.float16, torch.bfloat16):
        warn_once(f"{OP}-ref-{a.device.type}-{a.dtype}",
                  f"{OP}: no tile-flag path for {a.dtype} on {a.device.type}; running the reference "
                  "(matmul, all-reduce, add, norm, matmul)")
        agree_on_reference(group, OP, ("M", "K/R", "N", "N2", "dtype", "residual", "norm"),
                           (m, k, n, n2, dtype_code(a.dtype), int(residual is not None), _ar._norm_code(norm)),
                           a.device)
        return observed(OP, (m, n2, n), "reference", "no GPU" if not a.is_cuda else f"dtype {a.dtype}",
                        a.device, ref)
    esize = a.element_size()
    for name, v in (("K/R", k), ("N", n), ("N2", n2)):
        if (v * esize) % 16:
            raise ValueError(f"{OP}: {name}={v} must be a multiple of {16 // esize} for {a.dtype} "
                             "(16-byte rows for TMA)")
    from ..kernels.tile_gemm import check_b, check_tma

    check_b(b)
    check_b(b_next)
    check_tma("a", a.contiguous())
    if capturing() and get_runtime_if_made(group, a.device) is None:
        raise OverlapCaptureError(f"{OP}: call it once outside the CUDA graph capture first")
    rt = get_runtime(group, a.device)
    if rt.shared_gpu and rt.world > 1:
        return observed(OP, (m, n2, n), "p2p, two halves", "shared-GPU mode", a.device, _shared_gpu, a, b, b_next,
                        group, residual, norm, config)
    tuned = _tuned(rt).get(_tune_key(a, b, b_next, residual, norm)) if config is None else None
    sequential = isinstance(tuned, Sequential)  # the tuner's pick: the sequential reference
    cfg = config or (None if sequential else tuned) or OverlapConfig()
    if cfg.transport == "p2p":
        raise ValueError(f"{OP}: the peer-copy transport is not built for this op; use transport='nccl' (or None)")
    chunks = 0 if sequential else (cfg.chunks or _mr._default_chunks(m))
    # the NCCL calls' sizes come from (M, N) and the chunks (0: the sequential path): ranks
    # must agree or peers hang
    names = ("M", "K/R", "N", "N2", "dtype", "residual", "norm", "chunks")
    values = (m, k, n, n2, dtype_code(a.dtype), int(residual is not None), _ar._norm_code(norm), chunks)
    check_agree(rt, OP, names, values, rows_at=0)
    if sequential:
        return observed(OP, (m, n2, n), "sequential", "tuner pick", a.device, ref)
    key = _call_key(a, b, b_next, residual, norm, cfg, config is not None, tuned)
    cfg = _nccl(cfg, chunks)
    sig = (m, k, n, n2, a.dtype, b.stride(), b_next.stride(), residual is not None,
           None if norm is None else (norm.kind, norm.weight.dtype, norm.bias is not None, norm.eps), cfg)
    rt.require_warm(OP, sig)
    why = "config given" if config is not None else ("tuner pick" if tuned is not None else "default config")
    res, nrm = _ar._contiguous(None if residual is None else residual.contiguous(), norm)
    out = rt.mark_warm(OP, sig, observed(OP, (m, n2, n), f"nccl x{chunks}", why, a.device, _fused, rt,
                                         a.contiguous(), b, b_next, res, nrm, cfg))
    if (a.is_contiguous() and (residual is None or residual.is_contiguous()) and type(norm) in (_ar.Norm, type(None))
            and (norm is None or (norm.weight.is_contiguous() and (norm.bias is None or norm.bias.is_contiguous())))):
        # the call returned: later ones of its signature take its plan (``_calls``)
        _calls.keep(rt, key, CallPlan(OP, names, values, 0, sig, (m, n2, n), f"nccl x{chunks}", why, cfg, "nccl"))
    return out


def _call_key(a: torch.Tensor, b: torch.Tensor, b_next: torch.Tensor, residual: torch.Tensor | None, norm: Any,
              cfg: OverlapConfig, given: bool, tuned: Any) -> tuple:
    """A call's signature for its ``CallPlan``: everything the full path's checks and
    decisions read, but the pointers (``_calls.aligned``, per call)."""
    nk = None if norm is None else (norm.kind, norm.eps, tensor_key(norm.weight), tensor_key(norm.bias))
    return (tensor_key(a), tensor_key(b), tensor_key(b_next), tensor_key(residual), nk, cfg, given, tuned is not None)


def _planned(a: Any, b: Any, b_next: Any, group: Any, residual: Any, norm: Any, config: OverlapConfig | None) -> Any:
    """The call run from its signature's ``CallPlan`` (``_calls``), or None where it has
    none or needs the full path (a capture, autograd, an unaligned pointer, another
    tuned pick than the plan's). Its config is the plan's, on the NCCL transport."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(b_next, torch.Tensor)) \
            or not a.is_cuda:
        return None
    if (residual is not None and not isinstance(residual, torch.Tensor)) or type(norm) not in (_ar.Norm, type(None)):
        return None
    if norm is not None and not (isinstance(norm.weight, torch.Tensor)
                                 and (norm.bias is None or isinstance(norm.bias, torch.Tensor))):
        return None
    nw, nb = (norm.weight, norm.bias) if norm is not None else (None, None)
    if capturing():
        return None
    seen = _calls.scan(a, b, b_next, residual, nw, nb)  # (None: autograd, or an unaligned pointer)
    if seen is None:
        return None
    keys, ptrs = seen
    g = resolve_group(group)
    # the index: one dict read for a signature seen before (``_calls.index_lookup``)
    ikey = (OP, id(g), id(config), keys, None if norm is None else (norm.kind, norm.eps))
    hit = _calls.index_lookup(ikey, g, config)
    if hit is not None:
        rt, cp = hit[0], hit[1]
    else:  # the full lookup, indexed where it finds a plan
        # (not asked of an index hit: its key holds the shapes it was made for)
        if a.dim() != 2 or b.dim() != 2 or b_next.dim() != 2:  # the full path's checks say what is wrong
            return None
        gen, env = _calls.generation(), _calls.transport_env()
        rt = get_runtime_if_made(g, a.device)
        if rt is None:
            return None
        tuned = tcache = tkey = None
        if config is None:
            tcache, tkey = _tuned(rt), _tune_key(a, b, b_next, residual, norm)
            tuned = tcache.get(tkey)
            if isinstance(tuned, Sequential):
                return None
        cfg = config or tuned or OverlapConfig()
        key = _call_key(a, b, b_next, residual, norm, cfg, config is not None, tuned)
        cp = _calls.find(rt, OP, key)
        if cp is None:
            return None
        _calls.index(ikey, gen, g, config, env, rt, cp, cfg, "nccl", tcache if tuned is not None else None, tkey,
                     key)
    _calls.stats["planned"] += 1
    body = cp.body
    if body is None and not (cp.config.gemm is not None and cp.config.gemm.flatten):
        body = cp.body = _Bound(rt, a, b, b_next, residual, norm, cp.config)
    if body is not None:
        # what a graph reads in place (all but ``_Bound.moving``): b, b_next, the norm's weight and bias
        out = _graphs.replay_or_capture(rt, cp, body, (a, b, b_next, residual, norm),
                                        (ptrs[1], ptrs[2], ptrs[4], ptrs[5]))
        if out is not _graphs.NO:
            return out
        if body.ready():
            return _calls.run_bound(rt, cp, a, b, b_next, residual, norm)
    return run_planned(rt, cp, _fused, rt, a, b, b_next, residual, norm, cp.config)


class _Bound(_calls.BoundBody):
    """``_fused`` for one call signature, bound (``_calls``): both plans, both GEMM plans,
    communicator, error word, wait bound, words, streams, events and the gate decided once;
    the producer's launch, each chunk's counter wait, all-reduce, add+norm and flag post,
    and the consumer's launches made with their arguments. A call allocates C1, h, y and
    C, then queues what ``_fused`` queues, in its order::

        caller      | zero | fork | producer grid (posts) | gate | consumer grid (waits) | join |
        comm stream |   wait n0 | AR chunk0 | wait n1 | AR chunk1 | ...
        aux stream  |             ev | add+norm 0 |W0| ev | add+norm 1 |W1| [give-back grid]"""

    moving = (0, 3)
    """The arguments a plan graph copies in per call (``_graphs``); the others are read in place."""

    def __init__(self, rt: Runtime, a: torch.Tensor, b: torch.Tensor, b_next: torch.Tensor,
                 residual: torch.Tensor | None, norm: Any, cfg: OverlapConfig) -> None:
        from ..kernels import gate as _gate

        m, k = a.shape
        n, n2 = b.shape[1], b_next.shape[1]
        self.rt, self.m, self.k, self.n, self.n2 = rt, m, k, n, n2
        self.p1 = p1 = _mr._plan(rt, "matmul_all_reduce", m, n, k, cfg)
        self.p2 = p2 = _ar._plan(rt, m, n2, n, cfg)
        if tuple(p1.cmap.chunk_rows) != tuple(p2.chunk_rows):
            raise RuntimeError(f"{OP}: the producer's chunks {p1.cmap.chunk_rows} and the consumer's "
                               f"{p2.chunk_rows} differ")
        comm = rt.comm(p1.nccl_ctas)
        self.err = err = rt.err(OP)
        self.check = cfg.check
        # a plan graph (``_graphs``): its config and GEMM work (``auto`` graphs the small ones)
        self.cfg, self.flops = cfg, 2 * m * k * n + 2 * m * n * n2
        self.timeout_ns = timeout_ns = int((cfg.timeout_ms or _flags.default_timeout_ms(rt.group)) * 1e6)
        self.has_norm = norm is not None
        self.prologue = prologue = residual is not None or norm is not None
        chunks = len(p1.cmap.chunk_rows)
        self.cs, self.ns = cs, ns = rt.comm_stream, rt.aux_stream
        self.side = (cs, ns) if prologue else (cs,)
        with rt.order.lock:
            w1 = rt.local_words(OP + ".producer", 1, chunks)
            w2 = rt.local_words(OP + ".consumer", p2.counters, chunks)
        self.words = (w1, w2)
        self.bind_frame()
        self.gated = _gate.enabled()
        c1 = a.new_empty((p1.cmap.c_rows, n))
        h = a.new_empty((m, n))
        y = torch.empty_like(h) if norm is not None else h
        c = a.new_empty((m, n2))
        bound = getattr(comm, "bound", None)
        post_on = ns if prologue else cs
        rows_all = []
        for ci, (start, rows) in enumerate(zip(p1.cmap.chunk_starts, p1.cmap.chunk_rows)):
            reduce = bound("all_reduce", c1[start:start + rows], h[start:start + rows], cs) if bound is not None \
                else (lambda s_, r_, comm=comm: comm.all_reduce(s_, r_, stream=cs))
            ev = rt.event(("chunk", ci)) if prologue else None
            # (start, rows, the bound counter wait, the bound all-reduce, the chunk's event, the bound post)
            rows_all.append((start, rows, _flags.bound_wait_value(cs, w1.flags, ci, p1.counts[ci]), reduce, ev,
                             _flags.bound_write_value(post_on, w2.flags, ci, 1)))
        self.chunks = tuple(rows_all)
        self.norm_args = (norm.kind if norm else None, norm.eps if norm else 1e-5)
        self.gp1 = gemm_plan(p1.launches, a, b, c1, p1.table, flags=w1.flags, err=err.word, timeout_ns=1,
                             counter=w1.counters, rank=rt.rank, config=p1.gemm, post=True, groups=p1.groups)
        self.gp2 = gemm_plan(p2.launches, y, b_next, c, p2.table, flags=w2.flags, err=err.word,
                             timeout_ns=timeout_ns, counter=w2.counters, rank=rt.rank, config=p2.gemm, wait=True,
                             split=p2.split, groups=p2.groups)
        self.kn1, self.kn2 = getattr(self.gp1, "b_kn", True), getattr(self.gp2, "b_kn", True)
        self.bound, self.whole = False, False
        self.bl_norm: tuple = ()
        self.bl1 = self.bl_gate = self.bl2 = self.bl_back = None

    def _tensors(self, h: torch.Tensor, y: torch.Tensor, residual: Any, norm: Any) -> tuple:
        return (h, residual if residual is not None else h, y if self.has_norm else h,
                norm.weight if norm is not None else h, norm.bias if norm is not None and norm.bias is not None else h)

    def _bind_launches(self, a: Any, b: Any, b_next: Any, c1: Any, h: Any, y: Any, c: Any, residual: Any,
                       norm: Any) -> None:
        from ..kernels import gate as _gate
        from ..kernels.add_norm import bind_add_norm

        self.bound = True
        b1, b2 = _calls.gemm_bind(self.gp1), _calls.gemm_bind(self.gp2)
        if b1 is None or b2 is None:
            return
        if self.prologue:
            kind, eps = self.norm_args
            bl_norm = tuple(bind_add_norm(h, start, rows, residual=residual, norm=kind,
                                          weight=norm.weight if norm else None, bias=norm.bias if norm else None,
                                          eps=eps, y=y if norm is not None else None)
                            for start, rows, *_ in self.chunks)
            if any(bl is None for bl in bl_norm):
                return
            self.bl_norm = bl_norm
        if self.gated:
            self.bl_gate = _gate.bind_gate(self.words[1].flags, 0, 1, 3, self.err.word, rank=self.rt.rank,
                                           timeout_ns=self.timeout_ns)
            if self.bl_gate is None:
                return
        self.bl1 = b1(a, b, c1, epoch=1, grid=self.p1.grid)
        self.bl2 = b2(y, b_next, c, epoch=1, grid=self.p2.grid)
        if self.p2.give_back_grid:
            self.bl_back = b2(y, b_next, c, epoch=1, grid=self.p2.give_back_grid)
        self.whole = self.bl1 is not None and self.bl2 is not None and \
            (self.bl_back is not None or not self.p2.give_back_grid)

    def run(self, raw: int, cur: Any, a: torch.Tensor, b: torch.Tensor, b_next: torch.Tensor,
            residual: Any, norm: Any) -> Any:
        m, n, cs, ns = self.m, self.n, self.cs, self.ns
        c1 = a.new_empty((self.p1.cmap.c_rows, n))
        h = a.new_empty((m, n))
        y = torch.empty_like(h) if self.has_norm else h
        c = a.new_empty((m, self.n2))
        whole = self.whole and not (c1.data_ptr() % 16 or c.data_ptr() % 16)
        if whole:
            self.bl1(raw, (a, None, b if self.kn1 else b.t(), c1, None, None))
            t_norm = self._tensors(h, y, residual, norm) if self.prologue else None
        else:
            gp1 = self.gp1
            gp1.launch(gp1.operands(a, b), c1, epoch=1, grid=self.p1.grid)
        for i, (start, rows, wait, reduce, ev, post) in enumerate(self.chunks):
            wait()  # every tile of the chunk stored
            reduce(c1[start:start + rows], h[start:start + rows])
            if ev is not None:
                self.rec(ev, cs)
                self.wait(ev, ns)
                if whole:
                    self.bl_norm[i](ns.cuda_stream, t_norm)
                else:
                    _ar.body_add_norm(ns, cur, h, start, rows, residual, norm, self.norm_args, y)
            post()
        last = ns if self.prologue else cs
        if whole:
            t = (y, None, b_next if self.kn2 else b_next.t(), c, None, None)
            if self.bl_gate is not None:
                self.bl_gate(raw, ())
            self.bl2(raw, t)
            if self.bl_back is not None:
                self.bl_back(last.cuda_stream, t)
        else:
            gp2, p2 = self.gp2, self.p2
            descs = gp2.operands(y, b_next)
            if self.gated:
                from ..kernels import gate as _gate

                _gate.launch_gate(self.words[1].flags, 0, 1, 3, self.err.word, rank=self.rt.rank,
                                  timeout_ns=self.timeout_ns)
            gp2.launch(descs, c, epoch=1, grid=p2.grid)
            if p2.give_back_grid:
                with on_stream(last, cur):
                    gp2.launch(descs, c, epoch=1, grid=p2.give_back_grid)
            if not self.bound:
                self._bind_launches(a, b, b_next, c1, h, y, c, residual, norm)
        stats["fused"] += 1
        return c, h

    def fused(self, a: torch.Tensor, b: torch.Tensor, b_next: torch.Tensor, residual: torch.Tensor | None,
              norm: Any) -> Any:
        """The call as the fused body runs it (what a plan graph captures)."""
        return _fused(self.rt, a, b, b_next, residual, norm, self.cfg)

    def __repr__(self) -> str:
        return (f"{OP} body: M {self.m}, N {self.n}, K/R {self.k}, N2 {self.n2}, {len(self.chunks)} chunk(s) on "
                f"NCCL ({self.p1.nccl_ctas} CTAs), producer grid {self.p1.grid}, consumer grid {self.p2.grid}"
                + (f" + give-back {self.p2.give_back_grid}" if self.p2.give_back_grid else "")
                + (", gate first" if self.gated else "") + f", launches {'bound' if self.whole else 'general'}, "
                f"wait bound {self.timeout_ns / 1e6:g} ms, check {self.check!r}")


def _fused(rt: Runtime, a: torch.Tensor, b: torch.Tensor, b_next: torch.Tensor, residual: torch.Tensor | None,
           norm: Any, cfg: OverlapConfig) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = a.shape
    n, n2 = b.shape[1], b_next.shape[1]
    p1 = _mr._plan(rt, "matmul_all_reduce", m, n, k, cfg)
    p2 = _ar._plan(rt, m, n2, n, cfg)
    if tuple(p1.cmap.chunk_rows) != tuple(p2.chunk_rows):  # both split M the same way (split_rows)
        raise RuntimeError(f"{OP}: the producer's chunks {p1.cmap.chunk_rows} and the consumer's "
                           f"{p2.chunk_rows} differ")
    comm = rt.comm(p1.nccl_ctas)
    err = rt.err(OP)
    timeout_ns = int((cfg.timeout_ms or _flags.default_timeout_ms(rt.group)) * 1e6)
    prologue = residual is not None or norm is not None
    chunks = len(p1.cmap.chunk_rows)
    cs, ns = rt.comm_stream, rt.aux_stream
    # the producer's dispatch counter and per-chunk counts; the consumer's counters and
    # per-chunk flags: zeroed on the caller's stream before the side streams fork
    with fused_call(rt, err, cfg.check, (cs, ns) if prologue else (cs,), (OP + ".producer", 1, chunks),
                    (OP + ".consumer", p2.counters, chunks)) as (cur, (w1, w2)):
        c1 = a.new_empty((p1.cmap.c_rows, n))  # the partial products, all-reduced in place
        h = a.new_empty((m, n))
        y = torch.empty_like(h) if norm is not None else h
        c = a.new_empty((m, n2))
        gp1 = gemm_plan(p1.launches, a, b, c1, p1.table, flags=w1.flags, err=err.word, timeout_ns=1,
                        counter=w1.counters, rank=rt.rank, config=p1.gemm, post=True, groups=p1.groups)
        with gpu_range("gemm", "producer"):
            gp1.launch(gp1.operands(a, b), c1, epoch=1, grid=p1.grid)
        for ci, (start, rows) in enumerate(zip(p1.cmap.chunk_starts, p1.cmap.chunk_rows)):
            with gpu_range("comm", "chunk", ci):
                wait_count(cs, w1.flags, ci, p1.counts[ci], err, rt.rank, timeout_ns)  # every tile of the chunk stored
                comm.all_reduce(c1[start:start + rows], h[start:start + rows], stream=cs)
            _ar.chunk_ready(cur, cs, ns if prologue else None, h, y, start, rows, residual, norm, w2.flags, ci,
                            rt.event(("chunk", ci)) if prologue else None)
        gp2 = gemm_plan(p2.launches, y, b_next, c, p2.table, flags=w2.flags, err=err.word, timeout_ns=timeout_ns,
                        counter=w2.counters, rank=rt.rank, config=p2.gemm, wait=True, split=p2.split,
                        groups=p2.groups)
        descs = gp2.operands(y, b_next)
        _ar.gate(w2.flags, err, rt.rank, timeout_ns)  # the consumer grid is not resident while chunk 0 is late
        with gpu_range("gemm", "consumer"):
            gp2.launch(descs, c, epoch=1, grid=p2.grid)  # behind the producer grid on this stream
        if p2.give_back_grid:
            with on_stream(ns if prologue else cs, cur), gpu_range("giveback", "grid"):
                gp2.launch(descs, c, epoch=1, grid=p2.give_back_grid)
    stats["fused"] += 1
    return c, h


def _shared_gpu(a: torch.Tensor, b: torch.Tensor, b_next: torch.Tensor, group: Any, residual: torch.Tensor | None,
                norm: Any, config: OverlapConfig | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared-GPU mode (``overlap.dist.shared``): the pipeline runs on NCCL, which refuses
    ranks that share a GPU, so the op runs as its two halves: ``h`` by ``matmul_all_reduce``
    (its GEMM overlapped with the all-reduce on the peer-copy transport; it refuses
    ``transport='nccl'`` with the mode's error, and a capture), then ``norm(h) @ b_next`` on
    this rank alone, where no communication is left to hide. The reference's arithmetic."""
    h = _mr.matmul_all_reduce(a, b, group=group, residual=residual, config=config)
    y = norm.apply(h) if norm is not None else h
    stats["shared_gpu"] += 1
    return y @ b_next, h


def _nccl(cfg: OverlapConfig, chunks: int) -> OverlapConfig:
    """``cfg`` on the NCCL transport with ``chunks``: a config with no transport named may
    carry the peer-copy all-reduce's options (they apply where a call picks that
    transport); this op has none of them, so they are dropped, not refused."""
    return dataclasses.replace(cfg, chunks=chunks, transport="nccl", reduce_ctas=None, reduce_shared=False,
                               two_shot=False, fold_norm=False)


def _tuned(rt: Runtime) -> LRU:
    """The tuner's picks on ``rt`` by shape, layouts, dtype, residual and norm, the 256 most
    recently used."""
    return rt.cache("boundary.tuned", 256)


def _tune_key(a: torch.Tensor, b: torch.Tensor, b_next: torch.Tensor, residual: torch.Tensor | None,
              norm: Any) -> tuple:
    return (tuple(a.shape), b.shape[1], b_next.shape[1], a.dtype, b.stride(), b_next.stride(),
            residual is not None, _ar._norm_code(norm))


def tune_matmul_all_reduce_matmul(a: torch.Tensor, b: torch.Tensor, b_next: torch.Tensor, *, group: Any = None,
                                  residual: torch.Tensor | None = None, norm: Any = None,
                                  candidates: list[OverlapConfig] | None = None, iters: int = 10,
                                  verbose: bool = False) -> Path:
    """Time the pipeline's configs (chunks x NCCL CTA caps, or ``candidates``) against the
    sequential reference (matmul, all-reduce, add, norm, matmul), collectively (every rank
    calls it with the same shapes); cache the fastest for this shape, which
    ``matmul_all_reduce_matmul`` then takes when called without a config. Returns the
    ``OverlapConfig`` or ``SEQUENTIAL`` (the op then runs the reference for this shape,
    warning once). Inputs with no tile-flag path return ``SEQUENTIAL`` untimed."""
    _check(a, b, b_next, residual, norm)
    for c in candidates or ():
        if c.transport == "p2p":
            raise ValueError(f"{OP}: a candidate on the peer-copy transport ({c}); the op runs on NCCL only")
    group = resolve_group(group)
    m, k = a.shape
    n, n2 = b.shape[1], b_next.shape[1]
    esize = a.element_size()
    if (not a.is_cuda or a.dtype not in (torch.float16, torch.bfloat16)
            or any((v * esize) % 16 for v in (k, n, n2))):
        return SEQUENTIAL  # no tile-flag path for these inputs: nothing to tune
    rt = get_runtime(group, a.device)
    a = a.contiguous()
    res, nrm = _ar._contiguous(None if residual is None else residual.contiguous(), norm)

    def ref() -> Any:
        return matmul_all_reduce_matmul_ref(a, b, b_next, group=group, residual=residual, norm=norm)

    if candidates is None:
        candidates = [OverlapConfig(chunks=ch, nccl_ctas=ct, transport="nccl") for ch in (2, 4, 8) for ct in (8, 16)]
    candidates = [_nccl(c, c.chunks or _mr._default_chunks(m)) for c in candidates]
    def run(cand: OverlapConfig) -> Any:
        return _fused(rt, a, b, b_next, res, nrm, cand)

    def describe(cand: OverlapConfig) -> str:
        return f"  tune {OP} {m}x{n}x{k}->{n2}: nccl, {cand.chunks} chunks, {cand.nccl_ctas or 16} ctas"

    return tune_paths(rt, OP, (m, n2, n), f"{OP} {m}x{n}x{k}->{n2}", ref=ref, candidates=candidates, run=run,
                      describe=describe, iters=iters, group=group, verbose=verbose, cache=_tuned(rt),
                      key=_tune_key(a, b, b_next, residual, norm))
