"""The GEMM engine choice on the CPU (``overlap.kernels.engine``): the env knob, what the
Gluon GEMM cannot run (the tile GEMM then, with the reason in the report), a forced
Gluon plan's launch arguments, the measured pick made once per problem and never inside a
capture. The Gluon launch and the tile launch are stand-ins here; the engines' results are
checked on the GPU (tests/gpu/test_gluon_gemm_gpu.py, the ops' GPU tests)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from overlap import observe  # noqa: E402
from overlap.kernels import engine  # noqa: E402
from overlap.kernels.tile_gemm import GemmConfig, TileGemmPlan  # noqa: E402
from overlap.policies import Segment, build_tile_table  # noqa: E402

CFG = GemmConfig(block_m=128, block_n=256)


def _call(m: int = 512, n: int = 512, k: int = 256, cfg: GemmConfig = CFG, counter: bool = True) -> dict:
    g = torch.Generator().manual_seed(m + n + k)
    a = torch.randn(m // 2, k, generator=g).half()
    a2 = torch.randn(m // 2, k, generator=g).half()
    w = torch.randn(n, k, generator=g).half()
    c = torch.empty(m, n, dtype=torch.float16)
    segs = [Segment(a_src=0, a_row=0, c_row=0, rows=m // 2),
            Segment(a_src=1, a_row=0, c_row=m // 2, rows=m // 2, wait_idx=0, wait_mult=3)]
    table = torch.tensor(build_tile_table(segs, n, cfg.block_m, cfg.block_n, 8), dtype=torch.int32)
    kw = dict(a2=a2, flags=torch.zeros(4, dtype=torch.int32), err=torch.zeros(8, dtype=torch.int32),
              counter=torch.zeros(4, dtype=torch.int32) if counter else None, timeout_ns=123_000, rank=1,
              config=cfg, wait=True, clip=True)
    return dict(a=a, a2=a2, b=w.t(), c=c, table=table, kw=kw)


@pytest.fixture(autouse=True)
def _clean_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """No setting or kept pick of the environment or of another test reaches these."""
    for v in (engine.EXPERIMENTAL_ENV, engine.AHEAD_ENV, "OVERLAP_GEMM_CACHE"):
        monkeypatch.delenv(v, raising=False)
    for name, value in (("_measured", {}), ("_picks", {}), ("_disk", {}), ("_disk_loaded", [False])):
        monkeypatch.setattr(engine, name, value)
    monkeypatch.setattr(engine, "_derived", engine.OrderedDict())


@pytest.fixture
def fake_gluon(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Gluon 'available' on this CPU; its launches recorded, not run."""
    launches: list[dict] = []

    class FakePlan:
        def __init__(self, a: Any, b: Any, c: Any, table: Any, **kw: Any) -> None:
            self.made = dict(table=table, **kw)

        def launch(self, a: Any, b: Any, c: Any, **kw: Any) -> None:
            launches.append(dict(self.made, a=a, b=b, c=c, **kw))

    monkeypatch.setattr(engine, "unavailable", lambda device, dtype: None)
    monkeypatch.setattr(engine._gg, "GluonGemmPlan", FakePlan)
    observe.reset_report()
    return launches


def _engines() -> dict:
    return {tuple(e["gemm"]): (e["engine"], e["why"]) for e in observe.report().engines}


def test_env_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    for v, want in (("", "auto"), ("tile", "tile"), (" Gluon ", "gluon"), ("auto", "auto")):
        monkeypatch.setenv(engine.ENGINE_ENV, v)
        assert engine.engine_mode() == want
    monkeypatch.setenv(engine.ENGINE_ENV, "cublas")
    with pytest.raises(ValueError, match="OVERLAP_GEMM_ENGINE='cublas'"):
        engine.engine_mode()
    x = _call()
    with pytest.raises(ValueError, match="OVERLAP_GEMM_ENGINE"):
        engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])


def test_what_gluon_cannot_run_stays_on_the_tile_gemm(fake_gluon: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(engine.ENGINE_ENV, "gluon")
    x = _call()
    cases = {"split tiles": dict(split=(2, 2)), "a folded norm": dict(norm_epi=True),
             "signature words": dict(sig_stride=4, clip=None), "posts": dict(post=True),
             "a 64x128 tile": dict(config=GemmConfig(block_m=64, block_n=128)),
             "flattened": dict(config=replace(CFG, flatten=True), clip=None, counter=None)}
    for want, more in cases.items():
        assert want in (engine.misfit(x["b"], **{**x["kw"], **more}) or ""), want
    assert engine.misfit([x["b"], x["b"]], **x["kw"]) == "several weights"
    c2 = [x["c"], x["c"][:, :256]]
    gp = engine.engine_plan(x["a"], [x["b"], x["b"][:, :256]], c2, x["table"], **{**x["kw"], "clip": None})
    assert type(gp) is TileGemmPlan and _engines()[(512, 768, 256, "float16", "waits")] == ("tile", "Gluon: several weights")
    observe.reset_report()
    assert engine.misfit(x["b"], **x["kw"]) is None
    counter = torch.zeros(8, dtype=torch.int32)
    gp = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **{**x["kw"], "counter": counter, "split": (2, 2)})
    assert type(gp) is TileGemmPlan
    (eng, why), = _engines().values()
    assert eng == "tile" and why == "Gluon: split tiles", (eng, why)
    # Gluon missing: the tile GEMM, and the reason said
    monkeypatch.setattr(engine, "unavailable", lambda device, dtype: "no Gluon in this Triton")
    observe.reset_report()
    assert type(engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])) is TileGemmPlan
    assert list(_engines().values()) == [("tile", "Gluon: no Gluon in this Triton")]
    assert "engine tile (Gluon: no Gluon in this Triton)" in str(observe.report())
    monkeypatch.setenv(engine.ENGINE_ENV, "tile")
    monkeypatch.setattr(engine, "unavailable", lambda device, dtype: None)
    observe.reset_report()
    assert type(engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])) is TileGemmPlan
    assert list(_engines().values()) == [("tile", "OVERLAP_GEMM_ENGINE=tile")]


def test_unavailable_on_this_machine() -> None:
    """On a CPU (or under the interpreter) the reason names it; fp32 is refused by dtype."""
    why = engine.unavailable("cpu", torch.float16)
    assert why and ("cuda" in why.lower() or "interpreter" in why or "Gluon" in why), why


def test_forced_gluon_launches_with_the_plans_words(fake_gluon: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(engine.ENGINE_ENV, "gluon")
    picked = []
    for cfg in (CFG, GemmConfig(block_m=128, block_n=128), GemmConfig(block_m=64, block_n=256)):
        fake_gluon.clear()
        x = _call(cfg=cfg)
        gp = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])
        assert isinstance(gp, engine.EnginePlan)
        for it, (cap, grid) in enumerate(((200, 500), (256, 3))):  # a row cut, then none; grids capped
            a = x["a"][:cap].clone() if cap < 256 else x["a"]
            ops = gp.operands(a, x["b"], x["a2"])
            gp.launch(ops, x["c"], epoch=5 + it, grid=grid, rows=(cap, 256))
            got = fake_gluon[-1]
            assert got["a"] is a and got["a2"] is x["a2"] and got["b"] is x["b"] and got["c"] is x["c"]
            assert got["table"] is x["table"] and got["flags"] is x["kw"]["flags"] and got["err"] is x["kw"]["err"]
            assert got["counter"] is x["kw"]["counter"] and got["rows"] == (cap, 256)
            assert got["epoch"] == 5 + it and got["rank"] == 1 and got["timeout_ns"] == 123_000
            assert got["grid"] == grid and got["activation"] == 0 and got["clip"] is True
            assert got["config"] == engine.gluon_configs(cfg)[0]
        assert gp.engine.startswith("gluon") and len(fake_gluon) == 2
        with pytest.raises(ValueError, match="rows"):
            gp.launch(ops, x["c"], epoch=1, grid=4)
        with pytest.raises(TypeError, match="operands"):
            gp.launch((None, None, None), x["c"], epoch=1, grid=4, rows=(256, 256))
        with pytest.raises(ValueError, match="plan"):  # the tile plan's operand checks hold
            gp.operands(x["a"][:, :128].contiguous(), x["b"], x["a2"])
        picked += list(_engines().values())  # (one GEMM problem: the last plan's engine)
    assert picked == [(e, "OVERLAP_GEMM_ENGINE=gluon") for e in
                      ("gluon 128x256x64 s3", "gluon pp128x128x64 s5", "gluon pp64x256x64 s4")], picked


