"""Start the ranks of a job as forks of one process that has imported torch (``tests._procs``).

    python tests/_forkrun.py SPEC.json

Every rank of a multi-process test imports torch first: about 1-2 s of CPU per process,
most of a small job's time on a 2-core machine. Here torch is imported once and the
ranks are forked from this process afterwards, each then running its script as
``python script args`` would (``__main__``, ``sys.argv``, ``sys.path[0]``, its own
environment and log file, its exit status). Nothing of torch runs before the fork
(no thread pool, no device), so a forked rank starts as a fresh process would, less the
import. Each rank's exit status goes to ``rc<rank>`` in the spec's folder as soon as it
ends (a job killed at its deadline keeps the statuses of the ranks that ended). A test may
name more modules its ranks import (``run_ranks(preload=...)``: libraries such as
transformers' model files, never this package, whose settings are read from the
environment when it is imported).
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import time

spec = json.loads(open(sys.argv[1]).read())
del sys.path[0]  # this file's folder: the modules below are libraries, found where they are installed
import torch  # noqa: E402,F401  (the point: imported once, before the forks)

for name in spec.get("preload", ()):  # more modules every rank imports (a test names them)
    importlib.import_module(name)

children: dict[int, int] = {}
for rank in spec["ranks"]:
    pid = os.fork()
    if pid == 0:
        fd = os.open(os.path.join(spec["dir"], f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.environ.clear()
        os.environ.update(spec["envs"][str(rank)])
        script = spec["script"]
        sys.argv = [script, *spec["args"]]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as ``python script`` has it
        runpy.run_path(script, run_name="__main__")
        sys.exit(0)  # as the script's end would: atexit handlers and non-daemon threads, then exit
    children[pid] = rank

while children:
    pid, status = os.wait()
    rank = children.pop(pid, None)
    if rank is not None:
        with open(os.path.join(spec["dir"], f"rc{rank}"), "w") as f:
            f.write(f"{os.waitstatus_to_exitcode(status)} {time.monotonic()}")
