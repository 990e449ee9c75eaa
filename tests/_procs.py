"""Start the ranks of a small job as subprocesses, bounded in time.

The multi-process tests start their own processes so plain ``pytest`` works. Output
goes to files, not pipes: a rank blocked on a full pipe while its peer waits for it in a
collective would turn into a hang.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Launcher variables a test process must not inherit from whatever started pytest.
_LAUNCH_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "TORCHELASTIC_", "SLURM_")
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "GROUP_RANK", "ROLE_RANK")


@dataclass
class Proc:
    rank: int
    returncode: int | None  # None: killed at the deadline
    out: str
    elapsed_s: float

    def __str__(self) -> str:
        return f"--- rank {self.rank} rc={self.returncode} ({self.elapsed_s:.1f} s)\n{self.out}"


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without launcher variables, with the repo importable and extra added."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_LAUNCH_PREFIXES) and k not in _LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


_PER_RANK = ("RANK", "LOCAL_RANK")

COMPILER = ("torch._dynamo", "torch._functorch.aot_autograd")
"""``run_ranks(preload=...)`` for ranks that call torch.compile."""


def run_ranks(script: Path | str, world_size: int, args: Sequence[str] = (), *,
              ranks: Sequence[int] | None = None, timeout_s: float = 60.0,
              env: dict[str, str] | None = None, fork: bool | None = None,
              preload: Sequence[str] = ()) -> list[Proc]:
    """Run ``python script args`` once per rank with torchrun-style variables.

    ``ranks`` picks which ranks to start (default all) so a test can leave one out.
    Every process is killed at ``timeout_s``; its returncode is then None. ``fork``
    (default: on Linux, where ``OVERLAP_TEST_FORK`` is not 0): the ranks are forked
    from one process that imported torch once (``tests/_forkrun.py``) instead of each
    importing it; ``preload``: more modules imported there once (``tests/_forkrun.py``).
    """
    port = str(free_port())
    ranks = list(range(world_size)) if ranks is None else list(ranks)
    envs = {r: clean_env(RANK=str(r), WORLD_SIZE=str(world_size), LOCAL_RANK=str(r),
                         LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=port, **(env or {})) for r in ranks}
    if fork is None:
        fork = sys.platform.startswith("linux") and os.environ.get("OVERLAP_TEST_FORK", "1") != "0"
    with tempfile.TemporaryDirectory() as tmp:
        if fork and ranks:
            return _forked(script, args, ranks, envs, Path(tmp), timeout_s, preload)
        procs = []
        for r in ranks:
            log = open(Path(tmp) / f"rank{r}.log", "w+")
            p = subprocess.Popen([sys.executable, str(script), *args], env=envs[r], cwd=REPO,
                                 stdout=log, stderr=subprocess.STDOUT)
            procs.append((r, p, log))
        return _collect(procs, timeout_s)


def _forked(script: Path | str, args: Sequence[str], ranks: list[int], envs: dict[int, dict[str, str]],
            tmp: Path, timeout_s: float, preload: Sequence[str] = ()) -> list[Proc]:
    """``run_ranks`` through one forking process (its environment: the ranks' less their rank)."""
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"dir": str(tmp), "script": str(script), "args": list(args), "ranks": ranks,
                                "preload": list(preload), "envs": {str(r): e for r, e in envs.items()}}))
    base = {k: v for k, v in envs[ranks[0]].items() if k not in _PER_RANK}
    start = time.monotonic()
    with open(tmp / "forkrun.log", "w+") as log:
        p = subprocess.Popen([sys.executable, str(REPO / "tests" / "_forkrun.py"), str(spec)], env=base, cwd=REPO,
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        own = _collect([(-1, p, log)], timeout_s)[0]
    out = []
    for r in ranks:
        rc, end = None, time.monotonic()
        if (tmp / f"rc{r}").exists():
            code, at = (tmp / f"rc{r}").read_text().split()
            rc, end = int(code), float(at)
        text = (tmp / f"rank{r}.log").read_text() if (tmp / f"rank{r}.log").exists() else ""
        if rc is None and own.returncode not in (0, None):  # the forking process itself failed
            text += f"\n[forkrun exited {own.returncode}]\n{own.out}"
        out.append(Proc(r, rc, text, end - start))
    return out


def run_cmd(cmd: Sequence[str], *, timeout_s: float = 120.0,
            env: dict[str, str] | None = None) -> Proc:
    """Run one command (a launcher script) to completion or the deadline."""
    with tempfile.TemporaryDirectory() as tmp:
        log = open(Path(tmp) / "out.log", "w+")
        p = subprocess.Popen(list(cmd), env=clean_env(**(env or {})), cwd=REPO,
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return _collect([(-1, p, log)], timeout_s)[0]


def _collect(procs: list, timeout_s: float) -> list[Proc]:
    start = time.monotonic()
    deadline = start + timeout_s
    results = []
    for r, p, log in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
            rc = p.returncode
        except subprocess.TimeoutExpired:
            _kill(p)
            rc = None
        elapsed = time.monotonic() - start
        log.seek(0)
        results.append(Proc(r, rc, log.read(), elapsed))
        log.close()
    return results


def _kill(p: subprocess.Popen) -> None:
    """Kill p and, when it leads its own session (a launcher), everything it started."""
    try:
        if os.getpgid(p.pid) == p.pid:
            os.killpg(p.pid, 9)
        else:
            p.kill()
    except ProcessLookupError:
        pass
    p.wait()
