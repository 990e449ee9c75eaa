"""benchmarks/run.py on 2 gloo ranks (CPU): every op and shape asked for is measured and
reported, with the reports saying that CPU figures are not GPU figures."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.suite import load_op
from benchmarks.suite.report import NOT_GPU
from benchmarks.suite.shapes import select
from tests._procs import REPO, run_cmd, run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU (gloo) figures and labels")

OPS = ["agmm", "armm", "mmrs", "mmar", "chain", "agmm3", "mmarmm"]
SETS = ["gpt3-175b", "llama-70b", "comm-heavy"]
CUSTOM = "512x256x384"
FAST = ["--iters", "2", "--warmup", "1"]
# variants that cannot run on CPU, per op (everything else must have a positive time)
NA_ON_CPU = {"agmm": {"symm_mem"}, "agmm3": {"symm_mem"}, "mmarmm": set(), "armm": {"symm_mem"}, "mmrs": {"symm_mem"}, "mmar": set(),
             "chain": {"stream_sync", "tile_flag", "tile_sync"}}


def _expected(op: str, sets: list[str], custom: list[str]) -> list[tuple[str, str]]:
    shapes, _ = select(load_op(op), sets, custom)
    return [(s.set, s.label) for s in shapes]


def _check_run(out_dir: Path, stdout: str, ops: list[str], sets: list[str], custom: list[str]) -> dict:
    doc = json.loads((out_dir / "results.json").read_text())
    md = (out_dir / "results.md").read_text()
    assert doc["gpu"] is False and doc["note"] == NOT_GPU, doc["note"]
    assert NOT_GPU in md and NOT_GPU in stdout
    assert doc["world"] == 2 and doc["backend"] == "gloo"
    for key in ("date", "commit", "torch", "triton", "knobs", "world_size"):
        assert key in doc["context"], key
    total = 0
    for op in ops:
        assert doc["ops"][op]["status"] == "ok", doc["ops"][op]
        recs = [r for r in doc["results"] if r["op"] == op]
        want = _expected(op, sets, custom)
        assert [(r["set"], r["label"]) for r in recs] == want, (op, want)
        total += len(want)
        assert f"## {op}:" in md
        for r in recs:
            case = f"{op} {r['set']} {r['label']}"
            assert not r["errors"], (case, r["errors"])
            assert max(r["run_dims"].values()) <= 256, case  # scaled down for the CPU
            assert r["label"] in md, case
            variants = doc["ops"][op]["variants"]
            assert set(r["na"]) == NA_ON_CPU[op], (case, r["na"])
            timed = [v for v in variants if v not in r["na"]]
            assert timed, case
            for v in timed:
                assert r["ms"][v] > 0 and r["tflops"][v] > 0, (case, v)
            for v in r["na"]:
                assert r["ms"][v] is None, (case, v)
            for p in doc["ops"][op]["part_titles"]:
                assert r["ms"][p] > 0, (case, p)
            assert r["floor_ms"] > 0 and r["flops"] > 0, case
            assert ("observed" in r) == ("--profile" in doc["command"]), case
            if doc["ops"][op]["comm"]:
                assert r["busbw_GBps"]["comm"] > 0 and r["comm_bytes"] > 0, case
                assert set(r["hidden_frac"]) == set(timed) - {"reference"}, case
                assert r["check"]["rel_err"] < 1e-4, case  # CPU: the library's op is its reference
            else:
                assert r["floor_ms"] == pytest.approx(r["ms"]["producer"] + r["ms"]["consumer"]), case
    # a progress line per case, then the tables
    assert len(re.findall(r"^\[\s*\d+/\d+\] ", stdout, re.MULTILINE)) == total, stdout
    if importlib.util.find_spec("matplotlib") is not None:
        for op in ops:
            assert (out_dir / f"{op}.png").stat().st_size > 0
    else:
        assert "plots skipped: matplotlib not importable" in md
    return doc


def _launch(launcher: str, ops: list[str], sets: list[str], custom: list[str], out: Path) -> Any:
    """The command the README gives, through launch/, with the library's ops as they are."""
    shape_args = [a for c in custom for a in ("--shape", c)]
    r = run_cmd(["bash", launcher, "2", "benchmarks/run.py", "--ops", ",".join(ops), "--shapes", ",".join(sets),
                 *shape_args, *FAST, "--out", str(out)], timeout_s=90)
    assert r.returncode == 0, r
    _check_run(out, r.out, ops, sets, custom)
    return r


