"""Regenerate benchmarks/RESULTS.md, and README.md's results block, from the committed runs.

    python benchmarks/make_results.py            # rewrite RESULTS.md and the README block
    python benchmarks/make_results.py --check    # exit 1 if either is out of date
    python benchmarks/make_results.py --readme   # print the README block, write nothing

Input: every ``results.json`` the suite wrote under ``benchmarks/results/`` (``<run>/results.json``,
``<run>/suite/results.json``, ``<run>/suite_agmm/results.json``, ...). Runs without a GPU are
skipped (their figures are not GPU figures). Per op and machine kind (ranks x GPU), the
latest *full* run is shown (the most shapes; the latest date among those), then any later
run of fewer shapes. Tables come from ``benchmarks.suite.report`` (the same code that
writes each run's ``results.md``); the README block is a short table per op from the
latest full runs of the machine kind with the most runs. Then the one-GPU benchmarks, each
from its newest JSON by date: the tile GEMM against cuBLAS (``gemm_sweep.json``, written by
``benchmarks/gemm_sweep.py``), the shapes under the GEMM's per-shape target with what was
measured about each (the newest sweep per GPU and ``benchmarks/gluon_gemm_bench.py``'s rows
of that GPU, ``gemm_gaps_md``), and the MLP chain eager and as a CUDA graph
(``chain_graph.json``, ``benchmarks/chain_graph.py``).

The README block sits between ``<!-- results:start -->`` and ``<!-- results:end -->``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.suite import report  # noqa: E402

START, END = "<!-- results:start -->", "<!-- results:end -->"
COMMAND = "python benchmarks/make_results.py"
OP_ORDER = ("agmm", "armm", "chain")

INTRO = """\
Every op, side by side on 2 GPUs (the same with `launch/mpirun.sh`):

```bash
bash launch/torchrun.sh 2 benchmarks/run.py --ops agmm,armm,chain \\
    --shapes gpt3-175b,llama-70b,comm-heavy --out benchmarks/results/<date>_<gpus>_<commit>
```

Then `{command}` rewrites this file and the README's table.

