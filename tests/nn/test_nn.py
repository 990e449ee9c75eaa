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

from tests._procs import COMPILER, REPO, run_ranks


@pytest.mark.parametrize("world_size", [2, 4])
def test_layers_gloo(world_size: int) -> None:
    procs = run_ranks(REPO / "tests" / "_nn_worker.py", world_size, timeout_s=150)
    for p in procs:
        assert p.returncode == 0 and f"PASS nn world={world_size} rank={p.rank}" in p.out, p


def test_layers_compiled_gloo() -> None:
    procs = run_ranks(REPO / "tests" / "_nn_worker.py", 2, ["compile"], timeout_s=150, preload=COMPILER)
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


# the GPT block shapes of benchmarks/bench_block.py at TP 2, bf16: (hidden, tokens) -> the
# column layers qkv [3C/R rows] and fc1 [4C/R]; every one regathers (N/R of 12288 and more
# is far above the rule's ~3240 at these rates)
_GPT = [(c, t, n) for c in (8192, 12288) for t in (4096, 8192) for n in (3 * c, 4 * c)]


@pytest.mark.parametrize("c,t,n", _GPT)
def test_regather_plan_gpt_shapes(c: int, t: int, n: int) -> None:
    import torch

    from overlap.nn.functional import regather_plan

    p = regather_plan(t, n // 2, c, 2, torch.bfloat16)
    assert p.regather and p.gather_s + p.reduce_scatter_s <= p.gemm_s, p
    assert p.saved_bytes == (t - t // 2) * c * 2  # bytes of [M, K] - [M/R, K]
    # the estimates against the measured all-gather and cuBLAS figures (benchmarks/RESULTS.md,
    # 2x H200: 8192 x 12288 gathered in 0.477 ms; 8192 x 18432 x 12288 GEMM in 5.449 ms)
    if (c, t, n) == (12288, 8192, 3 * 12288):
        assert 0.45e-3 < p.gather_s < 0.55e-3 and 5.2e-3 < p.gemm_s < 5.7e-3, p


def test_regather_plan_rule() -> None:
    import torch

    from overlap.nn import functional as F

    bf16 = torch.bfloat16
    # narrow layers keep: the gather and the reduce-scatter outlast the GEMM
    keep = F.regather_plan(8192, 1024, 8192, 2, bf16)
    assert not keep.regather and keep.gather_s + keep.reduce_scatter_s > keep.gemm_s, keep
    # the threshold in N/R does not move with M and K (the byte terms cancel), save the fixed cost
    edge = [n for n in range(2048, 8192, 64) if F.regather_plan(8192, n, 8192, 2, bf16).regather][0]
    assert 3000 < edge < 3600, edge
    assert F.regather_plan(16384, edge, 12288, 2, bf16).regather
    assert not F.regather_plan(16384, edge - 256, 12288, 2, bf16).regather
    # small inputs keep: the fixed cost of one more collective outweighs the GEMM
    assert not F.regather_plan(64, 12288, 8192, 2, bf16).regather
    assert F.regather_plan(512, 12288, 8192, 2, bf16).regather
    # one rank: nothing to gather, nothing saved
    one = F.regather_plan(8192, 12288, 8192, 1, bf16)
    assert not one.regather and one.saved_bytes == 0
    # fp32 at 4 ranks: twice the bytes, a slower GEMM, 3/4 of [M, K] saved
    p = F.regather_plan(4096, 8192, 4096, 4, torch.float32)
    assert p.saved_bytes == 3 * 1024 * 4096 * 4 and p.regather, p


def test_save_gathered_bad_values() -> None:
    import torch

    from overlap.nn import functional as F

    x, w = torch.zeros(2, 4), torch.zeros(4, 4)
    for bad in ("yes", "Auto", 1, 0, None, 2.0):
        with pytest.raises(ValueError, match="save_gathered"):
            F.all_gather_linear(x, w, group=None, save_gathered=bad)
