"""Run the multi-rank GPU checks with R ranks on one GPU (shared-GPU mode); see
``launch/shared_gpu.sh`` for the usage and docs/guarantees.md ("Two ranks on one GPU").

Each case is one ``launch/torchrun.sh R ...`` job with ``OVERLAP_SHARED_GPU=1``, bounded in
time; a case's ``RESULT name outcome seconds detail`` lines become tests of their own, a
case without them one test named after it (passed where its ``PASS`` line appeared).
Writes ``shared_gpu.json``::

    {"context": {"gpu", "gpu_count", "ranks", "mps", "commit", "versions", "gpu_settings"},
     "tests": [{"name", "outcome", "seconds", "detail"}]}

and ``shared_gpu.log`` (every job's output). Outcomes: passed, failed, timeout, not_run
(the time budget ran out first). Seconds are wall time with ranks sharing one GPU, and
compiling kernels: not performance figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# (name, script and arguments, seconds at most, the line that says it passed where it prints no
# RESULT, how it starts: "torchrun" (R ranks of the script) or "python" (one process that is
# given R and the output folder and starts its own jobs))
CASES = [
    ("ops", ["tests/gpu/shared_gpu_check.py", "ops"], 100, None, "torchrun"),
    ("guarantees", ["tests/gpu/shared_gpu_check.py", "guarantees"], 70, None, "torchrun"),
    ("refusals", ["tests/gpu/shared_gpu_check.py", "refusals"], 150, None, "torchrun"),
    ("layers", ["tests/gpu/shared_gpu_check.py", "layers"], 150, None, "torchrun"),
    ("kill", ["tests/gpu/shared_gpu_check.py", "kill"], 90, None, "torchrun"),
    ("producer_p2p_check", ["tests/gpu/producer_p2p_check.py"], 240, r"^PASS producer_p2p world=", "torchrun"),
    ("train", ["tests/gpu/shared_gpu_train.py"], 420, None, "python"),
]


def _sh(cmd: list[str], env: dict[str, str] | None = None, inp: str | None = None) -> tuple[int, str]:
    try:
        r = subprocess.run(cmd, env=env, input=inp, capture_output=True, text=True, timeout=30)
        return r.returncode, (r.stdout + r.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return -1, str(e)


def gpu_settings() -> str:
    """Compute mode, MIG mode and clocks, to show the run left them as it found them."""
    return _sh(["nvidia-smi", "--query-gpu=compute_mode,mig.mode.current,clocks.applications.graphics,"
                "clocks.applications.memory,power.limit", "--format=csv,noheader"])[1]


def context(ranks: int, mps: dict) -> dict:
    import torch

    versions = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    for mod in ("triton", "cupy"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            versions[mod] = f"unavailable: {e}"
    try:
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001
        versions["nccl"] = f"unavailable: {e}"
    rc, drv = _sh(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    name, _, driver = drv.splitlines()[0].partition(", ") if rc == 0 and drv else ("unknown", "", "")
    versions["driver"] = driver
    commit = os.environ.get("OVERLAP_COMMIT") or _sh(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])[1]
    return {"gpu": name, "gpu_count": torch.cuda.device_count(), "ranks": ranks, "mps": mps,
            "commit": commit, "versions": versions, "gpu_settings_before": gpu_settings()}


class Mps:
    """The MPS control daemon of this run: private pipe and log directories under /tmp, so
    it meets only this run's processes; stopped at the end. Changes no GPU setting."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="overlap-mps-")
        self.env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=f"{self.dir}/pipe",
                        CUDA_MPS_LOG_DIRECTORY=f"{self.dir}/log")
        os.makedirs(self.env["CUDA_MPS_PIPE_DIRECTORY"])
        os.makedirs(self.env["CUDA_MPS_LOG_DIRECTORY"])
        self.info: dict = {"requested": True, "running": False}

    def start(self) -> None:
        exe = shutil.which("nvidia-cuda-mps-control")
        if exe is None:
            self.info["why"] = "nvidia-cuda-mps-control not found"
            return
        rc, out = _sh([exe, "-d"], env=self.env)
        if rc != 0:
            self.info["why"] = f"nvidia-cuda-mps-control -d: rc {rc}: {out}"
            return
        time.sleep(1.0)
        self.info["running"] = True

    def servers(self) -> str:
        return _sh(["nvidia-cuda-mps-control"], env=self.env, inp="get_server_list\n")[1]

    def stop(self) -> None:
        if self.info.get("running"):
            self.info["servers_seen"] = self.info.get("servers_seen") or self.servers()
            rc, out = _sh(["nvidia-cuda-mps-control"], env=self.env, inp="quit\n")
            self.info["stopped"] = rc == 0
            time.sleep(1.0)
        log = Path(self.env["CUDA_MPS_LOG_DIRECTORY"]) / "control.log"
        if log.exists():
            self.info["control_log_tail"] = log.read_text(errors="replace")[-600:]


