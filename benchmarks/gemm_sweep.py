"""The tuned tile GEMM against cuBLAS on 40+ layer shapes of GPT-3, LLaMA, Qwen and Mixtral (one GPU).

    python benchmarks/gemm_sweep.py [--out DIR] [--quick] [--max-seconds S] [--rounds 7] [--workers 12]
                                    [--no-flatten] [--gluon] [--wait-chunks N] [--m-at-least M]

Shapes (``sweep_shapes``): M (tokens) from 512 to 32768; N and K from each model's
hidden and FFN sizes divided by a tensor-parallel degree of 1, 2, 4 or 8, as the
column-parallel (qkv, fc1: N = out / TP, K = hidden) and row-parallel (proj, fc2:
N = hidden, K = in / TP) layers see them; both B layouts (``nk``: the ``w.t()`` of an
nn.Linear weight, ``kn``: row-major [K, N]), bf16 and fp16.

The GEMM alone waits on no flag, so the tuner's shortlists hold the flattened configs and
the tail launches too (``GemmConfig.flatten``, ``GemmConfig.tail_block_m``,
``tune_gemm(flatten=True)``; run through ``launch_gemm``); ``--no-flatten`` leaves them
out, which is what an op whose tiles wait can take.

First every config the tuner will try (``overlap.kernels.autotune.shortlist``) is
compiled once in a pool of processes (Triton's on-disk cache then serves the tuner);
then per shape: ``tune_gemm`` (its wall time is the tuner's cost for a new shape), and
interleaved rounds of cuBLAS (``torch.mm``) and the tuned tile GEMM over every SM, each
timed as CUDA-graph replays (host launch cost left out), medians kept. Beside the GEMM
alone (``tile_ms``), ``wait_ms`` is the GEMM as the consumer ops run it: over the table
``all_reduce_matmul`` builds, its rows in the op's chunks (one per 2048 rows, 1 to 4;
``--wait-chunks 4`` fixes 4 at every M, as this column was measured before), whose flags
are already set (``wait_table``), of the per-tile kernel's tuned
tile (``tune_gemm`` without the flattened configs), on the engine the ops pick
(``overlap.kernels.engine.engine_plan``: the tile GEMM or the Gluon GEMM, measured; its
pick in ``wait_engine``); ``tile_wait_ms`` is the tile GEMM alone on that table. Where
the engine measured, each of its Gluon candidates is timed here too, on that table as the
engine runs it (``engine_cands_ms``, with the tile GEMM's ``tile_wait_ms``; the fastest
``engine_best``, ``engine_pick_vs_best``: its time over the pick's). So these
figures are what waiting on flags costs when nothing is late (their kernels, with waits,
are built at their first use; the Gluon configs the engine measures are built in the pool too, waiting). ``--gluon`` adds the Gluon GEMM (``overlap.kernels.gluon_gemm``): each of
its configs alone and on the same kind of waiting table, the fastest of each kept
(``gluon_ms``, ``gluon_wait_ms``). ``--posts`` adds ``post_ms``: the GEMM as the producer ops run it (the same row chunks, each
tile posting to its chunk's flag, waiting on none) on the engine the ops pick (the Gluon
GEMM's posts among the candidates), and
``alone_best_vs_cublas``, the faster of it and ``tile_ms`` (the producer ops' tuner picks
between the flattened tile GEMM and the per-tile one). With
``--max-seconds`` no new shape is started once that much time has passed; the JSON says
which shapes were left out.

Writes ``gemm_sweep.json`` ({"context", "summary", "rows"}), ``gemm_sweep.md`` (the
table) and the tuner's cache ``gemm_cache.json`` (``OVERLAP_GEMM_CACHE``, unless set).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from typing import Any, Iterable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

M_VALUES = (512, 1024, 2048, 4096, 8192, 16384, 32768)
TPS = (1, 2, 4, 8)
MODELS = {  # hidden, FFN (per expert for the MoE models)
    "gpt3-175b": (12288, 49152),
    "llama2-7b": (4096, 11008),
    "llama3-8b": (4096, 14336),
    "llama2-70b": (8192, 28672),
    "llama3-405b": (16384, 53248),
    "qwen2-7b": (3584, 18944),
    "qwen2.5-72b": (8192, 29568),
    "mixtral-8x7b": (4096, 14336),
    "mixtral-8x22b": (6144, 16384),
}
MAX_TFLOP = 16.0
"""Shapes over this many TFLOP (2 M N K) are left out: about 20 ms each on an H200,
so the sweep's tuning and timing stay within one short run."""