def test_auto_measures_once_per_problem_and_never_in_a_capture(fake_gluon: list,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(engine.ENGINE_ENV, "auto")
    measured: list[Any] = []
    pick: list[Any] = [engine.gluon_configs(CFG)[0]]

    def measure(self: Any, ops: Any, c: Any, grid: int, rows: Any) -> tuple:
        measured.append((grid, rows))
        return pick[0], f"measured {len(measured)}"

    monkeypatch.setattr(engine.EnginePlan, "_measure", measure)
    tile_launches: list[Any] = []
    x = _call(m=1024, n=768)

    def plan() -> Any:
        gp = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])
        gp.tile.launch = lambda descs, c, **kw: tile_launches.append(kw)
        gp.tile.operands = lambda a, b, a2=None: ("descs", a, b, a2)
        return gp

    gp = plan()
    for _ in range(3):
        gp.launch(gp.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=1, grid=100, rows=(512, 512))
    assert measured == [(100, (512, 512))] and len(fake_gluon) == 3 and not tile_launches
    gp2 = plan()  # a second plan of the problem: the pick is known
    gp2.launch(gp2.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=1, grid=100, rows=(512, 512))
    assert len(measured) == 1 and len(fake_gluon) == 4
    assert list(_engines().values()) == [("gluon 128x256x64 s3", "measured 1")]
    # another grid is another measurement; the tile GEMM picked runs the tile plan
    pick[0] = None
    gp3 = plan()
    gp3.launch(gp3.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=2, grid=90, rows=(512, 512))
    assert measured[-1] == (90, (512, 512)) and len(fake_gluon) == 4
    assert tile_launches == [dict(epoch=2, grid=90, rows=(512, 512))] and gp3.engine == "tile"
    # a first launch inside a capture: no measuring, the tile GEMM
    monkeypatch.setattr(engine, "_capturing", lambda: True)
    gp4 = plan()
    gp4.launch(gp4.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=1, grid=80, rows=(512, 512))
    assert len(measured) == 2 and gp4.engine == "tile" and len(tile_launches) == 2
    assert "capture" in list(_engines().values())[0][1]


def test_measured_picks_kept_on_disk(fake_gluon: list, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """With OVERLAP_GEMM_CACHE the measured pick is written beside it and a later process
    (fresh in-memory caches) takes it from there without measuring; a file of another
    format is ignored; a forced engine overrides a kept pick."""
    monkeypatch.setenv(engine.ENGINE_ENV, "auto")
    monkeypatch.setenv("OVERLAP_GEMM_CACHE", str(tmp_path / "gemm.json"))
    monkeypatch.setattr(engine, "_env", lambda device: {"gpu": "test", "sms": 132})
    measured: list[Any] = []

    def measure(self: Any, ops: Any, c: Any, grid: int, rows: Any) -> tuple:
        measured.append(grid)
        return engine.gluon_configs(CFG)[0], "measured here"

    monkeypatch.setattr(engine.EnginePlan, "_measure", measure)
    x = _call(m=768, n=512, k=128)

    def fresh_process() -> None:
        monkeypatch.setattr(engine, "_measured", {})
        monkeypatch.setattr(engine, "_disk", {})
        monkeypatch.setattr(engine, "_disk_loaded", [False])

    def run() -> Any:
        gp = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])
        gp.tile.launch = lambda descs, c, **kw: None
        gp.tile.operands = lambda a, b, a2=None: ("descs", a, b, a2)
        gp.launch(gp.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=1, grid=64, rows=(384, 384))
        return gp

    fresh_process()
    assert run().engine == "gluon 128x256x64 s3" and measured == [64]
    path = engine.cache_path()
    assert path == str(tmp_path / "gemm.json") + ".engines.json"
    import json

    data = json.load(open(path))
    assert data["format"] == "overlap-gemm-engine-1" and len(data["entries"]) == 1, data
    fresh_process()
    gp = run()
    assert measured == [64] and gp.engine == "gluon 128x256x64 s3" and "earlier process" in gp.why
    # a pick naming no candidate config, and a file of another format: measured again
    data["entries"] = {k: {"engine": "gluon 512x512x64 s9", "why": "?"} for k in data["entries"]}
    json.dump(data, open(path, "w"))
    fresh_process()
    assert run().engine == "gluon 128x256x64 s3" and measured == [64, 64]
    open(path, "w").write("not json")
    fresh_process()
    run()
    assert measured == [64, 64, 64]
    # forced: the kept pick (here Gluon's) is not consulted, nor measured
    monkeypatch.setenv(engine.ENGINE_ENV, "gluon")
    assert run().why == "OVERLAP_GEMM_ENGINE=gluon" and len(measured) == 3


def test_split_columns_keeps_each_tiles_rows_and_waits() -> None:
    """A 128x256 table as 128x128 tiles: the same tiles as a table built at 128 columns
    (rows, source, flag, multiple), each 256-wide tile's halves next to each other, a right
    half past N left out; bad tables refused."""
    segs = [Segment(a_src=0, a_row=0, c_row=0, rows=200),
            Segment(a_src=1, a_row=64, c_row=200, rows=300, wait_idx=1, wait_mult=3),
            Segment(a_src=1, a_row=0, c_row=500, rows=128, wait_idx=0, wait_mult=2)]
    for n in (640, 768, 700, 100):
        wide = torch.tensor(build_tile_table(segs, n, 128, 256, 4), dtype=torch.int32)
        half = engine.split_columns(wide, n, 256)
        narrow = build_tile_table(segs, n, 128, 128, 4)
        assert sorted(map(tuple, half.tolist())) == sorted(map(tuple, narrow)), n
        i = 0
        for t in wide.tolist():  # tile i's halves, in the wide table's order
            assert half[i].tolist() == t[:4] + [2 * t[4]] + t[5:]
            i += 1
            if (2 * t[4] + 1) * 128 < n:
                assert half[i].tolist() == t[:4] + [2 * t[4] + 1] + t[5:]
                i += 1
        assert i == half.shape[0]
    with pytest.raises(ValueError, match="even"):
        engine.split_columns(wide, 100, 255)
    with pytest.raises(ValueError, match="int32"):
        engine.split_columns(wide.long(), 100, 256)
    multi = wide.clone()
    multi[:, 4] |= 1 << 24  # a second weight's tiles (protocol.N_TILE_BITS)
    with pytest.raises(ValueError, match="one weight"):
        engine.split_columns(multi, 100, 256)
    with pytest.raises(ValueError, match="past N"):
        engine.split_columns(torch.tensor(build_tile_table(segs, 640, 128, 256, 4), dtype=torch.int32), 256, 256)


