"""Which GEMM engine runs an op's tiles: the ``triton.language`` tile GEMM or the
warp-specialized Gluon GEMM, chosen per GEMM by measurement.

    plan = engine_plan(a, b, c, table, flags=..., err=..., config=GemmConfig, wait=True, ...)
    plan.launch(plan.operands(a, b, a2), c, epoch=1, grid=G, rows=(cap, span))

``engine_plan`` takes ``tile_gemm.TileGemmPlan``'s arguments and returns that plan itself
where the Gluon GEMM cannot run the call, else an ``EnginePlan`` with the same two methods.
The Gluon GEMM (``overlap.kernels.gluon_gemm``) runs a call that has

- tiles that wait (or none), on one error word, with a dispatch counter or without
  (a give-back grid joins the same table by the counter), C rows cut per row block
  (``rows=``, C rows only), the gelu activation, one or two A sources;
- a table of a tile it has (128x256, 256x128, 128x128; 64x256 in ping-pong); a table of
  128x256 (256x128) tiles may also run as its column (row) halves on ping-pong 128x128
  (``HALF_CONFIGS``, ``split_columns`` / ``split_rows``: each tile's flag, multiple and row
  cut kept, twice the tiles); with ``OVERLAP_GLUON_EXPERIMENTAL=1`` a table of 128-row tiles may
  also run at 192 columns (``WIDE_CONFIGS``, ``retile_columns``: each row block's columns
  tiled again, its flag, multiple and row cut kept), and 128x256 / 256x128 tables may also
  run on 4 stages with C stored from registers (``REGS_CONFIGS``), and a table of its own
  tile with the last wave split along K where the launch's grid leaves it at most half
  full (``SPLIT_CONFIGS``, ``GluonGemmConfig.split_tail``);
- with ``OVERLAP_GLUON_AHEAD=1``, each of those configs (and of the posting ones below) with
  ``GluonGemmConfig.ahead`` in its place (checked on an H100, no faster: off by default);
- or tiles that post and do not wait (a producer's), on the plain kernel of the table's own
  tile (``_post_configs``: halves and retiled tables would post per piece; C staged through
  shared memory, checked and timed on a GPU: docs/experiments.md, 2026-12-05);
- bf16 / fp16 on an sm_90 GPU, a Triton whose Gluon it knows (``_gluon_compat``);

and not: posts from tiles that wait, split tiles, a folded norm, several weights, TileSync,
a flattened GEMM's groups, A-row cuts, the peer-copy transport's signature words, a start
flag. Those calls run the tile GEMM, which stays the fallback everywhere.

``OVERLAP_GEMM_ENGINE`` (read when a plan is made): ``auto`` (the default) measures, at a
plan's first launch outside a graph capture, the GEMM as the op runs it (its table, A
rows, grid and row cut, every flag already set, on scratch flags, error word, counter and
C; the posts of a producer's tiles go to scratch flags too) on the tile GEMM and each Gluon config of the table's tile (and of its halves), as they
run sustained: each captured in a CUDA graph of about ``GRAPH_MS`` of launches on a stream
of its own, the graphs replayed back to back, rotated, over ``ROUNDS`` rounds, medians
(eager rounds where a capture fails); the Gluon GEMM runs only where it was ``MARGIN`` (1%)
faster. Before it is timed, each Gluon config's C from its first launch is checked against
the tile GEMM's C from the same launch (``c_differs``; C prefilled with NaN, so a tile left
unwritten shows): a config whose C differs is no candidate, with a warning and the reason in
the report (a guard on the call's own operands, not a proof; it holds one more C-sized
buffer while the measurement runs). The pick is kept
per problem for the process (``picks()``) and, with ``OVERLAP_GEMM_CACHE`` set, in a file
beside the GEMM tuner's (``cache_path()``), keyed like the tuner's by the GPU, the versions
and the problem. A first launch inside a capture runs the tile GEMM (no measuring in a
capture) unless the problem was measured before. ``tile`` never runs the Gluon GEMM;
``gluon`` runs it wherever it can (the table tile's first config), unmeasured.
``overlap.report()`` lists each GEMM problem's engine and why (measured times, forced, or
why Gluon cannot run it).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from .. import protocol as _p
from . import gluon_gemm as _gg
from .gluon_gemm import GluonGemmConfig
from .tile_gemm import ACTIVATIONS, GemmConfig, TileGemmPlan, interpreting

__all__ = ["ENGINE_ENV", "ENGINES", "engine_mode", "unavailable", "misfit", "gluon_configs", "split_columns",
           "split_rows", "retile_columns", "experimental", "EXPERIMENTAL_ENV", "ahead", "AHEAD_ENV",
           "engine_plan",
           "EnginePlan", "picks"]

ENGINE_ENV = "OVERLAP_GEMM_ENGINE"
ENGINES = ("auto", "tile", "gluon")

TILE_CONFIGS: dict[tuple[int, int], tuple[GluonGemmConfig, ...]] = {
    (128, 256): (GluonGemmConfig(block_m=128, block_n=256, stages=3),),
    (256, 128): (GluonGemmConfig(block_m=256, block_n=128, stages=3),),
    (128, 128): (GluonGemmConfig(block_m=128, block_n=128, stages=5, pingpong=True),
                 GluonGemmConfig(block_m=128, block_n=128, stages=4)),
    (64, 256): (GluonGemmConfig(block_m=64, block_n=256, stages=4, pingpong=True),),
}
"""The Gluon configs measured for a table of each tile (those of benchmarks/gluon_gemm_bench.py;
a table's tile fixes the config's, as its rows and column tiles are the kernel's)."""

HALF_CONFIGS: dict[tuple[int, int], tuple[GluonGemmConfig, ...]] = {
    (128, 256): (GluonGemmConfig(block_m=128, block_n=128, stages=5, pingpong=True),),
    (256, 128): (GluonGemmConfig(block_m=128, block_n=128, stages=5, pingpong=True),),
}
"""Gluon configs of half the table tile, also measured on a table of that tile: each of
the table's tiles cut into its two column halves (``split_columns``) or row halves
(``split_rows``), so every tile keeps the op's A source, flag, multiple and row cut.
Ping-pong 128x128 waiting was the fastest Gluon config on 28 of the 48 sweep shapes
(docs/experiments.md, 2026-12-04), where the tables are of 128x256 or 256x128 tiles."""

REGS_CONFIGS: dict[tuple[int, int], tuple[GluonGemmConfig, ...]] = {
    (128, 256): (GluonGemmConfig(block_m=128, block_n=256, stages=4, tma_epilogue=False),),
    (256, 128): (GluonGemmConfig(block_m=256, block_n=128, stages=4, tma_epilogue=False),),
}
"""Configs of the table's own tile whose C goes out by masked stores from registers, leaving
the C tile's shared memory to a fourth ring slot (``GluonGemmConfig.tma_epilogue``), measured
where ``OVERLAP_GLUON_EXPERIMENTAL=1``: more loads in flight for a long K (at 2048 x 8192 x
14784 cuBLAS ran at 794 TFLOP/s, the best candidate at 711). Checked on a GPU, and the
slowest variant on 10 of ``gluon_gemm_bench``'s 11 shapes (its stores 4 bytes wide)."""
WIDE_CONFIGS: dict[tuple[int, int], tuple[GluonGemmConfig, ...]] = {
    (128, 256): (GluonGemmConfig(block_m=128, block_n=192, stages=4),),
    (128, 128): (GluonGemmConfig(block_m=128, block_n=192, stages=4),),
}
"""Gluon configs of a 192-column tile (``GluonGemmConfig.wide``), measured on a table of
128-row tiles retiled to 192 columns (``retile_columns``: each row block's flag, multiple
and row cut kept) where ``OVERLAP_GLUON_EXPERIMENTAL=1``. Where 256 columns leave a partial wave,
192 may fill one (N = 1536, M = 2048: 96 tiles of 128x256 on 132 SMs, 128 of 128x192).
Checked on a GPU; the fastest alone on 4 of ``gluon_gemm_bench``'s 11 shapes, but the
48-shape sweep with it among the candidates waited at 0.971x cuBLAS against 0.972x without
(docs/experiments.md, 2026-12-05): off by default, a candidate more to time at every first
launch for no gain measured yet."""
SPLIT_CONFIGS: dict[tuple[int, int], tuple[GluonGemmConfig, ...]] = {
    (128, 256): (GluonGemmConfig(block_m=128, block_n=256, stages=3, split_tail=True),),
    (256, 128): (GluonGemmConfig(block_m=256, block_n=128, stages=3, split_tail=True),),
    (128, 128): (GluonGemmConfig(block_m=128, block_n=128, stages=4, split_tail=True),),
}
"""Configs of the table's own tile whose last wave is split along K where it is at most half
full (``GluonGemmConfig.split_tail``), measured where ``OVERLAP_GLUON_EXPERIMENTAL=1`` and
the launch's grid splits the table (``gluon_gemm.split_plan``; elsewhere the config is its
unsplit twin, not measured twice)."""
EXPERIMENTAL_ENV = "OVERLAP_GLUON_EXPERIMENTAL"


AHEAD_ENV = "OVERLAP_GLUON_AHEAD"


def ahead() -> bool:
    """``OVERLAP_GLUON_AHEAD`` is 1 (or on, true, yes): every Gluon candidate runs with
    ``GluonGemmConfig.ahead`` (the reads at tile boundaries moved off the tiles' path), in
    place of the same config without it; its GPU tests pass, but it timed no faster on an
    H100 (docs/experiments.md, 2026-12-05), so off by default."""
    return os.environ.get(AHEAD_ENV, "").strip().lower() in ("1", "on", "true", "yes")


def _with_ahead(cfgs: tuple[GluonGemmConfig, ...]) -> tuple[GluonGemmConfig, ...]:
    # (a split tail does not read ahead: it stays as it is)
    return tuple(g if g.split_tail else replace(g, ahead=True) for g in cfgs) if ahead() else cfgs


def experimental() -> bool:
    """``OVERLAP_GLUON_EXPERIMENTAL`` is 1 (or on, true, yes): the Gluon GEMM's parts that
    measured no faster on a GPU are candidates too: the 192-column tile (``WIDE_CONFIGS``),
    128x256 and 256x128 on 4 stages with C stored from registers (``REGS_CONFIGS``); and the
    last wave split along K (``SPLIT_CONFIGS``): +0.4% over the 48-shape sweep on an H100, its
    workspace up to 16.5 MiB per plan that picks it (docs/experiments.md, 2026-12-06)."""
    return os.environ.get(EXPERIMENTAL_ENV, "").strip().lower() in ("1", "on", "true", "yes")


MARGIN = 0.01
"""How much faster (a fraction of the tile GEMM's time) the Gluon GEMM must measure to be picked."""
TIMING = "graphs-rotated-1"
"""How picks are measured (``EnginePlan._measure``), part of a kept pick's key: picks measured
another way (3 rounds of 3 eager launches before) are measured again."""

_lock = threading.Lock()
_picks: dict[tuple, tuple[str, str]] = {}     # problem -> (label, why), the last plan's
_DERIVED_CAP = 256
_derived: "OrderedDict[tuple, tuple[Any, Any]]" = OrderedDict()
"""Tables derived from an op's table (its halves, its row blocks at 192 columns), by the op
table's address, shape and device and how: (the op's table, the derived one), the most
recent ``_DERIVED_CAP``. A plan made inside a capture (its words are the capture's own, so
its plan is new) finds here the table an eager plan of the same op table built, which it
may not build itself. Each entry holds the op's table, so its address is not reused by
another table while the entry lives; a plan holds the derived tables it runs (a captured
graph reads them for good)."""
_measured: dict[tuple, tuple[str, str, tuple]] = {}  # problem + (grid, rows) -> (label, why, the candidates measured)


def engine_mode() -> str:
    """``OVERLAP_GEMM_ENGINE``: auto (unset or empty), tile or gluon; ValueError otherwise."""
    v = os.environ.get(ENGINE_ENV, "").strip().lower() or "auto"
    if v not in ENGINES:
        raise ValueError(f"{ENGINE_ENV}={os.environ.get(ENGINE_ENV)!r}: must be one of {', '.join(ENGINES)}")
    return v


def unavailable(device: Any, dtype: Any) -> str | None:
    """Why the Gluon GEMM cannot run on ``device`` at ``dtype`` here, or None."""
    import torch

    if not _gg.AVAILABLE:
        return _gg.REASON
    if interpreting():
        return "Triton's interpreter runs no Gluon kernel"
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"the Gluon GEMM runs on CUDA devices, not {dev.type}"
    major, minor = torch.cuda.get_device_capability(dev)
    if major != 9:
        return f"the Gluon GEMM is built for sm_90 (Hopper), this GPU is sm_{major}{minor}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the Gluon GEMM takes bf16 / fp16, not {dtype}"
    return None


def gluon_configs(config: GemmConfig) -> tuple[GluonGemmConfig, ...]:
    """The Gluon configs for a table of ``config``'s tile (none for another tile): those of
    the tile itself first, then those that run its halves (``HALF_CONFIGS``), then (with
    ``OVERLAP_GLUON_EXPERIMENTAL=1``) those of its own tile storing C from registers
    (``REGS_CONFIGS``), those of its own tile with the last wave split along K
    (``SPLIT_CONFIGS``) and those of its rows retiled to 192 columns (``WIDE_CONFIGS``)."""
    tile = (config.block_m, config.block_n)
    if not TILE_CONFIGS.get(tile):
        return ()
    more = REGS_CONFIGS.get(tile, ()) + SPLIT_CONFIGS.get(tile, ()) + WIDE_CONFIGS.get(tile, ()) \
        if experimental() else ()
    return _with_ahead(TILE_CONFIGS[tile] + HALF_CONFIGS.get(tile, ()) + more)


def split_columns(table: Any, n: int, block_n: int) -> Any:
    """A tile table (int32 [T, 8], one weight) of ``block_n``-wide tiles as a table of
    ``block_n // 2``-wide ones: tile i becomes tiles 2i and 2i + 1, its left and right
    column halves, each with tile i's A rows, source, C rows, flag and multiple (so the
    waits and row cuts are the op's); a right half wholly past ``n`` columns is left out.
    Tables that post are refused. A CPU tensor in, a CPU tensor out."""
    import torch

    if block_n % 2 or block_n <= 0:
        raise ValueError(f"split_columns: block_n must be even and positive, got {block_n}")
    if table.dim() != 2 or table.shape[1] != _p.TABLE_COLS or table.dtype != torch.int32:
        raise ValueError(f"split_columns: a table is int32 [T, {_p.TABLE_COLS}], got {table.dtype} "
                         f"{tuple(table.shape)}")
    from ..policies import NO_FLAG

    if bool((table[:, _p.COL_POST] != NO_FLAG).any()):
        raise ValueError("split_columns: a table whose tiles post cannot be split (each post would count twice)")
    nt = table[:, _p.COL_N_TILE]
    if bool((nt < 0).any()) or bool((nt > _p.N_TILE_MASK).any()):
        raise ValueError("split_columns: a table of one weight (column tiles in [0, N_TILE_MASK]) only")
    if bool((nt >= -(-n // block_n)).any()):
        raise ValueError(f"split_columns: a column tile past N = {n} at {block_n} columns a tile")
    out = table.repeat_interleave(2, dim=0)
    out[:, _p.COL_N_TILE] = 2 * out[:, _p.COL_N_TILE] + torch.arange(out.shape[0], dtype=torch.int32) % 2
    return out[out[:, _p.COL_N_TILE] * (block_n // 2) < n].contiguous()


def retile_columns(table: Any, n: int, block_n: int, new_n: int) -> Any:
    """A tile table (int32 [T, 8], one weight) of ``block_n``-wide tiles as one of
    ``new_n``-wide tiles over the same rows: each row block (A rows, source, C rows) gets
    the column tiles that cover N at the new width, with the row block's flag and multiple,
    in the order of the old tiles they start in (so the old table's group order holds).
    Every row block must have every old column tile once, and one flag and multiple; tables
    that post are refused (a post counts tiles). A CPU tensor in, a CPU tensor out."""
    import torch

    if block_n <= 0 or new_n <= 0:
        raise ValueError(f"retile_columns: widths must be positive, got {block_n} and {new_n}")
    if table.dim() != 2 or table.shape[1] != _p.TABLE_COLS or table.dtype != torch.int32:
        raise ValueError(f"retile_columns: a table is int32 [T, {_p.TABLE_COLS}], got {table.dtype} "
                         f"{tuple(table.shape)}")
    from ..policies import NO_FLAG

    if bool((table[:, _p.COL_POST] != NO_FLAG).any()):
        raise ValueError("retile_columns: a table whose tiles post cannot be retiled (each post counts a tile)")
    nt = table[:, _p.COL_N_TILE].long()
    cols = -(-n // block_n)
    if bool((nt < 0).any()) or bool((nt >= cols).any()):
        raise ValueError(f"retile_columns: column tiles must be in [0, {cols}) for N = {n} at {block_n} a tile")
    key_cols = [_p.COL_A_ROW, _p.COL_A_SRC, _p.COL_C_ROW, _p.COL_C_ROWS]
    blocks, inverse = torch.unique(table[:, key_cols], dim=0, return_inverse=True)
    per = torch.zeros(blocks.shape[0], cols, dtype=torch.long)
    per.index_put_((inverse, nt), torch.ones_like(nt), accumulate=True)
    if not bool((per == 1).all()):
        raise ValueError("retile_columns: each row block must have each column tile exactly once")
    waits = table[:, [_p.COL_WAIT, _p.COL_WAIT_MULT]]
    first = torch.zeros(blocks.shape[0], 2, dtype=table.dtype)
    first[inverse] = waits
    if not bool((first[inverse] == waits).all()):
        raise ValueError("retile_columns: the tiles of a row block wait on different flags")
    lo = nt * block_n
    hi = torch.clamp((nt + 1) * block_n, max=n)
    j0 = -(-lo // new_n)                   # the first new tile that starts in [lo, hi)
    counts = torch.clamp(-(-hi // new_n) - j0, min=0)
    out = table.repeat_interleave(counts, dim=0)
    start = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    out[:, _p.COL_N_TILE] = (torch.repeat_interleave(j0, counts) + torch.arange(out.shape[0]) - start).to(table.dtype)
    return out.contiguous()


def split_rows(table: Any, block_m: int) -> Any:
    """A tile table (int32 [T, 8]) of ``block_m``-row tiles as a table of ``block_m // 2``-row
    ones: tile i becomes tiles 2i (its first half of rows) and 2i + 1 (the rest, left out
    where the tile has no more than half its rows), each with tile i's column tile, A
    source, flag and multiple; the halves' rows lie inside tile i's, so a row cut of the
    op's (C rows in blocks, ``rows=(cap, span)``) cuts them as it cut tile i. Tables that
    post are refused (a post would count twice). A CPU tensor in, a CPU tensor out."""
    import torch

    if block_m % 2 or block_m <= 0:
        raise ValueError(f"split_rows: block_m must be even and positive, got {block_m}")
    if table.dim() != 2 or table.shape[1] != _p.TABLE_COLS or table.dtype != torch.int32:
        raise ValueError(f"split_rows: a table is int32 [T, {_p.TABLE_COLS}], got {table.dtype} "
                         f"{tuple(table.shape)}")
    from ..policies import NO_FLAG

    if bool((table[:, _p.COL_POST] != NO_FLAG).any()):
        raise ValueError("split_rows: a table whose tiles post cannot be split (each post would count twice)")
    rows = table[:, _p.COL_C_ROWS]
    if bool((rows > block_m).any()):
        raise ValueError(f"split_rows: a tile of more than block_m = {block_m} rows")
    half = block_m // 2
    out = table.repeat_interleave(2, dim=0)
    second = (torch.arange(out.shape[0]) % 2 == 1)
    r = out[:, _p.COL_C_ROWS]
    out[:, _p.COL_C_ROWS] = torch.where(second, r - half, torch.clamp(r, max=half))
    out[second, _p.COL_A_ROW] += half
    out[second, _p.COL_C_ROW] += half
    return out[out[:, _p.COL_C_ROWS] > 0].contiguous()


def set_flags(table: Any, flags: Any) -> Any:
    """Host flags like ``flags`` (its shape and dtype) as a launch at epoch 1 finds them all
    set: each flag a tile of ``table`` (a CPU tensor) waits on at the largest multiple its
    waiters want, the others 0."""
    import torch

    w, mult = table[:, _p.COL_WAIT].long(), table[:, _p.COL_WAIT_MULT].long()
    on = w >= 0
    out = torch.zeros(flags.shape, dtype=torch.long).reshape(-1)
    out.scatter_reduce_(0, w[on], mult[on], reduce="amax")
    return out.reshape(flags.shape).to(flags.dtype)


def misfit(b: Any, *, config: GemmConfig, wait: bool = False, post: bool = False, k_wait: int = 0,
           norm_epi: bool = False, split: Any = None, sig_stride: Any = None, groups: Any = None,
           clip: Any = None, start_flag: Any = None, activation: Any = None, **_: Any) -> str | None:
    """What of a ``TileGemmPlan``'s arguments the Gluon GEMM lacks, or None (it runs them)."""
    why = [what for what, on in (
        ("several weights", isinstance(b, (list, tuple))), ("posts from tiles that wait", post and wait),
        ("TileSync waits (k_wait)", k_wait), ("a folded norm", norm_epi), ("split tiles", split is not None),
        ("signature words (peer-copy transport)", sig_stride is not None),
        ("a flattened GEMM (GemmConfig.flatten)", config.flatten or groups is not None),
        ("A-row cuts (a reduce-scatter's)", clip == "a"), ("a start flag", start_flag is not None),
        (f"activation {activation!r}", ACTIVATIONS.get(activation, -1) not in (0, 1)),
    ) if on]
    if not gluon_configs(config):
        why.append(f"a {config.block_m}x{config.block_n} tile")
    elif post and not _post_configs(config):
        why.append(f"posts on a {config.block_m}x{config.block_n} tile (only the plain kernel's tiles post)")
    return ", ".join(why) or None


def _post_configs(config: GemmConfig) -> tuple[GluonGemmConfig, ...]:
    """The configs that run a table of ``config``'s tile whose tiles post: the plain
    kernel's of that very tile (halves and retiled tables would count a post per piece)."""
    own = TILE_CONFIGS.get((config.block_m, config.block_n), ())
    return _with_ahead(tuple(g for g in own if g.kind == "plain"))


def picks() -> dict[tuple, tuple[str, str]]:
    """The engine picked per GEMM problem so far: {problem: (label, why)}."""
    with _lock:
        return dict(_picks)


def _label(cfg: GluonGemmConfig, how: str = "") -> str:
    return (f"gluon {'pp' if cfg.pingpong else ''}{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.stages}"
            f"{'' if cfg.tma_epilogue else ' regs'}{' ahead' if cfg.ahead else ''}{' split' if cfg.split_tail else ''}"
            f"{' ' + how if how else ''}")


def _record(problem: tuple, label: str, why: str) -> None:
    from .. import observe as _observe

    with _lock:
        _picks[problem] = (label, why)
    # (M, N, K, dtype) and what its tiles do: a waiting GEMM and a posting one of one shape
    # (the chain's fc2 and its stream-synced baseline, say) are two lines of the report
    kind = "posts" if problem[11] else ("waits" if problem[9] else "alone")
    _observe.record_engine(problem[:4] + (kind,), label, why)


def engine_plan(a: Any, b: Any, c: Any, table: Any, *, tile_only: str | None = None, **kw: Any) -> Any:
    """``TileGemmPlan(a, b, c, table, **kw)``, or an ``EnginePlan`` over it where the Gluon
    GEMM can run the call and ``OVERLAP_GEMM_ENGINE`` allows it (see the module's doc).
    ``tile_only``: why this call must run the tile GEMM whatever the engine setting (a
    kernel of the op shares the GEMM's SMs and counts on the tile GEMM's registers and
    shared memory leaving it room: ``OverlapConfig.reduce_shared``)."""
    tile = TileGemmPlan(a, b, c, table, **kw)
    mode = engine_mode()
    cfg = kw.get("config") or GemmConfig()
    # (M, N, K, dtype) as the report shows it, then what else the pick depends on
    c0 = c[0] if isinstance(c, (list, tuple)) else c
    problem = (c0.shape[0], _ns(b), a.shape[1], str(a.dtype).removeprefix("torch."), tile.b_kn, cfg.block_m,
               cfg.block_n, table.shape[0], kw.get("a2") is not None, bool(kw.get("wait")), kw.get("activation"),
               bool(kw.get("post")))
    if mode == "tile" or tile_only:
        _record(problem, "tile", tile_only or f"{ENGINE_ENV}=tile")
        return tile
    why = unavailable(a.device, a.dtype) or misfit(b, **kw)
    if why is not None:
        _record(problem, "tile", f"Gluon: {why}")
        return tile
    return EnginePlan(tile, a, b, c, table, kw, problem, forced=mode == "gluon")


_FORMAT = "overlap-gemm-engine-1"
_disk: dict[str, dict] = {}
_disk_loaded = [False]


def cache_path() -> str | None:
    """Where measured picks are kept across processes: beside the GEMM tuner's cache
    (``OVERLAP_GEMM_CACHE`` + ``.engines.json``); None without one (the process only)."""
    p = os.environ.get("OVERLAP_GEMM_CACHE")
    return p + ".engines.json" if p else None


def _env(device: Any) -> dict[str, Any]:
    """What a pick depends on besides the problem: the GPU and versions (the GEMM tuner's),
    the Gluon configs measured and the margin."""
    from .autotune import device_env

    env = {**device_env(device), "gluon": [_label(g) for v in TILE_CONFIGS.values() for g in v],
           "halves": {f"{m}x{n}": [_label(g) for g in v] for (m, n), v in HALF_CONFIGS.items()}, "margin": MARGIN,
           "timing": TIMING}
    if ahead():  # (likewise: the key of picks measured without it unchanged)
        env["ahead"] = True
    if WARM_MS:
        env["warm_ms"] = WARM_MS
    if experimental():  # (picks measured without the experimental candidates keep their key)
        env["experimental"] = {"wide": {f"{m}x{n}": [_label(g) for g in v] for (m, n), v in WIDE_CONFIGS.items()},
                               "regs": {f"{m}x{n}": [_label(g) for g in v] for (m, n), v in REGS_CONFIGS.items()},
                               "split": {f"{m}x{n}": [_label(g) for g in v] for (m, n), v in SPLIT_CONFIGS.items()}}
    return env


def _disk_key(key: tuple, device: Any) -> str:
    return json.dumps({"env": _env(device), "problem": [str(x) for x in key]}, sort_keys=True, separators=(",", ":"))


def _read(path: str) -> dict[str, dict]:
    from .autotune import _read_file

    return {k: v for k, v in _read_file(path, _FORMAT).items()
            if isinstance(v.get("engine"), str) and isinstance(v.get("why"), str)}


def _known(key: tuple, labels: tuple, device: Any) -> tuple[str, str] | None:
    """A pick measured before for ``key``: in this process, or in the file (``cache_path``);
    None where there is none, or the file's names a config that is no candidate."""
    with _lock:
        got = _measured.get(key)
        path = cache_path()
        if got is not None:
            # measured again where a candidate is new since (OVERLAP_GLUON_EXPERIMENTAL turned
            # on) or the pick is no longer one (turned off)
            label, why, among = got
            return (label, why) if label in ("tile", *labels) and set(labels) <= set(among) else None
        if path is None:
            return None
        if not _disk_loaded[0]:
            _disk_loaded[0] = True
            _disk.update(_read(path))
        entry = _disk.get(_disk_key(key, device))
    if entry is None or entry["engine"] not in ("tile", *labels):
        return None
    got = (entry["engine"], entry["why"] + " (kept from an earlier process)")
    with _lock:
        _measured[key] = (*got, tuple(labels))
    return got


def _keep(key: tuple, label: str, why: str, device: Any, among: tuple = ()) -> None:
    """A new measured pick: for the process, and merged into the file (others' entries kept)."""
    from .autotune import _write_atomic

    with _lock:
        _measured[key] = (label, why, among)
        path = cache_path()
        if path is None or "(eager," in why:  # measured another way than the file's key says: this process only
            return
        dk = _disk_key(key, device)
        _disk[dk] = {"engine": label, "why": why}
        merged = _read(path)
        merged[dk] = _disk[dk]
        try:
            _write_atomic(path, {"format": _FORMAT, "entries": merged})
        except OSError:
            pass  # an unwritable file only costs a measurement in the next process


def _capturing() -> bool:
    import torch

    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _ns(b: Any) -> int:
    return b.shape[1] if not isinstance(b, (list, tuple)) else sum(x.shape[1] for x in b)


class _Operands:
    """One call's operands, their descriptors made for the engine that launches them."""

    __slots__ = ("a", "b", "a2", "descs")

    def __init__(self, a: Any, b: Any, a2: Any) -> None:
        self.a, self.b, self.a2 = a, b, a2
        self.descs: Any = None  # the tile GEMM's, made once where it launches them


class EnginePlan:
    """A consumer GEMM that may run on the Gluon GEMM: ``TileGemmPlan``'s ``operands`` and
    ``launch``, the engine fixed at the first launch (measured, or forced)."""

    def __init__(self, tile: TileGemmPlan, a: Any, b: Any, c: Any, table: Any, kw: dict, problem: tuple,
                 forced: bool) -> None:
        self.tile = tile
        self.table = table
        # the table on the host: the rows ``table_tensor`` kept, or read now, when the plan is
        # made, not at its first launch: by then the caller's stream may hold the call's gate or
        # stream wait, and a read queued behind it waits for it (for good, were its release not
        # queued yet)
        from ..policies import host_table

        self._table_cpu = host_table(table)
        if self._table_cpu is None and not _capturing():
            self._table_cpu = table.cpu()
        self.flags = kw.get("flags")
        self.err = kw.get("err")
        self.counter = kw.get("counter")
        self.wait = bool(kw.get("wait"))
        self.post = bool(kw.get("post"))
        self.rank = int(kw.get("rank", 0))
        self.timeout_ns = int(kw.get("timeout_ns", 500_000_000))
        self.activation = ACTIVATIONS[kw.get("activation")]
        self.clip = bool(kw.get("clip"))
        self.problem = problem
        self.forced = forced
        cfg = kw.get("config") or GemmConfig()
        self.configs = _post_configs(cfg) if self.post else gluon_configs(cfg)
        self.tile_shape = (cfg.block_m, cfg.block_n)
        self.n = _ns(b)
        self._tables: dict[tuple, Any] = {self.tile_shape: table}  # tile -> its table (the op's, or its halves)
        self.gluon: GluonGemmConfig | None = None  # the pick; None: the tile GEMM
        self.decided = False
        self.followable = False  # decided by a measurement, a kept pick or the forced engine
        self.b_kn = tile.b_kn
        self._gplans: dict[tuple, Any] = {}  # (config, flags, err, counter) -> GluonGemmPlan
        self.engine = "undecided"
        self.why = ""

    # the tile plan's attributes the ops read (num_tiles, workspace, ...)
    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["tile"], name)

    def operands(self, a: Any, b: Any, a2: Any = None) -> _Operands:
        """The call's operands; the tile plan's checks of their shapes and layouts now."""
        ops = _Operands(a, b, a2)
        if self.decided and self.gluon is None:
            ops.descs = self.tile.operands(a, b, a2)
            return ops
        t = self.tile
        b_store = b if t.b_kn else b.t()
        if (t._rows_free(a) != t.a_layout or (a2 is None) != (t.a2_layout is None)
                or (a2 is not None and t._rows_free(a2) != t.a2_layout)
                or (tuple(b_store.shape), b_store.stride()) != t.b_layouts[0]):
            # not the plan's layouts: the tile plan's own checks say how (or take B through
            # the copy they make for an odd layout, which this plan then reads as well)
            descs = t.operands(a, b, a2)
            ops.b = descs[2].base if t.b_kn else descs[2].base.t()
        return ops

    def launch(self, descs: Any, c: Any, *, epoch: int, grid: int, rowstat: Any = None, colvec: Any = None,
               sig: int = 0, rows: tuple[int, int] | None = None) -> None:
        """``TileGemmPlan.launch`` on the engine picked (at the first launch)."""
        if not isinstance(descs, _Operands):
            raise TypeError("EnginePlan.launch takes its own operands() (not another plan's descriptors)")
        if (rows is not None) != self.clip:
            raise ValueError(f"rows=(cap, span) must be given {'with' if self.clip else 'without'} clip")
        if rowstat is not None or colvec is not None or sig:
            raise ValueError("this GEMM's plan has no folded norm or signature words")
        if not self.decided:
            self._decide(descs, c, grid, rows)
        if self.gluon is None:
            if descs.descs is None:
                descs.descs = self.tile.operands(descs.a, descs.b, descs.a2)
            self.tile.launch(descs.descs, c, epoch=epoch, grid=grid, rows=rows)
            return
        self._launch_gluon(self.gluon, descs.a, descs.b, descs.a2, c, epoch, grid, rows, self.flags, self.err,
                           self.counter)

    def bind(self, a: Any, b: Any, c: Any, *, a2: Any = None, epoch: int, grid: int, rowstat: Any = None,
             colvec: Any = None, sig: int = 0, rows: tuple[int, int] | None = None) -> Any:
        """``TileGemmPlan.bind`` on the engine picked: the tile plan's bound launch, or the
        Gluon plan's (``GluonGemmPlan.bind``: the same per-call tensors); None before the
        pick (the first launch picks), for what ``launch`` refuses, or where the picked plan
        cannot be bound (its Gluon plan not launched yet, among others): the caller keeps
        ``launch``."""
        if not self.decided or (rows is not None) != self.clip:
            return None
        if self.gluon is None:
            return self.tile.bind(a, b, c, a2=a2, epoch=epoch, grid=grid, rowstat=rowstat, colvec=colvec, sig=sig,
                                  rows=rows)
        if rowstat is not None or colvec is not None or sig:
            return None
        gp = self._gplans.get((self.gluon, id(self.flags), id(self.err), id(self.counter)))
        if gp is None or gp.b_kn != self.b_kn:  # (a call gives B as the tile plan lays it out)
            return None
        return gp.bind(a, b, c, a2=a2, epoch=epoch, grid=grid, rows=rows)

    def _launch_gluon(self, cfg: GluonGemmConfig, a: Any, b: Any, a2: Any, c: Any, epoch: int, grid: int,
                      rows: Any, flags: Any, err: Any, counter: Any) -> None:
        key = (cfg, id(flags), id(err), id(counter))
        gp = self._gplans.get(key)
        if gp is None:
            gp = self._gplans[key] = _gg.GluonGemmPlan(
                a, b, c, self._table_for(cfg), a2=a2, flags=flags if self.wait or self.post else None,
                err=err if self.wait else None, rank=self.rank, timeout_ns=self.timeout_ns,
                activation=self.activation, counter=counter, config=cfg, clip=self.clip, post=self.post)
        gp.launch(a, b, c, a2=a2, epoch=epoch, grid=grid, rows=rows)

    def label(self, cfg: GluonGemmConfig | None) -> str:
        """The engine's name in the report: "tile", or the Gluon config (+ " halves" where it
        runs the halves of the op's tiles, " retiled" where the op's row blocks at 192 columns)."""
        if cfg is None:
            return "tile"
        if (cfg.block_m, cfg.block_n) == self.tile_shape:
            return _label(cfg)
        return _label(cfg, "retiled" if cfg.wide else "halves")

    def _host_table(self) -> Any:
        """The op's table on the host (read when the plan was made; here where it was made
        inside a capture)."""
        if self._table_cpu is None:
            self._table_cpu = self.table.cpu()
        return self._table_cpu

    def _derived_key(self, cfg: GluonGemmConfig) -> tuple:
        t = self.table
        return (t.data_ptr(), tuple(t.shape), str(t.device), self.tile_shape, (cfg.block_m, cfg.block_n), self.n)

    def _has_table(self, cfg: GluonGemmConfig) -> bool:
        """Whether ``cfg``'s table is at hand without building it (inside a capture too); one
        another plan of this op table built is taken now (held by this plan from then on)."""
        key = (cfg.block_m, cfg.block_n)
        if key in self._tables:
            return True
        with _lock:
            got = _derived.get(self._derived_key(cfg))
            if got is None or got[0] is not self.table:
                return False
            self._tables[key] = got[1]
        return True

    def _table_for(self, cfg: GluonGemmConfig) -> Any:
        """The table ``cfg`` runs: the op's, or (a config of half its tile) its column or
        row halves, or (a ``wide`` config) its row blocks at 192 columns: one another plan
        of the same op table built (``_derived``), else built here from a host copy of the
        op's (not inside a capture)."""
        key = (cfg.block_m, cfg.block_n)
        t = self._tables.get(key)
        if t is not None:
            return t
        dk = self._derived_key(cfg)
        with _lock:
            got = _derived.get(dk)
            if got is not None and got[0] is self.table:
                _derived.move_to_end(dk)
                t = self._tables[key] = got[1]
                return t
        tm, tn = self.tile_shape
        if cfg.wide and tm == cfg.block_m:
            split = lambda tab: retile_columns(tab, self.n, tn, cfg.block_n)  # noqa: E731
        elif key == (tm, tn // 2):
            split = lambda tab: split_columns(tab, self.n, tn)  # noqa: E731
        elif key == (tm // 2, tn):
            split = lambda tab: split_rows(tab, tm)  # noqa: E731
        else:
            raise ValueError(f"gluon_gemm: a {key[0]}x{key[1]} config on a table of {tm}x{tn} tiles")
        if _capturing():
            raise RuntimeError("a table derived from the op's (halves, 192 columns) is built outside a CUDA graph "
                               "capture")
        host, dev = split(self._host_table()), self.table.device
        if dev.type == "cuda":
            import torch

            cur = torch.cuda.current_stream(dev)
            # copied on the measurement's stream, as its words (nothing here waits on the op's
            # streams, which may hold a gate): landed when ``to`` returns; then freed only
            # after what the caller's stream has queued until the free (its launches read it)
            with _timing(dev).context():
                t = host.to(dev)
            t.record_stream(cur)
        else:
            t = host.to(dev)
        self._tables[key] = t
        with _lock:
            _derived[dk] = (self.table, t)
            while len(_derived) > _DERIVED_CAP:
                _derived.popitem(last=False)
        return t

    def follow(self, other: "EnginePlan") -> bool:
        """Take ``other``'s engine, decided, instead of measuring this plan's own: the same
        GEMM (shapes, dtype, B's layout, table tile and size) run another way, as the MLP
        chain's stream-synced baseline runs its fc2 (without waits) on the engine of the
        chain's fc2 (``ops/chain.py``). False (nothing changed) where this plan is decided,
        ``other`` is not, the GEMMs differ, or ``other``'s pick is no candidate here or its
        table cannot be built (inside a capture)."""
        if self.decided or not other.followable or self.forced != other.forced \
                or other.problem[:9] != self.problem[:9]:
            return False
        g = next((g for g in self.configs if self.label(g) == other.engine), None)
        if g is None and other.engine != "tile":
            return False
        if g is not None and not self._has_table(g):
            if _capturing():
                return False
            self._table_for(g)
        self.gluon, self.decided, self.engine = g, True, self.label(g)
        self.why = f"as the same GEMM's other plan: {other.why}"
        _record(self.problem, self.engine, self.why)
        return True

    def _decide(self, ops: _Operands, c: Any, grid: int, rows: Any) -> None:
        key = self.problem + (int(grid), rows)
        known = None if self.forced else _known(key, tuple(self.label(g) for g in self.configs), c.device)
        if self.forced:
            self.gluon, why = self.configs[0], f"{ENGINE_ENV}=gluon"
        elif known is not None and not (_capturing() and known[0] != "tile"
                                        and any(self.label(g) == known[0] and not self._has_table(g)
                                                for g in self.configs)):
            label, why = known
            self.gluon = next((g for g in self.configs if self.label(g) == label), None)
        elif _capturing():
            # no measuring inside a capture: the tile GEMM, undecided for the next plan; not a
            # pick another plan may follow (``follow``)
            self.decided, self.engine = True, "tile"
            self.why = ("first launch inside a CUDA graph capture: not measured" if known is None else
                        f"inside a CUDA graph capture, where the table of the pick measured before "
                        f"({known[0]}) cannot be built")
            _record(self.problem, "tile", self.why)
            return
        else:
            self.gluon, why = self._measure(ops, c, grid, rows)
            _keep(key, self.label(self.gluon), why, c.device, tuple(self.label(g) for g in self.configs))
        if self.gluon is not None and not self._has_table(self.gluon):
            self._table_for(self.gluon)  # built now (not in a capture: checked above), for plans made in one
        self.decided = self.followable = True
        self.engine = self.label(self.gluon)
        self.why = why
        _record(self.problem, self.engine, why)

    def timed_configs(self, grid: int, k: int) -> tuple[GluonGemmConfig, ...]:
        """The Gluon candidates a launch on ``grid`` programs at reduction ``k`` times: a split
        tail's config only where that grid splits its table (``gluon_gemm.split_plan``;
        elsewhere it is its unsplit twin, not timed twice)."""
        return tuple(g for g in self.configs if not g.split_tail
                     or _gg.split_plan(self._table_for(g).shape[0], int(grid), -(-int(k) // g.block_k)) is not None)

    def _measure(self, ops: _Operands, c: Any, grid: int, rows: Any) -> tuple[GluonGemmConfig | None, str]:
        """Time the tile GEMM and each Gluon config on this call's operands and grid, every
        flag set, on scratch words and C (the op's own are untouched), on a stream of its own:
        each candidate captured in a CUDA graph of about ``GRAPH_MS`` of launches, the graphs
        replayed back to back in rotated order over ``ROUNDS`` rounds (``graph_times``),
        medians; eager rounds (``eager_times``) where a capture fails."""
        import torch

        if _capturing():  # (``_decide`` never comes here inside a capture; nor may anyone else)
            raise RuntimeError("gluon engine: no measuring inside a CUDA graph capture")
        dev = c.device
        tab = self._host_table()
        # a stream of its own, ordered after nothing of the op's (timing needs no right data;
        # the op's streams may hold work that waits on its peers, or on work not yet queued):
        # the scratch words are made there too, so nothing here waits on the op's streams
        timing = _timing(dev)
        flags = err = counter = None
        with timing.context():
            if self.post:  # (the posts count into scratch flags: the op's own are never touched)
                flags = torch.zeros_like(self.flags)
            if self.wait:
                flags = set_flags(tab, self.flags).to(dev)
                err = torch.zeros_like(self.err)
            if self.counter is not None:
                counter = torch.zeros_like(self.counter)
            c_s = torch.empty_like(c)
        a, b, a2 = ops.a, ops.b, ops.a2
        tile_plan = TileGemmPlan.__new__(TileGemmPlan)
        tile_plan.__dict__.update(self.tile.__dict__)
        tile_plan.flags = flags if flags is not None else self.tile.flags
        tile_plan.err = err if err is not None else self.tile.err
        tile_plan.counter = counter if counter is not None else self.tile.counter
        # (the copy shares the prepared launch: its own tensors were checked for alignment alike)

        def run_tile() -> None:
            if counter is not None:
                counter.zero_()
            tile_plan.launch(tile_plan.operands(a, b, a2), c_s, epoch=1, grid=grid, rows=rows)

        def run_gluon(cfg: GluonGemmConfig) -> Any:
            def f() -> None:
                if counter is not None:
                    counter.zero_()
                self._launch_gluon(cfg, a, b, a2, c_s, 1, grid, rows, flags, err, counter)
            return f

        cands: list[tuple[str, Any, GluonGemmConfig | None]] = [("tile", run_tile, None)]
        cands += [(self.label(g), run_gluon(g), g) for g in self.timed_configs(grid, a.shape[1])]
        failed: list[str] = []
        scratch = {id(t) for t in (flags, err, counter) if t is not None}
        try:
            with timing.context():
                live = []
                ref = None
                for name, fn, g in cands:
                    try:
                        c_s.fill_(float("nan"))  # (what a launch leaves unwritten stays NaN)
                        fn()  # compiles where new
                        timing.sync()
                        if err is not None and int(err[0]) != 0:
                            raise RuntimeError(f"error word {err.tolist()} with every flag set")
                        if g is None:
                            ref = c_s.clone()
                        else:
                            bad = c_differs(c_s, ref)
                            if bad is not None:
                                _warn_wrong(self.problem, name, bad)
                                raise RuntimeError(f"its C is not the tile GEMM's: {bad}")
                        live.append((name, fn, g))
                    except Exception as e:  # noqa: BLE001 - a config this GPU or Triton refuses: not a candidate
                        if g is None:
                            raise
                        failed.append(f"{name} failed ({type(e).__name__}: {str(e)[:160]})")
                del ref
                runs = {name: fn for name, fn, _g in live}
                try:
                    times, iters = graph_times(runs, timing)
                    how = "graphs of " + ", ".join(f"{iters[nm]}" for nm in runs) + f" launches, {ROUNDS} rounds"
                except Exception as e:  # noqa: BLE001 - a capture this build refuses: eager rounds, as before
                    timing.sync()
                    times = eager_times(runs, timing)
                    how = f"eager, a capture failed ({type(e).__name__}: {str(e)[:120]})"
        finally:
            # the scratch words' plans go, whatever happened (the op's own are kept)
            self._gplans = {kk: v for kk, v in self._gplans.items() if not scratch & set(kk[1:])}
        med = {name: statistics.median(v) for name, v in times.items()}
        best = pick(med)
        why = f"measured ({how}) " + ", ".join(f"{nm} {ms:.3f}" for nm, ms in sorted(med.items(), key=lambda kv: kv[1]))
        why += " ms" + ("; " + "; ".join(failed) if failed else "")
        return next((g for name, _f, g in live if name == best), None), why


CHECK_RTOL = 2.0 ** -6
"""``c_differs``: an element differs where it is off by more than this fraction of the tile
GEMM's value (2 to 4 bf16 ulps; the two sum K in another order, in fp32, and round once) ..."""
CHECK_ATOL = 2.0 ** -10
"""... plus this fraction of the root mean square of the tile GEMM's C (sums that cancel
to near zero)."""
_CHECK_CHUNK = 1 << 22
"""Elements of C compared at a time (the fp32 copies a comparison makes stay this small)."""
_wrong_warned: set = set()


def c_differs(out: Any, ref: Any) -> str | None:
    """Where a candidate's C ``out`` is not the tile GEMM's ``ref`` (the same launch, both on
    C prefilled with NaN): None, or how many elements differ and the first of them. One is
    finite and the other not (a tile one of them left unwritten, or wrote where the other
    did not), or both finite and further apart than ``CHECK_RTOL`` of the tile GEMM's value
    plus ``CHECK_ATOL`` of its C's root mean square. Read in chunks of rows; the host waits
    for each (a measurement's, once per GEMM problem)."""
    import torch

    if tuple(out.shape) != tuple(ref.shape):
        return f"shape {tuple(out.shape)}, the tile GEMM's {tuple(ref.shape)}"
    m, n = ref.shape
    step = max(1, _CHECK_CHUNK // max(1, n))
    ss, cnt = 0.0, 0
    for i in range(0, m, step):
        r = ref[i:i + step].float()
        fin = torch.isfinite(r)
        ss += float(torch.where(fin, r * r, torch.zeros_like(r)).sum())
        cnt += int(fin.sum())
    rms = math.sqrt(ss / cnt) if cnt else 0.0
    nbad, first = 0, None
    for i in range(0, m, step):
        r, o = ref[i:i + step].float(), out[i:i + step].float()
        fr, fo = torch.isfinite(r), torch.isfinite(o)
        far = (o - r).abs() > CHECK_RTOL * r.abs() + CHECK_ATOL * rms
        bad = (fr != fo) | (fr & fo & far)
        k = int(bad.sum())
        if k and first is None:
            j = int(bad.flatten().nonzero()[0])
            first = (i + j // n, j % n, float(o.flatten()[j]), float(r.flatten()[j]))
        nbad += k
    if not nbad:
        return None
    row, col, got, want = first
    return (f"{nbad} of {m * n} elements differ (the first at row {row}, column {col}: {got:.6g}, the tile "
            f"GEMM's {want:.6g})")


def _warn_wrong(problem: tuple, name: str, bad: str) -> None:
    """Once per problem and config: a Gluon config whose C differs is a defect to report."""
    import warnings

    key = (problem, name)
    with _lock:
        if key in _wrong_warned:
            return
        _wrong_warned.add(key)
    warnings.warn(f"overlap: the Gluon GEMM config {name} computed another C than the tile GEMM on the GEMM "
                  f"problem {problem} ({bad}); it is not used for that GEMM (the tile GEMM or another config "
                  "runs). Please report this with overlap.report()", RuntimeWarning, stacklevel=3)


def pick(med: dict[str, float]) -> str:
    """The candidate to run from its median ms: the fastest, but a Gluon config only where
    it is ``MARGIN`` faster than the tile GEMM (its launch costs the host a little more, and
    a measurement does not rank configs closer than that)."""
    return min(med, key=lambda nm: (med[nm] * (1.0 if nm == "tile" else 1.0 + MARGIN), nm != "tile"))


GRAPH_MS = 2.0
"""About how long one replay of a candidate's graph runs: its launches captured back to back
(as ``benchmarks/gemm_sweep.py`` times, ``autotune.GraphTimer``)."""
GRAPH_MAX_ITERS = 64
"""Most launches in one candidate's graph (a GEMM of a few microseconds)."""
ROUNDS = 5
"""Timed rounds: each replays every candidate's graph once, in an order rotated by one per
round (``rotated_rounds``), after the untimed ones (one, or ``WARM_MS`` of them)."""
WARM_MS = 0.0
"""Untimed rounds before the timed ones, for about this long (at least one round), so the
timed ones run as a sustained load does (the clocks, a hypothesis): on an H200 the engine
timed the Gluon GEMM 0.8% faster than the tile GEMM at 8192x12288x6144, the sweep's longer
timing 3.7% (docs/experiments.md, 2026-12-05). 0: one round, as before; ``gemm_sweep.py
--engine-warm-ms`` measures what a longer warm-up picks."""
EAGER_ROUNDS, EAGER_REPS = 3, 3
"""Where a capture fails: rounds of ``EAGER_REPS`` eager launches a candidate (the
measurement before graphs)."""


def rotated_rounds(names: list[str], rounds: int) -> list[list[str]]:
    """The order of each round: round r starts at candidate r (mod their count), so none is
    always first (after the GPU idled) or always after the same one."""
    n = len(names)
    return [[names[(r + i) % n] for i in range(n)] for r in range(rounds)]


def graph_times(runs: dict[str, Any], timing: Any, *, rounds: int = ROUNDS, target_ms: float = GRAPH_MS,
                max_iters: int = GRAPH_MAX_ITERS,
                warm_ms: float | None = None) -> tuple[dict[str, list[float]], dict[str, int]]:
    """ms per launch of each of ``runs`` (name -> a launch, run once already), as the
    candidates run sustained and interleaved: each captured ``iters`` times in one graph
    (about ``target_ms``, sized by one timed launch), then the rounds of every graph replayed
    back to back in rotated order, timed each: untimed ones first (one, or as many as take
    about ``warm_ms``, default ``WARM_MS``, by the sizing launches' times), then ``rounds``.
    ``timing``: ``time(fn) -> ms``, ``capture(fn, iters) -> replay``, ``timed(calls) -> [ms]``
    (calls queued back to back, one wait at the end). A capture that fails raises (the
    caller times eagerly then). Returns ({name: [ms per launch, a round each]}, {name: iters})."""
    one = {nm: max(timing.time(fn), 1e-3) for nm, fn in runs.items()}
    iters = {nm: max(1, min(max_iters, round(target_ms / one[nm]))) for nm in runs}
    graphs = {}
    for nm, fn in runs.items():
        graphs[nm] = timing.capture(fn, iters[nm])
    warm_ms = WARM_MS if warm_ms is None else warm_ms
    if not (math.isfinite(warm_ms) and warm_ms >= 0):
        raise ValueError(f"engine: the warm-up must be a finite, non-negative ms, got {warm_ms!r}")
    warm = max(1, math.ceil(warm_ms / sum(one[nm] * iters[nm] for nm in runs)))
    order = [nm for rnd in rotated_rounds(list(runs), rounds + warm) for nm in rnd]
    ms = timing.timed([graphs[nm] for nm in order])
    times: dict[str, list[float]] = {nm: [] for nm in runs}
    for i, (nm, t) in enumerate(zip(order, ms)):
        if i >= warm * len(runs):  # (the warm rounds: untimed)
            times[nm].append(t / iters[nm])
    return times, iters


def eager_times(runs: dict[str, Any], timing: Any, *, rounds: int = EAGER_ROUNDS,
                reps: int = EAGER_REPS) -> dict[str, list[float]]:
    """ms per launch of each of ``runs`` in ``rounds`` rotated rounds of ``reps`` eager
    launches each (where a candidate cannot be captured)."""
    times: dict[str, list[float]] = {nm: [] for nm in runs}
    for rnd in rotated_rounds(list(runs), rounds):
        for nm in rnd:
            fn = runs[nm]
            times[nm].append(timing.time(lambda fn=fn: [fn() for _ in range(reps)]) / reps)
    return times


class _CudaTiming:
    """The engine's measurement on a CUDA stream of its own (``graph_times``' ``timing``):
    one per device and thread, kept, so its scratch C and words come from one cache."""

    _streams: dict[tuple, Any] = {}

    def __init__(self, device: Any) -> None:
        import torch

        dev = torch.device(device)
        key = (dev.index if dev.index is not None else torch.cuda.current_device(), threading.get_ident())
        s = _CudaTiming._streams.get(key)
        if s is None:
            s = _CudaTiming._streams[key] = torch.cuda.Stream(dev)
        self.stream = s

    def context(self) -> Any:
        import torch

        return torch.cuda.stream(self.stream)

    def sync(self) -> None:
        self.stream.synchronize()

    def time(self, fn: Any) -> float:
        return self.timed([fn])[0]

    def timed(self, calls: list[Any]) -> list[float]:
        import torch

        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(calls) + 1)]
        with torch.cuda.stream(self.stream):
            ev[0].record(self.stream)
            for fn, e in zip(calls, ev[1:]):
                fn()
                e.record(self.stream)
        ev[-1].synchronize()
        return [x.elapsed_time(y) for x, y in zip(ev, ev[1:])]

    def capture(self, fn: Any, iters: int) -> Any:
        """``fn`` ``iters`` times in a CUDA graph captured on this stream; its replay. Not
        torch.cuda.graph: that synchronizes the device (the op's streams may hold work
        waiting on peers) and empties the allocator's cache. Errors of this thread only
        (``thread_local``): other threads go on as they were. The capture is ended whatever
        ``fn`` raised."""
        import torch

        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gluon engine: no measuring inside a CUDA graph capture")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            g.capture_begin(capture_error_mode="thread_local")
            try:
                for _ in range(iters):
                    fn()
            finally:
                g.capture_end()
        return g.replay


_timing = _CudaTiming
"""Makes the measurement's timing for a device (a stand-in in the CPU tests)."""
