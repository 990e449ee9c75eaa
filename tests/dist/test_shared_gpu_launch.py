"""launch/shared_gpu.py's reading of a job's output into shared_gpu.json's tests (the GPU
jobs themselves run on a GPU only)."""

from __future__ import annotations

import importlib.util

from tests._procs import REPO

_spec = importlib.util.spec_from_file_location("shared_gpu_launch", REPO / "launch" / "shared_gpu.py")
sg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sg)


def test_result_lines_become_tests() -> None:
    text = ("MODE shared_gpu=True\nRESULT all_gather_matmul passed 4.6 8 peer-copy calls\n"
            "noise\nRESULT two_streams failed 1.2 AssertionError: ('p2p', 3, 0.5)\nDONE\n")
    assert sg.parse_results("ops", text, 0, 9.0, 100, None) == [
        {"name": "all_gather_matmul", "outcome": "passed", "seconds": 4.6, "detail": "8 peer-copy calls"},
        {"name": "two_streams", "outcome": "failed", "seconds": 1.2, "detail": "AssertionError: ('p2p', 3, 0.5)"}]


def test_jobs_that_end_badly_say_so() -> None:
    # a rank died after one test: the job is a failed test of its own, with the rank's error
    text = "RESULT a passed 1.0 ok\n[rank1]: RuntimeError: boom\nChildFailedError\n"
    got = sg.parse_results("ops", text, 1, 5.0, 100, None)
    assert [t["outcome"] for t in got] == ["passed", "failed"] and got[1]["name"] == "ops (job)"
    assert "RuntimeError: boom" in got[1]["detail"]
    assert sg.parse_results("kill", "", None, 90.0, 90, None)[0]["outcome"] == "timeout"
    assert sg.parse_results("ops", "nothing\n", 0, 1.0, 10, None)[0]["outcome"] == "failed"  # no RESULT at all
    # a job judged by its PASS line
    ok = sg.parse_results("p", "x\nPASS producer_p2p world=2 torchrun calls=40\n", 0, 3.0, 10, r"^PASS producer_p2p")
    assert ok[0]["outcome"] == "passed" and ok[0]["detail"].startswith("PASS producer_p2p world=2")
    bad = sg.parse_results("p", "PASS producer_p2p world=2\n", 1, 3.0, 10, r"^PASS producer_p2p")
    assert bad[0]["outcome"] == "failed"