def test_retile_columns_keeps_each_row_blocks_rows_and_waits() -> None:
    """A table of 128x256 (or 128x128) tiles retiled to 192 columns: the same tiles as a
    table built at 192 columns (rows, source, flag, multiple), each exactly once, in the
    order of the old tiles they start in; a table with posts, a row block missing a column
    tile, or a row block of two flags is refused."""
    segs = [Segment(a_src=0, a_row=0, c_row=0, rows=200),
            Segment(a_src=1, a_row=64, c_row=200, rows=300, wait_idx=1, wait_mult=3),
            Segment(a_src=1, a_row=0, c_row=500, rows=128, wait_idx=0, wait_mult=2)]
    for old_n in (256, 128):
        for n in (1536, 640, 700, 100, 192):
            old = torch.tensor(build_tile_table(segs, n, 128, old_n, 4), dtype=torch.int32)
            new = engine.retile_columns(old, n, old_n, 192)
            want = build_tile_table(segs, n, 128, 192, 4)
            assert sorted(map(tuple, new.tolist())) == sorted(map(tuple, want)), (old_n, n)
            # in the old order: a new tile follows the old tile it starts in
            starts = [t[4] * 192 // old_n for t in new.tolist()]
            rows = [tuple(t[:4]) for t in old.tolist()]
            pos = [rows.index(tuple(t[:4])) for t in new.tolist()]
            keyed = [(rows[p], s) for p, s in zip(pos, starts)]
            order = [(tuple(t[:4]), t[4]) for t in old.tolist()]
            assert [order.index(kv) for kv in keyed] == sorted(order.index(kv) for kv in keyed), (old_n, n)
    old = torch.tensor(build_tile_table(segs, 640, 128, 256, 4), dtype=torch.int32)
    posts = old.clone()
    posts[:, 7] = 0
    with pytest.raises(ValueError, match="post"):
        engine.retile_columns(posts, 640, 256, 192)
    with pytest.raises(ValueError, match="exactly once"):
        engine.retile_columns(old[1:], 640, 256, 192)
    two = old.clone()
    two[0, 5] = 7
    with pytest.raises(ValueError, match="different flags"):
        engine.retile_columns(two, 640, 256, 192)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        engine.retile_columns(old, 500, 256, 192)


def test_wide_candidate_only_where_asked(fake_gluon: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """The 192-column config is a candidate of 128-row tables with ``OVERLAP_GLUON_EXPERIMENTAL=1``
    only (and in the kept picks' key then); picked, it runs on the retiled table (the op's
    words, rows and grid) and the report says "retiled"."""
    monkeypatch.delenv(engine.EXPERIMENTAL_ENV, raising=False)
    assert all(not c.wide for c in engine.gluon_configs(CFG))
    from overlap.kernels import autotune

    monkeypatch.setattr(autotune, "device_env", lambda device: {"gpu": "test"})
    assert "wide" not in engine._env("cpu")
    monkeypatch.setenv(engine.EXPERIMENTAL_ENV, "1")
    assert engine._env("cpu")["experimental"]["wide"]["128x256"] == ["gluon 128x192x64 s4"]
    cands = engine.gluon_configs(CFG)
    assert [c.block_n for c in cands] == [256, 128, 256, 256, 192] and cands[-1].wide and cands[3].split_tail
    assert not cands[2].tma_epilogue and cands[2].stages == 4 and engine._label(cands[2]) == "gluon 128x256x64 s4 regs"
    assert [c.block_n for c in engine.gluon_configs(GemmConfig(block_m=128, block_n=128))][-1] == 192
    assert not any(c.wide for c in engine.gluon_configs(GemmConfig(block_m=256, block_n=128)))
    monkeypatch.setenv(engine.ENGINE_ENV, "auto")
    monkeypatch.setattr(engine, "_measured", {})
    monkeypatch.setattr(engine.EnginePlan, "_measure", lambda self, ops, c, grid, rows: (cands[-1], "measured"))
    x = _call(m=1024, n=640)
    gp = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])
    for it in range(2):
        gp.launch(gp.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=3 + it, grid=77, rows=(512, 512))
        got = fake_gluon[-1]
        assert torch.equal(got["table"], engine.retile_columns(x["table"], 640, 256, 192))
        assert got["config"] == cands[-1] and got["flags"] is x["kw"]["flags"] and got["rows"] == (512, 512)
    assert gp.engine == "gluon 128x192x64 s4 retiled"
    # the wide configs off again: the pick this process kept is no candidate, so measured again
    monkeypatch.delenv(engine.EXPERIMENTAL_ENV)
    measured: list[int] = []
    monkeypatch.setattr(engine.EnginePlan, "_measure",
                        lambda self, ops, c, grid, rows: (measured.append(1), (None, "measured"))[1])
    gp = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])
    gp.tile.launch = lambda descs, c, **kw: fake_gluon.append({"tile": True, **kw})
    gp.tile.operands = lambda a, b, a2=None: ("descs", a, b, a2)
    gp.launch(gp.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=5, grid=77, rows=(512, 512))
    assert measured == [1] and gp.engine == "tile" and fake_gluon[-1].get("tile")
    # and on again: the tile GEMM kept without the wide config among the candidates is measured again
    monkeypatch.setenv(engine.EXPERIMENTAL_ENV, "1")
    gp = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])
    gp.tile.launch = lambda descs, c, **kw: fake_gluon.append({"tile": True, **kw})
    gp.launch(gp.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=6, grid=77, rows=(512, 512))
    assert measured == [1, 1]
    gp = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])  # now kept with it
    gp.tile.launch = lambda descs, c, **kw: fake_gluon.append({"tile": True, **kw})
    gp.launch(gp.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=7, grid=77, rows=(512, 512))
    assert measured == [1, 1] and gp.engine == "tile"


def test_ahead_configs_only_where_asked(fake_gluon: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``OVERLAP_GLUON_AHEAD=1`` every Gluon candidate (a waiting table's, a posting
    one's) is the same config with ``ahead`` on, in its place, named so in the report and
    in the kept picks' key; a pick kept without it is measured again."""
    from overlap.kernels import autotune

    monkeypatch.setattr(autotune, "device_env", lambda device: {"gpu": "test"})
    plain, posts = engine.gluon_configs(CFG), engine._post_configs(CFG)
    assert plain and posts and not any(c.ahead for c in plain + posts) and "ahead" not in engine._env("cpu")
    monkeypatch.setenv(engine.AHEAD_ENV, "1")
    cands = engine.gluon_configs(CFG)
    assert cands == tuple(replace(c, ahead=True) for c in plain)
    assert engine._post_configs(CFG) == tuple(replace(c, ahead=True) for c in posts)
    assert engine._env("cpu")["ahead"] is True and engine._label(cands[0]) == "gluon 128x256x64 s3 ahead"
    monkeypatch.setenv(engine.ENGINE_ENV, "auto")
    measured: list[int] = []
    monkeypatch.setattr(engine.EnginePlan, "_measure",
                        lambda self, ops, c, grid, rows: (measured.append(1), (self.configs[0], "measured"))[1])
    x = _call(m=1024, n=640)
    for it, env in enumerate(("1", "", "1")):  # (a pick without it, then with it again: measured each time)
        monkeypatch.setenv(engine.AHEAD_ENV, env)
        gp = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])
        gp.launch(gp.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=3 + it, grid=77, rows=(512, 512))
        assert fake_gluon[-1]["config"].ahead == bool(env) and gp.engine.endswith(" ahead") == bool(env)
    assert measured == [1, 1, 1]
    gp = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])  # kept: not measured again
    gp.launch(gp.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=7, grid=77, rows=(512, 512))
    assert measured == [1, 1, 1] and fake_gluon[-1]["config"].ahead


