"""overlap.observe on the CPU: the report, the profile switch, ranges in a torch profiler
trace, lazy event timing and the hidden fraction, the timeline tool, launch metadata."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import timeit
import warnings
from types import SimpleNamespace

import pytest
import torch

from overlap import observe
from tests._procs import REPO

SHAPE = (4096, 2048, 8192)


@pytest.fixture(autouse=True)
def _clean():
    was = observe.profile()
    observe.reset_report()
    yield
    observe.profile(was)
    observe.reset_report()


def _row(rep: observe.Report, op: str) -> dict:
    rows = [r for r in rep.rows if r["op"] == op]
    assert len(rows) == 1, rep.rows
    return rows[0]


# ---- the top level ------------------------------------------------------------------------

def test_top_level_switch_and_report() -> None:
    """overlap.profile / overlap.report / overlap.reset_report are observe's, in __all__."""
    import overlap

    for name in ("profile", "report", "reset_report"):
        assert getattr(overlap, name) is getattr(observe, name) and name in overlap.__all__, name
    assert overlap.profile(True) is True and observe.profile() is True
    assert overlap.profile(False) is False and observe.profile() is False
    observe.record_call("mlp_chain", (8, 8, 8, 8), "reference", observe.Why.NO_GPU)
    assert _row(overlap.report(), "mlp_chain")["calls"] == 1
    overlap.reset_report()
    assert overlap.report().rows == []


# ---- the report ---------------------------------------------------------------------------

def test_report_counts_paths_warnings_timeouts_tuning() -> None:
    for _ in range(3):
        observe.record_call("all_gather_matmul", SHAPE, "p2p x4", observe.Why.TUNER)
    observe.record_call("all_gather_matmul", SHAPE, "reference", observe.Why.DTYPE)
    observe.record_call("mlp_chain", (128, 64, 256), "fused", observe.Why.DEFAULT)
    observe.record_warning("all_gather_matmul", SHAPE, "no p2p: one host")
    observe.record_warning("all_gather_matmul", SHAPE, "no p2p: one host")
    observe.record_timeout("all_gather_matmul", SHAPE, "rank 1 chunk 2: flag 3 < 4")
    observe.record_tuning("all_gather_matmul", SHAPE, [("p2p x4", 1.10), ("nccl x2", 1.31)], "p2p x4")

    rep = observe.report()
    r = _row(rep, "all_gather_matmul")
    assert r["shape"] == list(SHAPE) and r["calls"] == 4
    assert r["paths"] == [{"path": "p2p x4", "why": "tuner pick", "calls": 3},
                          {"path": "reference", "why": "dtype", "calls": 1}]
    assert r["warnings"] == [{"msg": "no p2p: one host", "count": 2}]
    assert r["timeouts"] == {"count": 1, "last": "rank 1 chunk 2: flag 3 < 4"}
    assert r["tuning"] == {"candidates": [["p2p x4", 1.10], ["nccl x2", 1.31]], "picked": "p2p x4"}
    assert _row(rep, "mlp_chain")["calls"] == 1

    assert json.loads(rep.to_json())["rows"] == rep.rows
    table = str(rep)
    for s in ("all_gather_matmul", "4096x2048x8192", "p2p x4 (tuner pick)", "reference (dtype)",
              "tuner picked p2p x4", "warning x2", "1 failed wait"):
        assert s in table, table

    observe.reset_report()
    assert observe.report().rows == []