def layer_shapes(hidden: int, ffn: int, tp: int) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear of a transformer block on one of ``tp`` ranks."""
    return {"qkv": (3 * hidden // tp, hidden), "proj": (hidden, hidden // tp),
            "fc1": (ffn // tp, hidden), "fc2": (hidden, ffn // tp)}


def sweep_shapes(count: int = 48, seed: int = 0, max_tflop: float = MAX_TFLOP) -> list[dict[str, Any]]:
    """``count`` distinct (M, N, K, B layout, dtype) rows, a deterministic spread: every M
    value and every model appears, both B layouts in both dtypes (every third row ``kn``,
    every fourth fp16); N and K multiples of 16 (TMA rows of 16 bytes, and one Triton
    specialization for all of them)."""
    pool = []
    for model, (hidden, ffn) in MODELS.items():
        for tp in TPS:
            for layer, (n, k) in layer_shapes(hidden, ffn, tp).items():
                for m in M_VALUES:
                    if n % 16 or k % 16 or 2.0 * m * n * k / 1e12 > max_tflop:
                        continue
                    pool.append({"model": model, "tp": tp, "layer": layer, "m": m, "n": n, "k": k})
    random.Random(seed).shuffle(pool)
    picked: list[dict[str, Any]] = []
    seen: set[tuple[int, int, int]] = set()

    def take(row: dict[str, Any]) -> None:
        key = (row["m"], row["n"], row["k"])
        if key not in seen and len(picked) < count:
            seen.add(key)
            picked.append(row)

    # coverage first: each M with each TP degree once, each model once, then the rest
    for m in M_VALUES:
        for tp in TPS:
            row = next((r for r in pool if r["m"] == m and r["tp"] == tp and (m, r["n"], r["k"]) not in seen), None)
            if row is not None:
                take(row)
    for model in MODELS:
        if not any(r["model"] == model for r in picked):
            row = next((r for r in pool if r["model"] == model and (r["m"], r["n"], r["k"]) not in seen), None)
            if row is not None:
                take(row)
    for row in pool:
        take(row)
    out = []
    for i, row in enumerate(picked):
        out.append({**row, "b_layout": "kn" if i % 3 == 2 else "nk", "dtype": "float16" if i % 4 == 3 else "bfloat16"})
    return out


def quick_shapes() -> list[dict[str, Any]]:
    rows = [(512, 4096, 4096, "nk", "bfloat16"), (2048, 8192, 8192, "nk", "bfloat16"),
            (4096, 4096, 8192, "kn", "bfloat16"), (16384, 6144, 4096, "nk", "bfloat16"),
            (12288, 3584, 5120, "kn", "float16"), (8192, 1792, 4096, "nk", "float16")]
    return [{"model": "-", "tp": 0, "layer": "-", "m": m, "n": n, "k": k, "b_layout": b, "dtype": d}
            for m, n, k, b, d in rows]


def summarize(rows: list[dict[str, Any]], target_geo: float = 0.97, target_min: float = 0.93) -> dict[str, Any]:
    """Geo-mean and minimum of the tile GEMM's speed relative to cuBLAS (cublas_ms / tile_ms)
    over the rows that ran, the five slowest shapes, and the rows under ``target_min``."""
    ok = [r for r in rows if r.get("tile_ms") and r.get("cublas_ms")]
    if not ok:
        return {"shapes": 0}
    sp = [r["cublas_ms"] / r["tile_ms"] for r in ok]
    geo = math.exp(sum(math.log(s) for s in sp) / len(sp))
    worst = sorted(ok, key=lambda r: r["cublas_ms"] / r["tile_ms"])
    label = lambda r: f"{r['m']}x{r['n']}x{r['k']} {r['b_layout']} {r['dtype']}"  # noqa: E731
    tune = [r["tune_s"] for r in ok if r.get("tune_s") is not None]
    wsp = [r["cublas_ms"] / r["wait_ms"] for r in ok if r.get("wait_ms")]
    wait = ({"geomean": round(math.exp(sum(math.log(s) for s in wsp) / len(wsp)), 4), "min": round(min(wsp), 4),
             "shapes": len(wsp), "gluon_picked": sum(str(r.get("wait_engine", "")).startswith("gluon") for r in ok),
             "under_0.93": [label(r) for r in ok if r.get("wait_ms") and r["cublas_ms"] / r["wait_ms"] < 0.93]}
            if wsp else None)
    tsp = [r["cublas_ms"] / r["tile_wait_ms"] for r in ok if r.get("tile_wait_ms")]
    tile_wait = ({"geomean": round(math.exp(sum(math.log(s) for s in tsp) / len(tsp)), 4), "min": round(min(tsp), 4),
                  "shapes": len(tsp)} if tsp else None)
    gl_ = {}
    for kind in ("gluon", "gluon_wait"):
        v = [r[f"{kind}_vs_cublas"] for r in ok if r.get(f"{kind}_vs_cublas")]
        if v:
            gl_[kind] = {"geomean": round(math.exp(sum(map(math.log, v)) / len(v)), 4), "min": round(min(v), 4),
                         "shapes": len(v)}
    eng = [r for r in ok if r.get("engine_pick_vs_best")]
    if eng:
        from overlap.kernels.engine import MARGIN

        pv = [r["engine_pick_vs_best"] for r in eng]
        bw = [r["cublas_ms"] / r["engine_cands_ms"][r["engine_best"]] for r in eng]
        gl_["engine"] = {"shapes": len(eng), "pick_is_fastest": sum(r["wait_engine"] == r["engine_best"] for r in eng),
                         "pick_within_margin": sum(v >= 1 / (1 + MARGIN) for v in pv),
                         "pick_vs_fastest_geomean": round(math.exp(sum(map(math.log, pv)) / len(pv)), 4),
                         "pick_vs_fastest_min": round(min(pv), 4),
                         "fastest_wait_geomean": round(math.exp(sum(map(math.log, bw)) / len(bw)), 4),
                         "missed": [[label(r), r["wait_engine"], r["engine_best"], r["engine_pick_vs_best"]]
                                    for r in eng if r["engine_pick_vs_best"] < 1 / (1 + MARGIN)]}
    for kind in ("post", "alone_best"):
        v = [r[f"{kind}_vs_cublas"] for r in ok if r.get(f"{kind}_vs_cublas")]
        if v:
            gl_[kind] = {"geomean": round(math.exp(sum(map(math.log, v)) / len(v)), 4), "min": round(min(v), 4),
                         "shapes": len(v)}
    es = [r["wait_engine_s"] for r in ok if r.get("wait_engine_s") is not None]
    if es:
        gl_["engine_first_launch_s"] = {"median": round(statistics.median(es), 3), "max": round(max(es), 3)}
    return {"shapes": len(ok), "wait": wait, "tile_wait": tile_wait, **gl_, "geomean": round(geo, 4),
            "min": round(min(sp), 4),
            "max": round(max(sp), 4),
            "worst": [[label(r), round(r["cublas_ms"] / r["tile_ms"], 4)] for r in worst[:5]],
            "under_min_target": [label(r) for r in worst if r["cublas_ms"] / r["tile_ms"] < target_min],
            "targets": {"geomean": target_geo, "min": target_min},
            "met": geo >= target_geo and min(sp) >= target_min,
            "tune_s_median": round(statistics.median(tune), 3) if tune else None,
            "tune_s_max": round(max(tune), 3) if tune else None}


def _chunks_words() -> str:
    return (f"{FIXED_CHUNKS[0]} chunk flags" if FIXED_CHUNKS[0]
            else "all_reduce_matmul's chunks: 1 per 2048 rows, 1 to 4")


def markdown(rows: list[dict[str, Any]], summary: dict[str, Any], context: dict[str, Any]) -> str:
    lines = [f"# Tile GEMM vs cuBLAS ({context.get('gpu')}, commit {context.get('commit')})", "",
             "| M | N | K | B | dtype | model / layer / TP | cuBLAS ms | tile ms | tile / cuBLAS speed | config "
             "| tune s | wait ms | wait / cuBLAS speed | wait config | wait engine | tile wait / cuBLAS |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("tile_ms"):
            continue
        lines.append(f"| {r['m']} | {r['n']} | {r['k']} | {r['b_layout']} | {r['dtype']} | "
                     f"{r.get('model')} {r.get('layer')} {r.get('tp')} | {r['cublas_ms']:.4f} | {r['tile_ms']:.4f} | "
                     f"{r['cublas_ms'] / r['tile_ms']:.3f} | {r['config']} | {r.get('tune_s', float('nan')):.2f} | "
                     f"{r.get('wait_ms', float('nan')):.4f} | {r.get('wait_vs_cublas', float('nan')):.3f} | "
                     f"{r.get('wait_config', '-')} | {r.get('wait_engine', '-')} | "
                     f"{r.get('tile_wait_vs_cublas', float('nan')):.3f} |")
    if summary.get("shapes"):
        lines += ["", f"{summary['shapes']} shapes: geo-mean {summary['geomean']:.3f}x cuBLAS, "
                      f"min {summary['min']:.3f}x, max {summary['max']:.3f}x; targets geo-mean >= "
                      f"{summary['targets']['geomean']}, min >= {summary['targets']['min']}: "
                      f"{'met' if summary['met'] else 'missed'}.",
                  f"Slowest: {', '.join(f'{s} {v:.3f}x' for s, v in summary['worst'])}.",
                  (f"As the consumer ops run it ({_chunks_words()}, flags already set, the engine the ops pick, "
                   f"wait ms): geo-mean {summary['wait']['geomean']:.3f}x cuBLAS, min {summary['wait']['min']:.3f}x "
                   f"(Gluon picked on {summary['wait']['gluon_picked']} shapes)"
                   + (f"; the tile GEMM alone on that table: geo-mean {summary['tile_wait']['geomean']:.3f}x, "
                      f"min {summary['tile_wait']['min']:.3f}x." if summary.get("tile_wait") else ".")
                   if summary.get("wait") else "No wait column."),
                  *([f"The engine's pick against the fastest of its candidates timed here: the fastest on "
                     f"{summary['engine']['pick_is_fastest']} of {summary['engine']['shapes']} shapes, within 1% on "
                     f"{summary['engine']['pick_within_margin']}; pick / fastest speed geo-mean "
                     f"{summary['engine']['pick_vs_fastest_geomean']:.3f}, min "
                     f"{summary['engine']['pick_vs_fastest_min']:.3f}; the fastest candidate everywhere would wait at "
                     f"{summary['engine']['fastest_wait_geomean']:.3f}x cuBLAS."] if summary.get("engine") else []),
                  *[f"Gluon GEMM {what} (its fastest config per shape): geo-mean "
                    f"{summary[kind]['geomean']:.3f}x cuBLAS, min {summary[kind]['min']:.3f}x."
                    for kind, what in (("gluon", "alone"), ("gluon_wait", "waiting")) if summary.get(kind)],
                  *[f"{what}: geo-mean {summary[kind]['geomean']:.3f}x cuBLAS, min {summary[kind]['min']:.3f}x "
                    f"({summary[kind]['shapes']} shapes)."
                    for kind, what in (("post", "The GEMM as the producer ops run it (tiles that post), on the "
                                                "engine"),
                                       ("alone_best", "The faster of that and the tile GEMM alone"))
                    if summary.get(kind)],
                  f"Tuning a new shape: median {summary['tune_s_median']} s, max {summary['tune_s_max']} s "
                  "(kernels already compiled)."]
    return "\n".join(lines) + "\n"


def write_results(out: str, context: dict[str, Any], rows: list[dict[str, Any]],
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``gemm_sweep.json`` and ``gemm_sweep.md`` under ``out``; returns the summary."""
    summary = summarize(rows)
    os.makedirs(out, exist_ok=True)
    doc = {"context": context, "summary": summary, **(extra or {}), "rows": rows}
    with open(os.path.join(out, "gemm_sweep.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(out, "gemm_sweep.md"), "w") as f:
        f.write(markdown(rows, summary, context))
    return summary


# ------------------------------------------------------------------------------------
# GPU part
# ------------------------------------------------------------------------------------
def _compile_one(job: tuple[dict[str, Any], str, bool]) -> tuple[dict[str, Any], str, bool, float, str | None]:
    """Build and run one config on a small problem of the same Triton specialization
    (sizes multiples of 16), filling Triton's on-disk cache for the tuner."""
    import torch

    from overlap.kernels.tile_gemm import GemmConfig, launch_gemm

    cfg_d, dtype_s, b_kn = job
    cfg = GemmConfig(**cfg_d)
    dtype = getattr(torch, dtype_s)
    m, n, k = 576, 512, 1024  # at a grid of 8 a tail config runs both its launches
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    b = w.t().contiguous() if b_kn else w.t()
    c = torch.empty(m, n, device="cuda", dtype=dtype)
    t0 = time.perf_counter()
    try:
        launch_gemm(a, b, c, grid=8, config=cfg)
        torch.cuda.synchronize()
        err = None
        rel = ((c.float() - (a @ b).float()).norm() / (a @ b).float().norm()).item()
        if not rel < 2e-2:
            err = f"wrong result: rel err {rel:.2e}"
    except Exception as e:  # noqa: BLE001 - a config that does not build here: reported
        err = f"{type(e).__name__}: {str(e)[:200]}"
    return cfg_d, dtype_s, b_kn, time.perf_counter() - t0, err


def _compile_gluon_one(job: tuple[dict[str, Any], str, bool, bool]) -> tuple[dict[str, Any], str, bool, float,
                                                                           str | None]:
    """Build and run one Gluon config (``gluon_gemm``) alone or waiting on a small problem of
    the sweep's specialization (sizes multiples of 16), filling Triton's on-disk cache so the
    timed process does not build it serially."""
    import torch

    from overlap.kernels.gluon_gemm import GluonGemmConfig, launch_gluon_gemm
    from overlap.policies import Segment, build_tile_table, table_tensor

    fields, dtype_s, b_kn, waiting = job
    gc = GluonGemmConfig(**fields)
    dtype = getattr(torch, dtype_s)
    dev = torch.device("cuda")
    m, n, k = 576, 512, 1024
    a = torch.randn(m, k, device=dev, dtype=dtype)
    w = torch.randn(n, k, device=dev, dtype=dtype)
    b = w.t().contiguous() if b_kn else w.t()
    c = torch.full((m, n), float("nan"), device=dev, dtype=dtype)
    t0 = time.perf_counter()
    try:
        if waiting:
            tab = wait_table(m, n, gc, dev)
            kw = {"flags": torch.ones(WAIT_CHUNKS, dtype=torch.int32, device=dev),
                  "err": torch.zeros(8, dtype=torch.int32, device=dev), "epoch": 1}
        else:
            tab = table_tensor(build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, gc.block_m,
                                                gc.block_n), dev)
            kw = {}
        launch_gluon_gemm(a, b, c, tab, grid=8, config=gc, **kw)
        torch.cuda.synchronize()
        ref = (a @ b).float()
        rel = ((c.float() - ref).norm() / ref.norm()).item()
        err = None if rel < 2e-2 else f"wrong result: rel err {rel:.2e}"
    except Exception as e:  # noqa: BLE001 - a config that does not build here: reported
        err = f"{type(e).__name__}: {str(e)[:200]}"
    return fields, dtype_s, b_kn, time.perf_counter() - t0, err


def gluon_compile_jobs(shapes: Iterable[dict[str, Any]], alone: bool) -> list[tuple[dict[str, Any], str, bool, bool]]:
    """Every (Gluon config, dtype, B layout, waiting) the engine measures on ``shapes``
    (its configs, waiting) and, with ``alone`` (``--gluon``), every config alone too."""
    from dataclasses import asdict

    from overlap.kernels.engine import HALF_CONFIGS, REGS_CONFIGS, TILE_CONFIGS, WIDE_CONFIGS, experimental

    extra = (*REGS_CONFIGS.values(), *WIDE_CONFIGS.values()) if experimental() else ()  # (OVERLAP_GLUON_EXPERIMENTAL=1)
    configs = {g: None for v in (*TILE_CONFIGS.values(), *HALF_CONFIGS.values(), *extra) for g in v}
    if alone:
        from benchmarks.gluon_gemm_bench import VARIANTS
        from overlap.kernels.gluon_gemm import GluonGemmConfig

        configs.update({GluonGemmConfig(**f): None for f in VARIANTS.values()})
    kinds = sorted({(r["dtype"], r["b_layout"] == "kn") for r in shapes})
    return [(asdict(g), d, kn, waiting) for g in configs for d, kn in kinds
            for waiting in ((False, True) if alone else (True,))]


def precompile(jobs: list[tuple[Any, ...]], workers: int, fn: Any = None) -> list[tuple[Any, ...]]:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    fn = fn or _compile_one
    if workers <= 1:
        return [fn(j) for j in jobs]
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        return list(ex.map(fn, jobs))


WAIT_CHUNKS = 4
"""Most chunks of the ``wait_ms`` column's table (flags allocated)."""
FIXED_CHUNKS: list[int] = [0]
"""``--wait-chunks``: 0 (the default) takes the op's own chunk count (``wait_chunks``); a
positive number fixes it (4 at every M was the column's table before 2026-12-04's second run)."""


def wait_chunks(m: int) -> int:
    """Chunks of the ``wait_ms`` table at M rows: ``all_reduce_matmul``'s own policy (one
    per 2048 rows, 1 to 4: fewer chunks at small M, where each chunk would read all of B
    again), unless ``--wait-chunks`` fixed it."""
    from overlap.ops.all_reduce import _default_chunks

    return FIXED_CHUNKS[0] or _default_chunks(m)


def wait_table(m: int, n: int, cfg: Any, device: Any, chunks: int | None = None) -> Any:
    """The table ``all_reduce_matmul`` builds for C[m, n] at ``cfg``'s tile: ``chunks``
    (default ``wait_chunks(m)``) segments of rows in arrival order, sized as the op sizes
    them (multiples of 128 rows but the last), each tile waiting on its segment's flag
    (index = segment)."""
    from overlap.policies import build_tile_table, row_chunk_segments, table_tensor

    chunks = min(chunks or wait_chunks(m), WAIT_CHUNKS)
    _sizes, segs = row_chunk_segments(m, chunks, 128)
    # the op's default group_m (8), not the tuned config's: the op builds its table so
    return table_tensor(build_tile_table(segs, n, cfg.block_m, cfg.block_n), device)


def post_table(m: int, n: int, cfg: Any, device: Any, chunks: int | None = None) -> Any:
    """``wait_table``'s row chunks as a posting table: each tile posts to its chunk's flag
    (index = chunk) once stored, and waits on none (the producer ops' own tables chunk rows
    by 1024 and cut them per row bucket: this is the same GEMM's posts, not their table)."""
    import numpy as np

    from overlap import protocol as P
    from overlap.policies import Segment, build_tile_table, row_chunk_segments, table_tensor

    chunks = min(chunks or wait_chunks(m), WAIT_CHUNKS)
    _sizes, segs = row_chunk_segments(m, chunks, 128)
    posting = [Segment(a_src=g.a_src, a_row=g.a_row, c_row=g.c_row, rows=g.rows) for g in segs]
    table = build_tile_table(posting, n, cfg.block_m, cfg.block_n, array=True)
    table[:, P.COL_POST] = np.repeat(np.arange(len(posting)), [-(-g.rows // cfg.block_m) * -(-n // cfg.block_n)
                                                               for g in posting])
    return table_tensor(table, device)


def run_shape(row: dict[str, Any], rounds: int, sms: int, flatten: bool = True, gluon: bool = False,
              posts: bool = False) -> dict[str, Any]:
    """One shape: tune, then time cuBLAS, the tile GEMM alone and waiting, and (``gluon``)
    each config of the Gluon GEMM (``benchmarks/gluon_gemm_bench.VARIANTS``) alone and on
    the same kind of waiting table, in interleaved rounds."""
    import torch

    from overlap.kernels.autotune import GraphTimer, _cfg_str, cached_configs, tune_gemm
    from overlap.kernels.engine import EnginePlan, engine_plan
    from overlap.kernels.tile_gemm import launch_gemm, launch_tile_gemm

    m, n, k, b_kn = row["m"], row["n"], row["k"], row["b_layout"] == "kn"
    dtype = getattr(torch, row["dtype"])
    dev = torch.device("cuda")
    before = set(cached_configs())
    t0 = time.perf_counter()
    cfg = tune_gemm(m, n, k, dtype=dtype, device=dev, b_kn=b_kn, flatten=flatten)
    tune_s = time.perf_counter() - t0
    entry = next((v for kk, v in cached_configs().items() if kk not in before), None)
    g = torch.Generator(device=dev).manual_seed(m * 7 + n * 3 + k)
    a = torch.randn(m, k, device=dev, dtype=dtype, generator=g)
    w = torch.randn(n, k, device=dev, dtype=dtype, generator=g) / k ** 0.5
    b = w.t().contiguous() if b_kn else w.t()
    c_ref = torch.empty(m, n, device=dev, dtype=dtype)
    c = torch.empty(m, n, device=dev, dtype=dtype)
    # the GEMM as the consumer ops run it: the per-tile kernel (the tuner without flattened
    # configs), tiles waiting on chunk flags that are already set (epoch 1)
    t0 = time.perf_counter()
    wcfg = tune_gemm(m, n, k, dtype=dtype, device=dev, b_kn=b_kn, flatten=False)
    wait_tune_s = time.perf_counter() - t0
    wtab = wait_table(m, n, wcfg, dev)
    flags = torch.ones(WAIT_CHUNKS, dtype=torch.int32, device=dev)
    err = torch.zeros(8, dtype=torch.int32, device=dev)
    c_w = torch.empty(m, n, device=dev, dtype=dtype)
    c_e = torch.empty(m, n, device=dev, dtype=dtype)
    # the engine the ops pick on this table (measured at its first launch, outside the timers)
    t0 = time.perf_counter()
    ep = engine_plan(a, b, c_e, wtab, flags=flags, err=err, timeout_ns=2_000_000_000, config=wcfg, wait=True)
    ep.launch(ep.operands(a, b), c_e, epoch=1, grid=sms)
    torch.cuda.synchronize()
    engine_s = time.perf_counter() - t0
    wait_engine = getattr(ep, "engine", "tile")
    timers = {"cublas": GraphTimer(lambda: torch.mm(a, b, out=c_ref)),
              "tile": GraphTimer(lambda: launch_gemm(a, b, c, grid=sms, config=cfg)),
              "wait": GraphTimer(lambda: ep.launch(ep.operands(a, b), c_e, epoch=1, grid=sms)),
              "tile_wait": GraphTimer(lambda: launch_tile_gemm(a, b, c_w, wtab, flags=flags, err=err, epoch=1,
                                                               wait=True, grid=sms, config=wcfg))}
    # each candidate the engine measured, timed here as the sweep times (the tile GEMM's is
    # tile_wait): does the engine's pick match the fastest of them?
    if isinstance(ep, EnginePlan):
        for gcfg in ep.configs:
            cc = torch.empty(m, n, device=dev, dtype=dtype)
            timers[f"cand {ep.label(gcfg)}"] = GraphTimer(
                lambda gcfg=gcfg, cc=cc: ep._launch_gluon(gcfg, a, b, None, cc, 1, sms, None, flags, err, None))
    # the GEMM as the producer ops run it (``posts``): the per-tile table of all_reduce_matmul's
    # row chunks, each tile posting to its chunk's flag (scratch flags: the counts are never
    # read here), on the engine (the Gluon GEMM's posts among its candidates)
    pp = None
    if posts:
        ptab = post_table(m, n, wcfg, dev)
        pflags = torch.zeros(WAIT_CHUNKS, dtype=torch.int32, device=dev)
        c_p = torch.empty(m, n, device=dev, dtype=dtype)
        pp = engine_plan(a, b, c_p, ptab, flags=pflags, err=err, timeout_ns=1, config=wcfg, post=True,
                         counter=torch.zeros(4, dtype=torch.int32, device=dev))
        pp.launch(pp.operands(a, b), c_p, epoch=1, grid=sms)
        torch.cuda.synchronize()
        # (the dispatch counter zeroed per launch, as the ops' calls zero their words)
        timers["post"] = GraphTimer(lambda: (pp.counter.zero_(), pp.launch(pp.operands(a, b), c_p, epoch=1,
                                                                           grid=sms)))
    g_runs = _gluon_runs(a, b, m, n, flags, err, sms) if gluon else {}
    for kk, (fn, _out) in g_runs.items():
        timers[kk] = GraphTimer(fn)
    times: dict[str, list[float]] = {kk: [] for kk in timers}
    for _ in range(rounds):  # interleaved: drifts of clock and temperature hit both alike
        for kk, t in timers.items():
            times[kk].append(t.ms())
    c.fill_(float("nan"))
    c_w.fill_(float("nan"))
    c_e.fill_(float("nan"))
    ep.launch(ep.operands(a, b), c_e, epoch=1, grid=sms)
    launch_gemm(a, b, c, grid=sms, config=cfg)
    launch_tile_gemm(a, b, c_w, wtab, flags=flags, err=err, epoch=1, wait=True, grid=sms, config=wcfg)
    torch.mm(a, b, out=c_ref)
    ref = c_ref.float()
    rel = ((c.float() - ref).norm() / ref.norm()).item()
    rel_w = ((c_e.float() - ref).norm() / ref.norm()).item()
    rel_tw = ((c_w.float() - ref).norm() / ref.norm()).item()
    if int(err[0]) != 0:
        raise RuntimeError(f"wait_ms: a wait failed on flags already set: error word {err.tolist()}")
    cb, tl_ = statistics.median(times["cublas"]), statistics.median(times["tile"])
    wt, twt = statistics.median(times["wait"]), statistics.median(times["tile_wait"])
    extra = _gluon_fields(g_runs, times, cb, ref) if gluon else {}
    if pp is not None:
        # (the dispatch counter and the post flags from the timed replays: zeroed, then the
        # result recomputed into a NaN-poisoned C)
        pp.counter.zero_()
        c_p.fill_(float("nan"))
        pp.launch(pp.operands(a, b), c_p, epoch=1, grid=sms)
        torch.cuda.synchronize()
        pm = statistics.median(times["post"])
        extra.update({"post_ms": round(pm, 5), "post_vs_cublas": round(cb / pm, 4),
                      "post_engine": getattr(pp, "engine", "tile"), "post_engine_why": getattr(pp, "why", None),
                      "post_rel_err_vs_cublas": ((c_p.float() - ref).norm() / ref.norm()).item(),
                      "alone_best_vs_cublas": round(cb / min(tl_, pm), 4)})
    if int(err[0]) != 0:
        raise RuntimeError(f"gluon: a wait failed on flags already set: error word {err.tolist()}")
    cands = {"tile": twt, **{kk[5:]: statistics.median(v) for kk, v in times.items() if kk.startswith("cand ")}}
    if len(cands) > 1:
        best = min(cands, key=cands.get)
        extra.update({"engine_cands_ms": {kk: round(v, 5) for kk, v in cands.items()}, "engine_best": best,
                      "engine_pick_vs_best": round(cands[best] / cands[wait_engine], 4)
                      if wait_engine in cands else None})
    flops = 2.0 * m * n * k
    ratios = sorted(x / y for x, y in zip(times["cublas"], times["tile"]))
    return {**row, "cublas_ms": round(cb, 5), "tile_ms": round(tl_, 5), "speed_vs_cublas": round(cb / tl_, 4),
            "wait_ms": round(wt, 5), "wait_vs_cublas": round(cb / wt, 4), "wait_config": _cfg_str(wcfg),
            "wait_chunks": min(wait_chunks(m), WAIT_CHUNKS),
            "wait_tune_s": round(wait_tune_s, 3), "wait_rel_err_vs_cublas": rel_w,
            "wait_engine": wait_engine, "wait_engine_s": round(engine_s, 3),
            "wait_engine_why": getattr(ep, "why", None),
            "tile_wait_ms": round(twt, 5), "tile_wait_vs_cublas": round(cb / twt, 4),
            "tile_wait_rel_err_vs_cublas": rel_tw,
            "ratio_range": [round(ratios[0], 4), round(ratios[-1], 4)],
            "cublas_tflops": round(flops / cb / 1e9, 1), "tile_tflops": round(flops / tl_ / 1e9, 1),
            "config": _cfg_str(cfg), "config_fields": {f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
            "tune_s": round(tune_s, 3), "candidates_ms": entry["ms"] if entry else None,
            "rel_err_vs_cublas": rel, "iters_per_replay": {kk: t.iters for kk, t in timers.items()},
            "graphs": all(t.graph is not None for t in timers.values()), "times": times, **extra}


def _gluon_runs(a: Any, b: Any, m: int, n: int, flags: Any, err: Any, sms: int) -> dict[str, tuple[Any, Any]]:
    """name -> (launch, its C) for each Gluon config alone ("gluon <v>") and waiting on the
    ``wait_table`` of its tile ("gluon_wait <v>", flags already set)."""
    import torch

    from benchmarks.gluon_gemm_bench import VARIANTS
    from overlap.kernels.gluon_gemm import GluonGemmConfig, launch_gluon_gemm
    from overlap.policies import Segment, build_tile_table, table_tensor

    runs: dict[str, tuple[Any, Any]] = {}
    for name, fields in VARIANTS.items():
        gc = GluonGemmConfig(**fields)
        alone = table_tensor(build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, gc.block_m,
                                              gc.block_n), a.device)
        waiting = wait_table(m, n, gc, a.device)
        for kind, tab, kw in (("gluon", alone, {}), ("gluon_wait", waiting, {"flags": flags, "err": err, "epoch": 1})):
            c = torch.empty(m, n, device=a.device, dtype=a.dtype)
            runs[f"{kind} {name}"] = ((lambda c=c, tab=tab, gc=gc, kw=kw:
                                       launch_gluon_gemm(a, b, c, tab, grid=sms, config=gc, **kw)), c)
    return runs


def _gluon_fields(runs: dict[str, tuple[Any, Any]], times: dict[str, list[float]], cb: float,
                  ref: Any) -> dict[str, Any]:
    """The fastest Gluon config alone and waiting (ms, config, speed against cuBLAS, the
    relative error of its result, recomputed into a NaN-poisoned C), and every config's ms."""
    out: dict[str, Any] = {"gluon_ms_all": {kk: round(statistics.median(times[kk]), 5) for kk in runs}}
    for kind in ("gluon", "gluon_wait"):
        names = [kk for kk in runs if kk.split(" ")[0] == kind]
        best = min(names, key=lambda kk: statistics.median(times[kk]))
        fn, c = runs[best]
        c.fill_(float("nan"))
        fn()
        ms = statistics.median(times[best])
        out.update({f"{kind}_ms": round(ms, 5), f"{kind}_config": best.split(" ")[1],
                    f"{kind}_vs_cublas": round(cb / ms, 4),
                    f"{kind}_rel_err_vs_cublas": ((c.float() - ref).norm() / ref.norm()).item()})
    return out


def compile_jobs(shapes: Iterable[dict[str, Any]], sms: int, ws: bool,
                 flatten: bool = True) -> list[tuple[dict[str, Any], str, bool]]:
    """Every (config, dtype, B layout) the tuner's shortlists hold for ``shapes``."""
    from dataclasses import asdict

    from overlap.kernels.autotune import shortlist

    jobs, seen = [], set()
    for r in shapes:
        for cfg in shortlist(r["m"], r["n"], r["k"], sms=sms, ws=ws, flatten=flatten):
            key = (cfg, r["dtype"], r["b_layout"] == "kn")
            if key not in seen:
                seen.add(key)
                jobs.append((asdict(cfg), r["dtype"], r["b_layout"] == "kn"))
    return jobs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true", help="six shapes")
    ap.add_argument("--count", type=int, default=48, help="shapes of the full sweep")
    ap.add_argument("--max-seconds", type=float, default=None, help="start no new shape after this long")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--m-at-least", type=int, default=0, help="only the shapes of at least this M")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1), help="parallel compiles")
    ap.add_argument("--gluon", action="store_true",
                    help="also time the Gluon GEMM's configs, alone and waiting (sm_90, a Triton with Gluon)")
    ap.add_argument("--wait-chunks", type=int, default=0,
                    help="chunks of the wait_ms table (0: all_reduce_matmul's own policy; 4 was the fixed count "
                         "before)")
    ap.add_argument("--posts", action="store_true",
                    help="also post_ms: the GEMM as the producer ops run it (tiles that post per row chunk) on the "
                         "engine (the Gluon GEMM's posts among its candidates), and "
                         "alone_best: the faster of it and tile_ms")
    ap.add_argument("--no-flatten", action="store_true",
                    help="leave the flattened configs (GemmConfig.flatten) out of the tuner's shortlists")
    ap.add_argument("--engine-eager", action="store_true",
                    help="the engine ranks its candidates by eager rounds (its measurement before graphs), "
                         "to compare the two ways of ranking; use an --out of its own (picks are kept there)")
    ap.add_argument("--engine-warm-ms", type=float, default=None,
                    help="the engine's untimed rounds before its timed ones, for about this long "
                         "(overlap.kernels.engine.WARM_MS; default: the library's)")
    args = ap.parse_args()
    if args.engine_warm_ms is not None:
        if not (math.isfinite(args.engine_warm_ms) and args.engine_warm_ms >= 0):
            sys.exit("--engine-warm-ms must be a finite number >= 0")
        from overlap.kernels import engine as _engine

        _engine.WARM_MS = args.engine_warm_ms
    if not 0 <= args.wait_chunks <= WAIT_CHUNKS:
        sys.exit(f"--wait-chunks must be 0 to {WAIT_CHUNKS}")
    FIXED_CHUNKS[0] = args.wait_chunks
    if args.engine_eager:
        from overlap.kernels import engine as _engine

        def _eager_only(*_a: Any, **_k: Any) -> Any:
            raise RuntimeError("--engine-eager")
        _engine.graph_times = _eager_only  # the engine's fallback: eager rounds
    t_start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("OVERLAP_GEMM_CACHE", os.path.join(os.path.abspath(args.out), "gemm_cache.json"))
    import torch

    if not torch.cuda.is_available():
        sys.exit("gemm_sweep.py times on a CUDA GPU; none is visible here")
    from benchmarks.context import run_context
    from overlap.kernels import engine as _eng
    from overlap.kernels.autotune import note_failed
    from overlap.kernels.tile_gemm import GemmConfig, warp_specialize_supported

    shapes = [r for r in (quick_shapes() if args.quick else sweep_shapes(args.count)) if r["m"] >= args.m_at_least]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ws = warp_specialize_supported(0)
    flatten = not args.no_flatten
    jobs = compile_jobs(shapes, sms, ws, flatten)
    print(f"{len(shapes)} shapes; compiling {len(jobs)} (config, dtype, layout) kernels on {args.workers} processes",
          flush=True)
    t0 = time.perf_counter()
    built = precompile(jobs, args.workers)
    compile_wall = time.perf_counter() - t0
    failed = []
    for cfg_d, dtype_s, b_kn, secs, err in built:
        if err is not None:
            failed.append({"config": cfg_d, "dtype": dtype_s, "b_kn": b_kn, "error": err})
            note_failed(GemmConfig(**cfg_d), getattr(torch, dtype_s), b_kn, sms)
            print(f"  does not build: {cfg_d} {dtype_s} {'kn' if b_kn else 'nk'}: {err}", flush=True)
    per = sorted(s for *_, s, e in built if e is None)
    print(f"compiled in {compile_wall:.1f} s wall; one kernel's build and first run: median "
          f"{statistics.median(per) if per else float('nan'):.2f} s, max {max(per) if per else float('nan'):.2f} s; "
          f"{len(failed)} failed", flush=True)
    from overlap.kernels.engine import unavailable

    why_not = unavailable(torch.device("cuda"), torch.bfloat16)
    if why_not is not None:
        print(f"Gluon configs not built in the pool: {why_not}", flush=True)
    else:
        gjobs = gluon_compile_jobs(shapes, args.gluon)
        t0 = time.perf_counter()
        gbuilt = precompile(gjobs, args.workers, _compile_gluon_one)
        gfail = [f"{f} {d} {'kn' if kn else 'nk'}: {e}" for f, d, kn, _s, e in gbuilt if e is not None]
        for line in gfail:
            print(f"  Gluon config does not build: {line}", flush=True)
        print(f"Gluon: compiled {len(gjobs)} kernels in {time.perf_counter() - t0:.1f} s wall; {len(gfail)} failed",
              flush=True)
    context = run_context()
    context.update({"sms": sms, "warp_specialize": ws, "flatten": flatten, "rounds": args.rounds,
                    "wait_chunks": args.wait_chunks or "all_reduce_matmul's (1 per 2048 rows, 1-4)",
                    "timing": "CUDA-graph replays",
                    "engine_warm_ms": _eng.WARM_MS, "engine_ahead": _eng.ahead(),
                    "cmdline": " ".join(sys.argv[1:])})
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for i, row in enumerate(shapes):
        if args.max_seconds is not None and time.perf_counter() - t_start > args.max_seconds:
            skipped = shapes[i:]
            print(f"--max-seconds {args.max_seconds:.0f} spent: {len(skipped)} of {len(shapes)} shapes not run",
                  flush=True)
            break
        try:
            r = run_shape(row, args.rounds, sms, flatten, args.gluon, args.posts)
        except Exception as e:  # noqa: BLE001 - one shape's failure is recorded, the sweep goes on
            r = {**row, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            torch.cuda.synchronize()
        rows.append(r)
        if "error" in r:
            print(f"[{i + 1}/{len(shapes)}] {row['m']}x{row['n']}x{row['k']} {row['b_layout']} {row['dtype']}: "
                  f"ERROR {r['error']}", flush=True)
        else:
            print(f"[{i + 1}/{len(shapes)}] {r['m']:>5}x{r['n']:>5}x{r['k']:>5} {r['b_layout']} {r['dtype']:>8}: "
                  f"cuBLAS {r['cublas_ms']:.4f} ms, tile {r['tile_ms']:.4f} ms = {r['speed_vs_cublas']:.3f}x, "
                  f"waiting {r['wait_ms']:.4f} ms = {r['wait_vs_cublas']:.3f}x ({r['wait_config']}, "
                  f"{r['wait_engine']}; tile GEMM {r['tile_wait_vs_cublas']:.3f}x) "
                  f"({r['config']}; tuned in {r['tune_s']:.2f} s; err {r['rel_err_vs_cublas']:.1e}) "
                  f"[{time.perf_counter() - t_start:.0f} s]", flush=True)
        write_results(args.out, context, rows, {"compile": {"jobs": len(jobs), "wall_s": round(compile_wall, 2),
                                                            "per_kernel_s": [round(s, 2) for s in per],
                                                            "failed": failed},
                                                "not_run": skipped})
    summary = write_results(args.out, context, rows, {
        "compile": {"jobs": len(jobs), "wall_s": round(compile_wall, 2), "per_kernel_s": [round(s, 2) for s in per],
                    "failed": failed},
        "not_run": [{k: r[k] for k in ("m", "n", "k", "b_layout", "dtype")} for r in skipped]})
    print(markdown(rows, summary, context), flush=True)
    if skipped:
        print(f"NOTE: budget spent, {len(skipped)} shapes not run", flush=True)


if __name__ == "__main__":
    main()
