"""``launch/train_gpt.py --tp R`` with R ranks on one GPU (shared-GPU mode) against the same
run in one process, both from one seed and one data order; run by ``launch/shared_gpu.sh``
as ``python tests/gpu/shared_gpu_train.py R OUT`` (each training job bounded in time).

Four jobs, the same model, seed, data and steps:

    fp32   one process, --tp 1, fp32        the curve without bf16 rounding
    bf16   one process, --tp 1, bf16        the reference
    tp     R ranks, --tp R --path overlap   the layers' fused ops, peer-copy transport
    tp_sp  the same, sequence parallel

Tolerance (bf16): ``tp`` computes the function of ``bf16`` with sums in another order and
partial products rounded to bf16 before the all-reduce, i.e. another bf16 rounding of the
same fp32 curve. So its distance from ``bf16`` (the largest per-step loss difference) is
bounded by a multiple of the distance bf16 rounding alone puts between ``bf16`` and
``fp32``: ``3 x`` that (``TOL_FACTOR``), and at least ``TOL_FLOOR`` (a run where bf16 and
fp32 happen to stay very close would otherwise give a bound below one bf16 rounding of
the loss). A sharded layer that is wrong (a missing all-reduce, rows of the wrong rank)
moves the curve by far more: see ``compare``.

Prints ``RESULT <name> <passed|failed> <seconds> <detail>`` per tp run. On a machine
without a GPU it runs the same jobs on the CPU (gloo, the ops' references): a check of
the check, not of the GPU path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent

STEPS = 40
ARGS = ["--steps", str(STEPS), "--batch", "8", "--block", "64", "--n-layer", "2", "--n-head", "4",
        "--n-embd", "128", "--seed", "0", "--eval-every", "0", "--log-every", "10"]
TOL_FACTOR = 3.0
TOL_FLOOR = 0.02
JOB_LIMIT_S = float(os.environ.get("SHARED_GPU_TRAIN_JOB_S", "120"))


def compare(ref: list[float], ref32: list[float], got: list[float]) -> tuple[bool, str]:
    """Is ``got`` (a tp run's per-step losses) the curve of ``ref`` (one process, bf16)
    within the tolerance that bf16's own drift from ``ref32`` (fp32) sets? Also: the
    same number of steps, finite, and a curve that learned (its last loss below its first)."""
    if not (len(ref) == len(ref32) == len(got)) or not ref:
        return False, f"steps differ: bf16 {len(ref)}, fp32 {len(ref32)}, tp {len(got)}"
    if any(x != x or abs(x) == float("inf") for x in got):
        return False, "a loss is not finite"
    drift = max(abs(a - b) for a, b in zip(ref, ref32))
    tol = max(TOL_FACTOR * drift, TOL_FLOOR)
    diffs = [abs(a - b) for a, b in zip(got, ref)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    learned = got[-1] < got[0] - 0.5
    ok = diffs[worst] <= tol and learned
    return ok, (f"max |loss - one process| {diffs[worst]:.4f} at step {worst + 1} (tol {tol:.4f} = "
                f"max({TOL_FACTOR:g} x bf16's drift from fp32 {drift:.4f}, {TOL_FLOOR})); "
                f"loss {got[0]:.3f} -> {got[-1]:.3f}"
                + ("" if learned else " (did not learn)"))


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """One training job in its own process group, its output to ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def finish(p: subprocess.Popen, cmd: list[str], log: Path, deadline: float) -> tuple[int | None, str]:
    """Wait for job ``p`` until ``deadline`` (time.time()), else kill its process group."""
    try:
        rc = p.wait(timeout=max(deadline - time.time(), 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)  # the job's own process group (started above), nothing else
        p.wait()
        rc = None
    text = log.read_text(errors="replace")
    sys.stdout.write(f"----- {' '.join(cmd[1:])}: rc={rc}\n{text}")
    sys.stdout.flush()
    return rc, text


def losses(out: Path) -> list[float]:
    return json.loads((out / "train.json").read_text())["losses"]


def p2p_calls(out: Path) -> int:
    """Calls of the fused ops that took the peer-copy path (train.json's ``ops``, rank 0)."""
    ops = json.loads((out / "train.json").read_text()).get("ops", [])
    return sum(p["calls"] for r in ops for p in r["paths"] if str(p["path"]).startswith("p2p"))


def main() -> int:
    ranks, out = int(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    py = os.environ.get("OVERLAP_PYTHON", sys.executable)
    on_gpu = _has_gpu()
    one = dict(os.environ, OVERLAP_SHARED_GPU="0")  # one process: one rank per GPU, as in production
    shared = dict(os.environ, OVERLAP_SHARED_GPU="1") if on_gpu else one  # on a CPU: gloo, the references
    runs: dict[str, tuple[list[str], dict[str, str]]] = {
        "fp32": ([py, "launch/train_gpt.py", "--tp", "1", "--dtype", "fp32"], one),
        "bf16": ([py, "launch/train_gpt.py", "--tp", "1", "--dtype", "bf16" if on_gpu else "fp32"], one),
        "tp": (["bash", "launch/torchrun.sh", str(ranks), "launch/train_gpt.py", "--tp", str(ranks),
                "--path", "overlap"], shared),
        "tp_sp": (["bash", "launch/torchrun.sh", str(ranks), "launch/train_gpt.py", "--tp", str(ranks),
                   "--path", "overlap", "--sp"], shared),
    }
    curves: dict[str, list[float]] = {}
    took: dict[str, float] = {}
    why: dict[str, str] = {}
    # the two one-process runs at once (neither waits on anything), then the tp runs one by one
    for batch in (("fp32", "bf16"), ("tp",), ("tp_sp",)):
        t0 = time.time()
        jobs = {}
        for name in batch:
            cmd, env = runs[name]
            cmd = cmd + ARGS + ["--out", str(out / name)]
            jobs[name] = (start(cmd, env, out / f"{name}.log"), cmd)
        for name, (p, cmd) in jobs.items():
            rc, text = finish(p, cmd, out / f"{name}.log", t0 + JOB_LIMIT_S)
            took[name] = time.time() - t0
            if rc == 0:
                curves[name] = losses(out / name)
            else:
                lines = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln][-2:]
                why[name] = (f"killed after {JOB_LIMIT_S:.0f} s" if rc is None else f"rc {rc}") + (
                    f": {' | '.join(lines)}" if lines else "")
    failed = 0
    for name in ("tp", "tp_sp"):
        test = f"train_gpt_tp{ranks}" + ("_sp" if name == "tp_sp" else "")
        missing = [n for n in ("fp32", "bf16", name) if n not in curves]
        if missing:
            ok, detail = False, "; ".join(f"{n}: {why[n]}" for n in missing)
        else:
            ok, detail = compare(curves["bf16"], curves["fp32"], curves[name])
            calls = p2p_calls(out / name)
            detail += f"; {calls} fused calls on the peer-copy path (rank 0)"
            if on_gpu and calls == 0:
                ok, detail = False, detail + ": the layers never took the fused path"
        failed += not ok
        print(f"RESULT {test} {'passed' if ok else 'failed'} {took.get(name, 0.0):.1f} {STEPS} steps vs one "
              f"process{'' if on_gpu else ' (CPU)'}: {detail}", flush=True)
    (out / "curves.json").write_text(json.dumps(curves) + "\n")
    print("CURVES " + json.dumps({k: [round(x, 4) for x in v] for k, v in curves.items()}), flush=True)
    return 1 if failed else 0


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
