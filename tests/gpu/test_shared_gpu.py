"""Two ranks on one GPU (shared-GPU mode): ``launch/shared_gpu.sh 2``'s ops and guarantees
cases, every test in its shared_gpu.json passed (see shared_gpu_check.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._procs import run_cmd


@pytest.mark.gpu
def test_two_ranks_on_one_gpu(tmp_path: Path) -> None:
    r = run_cmd(["bash", "launch/shared_gpu.sh", "2", "--only", "ops,guarantees", "--out", str(tmp_path)],
                timeout_s=600)
    tests = json.loads((tmp_path / "shared_gpu.json").read_text())["tests"]
    names = {t["name"] for t in tests}
    assert {"all_gather_matmul", "matmul_reduce_scatter_and_all_reduce", "disagree_signature_words"} <= names, r.out
    assert all(t["outcome"] == "passed" for t in tests), [t for t in tests if t["outcome"] != "passed"]
