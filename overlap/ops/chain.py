"""Intra-GPU producer -> consumer chain through tile flags: ``y = act(x @ w1) @ w2``.

The seed's own case (cuSync, Jangda et al., CGO 2024): the MLP of a GPT layer
on one GPU, two GEMMs in two kernels on two streams. A consumer (fc2) tile
of row block i needs every producer (fc1) tile of row block i (RowSync):

    producer  (high-priority stream): tiles of mid = act(x @ w1), groups of row
              blocks in order; each tile, once stored, adds 1 to flags[row block]
    consumer  (current stream):       tiles of y = mid @ w2, groups of row blocks
              in order; a tile of row block i waits until
              flags[i] >= epoch * (N tiles of mid)

Each GEMM's tiles run in its config's ``group_m`` order (``build_tile_table``):
``group_m`` row blocks sweep the N tiles together, so a wave shares B's columns
through L2; with ``group_m`` 1 a row block's tiles come before the next's, so the
first row blocks are done soonest but every wave reads all of B (at M = 1024 with
64-row tiles, 1.5x the time of the grouped order:
benchmarks/results/2026-12-02_1xH200_89b319c). ``tune_mlp_chain`` tries both.

With stream order instead, fc2 waits for the last fc1 tile: the SMs that run
out of fc1 tiles in its last wave idle until the whole kernel ends, then fc2
ramps up. With flags, fc2 tiles start on those SMs as soon as their row block
is done.

Speed: the consumer is enqueued behind a stream wait (no SM) on a flag the
producer's grid sets as it starts, so the producer's programs take the SMs
first and consumer programs move in as producer programs run out of tiles.
Without it, a consumer grid dispatched first holds every SM but the reserved
ones while the producer crawls on those (many times slower: docs/experiments.md).

No deadlock, whichever kernel the GPU schedules first. Both kernels hand out
tiles in order from an atomic counter (a program holds no tile until it runs),
the producer never waits on anything, and the consumer's grid leaves
``reserve_sms`` SMs (at least one) that its programs never occupy. Whatever the
order, a producer program finds an SM and every producer tile is done by the
programs that run; consumer tiles then find their flags set. Launched consumer
first, the producer runs on the reserved SMs only until consumer programs
finish (slow, never stuck); tests launch it that way on purpose. Under
``launch="pdl"`` the consumer is launched only once every producer program has
started (each triggers the launch as it begins), so no consumer program can take an
SM a producer program still needs, and the producer's programs, all running, take
their tiles statically; the consumer's programs end with a wait for the producer's
grid (``griddepcontrol.wait``), so work queued behind the consumer comes after both,
even when a failed wait let consumer tiles skip theirs.

fc2 runs on the GEMM engine the consumer ops take (``overlap.kernels.engine``): under
RowSync with ``launch="streams"`` the warp-specialized Gluon GEMM where it runs on this GPU
and measured faster at fc2's first launch, else (TileSync, PDL, or slower) the tile GEMM.
The argument above holds for both: the Gluon GEMM's loader warp takes tiles from the same
counter (one ahead of its MMA warps, which never spin) and its waits are bounded alike.

One hazard is outside the kernels: loading a kernel's module (CUDA loads
modules lazily, Triton on first launch) waits while a spinning kernel holds
the GPU. Enqueued first, a consumer therefore times out if the producer's
kernel was never launched before; in the normal order the producer
is loaded and running before the consumer spins.

Flags are never reset (epochs); every wait inside the kernels is bounded and a
timeout raises ``overlap.flags.FlagTimeoutError``. The stream wait of the start
gate has no bound of its own: it waits on the producer's launch, and the
producer depends on nothing but work already queued before it.

``ChainConfig(launch="pdl")`` (Hopper): both kernels on the caller's stream, the consumer
a programmatic dependent launch of the producer. Every producer program triggers it as
it starts, so the consumer is launched once all producer programs hold their SMs (what
the start gate does, without a second stream, the stream wait and the join); its reads
of fc1's rows are ordered by the flags alone. The producer takes its tiles statically
then (no counter), and the consumer's programs end with a wait for the producer's grid
(``griddepcontrol.wait``), so none of the producer's writes can come after the consumer
ends, even when a recorded failure let consumer tiles skip their waits. Faster than the
two streams on 11 and 10 of 12 MLP shapes in two runs, by up to 10%
(benchmarks/results/2026-12-02_1xH200_76bcb2b, ``..._6fdfb5b``, both before the wait at
the consumer's end was added); ``tune_mlp_chain`` tries both.

Two sync policies (``ChainConfig.sync``, cuSync's names):

    "row"   RowSync: a consumer tile waits once, before its K loop, for every
            producer tile of its row block (one counted flag per row block)
    "tile"  TileSync: a consumer tile's K loop runs in groups of K steps, one group
            per producer tile of its row block, each group waiting on that producer
            tile's own flag. The wait sits between two K loops, so no load of a
            group is issued before its wait (each group's software pipeline starts
            after it); the price is a pipeline restart per group

Producer tiles of a row block run side by side and finish at about the same time,
so TileSync gains little over RowSync here; both are measured in the benchmarks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from .. import flags as _flags
from .._fields import choice_field, float_field, int_field
from ..observe import gpu_range
from . import _calls, _graphs
from ._agree import check_dtype, named
from ._calls import aligned, grad_refused, tensor_key
from ._runtime import (MAX_SMS, MAX_TIMEOUT_MS, MIN_TIMEOUT_MS, check_gemm_field)
from ._runtime import (LRU, OverlapCaptureError, Runtime, capturing, env_sm_margin, gemm_plan, keep_for_capture,
                       local_runtime, local_runtime_if_made, observed, on_stream, refuse_grad, report_errors,
                       serial_phases, warn_once)

__all__ = ["ChainConfig", "mlp_chain", "mlp_chain_stream_sync", "mlp_chain_ref", "tune_mlp_chain", "stats"]

stats: dict[str, int] = {"fused": 0, "stream_sync": 0, "reference": 0}
"""How many calls took each path."""

_ACTS = (None, "gelu")


def _default_gemm() -> Any:
    from ..kernels.tile_gemm import DEFAULT_CONFIG

    return DEFAULT_CONFIG


@dataclass(frozen=True, kw_only=True)
class ChainConfig:
    """How the chain runs. Producer and consumer share BLOCK_M (RowSync maps row block to row block)."""

    producer: Any = None
    """GemmConfig of fc1; None: the default (128x256x64)."""
    consumer: Any = None
    """GemmConfig of fc2; None: the producer's."""
    reserve_sms: int = 1
    """SMs the consumer's grid leaves to the producer (>= 1: the no-deadlock argument needs one)."""
    timeout_ms: float | None = None
    """Bound of one consumer tile's wait; None: ``overlap.flags.default_timeout_ms()``
    (``OVERLAP_WAIT_TIMEOUT_MS``, else ``overlap.dist``'s or torch's process-group timeout:
    minutes, so that a producer held back by other work on the GPU is waited for)."""
    check: str = "async"
    """'sync', 'async' or 'none', as in ``OverlapConfig``."""
    sync: str = "row"
    """'row' (RowSync) or 'tile' (TileSync); see the module docstring."""
    launch: str = "streams"
    """How the consumer's grid gets its SMs after the producer's. 'streams': the producer on
    the runtime's high-priority aux stream, the consumer on the caller's behind a stream
    wait on the producer's start flag (see the module docstring). 'pdl': both on the
    caller's stream, the consumer as a programmatic dependent launch that starts once every
    producer program runs (Hopper or later: ``overlap.kernels.tile_gemm.pdl_supported``)."""

    def __post_init__(self) -> None:
        o = "ChainConfig"
        check_gemm_field(o, "producer", self.producer)
        check_gemm_field(o, "consumer", self.consumer)
        # >= 1: the producer needs an SM
        int_field(o, "reserve_sms", self.reserve_sms, 1, MAX_SMS)
        float_field(o, "timeout_ms", self.timeout_ms, MIN_TIMEOUT_MS, MAX_TIMEOUT_MS, none_ok=True)
        choice_field(o, "check", self.check, ("sync", "async", "none"))
        choice_field(o, "sync", self.sync, ("row", "tile"))
        choice_field(o, "launch", self.launch, ("streams", "pdl"))
        p = self.producer or _default_gemm()
        c = self.consumer or p
        if p.tail_block_m or c.tail_block_m:
            raise ValueError("GemmConfig.tail_block_m/n is for the GEMM alone (launch_gemm), not the chain's GEMMs")
        if p.flatten or c.flatten:
            raise ValueError("GemmConfig.flatten is not for the chain's GEMMs (their tiles are handed out one by one "
                             "from a counter); use flatten=False")
        if p.block_m != c.block_m:
            raise ValueError(f"producer and consumer must share block_m ({p.block_m} != {c.block_m})")
        if self.sync == "tile" and p.block_n % c.block_k:
            raise ValueError(f"TileSync needs the consumer's block_k ({c.block_k}) to divide the producer's "
                             f"block_n ({p.block_n})")