def test_report_shapeless_records_are_notes_not_rows() -> None:
    """A warning or timeout an op recorded without a shape (a process-wide fallback warning)
    is a note under the table, not a row with an empty shape and 0 calls; the table has one
    "calls" column."""
    observe.record_call("all_gather_matmul", SHAPE, "reference", observe.Why.NO_GPU)
    observe.record_warning("all_gather_matmul", (), "all_gather_matmul: no tile-flag path for float32")
    observe.record_timeout("all_reduce_matmul", (), "rank 1 chunk 0: flag 3 < 4")
    rep = observe.report()
    assert [(r["op"], r["shape"], r["calls"]) for r in rep.rows] == [("all_gather_matmul", list(SHAPE), 1)]
    assert rep.notes == [
        {"op": "all_gather_matmul", "warnings": [{"msg": "all_gather_matmul: no tile-flag path for float32",
                                                  "count": 1}], "timeouts": None},
        {"op": "all_reduce_matmul", "warnings": [], "timeouts": {"count": 1, "last": "rank 1 chunk 0: flag 3 < 4"}}]
    assert json.loads(rep.to_json())["notes"] == rep.notes
    lines = str(rep).splitlines()
    assert lines[0].split().count("calls") == 1, lines[0]
    assert len(lines) == 5, lines  # header, rule, one row, two notes
    assert lines[2].split()[:2] == ["all_gather_matmul", "4096x2048x8192"]
    assert "warning x1: all_gather_matmul: no tile-flag path" in lines[3]
    assert "all_reduce_matmul: 1 failed wait(s)" in lines[4]


def test_report_names_a_failed_wait_that_is_no_timeout() -> None:
    """A disagreement or a peer's refusal is a ``FlagTimeoutError`` by type (it ends a
    wait), but the report names it for what it is; a plain timeout keeps its bare text."""
    from overlap.flags import FlagTimeoutError, RanksDisagreeError

    observe.record_timeout("matmul_all_reduce", (), FlagTimeoutError("matmul_all_reduce", 1, 0, 4, 3, 2))
    assert observe.report().notes[0]["timeouts"]["last"].startswith("matmul_all_reduce: rank 1 timed out")
    observe.record_timeout("matmul_all_reduce", (), RanksDisagreeError("matmul_all_reduce", 1, 0, 0x1234, 0x99, 2))
    last = observe.report().notes[0]["timeouts"]
    assert last["count"] == 2
    assert last["last"].startswith("RanksDisagreeError: matmul_all_reduce: rank 1: the peer"), last


def test_report_is_linear_in_records() -> None:
    """10,000 shapes, each with a call, a warning, a tuning and timings: the report and its
    table under a second (a scan of every record per row took a minute at 8,000)."""
    for m in range(10_000):
        shape = (m + 1, 64, 64)
        observe.record_call("all_gather_matmul", shape, "reference", observe.Why.NO_GPU)
        observe.record_warning("all_gather_matmul", shape, "w")
        observe.record_tuning("all_gather_matmul", shape, [("p2p x1", 1.0)], "p2p x1")
        observe.record_phases("all_gather_matmul", shape, "p2p x1",
                              {"op": (_FakeEvent(0.0), _FakeEvent(1.0))})
    t0 = time.process_time()  # this process's CPU time: other jobs on the machine do not count
    rep = observe.report()
    text = str(rep)
    elapsed = time.process_time() - t0
    assert len(rep.rows) == 10_000 and all(r["calls"] == 1 and r["timing"] for r in rep.rows)
    assert text.count("\n") >= 2 * 10_000
    assert elapsed < 1.0, f"report() of 10,000 shapes took {elapsed:.2f} s of CPU"


