"""overlap.ops._calls without a GPU: a call plan's text, the per-call checks it leaves,
and the short path declining what only the full path may take (the ops' call plans
themselves run on CUDA: tests/gpu/planned_check.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from overlap.ops import _calls
from overlap.ops import all_gather as ag
from overlap.ops import all_reduce as ar
from overlap.ops import boundary as bd
from overlap.ops import matmul_reduce as mr


def test_call_plan_prints_what_it_decided() -> None:
    cp = _calls.CallPlan("all_gather_matmul", ("M/R", "K", "N"), (256, 1024, 1024), 0, (), (512, 1024, 1024),
                         "nccl x2", "config given", None, "nccl")
    assert repr(cp) == ("CallPlan(all_gather_matmul 512x1024x1024 on nccl x2 (config given); ranks agree on "
                        "M/R=256, K=1024, N=1024)")


def test_aligned_and_grad_and_tensor_key() -> None:
    buf = torch.zeros(64, dtype=torch.float16)
    assert _calls.aligned(buf, None, buf[8:])          # 16 bytes on
    assert not _calls.aligned(buf, buf[1:])            # 2 bytes on
    w = torch.zeros(4, 4, requires_grad=True)
    assert _calls.grad_refused(buf, w) and not _calls.grad_refused(buf, None)
    with torch.no_grad():
        assert not _calls.grad_refused(w)
    t = torch.zeros(3, 5).t()
    assert _calls.tensor_key(t) == (torch.Size([5, 3]), (1, 5), torch.float32, torch.device("cpu"))
    assert _calls.tensor_key(None) is None


def test_short_path_declines_cpu_inputs() -> None:
    """No CUDA, no plan: every op's short path hands the call to the full path."""
    a, b = torch.zeros(8, 16), torch.zeros(16, 8)
    assert ag._planned(a, b, None, False, None) is None
    assert mr._planned("matmul_all_reduce", a, b, None, None, None) is None
    assert ar._planned(a, b, None, None, None, None) is None
    assert bd._planned(a, b, torch.zeros(8, 8), None, None, None, None) is None
    assert ag._planned("not a tensor", b, None, False, None) is None


def test_plans_kept_and_found_by_key_unhashable_never() -> None:
    from overlap.ops._runtime import Runtime

    rt = Runtime.__new__(Runtime)  # only its caches are used
    rt._caches = {}
    cp = _calls.CallPlan("op", (), (), None, (), (1, 2, 3), "nccl x1", "default config", None, "nccl")
    made = _calls.stats["made"]
    _calls.keep(rt, ("k", 1), cp)
    assert _calls.find(rt, "op", ("k", 1)) is cp and _calls.find(rt, "op", ("k", 2)) is None
    _calls.keep(rt, ("k", [1]), cp)  # a config holding a list: not kept, not found, no error
    assert _calls.find(rt, "op", ("k", [1])) is None and _calls.stats["made"] == made + 1
    assert len(_calls.call_plans(rt, "op")) == 1


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the short paths' first look."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def test_short_path_declines_wrong_dims(monkeypatch) -> None:  # noqa: ANN001
    """An input of the wrong number of dims at a group whose runtime exists goes to the full
    path (whose checks name the op and what is wrong), never fails inside the short path."""
    from overlap.ops._runtime import Runtime

    rt = Runtime.__new__(Runtime)
    rt._caches = {}
    for mod in (ag, ar, mr, bd):
        monkeypatch.setattr(mod, "get_runtime_if_made", lambda *a: rt)
        monkeypatch.setattr(mod, "resolve_group", lambda g: g)
    two = torch.Tensor._make_subclass(_OnCuda, torch.zeros(8, 8))
    for bad in (torch.Tensor._make_subclass(_OnCuda, torch.zeros(8)),
                torch.Tensor._make_subclass(_OnCuda, torch.zeros(()))):
        for a, b in ((bad, two), (two, bad)):
            assert ag._planned(a, b, None, False, None) is None
            assert ar._planned(a, b, None, None, None, None) is None
            assert mr._planned("matmul_all_reduce", a, b, None, None, None) is None
            assert bd._planned(a, b, two, None, None, None, None) is None
        assert bd._planned(two, two, bad, None, None, None, None) is None


