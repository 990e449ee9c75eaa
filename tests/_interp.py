"""Run a test under the Triton interpreter, in a child process.

Triton reads ``TRITON_INTERPRET`` when it is imported, so a test that interprets kernels
on the CPU cannot share the process of tests that do not. ``@interpreted`` makes a test
run itself again in a child ``pytest`` with ``TRITON_INTERPRET=1`` (bounded in time, its
output in the failure message); in the child, the test body runs.

    @interpreted
    def test_posts():
        ...  # launches kernels on CPU tensors

Parametrized tests work: the child gets the test's node id.

One child per test directory, not per test: the first interpreted test of a directory
(tests/ops, tests/kernels) to run starts a child for all of the session's selected
interpreted tests of that directory (their node ids noted at the end of collection,
``note_selected``) and reads each one's outcome from the child's JUnit XML; each test then
passes on its own outcome. (Each child pays for importing torch and Triton and for
collecting its modules: a few seconds of CPU, once per directory instead of once per
module.) A test that did not pass
there (failed, skipped, or no outcome: the child crashed or ran out of time) runs again in
a child of its own, whose output is the failure message, so the batch can only save time.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import xml.etree.ElementTree as ET
from typing import Any, Callable

import pytest

from tests._procs import REPO, run_cmd

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

BATCH_BOUND_S = 450.0
"""A batch child is killed past this (its tests then run alone), before pytest's own
600 s bound on the test that started it would fire and leave the child running."""

_selected: dict[str, float] = {}
"""Node id -> time bound of every interpreted test the session selected, in order."""
_batches: dict[str, dict[str, str]] = {}
"""Directory -> {node id: outcome} of its batch child."""


def _node(nodeid: str) -> str:
    """A test's node id as a child ``pytest`` takes it: pytest-xdist's ``--dist loadgroup``
    adds ``@<group>`` to the ids of grouped tests (``tests/conftest.py``)."""
    return nodeid.split("@interpreted:", 1)[0]


def note_selected(items: Any) -> None:
    """Note the session's selected interpreted tests (``conftest``, at the end of collection)."""
    for item in items:
        bound = getattr(getattr(item, "function", None), "_interpreted_timeout_s", None)
        if bound is not None:
            _selected[_node(item.nodeid)] = bound


def _dir(node: str) -> str:
    return os.path.dirname(node.split("::", 1)[0])


def _batch(folder: str) -> dict[str, str]:
    """One child for the selected interpreted tests under ``folder``: {node id: outcome}."""
    nodes = [n for n in _selected if _dir(n) == folder]
    if len(nodes) < 2:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "junit.xml")
        run_cmd([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *nodes],
                timeout_s=min(BATCH_BOUND_S, sum(_selected[n] for n in nodes)), env={"TRITON_INTERPRET": "1"})
        try:
            root = ET.parse(report).getroot()
        except (OSError, ET.ParseError):
            return {}
    out = {}
    for case in root.iter("testcase"):  # classname "tests.ops.test_x", name "test_y[param]"
        bad = case.find("failure") is not None or case.find("error") is not None
        node = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
        out[node] = "failed" if bad else ("skipped" if case.find("skipped") is not None else "passed")
    return out


def interpreted(fn: Callable[..., Any] | None = None, *, timeout_s: float = 240.0) -> Any:
    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def run(*args: Any, **kwargs: Any) -> Any:
            if INTERPRETING:
                return f(*args, **kwargs)
            pytest.importorskip("triton")
            node = _node(os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0])
            if node in _selected:
                folder = _dir(node)
                if folder not in _batches:
                    _batches[folder] = _batch(folder)
                if _batches[folder].get(node) == "passed":
                    return None
            r = run_cmd([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", node],
                        timeout_s=timeout_s, env={"TRITON_INTERPRET": "1"})
            assert r.returncode == 0 and " passed" in r.out, f"{node} under TRITON_INTERPRET=1:\n{r.out[-6000:]}"

        run._interpreted_timeout_s = timeout_s  # type: ignore[attr-defined]  (note_selected reads it)
        return run

    return wrap(fn) if fn is not None else wrap


def _skip_repatching() -> None:
    """Make Triton's interpreter patch ``triton.language`` once per launch, not once per call.

    The interpreter patches the language modules a kernel sees (``_patch_lang``) when a
    launch starts and restores them when it ends. It also calls ``_patch_lang`` on every
    call of a ``@triton.jit`` helper inside the kernel, which walks every member of those
    modules again (``inspect.getmembers``) to patch what is still unpatched: nothing, where
    the launch patched the same modules. Under the interpreter that walk was about a
    third of the time of the kernels' tests (tens of thousands of helper calls). Here a
    helper's call skips it where every language module in its globals was patched by the
    launch in progress, and makes it, as before, otherwise. What the kernels compute is
    unchanged. Where the interpreter's internals differ (another Triton), nothing is changed."""
    try:
        from triton.runtime import interpreter as interp
    except ImportError:
        return
    original = getattr(interp, "_patch_lang", None)
    if original is None or getattr(original, "_once_per_launch", False) or not hasattr(interp, "tl"):
        return
    tl = interp.tl
    patched: set[int] = set()  # ids of the modules patched by the launch in progress

    class _Nothing:
        def restore(self) -> None:
            pass

    def langs(fn: Any) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_lang(fn: Any) -> Any:
        mine = langs(fn)
        if patched and mine <= patched:
            return _Nothing()  # a helper's call inside a launch that patched its modules
        scope = original(fn)
        if not patched:  # a launch: the modules are restored when it ends
            restore = scope.restore

            def restore_and_forget() -> None:
                patched.clear()
                restore()

            scope.restore = restore_and_forget
        patched.update(mine)
        return scope

    patch_lang._once_per_launch = True  # type: ignore[attr-defined]
    interp._patch_lang = patch_lang


if INTERPRETING:
    _skip_repatching()


__all__ = ["interpreted", "INTERPRETING", "REPO"]