@pytest.mark.parametrize("gpu,dtype_note,arch_note", [
    ((9, 0, "NVIDIA H200"), True, None),
    ((8, 0, "NVIDIA A100"), True, "Ampere or Ada"),
    ((8, 9, "NVIDIA L40S"), True, "Ampere or Ada"),
    ((10, 0, "NVIDIA B200"), True, "Blackwell"),
    (None, False, None),
])
def test_first_call_says_why_on_a_gpu(monkeypatch: pytest.MonkeyPatch, gpu, dtype_note: bool,
                                      arch_note: str | None) -> None:
    """On a GPU: fp32 (reference, no overlap) and a GPU other than Hopper (fused paths
    untested) each warn once per process, on the first call, saying why; on a CPU
    nothing (the ops' own warnings say they run their reference)."""
    monkeypatch.setattr(observe, "_device_info", lambda: gpu)
    monkeypatch.setattr(observe, "_noted", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m in (256, 512):  # two shapes, two calls each: still one warning per reason
            for _ in range(2):
                observe.record_call("all_gather_matmul", (m, 64, 64), "reference", "dtype torch.float32")
                observe.record_call("all_reduce_matmul", (m, 64, 64), "p2p x4", observe.Why.TUNER)
    msgs = [str(w.message) for w in caught]
    fp32 = [m for m in msgs if "torch.float32 on a GPU runs the reference" in m]
    arch = [m for m in msgs if "built, tested and measured on Hopper" in m]
    assert len(fp32) == (1 if dtype_note else 0), msgs
    assert "fp16/bf16" in "".join(fp32) or not dtype_note
    if arch_note is None:
        assert not arch, msgs
    else:
        assert len(arch) == 1 and arch_note in arch[0] and gpu[2] in arch[0], msgs
    assert len(msgs) == len(fp32) + len(arch)
    notes = [w["msg"] for n in observe.report().notes for w in n["warnings"]]
    assert sorted(notes) == sorted(fp32 + arch)


class _FakeEvent:
    """Stands in for a CUDA event: completes when the test says so; times in ms."""

    def __init__(self, t: float, done: bool = True) -> None:
        self.t, self.done = t, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "_FakeEvent") -> float:
        assert self.done and end.done, "elapsed_time on an event not complete (would wait or raise)"
        return end.t - self.t


def test_phases_resolve_lazily_and_hidden_fraction() -> None:
    op = "all_gather_matmul"
    # a serial call: comm 0.6 ms then GEMM 0.7 ms, one after the other (the alone-times)
    observe.record_phases(op, SHAPE, "chunked", {"comm": (_FakeEvent(0.0), _FakeEvent(0.6)),
                                                 "gemm": (_FakeEvent(0.6), _FakeEvent(1.3))}, serial=True)
    # an overlapped call of 0.85 ms, and one whose end event has not completed yet
    observe.record_phases(op, SHAPE, "p2p x4", {"op": (_FakeEvent(0.0), _FakeEvent(0.85)),
                                                "comm": (_FakeEvent(0.0), _FakeEvent(0.7))})
    late = _FakeEvent(9.0, done=False)
    observe.record_phases(op, SHAPE, "p2p x4", {"op": (_FakeEvent(0.0), late)})

    rep = observe.report()
    assert rep.pending == 1
    t = {x["path"]: x for x in _row(rep, op)["timing"]}
    fused = t["p2p x4"]
    assert fused["calls"] == 1 and fused["op_ms"] == pytest.approx(0.85)
    assert fused["comm_ms"] == pytest.approx(0.7)  # in-call span: shown, not used as alone-time
    assert fused["comm_alone_ms"] == pytest.approx(0.6) and fused["gemm_alone_ms"] == pytest.approx(0.7)
    assert fused["hidden"] == pytest.approx((0.6 + 0.7 - 0.85) / 0.6)
    assert t["chunked"]["hidden"] is None
    assert "75%" in str(rep)

    late.done = True
    rep = observe.report()
    assert rep.pending == 0
    fused = {x["path"]: x for x in _row(rep, op)["timing"]}["p2p x4"]
    assert fused["calls"] == 2 and fused["op_ms"] == pytest.approx((0.85 + 9.0) / 2)
    assert fused["hidden"] == 0.0  # slower than both in turn: clipped

    # alone-times given apart take precedence
    observe.record_alone(op, SHAPE, comm_ms=1.0, gemm_ms=1.0)
    fused = {x["path"]: x for x in _row(observe.report(), op)["timing"]}["p2p x4"]
    assert fused["comm_alone_ms"] == 1.0 and fused["hidden"] == pytest.approx(0.0)


def test_hidden_fraction() -> None:
    assert observe.hidden_fraction(0.6, 0.7, 0.7) == pytest.approx(1.0)  # all of the comm hidden
    assert observe.hidden_fraction(0.6, 0.7, 1.3) == 0.0      # none
    assert observe.hidden_fraction(0.6, 0.7, 1.0) == pytest.approx(0.5)
    assert observe.hidden_fraction(0.6, 0.7, 0.5) == 1.0      # faster than the GEMM alone: clipped
    assert observe.hidden_fraction(None, 0.7, 1.0) is None


# ---- the switch and the ranges -----------------------------------------------------------