def run_case(name: str, argv: list[str], limit: float, pass_re: str | None, ranks: int, env: dict[str, str],
             log, how: str = "torchrun", out_dir: Path | None = None) -> list[dict]:
    if how == "torchrun":
        cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), str(ranks), *argv]
    else:
        cmd = [env.get("OVERLAP_PYTHON", sys.executable), *argv, str(ranks), str(out_dir or ".")]
    shown = " ".join(["python" if c == sys.executable else os.path.relpath(c, REPO) if c.startswith(str(REPO))
                      else c for c in cmd])  # no machine paths in the log
    log.write(f"\n===== {name}: {shown} (at most {limit:.0f} s)\n")
    log.flush()
    t0 = time.time()
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)  # the job's own process group (started above), nothing else
            p.wait()
            rc = None
        took = time.time() - t0
        out.seek(0)
        text = out.read()
    log.write(text)
    log.write(f"===== {name}: rc={rc} after {took:.1f} s\n")
    log.flush()
    return parse_results(name, text, rc, took, limit, pass_re)


def parse_results(name: str, text: str, rc: int | None, took: float, limit: float, pass_re: str | None) -> list[dict]:
    """The tests of one job's output ``text`` (``rc`` None: killed at ``limit``): its RESULT
    lines, or, for a job that prints a PASS line instead, one test named after the job; a
    job that failed or timed out without saying which test gets a test of its own."""
    tests = []
    for m in re.finditer(r"^RESULT (\S+) (passed|failed) ([0-9.]+) ?(.*)$", text, re.M):
        tests.append({"name": m.group(1), "outcome": m.group(2), "seconds": float(m.group(3)),
                      "detail": m.group(4)[:400]})
    if pass_re is not None:
        ok = rc == 0 and re.search(pass_re, text, re.M) is not None
        tests.append({"name": name, "outcome": "passed" if ok else ("timeout" if rc is None else "failed"),
                      "seconds": round(took, 1), "detail": _tail(text) if not ok else
                      re.search(pass_re + ".*$", text, re.M).group(0)[:400]})
    elif rc is None:
        tests.append({"name": f"{name} (job)", "outcome": "timeout", "seconds": round(took, 1),
                      "detail": f"killed after {limit:.0f} s; " + _tail(text)})
    elif rc != 0 or not tests:
        tests.append({"name": f"{name} (job)", "outcome": "failed", "seconds": round(took, 1),
                      "detail": f"rc {rc}; " + _tail(text)})
    return tests


def _tail(text: str) -> str:
    """The job's last error lines (a rank's exception, not torchrun's summary), else its last lines."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.search(r"(Error|Exception|assert)\b", ln) and "ChildFailedError" not in ln
            and "error_file" not in ln and not ln.startswith(("File ", "raise "))]
    picked = errs[-3:] if errs else lines[-4:]
    return " | ".join(dict.fromkeys(picked))[-400:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ranks", type=int)
    ap.add_argument("--mps", action="store_true", help="run under an MPS daemon started (and stopped) here")
    ap.add_argument("--out", default=".", help="folder for shared_gpu.json and shared_gpu.log")
    ap.add_argument("--only", default="", help="comma-separated case names (default: all, in order)")
    ap.add_argument("--budget-s", type=float, default=3600.0, help="stop starting cases after this many seconds")
    args = ap.parse_args()
    if args.ranks < 2:
        ap.error("ranks must be at least 2")
    names = [c[0] for c in CASES]
    only = [s for s in args.only.split(",") if s]
    bad = [s for s in only if s not in names]
    if bad:
        ap.error(f"unknown case(s) {bad}; cases: {names}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mps = Mps() if args.mps else None
    if mps is not None:
        mps.start()
    env = dict(mps.env if mps is not None else os.environ, OVERLAP_SHARED_GPU="1")
    ctx = context(args.ranks, mps.info if mps is not None else {"requested": False, "running": False})
    t_start = time.time()
    tests: list[dict] = []
    try:
        with open(out / "shared_gpu.log", "w") as log:
            log.write(json.dumps(ctx) + "\n")
            for name, argv, limit, pass_re, how in CASES:
                if only and name not in only:
                    continue
                left = args.budget_s - (time.time() - t_start)
                if left < 30:
                    tests.append({"name": name, "outcome": "not_run", "seconds": 0.0,
                                  "detail": f"time budget ({args.budget_s:.0f} s) spent"})
                    continue
                # a job's own files go to a temporary folder (its output, curves included, to the log)
                work = Path(tempfile.mkdtemp(prefix=f"overlap-{name}-")) if how == "python" else None
                tests += run_case(name, argv, min(limit, left), pass_re, args.ranks, env, log, how, work)
                if work is not None:
                    shutil.rmtree(work, ignore_errors=True)
                if mps is not None and "servers_seen" not in mps.info:
                    mps.info["servers_seen"] = mps.servers()
                print("\n".join(f"{t['outcome']:8s} {t['name']}" for t in tests[-20:] if t.get("_shown") is None),
                      flush=True)
                for t in tests:
                    t["_shown"] = True
    finally:
        if mps is not None:
            mps.stop()
        ctx["gpu_settings_after"] = gpu_settings()
        for t in tests:
            t.pop("_shown", None)
        (out / "shared_gpu.json").write_text(json.dumps({"context": ctx, "tests": tests}, indent=1) + "\n")
    bad = [t for t in tests if t["outcome"] not in ("passed", "not_run")]
    print(f"{len(tests) - len(bad)} of {len(tests)} passed or not run; wrote {out / 'shared_gpu.json'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