def test_every_op_and_shape_under_torchrun_sh(tmp_path: Path) -> None:
    """All ops, all named sets and a shape by numbers (+ln: armm's residual + LayerNorm;
    the other ops run the plain shape and say so)."""
    r = _launch("launch/torchrun.sh", OPS, SETS, [CUSTOM + "+ln"], tmp_path)
    assert "op chain: no shapes in set comm-heavy (skipped)" in r.out
    assert f"op agmm: ignores +ln of --shape {CUSTOM}+ln" in r.out
    doc = json.loads((tmp_path / "results.json").read_text())
    assert len(doc["results"]) == 5 + 1 + 10 + 1 + 5 + 1 + 5 + 1 + 10 + 1 + 4 + 1 + 3 + 1  # ..., agmm3, mmarmm
    assert [r["params"] for r in doc["results"] if r["op"] == "armm"][-1] == {"ln": True}


def test_profile_adds_the_report_per_variant(tmp_path: Path) -> None:
    """--profile: per case, every variant that ran (external ones aside) has the report's
    keys; on CPU the library's op is seen taking its reference path ("no GPU"), the
    timings are None, and the markdown has the section."""
    from benchmarks.suite.observed import FIELDS

    r = run_cmd(["bash", "launch/torchrun.sh", "2", "benchmarks/run.py", "--ops", "agmm,chain", "--shape", CUSTOM,
                 *FAST, "--profile", "--profile-calls", "3", "--out", str(tmp_path)], timeout_s=90)
    assert r.returncode == 0, r
    doc = _check_run(tmp_path, r.out, ["agmm", "chain"], [], [CUSTOM])
    want_op = {"agmm": "all_gather_matmul", "chain": "mlp_chain"}
    for rec in doc["results"]:
        variants = doc["ops"][rec["op"]]["variants"]
        ran = {n for n, v in variants.items() if v["role"] != "external" and n not in rec["na"]}
        assert set(rec["observed"]) == ran, (rec["op"], rec["observed"])
        for n, o in rec["observed"].items():
            assert tuple(o) == FIELDS, (rec["op"], n, o)
            for f in ("op_ms", "comm_ms", "gemm_ms", "comm_alone_ms", "gemm_alone_ms", "hidden"):
                assert o[f] is None, (rec["op"], n, f, o)  # CPU: no CUDA events
        lib = rec["observed"][doc["ops"][rec["op"]]["library"]] if rec["op"] == "agmm" else \
            rec["observed"]["torch"]
        if rec["op"] == "agmm":
            assert (lib["path"], lib["why"], lib["calls"]) == ("reference", "no GPU", 3), lib
        else:  # the chain's reference (mlp_chain_ref) is not an observed op
            assert lib["path"] is None, lib
        rows = rec["observed_report"]
        if rec["op"] == "agmm":
            assert rows and {row["op"] for row in rows} == {want_op[rec["op"]]}, rows
        else:  # nothing of the chain is observed on CPU
            assert rows == [], rows
    md = (tmp_path / "results.md").read_text()
    assert md.count("overlap.report() of a few profiled calls") == 2 and "reference (no GPU)" in md


