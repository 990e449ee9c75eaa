"""Reports of a run: a text table (stdout), JSON (every figure), markdown, a PNG per op.

A record (one op, one shape) holds ``ms`` (every timing: parts, extras, variants; None
where not run), ``na`` / ``errors`` / ``notes`` per variant, and the derived figures
``floor_ms``, ``vs_floor``, ``tflops``, ``busbw_GBps``, ``hidden_frac``, ``speedup``; with
``--profile`` also ``observed`` (per variant: path, why, calls, phase times, alone-times and
the hidden fraction from ``overlap.report()``) and ``observed_report`` (its rows).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

NOT_GPU = "CPU run (gloo, time.perf_counter): figures are not GPU figures"

# NCCL-tests bus bandwidth factors over algorithm bandwidth (bytes / time), R ranks
BUSBW_FACTOR = {
    "all_gather": lambda r: (r - 1) / r,
    "reduce_scatter": lambda r: (r - 1) / r,
    "all_reduce": lambda r: 2 * (r - 1) / r,
}


def fmt(v: Any, digits: int = 3) -> str:
    """Fixed decimals; ``digits=0``: three significant figures (rates that span decades)."""
    if v is None:
        return "n/a"
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:.3g}" if digits == 0 else f"{v:.{digits}f}"
    return str(v)


def _shape_cell(r: dict) -> str:
    s = r["label"]
    if r.get("run_dims"):
        s += " (ran " + "x".join(str(v) for v in r["run_dims"].values()) + ")"
    return s


def table(meta: dict, recs: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of one op's table."""
    variants = meta["variants"]  # name -> {"title", "role", ...} in run order
    parts = meta["part_titles"]
    lib = meta["library"]
    lib_title = variants.get(lib, {}).get("title", lib)
    head = ["set", "shape"] + list(parts.values()) + ["floor" if meta["floor"] == "max" else "sequential"]
    head += [v["title"] for v in variants.values()]
    head += [f"{lib_title} / floor" if meta["floor"] == "max" else f"{lib_title} / sequential"]
    if meta["comm"]:
        head += ["hidden", "busbw GB/s"]
    ref = next((n for n, v in variants.items() if v["role"] == "reference"), None)
    head += ["TFLOP/s ref", f"TFLOP/s {lib_title}"]
    if meta.get("speedup"):
        a, b = meta["speedup"]
        head.append(f"{variants[a]['title']} speedup over {variants[b]['title']}")
    tuned = any("tuned" in r for r in recs)
    if tuned:
        head.append("tuned")
    rows = []
    for r in recs:
        ms = r["ms"]
        row = [r["set"], _shape_cell(r)] + [fmt(ms.get(p)) for p in parts] + [fmt(r.get("floor_ms"))]
        for n in variants:
            row.append("err" if n in r.get("errors", {}) else fmt(ms.get(n)))
        row.append(fmt(r.get("vs_floor", {}).get(lib), 2))
        if meta["comm"]:
            h = r.get("hidden_frac", {}).get(lib)
            row += [f"{100 * h:.0f}%" if h is not None else "n/a", fmt(r.get("busbw_GBps", {}).get("comm"), 0)]
        row += [fmt(r.get("tflops", {}).get(ref), 0), fmt(r.get("tflops", {}).get(lib), 0)]
        if meta.get("speedup"):
            row.append(fmt(next(iter(r.get("speedup", {}).values()), None), 2))
        if tuned:
            row.append(str(r.get("tuned", "")))
        rows.append(row)
    return head, rows