def test_gemm_bind_follows_the_engine_pick() -> None:
    """A bound body binds a ``TileGemmPlan``'s launch, and an engine plan's through its own
    ``bind``: nothing before its pick, the tile plan's bound launch once it has picked the
    tile GEMM, the Gluon plan's once it has picked the Gluon GEMM (what its launch runs), and
    nothing for what its launch refuses. Another object whose ``bind`` would be a tile
    plan's (an engine plan's unknown attributes fall through to its tile plan's) is not
    bound."""
    from overlap.kernels.engine import EnginePlan
    from overlap.kernels.tile_gemm import TileGemmPlan

    tile = TileGemmPlan.__new__(TileGemmPlan)
    assert _calls.gemm_bind(tile).__func__ is TileGemmPlan.bind

    class Fallthrough:  # an object whose attributes are its tile plan's
        def __getattr__(self, name):  # noqa: ANN001, ANN204
            return getattr(tile, name)

    assert getattr(Fallthrough(), "bind", None) is not None and _calls.gemm_bind(Fallthrough()) is None
    calls: list = []
    tile.bind = lambda *a, **kw: calls.append(("tile", a, kw)) or "tile-bound"  # type: ignore[method-assign]
    gplan = SimpleNamespace(b_kn=True, bind=lambda *a, **kw: calls.append(("gluon", a, kw)) or "gluon-bound")
    flags, err, counter = object(), object(), object()

    def engine(decided: bool, gluon: Any) -> EnginePlan:
        e = EnginePlan.__new__(EnginePlan)
        e.__dict__.update(tile=tile, decided=decided, gluon=gluon, clip=False, flags=flags, err=err,
                          counter=counter, b_kn=True, _gplans={("cfg", id(flags), id(err), id(counter)): gplan})
        return e

    a, b, c = object(), object(), object()
    assert _calls.gemm_bind(engine(False, None))(a, b, c, epoch=1, grid=4) is None  # not picked yet
    assert _calls.gemm_bind(engine(True, None))(a, b, c, epoch=1, grid=4) == "tile-bound"
    assert _calls.gemm_bind(engine(True, "cfg"))(a, b, c, a2=a, epoch=1, grid=4) == "gluon-bound"
    assert [x[0] for x in calls] == ["tile", "gluon"] and calls[1][1] == (a, b, c)
    assert calls[1][2] == dict(a2=a, epoch=1, grid=4, rows=None)
    picked = engine(True, "cfg")
    assert picked.bind(a, b, c, epoch=1, grid=4, rows=(1, 2)) is None  # rows without the plan's clip
    assert picked.bind(a, b, c, epoch=1, grid=4, sig=3) is None  # what its launch refuses
    picked.__dict__["_gplans"] = {}
    assert picked.bind(a, b, c, epoch=1, grid=4) is None  # its Gluon plan not launched yet
    gplan.b_kn = False
    assert engine(True, "cfg").bind(a, b, c, epoch=1, grid=4) is None  # B laid out otherwise
    assert len(calls) == 2