def test_an_op_plans_gemm_made_again_where_ahead_changes(fake_gluon: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ops._plans.gemm_plan`` keeps one GEMM plan per key; turning ``OVERLAP_GLUON_AHEAD``
    on (or off) makes the next call's plan anew, with the candidates it now has, and the
    same setting finds the kept one."""
    from overlap.ops._plans import gemm_plan

    x = _call()
    kw = dict(x["kw"])
    plans: dict = {}
    args = (plans, x["a"], x["b"], x["c"], x["table"])
    first = gemm_plan(*args, **kw)
    assert gemm_plan(*args, **kw) is first and not any(g.ahead for g in first.configs)
    monkeypatch.setenv(engine.AHEAD_ENV, "1")
    on = gemm_plan(*args, **kw)
    assert on is not first and on.configs and all(g.ahead for g in on.configs) and gemm_plan(*args, **kw) is on
    monkeypatch.delenv(engine.AHEAD_ENV)
    assert gemm_plan(*args, **kw) is first and len(plans) == 2


def test_a_plan_takes_the_tables_host_rows_without_reading_it(fake_gluon: list,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A table made by ``table_tensor`` (or a run of its rows) keeps its rows on the host
    (``policies.host_table``): an engine plan over it, its halves too, reads no table from
    the device (``Tensor.cpu`` raising shows it); a table made otherwise is read when the
    plan is made. Views of other shapes than a run of whole rows have none."""
    from overlap.policies import host_table, table_rows, table_tensor

    x = _call(m=1024, n=640)
    rows = x["table"].numpy()
    made = table_tensor(rows, "cpu")
    assert torch.equal(host_table(made), x["table"]) and torch.equal(host_table(made[3:7]), x["table"][3:7])
    for other in (x["table"], made[::2], made[:, :4], made.t(), made.view(-1)):
        assert host_table(other) is None
    with torch.inference_mode():  # (a view made there has no ``_base``: table_rows keeps its rows)
        inf = table_tensor(rows, "cpu")
        assert torch.equal(host_table(table_rows(inf, 2, 5)), x["table"][2:5])
        assert torch.equal(host_table(table_rows(inf, 4)), x["table"][4:])
    read: list[int] = []
    real_cpu = torch.Tensor.cpu

    def cpu(t: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
        if t.dtype == torch.int32 and t.dim() == 2:
            read.append(t.shape[0])
        return real_cpu(t, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    monkeypatch.setenv(engine.ENGINE_ENV, "auto")
    monkeypatch.setattr(engine.EnginePlan, "_measure", lambda self, ops, c, grid, rows: (self.configs[-1], "set"))
    for table, want in ((made[2:], []), (x["table"][2:].clone(), [x["table"].shape[0] - 2])):
        del read[:]
        gp = engine.engine_plan(x["a"], x["b"], x["c"], table, **x["kw"])
        gp.launch(gp.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=3, grid=77, rows=(512, 512))
        assert read == want and gp.engine.endswith("halves"), (read, gp.engine)
        assert torch.equal(fake_gluon[-1]["table"], engine.split_columns(x["table"][2:], 640, 256))


def test_scratch_flags_at_their_waiters_largest_multiple() -> None:
    """The engine's measurement launches on flags all set at epoch 1: each flag a tile waits
    on at the largest multiple of its waiters, flags nobody waits on 0 (``set_flags``)."""
    segs = [Segment(a_src=0, a_row=0, c_row=0, rows=256),
            Segment(a_src=1, a_row=0, c_row=256, rows=256, wait_idx=2, wait_mult=3),
            Segment(a_src=1, a_row=256, c_row=512, rows=128, wait_idx=2, wait_mult=5),
            Segment(a_src=1, a_row=384, c_row=640, rows=128, wait_idx=0, wait_mult=1)]
    table = torch.tensor(build_tile_table(segs, 512, 128, 256, 8), dtype=torch.int32)
    got = engine.set_flags(table, torch.full((5,), 9, dtype=torch.int32))
    assert got.dtype == torch.int32 and got.tolist() == [1, 0, 5, 0, 0]


def test_auto_may_pick_the_column_halves(fake_gluon: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a 128x256 table the candidates are 128x256 and ping-pong 128x128 on the table's
    column halves; picked, the halves run on the split table (same words, rows and grid) and
    the report names them. A pick of the halves kept from before is not taken inside a
    capture, where the split table cannot be built (the tile GEMM runs)."""
    monkeypatch.setenv(engine.ENGINE_ENV, "auto")
    cands = engine.gluon_configs(CFG)
    assert [c.block_n for c in cands] == [256, 128] and cands[1].pingpong
    pick: list[Any] = [cands[1]]
    monkeypatch.setattr(engine.EnginePlan, "_measure", lambda self, ops, c, grid, rows: (pick[0], "measured"))
    x = _call(m=1024, n=640)

    def plan() -> Any:
        gp = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])
        gp.tile.launch = lambda descs, c, **kw: fake_gluon.append({"tile": True, **kw})
        gp.tile.operands = lambda a, b, a2=None: ("descs", a, b, a2)
        return gp

    gp = plan()
    for it in range(2):
        gp.launch(gp.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=3 + it, grid=77, rows=(512, 512))
        got = fake_gluon[-1]
        assert torch.equal(got["table"], engine.split_columns(x["table"], 640, 256))
        assert got["config"] == cands[1] and got["flags"] is x["kw"]["flags"] and got["err"] is x["kw"]["err"]
        assert got["counter"] is x["kw"]["counter"] and got["rows"] == (512, 512) and got["grid"] == 77
        assert got["epoch"] == 3 + it and got["clip"] is True
    assert fake_gluon[0]["table"] is fake_gluon[1]["table"]  # built once
    assert gp.engine == "gluon pp128x128x64 s5 halves"
    assert list(_engines().values()) == [("gluon pp128x128x64 s5 halves", "measured")]
    # known from the first plan; a new plan of the same op table (new words: a capture's) whose
    # first launch is inside a capture runs the halves on the table the first plan built
    monkeypatch.setattr(engine, "_capturing", lambda: True)
    gp2 = plan()
    gp2.launch(gp2.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=1, grid=77, rows=(512, 512))
    assert gp2.engine == "gluon pp128x128x64 s5 halves" and fake_gluon[-1]["table"] is fake_gluon[0]["table"]
    # a plan of another op table (equal, not the same tensor) cannot build its halves in a
    # capture: the tile GEMM, and the report says so, naming the pick measured before
    x["table"] = x["table"].clone()
    gp2 = plan()
    gp2.launch(gp2.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=1, grid=77, rows=(512, 512))
    assert gp2.engine == "tile" and fake_gluon[-1].get("tile") and "cannot be built" in gp2.why
    (eng, why), = _engines().values()
    assert eng == "tile" and "(gluon pp128x128x64 s5 halves) cannot be built" in why, why
    # the 128x256 config, known, runs inside a capture on the op's own table
    monkeypatch.setattr(engine, "_capturing", lambda: False)
    pick[0] = cands[0]
    plan().launch(gp.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=1, grid=60, rows=(512, 512))
    monkeypatch.setattr(engine, "_capturing", lambda: True)
    gp3 = plan()
    gp3.launch(gp3.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=1, grid=60, rows=(512, 512))
    assert gp3.engine == "gluon 128x256x64 s3" and fake_gluon[-1]["table"] is x["table"]


def _cut(row: int, rows: int, cap: int, span: int) -> tuple[int, int]:
    """The kernels' row cut (``tile_gemm._cut_rows``), in Python."""
    blk, off = divmod(row, span)
    return blk * cap + off, min(rows, cap - off)


def test_split_rows_keeps_each_tiles_columns_waits_and_row_cut() -> None:
    """A 256x128 table as 128x128 tiles: the same tiles as a table built at 128 rows; each
    tile's halves next to each other with its column tile, source, flag and multiple; under
    every row cut of a bucket the halves cover exactly the rows the tile covers; posts and
    over-tall tiles refused."""
    span = 640
    segs = [Segment(a_src=0, a_row=0, c_row=0, rows=span),
            Segment(a_src=1, a_row=span, c_row=span, rows=300, wait_idx=1, wait_mult=3),
            Segment(a_src=1, a_row=span + 300, c_row=span + 300, rows=340, wait_idx=2, wait_mult=3)]
    tall = torch.tensor(build_tile_table(segs, 384, 256, 128, 4), dtype=torch.int32)
    half = engine.split_rows(tall, 256)
    assert sorted(map(tuple, half.tolist())) == sorted(map(tuple, build_tile_table(segs, 384, 128, 128, 4)))
    i = 0
    for t in tall.tolist():
        h = half[i].tolist()
        assert h[:3] == t[:3] and h[3] == min(t[3], 128) and h[4:] == t[4:]
        i += 1
        if t[3] > 128:
            h = half[i].tolist()
            assert h[0] == t[0] + 128 and h[1] == t[1] and h[2] == t[2] + 128 and h[3] == t[3] - 128
            assert h[4:] == t[4:]
            i += 1
        for cap in (span, 500, 300, 129, 1):
            r0, n0 = _cut(t[2], t[3], cap, span)
            want = set(range(r0, r0 + max(n0, 0)))
            got = set()
            for h in half[i - (2 if t[3] > 128 else 1):i].tolist():
                r, nr = _cut(h[2], h[3], cap, span)
                got |= set(range(r, r + max(nr, 0)))
            assert got == want, (t, cap)
    assert i == half.shape[0]
    with pytest.raises(ValueError, match="more than"):
        engine.split_rows(tall, 128)
    posting = torch.tensor(build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=512, post_base=0)], 256,
                                            256, 128), dtype=torch.int32)
    with pytest.raises(ValueError, match="post"):
        engine.split_rows(posting, 256)
    with pytest.raises(ValueError, match="post"):
        engine.split_columns(posting, 256, 128)


def test_a_256x128_table_may_run_as_its_row_halves(fake_gluon: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(engine.ENGINE_ENV, "auto")
    cfg = GemmConfig(block_m=256, block_n=128)
    cands = engine.gluon_configs(cfg)
    assert [(c.block_m, c.block_n, c.pingpong) for c in cands] == [(256, 128, False), (128, 128, True)]
    monkeypatch.setattr(engine.EnginePlan, "_measure", lambda self, ops, c, grid, rows: (cands[1], "measured"))
    x = _call(m=1024, n=384, cfg=cfg)
    gp = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])
    gp.launch(gp.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=2, grid=50, rows=(300, 512))
    got = fake_gluon[-1]
    assert torch.equal(got["table"], engine.split_rows(x["table"], 256)) and got["rows"] == (300, 512)
    assert got["config"] == cands[1] and gp.engine == "gluon pp128x128x64 s5 halves"