def observed_table(meta: dict, recs: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the ``--profile`` figures: one row per shape and variant."""
    head = ["set", "shape", "variant", "path (why)", "op ms", "comm alone", "gemm alone", "hidden"]
    rows = []
    for r in recs:
        for n, o in r.get("observed", {}).items():
            path = "-" if o["path"] is None else o["path"] + (f" ({o['why']})" if o["why"] else "")
            h = o["hidden"]
            rows.append([r["set"], _shape_cell(r), meta["variants"].get(n, {}).get("title", n), path,
                         fmt(o["op_ms"]), fmt(o["comm_alone_ms"]), fmt(o["gemm_alone_ms"]),
                         "n/a" if h is None else f"{100 * h:.0f}%"])
    return head, rows


def text_table(head: list[str], rows: list[list[str]]) -> str:
    w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w[i]) if i > 1 else c.ljust(w[i]) for i, c in enumerate(cells))

    return "\n".join([line(head), line(["-" * x for x in w])] + [line(r) for r in rows])


def md_table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _notes(meta: dict, recs: list[dict]) -> list[str]:
    """How to read the table: variant notes, n/a reasons, errors."""
    notes = []
    for v in meta["variants"].values():
        if v.get("note"):
            notes.append(f"{v['title']}: {v['note']}")
    nas: dict[str, set] = {}
    for r in recs:
        for n, why in r.get("na", {}).items():
            nas.setdefault(n, set()).add(why)
    for n, whys in nas.items():
        notes.append(f"{meta['variants'][n]['title']}: n/a ({'; '.join(sorted(whys))})")
    for r in recs:
        for n, e in r.get("errors", {}).items():
            notes.append(f"ERROR {r['set']} {r['label']} {n}: {e}")
    return notes


def describe_run(doc: dict) -> str:
    c = doc["context"]
    host = (f"host {c['host_us_torch_mm']} us per torch.mm (the instance's host speed), "
            if c.get("host_us_torch_mm") is not None else "")
    gpu = (f"{c.get('gpu_count')}x {c.get('gpu')}, driver {c.get('driver')}, CUDA {c.get('cuda')}, "
           f"NCCL {c.get('nccl')}, {host}" if doc["gpu"] else "no GPU (gloo), ")
    return (f"{c.get('date')}, {doc['world']} ranks, {gpu}torch {c.get('torch')}, triton {c.get('triton')}, "
            f"cupy {c.get('cupy')}, commit {c.get('commit')}, {doc['dtype']}; knobs {c.get('knobs')}")


def op_section(doc: dict, name: str, *, markdown: bool) -> str:
    meta = doc["ops"][name]
    recs = [r for r in doc["results"] if r["op"] == name]
    title = f"{name}: {meta['title']}"
    lines = [("## " if markdown else "== ") + title]
    if meta["status"] != "ok":
        lines.append(f"op {name} unavailable: {meta.get('error')}")
        return "\n".join(lines) + "\n"
    for n in meta.get("set_notes", []):
        lines.append(n)
    if not recs:
        lines.append("(no shapes ran)")
        return "\n".join(lines) + "\n"
    parts = meta["part_titles"].values()
    floor = f"floor = max({', '.join(parts)})" if meta["floor"] == "max" else f"sequential = {' + '.join(parts)}"
    lines.append(f"ms per call, median, slowest of {doc['world']} ranks ({doc['timing']}); {floor}"
                 + ("; hidden = (sequential - library) / communication alone" if meta["comm"] else ""))
    if not doc["gpu"]:
        lines.append(("**" if markdown else "") + NOT_GPU + ("**" if markdown else ""))
    head, rows = table(meta, recs)
    lines += ["", md_table(head, rows) if markdown else text_table(head, rows), ""]
    for n in _notes(meta, recs):
        lines.append(("- " if markdown else "  ") + n)
    if any("observed" in r for r in recs):
        head, rows = observed_table(meta, recs)
        lines += ["", "overlap.report() of a few profiled calls per variant after the timing (--profile): the path "
                  "taken, the op's CUDA-event time, the alone-times from the serial calls, the hidden fraction",
                  "", md_table(head, rows) if markdown else text_table(head, rows), ""]
    if markdown and doc.get("plots", {}).get(name):
        lines += ["", f"![{name}]({doc['plots'][name]})"]
    return "\n".join(lines) + "\n"


def text_report(doc: dict) -> str:
    parts = [f"Benchmark suite: {describe_run(doc)}"]
    if not doc["gpu"]:
        parts.append(f"*** {NOT_GPU} ***")
    parts += [op_section(doc, n, markdown=False) for n in doc["ops"]]
    return "\n".join(parts)


def markdown(doc: dict) -> str:
    out = ["# Benchmark suite", ""]
    if not doc["gpu"]:
        scaled = (f" Shapes were scaled down to a largest dim <= {doc['cpu_max_dim']} (the table names the GPU "
                  "shape and the dims that ran)." if doc.get("cpu_max_dim") else "")
        out += [f"> **{NOT_GPU}.**{scaled}", ""]
    out += [f"Run: {describe_run(doc)}.", "", f"Command: `{doc.get('command', '')}`", ""]
    out += [op_section(doc, n, markdown=True) for n in doc["ops"]]
    if doc.get("plot_note"):
        out += [doc["plot_note"], ""]
    return "\n".join(out)


def plot(doc: dict, name: str, path: str) -> str | None:
    """Time against shape for every variant, the floor drawn in. None, with the reason,
    when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except Exception as e:
        return f"plots skipped: matplotlib not importable ({type(e).__name__}: {e}); pip install 'overlap[bench]'"
    meta = doc["ops"][name]
    recs = [r for r in doc["results"] if r["op"] == name]
    if not recs:
        return None
    x = list(range(len(recs)))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(recs)), 4.8))
    for n, v in meta["variants"].items():
        ys = [r["ms"].get(n) for r in recs]
        if any(y is not None for y in ys):
            ax.plot(x, [float("nan") if y is None else y for y in ys], marker="o", label=v["title"])
    floor_label = (f"floor = max({', '.join(meta['part_titles'].values())})" if meta["floor"] == "max"
                   else f"sequential = {' + '.join(meta['part_titles'].values())}")
    ax.plot(x, [r.get("floor_ms") or float("nan") for r in recs], color="k", ls="--", lw=1.5, label=floor_label)
    ax.set_xticks(x)
    ax.set_xticklabels([f"{r['set']}\n{_shape_cell(r)}" for r in recs], rotation=20, fontsize=7, ha="right")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_ylabel("ms per call (median, slowest rank)")
    where = (f"{doc['world']}x {doc['context'].get('gpu')}" if doc["gpu"]
             else f"{doc['world']} ranks, CPU (gloo): NOT GPU figures")
    ax.set_title(f"{meta['title']}, {doc['dtype']}, {where}", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write(doc: dict, out: str) -> list[str]:
    """results.json, results.md and <op>.png under ``out``; the paths written."""
    os.makedirs(out, exist_ok=True)
    written = []
    doc["plots"] = {}
    for name in doc["ops"]:
        if doc["ops"][name]["status"] != "ok" or not any(r["op"] == name for r in doc["results"]):
            continue
        why = plot(doc, name, os.path.join(out, f"{name}.png"))
        if why:
            doc["plot_note"] = why
            break
        if os.path.exists(os.path.join(out, f"{name}.png")):
            doc["plots"][name] = f"{name}.png"
            written.append(os.path.join(out, f"{name}.png"))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(doc, f, indent=1, default=str)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(markdown(doc))
    return [os.path.join(out, "results.json"), os.path.join(out, "results.md")] + written