def test_index_follows_what_may_change_a_decision(monkeypatch) -> None:  # noqa: ANN001
    """``all_gather_matmul``'s short path through the call plans' index (``_calls.index``):
    a signature seen before skips the full lookup (no runtime lookup), yet a tuned pick
    stored after its plan was made, ``clear_call_plans()``, another ``OVERLAP_TRANSPORT``
    and another config object each send the next call through the full lookup, which then
    decides as before; every call hands on its own tensors and checks their alignment."""
    from overlap.ops import OverlapConfig
    from overlap.ops._runtime import Runtime, _runtimes

    rt = Runtime.__new__(Runtime)
    rt._caches = {}
    rt.transport = lambda cfg: "p2p"  # the plan's transport: no bound body is made
    looked: list = []
    monkeypatch.setattr(ag, "get_runtime_if_made", lambda g, d: looked.append(g) or rt)
    monkeypatch.setattr(ag, "resolve_group", lambda g: g)
    monkeypatch.setattr(ag, "run_planned", lambda rt_, cp, *args: (cp, args))
    monkeypatch.delenv("OVERLAP_TRANSPORT", raising=False)
    group = object()
    gen = torch.Generator().manual_seed(3)

    def new(*shape: int) -> torch.Tensor:
        return torch.Tensor._make_subclass(_OnCuda, torch.randn(*shape, generator=gen))

    a, b = new(8, 16), new(16, 8)
    plan = {}
    for name, cfg, tuned in (("default", OverlapConfig(), None), ("tuned", OverlapConfig(chunks=3), True),
                             ("given", OverlapConfig(chunks=2), None)):
        plan[name] = _calls.CallPlan("all_gather_matmul", (), (), None, (), (16, 8, 16), "p2p", name, cfg, "p2p")
        _calls.keep(rt, ag._call_key(a, b, False, cfg, "p2p", name == "given", tuned), plan[name])

    def call(config=None):  # noqa: ANN001, ANN202
        a, b = new(8, 16), new(16, 8)  # new tensors every call
        out = ag._planned(a, b, group, False, config)
        if out is not None:
            assert out[1][5] is a and out[1][6] is b, "a previous call's tensors"
            return out[0]
        return None

    assert call() is plan["default"] and len(looked) == 1
    assert call() is plan["default"] and call() is plan["default"] and len(looked) == 1  # the index
    unaligned = torch.Tensor._make_subclass(_OnCuda, torch.zeros(8 * 16 + 1)[1:].view(8, 16))
    assert ag._planned(unaligned, new(16, 8), group, False, None) is None and len(looked) == 1
    ag._tuned(rt)[(8, 8, 16, torch.float32)] = plan["tuned"].config  # a tuner stores a pick
    assert call() is plan["tuned"] and len(looked) == 2
    assert call() is plan["tuned"] and len(looked) == 2
    monkeypatch.setenv("OVERLAP_TRANSPORT", "p2p")
    assert call() is plan["tuned"] and len(looked) == 3
    given = plan["given"].config
    assert call(given) is plan["given"] and len(looked) == 4
    assert call(given) is plan["given"] and len(looked) == 4
    assert call(OverlapConfig(chunks=2)) is plan["given"] and len(looked) == 5  # equal, not the same object
    monkeypatch.setitem(_runtimes, ("test-index", None), rt)  # what ``clear_call_plans`` walks
    _calls.clear_call_plans()
    assert call() is None and call(given) is None and len(looked) == 7


class _NotReady:
    def ready(self) -> bool:
        return False


