"""One rank of the benchmark runner's CPU test (started by test_bench_suite.py).

    python tests/_bench_worker.py [--break-op NAME] [--break-variant OP:VARIANT] -- RUNNER ARGS...

Runs ``benchmarks/run.py``'s main in this process. ``--break-op NAME`` makes that op's
setup raise ImportError, as when the library lacks the op: the runner must report it and
go on. ``--break-variant OP:VARIANT`` makes one variant raise on every call: the runner
must record the error and exit 1.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _op_module(name: str) -> Any:
    return importlib.import_module(f"benchmarks.suite.op_{name}")


def break_op(name: str) -> None:
    mod = _op_module(name)

    def setup(shape: Any, env: Any) -> Any:
        raise ImportError(f"cannot import name 'missing_{name}' from 'overlap.ops'")

    mod.OP = dataclasses.replace(mod.OP, setup=setup)


def break_variant(name: str, variant: str) -> None:
    mod = _op_module(name)
    real = mod.OP.setup

    def setup(shape: Any, env: Any) -> Any:
        case = real(shape, env)

        def fail() -> None:
            raise RuntimeError(f"{variant} broken on purpose")

        case.variants[variant].fn = fail
        return case

    mod.OP = dataclasses.replace(mod.OP, setup=setup)


def main() -> int:
    argv = sys.argv[1:]
    while argv and argv[0] != "--":
        flag, value, argv = argv[0], argv[1], argv[2:]
        if flag == "--break-op":
            break_op(value)
        elif flag == "--break-variant":
            break_variant(*value.split(":"))
        else:
            raise SystemExit(f"unknown option {flag}")
    from benchmarks.suite.runner import main as run_main

    return run_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