Columns: communication alone and GEMM alone (the library's communicator, cuBLAS); the
floor, their max (for the chain, producer + consumer alone); the sequential reference
(`*_ref`); the chunked stream-overlap baseline (x2, x4); the library's op after its tuner
ran ("library (tuned)", its pick in the "tuned" column); torch's symm_mem op where one
exists; library / floor; the communication hidden, (sequential - library) / communication
alone; NCCL-tests bus bandwidth; TFLOP/s. ms per call, the median over batches of calls
back to back, of the slowest rank. `python benchmarks/run.py --help` lists the options;
the measurement history and everything tried and reverted is in `docs/experiments.md`.
"""


@dataclass
class Run:
    """One ``results.json`` of the suite."""

    doc: dict
    rel: str  # path from benchmarks/, e.g. results/<folder>/suite/results.json

    @property
    def date(self) -> str:
        return str(self.doc["context"].get("date") or "")

    @property
    def kind(self) -> str:
        return f"{self.doc['world']}x {self.doc['context'].get('gpu')}"

    @property
    def folder(self) -> str:
        return os.path.dirname(self.rel)

    def recs(self, op: str) -> list[dict]:
        return [r for r in self.doc["results"] if r.get("op") == op]


def load_runs(results_dir: str, base: str) -> list[Run]:
    """Every suite ``results.json`` under ``results_dir`` with GPU figures; paths relative to ``base``."""
    runs = []
    for path in sorted(glob.glob(os.path.join(results_dir, "**", "results.json"), recursive=True)):
        with open(path) as f:
            doc = json.load(f)
        if not (isinstance(doc, dict) and {"ops", "results", "context", "world"} <= doc.keys()):
            continue
        if not doc.get("gpu"):
            print(f"skipped (not GPU figures): {path}", file=sys.stderr)
            continue
        runs.append(Run(doc, os.path.relpath(path, base).replace(os.sep, "/")))
    return runs


def ops_in(runs: list[Run]) -> list[str]:
    names = {r["op"] for run in runs for r in run.doc["results"] if "op" in r}
    return sorted(names, key=lambda n: (OP_ORDER.index(n) if n in OP_ORDER else len(OP_ORDER), n))


def select(runs: list[Run], op: str) -> dict[str, tuple[Run, list[Run]]]:
    """Per machine kind: (the latest full run of ``op``, later runs of fewer shapes)."""
    out = {}
    kinds = sorted({r.kind for r in runs if r.recs(op)}, key=lambda k: (int(k.split("x")[0]), k))
    for kind in kinds:
        have = [r for r in runs if r.kind == kind and r.recs(op) and r.doc["ops"][op].get("status") == "ok"]
        if not have:
            continue
        main = max(have, key=lambda r: (len(r.recs(op)), r.date))
        later = sorted((r for r in have if r.date > main.date), key=lambda r: r.date)
        out[kind] = (main, later)
    return out


def short_tuned(t: Any) -> str:
    """The tuner's pick in words: ``{'transport': 'p2p', 'chunks': 4, ...}`` -> ``p2p, 4 chunks``."""
    if not isinstance(t, dict):
        return "" if t is None else str(t)
    if "transport" not in t:  # the chain: a GEMM config per kernel
        return ", ".join(f"{k} {v}" for k, v in t.items())
    words = [str(t["transport"])]
    if t.get("chunks") is not None:
        words.append(f"{t['chunks']} chunk{'s' if t['chunks'] != 1 else ''}")
    if t.get("nccl_ctas") is not None:
        words.append(f"{t['nccl_ctas']} NCCL CTAs")
    if t.get("reduce_ctas") is not None:
        words.append(f"{t['reduce_ctas']} reduce programs beside the GEMM" if t.get("reduce_shared")
                     else f"{t['reduce_ctas']} reduce SMs")
    if t.get("sm_margin"):
        words.append(f"SM margin {t['sm_margin']}")
    if t.get("two_shot"):
        words.append("two-shot")
    if t.get("fold_norm"):
        words.append("norm folded")
    if t.get("split_tail"):
        words.append(f"split tail {t['split_tail']}")
    if t.get("gemm_warp_specialized"):
        words.append("warp-specialized GEMM")
    if t.get("give_back") is False:
        words.append("no give-back")
    return ", ".join(words)


def _source(run: Run, prefix: str) -> str:
    c = run.doc["context"]
    return (f"{str(c.get('date'))[:10]}, {run.kind}, commit {c.get('commit')}, "
            f"`{prefix}{run.folder}/`")


def _table_section(run: Run, op: str, prefix: str) -> list[str]:
    """One run's table of ``op``: context, how to read it, the table, notes, the plot."""
    doc, meta, recs = run.doc, run.doc["ops"][op], run.recs(op)
    parts = list(meta["part_titles"].values())
    floor = (f"floor = max({', '.join(parts)})" if meta["floor"] == "max"
             else f"sequential = {' + '.join(parts)}")
    lines = [f"Run: {report.describe_run(doc)}.", "",
             f"Source: `{prefix}{run.rel}`; command `{doc.get('command', '')}`.", "",
             f"ms per call, median, slowest of {doc['world']} ranks ({doc['timing']}); {floor}."]
    head, rows = report.table(meta, recs)
    lines += ["", report.md_table(head, rows), ""]
    notes = report._notes(meta, recs)
    if notes:
        lines += [f"- {n}" for n in notes] + [""]
    plot = (doc.get("plots") or {}).get(op)
    if plot:
        lines += [f"![{op}]({prefix}{run.folder}/{plot})", ""]
    return lines


def results_md(runs: list[Run], results_dir: str | None = None) -> str:
    out = ["# Benchmark results", "",
           f"Generated by `{COMMAND}` from the committed runs' `results.json`; do not edit by hand.",
           "", INTRO.format(command=COMMAND)]
    for op in ops_in(runs):
        picked = select(runs, op)
        if not picked:
            continue
        main_any = next(iter(picked.values()))[0]
        out += [f"## {main_any.doc['ops'][op]['title']} (`{op}`)", ""]
        for kind, (main, later) in picked.items():
            out += [f"### {kind}: latest full run ({len(main.recs(op))} shapes)", ""]
            out += _table_section(main, op, "")
            for run in later:
                out += [f"### {kind}: a later run of {len(run.recs(op))} shape"
                        f"{'s' if len(run.recs(op)) != 1 else ''}", ""]
                out += _table_section(run, op, "")
    if results_dir is not None:
        out += one_gpu_md(results_dir)
    return "\n".join(out).rstrip() + "\n"


def _latest(results_dir: str, name: str) -> tuple[dict, str] | None:
    """The newest ``name`` (a one-GPU benchmark's JSON) under ``results_dir`` by its context's
    date, with its folder relative to ``results_dir``."""
    found = []
    for path in glob.glob(os.path.join(results_dir, "**", name), recursive=True):
        with open(path) as f:
            doc = json.load(f)
        found.append((str(doc.get("context", {}).get("date", "")), path, doc))
    if not found:
        return None
    _, path, doc = max(found)
    return doc, os.path.relpath(os.path.dirname(path), results_dir).replace(os.sep, "/")


def _context_line(c: dict) -> str:
    return (f"{str(c.get('date'))[:10]}, {c.get('gpu')}, torch {c.get('torch')}, Triton {c.get('triton')}, "
            f"commit {str(c.get('commit'))[:7]}")


def gemm_sweep_md(found: tuple[dict, str]) -> list[str]:
    """The tile GEMM against cuBLAS on every shape of ``benchmarks/gemm_sweep.py``."""
    doc, folder = found
    summ, rows = doc["summary"], doc["rows"]
    t = summ.get("targets", {})
    lines = ["## Tile GEMM against cuBLAS, one GPU (`benchmarks/gemm_sweep.py`)", "",
             f"Run: {_context_line(doc['context'])}; `results/{folder}/gemm_sweep.json`. The tuned tile "
             f"GEMM against `torch.mm`, both timed as CUDA-graph replays in interleaved rounds (medians).", "",
             f"{summ['shapes']} shapes: geo-mean {summ['geomean']:.3f}x cuBLAS (target {t.get('geomean')}), "
             f"min {summ['min']:.3f}x (target {t.get('min')}), max {summ['max']:.3f}x; "
             f"{len(summ.get('under_min_target', []))} shapes under the min target. Tuning a new shape: "
             f"median {summ.get('tune_s_median', float('nan')):.2f} s, max {summ.get('tune_s_max', float('nan')):.2f} s.",
             ""]
    wait = summ.get("wait")
    if wait:
        lines[-1:-1] = ["", f"As the consumer ops run it (`wait_ms`: tiles on chunk flags already set, the engine "
                        f"the ops pick): geo-mean {wait['geomean']:.3f}x cuBLAS, min {wait['min']:.3f}x, "
                        f"{len(wait.get('under_0.93', []))} shapes under 0.93x; Gluon picked on "
                        f"{wait.get('gluon_picked', 0)} of {wait['shapes']}."]
    head = ["M", "N", "K", "B", "dtype", "model / layer / TP", "cuBLAS ms", "tile ms", "tile / cuBLAS", "config",
            *(["wait / cuBLAS", "wait engine"] if wait else [])]
    body = [[r["m"], r["n"], r["k"], r["b_layout"], r["dtype"], f"{r['model']} {r['layer']} {r['tp']}",
             report.fmt(r["cublas_ms"]), report.fmt(r["tile_ms"]), f"{r['speed_vs_cublas']:.3f}", r["config"],
             *([f"{r['wait_vs_cublas']:.3f}" if r.get("wait_vs_cublas") else "-", r.get("wait_engine", "-")]
               if wait else [])]
            for r in sorted(rows, key=lambda r: r["speed_vs_cublas"])]
    return lines + [report.md_table(head, [[str(v) for v in row] for row in body]), ""]


def chain_graph_md(found: tuple[dict, str]) -> list[str]:
    """The MLP chain eager and as a CUDA graph (``benchmarks/chain_graph.py``)."""
    doc, folder = found
    rows = doc["rows"]
    lines = ["## MLP chain, eager and as a CUDA graph, one GPU (`benchmarks/chain_graph.py`)", "",
             f"Run: {_context_line(doc['context'])}; `results/{folder}/chain_graph.json`. ms per call, "
             "median of interleaved rounds; \"graph\": the calls captured in one CUDA graph; \"tile-flag\": "
             "the fastest of RowSync, TileSync and RowSync with fc2 a programmatic dependent launch (\"row "
             "pdl\", where run); \"fc1 + fc2\": the two tile kernels each alone (graph).", ""]
    pdl = any("row pdl graph" in r["ms"] for r in rows)
    own = any("sync own graph" in r["ms"] for r in rows)
    model = any("wave_model" in r for r in rows)
    if own:
        lines[-1:-1] = ["", "\"sync own\": the stream-synced kernels with each GEMM's own pick alone (BLOCK_M 128); "
                        "\"/ stream-sync\" divides by the faster stream sync."]
    if model:
        lines[-1:-1] = ["", "\"model bound\": the chain model's ceiling on tile flags over the best stream sync "
                        "(waves of equal tiles on the SMs, no memory or flag cost; `benchmarks/chain_model.py`), "
                        "with the best tiles and orders / with the tuned ones."]
    head = ["model", "TP", "M", "K", "F", "torch (graph)", "stream-sync (graph)", *(["sync own (graph)"] if own else []),
            "row (graph)", "tile (graph)", *(["row pdl (graph)"] if pdl else []),
            "fc1 + fc2", "tile-flag / stream-sync", "tile-flag / torch", "eager: / stream-sync", "eager: / torch",
            *(["model bound best / tuned"] if model else []), "waves fc1 / fc2"]
    body = []
    for r in rows:
        ms = r["ms"]
        wm = r.get("wave_model")
        body.append([r["model"], r["tp"], r["m"], r["k"], r["f"], report.fmt(ms["torch graph"]),
                     report.fmt(ms["stream-sync graph"]),
                     *([report.fmt(ms["sync own graph"]) if "sync own graph" in ms else "-"] if own else []),
                     report.fmt(ms["row graph"]), report.fmt(ms["tile graph"]),
                     *([report.fmt(ms["row pdl graph"]) if "row pdl graph" in ms else "-"] if pdl else []),
                     report.fmt(r["fc1_plus_fc2_ms"]), f"{r['flag_over_sync_graph']:.3f}x",
                     f"{r['flag_over_torch_graph']:.3f}x", f"{r['flag_over_sync_eager']:.3f}x",
                     f"{r['flag_over_torch_eager']:.3f}x",
                     *([f"{wm['ceiling']:.3f}x / {wm['tuned']:.3f}x" if wm else "-"] if model else []),
                     f"{r['fc1_waves']:.2f} / {r['fc2_waves']:.2f}"])
    return lines + [report.md_table(head, [[str(v) for v in row] for row in body]), ""]


def _newest_per_gpu(results_dir: str, pattern: str) -> list[tuple[dict, str]]:
    """The newest JSON matching ``pattern`` per GPU name (its context's ``gpu``), newest
    first, each with its folder relative to ``results_dir``."""
    best: dict[str, tuple[str, dict, str]] = {}
    for path in glob.glob(os.path.join(results_dir, "**", pattern), recursive=True):
        with open(path) as f:
            doc = json.load(f)
        c = doc.get("context", {})
        if not doc.get("rows"):
            continue
        date, gpu = str(c.get("date", "")), str(c.get("gpu"))
        if gpu not in best or date > best[gpu][0]:
            best[gpu] = (date, doc, os.path.relpath(os.path.dirname(path), results_dir).replace(os.sep, "/"))
    return [(doc, folder) for _d, doc, folder in sorted(best.values(), key=lambda v: v[0], reverse=True)]


def _shape(r: dict) -> tuple:
    return (r["m"], r["n"], r["k"], r["b_layout"], r["dtype"])


def _tile_of(text: str) -> tuple[int, int] | None:
    """(BLOCK_M, BLOCK_N) of a config as the sweep names it ("gluon pp128x128x64 s5",
    "128x256x64 s4 w8 flat g8")."""
    for tok in (text or "").replace("pp", "").split():
        parts = tok.split("x")
        if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
            return int(parts[0]), int(parts[1])
    return None


def _waves(m: int, n: int, tile: tuple[int, int] | None, sms: int) -> tuple[int, float, float] | None:
    """Tiles, waves on ``sms`` SMs and the last wave's fill of an M x N C in ``tile``."""
    if tile is None:
        return None
    tiles = -(-m // tile[0]) * -(-n // tile[1])
    return tiles, tiles / sms, ((tiles % sms) or sms) / sms


def _wave_reason(w: tuple[int, float, float] | None) -> str | None:
    if w is None:
        return None
    _tiles, waves, fill = w
    if waves <= 1 and fill < 0.8:
        return f"one wave {fill:.0%} full"
    if waves > 1 and fill <= 0.5:
        return f"last wave {fill:.0%} full"
    return None


def _bench_best(rows: list[dict]) -> dict[tuple, dict]:
    """Per shape, from ``benchmarks/gluon_gemm_bench.py`` rows: cuBLAS and the fastest Gluon
    variant alone and waiting on set flags (static tiles), in ms."""
    out = {}
    for r in rows:
        ms = r.get("ms", {})
        alone = [v for k, v in ms.items() if k.startswith("gluon_") and not k.startswith(("gluon_wait", "gluon_dyn"))]
        wait = [v for k, v in ms.items() if k.startswith("gluon_wait")]
        if ms.get("cublas") and alone and wait:
            out[_shape(r)] = {"cublas": ms["cublas"], "alone": min(alone), "wait": min(wait)}
    return out


GAP_LIMIT = 0.93
"""A shape is listed in the gaps' table where the GEMM waiting or alone is under this."""


def gemm_gaps_md(results_dir: str) -> list[str]:
    """The shapes under the GEMM's per-shape target, each with what was measured about it
    and the reasons those measurements give (``benchmarks/gemm_sweep.py`` per GPU, with
    ``benchmarks/gluon_gemm_bench.py``'s rows of the same shapes)."""
    sweeps = _newest_per_gpu(results_dir, "gemm_sweep.json")
    if not sweeps or not any("wait_vs_cublas" in r for r in sweeps[0][0]["rows"]):
        return []
    (doc, folder), others = sweeps[0], sweeps[1:]
    gpu = doc["context"].get("gpu")
    sms = int(doc["context"].get("sms") or 132)
    other = [({_shape(r): r for r in d["rows"]}, d["context"].get("gpu")) for d, _f in others]
    bench: dict[tuple, dict] = {}
    bench_from = []
    # the bench rows of the sweep's GPU, newest last (they win); other GPUs' are not mixed in
    found = []
    for path in glob.glob(os.path.join(results_dir, "**", "gluon_*.json"), recursive=True):
        with open(path) as f:
            b = json.load(f)
        if b.get("rows") and b.get("context", {}).get("gpu") == gpu:
            found.append((str(b["context"].get("date", "")), path, b))
    for _date, path, b in sorted(found):
        got = _bench_best(b["rows"])
        if got:
            bench.update(got)
            bench_from.append(os.path.relpath(path, results_dir).replace(os.sep, "/"))

    def under(r: dict) -> bool:
        return (r.get("wait_vs_cublas") or 1) < GAP_LIMIT or r["speed_vs_cublas"] < GAP_LIMIT

    keys = [_shape(r) for r in doc["rows"] if under(r) or any(under(o[_shape(r)]) for o, _g in other
                                                                if _shape(r) in o)]
    rows = {_shape(r): r for r in doc["rows"]}
    head = ["M x N x K", "B", "dtype", "layer", "cuBLAS us", "waiting", "alone", "tiles, waves: waiting / alone",
            "K steps", "pick / fastest", "Gluon alone / waiting (bench)", "reasons measured"]
    body, counts = [], {}
    for key in sorted(keys, key=lambda k: rows[k].get("wait_vs_cublas") or 1):
        r = rows[key]
        m, n, k = key[:3]
        w, a = r.get("wait_vs_cublas") or 0.0, r["speed_vs_cublas"]
        also_w = [o[key].get("wait_vs_cublas") for o, _g in other if key in o and o[key].get("wait_vs_cublas")]
        also_a = [o[key]["speed_vs_cublas"] for o, _g in other if key in o]
        wait_cfg = r.get("wait_engine") if str(r.get("wait_engine", "")).startswith("gluon") else r.get("wait_config")
        ww, wa = _waves(m, n, _tile_of(wait_cfg), sms), _waves(m, n, _tile_of(r.get("config")), sms)
        pick = r.get("engine_pick_vs_best")
        bb = bench.get(key)
        why: list[tuple[str, str]] = []  # (the reason's kind, what was measured)
        if r["cublas_ms"] < 0.03:
            why.append(("small", f"small: cuBLAS {r['cublas_ms'] * 1e3:.0f} us"))
        for side, wv in (("waiting", ww), ("alone", wa)):
            text = _wave_reason(wv)
            if text:
                why.append(("waves", f"{side}: {text}"))
        if k <= 1024:
            why.append(("short K", f"short K ({k // 64} steps)"))
        if pick is not None and pick < 0.97:
            why.append(("engine pick", f"engine pick {pick:.2f} of the fastest"))
        if bb:
            cost = (bb["wait"] - bb["alone"]) * 1e3
            if cost > 0.03 * bb["alone"] * 1e3:
                why.append(("waiting costs", f"waiting costs {cost:.1f} us ({cost / (bb['alone'] * 1e3):.0%})"))
            if bb["cublas"] / bb["alone"] < GAP_LIMIT:
                why.append(("kernel alone", f"the Gluon kernel alone {bb['cublas'] / bb['alone']:.2f}"))
        spread = [abs(v - w) for v in also_w] + [abs(v - a) for v in also_a]
        if spread and max(spread) > 0.05:
            why.append(("runs differ", f"runs differ by up to {max(spread):.2f}"))
        for kind in {kind for kind, _t in why}:
            counts[kind] = counts.get(kind, 0) + 1
        body.append([f"{m} x {n} x {k}", key[3], key[4], f"{r['model']} {r['layer']} {r['tp']}",
                     f"{r['cublas_ms'] * 1e3:.0f}", f"{w:.3f}" + "".join(f" / {v:.3f}" for v in also_w),
                     f"{a:.3f}" + "".join(f" / {v:.3f}" for v in also_a),
                     " / ".join(f"{wv[0]}, {wv[1]:.2f}" if wv else "-" for wv in (ww, wa)), str(k // 64),
                     f"{pick:.3f}" if pick is not None else "-",
                     f"{bb['cublas'] / bb['alone']:.3f} / {bb['cublas'] / bb['wait']:.3f}" if bb else "-",
                     "; ".join(t for _k, t in why) or "none of these (not taken apart)"])
    cols = " / ".join([str(gpu)] + [str(g) for _o, g in other])
    lines = ["## Where the GEMM misses its targets, shape by shape", "",
             f"The shapes whose GEMM waiting (the consumer ops' GEMM) or alone (the flattened tile GEMM) is "
             f"under {GAP_LIMIT}x cuBLAS in the newest sweep of any GPU: `results/{folder}/gemm_sweep.json`"
             + "".join(f", `results/{f}/gemm_sweep.json`" for _d, f in others)
             + f". Waiting and alone: x cuBLAS ({cols}); tiles and waves on {sms} SMs of the waiting pick's "
             f"tile and of the alone config's; pick / fastest: the engine's pick over the fastest of its candidates, each timed in "
             f"the sweep; *bench*: `benchmarks/gluon_gemm_bench.py`'s fastest Gluon variant alone and "
             f"waiting on set flags, the newest row of the shape on the {gpu}"
             + (f" ({', '.join(f'`results/{b}`' for b in bench_from)})" if bench_from else "")
             + ". Reasons: *small*, cuBLAS under 30 us, where the launch, the tile's flag read before its "
             "first load and an epilogue not overlapped are a fixed cost; *one wave* / *last wave* (waves), "
             "the SMs idle in a wave; *short K*, 16 K steps or fewer, the epilogue's share large; *waiting "
             "costs*, the bench's fastest waiting over its fastest alone; *kernel alone*, the bench's fastest Gluon variant alone under the limit; *engine pick*, the pick slower than "
             "another candidate; *runs differ*, the same shape on two GPUs or runs apart by more than 0.05.", "",
             "Shapes per reason: " + ", ".join(f"{t} {c}" for t, c in sorted(counts.items(), key=lambda v: (-v[1], v[0])))
             + ". What would close each, and what was tried, is in `docs/tuning.md` (the GEMM's gaps).", ""]
    return lines + [report.md_table(head, body), ""]


def one_gpu_md(results_dir: str) -> list[str]:
    out: list[str] = []
    for name, fn in (("gemm_sweep.json", gemm_sweep_md), ("chain_graph.json", chain_graph_md)):
        found = _latest(results_dir, name)
        if found is not None:
            out += fn(found)
        if name == "gemm_sweep.json":
            out += gemm_gaps_md(results_dir)
    return out


def headline_kind(runs: list[Run]) -> str | None:
    kinds = [r.kind for r in runs]
    return max(set(kinds), key=lambda k: (kinds.count(k), k)) if kinds else None


def _summary(meta: dict, recs: list[dict]) -> str:
    """One line: on how many cases the library beat each baseline, and its range against the floor."""
    lib = meta["library"]
    words = []
    for n, v in meta["variants"].items():
        if v["role"] not in ("reference", "external"):
            continue
        both = [r for r in recs if r["ms"].get(n) is not None and r["ms"].get(lib) is not None]
        if both:
            wins = sum(r["ms"][lib] < r["ms"][n] for r in both)
            words.append(f"than {v['title']} on {wins} of {len(both)}")
    ratios = [r["vs_floor"][lib] for r in recs if r.get("vs_floor", {}).get(lib) is not None]
    line = "The library is faster " + ", ".join(words) if words else "The library"
    if ratios:
        line += f"; {min(ratios):.2f}-{max(ratios):.2f}x of the floor"
    return line + "."


def readme_block(runs: list[Run], ops: tuple[str, ...] = ("agmm",), summaries: tuple[str, ...] = ("armm",)) -> str:
    """The README's results: the latest full run on the commonest kind, a short table for
    each op of ``ops`` and one summary line for each of ``summaries`` (their tables are in
    RESULTS.md), so the README stays a page."""
    kind = headline_kind(runs)
    out = [START, f"<!-- generated by `{COMMAND}`; do not edit by hand -->", ""]
    for op in ops + summaries:
        picked = select(runs, op).get(kind)
        if picked is None:
            continue
        run = picked[0]
        meta, recs = run.doc["ops"][op], run.recs(op)
        if op in summaries:
            line = _summary(meta, recs)
            out += [f"{meta['title']}, {run.doc['dtype']} ({_source(run, 'benchmarks/')}): "
                    f"{line[0].lower()}{line[1:]} Its table: [benchmarks/RESULTS.md](benchmarks/RESULTS.md).", ""]
            continue
        lib = meta["library"]
        ref = next(n for n, v in meta["variants"].items() if v["role"] == "reference")
        ext = [n for n, v in meta["variants"].items()
               if v["role"] == "external" and any(r["ms"].get(n) is not None for r in recs)]
        parts = list(meta["part_titles"])
        head = (["shape (M x N x K)"] + [meta["part_titles"][p] for p in parts] + ["floor", "sequential", "library"]
                + [meta["variants"][n]["title"] for n in ext] + ["library / floor", "library's pick"])
        rows = []
        for r in recs:
            ms = r["ms"]
            rows.append([r["label"]] + [report.fmt(ms.get(p)) for p in parts]
                        + [report.fmt(r.get("floor_ms")), report.fmt(ms.get(ref)), report.fmt(ms.get(lib))]
                        + [report.fmt(ms.get(n)) for n in ext]
                        + [report.fmt(r.get("vs_floor", {}).get(lib), 2), short_tuned(r.get("tuned"))])
        out += [f"{meta['title']}, {run.doc['dtype']}, ms per call (median, slowest rank; "
                f"{_source(run, 'benchmarks/')}):", "", report.md_table(head, rows), "", _summary(meta, recs), ""]
    out.append(END)
    return "\n".join(out)


def replace_block(text: str, block: str) -> str:
    i, j = text.find(START), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"README has no {START} ... {END} block")
    return text[:i] + block + text[j + len(END):]


def main(argv: list[str] | None = None) -> int:
    root = os.path.dirname(HERE)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=os.path.join(HERE, "results"), help="the runs' folder")
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"), help="RESULTS.md to write")
    ap.add_argument("--readme-file", default=os.path.join(root, "README.md"),
                    help="README whose results block is rewritten")
    ap.add_argument("--readme", action="store_true", help="print the README block only")
    ap.add_argument("--check", action="store_true", help="exit 1 if an output is out of date")
    args = ap.parse_args(argv)

    runs = load_runs(args.results, os.path.dirname(os.path.abspath(args.out)))
    if not runs:
        print(f"no GPU results.json under {args.results}", file=sys.stderr)
        return 1
    # README links are from the repository root; RESULTS.md's from benchmarks/
    block = readme_block(runs)
    if args.readme:
        print(block)
        return 0
    new = {args.out: results_md(runs, args.results)}
    with open(args.readme_file) as f:
        new[args.readme_file] = replace_block(f.read(), block)
    stale = []
    for path, text in new.items():
        old = open(path).read() if os.path.exists(path) else None
        if old != text:
            stale.append(path)
            if not args.check:
                with open(path, "w") as f:
                    f.write(text)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run {COMMAND}", file=sys.stderr)
        return 1
    for path in stale:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
