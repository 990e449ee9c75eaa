"""Pick a ``GemmConfig`` per GEMM shape by timing a short, rule-pruned list on the device.

    cfg = tune_gemm(m, n, k, dtype=torch.bfloat16, device=dev, b_kn=False)

The space (``space()``): tiles 128x256, 256x128, 128x128, 64x256; BLOCK_K 64 and 128;
3, 4 or 5 stages; 4 or 8 warps; the K loop warp-specialized or not; GROUP_M 8 or 16.
Rules drop what cannot or should not run, before anything is timed:

- shared memory: the K loop's ring holds ``stages * (BM * BK + BK * BN) * elem`` bytes,
  which must fit the device's per-block limit (227 KB on an H100 / H200). This leaves
  BLOCK_K 128 only at 128x128 with 3 stages, and 5 stages only at 128x128 and 64x256.
- registers: the fp32 accumulator takes ``BM * BN / (32 * warps)`` registers a thread;
  over 128 of the 255 a thread may hold, the rest of the loop spills (so 128x256 and
  256x128 run on 8 warps only).
- warp specialization only with 8 warps (Triton 3.6's Hopper build of a 4-warp one
  failed to compile) and where ``warp_specialize_supported``.

``shortlist()`` then prunes by shape:

- tile vs. M: a tile taller than M only computes padding; 64-row tiles only where
  M <= ``SMALL_M`` (on taller problems they load each B tile twice as often per flop,
  and the last wave is a small part of the run anyway).
- wave quantization: a persistent grid of ``sms`` programs runs ``ceil(tiles / sms)``
  waves of tiles; each tile shape's modelled time is that count times the tile's work
  over its relative rate (``TILE_RATE``). Tile shapes within ``KEEP_WITHIN`` of the
  best model are kept, at most ``MAX_TILES``, best first.
- per kept tile, at BLOCK_K 64 and 8 warps, the deepest and the next-deepest ring that
  fit (the deepest can still overflow once the epilogue's scratch is added), and the
  deepest warp-specialized; plus BLOCK_K 128 and 4 warps where the rules allow them
  (the deepest ring each). GROUP_M 16 is tried on the winner alone: it
  changes only the table's order, so it costs no compile.
- ``flatten=True`` (the GEMM alone, through ``launch_gemm``): each plain pick also with
  ``GemmConfig.flatten`` (one software pipeline over a program's tiles;
  benchmarks/results/2026-12-02_1xH200_608f1c4); and where a 128x256 or 256x128 tile's
  last partial wave idles ``TAIL_MIN_IDLE`` of the run, the tile's first pick flattened
  with a tail launch of half-size tiles (``GemmConfig.tail_block_m``, ``TAIL_OF``) where
  its first launch has rows and the rest fit one wave of the small tiles (``tail_fits``;
  benchmarks/results/2026-12-02_1xH200_7ecc691). Such a pick is for ``launch_gemm`` only:
  an op takes one launch (``replace(cfg, tail_block_m=0, tail_block_n=0)``).

Each candidate is timed in CUDA-graph replays (host launch cost left out, so small
shapes rank by their kernels) for a few milliseconds of GPU time; then the three fastest
again in three interleaved rounds, whose medians pick (one candidate after another, a drift
of the clocks can rank a config a few percent off: a 2026-12-02 sweep kept a pick that timed
0.91x cuBLAS in its rounds where the day before's pick had timed 0.97x).

Cost per new shape: timing the shortlist is short next to compiling it, where the kernels
are new to the process and to Triton's disk cache; the configs recur from shape to shape,
so compiling is paid once per config, dtype and B layout (figures: docs/experiments.md,
2026-12-01, "The GEMM tuner's rule-pruned space over 48 layer shapes").

The cache: a shape is tuned once per process; with ``OVERLAP_GEMM_CACHE`` naming a
JSON file the winners are also kept there (read at first use, written after each new
tuning). An entry's key holds everything the pick depends on: the GPU's name and SM
count, the torch, Triton and overlap versions, the tuner's space (``SPACE_VERSION``),
M, N, K, dtype, B layout, the BLOCK_M asked for, the grid and the candidate list when
the caller gives one. An entry for the same problem under other versions is stale: it
is ignored and replaced by the new one; an entry that does not parse (another format,
unknown fields, a config the rules reject) is ignored and rewritten. The file is
written whole into a temporary file in its own directory (``tempfile.mkstemp``) and
moved over the old one (``os.replace``), so a reader sees the old file or the new one,
never a torn one; two processes saving at once may each drop the other's newest entry
(the last move wins), which costs only a re-tune.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, replace
from typing import Any, Iterable

from .tile_gemm import GemmConfig

__all__ = ["TILES", "SMEM_LIMIT", "space", "shortlist", "smem_bytes", "rejects", "tune_gemm", "cached_configs",
           "cache_key"]

TILES: tuple[tuple[int, int], ...] = ((128, 256), (256, 128), (128, 128), (64, 256))
"""(BLOCK_M, BLOCK_N) tile shapes of the space."""
BLOCK_KS = (64, 128)
STAGES = (3, 4, 5)
WARPS = (4, 8)
GROUP_MS = (8, 16)

SMEM_LIMIT = 232448
"""Shared memory a block may opt into on an H100 / H200 (227 KB); the device's own
figure is used where torch reports it."""
MAX_ACC_REGS = 128
"""fp32 accumulator registers per thread above which a config is dropped."""
SMALL_M = 2048
"""64-row tiles are tried only up to this M."""
TILE_RATE = {(128, 256): 1.0, (256, 128): 1.0, (128, 128): 0.88, (64, 256): 0.8}
"""Relative MMA rate of one full wave of each tile shape: smaller tiles load more bytes per
flop (a 128x128 tile 1.33x, a 64x256 one 1.67x a 128x256's). A prior for ranking
tile shapes by wave quantization only: the timing decides among those kept."""
TAIL_OF: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {(128, 256): ((64, 256), (128, 128)),
                                                              (256, 128): ((128, 128),)}
"""Tail tiles tried after each big tile (``GemmConfig.tail_block_m``): half its size."""
TAIL_MIN_IDLE = 0.02
"""With ``flatten`` (the GEMM alone), a big tile whose last partial wave leaves at least this
part of the run idle (``partial_wave``) is also tried with a tail launch of each ``TAIL_OF``
tile where that splits the shape usefully (``tail_fits``)."""
KEEP_WITHIN = 1.10
MAX_TILES = 2
SPACE_VERSION = 5
"""Bumped when the space or the rules change: older cache entries are then stale."""

_lock = threading.Lock()
_cache: dict[str, dict[str, Any]] = {}
_loaded = False
_failed: set[tuple[Any, ...]] = set()
_FORMAT = 1


# ------------------------------------------------------------------------------------
# the space and its rules
# ------------------------------------------------------------------------------------
def smem_bytes(cfg: GemmConfig, elem_bytes: int = 2) -> int:
    """Bytes of the K loop's shared-memory ring: ``stages * (BM * BK + BK * BN) * elem``."""
    return cfg.num_stages * (cfg.block_m * cfg.block_k + cfg.block_k * cfg.block_n) * elem_bytes


def rejects(cfg: GemmConfig, *, smem_limit: int = SMEM_LIMIT, elem_bytes: int = 2) -> str | None:
    """Why the static rules drop ``cfg`` (shared memory, registers, warp specialization),
    or None when it may run."""
    need = smem_bytes(cfg, elem_bytes)
    if need > smem_limit:
        return f"shared memory: {need} B > {smem_limit} B"
    regs = cfg.block_m * cfg.block_n // (32 * cfg.num_warps)
    if regs > MAX_ACC_REGS:
        return f"registers: {regs} accumulator registers a thread > {MAX_ACC_REGS}"
    if cfg.warp_specialize and cfg.num_warps != 8:
        return "warp specialization needs 8 warps"
    if cfg.tail_block_m:
        from .tile_gemm import tail_config

        why = rejects(tail_config(cfg), smem_limit=smem_limit, elem_bytes=elem_bytes)
        if why is not None:
            return f"tail launch: {why}"
    return None


def space(*, ws: bool = True, smem_limit: int = SMEM_LIMIT, elem_bytes: int = 2) -> list[GemmConfig]:
    """Every config of the space that the static rules keep (``ws``: with the
    warp-specialized ones)."""
    out = []
    for bm, bn in TILES:
        for bk in BLOCK_KS:
            for st in STAGES:
                for nw in WARPS:
                    for w in ((False, True) if ws else (False,)):
                        for gm in GROUP_MS:
                            cfg = GemmConfig(block_m=bm, block_n=bn, block_k=bk, num_stages=st, num_warps=nw,
                                             warp_specialize=w, group_m=gm)
                            if rejects(cfg, smem_limit=smem_limit, elem_bytes=elem_bytes) is None:
                                out.append(cfg)
    return out


CANDIDATES: tuple[GemmConfig, ...] = tuple(space())
"""The whole space that the static rules keep (``space()``), at the H100 / H200 limit."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def wave_model(m: int, n: int, bm: int, bn: int, sms: int) -> float:
    """Modelled time of a tile shape, in units of one 128x256 tile: waves of the
    persistent grid times the tile's work over its rate (``TILE_RATE``)."""
    tiles = _cdiv(m, bm) * _cdiv(n, bn)
    return _cdiv(tiles, sms) * (bm * bn / (128 * 256)) / TILE_RATE[(bm, bn)]


def shortlist(m: int, n: int, k: int, *, sms: int, block_m: int | None = None, ws: bool = True,
              smem_limit: int = SMEM_LIMIT, elem_bytes: int = 2, flatten: bool = False) -> list[GemmConfig]:
    """The configs ``tune_gemm`` times for this shape (before its GROUP_M step), best
    tile shape first; ``block_m`` restricts the tile height (the tile-vs-M rule then
    yields to it); ``flatten``: each pick that is not warp-specialized also flattened, and
    the tail launches (``TAIL_MIN_IDLE``)."""
    tiles = [(bm, bn) for bm, bn in TILES if block_m is None or bm == block_m]
    if block_m is None:
        fit = [(bm, bn) for bm, bn in tiles if bm <= max(m, 64) and (bm > 64 or m <= SMALL_M)]
        tiles = fit or tiles
    est = {t: wave_model(m, n, *t, sms) for t in tiles}
    best = min(est.values()) if est else 0.0
    kept = sorted((t for t in tiles if est[t] <= KEEP_WITHIN * best), key=lambda t: (est[t], TILES.index(t)))
    kept = kept[:MAX_TILES]
    ok = space(ws=ws, smem_limit=smem_limit, elem_bytes=elem_bytes)
    out: list[GemmConfig] = []
    for bm, bn in kept:
        mine = [c for c in ok if (c.block_m, c.block_n) == (bm, bn) and c.group_m == GROUP_MS[0]]

        def deepest(bk: int, nw: int, w: bool, skip: int = 0) -> GemmConfig | None:
            got = sorted((c for c in mine if (c.block_k, c.num_warps, c.warp_specialize) == (bk, nw, w)),
                         key=lambda c: -c.num_stages)
            return got[skip] if len(got) > skip else None

        picks = [deepest(64, 8, False), deepest(64, 8, False, 1)]
        if ws:
            picks.append(deepest(64, 8, True))
        picks += [deepest(128, 8, False), deepest(64, 4, False)]
        for c in picks:
            if c is not None and c not in out:
                out.append(c)
            if flatten and c is not None and not c.warp_specialize and replace(c, flatten=True) not in out:
                out.append(replace(c, flatten=True))
        first = picks[0]
        if flatten and first is not None and (bm, bn) in TAIL_OF and partial_wave(m, n, bm, bn, sms) >= TAIL_MIN_IDLE:
            for tm, tn in TAIL_OF[(bm, bn)]:
                tc = replace(first, flatten=True, tail_block_m=tm, tail_block_n=tn)
                if tail_fits(m, n, tc, sms) and rejects(tc, smem_limit=smem_limit, elem_bytes=elem_bytes) is None:
                    out.append(tc)
    return out


def tail_fits(m: int, n: int, cfg: GemmConfig, sms: int) -> bool:
    """Whether a tail config splits this shape usefully: its first launch has rows
    (``tail_rows`` > 0) and the rows left fit one wave of the tail's tiles."""
    from .tile_gemm import tail_rows

    m1 = tail_rows(m, n, cfg, sms)
    return 0 < m1 < m and _cdiv(m - m1, cfg.tail_block_m) * _cdiv(n, cfg.tail_block_n) <= sms


def partial_wave(m: int, n: int, bm: int, bn: int, sms: int) -> float:
    """The part of a persistent grid's run its SMs sit idle in the last, partial wave:
    ``1 - tiles / (waves * sms)`` (0 when the waves are full)."""
    tiles = _cdiv(m, bm) * _cdiv(n, bn)
    return 1.0 - tiles / (_cdiv(tiles, sms) * sms)


# ------------------------------------------------------------------------------------
# the cache
# ------------------------------------------------------------------------------------
def device_env(device: Any) -> dict[str, Any]:
    """What a tuned pick depends on besides the problem: GPU, SM count, shared memory a
    block may hold, versions, the tuner's space."""
    import torch
    import triton

    from .. import __version__

    props = torch.cuda.get_device_properties(device)
    smem = int(getattr(props, "shared_memory_per_block_optin", 0) or SMEM_LIMIT)
    return {"gpu": props.name, "sms": int(props.multi_processor_count), "smem": smem, "torch": torch.__version__,
            "triton": triton.__version__, "overlap": __version__, "space": SPACE_VERSION}


def _problem(m: int, n: int, k: int, dtype: Any, b_kn: bool, block_m: int | None, grid: int | None,
             candidates: Iterable[GemmConfig] | None) -> dict[str, Any]:
    p: dict[str, Any] = {"m": int(m), "n": int(n), "k": int(k), "dtype": str(dtype).replace("torch.", ""),
                         "b": "kn" if b_kn else "nk", "block_m": block_m, "grid": grid}
    if candidates is not None:
        p["candidates"] = [_cfg_str(c) for c in candidates]
    return p


def cache_key(env: dict[str, Any], problem: dict[str, Any]) -> str:
    """The JSON cache's key: the environment and the problem, as sorted JSON."""
    return json.dumps({"env": env, "problem": problem}, sort_keys=True, separators=(",", ":"))


def _same_problem_elsewhere(key: str, env: dict[str, Any], problem: dict[str, Any]) -> bool:
    """True for a key of the same problem on the same GPU model and SM count under other
    versions: an entry this process's new one supersedes."""
    try:
        d = json.loads(key)
        e = d["env"]
        return d["problem"] == problem and e.get("gpu") == env["gpu"] and e.get("sms") == env["sms"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


def _parse_entry(entry: Any, smem_limit: int = SMEM_LIMIT) -> GemmConfig | None:
    """The entry's config, or None when it does not parse or the rules reject it."""
    try:
        cfg = GemmConfig(**entry["config"])
    except (TypeError, KeyError, ValueError):
        return None
    return cfg if rejects(cfg, smem_limit=smem_limit) is None else None


def _read_file(path: str, fmt: Any = _FORMAT) -> dict[str, Any]:
    """The file's entries; {} when it is missing, unreadable or of another format than
    ``fmt`` (this cache's by default; the engine picks' file shares the layout)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != fmt or not isinstance(data.get("entries"), dict):
        return {}
    return {k: v for k, v in data["entries"].items() if isinstance(v, dict)}


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    path = os.environ.get("OVERLAP_GEMM_CACHE")
    if path:
        _cache.update(_read_file(path))


def _write_atomic(path: str, data: dict[str, Any]) -> None:
    """``data`` as JSON at ``path``: written to a temporary file in the same directory,
    then moved over ``path`` in one step (a reader never sees a partial file)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would hide the cache from other users
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _save(new_keys: Iterable[str] = (), env: dict[str, Any] | None = None) -> None:
    """Merge this process's entries into the file: entries written meanwhile by other
    processes are kept, those that ``new_keys`` supersede (same problem and GPU, other
    versions) and those that do not parse are dropped. Caller holds ``_lock``."""
    path = os.environ.get("OVERLAP_GEMM_CACHE")
    if not path:
        return
    merged = _read_file(path)
    for key in new_keys:
        if env is not None:
            problem = json.loads(key)["problem"]
            for old in [k for k in merged if k != key and _same_problem_elsewhere(k, env, problem)]:
                del merged[old]
                _cache.pop(old, None)
    merged.update(_cache)
    merged = {k: v for k, v in merged.items() if _parse_entry(v) is not None}
    try:
        _write_atomic(path, {"format": _FORMAT, "entries": merged})
    except OSError:
        pass  # an unwritable cache only costs a re-tune in the next process


def cached_configs() -> dict[str, dict[str, Any]]:
    """Every entry: key -> {"config": {...}, "ms": {config: ms}, "tune_s": s, ...}."""
    with _lock:
        _load()
        return dict(_cache)


# ------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------
def _time(fn: Any, reps: int = 5, iters: int = 10) -> float:
    """Median ms of ``fn`` over ``reps`` event-timed runs of ``iters`` eager calls."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / iters)
    return statistics.median(times)


class GraphTimer:
    """``fn`` captured ``iters`` times in one CUDA graph (iters sized so a replay lasts
    about ``target_ms``); ``ms()`` times one replay per call. Without a graph (capture
    refused) the calls run eagerly. Keeps launch cost on the host out of the figure, so a
    small GEMM ranks by its kernel, as it runs back to back in a model's step."""

    def __init__(self, fn: Any, target_ms: float = 2.0, max_iters: int = 64) -> None:
        import torch

        fn()  # compile, allocate, warm
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        one = max(s.elapsed_time(e), 1e-3)
        self.iters = max(1, min(max_iters, round(target_ms / one)))
        self.fn = fn
        self.graph = None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()  # warm on the capture's side stream, as torch asks
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(self.iters):
                    fn()
            g.replay()
            torch.cuda.synchronize()
            self.graph = g
        except Exception:  # noqa: BLE001 - a capture torch refuses: time eager calls
            torch.cuda.synchronize()
            self.graph = None

    def ms(self) -> float:
        import torch

        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        if self.graph is not None:
            self.graph.replay()
        else:
            for _ in range(self.iters):
                self.fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / self.iters


def _cfg_str(cfg: GemmConfig) -> str:
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.num_stages} w{cfg.num_warps}"
            f"{' ws' if cfg.warp_specialize else ''}{' flat' if cfg.flatten else ''}"
            f"{f' tail{cfg.tail_block_m}x{cfg.tail_block_n}' if cfg.tail_block_m else ''} g{cfg.group_m}")


