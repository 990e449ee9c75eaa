"""overlap.kernels.autotune without a GPU: the space's rules, the shortlist, the JSON cache;
and benchmarks/gemm_sweep.py's shapes and result files."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from dataclasses import asdict

import pytest
import torch

from tests._procs import REPO

pytest.importorskip("triton")

ENV = {"gpu": "Fake GPU", "sms": 132, "smem": 232448, "torch": "2.0", "triton": "3.6.0", "overlap": "0.1.0", "space": 2}


@pytest.fixture
def autotune(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setenv("OVERLAP_GEMM_CACHE", str(tmp_path / "gemm.json"))
    import overlap.kernels.autotune as mod

    mod = importlib.reload(mod)  # a fresh in-process cache
    env = dict(ENV, space=mod.SPACE_VERSION)
    monkeypatch.setattr(mod, "device_env", lambda device: dict(env))
    return mod


def _problem(mod, m=256, n=512, k=1024, b_kn=False, block_m=None, dtype=torch.bfloat16):
    return mod._problem(m, n, k, dtype, b_kn, block_m, None, None)


def _fake_measure(mod, monkeypatch, pick):
    calls = []

    def measure(m, n, k, dtype, device, b_kn, cands, sms, **kw):
        calls.append((m, n, k, len(cands)))
        return pick, {mod._cfg_str(pick): 1.0}

    monkeypatch.setattr(mod, "_measure", measure)
    monkeypatch.setattr("overlap.kernels.tile_gemm.warp_specialize_supported", lambda device=None: False)
    return calls


# -- the space -----------------------------------------------------------------------------
def test_space_keeps_only_what_fits_by_rule(autotune) -> None:
    from overlap.kernels.tile_gemm import GemmConfig

    sp = autotune.space()
    assert sp and len(set(sp)) == len(sp)
    for c in sp:
        assert c.num_stages * (c.block_m * c.block_k + c.block_k * c.block_n) * 2 <= autotune.SMEM_LIMIT
        assert c.block_m * c.block_n // (32 * c.num_warps) <= autotune.MAX_ACC_REGS
        assert not c.warp_specialize or c.num_warps == 8
        assert (c.block_m, c.block_n) in autotune.TILES and c.group_m in (8, 16)
    tiles = {(c.block_m, c.block_n, c.block_k, c.num_stages) for c in sp}
    assert (128, 256, 64, 4) in tiles and (128, 256, 64, 5) not in tiles  # 240 KB > 227 KB
    assert {t for t in tiles if t[2] == 128} == {(128, 128, 128, 3)}  # the only BLOCK_K 128 that fits
    assert (64, 256, 64, 5) in tiles and (256, 128, 64, 5) not in tiles
    big = GemmConfig(block_m=128, block_n=256, num_warps=4)
    assert "registers" in autotune.rejects(big)
    assert "shared memory" in autotune.rejects(GemmConfig(block_k=128))
    # a smaller limit (another GPU) or 4-byte elements shrink the space by the same rule
    assert len(autotune.space(smem_limit=101376)) < len(sp)
    assert all(autotune.smem_bytes(c, 4) <= autotune.SMEM_LIMIT for c in autotune.space(elem_bytes=4))
    assert not any(c.warp_specialize for c in autotune.space(ws=False))
    assert set(autotune.CANDIDATES) == set(sp)


def test_shortlist_prunes_by_tile_height_and_waves(autotune) -> None:
    small = autotune.shortlist(512, 4096, 4096, sms=132)
    big = autotune.shortlist(16384, 6144, 4096, sms=132)
    for sl in (small, big):
        assert 1 <= len(sl) <= 12 and len(set(sl)) == len(sl)
        assert all(autotune.rejects(c) is None and c.group_m == 8 for c in sl)
    # small M: 128x256 tiles fill 64 of 132 SMs; 128x128 and 64x256 tiles fill a wave
    assert {(c.block_m, c.block_n) for c in small} == {(128, 128), (64, 256)}
    # large M: 64-row tiles never; the 128x256 and 256x128 ones model fastest
    assert {(c.block_m, c.block_n) for c in big} == {(128, 256), (256, 128)}
    assert any(c.warp_specialize for c in big)
    assert not any(c.warp_specialize for c in autotune.shortlist(16384, 6144, 4096, sms=132, ws=False))
    # a BLOCK_M asked for overrides the tile-vs-M rule
    assert {c.block_m for c in autotune.shortlist(16384, 6144, 4096, sms=132, block_m=64)} == {64}
    assert autotune.shortlist(16384, 6144, 4096, sms=132, block_m=32) == []
    # wave quantization: 2 full waves of 128x256 tiles against 2 waves plus a tile of 128x128
    assert autotune.wave_model(2048, 2048 * 132 // 16 // 16 * 16, 128, 256, 132) <= \
        autotune.wave_model(2048, 2048 * 132 // 16 // 16 * 16, 128, 128, 132)


def test_shortlist_flatten_adds_a_flat_twin_of_each_plain_pick(autotune, monkeypatch) -> None:
    """``flatten=True`` (a caller whose tiles wait on nothing): each pick that is not
    warp-specialized is also tried flattened; without it no flattened config appears, and
    the cache keeps the two problems apart (a flattened pick never reaches a caller whose
    tiles wait)."""
    from dataclasses import replace

    plain = autotune.shortlist(16384, 6144, 4096, sms=132)
    flat = autotune.shortlist(16384, 6144, 4096, sms=132, flatten=True)
    assert not any(c.flatten for c in plain)
    assert [c for c in flat if not c.flatten] == plain
    assert {c for c in flat if c.flatten and not c.tail_block_m} == \
        {replace(c, flatten=True) for c in plain if not c.warp_specialize}
    assert all(autotune.rejects(c) is None and not (c.flatten and c.warp_specialize) for c in flat)
    seen = []

    def measure(m, n, k, dtype, device, b_kn, cands, sms, **kw):
        seen.append(any(c.flatten for c in cands))
        return cands[-1], {}

    monkeypatch.setattr(autotune, "_measure", measure)
    monkeypatch.setattr("overlap.kernels.tile_gemm.warp_specialize_supported", lambda device=None: False)
    a = autotune.tune_gemm(256, 512, 1024, dtype=torch.bfloat16, device="cpu", flatten=True)
    b = autotune.tune_gemm(256, 512, 1024, dtype=torch.bfloat16, device="cpu")
    assert seen == [True, False] and a.flatten and not b.flatten


def test_shortlist_tail_launches_only_for_the_gemm_alone_past_a_whole_wave(autotune) -> None:
    """``flatten`` (the GEMM alone): a 128x256 or 256x128 tile over at least one whole wave
    whose last partial wave idles TAIL_MIN_IDLE of the run is also tried with each half-size
    tail after its first pick; none below one wave, none with whole waves, none without
    ``flatten``; every tail config passes the rules."""
    from dataclasses import replace

    flat = autotune.shortlist(8192, 3696, 8192, sms=132, flatten=True)  # 64 x 15 = 960 tiles of 128x256
    tails = [c for c in flat if c.tail_block_m]
    assert {(c.block_m, c.block_n, c.tail_block_m, c.tail_block_n) for c in tails} == \
        {(128, 256, 64, 256), (128, 256, 128, 128), (256, 128, 128, 128)}
    for c in tails:
        assert c.flatten and autotune.rejects(c) is None
        assert replace(c, tail_block_m=0, tail_block_n=0) in flat
    assert "tail64x256" in autotune._cfg_str(tails[0]) or "tail128x128" in autotune._cfg_str(tails[0])
    assert not any(c.tail_block_m for c in autotune.shortlist(2048, 1536, 4096, sms=132, flatten=True))
    # 2048x4096: 128 tiles of 128x256 then 256 of 64x256, two waves of the small ones: no tail
    assert autotune.partial_wave(2048, 4096, 128, 256, 132) >= autotune.TAIL_MIN_IDLE
    assert not any(c.tail_block_m for c in autotune.shortlist(2048, 4096, 1024, sms=132, flatten=True))
    assert all(autotune.tail_fits(8192, 3696, c, 132) for c in tails)
    assert not any(c.tail_block_m for c in autotune.shortlist(4224, 4096, 4096, sms=132, flatten=True))
    assert not any(c.tail_block_m for c in autotune.shortlist(8192, 3696, 8192, sms=132))
    assert autotune.partial_wave(2048, 1536, 128, 256, 132) == 1 - 96 / 132
    from overlap.kernels.tile_gemm import GemmConfig

    bad = GemmConfig(block_m=128, block_n=256, num_stages=3, flatten=True, tail_block_m=256, tail_block_n=256)
    assert "tail launch" in (autotune.rejects(bad) or ""), autotune.rejects(bad)


# -- the cache -----------------------------------------------------------------------------
def test_cached_config_is_used_without_timing(autotune, tmp_path, monkeypatch) -> None:
    from overlap.kernels.tile_gemm import GemmConfig

    want = GemmConfig(block_m=64, block_n=256, block_k=64, num_stages=4, num_warps=4, group_m=16)
    env = autotune.device_env(None)
    key = autotune.cache_key(env, _problem(autotune))
    (tmp_path / "gemm.json").write_text(json.dumps({"format": 1, "entries": {key: {"config": asdict(want)}}}))
    calls = _fake_measure(autotune, monkeypatch, GemmConfig())
    assert autotune.tune_gemm(256, 512, 1024, dtype=torch.bfloat16, device="cpu", b_kn=False) == want
    assert calls == [] and key in autotune.cached_configs()


def test_key_holds_everything_the_pick_depends_on(autotune) -> None:
    env = autotune.device_env(None)
    base = autotune.cache_key(env, _problem(autotune))
    for field, value in (("gpu", "Other GPU"), ("sms", 114), ("smem", 101376), ("torch", "2.1"), ("triton", "3.7.0"),
                         ("overlap", "0.2.0"), ("space", -1)):
        assert autotune.cache_key(dict(env, **{field: value}), _problem(autotune)) != base, field
    for kw in ({"m": 512}, {"n": 1024}, {"k": 2048}, {"b_kn": True}, {"block_m": 64}, {"dtype": torch.float16}):
        assert autotune.cache_key(env, _problem(autotune, **kw)) != base, kw
    assert autotune.cache_key(env, autotune._problem(256, 512, 1024, torch.bfloat16, False, None, 100, None)) != base
    assert json.loads(base)["env"]["gpu"] == "Fake GPU"


def test_stale_entry_is_ignored_and_replaced(autotune, tmp_path, monkeypatch) -> None:
    from overlap.kernels.tile_gemm import GemmConfig

    env = autotune.device_env(None)
    problem = _problem(autotune)
    stale = autotune.cache_key(dict(env, triton="3.5.0"), problem)
    other_gpu = autotune.cache_key(dict(env, gpu="Other GPU"), problem)
    old = {"config": asdict(GemmConfig(block_m=64, block_n=256, num_warps=4))}
    (tmp_path / "gemm.json").write_text(json.dumps({"format": 1, "entries": {stale: old, other_gpu: old}}))
    pick = GemmConfig(block_m=128, block_n=128, num_stages=4)
    calls = _fake_measure(autotune, monkeypatch, pick)
    assert autotune.tune_gemm(256, 512, 1024, dtype=torch.bfloat16, device="cpu") == pick
    assert len(calls) == 1
    entries = json.loads((tmp_path / "gemm.json").read_text())["entries"]
    fresh = autotune.cache_key(env, problem)
    # the stale entry of this GPU is gone, another GPU's stays, the new one is there
    assert set(entries) == {fresh, other_gpu}
    assert GemmConfig(**entries[fresh]["config"]) == pick and "tune_s" in entries[fresh]
    # and a second call is a hit
    assert autotune.tune_gemm(256, 512, 1024, dtype=torch.bfloat16, device="cpu") == pick and len(calls) == 1


@pytest.mark.parametrize("bad", [
    {"config": {"block_m": 128, "tile_shape": [1, 2]}},  # an unknown field (another version's config)
    {"config": {"block_m": 128, "block_n": 256, "block_k": 128, "num_stages": 5}},  # the rules reject it
    {"config": {"block_m": 100}},  # not a valid GemmConfig
    {"ms": {}},  # no config at all
])
def test_unknown_entry_is_ignored_and_rewritten(autotune, tmp_path, monkeypatch, bad) -> None:
    from overlap.kernels.tile_gemm import GemmConfig

    key = autotune.cache_key(autotune.device_env(None), _problem(autotune))
    (tmp_path / "gemm.json").write_text(json.dumps({"format": 1, "entries": {key: bad}}))
    pick = GemmConfig(block_m=128, block_n=128, num_stages=4)
    calls = _fake_measure(autotune, monkeypatch, pick)
    assert autotune.tune_gemm(256, 512, 1024, dtype=torch.bfloat16, device="cpu") == pick and len(calls) == 1
    assert json.loads((tmp_path / "gemm.json").read_text())["entries"][key]["config"] == asdict(pick)


@pytest.mark.parametrize("content", ['{"entries": {', "[1, 2]", '{"k": {"config": {}}}', '{"format": 99}'])
def test_torn_or_foreign_file_is_ignored_and_rewritten(autotune, tmp_path, monkeypatch, content) -> None:
    from overlap.kernels.tile_gemm import GemmConfig

    (tmp_path / "gemm.json").write_text(content)
    pick = GemmConfig(block_m=128, block_n=128, num_stages=4)
    _fake_measure(autotune, monkeypatch, pick)
    assert autotune.tune_gemm(256, 512, 1024, dtype=torch.bfloat16, device="cpu") == pick
    data = json.loads((tmp_path / "gemm.json").read_text())
    assert data["format"] == 1 and len(data["entries"]) == 1


def test_block_m_without_candidates_raises(autotune, monkeypatch) -> None:
    _fake_measure(autotune, monkeypatch, None)
    with pytest.raises(ValueError, match="block_m=32"):
        autotune.tune_gemm(256, 512, 1024, dtype=torch.bfloat16, device="cpu", block_m=32)


def test_save_goes_through_a_temporary_file(autotune, tmp_path, monkeypatch) -> None:
    autotune._write_atomic(str(tmp_path / "gemm.json"), {"format": 1, "entries": {"a": {"x": 1}}})
    assert [p.name for p in tmp_path.iterdir()] == ["gemm.json"]
    seen = []
    real_replace = autotune.os.replace

    def failing_replace(src, dst):
        seen.append((src, dst))
        assert json.loads(open(src).read())["entries"] == {"b": {}}  # complete before the move
        raise OSError("disk gone")

    monkeypatch.setattr(autotune.os, "replace", failing_replace)
    with pytest.raises(OSError):
        autotune._write_atomic(str(tmp_path / "gemm.json"), {"format": 1, "entries": {"b": {}}})
    src, dst = seen[0]
    assert dst == str(tmp_path / "gemm.json") and str(tmp_path) == str(__import__("pathlib").Path(src).parent)
    # the old file is whole, the temporary one is gone
    assert json.loads((tmp_path / "gemm.json").read_text())["entries"] == {"a": {"x": 1}}
    assert [p.name for p in tmp_path.iterdir()] == ["gemm.json"]
    monkeypatch.setattr(autotune.os, "replace", real_replace)


def test_two_processes_saving_never_leave_a_torn_file(tmp_path) -> None:
    path = tmp_path / "gemm.json"
    code = textwrap.dedent(f"""
        import sys
        from overlap.kernels import autotune as at
        for i in range(150):
            entries = {{f"{{sys.argv[1]}}{{i}}": {{"pad": "x" * 20000}}}}
            at._write_atomic({str(path)!r}, {{"format": 1, "entries": entries}})
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, tag], cwd=REPO) for tag in ("a", "b")]
    reads = 0
    while any(p.poll() is None for p in procs):
        if path.exists():
            data = json.loads(path.read_text())  # never a partial file
            assert len(data["entries"]) == 1
            reads += 1
    assert all(p.returncode == 0 for p in procs)
    assert [p.name for p in tmp_path.iterdir()] == ["gemm.json"]