OP = "mlp_chain"


def _runtime(device: torch.device) -> Runtime:
    """The chain's state on ``device``: the device's local runtime (``_runtime.local_runtime``).
    The producer runs on its high-priority aux stream; its error word, local flag words and
    eager signatures (``Runtime.seen``) are the op's ``OP``; its tables and tuned configs are
    caches of it (``_tables_of``, ``_tuned``). ``overlap.dist.shutdown`` drops it all."""
    rt = local_runtime_if_made(device)
    if rt is None:
        if capturing():
            raise OverlapCaptureError("mlp_chain: call it once outside the CUDA graph capture first")
        rt = local_runtime(device)
    return rt


def _tables_of(rt: Runtime) -> LRU:
    """Tile tables on ``rt`` by shape and config, the 64 most recently used (a new M builds new ones)."""
    return rt.cache("mlp_chain.tables", 64)


def _consumers(rt: Runtime, key: tuple) -> LRU:
    """The consumer GEMM's plans (``_runtime.gemm_plan``: the tile GEMM's, or an engine plan
    that measures it against the Gluon GEMM at its first launch) for the chain tables of
    ``key``, by the flag and counter words they wait on and count with."""
    plans = rt.cache("mlp_chain.consumers", 64)
    got = plans.get(key)
    if got is None:
        got = plans[key] = LRU(8)
    return got