def test_index_of_every_op(monkeypatch) -> None:  # noqa: ANN001
    """The other ops' short paths through the index: a call seen before skips the runtime
    lookup and runs from its plan with its own tensors (new every call), and a tuned pick
    stored after the plan was made sends the next call to the plan of the pick."""
    from overlap.ops import Norm, OverlapConfig
    from overlap.ops._runtime import Runtime

    gen = torch.Generator().manual_seed(5)

    def new(*shape: int) -> torch.Tensor:
        return torch.Tensor._make_subclass(_OnCuda, torch.randn(*shape, generator=gen))

    m, k, n = 8, 16, 8
    ops = {"ar": "all_reduce_matmul", "mr": "matmul_all_reduce", "bd": bd.OP}
    cases = {
        "ar": (ar, lambda t, cfg: ar._call_key(t[0], t[1], t[2], t[3], cfg, "nccl", False, cfg if cfg.chunks == 3 else None),
               lambda t, c: ar._planned(t[0], t[1], c, t[2], t[3], None),
               lambda t: ar._tune_key(t[0], n, t[2], t[3]),
               lambda: (new(m, k), new(k, n), new(m, k), Norm("layernorm", new(k), new(k)))),
        "mr": (mr, lambda t, cfg: mr._call_key(t[0], t[1], None, cfg, "nccl", False, cfg if cfg.chunks == 3 else None),
               lambda t, c: mr._planned("matmul_all_reduce", t[0], t[1], c, None, None),
               lambda t: ("matmul_all_reduce", m, n, k, torch.float32, False),
               lambda: (new(m, k), new(k, n))),
        "bd": (bd, lambda t, cfg: bd._call_key(t[0], t[1], t[2], None, None, cfg, False, cfg if cfg.chunks == 3 else None),
               lambda t, c: bd._planned(t[0], t[1], t[2], c, None, None, None),
               lambda t: bd._tune_key(t[0], t[1], t[2], None, None),
               lambda: (new(m, k), new(k, n), new(n, k))),
    }
    for name, (mod, call_key, planned, tune_key, inputs) in cases.items():
        rt = Runtime.__new__(Runtime)
        rt._caches = {}
        rt.transport = lambda cfg: "nccl"
        looked: list = []
        monkeypatch.setattr(mod, "get_runtime_if_made", lambda g, d, looked=looked, rt=rt: looked.append(g) or rt)
        monkeypatch.setattr(mod, "resolve_group", lambda g: g)
        monkeypatch.setattr(mod, "run_planned", lambda rt_, cp, *args: (cp, args))
        monkeypatch.setattr(mod, "_Bound", lambda *a, **kw: _NotReady())
        monkeypatch.delenv("OVERLAP_TRANSPORT", raising=False)
        group = object()
        t0 = inputs()
        plans = {}
        for why, cfg in (("default", OverlapConfig()), ("tuned", OverlapConfig(chunks=3))):
            plans[why] = _calls.CallPlan(ops[name], (), (), None, (), (m, n, k), "nccl", why, cfg, "nccl")
            _calls.keep(rt, call_key(t0, cfg), plans[why])

        def call() -> object:
            t = inputs()  # new tensors every call
            out = planned(t, group)
            assert out is not None, name
            assert any(x is t[0] for x in out[1]) and any(x is t[1] for x in out[1]), (name, "stale tensors")
            return out[0]

        assert call() is plans["default"] and len(looked) == 1, name
        assert call() is plans["default"] and len(looked) == 1, name
        mod._tuned(rt)[tune_key(t0)] = plans["tuned"].config
        assert call() is plans["tuned"] and len(looked) == 2, name
        assert call() is plans["tuned"] and len(looked) == 2, name


class _NoStorage(torch.Tensor):
    def data_ptr(self) -> int:  # type: ignore[override]
        raise RuntimeError("Cannot access data pointer of Tensor that doesn't have storage")


def test_scan_reads_keys_and_pointers_or_sends_the_call_to_the_full_path() -> None:
    """``_calls.scan``: per tensor its key and pointer (None: key None, pointer 0); None for
    the full path where autograd would track the result, a pointer is unaligned, or a
    tensor has no storage (its pointer raises)."""
    a, b = torch.zeros(4, 8), torch.zeros(8, 2)
    keys, ptrs = _calls.scan(a, None, b)
    assert keys == (_calls.tensor_key(a), None, _calls.tensor_key(b)) and ptrs == (a.data_ptr(), 0, b.data_ptr())
    assert _calls.scan(a, torch.zeros(9)[1:]) is None  # 4 bytes past an aligned start
    g = torch.zeros(4, requires_grad=True)
    assert _calls.scan(a, g) is None
    with torch.no_grad():
        assert _calls.scan(a, g) is not None
    assert _calls.scan(a, torch.Tensor._make_subclass(_NoStorage, torch.zeros(4))) is None