def test_observe_case_attributes_paths_and_timings() -> None:
    """observe_case on stand-in variants that record as the ops do on a GPU (a serial
    reference, an overlapped library path, an unobserved baseline): each variant gets its
    path, its calls and its figures; the library's hidden fraction uses the reference's
    alone-times."""
    from types import SimpleNamespace

    from benchmarks.suite.observed import FIELDS, observe_case
    from benchmarks.suite.spec import Case, Variant
    from overlap import observe

    ev = lambda t: SimpleNamespace(t=t, query=lambda: True, elapsed_time=lambda e, t=t: e.t - t)  # noqa: E731
    shape = (64, 32, 16)

    def ref() -> None:  # all_gather_matmul_ref: serial phases, no record_call
        observe.record_phases("op", shape, "reference", {"comm": (ev(0), ev(0.6)), "gemm": (ev(0.6), ev(1.3))},
                              serial=True)

    def lib() -> None:
        observe.record_call("op", shape, "nccl x2", "tuner pick")
        observe.record_phases("op", shape, "nccl x2", {"op": (ev(0), ev(1.0))})

    case = Case(variants={"reference": Variant("seq", fn=ref, role="reference"), "other": Variant("b", fn=lambda: None),
                          "tile_flag": Variant("lib", fn=lib, role="library"),
                          "ext": Variant("x", fn=lib, role="external")}, parts={}, flops=1.0)
    was = observe.profile()
    observe.reset_report()
    try:
        seen, rows = observe_case(case, "op", 3, skip=set())
    finally:
        observe.reset_report()
    assert observe.profile() == was
    assert set(seen) == {"reference", "other", "tile_flag"}  # external ones aside
    assert all(tuple(o) == FIELDS for o in seen.values())
    r, o, t = seen["reference"], seen["other"], seen["tile_flag"]
    assert (r["path"], r["why"], r["calls"], r["serial"]) == ("reference", None, 3, True), r
    assert r["comm_ms"] == pytest.approx(0.6) and r["hidden"] is None
    assert o == dict.fromkeys(FIELDS), o
    assert (t["path"], t["why"], t["calls"], t["serial"]) == ("nccl x2", "tuner pick", 3, False), t
    assert t["op_ms"] == pytest.approx(1.0) and t["comm_alone_ms"] == pytest.approx(0.6)
    assert t["hidden"] == pytest.approx((0.6 + 0.7 - 1.0) / 0.6)
    assert [row["op"] for row in rows] == ["op"] and rows[0]["calls"] == 3


@pytest.mark.mpi
def test_under_mpirun_sh(tmp_path: Path) -> None:
    _launch("launch/mpirun.sh", OPS, ["comm-heavy", "llama-70b"], [], tmp_path)


def test_unavailable_op_is_reported_and_skipped(tmp_path: Path) -> None:
    args = ["--ops", "armm,agmm", "--shapes", "comm-heavy", *FAST, "--out", str(tmp_path)]
    procs = run_ranks(REPO / "tests/_bench_worker.py", 2, ["--break-op", "armm", "--", *args], timeout_s=60)
    for p in procs:
        assert p.returncode == 0, "\n".join(map(str, procs))
    assert "op armm unavailable: ImportError: cannot import name 'missing_armm'" in procs[0].out, procs[0]
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["ops"]["armm"]["status"] == "unavailable"
    assert {r["op"] for r in doc["results"]} == {"agmm"}
    assert "op armm unavailable" in (tmp_path / "results.md").read_text()


def test_failing_variant_is_recorded_and_fails_the_run(tmp_path: Path) -> None:
    args = ["--ops", "agmm", "--shape", "256x64x64", *FAST, "--out", str(tmp_path)]
    procs = run_ranks(REPO / "tests/_bench_worker.py", 2, ["--break-variant", "agmm:chunked2", "--", *args],
                      timeout_s=60)
    assert [p.returncode for p in procs] == [1, 1], "\n".join(map(str, procs))
    doc = json.loads((tmp_path / "results.json").read_text())
    (rec,) = doc["results"]
    assert "chunked2 broken on purpose" in rec["errors"]["chunked2"] and rec["ms"]["chunked2"] is None
    assert rec["ms"]["tile_flag"] > 0  # the other variants still ran
    assert "ERROR custom 256x64x64 chunked2: RuntimeError: chunked2 broken on purpose" in procs[0].out
    assert "| err |" in (tmp_path / "results.md").read_text()