def _tuned(rt: Runtime) -> LRU:
    """The tuner's picks on ``rt`` (``tune_mlp_chain``, ``_tune_key``), the 256 most recently used."""
    return rt.cache("mlp_chain.tuned", 256)


def _tune_key(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation: str | None) -> tuple:
    from ..kernels.tile_gemm import b_operand

    return (tuple(x.shape), w1.shape[1], w2.shape[1], x.dtype, b_operand(w1)[1], b_operand(w2)[1], activation)


def _check_inputs(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation: str | None) -> None:
    for name, t in (("x", x), ("w1", w1), ("w2", w2)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{OP}: {name} must be a tensor, got {type(t).__name__}")
    if x.dim() != 2 or w1.dim() != 2 or w2.dim() != 2:
        raise ValueError(f"{OP}: x [M, K], w1 [K, F] and w2 [F, N] must be 2-D; got {tuple(x.shape)}, "
                         f"{tuple(w1.shape)}, {tuple(w2.shape)}")
    if x.shape[1] != w1.shape[0]:
        raise ValueError(f"{OP}: K mismatch: x is {tuple(x.shape)}, w1 is {tuple(w1.shape)}")
    if w1.shape[1] != w2.shape[0]:
        raise ValueError(f"{OP}: F mismatch: w1 is {tuple(w1.shape)}, w2 is {tuple(w2.shape)}")
    check_dtype(OP, "x", x.dtype)
    if not (x.dtype == w1.dtype == w2.dtype):
        raise TypeError(f"{OP}: dtype mismatch: x {x.dtype}, w1 {w1.dtype}, w2 {w2.dtype}")
    if not (x.device == w1.device == w2.device):
        raise ValueError(f"{OP}: device mismatch: x on {x.device}, w1 on {w1.device}, w2 on {w2.device}")
    if x.numel() == 0 or w1.numel() == 0 or w2.numel() == 0:
        raise ValueError(f"{OP}: empty operand: x {tuple(x.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
    if activation not in _ACTS:
        raise ValueError(f"{OP}: activation must be one of {_ACTS}, got {activation!r}")


def mlp_chain_ref(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *,
                  activation: str | None = "gelu") -> torch.Tensor:
    """torch: ``act(x @ w1) @ w2`` (cuBLAS and torch's GeLU)."""
    _check_inputs(x, w1, w2, activation)
    mid = x @ w1
    if activation == "gelu":
        mid = torch.nn.functional.gelu(mid)
    stats["reference"] += 1
    return mid @ w2


def _tables(rt: Runtime, m: int, f: int, n: int, cfg: ChainConfig) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """Producer and consumer tables, the number of flags they share, the count a
    wait needs (``mult``: producer tiles per row block under RowSync, 1 under TileSync)
    and the consumer's ``k_wait``. A call zeroes the flags first, so a flag holds that
    count exactly once its row block (or tile) is stored."""
    from ..policies import rowsync_chain_tables, table_tensor, tilesync_chain_tables

    pc = cfg.producer or _default_gemm()
    cc = cfg.consumer or pc
    key = (m, f, n, pc, cc, cfg.sync)
    tables = _tables_of(rt)
    t = tables.get(key)
    if t is None:
        if capturing():
            raise OverlapCaptureError(f"mlp_chain: M={m}, F={f}, N={n} with this config has not run outside a CUDA "
                                      "graph capture yet; call it once before capturing it")
        if cfg.sync == "tile":
            prod, cons, pol = tilesync_chain_tables(m, f, n, pc.block_m, pc.block_n, cc.block_n, cc.block_k,
                                                    array=True, prod_group_m=pc.group_m, cons_group_m=cc.group_m)
            n_flags, mult, k_wait = -(-m // pc.block_m) * pol.producer_n_tiles, 1, pol.k_wait
        else:
            prod, cons = rowsync_chain_tables(m, f, n, pc.block_m, pc.block_n, cc.block_n, array=True,
                                              prod_group_m=pc.group_m, cons_group_m=cc.group_m)
            n_flags, mult, k_wait = -(-m // pc.block_m), -(-f // pc.block_n), 0
        t = (table_tensor(prod, rt.device), table_tensor(cons, rt.device),
             n_flags + 1, mult, k_wait)  # + the producer's start flag
        tables[key] = t
    # a captured call's kernels read these tables on every replay: never freed
    return keep_for_capture(t)


def _validate_cuda(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> None:
    """Everything the tile kernels would refuse, checked before any work is queued
    (a refusal between the two launches would leave the producer running unjoined)."""
    from ..kernels.tile_gemm import check_b, check_tma

    esize = x.element_size()
    for name, v in (("K", x.shape[1]), ("F", w1.shape[1]), ("N", w2.shape[1])):
        if (v * esize) % 16:
            raise ValueError(f"mlp_chain: {name}={v} must be a multiple of {16 // esize} for {x.dtype} "
                             "(16-byte rows for TMA)")
    check_tma("x", x.contiguous())
    check_b(w1)
    check_b(w2)


def _takes_fast_path(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


def mlp_chain_stream_sync(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *,
                          activation: str | None = "gelu", config: ChainConfig | None = None) -> torch.Tensor:
    """The same two GEMMs as ``mlp_chain``, one after the other on the current stream, each
    over every SM (no flags): the stream-synchronized baseline. fc2 runs on the engine
    ``mlp_chain``'s fc2 took (``overlap.kernels.engine``; ``EnginePlan.follow``) where the
    chain ran first with this config; else on the one measured for it alone."""
    from ..kernels.tile_gemm import launch_tile_gemm

    _check_inputs(x, w1, w2, activation)
    if not _takes_fast_path(x):
        return mlp_chain_ref(x, w1, w2, activation=activation)
    _validate_cuda(x, w1, w2)
    rt = _runtime(x.device)
    cfg = config or _tuned(rt).get(_tune_key(x, w1, w2, activation)) or ChainConfig()
    x = x.contiguous()
    m, f, n = x.shape[0], w1.shape[1], w2.shape[1]
    prod, cons, _, _, _ = _tables(rt, m, f, n, cfg)
    pc = cfg.producer or _default_gemm()
    mid = x.new_empty((m, f))
    y = x.new_empty((m, n))
    # as serial phases the two GEMMs' alone-times, for the report's hidden fraction of the
    # fused chain (the producer in the communication's part)
    tm = serial_phases("mlp_chain", (m, x.shape[1], f, n), "stream-sync", x.device)
    if tm:
        tm.start("comm")
    launch_tile_gemm(x, w1, mid, prod, grid=rt.num_sms, config=pc, activation=activation)
    if tm:
        tm.stop("comm")
        tm.start("gemm")
    # fc2 on the engine the chain's consumer took (the same GEMM, without waits), where the
    # chain ran first; else on the one measured for it
    cc = cfg.consumer or pc
    gp = gemm_plan(_consumers(rt, (m, f, n, pc, cc, cfg.sync, "stream-sync")), mid, w2, y, cons, flags=cons,
                   err=cons, timeout_ns=0, config=cc)  # (no waits: flags and error word never read)
    if not getattr(gp, "decided", True):
        for lead in list(_consumers(rt, (m, f, n, pc, cc, cfg.sync)).values()):
            if getattr(lead, "decided", False) and gp.follow(lead):
                break
    gp.launch(gp.operands(mid, w2), y, epoch=0, grid=rt.num_sms)
    if tm:
        tm.stop("gemm")
        tm.commit()
    stats["stream_sync"] += 1
    return y


def mlp_chain(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *, activation: str | None = "gelu",
              config: ChainConfig | None = None, sync: str | None = None) -> torch.Tensor:
    """``act(x @ w1) @ w2`` on one GPU, the fc2 tiles of a row block starting as
    soon as that row block of fc1 is stored (RowSync), or each K group of an fc2
    tile as soon as the one fc1 tile it reads is stored (TileSync).

    ==========  ======  ==================================================
    tensor      shape   meaning
    ==========  ======  ==================================================
    x           [M, K]  activations
    w1          [K, F]  ``fc1.weight.t()`` (no copy) or row-major
    w2          [F, N]  ``fc2.weight.t()`` (no copy) or row-major
    returns     [M, N]
    ==========  ======  ==================================================

    fp16 / bf16 on CUDA take the tile-flag path; other inputs run
    ``mlp_chain_ref`` with a one-time warning. ``sync`` ("row" or "tile")
    overrides the config's (or the tuned config's) policy.
    """
    out = _planned(x, w1, w2, activation, config, sync)
    if out is not None:
        return out
    return _mlp_chain(x, w1, w2, activation=activation, config=config, sync=sync)


def _call_key(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation: str | None, cfg: ChainConfig,
              given: bool, tuned: bool) -> tuple:
    """A call's signature for its ``CallPlan`` (``_calls``): everything the full path's
    checks and decisions read, but the pointers (checked per call)."""
    return (tensor_key(x), tensor_key(w1), tensor_key(w2), activation, cfg, given, tuned)


@named(OP)
def _planned(x: Any, w1: Any, w2: Any, activation: str | None, config: ChainConfig | None,
             sync: str | None) -> Any:
    """The call run from its signature's ``CallPlan`` (``_calls``: made by the signature's
    first call once it returned), or None where it has none or needs the full path (a
    capture, autograd, an unaligned pointer, a tuned pick stored since). A plan of this
    op has no rank agreement (one GPU); where the host sets the pace its fused body is
    captured as a plan graph (``_graphs``) and replayed per call."""
    if not (isinstance(x, torch.Tensor) and isinstance(w1, torch.Tensor) and isinstance(w2, torch.Tensor)) \
            or not x.is_cuda:
        return None
    if capturing() or grad_refused(x, w1, w2):
        return None
    ikey = (OP, id(config), tensor_key(x), tensor_key(w1), tensor_key(w2), activation, sync)
    hit = _calls.index_lookup(ikey, None, config)
    if hit is not None:
        rt, cp, cfg, _ = hit
    else:  # the full lookup, indexed where it finds a plan
        if x.dim() != 2 or w1.dim() != 2 or w2.dim() != 2 or sync not in (None, "row", "tile") \
                or (config is not None and not isinstance(config, ChainConfig)):
            return None  # the full path's checks say what is wrong
        gen, env = _calls.generation(), _calls.transport_env()
        rt = local_runtime_if_made(x.device)
        if rt is None:
            return None
        tuned = tcache = tkey = None
        if config is None:
            tcache, tkey = _tuned(rt), _tune_key(x, w1, w2, activation)
            tuned = tcache.get(tkey)
        cfg = config or tuned or ChainConfig()
        if sync is not None and sync != cfg.sync:
            cfg = dataclasses.replace(cfg, sync=sync)
        key = _call_key(x, w1, w2, activation, cfg, config is not None, tuned is not None)
        cp = _calls.find(rt, OP, key)
        if cp is None:
            return None
        _calls.index(ikey, gen, None, config, env, rt, cp, cfg, "local", tcache if tuned is not None else None,
                     tkey, key)
    if not aligned(x, w1, w2):
        return None
    _calls.stats["planned"] += 1
    body = cp.body
    if body is None:
        body = cp.body = _Body(rt, cfg, activation, cp.shape)
    fused0 = stats["fused"]
    out = _graphs.replay_or_capture(rt, cp, body, (x, w1, w2))
    if out is not _graphs.NO:
        if stats["fused"] == fused0:  # a replay (a capture, or the fused body run instead, counted itself)
            stats["fused"] += 1
        return out
    return observed(OP, cp.shape, cp.path, cp.why, x.device, _fused, rt, x, w1, w2, activation, cfg, False, 0)


class _Body:
    """What a plan graph (``_graphs``) needs of a chain's call plan: its fused body
    (``_fused`` with the plan's config and activation), the argument it copies in per call
    (x; the weights are read in place), its GEMM flops, its error word and check."""

    moving = (0,)

    def __init__(self, rt: Runtime, cfg: ChainConfig, activation: str | None, shape: tuple[int, ...]) -> None:
        m, k, f, n = shape
        self.rt, self.cfg, self.activation = rt, cfg, activation
        self.flops = 2 * m * f * (k + n)
        self.err, self.check = rt.err(OP), cfg.check

    def fused(self, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return _fused(self.rt, x, w1, w2, self.activation, self.cfg, False, 0)

    def __repr__(self) -> str:
        return f"mlp_chain body ({self.cfg.sync} sync, {self.cfg.launch})"


@named(OP)
def _mlp_chain(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *, activation: str | None = "gelu",
               config: ChainConfig | None = None, sync: str | None = None, consumer_first: bool = False,
               producer_delay_cycles: int = 0) -> torch.Tensor:
    """``mlp_chain`` with its test hooks: ``consumer_first`` enqueues the consumer before
    the producer (the order must not matter), ``producer_delay_cycles`` holds the producer
    back on its stream for that many GPU cycles first (``torch.cuda._sleep``)."""
    _check_inputs(x, w1, w2, activation)
    refuse_grad("mlp_chain", x, w1, w2)
    if sync not in (None, "row", "tile"):
        raise ValueError(f"{OP}: sync must be 'row' or 'tile', got {sync!r}")
    if config is not None and not isinstance(config, ChainConfig):
        raise TypeError(f"{OP}: config must be a ChainConfig or None, got {type(config).__name__}")
    if not _takes_fast_path(x):
        warn_once(f"chain-ref-{x.device.type}-{x.dtype}",
                  f"mlp_chain: no tile-flag path for {x.dtype} on {x.device.type}; running torch")
        why = "no GPU" if not x.is_cuda else f"dtype {x.dtype}"
        return observed("mlp_chain", (x.shape[0], x.shape[1], w1.shape[1], w2.shape[1]), "reference", why, x.device,
                        lambda: mlp_chain_ref(x, w1, w2, activation=activation))
    _validate_cuda(x, w1, w2)
    rt = _runtime(x.device)
    tuned = None if config is not None else _tuned(rt).get(_tune_key(x, w1, w2, activation))
    cfg = config or tuned or ChainConfig()
    if sync is not None and sync != cfg.sync:
        cfg = dataclasses.replace(cfg, sync=sync)
    if not consumer_first and cfg.launch != "pdl" and not _flags._cuda_driver():
        # the start gate needs cuStreamWaitValue32 (cuda-bindings); checked before
        # anything is queued. Without it the kernels still chain correctly, only slower
        warn_once("chain-no-gate", "mlp_chain: cuda-bindings missing (pip install 'overlap[cu13]' or [cu12]); "
                  "running the chain without its start gate")
    why = "config given" if config is not None else ("tuner pick" if tuned is not None else "default config")
    path = f"tile-flag {cfg.sync}" + (" pdl" if cfg.launch == "pdl" and not consumer_first else "")
    shape = (x.shape[0], x.shape[1], w1.shape[1], w2.shape[1])
    out = observed("mlp_chain", shape, path, why, x.device, _fused, rt, x, w1, w2, activation, cfg, consumer_first,
                   producer_delay_cycles)
    if not consumer_first and not producer_delay_cycles:  # returned: later calls of its signature take its plan
        sig = (shape[0], shape[1], shape[2], shape[3], x.dtype, w1.stride(), w2.stride(), activation, cfg, False)
        _calls.keep(rt, _call_key(x, w1, w2, activation, cfg, config is not None, tuned is not None),
                    _calls.CallPlan(OP, (), (), None, sig, shape, path, why, cfg, "local"))
    return out


def _fused(rt: Runtime, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation: str | None,
           cfg: ChainConfig, consumer_first: bool, producer_delay_cycles: int) -> torch.Tensor:
    from ..kernels.tile_gemm import launch_tile_gemm, pdl_supported

    # SMs left free for other work on the GPU (OVERLAP_SM_MARGIN: e.g. data-parallel NCCL)
    margin = env_sm_margin() or 0
    pdl = cfg.launch == "pdl" and not consumer_first
    if pdl and not pdl_supported(x.device):
        raise ValueError("mlp_chain: ChainConfig(launch='pdl') needs programmatic dependent launch (a GPU of "
                         "compute capability 9.0+ and a Triton with gdc_launch_dependents); use launch='streams'")
    if cfg.reserve_sms + margin >= rt.num_sms:
        raise ValueError(f"reserve_sms={cfg.reserve_sms} and OVERLAP_SM_MARGIN={margin} leave no SM for the "
                         f"consumer ({rt.num_sms} SMs)")
    x = x.contiguous()
    m, f, n = x.shape[0], w1.shape[1], w2.shape[1]
    sig = (m, x.shape[1], f, n, x.dtype, w1.stride(), w2.stride(), activation, cfg, consumer_first)  # (a plan's sig)
    if capturing() and (OP, sig) not in rt.seen:
        raise OverlapCaptureError(f"mlp_chain: x {tuple(x.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)} "
                                  f"({x.dtype}) with this config has not run outside a CUDA graph capture yet; call "
                                  "it once with the same shapes, layouts and config before capturing it (that call "
                                  "compiles its kernels and builds its tables)")
    prod, cons, n_flags, mult, k_wait = _tables(rt, m, f, n, cfg)
    err = rt.err(OP)  # made by the first eager call (a signature seen above ran one)
    pc = cfg.producer or _default_gemm()
    cc = cfg.consumer or pc
    timeout_ns = int((cfg.timeout_ms or _flags.default_timeout_ms()) * 1e6)
    order = rt.order
    with order.lock:
        # counters at words 0 and 4 (16 bytes apart: Triton specializes pointers on
        # 16-byte alignment), then the flags; all zeroed by this call first
        w = rt.local_words(OP, 8, n_flags)
        mid = x.new_empty((m, f))
        y = x.new_empty((m, n))
        cur = torch.cuda.current_stream(x.device)
        ps = rt.aux_stream  # the producer's: high priority, so its programs take the SMs first
        order.begin(cur)
        _flags.stream_zero(cur, w.buf, w.buf.numel())
        if not pdl:
            ps.wait_stream(cur)  # the producer must not wait on the consumer
        common = dict(flags=w.flags, err=err.word, epoch=1, timeout_ns=timeout_ns)
        start_idx = n_flags - 1

        def producer() -> None:
            with on_stream(cur if pdl else ps, cur):
                if producer_delay_cycles:
                    torch.cuda._sleep(int(producer_delay_cycles))
                # under PDL the producer takes its tiles statically (no dispatch counter: all
                # its programs run before the consumer launches, and no second grid joins);
                # the consumer's closing griddepcontrol.wait orders the producer's last writes
                # before the work queued behind the consumer (the next call's zeroing)
                launch_tile_gemm(x, w1, mid, prod, grid=rt.num_sms - margin, config=pc, activation=activation,
                                 post=True, counter=None if pdl else w.counters[0:1], start_flag=start_idx,
                                 pdl_trigger=pdl, **common)

        def consumer() -> None:
            grid = rt.num_sms - cfg.reserve_sms - margin
            if pdl:  # (a programmatic dependent launch: the tile GEMM's launch function only)
                launch_tile_gemm(mid, w2, y, cons, grid=grid, config=cc, wait=True, counter=w.counters[4:5],
                                 k_wait=k_wait, pdl_dependent=True, **common)
                return
            # the engine the consumer ops' GEMMs take: the Gluon GEMM where it runs RowSync's
            # waits and measured faster (``overlap.kernels.engine``), else the tile GEMM
            gp = gemm_plan(_consumers(rt, (m, f, n, pc, cc, cfg.sync)), mid, w2, y, cons, flags=w.flags,
                           err=err.word, timeout_ns=timeout_ns, counter=w.counters[4:5], config=cc, wait=True,
                           k_wait=k_wait)
            gp.launch(gp.operands(mid, w2), y, epoch=1, grid=grid)

        try:
            if pdl:
                # one stream: the consumer launched as a programmatic dependent of the
                # producer starts once every producer program runs (so it never holds an
                # SM a producer program still needs); its reads of mid wait on the flags
                with gpu_range("producer", "grid"):
                    producer()
                with gpu_range("gemm", "consumer"):
                    consumer()
            elif consumer_first:
                with gpu_range("gemm", "consumer"):
                    consumer()
                with gpu_range("producer", "grid"):
                    producer()
            else:
                with gpu_range("producer", "grid"):
                    producer()
                # the consumer's grid is dispatched only once the producer's runs (no SM
                # spent spinning while producer programs queue); the stream wait takes no SM
                if _flags._cuda_driver():
                    _flags.stream_wait_value(cur, w.flags, start_idx, 1)
                with gpu_range("gemm", "consumer"):
                    consumer()
        finally:
            # also after an exception: whatever was queued on the producer's stream is
            # ordered before the next call's zeroing, and no record_stream is needed
            # (the caching allocator reuses x, w1 and mid only after this wait on cur)
            if not pdl:
                cur.wait_stream(ps)
            order.end(cur)
        rt.seen.add((OP, sig))
        report_errors(err, cfg.check)  # under the lock, as all_gather_matmul's
    stats["fused"] += 1
    return y


def tune_mlp_chain(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, *, activation: str | None = "gelu",
                   block_ms: tuple[int, ...] = (128, 64), rounds: int = 5, verbose: bool = False) -> ChainConfig:
    """Pick the chain's GEMM configs for this shape and cache them (later calls
    of ``mlp_chain`` and ``mlp_chain_stream_sync`` without a config use them).

    For each BLOCK_M, each GEMM's fastest config alone (``tune_gemm``); that pair in its
    configs' ``group_m`` order and in row-block order (``group_m`` 1: the first row blocks
    done soonest), each with both launches where programmatic dependent launch is taken
    (``ChainConfig.launch``). Every candidate is captured in a CUDA graph and timed by
    its replays, in ``rounds`` interleaved rounds (eager calls would time the host: a
    chain call's host time is about its GPU time at these sizes); the fastest median wins."""
    import statistics

    from ..kernels.autotune import GraphTimer, tune_gemm
    from ..kernels.tile_gemm import b_operand, pdl_supported

    _check_inputs(x, w1, w2, activation)
    if not _takes_fast_path(x):
        return ChainConfig()
    m, k = x.shape
    f, n = w1.shape[1], w2.shape[1]

    def _skip(cfg: ChainConfig, e: Exception) -> None:
        p = cfg.producer
        warn_once(f"chain-tune-timeout-{p.block_m}-{p.group_m}-{cfg.launch}",
                  f"tune_mlp_chain: BLOCK_M {p.block_m} (group_m {p.group_m}, launch {cfg.launch}) timed out "
                  f"({e}); skipped")

    launches = ("streams", "pdl") if pdl_supported(x.device) else ("streams",)
    err = _runtime(x.device).err(OP)
    err.check(block=True)  # an earlier call's unreported failure is the caller's, not a candidate's
    timers: dict[ChainConfig, Any] = {}
    for bm in block_ms:
        pc = tune_gemm(m, f, k, dtype=x.dtype, device=x.device, b_kn=b_operand(w1)[1], block_m=bm)
        cc = tune_gemm(m, n, f, dtype=x.dtype, device=x.device, b_kn=b_operand(w2)[1], block_m=bm)
        pairs = [(pc, cc)]
        if (pc.group_m, cc.group_m) != (1, 1):
            pairs.append((dataclasses.replace(pc, group_m=1), dataclasses.replace(cc, group_m=1)))
        for p, c in pairs:
            for launch in launches:
                cfg = ChainConfig(producer=p, consumer=c, check="none", launch=launch)
                try:
                    # few calls per graph: each captured call keeps its flag words for good
                    timers[cfg] = GraphTimer(lambda cfg=cfg: mlp_chain(x, w1, w2, activation=activation, config=cfg),
                                             max_iters=8)
                    err.check(block=True)
                except _flags.FlagTimeoutError as e:  # a candidate that timed out is skipped, not fatal
                    timers.pop(cfg, None)
                    _skip(cfg, e)
    if any(t.graph is not None for t in timers.values()):
        # a candidate whose capture failed would be timed as eager calls (its host time):
        # not comparable with the others
        timers = {cfg: t for cfg, t in timers.items() if t.graph is not None}
    times: dict[ChainConfig, list[float]] = {cfg: [] for cfg in timers}
    for _ in range(max(1, rounds)):
        for cfg, t in list(timers.items()):
            try:
                times[cfg].append(t.ms())
                err.check(block=True)
            except _flags.FlagTimeoutError as e:
                del timers[cfg], times[cfg]
                _skip(cfg, e)
    if not times:
        raise RuntimeError(f"tune_mlp_chain: every config timed out for {m}x{k}x{f}x{n}")
    med = {cfg: statistics.median(v) for cfg, v in times.items()}
    pick = min(med, key=med.__getitem__)
    if verbose:
        for cfg, ms in sorted(med.items(), key=lambda kv: kv[1]):
            print(f"  tune chain {m}x{k}x{f}x{n}: fc1 {cfg.producer}, fc2 {cfg.consumer}, {cfg.launch}: "
                  f"{ms:.4f} ms", flush=True)
    best = dataclasses.replace(pick, check=ChainConfig().check)
    del timers
    _tuned(_runtime(x.device))[_tune_key(x, w1, w2, activation)] = best
    return best