def test_a_plan_graph_is_keyed_on_every_input_it_reads_in_place(monkeypatch) -> None:  # noqa: ANN001
    """The ops with a norm give their plan graph the pointers of its fixed inputs (read in
    their one pass over the tensors, ``_calls.scan``): every input not copied in per call
    (the weights, the norm's weight and bias) is among them, so a graph is never replayed
    with another weight than it captured; the activations (copied in) are not."""
    from overlap.ops import Norm, OverlapConfig, _graphs
    from overlap.ops._runtime import Runtime

    def new(*shape: int) -> torch.Tensor:
        return torch.Tensor._make_subclass(_OnCuda, torch.randn(*shape))

    m, k, n = 8, 16, 8
    seen: list = []
    monkeypatch.setattr(_graphs, "replay_or_capture", lambda rt, cp, body, args, ptrs=None: seen.append(
        (args, ptrs)) or "replayed")
    cases = {
        "ar": (ar, "all_reduce_matmul",
               lambda t, cfg: ar._call_key(t[0], t[1], t[2], t[3], cfg, "nccl", False, None),
               lambda t: ar._planned(t[0], t[1], object(), t[2], t[3], None),
               lambda norm: (new(m, k), new(k, n), new(m, k), Norm("layernorm", new(k), new(k)) if norm else None)),
        "bd": (bd, bd.OP, lambda t, cfg: bd._call_key(t[0], t[1], t[2], t[3], t[4], cfg, False, None),
               lambda t: bd._planned(t[0], t[1], t[2], object(), t[3], t[4], None),
               lambda norm: (new(m, k), new(k, k), new(k, n), new(m, k),
                             Norm("layernorm", new(k), new(k)) if norm else None)),
    }
    for name, (mod, op, call_key, planned, inputs) in cases.items():
        rt = Runtime.__new__(Runtime)
        rt._caches = {}
        rt.transport = lambda cfg: "nccl"
        monkeypatch.setattr(mod, "get_runtime_if_made", lambda g, d, rt=rt: rt)
        monkeypatch.setattr(mod, "resolve_group", lambda g: g)
        for with_norm in (True, False):
            t = inputs(with_norm)
            cfg = OverlapConfig()
            cp = _calls.CallPlan(op, (), (), None, (), (m, n, k), "nccl", "default", cfg, "nccl")
            cp.body = SimpleNamespace(moving=mod._Bound.moving)
            _calls.keep(rt, call_key(t, cfg), cp)
            seen.clear()
            assert planned(t) == "replayed", name
            args, ptrs = seen[-1]
            fixed = []  # every input not copied in, in order; a norm's weight and bias (0: none)
            for i, x in enumerate(args):
                if i in mod._Bound.moving:
                    continue
                if isinstance(x, torch.Tensor):
                    fixed.append(x.data_ptr())
                else:
                    fixed += [0, 0] if x is None else [w.data_ptr() if w is not None else 0 for w in (x.weight, x.bias)]
            assert ptrs == tuple(fixed), (name, with_norm, ptrs, fixed)
            moved = {args[i].data_ptr() for i in mod._Bound.moving if args[i] is not None}
            assert not moved & set(ptrs), (name, with_norm)


def test_index_hit_python_calls_are_few(monkeypatch) -> None:  # noqa: ANN001
    """The front of a planned call found through the index (``all_gather_matmul``, default
    config, its plan stubbed at the hand-off) is at most 32 calls (cProfile; the
    stand-in's and the stubs' own included; the CUDA stand-in tensor's dispatch frames
    left out), where the full lookup takes about 90 (it builds the default config anew)."""
    import cProfile
    import pstats

    from overlap.ops import OverlapConfig
    from overlap.ops._runtime import Runtime

    rt = Runtime.__new__(Runtime)
    rt._caches = {}
    rt.transport = lambda cfg: "p2p"
    monkeypatch.setattr(ag, "get_runtime_if_made", lambda g, d: rt)
    monkeypatch.setattr(ag, "resolve_group", lambda g: g)
    monkeypatch.setattr(ag, "run_planned", lambda rt_, cp, *args: cp)
    group = object()
    a = torch.Tensor._make_subclass(_OnCuda, torch.zeros(8, 16))
    b = torch.Tensor._make_subclass(_OnCuda, torch.zeros(16, 8))
    cfg = OverlapConfig()
    cp = _calls.CallPlan("all_gather_matmul", (), (), None, (), (16, 8, 16), "p2p", "default config", cfg, "p2p")
    _calls.keep(rt, ag._call_key(a, b, False, cfg, "p2p", False, None), cp)

    def count(clear: bool) -> float:
        pr = cProfile.Profile()
        for _ in range(20):
            if clear:
                _calls._index.clear()
            pr.enable()
            got = ag._planned(a, b, group, False, None)
            pr.disable()
            assert got is cp
        n = 0
        for f, (_, nc, _, _, callers) in pstats.Stats(pr).stats.items():
            if "torch/_tensor.py" in f[0].replace("\\", "/"):
                continue
            n += sum(v[0] for c, v in callers.items() if "torch/_tensor.py" not in c[0].replace("\\", "/")) \
                if callers else nc
        return n / 20

    full, hit = count(True), count(False)
    assert hit <= 32 and full >= 2 * hit, (hit, full)


