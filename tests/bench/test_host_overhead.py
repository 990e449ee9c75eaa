"""benchmarks/host_overhead.py on the CPU: every row is written, with the JSON layout the
results tables read, at one rank and under the torchrun launcher at two."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROWS = ["torch.mm", "torch layer_norm + mm", "all_gather_matmul", "all_reduce_matmul + layernorm",
        "matmul_reduce_scatter", "matmul_all_reduce", "matmul_all_reduce_matmul + layernorm",
        "torch nn.Linear fwd+bwd", "ColumnParallelLinear fwd+bwd", "RowParallelLinear fwd+bwd",
        "NormColumnParallelLinear fwd+bwd"]


@pytest.mark.parametrize("ranks", [1, 2])
def test_every_row_is_measured(tmp_path: Path, ranks: int) -> None:
    out = tmp_path / "res"
    script = [str(ROOT / "benchmarks" / "host_overhead.py"), "--out", str(out), "--calls", "5"]
    cmd = ([sys.executable] + script if ranks == 1
           else ["bash", str(ROOT / "launch" / "torchrun.sh"), str(ranks)] + script)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    res = json.loads((out / "host_overhead.json").read_text())
    assert [row["op"] for row in res["rows"]] == ROWS
    for row in res["rows"]:
        assert 0 < row["host_us_p50"] <= row["host_us_p99"], row
        assert row["gpu_us"] is None  # no GPU here
    assert res["context"]["world_size"] == ranks and res["context"]["shape"] == [64, 128, 128]
    assert "reference" in res["context"]["path"]
