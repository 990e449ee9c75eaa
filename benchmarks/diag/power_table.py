"""Board power and SM clock per phase of ``armm_trace.py --soak``, from an nvidia-smi log.

    nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu \
        --format=csv -lms 20 > smi.csv &
    bash launch/torchrun.sh 2 benchmarks/diag/armm_trace.py --soak 3 ... > soak.log
    python3 benchmarks/diag/power_table.py soak.log smi.csv [--skip 1.0]

For each ``soak NAME: CALLS calls from HH:MM:SS.mmm to HH:MM:SS.mmm UTC`` line of the log,
the medians of the samples inside the phase (its first ``--skip`` seconds left out: the
board's power reading is an average that lags), per GPU. Energy per call is power times
time per call; "above idle" subtracts the idle phase's power. The log's stamps and
nvidia-smi's are both read as the same clock (the GPU machine's, UTC).

Energies of phases do not add up to the energy of the work run together: on 2x H200 the
GEMM alone and the communication with a thin GEMM took 0.469 + 0.357 J above idle per
call, and the op 0.696 J (the SMs' clock and leakage are paid once when both run).
"""
from __future__ import annotations

import argparse
import csv
import re
import statistics

_SOAK = re.compile(r"soak (.+): (\d+) calls from (\d+):(\d+):([\d.]+) to (\d+):(\d+):([\d.]+) UTC")


def _secs(h: str, m: str, s: str) -> float:
    return int(h) * 3600 + int(m) * 60 + float(s)


def read_phases(log: str) -> list[tuple[str, int, float, float]]:
    out = []
    with open(log) as f:
        for line in f:
            mt = _SOAK.search(line)
            if mt:
                g = mt.groups()
                out.append((g[0], int(g[1]), _secs(*g[2:5]), _secs(*g[5:8])))
    return out


def read_samples(path: str) -> list[tuple[float, int, float, float]]:
    """(seconds of day, GPU index, SM MHz, watts) per sample."""
    out = []
    with open(path) as f:
        for row in csv.reader(f):
            if len(row) < 5 or not row[0][:1].isdigit():
                continue
            try:
                hms = row[0].split()[1].split(":")
                out.append((_secs(*hms), int(row[1]), float(row[2].split()[0]), float(row[4].split()[0])))
            except (ValueError, IndexError):
                continue  # a "[N/A]" or a cut line
    return out


def table(phases, samples, skip: float) -> tuple[list[dict], list[int]]:
    gpus = sorted({s[1] for s in samples})
    rows = []
    for name, calls, t0, t1 in phases:
        r = {"phase": name, "ms": (t1 - t0) / calls * 1e3, "calls": calls}
        for gi in gpus:
            sel = [s for s in samples if s[1] == gi and t0 + skip <= s[0] <= t1]
            r[f"W{gi}"] = statistics.median(s[3] for s in sel) if sel else float("nan")
            r[f"MHz{gi}"] = statistics.median(s[2] for s in sel) if sel else float("nan")
            r[f"n{gi}"] = len(sel)
        rows.append(r)
    return rows, gpus


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("smi")
    ap.add_argument("--skip", type=float, default=1.0, help="seconds left out at each phase's start")
    args = ap.parse_args()
    phases = read_phases(args.log)
    if not phases:
        raise SystemExit(f"no soak lines in {args.log}")
    rows, gpus = table(phases, read_samples(args.smi), args.skip)
    idle = {gi: next((r[f"W{gi}"] for r in rows if r["phase"] == "idle"), float("nan")) for gi in gpus}
    head = ["phase", "ms per call"] + [f"GPU{gi} W" for gi in gpus] + [f"GPU{gi} SM MHz" for gi in gpus] + \
        ["J per call (mean GPU)", "above idle"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        w = statistics.mean(r[f"W{gi}"] for gi in gpus)
        wi = statistics.mean(idle[gi] for gi in gpus)
        r["J"], r["Jdyn"] = w * r["ms"] / 1e3, (w - wi) * r["ms"] / 1e3
        cells = [r["phase"], "" if r["phase"] == "idle" else f"{r['ms']:.3f}"] + [f"{r[f'W{gi}']:.0f}" for gi in gpus] + \
            [f"{r[f'MHz{gi}']:.0f}" for gi in gpus] + \
            (["", ""] if r["phase"] == "idle" else [f"{r['J']:.3f}", f"{r['Jdyn']:.3f}"])
        print("| " + " | ".join(cells) + " |")
    sparse = [f"{r['phase']} (GPU{gi}: {r[f'n{gi}']})" for r in rows for gi in gpus if r[f"n{gi}"] < 5]
    if sparse:
        print(f"\nfew samples (under 5) in: {', '.join(sparse)}")


if __name__ == "__main__":
    main()