def test_switch_off_returns_one_shared_noop() -> None:
    observe.profile(False)
    a = observe.op_range("all_gather_matmul", "p2p x4")
    b = observe.op_range("mlp_chain", "fused")
    c = observe.gpu_range("comm", "chunk", 3)
    assert a is b is c
    assert not a and not observe.timer("mlp_chain", SHAPE, "fused")
    with a:
        pass
    with pytest.raises(KeyError):  # the no-op range lets exceptions through
        with a:
            raise KeyError("x")
    observe.profile(True)
    r1, r2 = observe.op_range("mlp_chain", "fused"), observe.op_range("mlp_chain", "fused")
    assert r1 is not a and r1 is not r2


def test_env_switch_read_at_import() -> None:
    code = "import overlap.observe as o; print(o.profile())"
    for val, want in (("1", "True"), ("0", "False"), ("", "False")):
        env = dict(os.environ, OVERLAP_PROFILE=val)
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                             timeout=120)
        assert out.stdout.strip() == want, (val, out.stdout, out.stderr)


def _fake_op() -> None:
    with observe.op_range("all_gather_matmul", "p2p x2"):
        for c in range(2):
            with observe.gpu_range("comm", "chunk", c):
                torch.ones(8).sum()
        with observe.gpu_range("gemm", "grid"):
            torch.ones(4, 4) @ torch.ones(4, 4)


@pytest.mark.parametrize("switch", [True, False])
def test_ranges_in_torch_profiler_trace(switch: bool) -> None:
    """Named ranges show in a torch profiler trace with the switch on, and also with it
    off (a recording profiler turns them on: the host time is being spent anyway)."""
    observe.profile(switch)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _fake_op()
    names = {e.name for e in prof.events()}
    for n in ("overlap.all_gather_matmul[p2p x2]", "overlap:comm:chunk 0", "overlap:comm:chunk 1",
              "overlap:gemm:grid"):
        assert n in names, sorted(names)[:40]


def test_noop_host_cost() -> None:
    """op_range + record_call alone, profiling off, stay well under a microsecond (CPU time
    of this process, best of several runs; about 0.3-0.5 us measured on a slow runner).
    What an op call pays in all is measured by test_profiling_off_adds_no_host_time_to_an_op_call."""
    observe.profile(False)
    shape = SHAPE

    def call() -> None:
        with observe.op_range("all_gather_matmul", "p2p x4"):
            observe.record_call("all_gather_matmul", shape, "p2p x4", "tuner pick")

    n = 20000
    best = min(timeit.repeat(call, number=n, repeat=7, timer=time.process_time)) / n
    assert best < 1.5e-6, f"{best * 1e9:.0f} ns per call"


# Host time observe may add to one op call with profiling off, in us. Measured on a slow
# 2-core runner: the no-op range and counter 0.4 us, but an op call pays about 2 us in all
# on the reference path and 4 us on the tile-flag path (observed around the body, two
# gpu_ranges): _runtime.observed's function-level ``from .. import observe`` (about 1.2 us)
# and ``device.type`` (about 0.6 us) are paid with profiling off. The bound catches a real
# cost (a record_function per range: +12 us, a CUDA event, a synchronization); it can come
# down to about 1.5 us once those two are out of the path.
ADDED_US_BOUND = 10.0


def _bare_observed(op, shape, path, why, device, fn, *args, serial=False):  # noqa: ANN001, ANN202
    return fn(*args)


def host_us_off_and_bare(mod: object, call: object, rounds: int = 21, n: int = 200, sync=None,  # noqa: ANN001
                         clock=time.perf_counter) -> tuple[float, float]:  # noqa: ANN001
    """Host microseconds per ``call()`` with profiling off, and with the op module ``mod``'s
    observe calls patched out (``observed`` calls the op's body straight, ``gpu_range``
    returns the shared no-op); rounds alternate (ABBA), the fastest per-call time of each, by
    ``clock`` (``time.thread_time`` leaves out time other processes took the core)."""
    observe.profile(False)
    orig = (mod.observed, mod.gpu_range)
    noop = observe._NOOP

    def bare(on: bool) -> None:
        mod.observed, mod.gpu_range = (_bare_observed, lambda *a: noop) if on else orig

    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for r in range(rounds):
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                bare(on)
                if sync:
                    sync()
                t0 = clock()
                for _ in range(n):
                    call()
                times[on].append((clock() - t0) / n * 1e6)
                if sync:
                    sync()
    finally:
        bare(False)
    return min(times[False]), min(times[True])


