"""Shared pytest set-up: skip tests whose hardware or launcher is missing.

Markers (registered in pyproject.toml):
    gpu   needs 1+ CUDA GPU          gpu2  needs 2 CUDA GPUs
    mpi   needs mpirun and mpi4py     slow  takes more than a few seconds

A marked test is skipped with the reason, never failed, where its need is not met, so
plain ``python -m pytest -q`` passes on a CPU-only machine.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # One CPU thread for torch in the test processes (the ranks' processes get the same,
    # tests._procs): the tensors here are tiny, and with a thread per core a matmul waits for
    # a thread the other busy core does not run (the host-time tests then took seconds)
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


@functools.cache
def cuda_device_count() -> int:
    """Visible CUDA GPUs; 0 when torch has no CUDA (imported only when a test asks)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


@functools.cache
def mpi_missing() -> str | None:
    """Why MPI tests cannot run here, or None when they can."""
    if shutil.which("mpirun") is None:
        return "mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py not installed (pip install 'overlap[mpi]')"
    return None


_ONE_WORKER_MODULES = ("tests/nn/test_gpt.py", "tests/ops/test_compile.py", "tests/nn/test_checkpoint.py")
"""Modules whose tests share runs made once per module (a fixture, a cache of training runs)."""


def _xdist_group(item: pytest.Item) -> str | None:
    """Under pytest-xdist (``-n``, ``--dist loadgroup``), the tests that must share one
    worker: a module's tests that share its runs; the interpreted tests of a folder (one
    child interprets them all, ``tests._interp``); the GPU tests (one GPU, one at a time)."""
    path = item.nodeid.split("::", 1)[0]
    if item.get_closest_marker("gpu") is not None or item.get_closest_marker("gpu2") is not None:
        return "gpu"
    if getattr(getattr(item, "function", None), "_interpreted_timeout_s", None) is not None:
        return "interpreted:" + path.rsplit("/", 1)[0]
    if path in _ONE_WORKER_MODULES:
        return path
    return None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if (group := _xdist_group(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        if item.get_closest_marker("gpu2") is not None and cuda_device_count() < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 CUDA GPUs, found {cuda_device_count()}"))
        elif item.get_closest_marker("gpu") is not None and cuda_device_count() < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if item.get_closest_marker("mpi") is not None and (why := mpi_missing()):
            item.add_marker(pytest.mark.skip(reason=why))


def pytest_collection_finish(session: pytest.Session) -> None:
    # the interpreted tests the session runs, for one child per module (tests._interp)
    from tests._interp import note_selected

    note_selected(session.items)
