"""benchmarks/host_overhead.py on the CPU: every row is written, with the JSON layout the
results tables read, at one rank and under the torchrun launcher at two."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
        assert row["idle_us_p50"] > 0 and row["x_mm"] == pytest.approx(row["host_us_p50"] / res["rows"][0]["host_us_p50"],
                                                                       rel=0.01), row
    assert res["context"]["world_size"] == ranks and res["context"]["shape"] == [64, 128, 128]
    assert res["context"]["rounds"] == 5
    assert "reference" in res["context"]["path"]


def test_rows_are_timed_in_interleaved_rounds() -> None:
    """Every row is timed once per round, the rows in turn, the calls spread over the rounds
    (a host that drifts moves every row alike)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.host_overhead import interleaved

    log: list[str] = []
    rows = [(name, (lambda n=name: log.append(n)), False) for name in ("a", "b")]
    got = interleaved(rows, 7, 3, torch.device("cpu"), lambda: None)
    assert {k: (len(b2b), len(idle)) for k, (b2b, idle) in got.items()} == {"a": (7, 7), "b": (7, 7)}
    runs = [log[0]]
    for x in log[1:]:
        if x != runs[-1]:
            runs.append(x)
    assert runs == ["a", "b"] * 3, runs  # round by round, row by row
    # per round: the warm-up (10 in the first round, then 3), the timed calls back to back,
    # one more untimed, the timed calls onto an idle device: 7 calls = 3 + 2 + 2
    assert log.count("a") == (10 + 3 + 1 + 3) + (3 + 2 + 1 + 2) * 2
