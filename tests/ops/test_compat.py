"""overlap.compat (torch's async-TP schemas) and the top-level ops' N-D inputs, gather /
scatter dims and weight lists, on gloo through the reference path, against torch's own
fallbacks (values and strides): see _compat_worker.py. The GPU run: tests/gpu/compat_check.py."""

from __future__ import annotations

import pytest

from tests._procs import COMPILER, REPO, run_ranks


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_compat_gloo(world_size: int) -> None:
    procs = run_ranks(REPO / "tests" / "_compat_worker.py", world_size, timeout_s=300, preload=COMPILER)
    for p in procs:
        assert p.returncode == 0 and f"PASS compat rank={p.rank} world={world_size}" in p.out, p


def test_compat_schemas_match_torch() -> None:
    """The schemas are torch's, op for op (the switch is the namespace)."""
    import torch

    import overlap.compat  # noqa: F401

    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (defines torch.ops.symm_mem.*)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"torch's symmetric memory module: {e}")
    for op in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter", "fused_all_gather_scaled_matmul",
               "fused_scaled_matmul_reduce_scatter"):
        ours = str(getattr(torch.ops.overlap, op).default._schema).split("(", 1)[1]
        theirs = str(getattr(torch.ops.symm_mem, op).default._schema).split("(", 1)[1]
        assert ours == theirs, (op, ours, theirs)


def test_inductor_async_tp_emits_overlap_ops() -> None:
    """torch.compile's async-TP pass, retargeted: the generated code calls overlap's ops."""
    pytest.importorskip("torch._inductor")
    procs = run_ranks(REPO / "tests" / "_inductor_tp_worker.py", 2, timeout_s=400,
                      preload=COMPILER + ("torch._inductor.compile_fx",))
    for p in procs:
        assert p.returncode == 0 and f"PASS inductor_tp rank={p.rank} world=2" in p.out, p


def test_block_benchmark_gloo(tmp_path) -> None:  # noqa: ANN001
    """benchmarks/bench_block.py on gloo, sequence parallel, every mode: the eager layers time;
    the compiled-overlap mode's generated code calls overlap's fused ops (forward and
    backward), the compiled mode none; torch's symm_mem mode is n/a without CUDA."""
    import json

    from tests._procs import run_cmd

    r = run_cmd(["bash", "launch/torchrun.sh", "2", "benchmarks/bench_block.py", "--sp", "--pretend-nccl",
                 "--out", str(tmp_path)], timeout_s=400)
    assert r.returncode == 0, r.out[-4000:]
    doc = json.loads((tmp_path / "block_sp.json").read_text())
    assert doc["note"].startswith("CPU run") and doc["context"]["world_size"] == 2
    rows = {row["mode"]: row for row in doc["rows"]}
    for mode in ("plain", "library", "library-regather", "compiled", "compiled-overlap"):
        assert rows[mode]["ms_per_step"] > 0 and rows[mode]["tokens_per_s"] > 0, rows[mode]
    assert "CUDA" in rows["compiled-torch"]["na"]
    assert "GPU" in rows["plain-graphed"]["na"] and "GPU" in rows["library-graphed"]["na"]
    assert not any(rows["compiled"]["fused_calls"].values()), rows["compiled"]
    calls = rows["compiled-overlap"]["fused_calls"]
    # qkv and fc1 gather in the forward, proj and fc2 in the backward; the reverse for the scatters
    assert calls["overlap.fused_all_gather_matmul"] == 4 and calls["overlap.fused_matmul_reduce_scatter"] == 4, calls
    assert calls["symm_mem.fused_all_gather_matmul"] == 0 == calls["symm_mem.fused_matmul_reduce_scatter"], calls