def test_profiling_off_adds_no_host_time_to_an_op_call() -> None:
    """mlp_chain's reference path on tiny CPU tensors (host-bound): host time per call with
    profiling off against the same op with observe's calls patched out, under
    ``ADDED_US_BOUND``; tests/gpu/test_observe_gpu.py does the same for the tile-flag path."""
    import warnings

    from overlap.ops import chain

    x, w1, w2 = torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(20):
            chain.mlp_chain(x, w1, w2, activation=None)
        off, bare = host_us_off_and_bare(chain, lambda: chain.mlp_chain(x, w1, w2, activation=None),
                                         clock=time.thread_time)
    print(f"mlp_chain (reference) host us per call: off {off:.2f}, patched out {bare:.2f}, added {off - bare:+.2f}")
    assert off - bare < ADDED_US_BOUND, (off, bare)


# ---- the timeline tool --------------------------------------------------------------------

def _gpu_like_trace(path: str, chunks: int = 4) -> None:
    """A chrome trace as torch writes one with CUDA activities: host ranges and launches
    on thread 1, a GEMM grid on stream 7, chunk copies and a give-back grid on stream 20,
    GPU annotations naming their host ranges, and a kernel launched before the call."""
    ev: list[dict] = []
    ids = iter(range(100, 10_000))

    def x(cat: str, name: str, ts: float, dur: float, pid: int, tid: int, **args: object) -> None:
        ev.append(dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, pid=pid, tid=tid, args=args))

    def host(name: str, ts: float, dur: float) -> int:
        i = next(ids)
        x("user_annotation", name, ts, dur, 1, 1, **{"External id": i})
        return i

    def launch(ts: float, cat: str, name: str, stream: int, gts: float, gdur: float, label: str = "",
               ext: int = 0) -> None:
        c = next(ids)
        x("cuda_runtime", "cudaLaunchKernel", ts, 2, 1, 1, correlation=c)
        x(cat, name, gts, gdur, 0, stream, device=0, stream=stream, correlation=c)
        if label:
            x("gpu_user_annotation", label, gts, gdur, 0, stream, device=0, stream=stream, **{"External id": ext})

    launch(0, "kernel", "before_the_call", 7, 5, 10)
    host("overlap.all_gather_matmul[p2p x4]", 100, 80)
    launch(103, "kernel", "tile_gemm_kernel", 7, 200, 400, "overlap:gemm:grid", host("overlap:gemm:grid", 102, 5))
    for c in range(chunks):
        e = host(f"overlap:comm:chunk {c}", 110 + 10 * c, 8)
        launch(111 + 10 * c, "gpu_memcpy", "Memcpy PtoP", 20, 205 + 60 * c, 55, f"overlap:comm:chunk {c}", e)
    launch(161, "kernel", "tile_gemm_kernel", 20, 450, 150, "overlap:giveback:grid",
           host("overlap:giveback:grid", 160, 5))
    with open(path, "w") as f:
        json.dump({"traceEvents": ev}, f)


def test_timeline_finds_the_call_and_its_streams(tmp_path) -> None:
    from benchmarks import timeline

    p = str(tmp_path / "g.json")
    _gpu_like_trace(p)
    events = timeline.load(p)
    (call,) = timeline.find_calls(events, "all_gather_matmul")
    assert (call.op, call.path) == ("all_gather_matmul", "p2p x4")
    lanes = timeline.call_lanes(events, call)
    assert set(lanes) == {"host", "stream 7 (gemm)", "stream 20 (comm, giveback)"}
    names = [i["name"] for i in lanes["stream 7 (gemm)"]]
    assert "before_the_call" not in names and "tile_gemm_kernel" in names
    comm = lanes["stream 20 (comm, giveback)"]
    assert [i["name"] for i in comm if i["kind"] == "label"] == [f"comm chunk {c}" for c in range(4)] + \
        ["giveback grid"]
    assert timeline.busy_us(comm) == pytest.approx(4 * 55 + 150)


