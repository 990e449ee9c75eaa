"""The 192-column tile probe (``benchmarks/diag/wide_tile_diag.py``) computes C = A @ B:
its ``--check`` under the Triton interpreter (tiny shapes, both B layouts, ragged edges)."""

from __future__ import annotations

import sys

from tests._procs import REPO, run_cmd


def test_wide_tile_probe_matches_torch() -> None:
    r = run_cmd([sys.executable, str(REPO / "benchmarks" / "diag" / "wide_tile_diag.py"), "--check"],
                timeout_s=300, env={"TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and "PASS wide_tile check" in r.out, r.out[-3000:]
