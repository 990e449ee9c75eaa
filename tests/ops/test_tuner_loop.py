"""The tuners' shared candidate loop (overlap.ops._runtime.time_candidates) on the CPU:
one gloo process, a fake timer and a fake error word. A candidate whose waits timed
out is dropped (and warned about); the others come back with async error checks."""

from __future__ import annotations

import types
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as tdist

from overlap.flags import FlagTimeoutError
from overlap.ops import OverlapConfig
from overlap.ops._runtime import TUNE_TIMEOUT_MS, WARM_TIMEOUT_MS, confirm_best, time_candidates
from tests._procs import free_port


@pytest.fixture
def group() -> Any:
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield tdist.group.WORLD
    tdist.destroy_process_group()


class _Err:
    what = "fake op"

    def __init__(self) -> None:
        self.fail_next = False

    def check(self, block: bool = True) -> None:
        if self.fail_next:
            self.fail_next = False
            raise FlagTimeoutError("fake op", 0, 1, 5, 4, 0)


def test_timed_out_candidate_is_dropped(group: Any, capsys: pytest.CaptureFixture[str]) -> None:
    rt = types.SimpleNamespace(device=torch.device("cpu"), rank=0)
    err = _Err()
    seen: list[OverlapConfig] = []
    cands = [OverlapConfig(chunks=c) for c in (1, 2, 3)]

    def run(cand: OverlapConfig) -> None:
        seen.append(cand)
        err.fail_next = cand.chunks == 2  # this one's waits time out

    def timer(fn: Any, iters: int, grp: Any) -> float:
        fn()
        return float(len(seen))

    with pytest.warns(UserWarning, match="timed out"):
        out = time_candidates(rt, err, cands, run, 3, group, describe=lambda c: f"cand {c.chunks}", timer=timer)
    assert [(t, c.chunks) for t, c in out] == [(2.0, 1), (6.0, 3)]
    assert all(c.check == "async" for _, c in out) and all(c.check == "none" for c in seen)
    # each candidate's first (compiling) call ran under the long bound, the timed ones under
    # the tuning bound (seconds, not the default's minutes); the winners keep their own (None)
    assert [c.timeout_ms for c in seen] == [WARM_TIMEOUT_MS, TUNE_TIMEOUT_MS] * 3
    assert all(c.timeout_ms is None for _, c in out)
    printed = capsys.readouterr().out
    assert "cand 2" in printed and "rejected" in printed and printed.count("rejected") == 1