def test_index_emptied_with_the_runtimes() -> None:
    """``reset_runtimes`` (at ``overlap.dist.shutdown``) empties the index, whose entries hold
    a runtime each (its communicators), and moves the generation."""
    from overlap.ops import _state
    from overlap.ops._lifecycle import reset_runtimes

    gen = _state.generation[0]
    _calls._index[("test-entry",)] = (gen, None, None, None, (object(), None, None, None), None, None, {}, ())
    reset_runtimes()
    assert ("test-entry",) not in _calls._index and _state.generation[0] > gen


def test_bound_frame_prepares_before_the_fork_and_finishes_after_the_join() -> None:
    """A bound body's frame in the fused body's order: ``prepare`` (copies the side streams
    read) before the order, the zeroing and the fork; ``finish`` (work on buffers the side
    streams write) after the join and the order's end."""
    import threading
    from types import SimpleNamespace

    log: list = []

    class Order:
        lock = threading.Lock()

        def begin(self, cur) -> None:  # noqa: ANN001
            log.append("begin")

        def end(self, cur) -> None:  # noqa: ANN001
            log.append("end")

    class Body(_calls.BoundBody):
        def run(self, raw, cur, x):  # noqa: ANN001, ANN201
            log.append(("run", x))
            return x + 1

    body = Body()
    body.rt = SimpleNamespace(current_stream=lambda: SimpleNamespace(cuda_stream=7))
    body.order, body.err, body.check = Order(), None, "none"
    body.zeros = (lambda raw, cur: log.append("zero"),)
    body.forks, body.joins = (lambda cur: log.append("fork"),), (lambda cur: log.append("join"),)
    body.prepare = lambda args: (log.append("prepare"), (args[0] * 10,))[1]
    body.finish = lambda out: (log.append("finish"), out * 2)[1]
    assert body(1) == 22
    assert log == ["prepare", "begin", "zero", "fork", ("run", 10), "join", "end", "finish"], log
    del log[:]
    body.prepare = body.finish = None
    assert body(1) == 2 and log == ["begin", "zero", "fork", ("run", 1), "join", "end"], log


def test_chain_call_plan_through_the_index(monkeypatch) -> None:  # noqa: ANN001
    """``mlp_chain``'s short path: no plan before its first call returned; then a call of the
    signature is found through the index (no runtime lookup), runs from its plan with its
    own tensors (new every call) through the plan graphs' door and, while that says no, its
    fused body observed as the full path runs it; a tuned pick stored after the plan was
    made sends the next call to the plan of the pick; another activation or sync is another
    signature; autograd and a capture take the full path."""
    from types import SimpleNamespace

    from overlap.ops import _graphs
    from overlap.ops import chain as ch
    from overlap.ops._runtime import Runtime

    rt = Runtime.__new__(Runtime)
    rt._caches = {}
    looked: list = []
    monkeypatch.setattr(ch, "local_runtime_if_made", lambda d: looked.append(d) or rt)
    doors: list = []
    monkeypatch.setattr(_graphs, "replay_or_capture", lambda rt_, cp, body, args: doors.append((cp, body, args))
                        or _graphs.NO)
    monkeypatch.setattr(ch, "observed", lambda op, shape, path, why, dev, fn, *args: (why, args))
    monkeypatch.setattr(ch, "_Body", lambda rt_, cfg, act, shape: SimpleNamespace(cfg=cfg, act=act, shape=shape))
    gen = torch.Generator().manual_seed(7)

    def new(*shape: int) -> torch.Tensor:
        return torch.Tensor._make_subclass(_OnCuda, torch.randn(*shape, generator=gen))

    m, k, f, n = 8, 16, 32, 8
    t0 = (new(m, k), new(k, f), new(f, n))
    assert ch._planned(*t0, "gelu", None, None) is None and len(looked) == 1  # no plan yet
    plans = {}
    for why, cfg, tuned in (("default config", ch.ChainConfig(), False),
                            ("tuner pick", ch.ChainConfig(reserve_sms=3), True)):
        plans[why] = _calls.CallPlan(ch.OP, (), (), None, (), (m, k, f, n), "tile-flag row", why, cfg, "local")
        _calls.keep(rt, ch._call_key(*t0, "gelu", cfg, False, tuned), plans[why])

    def call(act: str | None = "gelu", sync: str | None = None) -> object:
        t = (new(m, k), new(k, f), new(f, n))
        out = ch._planned(*t, act, None, sync)
        if out is None:
            return None
        why, args = out
        assert args[1] is t[0] and args[2] is t[1] and args[3] is t[2], "a previous call's tensors"
        assert doors[-1][2] == t and doors[-1][0].why == why
        return why

    assert call() == "default config" and len(looked) == 2
    assert call() == "default config" and call() == "default config" and len(looked) == 2  # the index
    assert doors[-1][1].cfg == ch.ChainConfig() and doors[-1][1].act == "gelu"
    ch._tuned(rt)[ch._tune_key(*t0, "gelu")] = plans["tuner pick"].config  # a tuner stores a pick
    assert call() == "tuner pick" and len(looked) == 3
    assert call() == "tuner pick" and len(looked) == 3
    assert call(act=None) is None and call(sync="tile") is None  # other signatures: no plan
    x, w1, w2 = new(m, k), new(k, f), new(f, n)
    w1.requires_grad_(True)
    assert ch._planned(x, w1, w2, "gelu", None, None) is None  # autograd: the full path refuses it
    monkeypatch.setattr(ch, "capturing", lambda: True)
    assert ch._planned(new(m, k), new(k, f), new(f, n), "gelu", None, None) is None