def test_timeline_png_from_cpu_trace(tmp_path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib missing (pip install 'overlap[bench]')")
    from benchmarks import timeline

    observe.profile(True)
    trace = str(tmp_path / "cpu.json")
    with observe.trace(trace):
        for _ in range(2):
            _fake_op()
    outs = timeline.main([trace, "--out", str(tmp_path)])
    assert outs == [str(tmp_path / "cpu.all_gather_matmul.png")]
    with open(outs[0], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    gpu = str(tmp_path / "g.json")
    _gpu_like_trace(gpu)
    (out,) = timeline.main([gpu, "--op", "all_gather_matmul", "--out", str(tmp_path / "g.png")])
    assert os.path.getsize(out) > 1000


def test_trace_ops_on_cpu(tmp_path) -> None:
    """benchmarks/diag/trace_ops.py end to end on a CPU (one gloo rank): every op takes its
    reference path ("no GPU"), counted with its fallback warning; each call's host range
    is in the trace; a timeline per op."""
    from benchmarks import timeline
    from tests._procs import run_ranks

    out = tmp_path / "trace"
    (p,) = run_ranks(REPO / "benchmarks" / "diag" / "trace_ops.py", 1, ["--out", str(out), "--calls", "2"],
                     timeout_s=120)
    assert p.returncode == 0, p
    rep = json.loads((out / "report.json").read_text())
    rows = rep["rows"]
    by = {(r["op"], tuple(r["shape"])): r for r in rows}
    shapes = {"mlp_chain": (512, 1024, 2048, 1024), "all_gather_matmul": (1024, 768, 1024),
              "all_reduce_matmul": (1024, 512, 1024)}
    for op, shape in shapes.items():
        r = by[(op, shape)]
        assert r["paths"] == [{"path": "reference", "why": "no GPU", "calls": 4}], r  # 2 warm + 2 traced
        assert r["timing"] == [] and r["timeouts"] is None, r
        warned = [w for r2 in rows + rep["notes"] if r2["op"] == op for w in r2["warnings"]]
        assert any("no tile-flag path" in w["msg"] for w in warned), (op, rows)
        calls = timeline.find_calls(timeline.load(str(out / "trace.json")), op)
        assert [c.path for c in calls] == ["reference"] * 2, (op, calls)
    text = (out / "report.txt").read_text()
    assert "reference (no GPU)" in text and "512x1024x2048x1024" in text, text
    if importlib.util.find_spec("matplotlib") is not None:
        for op in shapes:
            assert (out / f"trace.{op}.png").stat().st_size > 1000


# ---- launch metadata ------------------------------------------------------------------------

def _desc(rows: int, cols: int, dtype: torch.dtype = torch.float16) -> SimpleNamespace:
    return SimpleNamespace(base=torch.empty(0, dtype=dtype), shape=[rows, cols])


def _kernel(name: str) -> SimpleNamespace:
    return SimpleNamespace(name=name)


def _gemm_args(m: int, n: int, k: int, bm: int = 128, bn: int = 256, **kw: object) -> dict:
    tiles = -(-m // bm) * -(-n // bn)
    args = dict(a_desc=_desc(m, k), a2_desc=_desc(m, k), b_desc=_desc(n, k),
                c_ptr=torch.empty(m, n, dtype=torch.float16),
                N=n, K=k, num_tiles=tiles, split_start=tiles, split_parts=1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64,
                HAS_WAIT=True, HAS_POST=False, SPLIT=False, NORM_EPI=False, WARP_SPEC=False)
    args.update(kw)
    return args


def test_tile_gemm_launch_metadata() -> None:
    m, n, k = 1024, 512, 256
    md = observe.tile_gemm_metadata((132, 1, 1), _kernel("tile_gemm_kernel"), _gemm_args(m, n, k))
    assert md["flops16"] == 2.0 * m * n * k
    assert md["bytes"] == 2 * (m * k + n * k + m * n)
    assert md["name"] == "tile_gemm_kernel [M=1024, N=512, K=256] wait"
    # a ragged M: tiles cover more than C; C's size caps the count
    md = observe.tile_gemm_metadata((132, 1, 1), _kernel("k"), _gemm_args(1000, n, k))
    assert md["flops16"] == 2.0 * 1000 * n * k
    # split tail: the last 4 tiles in 2 pieces each = 8 table rows; flops unchanged
    tiles = (m // 128) * (n // 256)
    split = _gemm_args(m, n, k, num_tiles=tiles - 4 + 8, split_start=tiles - 4, split_parts=2, SPLIT=True)
    assert observe.tile_gemm_metadata((132, 1, 1), _kernel("k"), split)["flops16"] == 2.0 * m * n * k
    # fp32 operands (the interpreter's tests) report flops32
    f32 = _gemm_args(m, n, k, a_desc=_desc(m, k, torch.float32), b_desc=_desc(n, k, torch.float32),
                     c_ptr=torch.empty(m, n))
    assert observe.tile_gemm_metadata((1,), _kernel("k"), f32)["flops32"] == 2.0 * m * n * k
    # a grid over three weights: every weight's C counts, and their Bs
    tiles3 = (m // 128) * (n // 256 + 1 + 1)
    many = _gemm_args(m, n, k, num_tiles=tiles3, c1_ptr=torch.empty(m, 256, dtype=torch.float16), N1=256,
                      c2_ptr=torch.empty(m, 200, dtype=torch.float16), N2=200, c3_ptr=None, N3=None)
    md = observe.tile_gemm_metadata((132, 1, 1), _kernel("k"), many)
    assert md["flops16"] == 2.0 * m * (n + 256 + 200) * k and md["name"].endswith("3 weights"), md
    assert md["bytes"] == 2 * (m * k + (n + 456) * k + m * (n + 456))


def test_norm_kernels_launch_metadata() -> None:
    h = torch.empty(0, dtype=torch.bfloat16)
    add = dict(h_ptr=h, res_ptr=h, y_ptr=h, w_ptr=h, b_ptr=h, K=1024, HAS_RES=True, NORM=1, HAS_BIAS=True)
    md = observe.add_norm_metadata((64,), _kernel("add_norm_kernel"), add)
    assert md["bytes"] == 64 * 1024 * 2 * 3 + 64 * 1024 * 2 + 1024 * 2 * 2
    assert md["flops32"] == 64 * 1024 * (1 + 8)
    red = dict(x_ptr=h, K=4096, slot_stride=2048 * 4096, WORLD=2, HAS_RES=True, NORM=0, HAS_BIAS=False, FOLD=False)
    md = observe.reduce_norm_metadata((16,), _kernel("reduce_norm_kernel"), red)
    assert md["name"] == "reduce_norm_kernel [M=2048, K=4096, R=2]"
    assert md["bytes"] == 2048 * 4096 * 2 * (2 + 1 + 1) and md["flops32"] == 2048 * 4096 * 2
    fold = dict(b_ptr=h, w_ptr=h, K=4096, N=2048, HAS_BIAS=False)
    md = observe.fold_norm_metadata((64,), _kernel("fold_norm_kernel"), fold)
    assert md["bytes"] == 2 * 4096 * 2048 * 2 + 4096 * 2 + 2 * 2048 * 4 and md["flops32"] == 4096 * 2048 * 2


def test_kernels_carry_their_launch_metadata() -> None:
    from overlap.kernels.add_norm import add_norm_kernel, reduce_norm_kernel
    from overlap.kernels.norm_fold import fold_norm_kernel
    from overlap.kernels.tile_gemm import tile_gemm_flat_kernel, tile_gemm_kernel

    assert tile_gemm_kernel.launch_metadata is observe.tile_gemm_metadata
    assert tile_gemm_flat_kernel.launch_metadata is observe.tile_gemm_metadata
    assert add_norm_kernel.launch_metadata is observe.add_norm_metadata
    assert reduce_norm_kernel.launch_metadata is observe.reduce_norm_metadata
    assert fold_norm_kernel.launch_metadata is observe.fold_norm_metadata
    # every argument the functions read is a parameter of the kernel
    for fn, kern in ((observe.tile_gemm_metadata, tile_gemm_kernel), (observe.tile_gemm_metadata, tile_gemm_flat_kernel),
                     (observe.add_norm_metadata, add_norm_kernel),
                     (observe.reduce_norm_metadata, reduce_norm_kernel),
                     (observe.fold_norm_metadata, fold_norm_kernel)):
        names = set(kern.arg_names)

        class Strict(dict):
            def __getitem__(self, key: str) -> object:
                assert key in names, f"{fn.__name__} reads {key!r}, not a parameter of {kern.fn.__name__}"
                return super().__getitem__(key)

            def get(self, key: str, default: object = None) -> object:
                assert key in names, f"{fn.__name__} reads {key!r}, not a parameter of {kern.fn.__name__}"
                return super().get(key, default)

        base = {**_gemm_args(256, 256, 64), "h_ptr": torch.empty(0), "res_ptr": None, "y_ptr": torch.empty(0),
                "x_ptr": torch.empty(0), "b_ptr": torch.empty(0), "w_ptr": torch.empty(0), "HAS_RES": True,
                "NORM": 1, "HAS_BIAS": True, "FOLD": False, "WORLD": 2, "slot_stride": 64 * 64}
        fn((4, 1, 1), _kernel("k"), Strict({k: v for k, v in base.items() if k in names}))


def test_report_counts_plan_graphs_since_its_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's plan-graph line: captures, replays by how they copied, refusals, drops,
    the graphs alive and how a new capture copies, counted from the last ``reset_report``;
    none where no graph was made or tried since."""
    import json

    from overlap.ops import _graphs

    for k in _graphs.stats:
        monkeypatch.setitem(_graphs.stats, k, 5)  # counts from before the reset
    monkeypatch.setattr(_graphs, "COPIES", "nodes")
    observe.reset_report()
    assert observe.report().plan_graphs is None and "plan graphs" not in str(observe.report())
    _graphs.stats["captured"] += 2
    _graphs.stats["replayed"] += 10
    _graphs.stats["noded"] += 7
    _graphs.stats["relayed"] += 1
    rep = observe.report()
    assert rep.plan_graphs["captured"] == 2 and rep.plan_graphs["replayed"] == 10 and rep.plan_graphs["dropped"] == 0
    line = [x for x in str(rep).splitlines() if x.startswith("plan graphs:")]
    assert line == [f"plan graphs: 2 captured, 10 call(s) replayed (7 through memcpy nodes, 1 through the relay's "
                    f"kernels, 2 with driver copies), 0 refused, 0 dropped, {len(_graphs.live)} alive; new captures "
                    "copy with: nodes"], line
    assert json.loads(rep.to_json())["plan_graphs"]["noded"] == 7
    observe.reset_report()
    assert observe.report().plan_graphs is None


def test_report_with_plan_graphs_and_a_setting_it_warns_about(monkeypatch: pytest.MonkeyPatch) -> None:
    """A report whose plan-graph line reads a setting that warns (an unknown
    ``OVERLAP_PLAN_GRAPH_COPIES``) returns: the warning is recorded outside the report's
    lock, never waited for under it."""
    import threading

    from overlap.ops import _graphs, _state

    observe.reset_report()
    monkeypatch.setattr(_graphs, "COPIES", None)
    monkeypatch.setenv("OVERLAP_PLAN_GRAPH_COPIES", "nodez")
    monkeypatch.setitem(_graphs.stats, "refused", _graphs.stats["refused"] + 1)
    _state._warned.discard("plan-graph-copies-nodez")
    got: list = []
    t = threading.Thread(target=lambda: got.append(observe.report()), daemon=True)
    with pytest.warns(UserWarning, match="nodez"):
        t.start()
        t.join(timeout=30)
    assert got, "report() did not return (a lock taken twice)"
    assert got[0].plan_graphs["copies"] == "nodes" and got[0].plan_graphs["refused"] == 1
    observe.reset_report()
