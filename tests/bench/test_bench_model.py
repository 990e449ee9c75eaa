"""benchmarks/bench_model.py on gloo at tiny sizes: every mode runs, its output matches the
unsharded stack, the table and the JSON are written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests._procs import REPO, run_ranks

pytest.importorskip("transformers", reason="the benchmark builds HF transformers decoder layers (the test extra)")


def test_bench_model_cpu(tmp_path: Path) -> None:
    procs = run_ranks(REPO / "benchmarks" / "bench_model.py", 2, ["--sp", "--out", str(tmp_path)], timeout_s=240,
                      preload=("transformers.models.llama.modeling_llama",))
    assert all(p.returncode == 0 for p in procs), procs
    out = procs[0].out
    for mode in ("plain", "overlap", "dtensor"):
        row = re.search(rf"^{mode} +[\d.]+ +\d+ +\S+ +[\d.]+ +([\d.e+-]+)$", out, re.M)
        assert row and float(row.group(1)) < 1e-5, (mode, out[-3000:])
    assert re.search(r"^async-tp +n/a: CUDA", out, re.M), out[-3000:]
    doc = json.loads((tmp_path / "model_sp.json").read_text())
    assert [r["mode"] for r in doc["rows"]] == ["plain", "overlap", "dtensor", "async-tp"], doc["rows"]
    assert doc["context"]["world_size"] == 2 and "CPU run" in doc["note"]