class FakeTiming:
    """The measurement's timing (``engine._CudaTiming``) on the CPU: a capture records the
    launches its function makes, a replay makes them again; each launch costs what
    ``cost(name, nth)`` says (its engine's name, and how many launches of it came before)."""

    made: list["FakeTiming"] = []

    def __init__(self, launches: list, cost: Any, fail_capture: str | None = None, fail_time: bool = False) -> None:
        self.launches, self.cost, self.fail_capture, self.fail_time = launches, cost, fail_capture, fail_time
        self.count: dict[str, int] = {}
        self.replayed: list[tuple[str, int]] = []   # (engine, launches) per replay, in order
        self.captured: dict[str, int] = {}          # engine -> launches captured
        self.eager: list[tuple[str, int]] = []      # (engine, launches) per eager timing, in order
        FakeTiming.made.append(self)

    @staticmethod
    def name(entry: dict) -> str:
        if entry.get("tile"):
            return "tile"
        cfg = entry["config"]
        return engine._label(cfg, "halves" if cfg.block_n == 128 else "")  # (on a 128x256 table: its halves)

    def context(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def sync(self) -> None:
        pass

    def _ran(self, fn: Any) -> list[str]:
        n0 = len(self.launches)
        fn()
        names = [self.name(e) for e in self.launches[n0:]]
        del self.launches[n0:]
        return names

    def _ms(self, names: list[str]) -> float:
        total = 0.0
        for nm in names:
            total += self.cost(nm, self.count.get(nm, 0))
            self.count[nm] = self.count.get(nm, 0) + 1
        return total

    def time(self, fn: Any) -> float:
        if self.fail_time:
            raise RuntimeError("the GPU fell over")
        names = self._ran(fn)
        self.eager.append((names[0], len(names)))
        return self._ms(names)

    def capture(self, fn: Any, iters: int) -> Any:
        names: list[str] = []
        for _ in range(iters):
            names += self._ran(fn)
        if names[0] == self.fail_capture:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captured[names[0]] = len(names)
        return lambda: names

    def timed(self, calls: list[Any]) -> list[float]:
        out = []
        for replay in calls:
            names = replay()
            self.replayed.append((names[0], len(names)))
            out.append(self._ms(names))
        return out


def _measuring_plan(fake_gluon: list, monkeypatch: pytest.MonkeyPatch, cost: Any, **timing_kw: Any) -> tuple:
    """An auto plan of a 128x256 table (candidates: tile, 128x256, the column halves) whose
    measurement runs the real ``_measure`` on a ``FakeTiming``."""
    monkeypatch.setenv(engine.ENGINE_ENV, "auto")
    monkeypatch.setattr(engine, "_measured", {})
    monkeypatch.setattr(engine, "cache_path", lambda: None)
    FakeTiming.made.clear()
    monkeypatch.setattr(engine, "_timing", lambda device: FakeTiming(fake_gluon, cost, **timing_kw))
    x = _call(m=1024, n=768)
    gp = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])
    gp.tile.launch = lambda descs, c, **kw: fake_gluon.append({"tile": True, "c": c, **kw})
    gp.tile.operands = lambda a, b, a2=None: ("descs", a, b, a2)
    return gp, x


NAMES = ["tile", "gluon 128x256x64 s3", "gluon pp128x128x64 s5 halves"]


