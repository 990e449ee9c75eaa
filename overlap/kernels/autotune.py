"""Pick a ``GemmConfig`` per GEMM shape by timing candidates on the device; cache the winners.

    cfg = tune_gemm(m, n, k, dtype=torch.bfloat16, device=dev, b_kn=False)

A shape is timed once per process; winners are also kept in a JSON file when
``OVERLAP_GEMM_CACHE`` names one (read at first use, written after each new
tuning), keyed by GPU name, shape, dtype, B layout and the BLOCK_M asked for.
The timing runs the tile GEMM alone over every SM, without waits (a satisfied
wait costs nothing measurable, see the benchmarks), on random inputs.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
from dataclasses import asdict
from typing import Any

from .tile_gemm import GemmConfig

__all__ = ["CANDIDATES", "tune_gemm", "cached_configs"]

CANDIDATES: tuple[GemmConfig, ...] = (
    GemmConfig(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8),
    GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=8),
    GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=4, num_warps=4),
    GemmConfig(block_m=128, block_n=64, block_k=64, num_stages=4, num_warps=4),
    GemmConfig(block_m=64, block_n=256, block_k=64, num_stages=4, num_warps=4),
    GemmConfig(block_m=64, block_n=128, block_k=64, num_stages=4, num_warps=4),
)
"""Tried in this order; configs that fail to compile or fit are skipped."""

_lock = threading.Lock()
_cache: dict[str, dict[str, Any]] = {}
_loaded = False


def _key(gpu: str, m: int, n: int, k: int, dtype: Any, b_kn: bool, block_m: int | None) -> str:
    return f"{gpu}|{m}x{n}x{k}|{str(dtype).replace('torch.', '')}|{'kn' if b_kn else 'nk'}|bm={block_m or 'any'}"


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    path = os.environ.get("OVERLAP_GEMM_CACHE")
    if path and os.path.exists(path):
        try:
            with open(path) as f:
                _cache.update(json.load(f))
        except (OSError, ValueError):
            pass  # an unreadable cache only costs a re-tune


def _save() -> None:
    path = os.environ.get("OVERLAP_GEMM_CACHE")
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(_cache, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def cached_configs() -> dict[str, dict[str, Any]]:
    """Every tuned entry: key -> {"config": {...}, "ms": {config str: ms}}."""
    with _lock:
        _load()
        return dict(_cache)


def _time(fn: Any, reps: int = 5, iters: int = 10) -> float:
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


def tune_gemm(m: int, n: int, k: int, *, dtype: Any, device: Any, b_kn: bool = False, block_m: int | None = None,
              candidates: tuple[GemmConfig, ...] | None = None, grid: int | None = None) -> GemmConfig:
    """The fastest of ``candidates`` (default ``CANDIDATES``) for C[m, n] = A[m, k] @ B[k, n],
    restricted to ``block_m`` when given (ops whose flags map row blocks need it).
    ``b_kn``: B row-major [K, N] (True) or the [N, K] storage of ``w.t()`` (False)."""
    import torch

    from ..policies import Segment, build_tile_table
    from .tile_gemm import launch_tile_gemm

    device = torch.device(device)
    gpu = torch.cuda.get_device_name(device)
    key = _key(gpu, m, n, k, dtype, b_kn, block_m)
    with _lock:
        _load()
        hit = _cache.get(key)
    if hit is not None:
        return GemmConfig(**hit["config"])
    cands = [c for c in (candidates or CANDIDATES) if block_m is None or c.block_m == block_m]
    if not cands:
        raise ValueError(f"no candidate config has block_m={block_m}")
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, dtype=dtype, generator=g)
    w = torch.randn(n, k, device=device, dtype=dtype, generator=g) / k ** 0.5
    b = w.t().contiguous() if b_kn else w.t()
    c = torch.empty(m, n, device=device, dtype=dtype)
    sms = grid or torch.cuda.get_device_properties(device).multi_processor_count
    timings: dict[str, float] = {}
    best, best_ms = None, float("inf")
    for cfg in cands:
        table = torch.tensor(build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, cfg.block_m,
                                              cfg.block_n), dtype=torch.int32, device=device)
        try:
            ms = _time(lambda: launch_tile_gemm(a, b, c, table, grid=sms, config=cfg))
        except Exception:  # noqa: BLE001  (does not compile or fit: skip it)
            timings[str(cfg)] = float("nan")
            continue
        timings[str(cfg)] = ms
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError(f"no GEMM config ran for {m}x{n}x{k} {dtype}")
    with _lock:
        _cache[key] = {"config": asdict(best), "ms": timings}
        _save()
    return best