def test_keep_leaves_a_plan_in_use() -> None:
    """A full-path call of a signature that has a plan (a capture, an unaligned input) keeps
    nothing new: the plan in use, its body and its graph stay, and the plans' generation
    (which every op's index checks) does not move."""
    from overlap.ops import _state
    from overlap.ops._runtime import Runtime

    rt = Runtime.__new__(Runtime)
    rt._caches = {}
    first = _calls.CallPlan("all_gather_matmul", (), (), None, (), (16, 8, 16), "nccl", "a", None, "nccl")
    _calls.keep(rt, ("k",), first)
    gen, made = _state.generation[0], _calls.stats["made"]
    _calls.keep(rt, ("k",), _calls.CallPlan("all_gather_matmul", (), (), None, (), (16, 8, 16), "nccl", "b", None,
                                            "nccl"))
    assert _calls.find(rt, "all_gather_matmul", ("k",)) is first
    assert _state.generation[0] == gen and _calls.stats["made"] == made


def test_transport_env_follows_the_environment_object(monkeypatch) -> None:  # noqa: ANN001
    """``transport_env`` (what the index compares ``OVERLAP_TRANSPORT`` by) sees a change of
    the variable, and an ``os.environ`` replaced by another mapping."""
    import os

    monkeypatch.delenv("OVERLAP_TRANSPORT", raising=False)
    assert _calls.transport_env() is None
    monkeypatch.setenv("OVERLAP_TRANSPORT", "p2p")
    assert _calls.transport_env() in ("p2p", b"p2p")
    monkeypatch.setattr(os, "environ", {"OVERLAP_TRANSPORT": "nccl"})
    assert _calls.transport_env() == "nccl"


def test_gated_grids_each_take_their_own_kind_of_operands(monkeypatch) -> None:  # noqa: ANN001
    """``all_gather_matmul``'s gated launches: the peers' grid takes the local grid's operands
    where both plans are of one kind, else makes its own (a split tail keeps the peers' grid
    on the tile GEMM while the local one may be an engine plan: each takes only its own)."""
    from overlap.kernels import gate as _gate

    launched: list = []

    class Plan:
        def __init__(self, kind: str) -> None:
            self.kind = kind

        def operands(self, a, b, a2):  # noqa: ANN001, ANN201
            return (self.kind, a, b, a2)

        def launch(self, descs, c, **kw):  # noqa: ANN001, ANN003
            assert descs[0] == self.kind, f"a {self.kind} plan launched with {descs[0]} operands"
            launched.append((self.kind, kw["grid"]))

    class Other(Plan):
        pass

    monkeypatch.setattr(_gate, "launch_gate", lambda *a, **kw: launched.append(("gate",)))
    a, b, g, c = object(), object(), object(), object()
    for gl, gp in ((Plan("engine"), Plan("engine")), (Plan("engine"), Other("tile")), (Other("tile"), Plan("engine"))):
        body = ag._Bound.__new__(ag._Bound)
        body.gated, body.gl, body.gp, body.cut, body.gate_args = True, gl, gp, (1, 2), ((), {})
        body.p = SimpleNamespace(grid=4, give_back_grid=0)
        del launched[:]
        body._launch(None, a, b, g, c)
        assert launched == [(gl.kind, 4), ("gate",), (gp.kind, 4)], launched
        assert ag._operands_of(gp, gl, gl.operands(a, b, g), a, b, g)[0] == gp.kind