def _measure(m: int, n: int, k: int, dtype: Any, device: Any, b_kn: bool, cands: list[GemmConfig], sms: int,
             reps: int = 5, group_step: bool = True, finalists: int = 3,
             rounds: int = 3) -> tuple[GemmConfig, dict[str, float]]:
    """Time ``cands`` (then GROUP_M 16 on the winner) on random inputs, then the
    ``finalists`` fastest again in ``rounds`` interleaved rounds (a drift of the clocks
    during the first pass, one candidate after another, cannot pick the winner; the
    op tuners' ``confirm_best`` does the same); the fastest by those rounds' medians, and
    every candidate's ms (NaN: did not build or run; ``"again <config>"``: a finalist's
    median of the rounds)."""
    import torch

    from .tile_gemm import launch_gemm

    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, dtype=dtype, generator=g)
    w = torch.randn(n, k, device=device, dtype=dtype, generator=g) / k ** 0.5
    b = w.t().contiguous() if b_kn else w.t()
    c = torch.empty(m, n, device=device, dtype=dtype)
    timings: dict[str, float] = {}
    best, best_ms = None, float("inf")
    timers: dict[GemmConfig, Any] = {}
    measured: list[tuple[float, GemmConfig]] = []

    def run(cfg: GemmConfig) -> float:
        fail_key = (replace(cfg, group_m=GROUP_MS[0]), str(dtype), b_kn, sms)
        if fail_key in _failed:
            return float("nan")
        try:
            t = timers[cfg] = GraphTimer(lambda: launch_gemm(a, b, c, grid=sms, config=cfg))
            ms = statistics.median(t.ms() for _ in range(reps))
            measured.append((ms, cfg))
            return ms
        except Exception:  # noqa: BLE001  (does not compile or fit: skip it, and remember)
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
            _failed.add(fail_key)
            return float("nan")

    for cfg in cands:
        ms = run(cfg)
        timings[_cfg_str(cfg)] = ms
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is not None and group_step and _cdiv(m, best.block_m) > GROUP_MS[0]:
        for gm in GROUP_MS[1:]:
            cfg = replace(best, group_m=gm)
            ms = run(cfg)
            timings[_cfg_str(cfg)] = ms
            if ms < best_ms:
                best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError(f"no GEMM config ran for {m}x{n}x{k} {dtype}: {timings}")
    top = [cfg for _, cfg in sorted(measured, key=lambda r: r[0])[:max(1, finalists)]]
    if len(top) > 1 and rounds > 0:
        again: dict[GemmConfig, list[float]] = {cfg: [] for cfg in top}
        for _ in range(rounds):
            for cfg in top:
                again[cfg].append(timers[cfg].ms())
        meds = {cfg: statistics.median(v) for cfg, v in again.items()}
        for cfg in top:
            timings[f"again {_cfg_str(cfg)}"] = meds[cfg]
        best = min(top, key=lambda cfg: meds[cfg])  # the first of equals: the first pass's order
    return best, timings


