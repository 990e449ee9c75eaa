"""A PNG timeline of one call of an overlapped op, lane per stream, from a torch profiler trace.

    python benchmarks/timeline.py TRACE.json [--op all_gather_matmul] [--call -1] [--out DIR_OR_PNG] [--list]

TRACE.json: a chrome trace as ``torch.profiler.profile(...).export_chrome_trace`` writes it,
of a run with ``overlap.observe`` ranges in it (``overlap.observe.trace("run.json")`` around
the calls makes one; any torch profiler run does, ``OVERLAP_PROFILE=1`` adds NVTX). A call is
found by its host range ``overlap.<op>[<path>]``; its GPU work is every kernel, copy and
memset whose launch (a CUDA runtime or driver call, matched by correlation id) lies inside
that range, and its labels are the ``gpu_user_annotation`` events of the
``overlap:<stream>:<label>`` ranges the op opened (``gpu_range``), drawn over the work on
their streams: chunk by chunk on the comm stream, the GEMM and give-back grids, the reduce
kernel. A top lane shows the host ranges (all a trace made on a CPU has).

Without ``--op``, one PNG per op found, of its ``--call``-th call (default the last, warm
one): ``<out>/<trace>.<op>.png``. Prints, per lane, the busy time inside the call.
Needs matplotlib (``pip install 'overlap[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Call", "load", "find_calls", "call_lanes", "busy_us", "draw", "main"]

OP_RE = re.compile(r"^overlap\.([A-Za-z0-9_]+)\[(.*)\]$")
GPU_RE = re.compile(r"^overlap:([^:]+):(.*)$")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


@dataclass
class Call:
    """One call of an op: its host range and what ran inside it."""

    op: str
    path: str
    ts: float
    end: float
    pid: Any
    tid: Any
    host: list[dict] = field(default_factory=list)
    """host ``user_annotation`` events inside the range (the range itself first)"""


def load(path: str) -> list[dict]:
    """The complete ("X") events of a chrome trace, sorted by start."""
    with open(path) as f:
        doc = json.load(f)
    evs = doc["traceEvents"] if isinstance(doc, dict) else doc
    out = [e for e in evs if e.get("ph") == "X" and "ts" in e]
    for e in out:
        e["ts"] = float(e["ts"])
        e["dur"] = float(e.get("dur", 0.0))
    out.sort(key=lambda e: e["ts"])
    return out


def find_calls(events: list[dict], op: str | None = None) -> list[Call]:
    """Calls of ``op`` (None: of every op), in order, with their host ranges."""
    calls = []
    for e in events:
        if e.get("cat") != "user_annotation":
            continue
        m = OP_RE.match(e.get("name", ""))
        if m and (op is None or m.group(1) == op):
            calls.append(Call(m.group(1), m.group(2), e["ts"], e["ts"] + e["dur"], e.get("pid"), e.get("tid")))
    for c in calls:
        c.host = [e for e in events if e.get("cat") == "user_annotation" and e.get("pid") == c.pid
                  and e.get("tid") == c.tid and c.ts <= e["ts"] and e["ts"] + e["dur"] <= c.end]
    return calls


def _stream(e: dict) -> tuple:
    a = e.get("args") or {}
    return (a.get("device", e.get("pid")), a.get("stream", e.get("tid")))


def call_lanes(events: list[dict], call: Call) -> dict[str, list[dict]]:
    """Lanes of ``call``: "host" (its host ranges), then one per GPU stream its work ran on,
    named ``stream <id> (<roles>)``. Each item: {t0, t1 (us from the call's start), name,
    kind} with kind "range", "kernel", "memcpy", "memset" or "label"."""
    corr = {(e.get("args") or {}).get("correlation") for e in events
            if e.get("cat") in LAUNCH_CATS and e.get("pid") == call.pid and e.get("tid") == call.tid
            and call.ts <= e["ts"] <= call.end}
    corr.discard(None)
    work = [e for e in events if e.get("cat") in GPU_CATS and (e.get("args") or {}).get("correlation") in corr]
    ext = {(e.get("args") or {}).get("External id") for e in call.host}
    ext.discard(None)
    t0 = min([call.ts] + [e["ts"] for e in work])
    lanes: dict[str, list[dict]] = {"host": []}
    depth: list[float] = []
    for e in call.host:  # nesting depth of each host range, for the label
        while depth and depth[-1] <= e["ts"]:
            depth.pop()
        lanes["host"].append({"t0": e["ts"] - t0, "t1": e["ts"] + e["dur"] - t0, "name": e["name"],
                              "kind": "range", "depth": len(depth)})
        depth.append(e["ts"] + e["dur"])
    if not work:
        return lanes
    g0, g1 = min(e["ts"] for e in work), max(e["ts"] + e["dur"] for e in work)
    ann = [e for e in events if e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith("overlap")]
    # a GPU annotation names the host range it came from where the trace says so; else it
    # is taken by time: those over this call's GPU work
    labels = [e for e in ann if (e.get("args") or {}).get("External id") in ext] or \
        [e for e in ann if e["ts"] < g1 and e["ts"] + e["dur"] > g0]
    by: dict[tuple, list[dict]] = {}
    roles: dict[tuple, set] = {}
    for e in work:
        kind = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}[e["cat"]]
        by.setdefault(_stream(e), []).append({"t0": e["ts"] - t0, "t1": e["ts"] + e["dur"] - t0,
                                              "name": e.get("name", ""), "kind": kind})
    for e in labels:
        m = GPU_RE.match(e["name"])
        if m is None:
            continue  # the op's own range, drawn on the host lane
        s = _stream(e)
        roles.setdefault(s, set()).add(m.group(1))
        by.setdefault(s, []).append({"t0": e["ts"] - t0, "t1": e["ts"] + e["dur"] - t0, "name": m.group(2),
                                     "kind": "label", "role": m.group(1)})
    for s, items in by.items():  # a stream of several roles: each label says whose it is
        if len(roles.get(s, ())) > 1:
            for it in items:
                if it["kind"] == "label":
                    it["name"] = f"{it['role']} {it['name']}"
    for s in sorted(by, key=lambda s: (str(s[0]), str(s[1]))):
        name = f"stream {s[1]}" + (f" ({', '.join(sorted(roles[s]))})" if s in roles else "")
        if s[0] not in (None, 0):
            name = f"gpu {s[0]} " + name
        lanes[name] = sorted(by[s], key=lambda i: i["t0"])
    return lanes


def busy_us(items: list[dict]) -> float:
    """Time covered by the work items (kernels, copies, memsets) of a lane: their union."""
    iv = sorted((i["t0"], i["t1"]) for i in items if i["kind"] in ("kernel", "memcpy", "memset"))
    total, cur = 0.0, None
    for a, b in iv:
        if cur is None or a > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    return total + (cur[1] - cur[0] if cur is not None else 0.0)


_COLORS = {"tile_gemm": "#1f77b4", "reduce": "#d62728", "norm": "#ff7f0e", "fold": "#9467bd", "memcpy": "#2ca02c",
           "memset": "#7f7f7f", "nccl": "#8c564b", "kernel": "#17becf"}


def _color(item: dict) -> str:
    if item["kind"] in ("memcpy", "memset"):
        return _COLORS[item["kind"]]
    n = item["name"].lower()
    for key in ("tile_gemm", "reduce", "fold", "norm", "nccl"):
        if key in n:
            return _COLORS[key]
    return _COLORS["kernel"]


def _short(name: str, n: int = 28) -> str:
    name = re.sub(r"\(.*", "", name)
    return name if len(name) <= n else name[:n - 1] + "~"


def draw(lanes: dict[str, list[dict]], call: Call, out: str, title: str = "") -> None:
    """Draw ``lanes`` to the PNG ``out``: one row per lane, work as bars, the ``gpu_range``
    labels as brackets above the work they cover, host ranges stacked by depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(lanes)
    span = max([1e-3] + [i["t1"] for items in lanes.values() for i in items])
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.9 * len(names)))
    for row, lane in enumerate(names):
        y = len(names) - 1 - row
        for it in lanes[lane]:
            w = max(it["t1"] - it["t0"], span * 1e-3)
            if it["kind"] == "range":
                h, yy = 0.8 / (1 + it.get("depth", 0)), y - 0.4
                ax.broken_barh([(it["t0"], w)], (yy, h), facecolors="none", edgecolors="#444", linewidth=0.8)
                if it.get("depth", 0) == 0 or w > span * 0.08:
                    ax.text(it["t0"], yy + h, " " + _short(it["name"], 40), fontsize=6, va="top", clip_on=True)
            elif it["kind"] == "label":
                ax.broken_barh([(it["t0"], w)], (y + 0.22, 0.16), facecolors="#dddddd", edgecolors="#666",
                               linewidth=0.5)
                ax.text(it["t0"] + w / 2, y + 0.30, _short(it["name"], 16), fontsize=6, ha="center",
                        va="center", clip_on=True)
            else:
                ax.broken_barh([(it["t0"], w)], (y - 0.35, 0.55), facecolors=_color(it), edgecolors="white",
                               linewidth=0.3)
                if w > span * 0.06:
                    ax.text(it["t0"] + w / 2, y - 0.08, _short(it["name"], int(w / span * 160)), fontsize=6,
                            ha="center", va="center", color="white", clip_on=True)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([f"{n}\nbusy {busy_us(lanes[n]):.0f} us" if n != "host" else n for n in reversed(names)],
                       fontsize=7)
    ax.set_xlim(0, span * 1.02)
    ax.set_ylim(-0.6, len(names) - 0.4)
    ax.set_xlabel("us from the call's start")
    ax.set_title(title or f"overlap.{call.op}[{call.path}]", fontsize=9)
    ax.grid(axis="x", linewidth=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[str]:
    """Draw the PNGs; returns their paths."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="chrome trace JSON written by torch.profiler's export_chrome_trace")
    ap.add_argument("--op", default=None, help="the op to draw (default: every op in the trace)")
    ap.add_argument("--call", type=int, default=-1, help="which call of the op, by index (default: the last)")
    ap.add_argument("--out", default="", help="a .png (with --op) or a folder; default: beside the trace")
    ap.add_argument("--list", action="store_true", help="list the calls found and stop")
    args = ap.parse_args(argv)
    events = load(args.trace)
    calls = find_calls(events, args.op)
    if not calls:
        raise SystemExit(f"no overlap.{args.op or '<op>'}[...] range in {args.trace}: was the run profiled "
                         "with overlap.observe ranges (an op wired to op_range, under torch.profiler)?")
    if args.list:
        for i, c in enumerate(calls):
            print(f"{i:4d} {c.op}[{c.path}] host {c.end - c.ts:.1f} us")
        return []
    by_op: dict[str, list[Call]] = {}
    for c in calls:
        by_op.setdefault(c.op, []).append(c)
    stem = os.path.splitext(os.path.basename(args.trace))[0]
    outs = []
    for op, cs in by_op.items():
        try:
            call = cs[args.call]
        except IndexError:
            raise SystemExit(f"{op}: {len(cs)} calls in the trace, no call {args.call}") from None
        if args.out.endswith(".png") and len(by_op) == 1:
            out = args.out
        else:
            folder = args.out or os.path.dirname(os.path.abspath(args.trace))
            os.makedirs(folder, exist_ok=True)
            out = os.path.join(folder, f"{stem}.{op}.png")
        lanes = call_lanes(events, call)
        try:
            draw(lanes, call, out, f"overlap.{op}[{call.path}], call {args.call % len(cs)} of {len(cs)}")
        except ImportError as e:
            raise SystemExit(f"timeline needs matplotlib ({e}): pip install 'overlap[bench]'") from None
        gpu = [n for n in lanes if n != "host"]
        print(f"{op}[{call.path}]: host {call.end - call.ts:.1f} us" + "".join(
            f"; {n}: busy {busy_us(lanes[n]):.1f} us" for n in gpu) + f" -> {out}")
        outs.append(out)
    return outs


if __name__ == "__main__":
    main(sys.argv[1:])
