"""The tile-flag GEMM under the Triton interpreter (CPU): each scenario in its own process,
since TRITON_INTERPRET must be set before Triton compiles anything."""

from __future__ import annotations

import pytest

from tests._procs import REPO, run_cmd

pytest.importorskip("triton")


@pytest.mark.parametrize("scenario", ["schedules", "all_gather_layout", "posts_and_gelu", "timeout",
                                      "dispatch_counter", "add_norm", "row_chunks", "chain", "tilesync",
                                      "push_layout", "reduce_norm", "norm_fold", "p2p_all_reduce_op", "p2p_all_gather_op",
                                      "split_tail", "wrap", "p2p_disagree", "late_peer_new_m",
                                      "nccl_pipeline"])
def test_tile_gemm_interpreted(scenario: str) -> None:
    r = run_cmd(["python", str(REPO / "tests" / "_kernel_interp_worker.py"), scenario], timeout_s=240,
                env={"TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and f"PASS {scenario}" in r.out, r
