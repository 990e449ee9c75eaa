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


GPU2_NCCL_CHECKS = ("agmm_check", "armm_check", "agmm_many_check", "random_m_check", "producer_check",
                    "safety2_check", "nccl_comm_check", "real_jobs2_check")
"""The two-GPU checks that run NCCL somewhere (the NCCL transport, chunked baselines, a
communicator): in shared-GPU mode each must stop before its first op, saying why."""


def test_gpu2_checks_that_need_nccl_skip_in_the_mode() -> None:
    import ast

    for name in GPU2_NCCL_CHECKS:
        tree = ast.parse((REPO / "tests" / "gpu" / f"{name}.py").read_text())
        main = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "main")
        calls = [n.func for s in main.body for n in ast.walk(s) if isinstance(n, ast.Call)]
        names = [getattr(c, "attr", getattr(c, "id", "")) for c in calls]
        assert "exit_if_shared" in names, f"{name}.py: no exit_if_shared in main()"
        assert names.index("init") < names.index("exit_if_shared"), f"{name}.py: exit_if_shared before init"
        # right after init: nothing of the check runs before it
        first = [getattr(s.value, "func", None) for s in main.body if isinstance(s, (ast.Expr, ast.Assign))]
        firsts = [getattr(f, "attr", getattr(f, "id", "")) for f in first if f is not None]
        assert firsts.index("exit_if_shared") == firsts.index("init") + 1, f"{name}.py: exit_if_shared not next"


def test_exit_if_shared(monkeypatch, capsys) -> None:
    from types import SimpleNamespace

    import pytest

    from overlap import dist
    from tests.gpu import _mode

    down: list[int] = []
    monkeypatch.setattr(dist, "shutdown", lambda: down.append(1))
    for ctx in (None, SimpleNamespace(shared_gpu=False, world_size=2, rank=0),
                SimpleNamespace(shared_gpu=True, world_size=1, rank=0)):  # one rank: NCCL is fine
        monkeypatch.setattr(dist, "get_context", lambda ctx=ctx: ctx)
        _mode.exit_if_shared("x_check.py", "its NCCL variants")
    assert not down
    for rank in (0, 1):
        monkeypatch.setattr(dist, "get_context", lambda rank=rank: SimpleNamespace(shared_gpu=True, world_size=2,
                                                                                   rank=rank))
        with pytest.raises(SystemExit) as e:
            _mode.exit_if_shared("x_check.py", "its NCCL variants")
        assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.count("SKIP x_check.py: it needs NCCL (its NCCL variants); shared-GPU mode: NCCL refuses") == 1, out
    assert down == [1, 1]


def test_train_curves_compared_within_bf16s_own_drift() -> None:
    spec = importlib.util.spec_from_file_location("shared_gpu_train", REPO / "tests" / "gpu" / "shared_gpu_train.py")
    tr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tr)
    ref32 = [3.5 - 0.03 * i for i in range(40)]
    ref = [x + (0.01 if i % 2 else -0.01) for i, x in enumerate(ref32)]  # bf16 drifts 0.01: tol 0.03
    ok, detail = tr.compare(ref, ref32, [x + 0.025 for x in ref])
    assert ok and "tol 0.0300" in detail, detail
    ok, detail = tr.compare(ref, ref32, ref[:10] + [x + 0.04 for x in ref[10:]])  # off by more than 3 x drift
    assert not ok and "0.0400 at step 11" in detail, detail
    assert tr.compare(ref32, ref32, [x + 0.019 for x in ref32])[0]  # no drift at all: the floor, 0.02
    assert not tr.compare(ref32, ref32, [x + 0.021 for x in ref32])[0]
    assert not tr.compare(ref, ref32, ref[:-1] + [float("nan")])[0]
    assert not tr.compare(ref, ref32, ref[:-1])[0]  # a step missing
    flat = [3.5] * 40
    assert "did not learn" in tr.compare(flat, flat, flat)[1]