def test_gathered_rows_in_rank_order_without_a_copy_at_one_rank() -> None:
    """``return_gathered``'s rows in rank order: at one rank the gathered buffer is in that
    order whatever the chunks (no permutation copy: the buffer itself, or its first rows of
    a row bucket); at two ranks and two chunks the rows are permuted, as the layout says."""
    from overlap.policies import all_gather_layout
    from tests.ops._cpu_runtime import cpu_runtime

    rt = cpu_runtime()
    for chunks in (1, 2, 3):
        layout = all_gather_layout(1, 0, 256, chunks, 64)
        g = torch.randn(256, 8)
        assert ag._natural(rt, g, layout) is g
        cut = ag._natural(rt, g, layout, ms=200)
        assert cut.data_ptr() == g.data_ptr() and torch.equal(cut, g[:200])
    layout = all_gather_layout(2, 1, 128, 2, 64)
    g = torch.randn(256, 8)
    got = ag._natural(rt, g, layout)
    assert got.data_ptr() != g.data_ptr()
    assert torch.equal(got, g[torch.tensor(layout.gathered_to_natural())])
    assert not torch.equal(got, g)


def test_the_index_marks_a_plan_used_by_its_own_key_object() -> None:
    """An index entry holds the very key object its plan is kept under (an equal key of the
    full lookup is swapped for it), so marking the plan used per call finds it by identity,
    not by comparing a config field by field."""
    from overlap.ops import OverlapConfig
    from overlap.ops._runtime import Runtime

    rt = Runtime.__new__(Runtime)
    rt._caches = {}
    kept = ("shape", OverlapConfig(chunks=2), "nccl")
    cp = _calls.CallPlan("all_gather_matmul", (), (), None, (), (1, 1, 1), "nccl", "x", kept[1], "nccl")
    _calls.keep(rt, kept, cp)
    assert cp.kept_as is kept
    equal = ("shape", OverlapConfig(chunks=2), "nccl")  # what a later full lookup builds
    assert equal == kept and equal is not kept
    ikey = ("test-kept-as", 1)
    _calls.index(ikey, _calls.generation(), None, None, None, rt, cp, kept[1], "nccl", None, None, equal)
    try:
        assert _calls._index[ikey][8] is kept
        assert _calls.index_lookup(ikey, None, None) == (rt, cp, kept[1], "nccl")
    finally:
        _calls._index.pop(ikey, None)


def test_public_mlp_chain_takes_its_planned_path(monkeypatch) -> None:  # noqa: ANN001
    """``overlap.mlp_chain`` called eagerly tries the chain's call plan first (its plan graph
    where the host sets the pace), as the group ops' public functions do; a call the plan
    declines goes on to the full path."""
    import overlap
    from overlap.ops import chain

    x, w1, w2 = torch.randn(4, 8), torch.randn(8, 16), torch.randn(16, 8)
    seen: list = []
    marker = torch.full((4, 8), 7.0)
    monkeypatch.setattr(chain, "_planned", lambda *a: seen.append(a) or marker)
    assert overlap.mlp_chain(x, w1, w2, activation=None) is marker
    assert seen and seen[0][0] is x and seen[0][3] is None
    monkeypatch.setattr(chain, "_planned", lambda *a: None)
    torch.testing.assert_close(overlap.mlp_chain(x, w1, w2, activation=None), x @ w1 @ w2)