def test_measure_replays_graphs_rotated_and_takes_medians(fake_gluon: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each candidate captured once (about GRAPH_MS of launches: 4 of 0.5 ms), the graphs
    replayed in rounds rotated by one, the first round untimed, the pick by medians per
    launch: the 128x256 config, fastest on 4 of 5 timed rounds and far slower on one (its
    mean would lose to the halves), on the op's words untouched; the report says graphs."""
    base = {"tile": 0.5, NAMES[1]: 0.45, NAMES[2]: 0.47}

    def cost(nm: str, nth: int) -> float:
        # launch 0 sizes the graph, 1-4 are the untimed round's replay, 5-8 the first timed
        # round's: there the 128x256 config runs 4x slower
        return base[nm] * (4.0 if nm == NAMES[1] and 5 <= nth < 9 else 1.0)

    gp, x = _measuring_plan(fake_gluon, monkeypatch, cost)
    ops = gp.operands(x["a"], x["b"], x["a2"])
    gp.launch(ops, x["c"], epoch=7, grid=100, rows=(512, 512))
    t, = FakeTiming.made
    assert t.captured == {nm: 4 for nm in NAMES}, t.captured            # 2.0 ms / 0.5 ms
    assert [nm for nm, _ in t.replayed] == [nm for rnd in engine.rotated_rounds(NAMES, engine.ROUNDS + 1)
                                            for nm in rnd]
    assert [nm for nm, _ in t.replayed][:6] == NAMES + NAMES[1:] + NAMES[:1]
    assert all(n == 4 for _, n in t.replayed) and len(t.replayed) == 3 * (engine.ROUNDS + 1)
    assert gp.engine == NAMES[1], gp.why
    assert gp.why.startswith("measured (graphs of 4, 4, 4 launches, 5 rounds) "), gp.why
    assert f"{NAMES[1]} 0.450, {NAMES[2]} 0.470, tile 0.500 ms" in gp.why, gp.why
    # the launch after the measurement is the op's, on its own words and C; none kept of the scratch
    got = fake_gluon[-1]
    assert got["flags"] is x["kw"]["flags"] and got["err"] is x["kw"]["err"] and got["c"] is x["c"]
    assert got["epoch"] == 7 and int(x["kw"]["flags"].abs().sum()) == 0
    assert all(k[1] == id(x["kw"]["flags"]) for k in gp._gplans), gp._gplans.keys()
    # (by the mean of its rounds, 0.72, the halves would win)
    # the untimed round is left out: a launch of 1 ms sizes a graph of 2, the warm round's
    # replay costs 1 ms a launch, the timed rounds' 0.5
    times, iters = engine.graph_times({"tile": lambda: fake_gluon.append({"tile": True})},
                                      FakeTiming(fake_gluon, lambda nm, k: 1.0 if k < 3 else 0.5))
    assert iters == {"tile": 2} and times == {"tile": [0.5] * engine.ROUNDS}, (iters, times)
    # a warm-up of about 9 ms: rounds of 2 ms (2 launches of the 1 ms the sizing launch took),
    # so 5 untimed; the launches cost 1 ms up to the 6th replay's (the sizing launch and the
    # 5 untimed replays' 10), then 0.5
    t = FakeTiming(fake_gluon, lambda nm, k: 1.0 if k < 11 else 0.5)
    times, iters = engine.graph_times({"tile": lambda: fake_gluon.append({"tile": True})}, t, warm_ms=9.0)
    assert len(t.replayed) == 5 + engine.ROUNDS and times == {"tile": [0.5] * engine.ROUNDS}, (t.replayed, times)
    with pytest.raises(ValueError, match="warm-up"):
        engine.graph_times({"tile": lambda: fake_gluon.append({"tile": True})}, t, warm_ms=float("nan"))
    # (a pick measured with a warm-up is kept under a key of its own; without one, the key as before)
    from overlap.kernels import autotune

    monkeypatch.setattr(autotune, "device_env", lambda device: {"gpu": "test"})
    assert "warm_ms" not in engine._env("cpu")
    monkeypatch.setattr(engine, "WARM_MS", 150.0)
    assert engine._env("cpu")["warm_ms"] == 150.0
    assert engine.pick({"tile": 1.0, "g": 0.995}) == "tile" and engine.pick({"tile": 1.0, "g": 0.98}) == "g"


def test_measure_falls_back_to_eager_rounds_when_a_capture_fails(fake_gluon: list,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate whose capture fails: every candidate timed in eager rounds (rotated, 3
    launches each), the why saying so, nothing of the scratch words kept."""
    base = {"tile": 0.5, NAMES[1]: 0.6, NAMES[2]: 0.4}
    gp, x = _measuring_plan(fake_gluon, monkeypatch, lambda nm, k: base[nm], fail_capture=NAMES[2])
    gp.launch(gp.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=1, grid=100, rows=(512, 512))
    t, = FakeTiming.made
    assert not t.replayed and NAMES[2] not in t.captured
    eager = t.eager[3:]  # after the three launches that size the graphs
    assert eager == [(nm, engine.EAGER_REPS) for rnd in engine.rotated_rounds(NAMES, engine.EAGER_ROUNDS)
                     for nm in rnd], eager
    assert gp.engine == NAMES[2] and "eager, a capture failed (RuntimeError: operation not permitted" in gp.why
    assert all(k[1] == id(x["kw"]["flags"]) for k in gp._gplans)


def test_measure_reads_nothing_from_the_callers_stream(fake_gluon: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first launch measures, and the caller's stream may by then hold a wait released
    only by work not yet queued (a gate, a stream wait): with CUDA's lazy loading a read, or
    a kernel's first launch, queued behind it blocks the host for good. So the op's table is
    read to the host when the plan is made, and the scratch words and C made on the
    measurement's own stream (inside its context)."""
    import contextlib

    gp, x = _measuring_plan(fake_gluon, monkeypatch, lambda nm, k: 1.0)
    depth = [0]

    @contextlib.contextmanager
    def own_stream() -> Any:
        depth[0] += 1
        try:
            yield
        finally:
            depth[0] -= 1

    monkeypatch.setattr(FakeTiming, "context", lambda self: own_stream())
    outside: list[str] = []
    for name in ("zeros_like", "empty_like", "zeros"):
        real = getattr(torch, name)

        def made(*a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            if not depth[0]:
                outside.append(_name)
            return _real(*a, **k)
        monkeypatch.setattr(torch, name, made)

    def no_read(self: Any, *a: Any, **k: Any) -> Any:
        raise AssertionError("a tensor read to the host at the launch")
    monkeypatch.setattr(torch.Tensor, "cpu", no_read)
    gp.launch(gp.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=1, grid=100, rows=(512, 512))
    assert gp.decided and gp.why.startswith("measured (graphs"), gp.why
    assert not outside, outside


def test_a_failed_measurement_leaves_no_state_and_none_runs_in_a_capture(fake_gluon: list,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The timing fails: the launch raises, the plan stays undecided with no scratch plans
    and no pick kept, and its next launch measures again. Inside a capture nothing is
    timed (no timing made; ``_measure`` itself refuses)."""
    gp, x = _measuring_plan(fake_gluon, monkeypatch, lambda nm, k: 1.0, fail_time=True)
    ops = gp.operands(x["a"], x["b"], x["a2"])
    with pytest.raises(RuntimeError, match="fell over"):
        gp.launch(ops, x["c"], epoch=1, grid=100, rows=(512, 512))
    assert not gp.decided and gp.engine == "undecided" and not gp._gplans and not engine._measured
    FakeTiming.made[0].fail_time = False
    monkeypatch.setattr(engine, "_timing", lambda device: FakeTiming.made[0])
    gp.launch(ops, x["c"], epoch=1, grid=100, rows=(512, 512))
    assert gp.decided and gp.why.startswith("measured (graphs") and len(engine._measured) == 1
    # inside a capture: the tile GEMM, no timing made
    gp2, x = _measuring_plan(fake_gluon, monkeypatch, lambda nm, k: 1.0)
    monkeypatch.setattr(engine, "_capturing", lambda: True)
    gp2.launch(gp2.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=1, grid=90, rows=(512, 512))
    assert gp2.engine == "tile" and not FakeTiming.made and fake_gluon[-1].get("tile")
    with pytest.raises(RuntimeError, match="capture"):
        gp2._measure(gp2.operands(x["a"], x["b"], x["a2"]), x["c"], 90, (512, 512))
    assert not FakeTiming.made


def test_a_pick_measured_eagerly_is_not_kept_on_disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """A pick measured by eager rounds (a capture failed) is for this process only: the
    file's key says how its picks were measured (``TIMING``), and that is not how."""
    import os

    monkeypatch.setenv("OVERLAP_GEMM_CACHE", str(tmp_path / "gemm.json"))
    monkeypatch.setattr(engine, "_env", lambda device: {"gpu": "test", "sms": 132})
    monkeypatch.setattr(engine, "_measured", {})
    monkeypatch.setattr(engine, "_disk", {})
    engine._keep(("p", 1), "tile", "measured (eager, a capture failed (RuntimeError: x)) tile 1.000 ms", "cpu")
    assert engine._measured[("p", 1)][0] == "tile" and not os.path.exists(engine.cache_path())
    engine._keep(("p", 2), "tile", "measured (graphs of 5 launches, 5 rounds) tile 1.000 ms", "cpu")
    assert os.path.exists(engine.cache_path())


def _producer(n: int = 768, cfg: GemmConfig = CFG) -> dict:
    """A producer op's kind of GEMM: tiles that post per row chunk (flags 0, 1), wait on none."""
    g = torch.Generator().manual_seed(n)
    a, w = torch.randn(1024, 256, generator=g).half(), torch.randn(n, 256, generator=g).half()
    segs = [Segment(a_src=0, a_row=0, c_row=0, rows=512, post_base=0),
            Segment(a_src=0, a_row=512, c_row=512, rows=512, post_base=4)]
    table = torch.tensor(build_tile_table(segs, n, cfg.block_m, cfg.block_n, 8), dtype=torch.int32)
    kw = dict(flags=torch.zeros(16, dtype=torch.int32), err=torch.zeros(8, dtype=torch.int32),
              counter=torch.zeros(4, dtype=torch.int32), timeout_ns=1, rank=0, config=cfg, post=True)
    return dict(a=a, b=w.t(), c=torch.empty(1024, n, dtype=torch.float16), table=table, kw=kw)


def test_posts_run_on_the_plain_kernel_and_measure_on_scratch_flags(fake_gluon: list,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A GEMM whose tiles post (a producer op's) may run, with ``OVERLAP_GLUON_EXPERIMENTAL``
    set or not, on the Gluon GEMM's plain kernel of its tile only (no ping-pong, halves or
    retiled table: a post counts tiles); forced, it
    launches with the op's flags, no error word and ``post``; measured, every candidate's
    posts go to scratch flags, never the op's; posts from tiles that also wait, or on a tile
    only ping-pong has, stay on the tile GEMM."""
    x = _producer()
    for setting in ("", "1"):
        monkeypatch.setenv(engine.EXPERIMENTAL_ENV, setting)
        assert engine.misfit(x["b"], **x["kw"]) is None
    assert "posts from tiles that wait" in engine.misfit(x["b"], **{**x["kw"], "wait": True})
    assert "posts on a 64x256 tile" in engine.misfit(x["b"], **{**x["kw"], "config": GemmConfig(block_m=64,
                                                                                                 block_n=256)})
    monkeypatch.setenv(engine.ENGINE_ENV, "gluon")
    for cfg, want in ((CFG, "gluon 128x256x64 s3"), (GemmConfig(block_m=128, block_n=128), "gluon 128x128x64 s4")):
        x = _producer(cfg=cfg)
        gp = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])
        assert isinstance(gp, engine.EnginePlan) and all(g.kind == "plain" for g in gp.configs), gp.configs
        gp.launch(gp.operands(x["a"], x["b"]), x["c"], epoch=1, grid=100)
        got = fake_gluon[-1]
        assert got["post"] is True and got["flags"] is x["kw"]["flags"] and got["err"] is None
        assert torch.equal(got["table"], x["table"]) and gp.engine == want, gp.engine
    # measured: the candidates' posts into scratch flags
    monkeypatch.setenv(engine.ENGINE_ENV, "auto")
    monkeypatch.setattr(engine, "_measured", {})
    monkeypatch.setattr(engine, "cache_path", lambda: None)
    FakeTiming.made.clear()
    monkeypatch.setattr(engine, "_timing", lambda device: FakeTiming(fake_gluon, lambda nm, k: 1.0 if nm == "tile"
                                                                     else 0.5))
    x = _producer()
    gp = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])
    seen: list = []  # the flags of each tile GEMM launch (the measurement's copy of the plan, then the plan)

    def tile_launch(self: Any, descs: Any, c: Any, **kw: Any) -> None:
        seen.append(self.flags)
        fake_gluon.append({"tile": True, "c": c, **kw})

    monkeypatch.setattr(TileGemmPlan, "launch", tile_launch)
    monkeypatch.setattr(TileGemmPlan, "operands", lambda self, a, b, a2=None: ("descs", a, b, a2))
    n0 = len(fake_gluon)
    gp.launch(gp.operands(x["a"], x["b"]), x["c"], epoch=1, grid=100)
    measured = fake_gluon[n0:-1]
    assert measured and all(e.get("flags") is not x["kw"]["flags"] for e in measured if not e.get("tile"))
    assert seen and all(f is not x["kw"]["flags"] for f in seen)
    assert gp.engine == "gluon 128x256x64 s3" and fake_gluon[-1]["flags"] is x["kw"]["flags"]


def test_a_plan_may_follow_another_plans_pick(fake_gluon: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """``EnginePlan.follow``: a plan of the same GEMM run without waits (the chain's
    stream-synced fc2) takes the waiting plan's decided engine, unmeasured, on the same
    derived table; not before that plan decided, not for another GEMM, not once decided."""
    monkeypatch.setenv(engine.ENGINE_ENV, "auto")
    monkeypatch.setattr(engine, "_measured", {})
    cands = engine.gluon_configs(CFG)
    measured: list[str] = []

    def measure(self: Any, ops: Any, c: Any, grid: int, rows: Any) -> tuple:
        measured.append("waits" if self.wait else "alone")
        return cands[1], "measured"

    monkeypatch.setattr(engine.EnginePlan, "_measure", measure)
    x = _call(m=1024, n=640)
    lead = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])
    alone_kw = {**x["kw"], "wait": False, "flags": None, "err": None}
    follower = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **alone_kw)
    assert not follower.follow(lead)  # the lead has not decided
    lead.launch(lead.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=1, grid=77, rows=(512, 512))
    other = _call(m=1024, n=768)
    stranger = engine.engine_plan(other["a"], other["b"], other["c"], other["table"],
                                  **{**other["kw"], "wait": False, "flags": None, "err": None})
    assert not stranger.follow(lead) and not stranger.decided
    assert follower.follow(lead) and not follower.follow(lead)  # (once decided, no more)
    follower.launch(follower.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=0, grid=132, rows=(512, 512))
    got = fake_gluon[-1]
    assert measured == ["waits"] and follower.engine == lead.engine == "gluon pp128x128x64 s5 halves"
    assert got["table"] is fake_gluon[0]["table"] and got["flags"] is None and got["config"] == cands[1]
    assert follower.why.startswith("as the same GEMM's other plan: measured")
    kinds = {k[4]: v[0] for k, v in _engines().items()}
    assert kinds == {"waits": lead.engine, "alone": lead.engine}, kinds
    # not a lead decided inside a capture (the tile GEMM, unmeasured), nor across forced and not
    monkeypatch.setattr(engine, "_measured", {})
    monkeypatch.setattr(engine, "_capturing", lambda: True)
    lead = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])
    lead.tile.launch = lambda descs, c, **kw: fake_gluon.append({"tile": True, **kw})
    lead.tile.operands = lambda a, b, a2=None: ("descs", a, b, a2)
    lead.launch(lead.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=1, grid=77, rows=(512, 512))
    assert lead.decided and lead.engine == "tile" and not lead.followable
    follower = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **alone_kw)
    assert not follower.follow(lead)
    monkeypatch.setattr(engine, "_capturing", lambda: False)
    monkeypatch.setenv(engine.ENGINE_ENV, "gluon")
    forced = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **alone_kw)
    lead = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **{**x["kw"], "counter": torch.zeros(4, dtype=torch.int32)})
    monkeypatch.setenv(engine.ENGINE_ENV, "auto")
    auto_lead = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])
    auto_lead.launch(auto_lead.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=1, grid=77, rows=(512, 512))
    assert auto_lead.followable and not forced.follow(auto_lead)  # a forced plan does not follow a measured one
    lead.launch(lead.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=1, grid=77, rows=(512, 512))
    assert forced.follow(lead) and forced.engine == "gluon 128x256x64 s3"


def test_tile_only_whatever_the_setting(fake_gluon: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tile_only="why"`` (a reduce kernel sharing the GEMM's SMs): the tile GEMM's plan,
    forced Gluon or not, the reason in the report."""
    for mode in ("gluon", "auto"):
        monkeypatch.setenv(engine.ENGINE_ENV, mode)
        observe.reset_report()
        x = _call()
        gp = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], tile_only="beside a reduce kernel", **x["kw"])
        assert type(gp) is TileGemmPlan
        assert list(_engines().values()) == [("tile", "beside a reduce kernel")]
        assert isinstance(engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"]), engine.EnginePlan)


def test_split_candidates_only_where_asked_and_split(fake_gluon: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """The split-tail configs are candidates with ``OVERLAP_GLUON_EXPERIMENTAL=1`` only (in the
    kept picks' key then), never swapped for ``ahead`` ones, named "split"; a launch times one
    only where its grid splits the table."""
    from overlap.kernels import autotune

    monkeypatch.setattr(autotune, "device_env", lambda device: {"gpu": "test"})
    monkeypatch.delenv(engine.EXPERIMENTAL_ENV, raising=False)
    assert not any(c.split_tail for c in engine.gluon_configs(CFG))
    monkeypatch.setenv(engine.EXPERIMENTAL_ENV, "1")
    assert engine._env("cpu")["experimental"]["split"]["128x256"] == ["gluon 128x256x64 s3 split"]
    for tile in ((128, 256), (256, 128), (128, 128)):
        got = [c for c in engine.gluon_configs(GemmConfig(block_m=tile[0], block_n=tile[1])) if c.split_tail]
        assert [(c.block_m, c.block_n) for c in got] == [tile], tile
    monkeypatch.setenv(engine.AHEAD_ENV, "1")
    cands = engine.gluon_configs(CFG)
    assert [engine._label(c) for c in cands if c.split_tail] == ["gluon 128x256x64 s3 split"]
    assert all(c.ahead for c in cands if not c.split_tail)
    monkeypatch.delenv(engine.AHEAD_ENV)
    monkeypatch.setenv(engine.ENGINE_ENV, "auto")
    x = _call(m=2048, n=1024)  # (a table of 2 x 1024 rows of 128x256 tiles: 16 x 4)
    gp = engine.engine_plan(x["a"], x["b"], x["c"], x["table"], **x["kw"])
    n_tiles = x["table"].shape[0]
    assert n_tiles == 64
    # 64 tiles on 60 programs: a last wave of 4, split; on 64 or 40 (24 of 40: over half) none
    for grid, k, split in ((60, 1024, True), (64, 1024, False), (40, 1024, False), (60, 128, False)):
        timed = gp.timed_configs(grid, k)
        assert any(c.split_tail for c in timed) == split, (grid, k)
        assert [c for c in timed if not c.split_tail] == [c for c in gp.configs if not c.split_tail]


def test_c_differs_finds_wrong_and_unwritten_elements_not_rounding() -> None:
    """The check of a candidate's C: equal, a rounding apart (each element one bf16 ulp off,
    a sum near zero off by a little of C's scale) and both NaN where neither wrote: none
    differs. One element off by 3 (its value -8.5: a tolerance of about 0.17), one left NaN,
    or one written where the tile GEMM left NaN: named with its row, column and values."""
    g = torch.Generator().manual_seed(3)
    ref = (torch.randn(300, 96, generator=g) * 40).bfloat16()
    ref[-20:] = float("nan")  # (rows the launch's row cut left unwritten)
    assert float(ref[17, 3]) == -8.5
    assert engine.c_differs(ref.clone(), ref) is None
    ulp = ref.float() * (1 + 2.0 ** -7)  # (bf16 keeps 8 bits: about one ulp up)
    assert engine.c_differs(ulp.bfloat16(), ref) is None
    near = ref.clone()
    near[5, 7] = 0.0
    near2 = near.clone()
    near2[5, 7] = 0.02  # (a sum that cancels: off by 0.05% of C's rms of about 40)
    assert engine.c_differs(near2, near) is None
    for row, col, value in ((17, 3, float(ref[17, 3]) + 3.0), (250, 95, float("nan")), (290, 0, 1.0)):
        bad = ref.clone()
        bad[row, col] = value
        got = engine.c_differs(bad, ref)
        assert got is not None and got.startswith(f"1 of {300 * 96} elements differ (the first at row {row}, "
                                                  f"column {col}: "), got
    assert "shape" in engine.c_differs(ref[:10], ref)
    monkeypatch_chunk = engine._CHECK_CHUNK
    try:  # (read in chunks of rows: the first element named is the first row's)
        engine._CHECK_CHUNK = 96 * 7
        bad = ref.clone()
        bad[100, 1] = bad[200, 2] = 1e4
        assert engine.c_differs(bad, ref).startswith("2 of 28800 elements differ (the first at row 100, column 1")
    finally:
        engine._CHECK_CHUNK = monkeypatch_chunk


def test_a_config_whose_c_differs_is_no_candidate(fake_gluon: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each launch of the measurement writes C (the tile GEMM: the product; the 128x256 config:
    the product with one tile wrong; the halves: the product one ulp off): the 128x256
    config, fastest, is not picked and not timed; the halves are; a warning names it, once
    per problem, and the report's why says what differed. Then the halves leave one tile
    unwritten: C is NaN there (prefilled before each candidate's launch), so they are no
    candidate either, though the launch before theirs left the right values there."""
    base = {"tile": 0.5, NAMES[1]: 0.3, NAMES[2]: 0.45}
    gp, x = _measuring_plan(fake_gluon, monkeypatch, lambda nm, k: base[nm])
    want = (x["a"].float().repeat(2, 1) @ x["b"].float())

    def tile_launch(descs: Any, c: Any, **kw: Any) -> None:
        fake_gluon.append({"tile": True, "c": c, **kw})
        c.copy_(want)
    gp.tile.launch = tile_launch

    class WritingPlan:
        def __init__(self, a: Any, b: Any, c: Any, table: Any, **kw: Any) -> None:
            self.made = dict(table=table, **kw)

        def launch(self, a: Any, b: Any, c: Any, **kw: Any) -> None:
            fake_gluon.append(dict(self.made, a=a, b=b, c=c, **kw))
            if self.made["config"].block_n == 256:
                c.copy_(want)
                c[128:256, 256:512] *= 0.5  # (one tile with half its K)
            else:
                c.copy_(want.half().float() * (1 + 2.0 ** -11))
    monkeypatch.setattr(engine._gg, "GluonGemmPlan", WritingPlan)
    with pytest.warns(RuntimeWarning, match="gluon 128x256x64 s3 computed another C than the tile GEMM"):
        gp.launch(gp.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=1, grid=100, rows=(1024, 1024))
    t, = FakeTiming.made
    assert gp.engine == NAMES[2], gp.why
    assert NAMES[1] not in t.captured and set(t.captured) == {"tile", NAMES[2]}
    import re

    # (the tile's elements near zero are within the tolerance halved too)
    got = re.search(f"{NAMES[1]} failed \\(RuntimeError: its C is not the tile GEMM's: ([0-9]+) of {1024 * 768} "
                    "elements differ \\(the first at row 128, column 256: ", gp.why)
    assert got is not None and 0.98 * 128 * 256 < int(got.group(1)) <= 128 * 256, gp.why
    # another plan of the problem measures again (no kept pick here): no second warning
    import warnings

    gp2, x2 = _measuring_plan(fake_gluon, monkeypatch, lambda nm, k: base[nm])
    gp2.tile.launch = tile_launch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gp2.launch(gp2.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=1, grid=100, rows=(1024, 1024))
    assert gp2.engine == NAMES[2]
    # the halves, fastest now, leave one tile unwritten (it keeps what C held before: NaN,
    # where the 128x256 config's launch before it wrote the right values)
    base = {"tile": 0.5, NAMES[1]: 0.45, NAMES[2]: 0.3}

    class Unwritten(WritingPlan):
        def launch(self, a: Any, b: Any, c: Any, **kw: Any) -> None:
            fake_gluon.append(dict(self.made, a=a, b=b, c=c, **kw))
            keep = c[:128, :128].clone()
            c.copy_(want)
            if self.made["config"].block_n == 128:
                c[:128, :128] = keep
    monkeypatch.setattr(engine._gg, "GluonGemmPlan", Unwritten)
    gp3, x3 = _measuring_plan(fake_gluon, monkeypatch, lambda nm, k: base[nm])
    gp3.tile.launch = tile_launch
    with pytest.warns(RuntimeWarning, match="halves computed another C"):
        gp3.launch(gp3.operands(x["a"], x["b"], x["a2"]), x["c"], epoch=1, grid=100, rows=(1024, 1024))
    assert gp3.engine == NAMES[1], gp3.why
    assert f"{NAMES[2]} failed (RuntimeError: its C is not the tile GEMM's: {128 * 128} of " in gp3.why, gp3.why
    assert "(the first at row 0, column 0: nan, the tile GEMM's " in gp3.why, gp3.why