@pytest.mark.parametrize("argv,text", [(["--ops", "nope"], "unknown op"), (["--shapes", "gpt4"], "unknown shape set"),
                                       (["--shape", "8192x1024"], "M x N x K"),
                                       (["--ops", "agmm", "--shape", "64x64x64+ln"], "no op of this run takes +ln")])
def test_bad_arguments_fail_before_start(argv: list[str], text: str, capsys: pytest.CaptureFixture) -> None:
    from benchmarks.suite.runner import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and text in capsys.readouterr().err


def test_named_and_numeric_shapes() -> None:
    from benchmarks.suite.runner import parse_args

    a = parse_args(["--ops", "armm", "--shape", "8192x1024x8192+ln"])
    assert a.ops == ["armm"] and a.sets == []
    shapes, _ = select(load_op("armm"), a.sets, a.shape)
    assert [(s.dims, s.params) for s in shapes] == [({"M": 8192, "N": 1024, "K": 8192}, {"ln": True})]
    assert parse_args([]).sets == ["all"] and parse_args([]).ops == OPS
    agmm = {s.label for s in load_op("agmm").shapes["comm-heavy"] + load_op("agmm").shapes["gpt3-175b"]}
    assert agmm == {"16384x2048x8192", "8192x1024x8192", "8192x18432x12288", "8192x24576x12288"}
    small = load_op("agmm").shapes["gpt3-175b"][0].scaled(256, 16)
    assert max(small.dims.values()) <= 256 and all(v % 16 == 0 for v in small.dims.values())


def test_time_interleaved_rounds_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds of one batch per callable (drift hits all alike); a callable that raises
    is reported and dropped; medians per callable. CUDA calls stubbed: the logic only."""
    import torch
    import torch.distributed as tdist

    from benchmarks.suite.timing import Timer

    if tdist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        t = Timer(group=None, device=torch.device("cpu"), iters=1, warmup=1, reps=3)
        order: list[str] = []
        fake = iter([5.0, 1.0, 9.0, 2.0, 6.0, 3.0])
        monkeypatch.setattr(t, "_batch", lambda fn: (order.append(fn.__name__), next(fake))[1])
        monkeypatch.setattr(t, "_barrier", lambda: None)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

        def a() -> None: ...

        def b() -> None: ...

        def bad() -> None:
            raise RuntimeError("boom")

        errors: dict[str, str] = {}
        got = t.time_interleaved({"a": a, "bad": bad, "b": b}, lambda n, e: errors.__setitem__(n, repr(e)))
        assert order == ["a", "b"] * 3, order  # interleaved, the failing one never timed
        assert got == {"a": 6.0, "b": 2.0}, got  # medians of [5, 9, 6] and [1, 2, 3]
        assert list(errors) == ["bad"] and "boom" in errors["bad"]
    finally:
        tdist.destroy_process_group()


def test_run_line_names_the_host_yardstick_when_measured() -> None:
    from benchmarks.suite.report import describe_run

    ctx = {"date": "d", "gpu_count": 2, "gpu": "H200", "driver": "x", "cuda": "13.0", "nccl": "2.28.9",
           "torch": "t", "triton": "3.6.0", "cupy": "14", "commit": "abc", "knobs": {}}
    doc = {"context": dict(ctx, host_us_torch_mm=14.2), "gpu": True, "world": 2, "dtype": "bfloat16"}
    assert "host 14.2 us per torch.mm" in describe_run(doc)
    assert "torch.mm" not in describe_run(dict(doc, context=ctx))
