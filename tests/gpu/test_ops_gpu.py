"""The collective ops on two GPUs, under torchrun and under mpirun (see agmm_check.py, armm_check.py),
all_gather_matmul with a list of weights on one GPU and two (agmm_many_check.py), and both
consumer ops with a new M every call (random_m_check.py)."""

from __future__ import annotations

import re

import pytest

from tests._procs import run_cmd

MANY = "tests/gpu/agmm_many_check.py"
RANDOM_M = "tests/gpu/random_m_check.py"


@pytest.mark.gpu2
@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("mpirun", marks=pytest.mark.mpi)])
@pytest.mark.parametrize("op", ["agmm", "armm"])
def test_op_gpu(op: str, launcher: str) -> None:
    r = run_cmd(["bash", f"launch/{launcher}.sh", "2", f"tests/gpu/{op}_check.py"], timeout_s=400)
    assert r.returncode == 0, r.out[-6000:]
    assert re.search(rf"^PASS {op} {launcher} world=2 ", r.out, re.M), r
    print(re.search(rf"^PASS {op} .*$", r.out, re.M).group(0))


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.gpu), pytest.param(2, marks=pytest.mark.gpu2)])
def test_weight_list_one_grid_gpu(world: int) -> None:
    """all_gather_matmul with a list of weights (QKV-like, different N, bf16) as one grid:
    every output against torch.matmul with new inputs every call, the one-grid path counted,
    five weights on the widest-fused path with its reason in the report."""
    r = run_cmd(["bash", "launch/torchrun.sh", str(world), MANY], timeout_s=500)
    assert r.returncode == 0, r.out[-6000:]
    assert len(re.findall(rf"^PASS agmm_many world={world} ", r.out, re.M)) == world, r.out[-6000:]


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.gpu), pytest.param(2, marks=pytest.mark.gpu2)])
def test_random_m_gpu(world: int) -> None:
    """A new M every call (1 to 6000 rows, random): both consumer ops, one weight and a
    list, against torch with new inputs every call; plans per row bucket, not per M; a
    CUDA graph at an M of a warm bucket."""
    r = run_cmd(["bash", "launch/torchrun.sh", str(world), RANDOM_M], timeout_s=500)
    assert r.returncode == 0, r.out[-6000:]
    assert len(re.findall(rf"^PASS random_m world={world} ", r.out, re.M)) == world, r.out[-6000:]


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["auto", "gluon"])
def test_call_plans_gpu(engine: str) -> None:
    """The five group ops from their call plans at world size 1 (planned_check.py): a plan
    per signature, later calls counted as planned and right with new inputs, refusals and
    unaligned inputs through the full path, a CUDA graph at a planned signature; with the
    Gluon GEMM forced, its launches bound in the bodies (the engines listed)."""
    r = run_cmd(["python", "tests/gpu/planned_check.py", "--engine", engine], timeout_s=400)
    assert r.returncode == 0, r.out[-6000:]
    got = re.search(r"^PASS planned world=1 ops=10 .* engines=(\S+)$", r.out, re.M)
    assert got, r.out[-6000:]
    if engine == "gluon":
        assert "gluon" in got.group(1).split(","), got.group(0)


@pytest.mark.gpu
@pytest.mark.parametrize("copies", ["graph", "driver", "nodes"])
def test_plan_graphs_gpu(copies: str) -> None:
    """The five group ops and the chain from plan graphs at world size 1
    (plan_graphs_check.py): captured once, replayed right with new inputs every call,
    earlier outputs unchanged, a weight changed in place or moved, two streams, a user's
    graph at the signature; the copies made by the graph's own kernels (``kernels.relay``),
    by the driver per call, or by the graph's memcpy nodes re-pointed per call
    (``_graph_nodes``)."""
    r = run_cmd(["python", "tests/gpu/plan_graphs_check.py", "--copies", copies], timeout_s=400)
    assert r.returncode == 0, r.out[-6000:]
    assert re.search(rf"^PASS plan_graphs world=1 ops=6 copies={copies} ", r.out, re.M), r.out[-6000:]
    print(re.search(r"^PASS plan_graphs .*$", r.out, re.M).group(0))
