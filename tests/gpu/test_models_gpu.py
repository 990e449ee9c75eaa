"""``parallelize`` on an HF Llama of about 100M parameters at world size 1 on CUDA; see models_check.py."""

from __future__ import annotations

import re

import pytest

from tests._procs import REPO, run_cmd


@pytest.mark.gpu
def test_parallelize_llama_one_gpu() -> None:
    pytest.importorskip("transformers", reason="the check builds an HF transformers Llama (the test extra)")
    r = run_cmd(["python", str(REPO / "tests" / "gpu" / "models_check.py")], timeout_s=500)
    assert r.returncode == 0 and re.search(r"^PASS models world=1 ", r.out, re.M), r.out[-6000:]