def note_failed(cfg: GemmConfig, dtype: Any, b_kn: bool, sms: int) -> None:
    """Mark a config as one that does not build here (e.g. found by a parallel compile),
    so ``tune_gemm`` skips it in this process."""
    _failed.add((replace(cfg, group_m=GROUP_MS[0]), str(dtype), bool(b_kn), int(sms)))


def tune_gemm(m: int, n: int, k: int, *, dtype: Any, device: Any, b_kn: bool = False, block_m: int | None = None,
              candidates: tuple[GemmConfig, ...] | None = None, grid: int | None = None,
              flatten: bool = False) -> GemmConfig:
    """The fastest config for C[m, n] = A[m, k] @ B[k, n] on ``device``: ``shortlist``'s
    configs (or ``candidates``), then GROUP_M 16 on the winner; restricted to ``block_m``
    when given (ops whose flags map row blocks need it). ``b_kn``: B row-major [K, N]
    (True) or the [N, K] storage of ``w.t()`` (False). ``grid``: the programs the GEMM
    gets (default every SM). ``flatten``: also the flattened configs (``GemmConfig.flatten``)
    and the tail launches (``GemmConfig.tail_block_m``), for a caller whose tiles wait on
    nothing; the pick may then be one (a pick with a tail runs through ``launch_gemm``
    only). Candidates are timed through ``launch_gemm``."""
    import torch

    from .tile_gemm import warp_specialize_supported

    device = torch.device(device)
    env = device_env(device)
    problem = _problem(m, n, k, dtype, b_kn, block_m, grid, candidates)
    if flatten and candidates is None:
        problem["flatten"] = True
    key = cache_key(env, problem)
    with _lock:
        _load()
        hit = _cache.get(key)
    cfg = _parse_entry(hit) if hit is not None else None
    if cfg is not None:
        return cfg
    sms = int(grid or env["sms"])
    if candidates is not None:
        cands = [c for c in candidates if block_m is None or c.block_m == block_m]
    else:
        esize = torch.empty((), dtype=dtype).element_size()
        cands = shortlist(m, n, k, sms=sms, block_m=block_m, ws=warp_specialize_supported(device),
                          smem_limit=int(env.get("smem", SMEM_LIMIT)), elem_bytes=esize, flatten=flatten)
    if not cands:
        raise ValueError(f"no candidate config has block_m={block_m}")
    t0 = time.perf_counter()
    best, timings = _measure(m, n, k, dtype, device, b_kn, cands, sms)
    with _lock:
        _cache[key] = {"config": asdict(best), "ms": timings, "tune_s": round(time.perf_counter() - t0, 3)}
        _save([key], env)
    return best