def test_measure_runs_candidates_under_the_interpreter(tmp_path) -> None:
    """``_measure`` builds each candidate's table and launches it (interpreted, fp16);
    a config that fails is skipped and remembered, GROUP_M 16 is tried on the winner."""
    code = textwrap.dedent("""
        import torch
        import overlap.kernels.autotune as at
        from overlap.kernels.tile_gemm import GemmConfig

        class Timer:  # one interpreted call; a config's "time" from its shape
            def __init__(self, fn):
                fn()
                self.iters, self.graph = 1, None
            def ms(self):
                return 1.0
        at.GraphTimer = Timer
        good = GemmConfig(block_m=64, block_n=64, block_k=32, num_stages=2, num_warps=4)
        bad = GemmConfig(block_m=64, block_n=64, block_k=32, num_stages=3, num_warps=4)
        import overlap.kernels.tile_gemm as tg
        real = tg.launch_tile_gemm
        def launch(a, b, c, table, *, config, **kw):
            if config == bad:
                raise RuntimeError("out of resources")
            assert table.shape[0] == 9 * 2
            real(a, b, c, table, config=config, **kw)
            ref = (a.float() @ b.float())
            assert ((c.float() - ref).norm() / ref.norm()).item() < 1e-2
        tg.launch_tile_gemm = launch
        best, ms = at._measure(9 * 64, 128, 64, torch.float16, torch.device("cpu"), False, [bad, good], 4)
        assert best.block_k == 32 and best.num_stages == 2, best
        assert any(v != v for v in ms.values()) and len([x for x in ms if not x.startswith("again")]) == 3, ms
        assert len([x for x in ms if x.startswith("again")]) == 2, ms  # good and its GROUP_M 16 twin
        assert (bad, "torch.float16", False, 4) in at._failed
        print("PASS measure")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and "PASS measure" in r.stdout, r.stdout + r.stderr


def test_measure_times_the_finalists_again_interleaved(monkeypatch) -> None:
    """The first pass (one candidate after another) ranked a first; timed again in
    interleaved rounds, b is faster and is the pick; the rounds alternate the finalists."""
    from dataclasses import replace

    import overlap.kernels.autotune as at
    import overlap.kernels.tile_gemm as tg
    from overlap.kernels.tile_gemm import GemmConfig

    a_cfg = GemmConfig(block_m=64, block_n=64, block_k=32, num_stages=2, num_warps=4)
    b_cfg, c_cfg, d_cfg = (replace(a_cfg, num_stages=st) for st in (3, 4, 5))
    first = {a_cfg: 1.0, b_cfg: 1.1, c_cfg: 1.2, d_cfg: 9.0}
    again = {a_cfg: 2.0, b_cfg: 1.5, c_cfg: 1.8, d_cfg: 0.1}  # d is not a finalist: never timed again
    seen: list = []
    last: dict = {}
    monkeypatch.setattr(tg, "launch_tile_gemm", lambda *args, config, **kw: last.__setitem__("cfg", config))

    class Timer:
        def __init__(self, fn) -> None:
            fn()
            self.cfg, self.calls, self.iters, self.graph = last["cfg"], 0, 1, None

        def ms(self) -> float:
            self.calls += 1
            seen.append(self.cfg)
            return first[self.cfg] if self.calls <= 5 else again[self.cfg]

    monkeypatch.setattr(at, "GraphTimer", Timer)
    best, ms = at._measure(64, 64, 32, torch.float16, torch.device("cpu"), False, [a_cfg, b_cfg, c_cfg, d_cfg], 4,
                           group_step=False)
    assert best == b_cfg
    assert ms["again " + at._cfg_str(b_cfg)] == 1.5 and ms[at._cfg_str(a_cfg)] == 1.0
    assert seen[20:] == [a_cfg, b_cfg, c_cfg] * 3  # 4 x 5 first-pass calls, then the rounds


# -- the sweep's shapes and files ------------------------------------------------------------
def test_sweep_shapes_cover_the_spread() -> None:
    from benchmarks.gemm_sweep import M_VALUES, MODELS, quick_shapes, sweep_shapes

    rows = sweep_shapes()
    assert len(rows) >= 40 and sweep_shapes() == rows  # deterministic
    assert len({(r["m"], r["n"], r["k"]) for r in rows}) == len(rows)
    assert {r["m"] for r in rows} == set(M_VALUES)
    assert {r["model"] for r in rows} == set(MODELS)
    assert {(r["b_layout"], r["dtype"]) for r in rows} == {(b, d) for b in ("nk", "kn")
                                                          for d in ("bfloat16", "float16")}
    assert {r["tp"] for r in rows} == {1, 2, 4, 8}
    assert all(r["n"] % 16 == 0 and r["k"] % 16 == 0 for r in rows)
    assert all(2.0 * r["m"] * r["n"] * r["k"] <= 16e12 for r in rows)
    assert 1 <= len(quick_shapes()) <= 8


def test_sweep_writes_json_and_table(tmp_path) -> None:
    from benchmarks.gemm_sweep import write_results

    rows = [{"m": 512, "n": 4096, "k": 4096, "b_layout": "nk", "dtype": "bfloat16", "cublas_ms": 0.1,
             "tile_ms": 0.1, "config": "128x128x64 s5 w8 g8", "tune_s": 1.0, "model": "x", "layer": "fc1", "tp": 1,
             "wait_ms": 0.125, "wait_vs_cublas": 0.8, "wait_config": "128x256x64 s3 w8 g8",
             "wait_engine": "gluon 128x256x64 s3", "tile_wait_ms": 0.2, "tile_wait_vs_cublas": 0.5,
             "gluon_vs_cublas": 0.95, "gluon_wait_vs_cublas": 0.9},
            {"m": 1024, "n": 4096, "k": 4096, "b_layout": "kn", "dtype": "float16", "cublas_ms": 0.09,
             "tile_ms": 0.1, "config": "64x256x64 s4 w4 g8", "tune_s": 2.0, "model": "x", "layer": "fc2", "tp": 2},
            {"m": 2048, "n": 4096, "k": 4096, "b_layout": "kn", "dtype": "float16", "error": "boom"}]
    summary = write_results(str(tmp_path), {"gpu": "Fake", "commit": "abc"}, rows, {"not_run": []})
    doc = json.loads((tmp_path / "gemm_sweep.json").read_text())
    assert set(doc) >= {"context", "summary", "rows"} and doc["rows"][2]["error"] == "boom"
    for r in doc["rows"][:2]:
        assert set(r) >= {"m", "n", "k", "b_layout", "dtype", "cublas_ms", "tile_ms", "config"}
    assert summary["shapes"] == 2 and summary["min"] == 0.9
    assert summary["geomean"] == pytest.approx((1.0 * 0.9) ** 0.5, abs=1e-4)
    assert summary["worst"][0][0].startswith("1024x4096x4096") and not summary["met"]
    assert summary["under_min_target"] == ["1024x4096x4096 kn float16"]
    md = (tmp_path / "gemm_sweep.md").read_text()
    assert "| 512 | 4096 | 4096 | nk | bfloat16 |" in md and "geo-mean 0.949x" in md
    # the wait column: only the rows that have it count
    assert summary["wait"] == {"geomean": 0.8, "min": 0.8, "shapes": 1, "gluon_picked": 1,
                               "under_0.93": ["512x4096x4096 nk bfloat16"]}
    assert summary["tile_wait"] == {"geomean": 0.5, "min": 0.5, "shapes": 1}
    assert "| 0.1250 | 0.800 | 128x256x64 s3 w8 g8 | gluon 128x256x64 s3 | 0.500 |" in md
    assert "consumer ops run it" in md and "min 0.800x" in md and "Gluon picked on 1 shapes" in md
    assert summary["gluon"]["geomean"] == 0.95 and summary["gluon_wait"]["min"] == 0.9
    assert "Gluon GEMM alone (its fastest config per shape): geo-mean 0.950x" in md and "waiting" in md
    # the posting column (--posts): its rows only
    rows[0].update(post_vs_cublas=0.96, alone_best_vs_cublas=1.0)
    summary = write_results(str(tmp_path), {"gpu": "Fake", "commit": "abc"}, rows, {"not_run": []})
    assert summary["post"] == {"geomean": 0.96, "min": 0.96, "shapes": 1}
    assert summary["alone_best"] == {"geomean": 1.0, "min": 1.0, "shapes": 1}
    md = (tmp_path / "gemm_sweep.md").read_text()
    assert "producer ops run it (tiles that post), on the engine: geo-mean 0.960x cuBLAS" in md
    assert "The faster of that and the tile GEMM alone: geo-mean 1.000x" in md


def test_sweep_post_table_is_the_wait_tables_tiles_posting() -> None:
    """``post_ms``'s table: ``wait_table``'s tiles in its order, each posting to the flag its
    chunk's tiles wait on there, and waiting on none."""
    from benchmarks.gemm_sweep import post_table, wait_table
    from overlap import protocol as P
    from overlap.kernels.tile_gemm import GemmConfig

    for cfg in (GemmConfig(block_m=128, block_n=256), GemmConfig(block_m=64, block_n=128)):
        for m in (512, 4096, 5000, 8192):
            post, wait = post_table(m, 1000, cfg, "cpu"), wait_table(m, 1000, cfg, "cpu")
            assert torch.equal(post[:, :P.COL_WAIT], wait[:, :P.COL_WAIT]), (cfg, m)
            assert torch.equal(post[:, P.COL_POST], wait[:, P.COL_WAIT]) and bool((post[:, P.COL_WAIT] < 0).all())


def test_sweep_wait_table_chunks_rows_by_flag() -> None:
    """``wait_ms``'s table: the op's chunks (all_reduce_matmul's count at M: 1 per 2048 rows,
    1 to 4; or a fixed count), sized as the op sizes them (128-row multiples but the last),
    each tile waiting on its chunk's flag, every C tile once (ragged chunk ends included)."""
    from benchmarks import gemm_sweep
    from benchmarks.gemm_sweep import wait_chunks, wait_table
    from overlap.kernels.tile_gemm import GemmConfig
    from overlap.policies import split_rows

    assert [wait_chunks(m) for m in (512, 1024, 2048, 4096, 6144, 8192, 32768)] == [1, 1, 1, 2, 3, 4, 4]
    cfg = GemmConfig(block_m=128, block_n=256)
    for m, n, fixed in ((1000, 600, 4), (4096, 512, 0), (6144, 300, 0), (1024, 512, 0), (1024, 512, 4)):
        gemm_sweep.FIXED_CHUNKS[0] = fixed
        try:
            chunks = wait_chunks(m)
            t = wait_table(m, n, cfg, "cpu").tolist()
        finally:
            gemm_sweep.FIXED_CHUNKS[0] = 0
        assert chunks == (fixed or max(1, min(4, m // 2048)))
        sizes = split_rows(m, chunks, 128)
        starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        assert all(x % 128 == 0 for x in sizes[:-1]) and starts[-1] == m
        cover = {}
        for a_row, _src, c_row, rows, n_tile, w, mult, post in t:
            assert a_row == c_row and mult == 1 and post < 0 and 0 < rows <= 128
            chunk = next(i for i in range(len(sizes)) if starts[i] <= c_row < starts[i + 1])
            assert w == chunk and c_row + rows <= starts[chunk + 1]
            for r in range(c_row, c_row + rows):
                cover[(r, n_tile)] = cover.get((r, n_tile), 0) + 1
        assert cover == {(r, j): 1 for r in range(m) for j in range(-(-n // 256))}
        assert len({row[5] for row in t}) == len(sizes)