def test_confirm_best_retimes_finalists_interleaved(group: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """The first pass ranked "a" first (a clock drift flattered it); timed again in
    interleaved rounds, "b" is faster and wins. Only the top 3 are timed again, each
    once per round with one batch, in turn."""
    rt = types.SimpleNamespace(device=torch.device("cpu"), rank=0)
    err = _Err()
    first = [(1.0, "a"), (1.1, "b"), (1.2, "c"), (9.0, "d")]
    true_ms = {"a": 2.0, "b": 1.5, "c": 1.8, "d": 0.1}  # "d" is never timed again
    calls: list[tuple[str, int]] = []

    def fn_for(choice: str) -> Any:
        return lambda: choice

    def timer(fn: Any, iters: int, grp: Any, batches: int = 3) -> float:
        choice = fn()
        calls.append((choice, batches))
        return true_ms[choice] + 0.01 * len(calls)

    t, best = confirm_best(rt, err, first, fn_for, 5, group, top=3, rounds=3, describe=lambda c: f"cand {c}",
                           timer=timer)
    assert best == "b"
    assert [c for c, _ in calls] == ["a", "b", "c"] * 3 and all(b == 1 for _, b in calls)
    assert t == pytest.approx(1.5 + 0.01 * 5)  # the median of b's rounds (calls 2, 5, 8)
    assert "cand b" in capsys.readouterr().out


def test_confirm_best_times_the_kept_baseline_again(group: Any) -> None:
    """The baseline ("sequential") ranked 5th in a drifting first pass; with keep it is
    timed again beside the top 3, and wins; without keep it is not."""
    rt = types.SimpleNamespace(device=torch.device("cpu"), rank=0)
    first = [(1.0, "a"), (1.1, "b"), (1.2, "c"), (1.3, "d"), (1.4, "sequential")]
    true_ms = {"a": 2.0, "b": 1.9, "c": 1.8, "d": 1.7, "sequential": 1.6}
    calls: list[str] = []

    def timer(fn: Any, iters: int, grp: Any, batches: int = 3) -> float:
        calls.append(fn())
        return true_ms[calls[-1]]

    t, best = confirm_best(rt, _Err(), first, lambda c: (lambda: c), 5, group, top=3, rounds=3, timer=timer,
                           keep=("sequential",))
    assert (best, t) == ("sequential", 1.6) and calls == ["a", "b", "c", "sequential"] * 3
    calls.clear()
    assert confirm_best(rt, _Err(), first, lambda c: (lambda: c), 5, group, top=3, rounds=3, timer=timer)[1] == "c"
    assert "sequential" not in calls


def test_confirm_best_keeps_first_pass_when_a_finalist_times_out(group: Any) -> None:
    rt = types.SimpleNamespace(device=torch.device("cpu"), rank=0)
    err = _Err()

    def timer(fn: Any, iters: int, grp: Any, batches: int = 3) -> float:
        fn()
        err.fail_next = True  # some finalist's waits timed out
        return {"a": 3.0, "b": 1.0}[fn()]

    with pytest.warns(UserWarning, match="timed out"):
        t, best = confirm_best(rt, err, [(1.0, "a"), (2.0, "b")], lambda c: (lambda: c), 5, group, timer=timer)
    assert (t, best) == (1.0, "a")


def test_confirm_best_single_result_is_returned_untimed(group: Any) -> None:
    rt = types.SimpleNamespace(device=torch.device("cpu"), rank=0)

    def timer(*a: Any, **k: Any) -> float:
        raise AssertionError("nothing to compare: no timing")

    assert confirm_best(rt, _Err(), [(2.0, "seq")], lambda c: (lambda: c), 5, group, timer=timer) == (2.0, "seq")


def test_ws_variants_take_the_fastest_plain_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    import overlap.kernels.tile_gemm as tg
    from overlap.kernels.tile_gemm import DEFAULT_CONFIG, GemmConfig
    from overlap.ops._runtime import ws_variants

    ws = GemmConfig(warp_specialize=True)
    results = [(1.0, "sequential"),  # paths named by strings are not configs
               (2.0, OverlapConfig(chunks=8, reduce_shared=True)),  # sized to fit beside the plain GEMM
               (3.0, OverlapConfig(chunks=4, gemm=ws)),  # already warp-specialized
               (5.0, OverlapConfig(chunks=16, split_tail=2)),
               (4.0, OverlapConfig(chunks=2, gemm=GemmConfig(block_n=128, num_stages=4))),
               (6.0, OverlapConfig(chunks=1))]
    monkeypatch.setattr(tg, "warp_specialize_supported", lambda device=None: True)
    got = ws_variants(results, "cpu")
    # the two fastest eligible ones, fastest first, each with its own GEMM config warp-specialized
    assert got == [OverlapConfig(chunks=2, gemm=GemmConfig(block_n=128, num_stages=4, warp_specialize=True)),
                   OverlapConfig(chunks=16, split_tail=2, gemm=replace(DEFAULT_CONFIG, warp_specialize=True))]
    monkeypatch.setattr(tg, "warp_specialize_supported", lambda device=None: False)
    assert ws_variants(results, "cpu") == []


@pytest.mark.parametrize("gpu,version,cc,interp,want", [
    (True, "3.6.0", 9, False, True), (True, "3.9.1", 10, False, True), (True, "3.5.1", 9, False, False),
    (True, "3.6.0", 8, False, False), (True, "3.6.0", 9, True, False), (False, "3.6.0", 9, False, False),
    (True, "unknown", 9, False, False)])
def test_warp_specialize_supported_rule(gpu: bool, version: str, cc: int, interp: bool, want: bool,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Warp specialization is taken with Triton 3.6 or later on a GPU of compute
    capability 9.0 or later, never under the interpreter or without a GPU."""
    from overlap.kernels import tile_gemm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (cc, 0))
    monkeypatch.setattr(tile_gemm.triton, "__version__", version)
    monkeypatch.setattr(tile_gemm, "interpreting", lambda: interp)
    assert tile_gemm.warp_specialize_supported() is want


def _fake_timing(monkeypatch: pytest.MonkeyPatch, ms: dict[Any, float]) -> list[Any]:
    """``time_ms`` replaced: each callable returns its path's key, timed as ``ms[key]``."""
    from overlap.ops import _tuning

    calls: list[Any] = []

    def timer(fn: Any, iters: int, grp: Any, batches: int = 3) -> float:
        key = fn()
        calls.append(key)
        return ms[key]

    monkeypatch.setattr(_tuning, "time_ms", timer)
    return calls


@pytest.mark.parametrize("fastest", ["sequential", "chunked", "config"])
def test_tune_paths_picks_caches_and_reports(group: Any, monkeypatch: pytest.MonkeyPatch, fastest: str) -> None:
    """The tuners' skeleton: the reference, the baselines and the configs are timed, the
    fastest (after the interleaved rounds) is returned as a Path and cached under the
    key; a pick that is not a config warns once and is named by its label in the report."""
    from overlap import observe
    from overlap.ops import SEQUENTIAL, Chunked, Sequential
    from overlap.ops._runtime import tune_paths

    rt = types.SimpleNamespace(device=torch.device("cpu"), rank=0, err=lambda op: _Err())
    cands = [OverlapConfig(chunks=c) for c in (2, 4)]
    ms = {"seq": 3.0, "ch2": 2.5, 2: 2.8, 4: 2.9}
    ms[{"sequential": "seq", "chunked": "ch2", "config": 4}[fastest]] = 1.0
    calls = _fake_timing(monkeypatch, ms)
    cache: dict[Any, Any] = {}
    observe.reset_report()
    kw = dict(ref=lambda: "seq", baselines={Chunked(2): lambda: "ch2"}, candidates=cands,
              run=lambda cand: cand.chunks, describe=lambda c: f"  tune t 8x8x8: {c.chunks} chunks", iters=3,
              group=group, verbose=False, cache=cache, key=("k",))
    if fastest == "config":
        best = tune_paths(rt, "op", (8, 8, 8), "t 8x8x8", **kw)
        assert isinstance(best, OverlapConfig) and best.chunks == 4 and best.check == "async"
    else:
        with pytest.warns(UserWarning, match="does not pay"):
            best = tune_paths(rt, "op", (8, 8, 8), "t 8x8x8", **kw)
        assert best == (SEQUENTIAL if fastest == "sequential" else Chunked(2))
        assert isinstance(best, Sequential) is (fastest == "sequential")
    assert cache == {("k",): best}
    assert set(calls) == {"seq", "ch2", 2, 4}  # every path and config timed
    picked = f"t 8x8x8: {best.chunks} chunks" if fastest == "config" else f"t 8x8x8: {best}"
    assert f"tuner picked tune {picked} from" in str(observe.report())


def test_chunked_path_rejects_fewer_than_two_chunks() -> None:
    from overlap.ops import Chunked

    assert str(Chunked(4)) == "chunked x4" and Chunked(4) == Chunked(4) and hash(Chunked(4)) == hash(Chunked(4))
    for bad in (1, 0, 2.0, True, "2"):
        with pytest.raises(ValueError, match="chunks"):
            Chunked(bad)


def test_flat_variants_take_the_fastest_plain_configs() -> None:
    """The producer tuners' flat pass: the two fastest configs that are neither split nor
    warp-specialized nor flattened already, again with a flattened GEMM."""
    from overlap.kernels.tile_gemm import DEFAULT_CONFIG, GemmConfig
    from overlap.ops._runtime import SEQUENTIAL, flat_variants

    results = [(0.5, SEQUENTIAL),
               (1.0, OverlapConfig(chunks=8, split_tail=2)),
               (2.0, OverlapConfig(chunks=4, gemm=GemmConfig(warp_specialize=True))),
               (3.0, OverlapConfig(chunks=2, gemm=GemmConfig(flatten=True), give_back=False)),
               (5.0, OverlapConfig(chunks=1)),
               (4.0, OverlapConfig(chunks=2, gemm=GemmConfig(block_n=128, num_stages=4))),
               (6.0, OverlapConfig(chunks=3))]
    assert flat_variants(results) == [
        OverlapConfig(chunks=2, gemm=GemmConfig(block_n=128, num_stages=4, flatten=True), give_back=False),
        OverlapConfig(chunks=1, gemm=replace(DEFAULT_CONFIG, flatten=True), give_back=False)]


def test_split_and_ws_passes_skip_flattened_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flattened GEMM takes no split tail and no warp specialization: the tuners' split and
    ws passes leave such candidates out instead of building configs that raise."""
    import overlap.kernels.tile_gemm as tg
    from overlap.kernels.tile_gemm import GemmConfig
    from overlap.ops._runtime import split_variants, ws_variants

    flat = OverlapConfig(chunks=2, give_back=False, gemm=GemmConfig(flatten=True))
    plain = OverlapConfig(chunks=4)
    results = [(1.0, flat), (2.0, plain)]
    assert split_variants(results) == [replace(plain, split_tail=s) for s in (2, 8)]
    monkeypatch.setattr(tg, "warp_specialize_supported", lambda device=None: True)
    assert [c.chunks for c in ws_variants(results, "cpu")] == [4]


def test_chain_tuner_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """``tune_mlp_chain``'s loop on the CPU with a fake GEMM tuner, graph timer and error
    word: 2 BLOCK_M x 2 tile orders x 2 launches; a candidate whose capture failed (timed as
    eager calls) and one that times out during the rounds are dropped however fast they
    look; the fastest of the rest comes back with the default error check and is cached."""
    from overlap.kernels import autotune, tile_gemm
    from overlap.kernels.tile_gemm import GemmConfig
    from overlap.ops import ChainConfig
    from overlap.ops import chain as ch

    from overlap.ops import _state

    monkeypatch.setattr(_state, "_warned", set())  # warn_once's memory: this test's warning fires
    err = _Err()
    caches: dict[str, dict] = {}
    rt = types.SimpleNamespace(err=lambda op: err, cache=lambda name, size: caches.setdefault(name, {}))
    monkeypatch.setattr(ch, "_takes_fast_path", lambda x: True)
    monkeypatch.setattr(ch, "_runtime", lambda device: rt)
    monkeypatch.setattr(tile_gemm, "pdl_supported", lambda device=None: True)
    monkeypatch.setattr(autotune, "tune_gemm",
                        lambda m, n, k, *, block_m, **kw: GemmConfig(block_m=block_m, block_n=128, group_m=8))
    # ms per (BLOCK_M, group_m, launch); (64, 1, "pdl") is fastest but its capture failed,
    # (128, 8, "streams") next but it times out in the second round
    fast = {(128, 8, "streams"): 0.5, (128, 8, "pdl"): 0.9, (128, 1, "streams"): 1.2, (128, 1, "pdl"): 1.1,
            (64, 8, "streams"): 1.0, (64, 8, "pdl"): 0.8, (64, 1, "streams"): 1.3, (64, 1, "pdl"): 0.1}
    made: list[Any] = []

    class FakeTimer:
        def __init__(self, fn: Any, target_ms: float = 2.0, max_iters: int = 64) -> None:
            cfg = fn.__defaults__[0]  # the candidate the tuner's lambda closes over
            self.key = (cfg.producer.block_m, cfg.producer.group_m, cfg.launch)
            assert cfg.check == "none" and max_iters <= 8, (cfg, max_iters)
            self.graph = None if self.key == (64, 1, "pdl") else object()
            self.calls = 0
            made.append(self.key)

        def ms(self) -> float:
            self.calls += 1
            if self.key == (128, 8, "streams") and self.calls == 2:
                err.fail_next = True
            return fast[self.key]

    monkeypatch.setattr(autotune, "GraphTimer", FakeTimer)
    x = torch.zeros(512, 256, dtype=torch.bfloat16)
    w1, w2 = torch.zeros(256, 384, dtype=torch.bfloat16), torch.zeros(384, 256, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="timed out"):
        best = ch.tune_mlp_chain(x, w1, w2, rounds=3)
    assert sorted(made) == sorted(fast), made
    assert (best.producer.block_m, best.producer.group_m, best.launch) == (64, 8, "pdl"), best
    assert best.consumer.group_m == best.producer.group_m and best.check == ChainConfig().check
    assert caches["mlp_chain.tuned"][ch._tune_key(x, w1, w2, "gelu")] == best
