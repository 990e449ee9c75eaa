"""``overlap.nn`` on gloo: the layers' outputs and gradients against unsharded references
(``_nn_worker.py``, 2 and 4 ranks), and under torch.compile (aot_eager, 2 ranks).

On the CPU every op takes its reference path; what is checked is the autograd (each
Function's pair of collectives, the bias and norm-parameter gradients, the sequence-parallel
layouts), ``from_linear``, ``parallelize``, and the argument checks.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests._procs import REPO, run_ranks


@pytest.mark.parametrize("world_size", [2, 4])
def test_layers_gloo(world_size: int) -> None:
    procs = run_ranks(REPO / "tests" / "_nn_worker.py", world_size, timeout_s=150)
    for p in procs:
        assert p.returncode == 0 and f"PASS nn world={world_size} rank={p.rank}" in p.out, p


def test_layers_compiled_gloo() -> None:
    procs = run_ranks(REPO / "tests" / "_nn_worker.py", 2, ["compile"], timeout_s=150)
    for p in procs:
        assert p.returncode == 0 and f"PASS nn compile world=2 rank={p.rank}" in p.out, p


def test_top_level_names() -> None:
    import overlap

    assert "nn" in overlap.__all__ and "parallelize" in overlap.__all__
    assert overlap.parallelize is overlap.nn.parallelize
    for name in overlap.nn.__all__:
        assert hasattr(overlap.nn, name), name


def test_import_stays_light() -> None:
    code = ("import sys, overlap, overlap.nn; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('cupy', 'mpi4py', 'triton') "
            "or m.startswith(('cuda.bindings', 'torch._dynamo'))]; assert not bad, bad[:5]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
