"""Run a test under the Triton interpreter, in a child process.

Triton reads ``TRITON_INTERPRET`` when it is imported, so a test that interprets kernels
on the CPU cannot share the process of tests that do not. ``@interpreted`` makes a test
run itself again in a child ``pytest`` with ``TRITON_INTERPRET=1`` (bounded in time, its
output in the failure message); in the child, the test body runs.

    @interpreted
    def test_posts():
        ...  # launches kernels on CPU tensors

Parametrized tests work: the child gets the test's node id.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable

import pytest

from tests._procs import REPO, run_cmd

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def interpreted(fn: Callable[..., Any] | None = None, *, timeout_s: float = 240.0) -> Any:
    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def run(*args: Any, **kwargs: Any) -> Any:
            if INTERPRETING:
                return f(*args, **kwargs)
            pytest.importorskip("triton")
            node = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
            r = run_cmd([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", node],
                        timeout_s=timeout_s, env={"TRITON_INTERPRET": "1"})
            assert r.returncode == 0 and " passed" in r.out, f"{node} under TRITON_INTERPRET=1:\n{r.out[-6000:]}"

        return run

    return wrap(fn) if fn is not None else wrap


__all__ = ["interpreted", "INTERPRETING", "REPO"]
