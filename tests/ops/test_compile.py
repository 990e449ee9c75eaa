"""The public ops under torch.compile: custom ops with fake implementations, no graph break.

World size 1 runs in this process (``overlap.dist.init()`` on gloo), 2 ranks in child
processes (``_compile_worker.py``). On the CPU every op takes its reference path; what
is checked here is the tracing: the graph holds the custom ops, the compiled function
matches eager with inputs changing between calls, configs and groups reach the op,
fake shapes are right, and inputs that require grad raise at forward time.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import overlap
from overlap import ChainConfig, Norm, OverlapConfig, _library
from tests._procs import COMPILER, REPO, run_ranks

OPS = ("all_gather_matmul", "all_reduce_matmul", "mlp_chain")
pytestmark = pytest.mark.filterwarnings("ignore:.*no tile-flag path")  # the CPU fallback's one-time warning


@pytest.fixture(scope="module")
def world1() -> Iterator[Any]:
    overlap.dist.shutdown()
    yield overlap.dist.init(timeout_s=30, device="cpu")
    overlap.dist.shutdown()


class GraphRecorder:
    """A torch.compile backend that keeps Dynamo's graphs, then runs aot_eager."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Any:
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs.append(gm)
        return aot_eager(gm, example_inputs)

    def targets(self) -> list[str]:
        return [str(n.target) for gm in self.graphs for n in gm.graph.nodes if n.op == "call_function"]


def _inputs(call: int, m: int = 5, k: int = 8, n: int = 6, f: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(call)
    return {"a": torch.randn(m, k, generator=g), "b": torch.randn(n, k, generator=g).t(),  # b as w.t()
            "res": torch.randn(m, k, generator=g), "lw": torch.rand(k, generator=g) + 0.5,
            "lb": torch.randn(k, generator=g), "w1": torch.randn(n, f, generator=g),
            "w2": torch.randn(f, 3, generator=g)}


def _step(a: torch.Tensor, b: torch.Tensor, res: torch.Tensor, lw: torch.Tensor, lb: torch.Tensor,
          w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    c, gathered = overlap.all_gather_matmul(a, b, return_gathered=True)
    c1 = overlap.all_gather_matmul(a * 2, b)
    y, h = overlap.all_reduce_matmul(a, b, residual=res, norm=Norm("layernorm", lw, lb, 1e-5))
    y2, h2 = overlap.all_reduce_matmul(a, b, norm=Norm("rmsnorm", lw, None, 1e-6))
    y3, h3 = overlap.all_reduce_matmul(a, b)
    z = overlap.mlp_chain(c + 1, w1, w2)
    z2 = overlap.mlp_chain(c1, w1, w2, activation=None)
    return c, gathered, c1, y, h, y2, h2, y3, h3, z, z2


def _reference(a: torch.Tensor, b: torch.Tensor, res: torch.Tensor, lw: torch.Tensor, lb: torch.Tensor,
               w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    k = a.shape[1]
    h = a + res
    c = a @ b
    return (c, a, (a * 2) @ b, torch.nn.functional.layer_norm(h, (k,), lw, lb, 1e-5) @ b, h,
            torch.nn.functional.rms_norm(a, (k,), lw, 1e-6) @ b, a, a @ b, a,
            torch.nn.functional.gelu((c + 1) @ w1) @ w2, ((a * 2) @ b @ w1) @ w2)


# ---- (a) compiled == eager ------------------------------------------------------------

def test_compiled_matches_eager_world1(world1: Any) -> None:
    rec = GraphRecorder()
    compiled = torch.compile(_step, fullgraph=True, backend=rec)
    before = (overlap.ops.all_gather.stats["reference"], overlap.ops.all_reduce.stats["reference"],
              overlap.ops.chain.stats["reference"])
    for call, m in enumerate((5, 5, 7, 9)):  # new values every call, new shapes from the third
        x = _inputs(call, m=m)
        got, want, ref = compiled(**x), _step(**x), _reference(**x)
        for i, (u, v, r) in enumerate(zip(got, want, ref)):
            torch.testing.assert_close(u, v, msg=lambda s: f"call {call}, output {i}, compiled vs eager: {s}")
            torch.testing.assert_close(u, r, msg=lambda s: f"call {call}, output {i}, compiled vs torch: {s}")
    targets = rec.targets()
    for op in OPS:
        assert f"overlap.{op}.default" in targets, targets
    assert len(rec.graphs) <= 2, "a static and a dynamic graph at most"
    after = (overlap.ops.all_gather.stats["reference"], overlap.ops.all_reduce.stats["reference"],
             overlap.ops.chain.stats["reference"])
    # each call ran every op twice (eager) or three times, once compiled and once eager: the graph ran the ops
    assert [b - a for a, b in zip(before, after)] == [4 * 4, 4 * 6, 4 * 4], (before, after)


def test_compiled_module_matches_eager(world1: Any) -> None:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1 = torch.nn.Parameter(torch.randn(8, 16), requires_grad=False)
            self.w2 = torch.nn.Parameter(torch.randn(16, 8), requires_grad=False)
            self.ln = torch.nn.LayerNorm(8)

        def forward(self, x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
            y, h = overlap.all_reduce_matmul(x, self.w1, residual=res, norm=Norm.from_module(self.ln))
            return overlap.mlp_chain(torch.relu(y), self.w2, self.w1) + h.sum()  # (M, 16)

    mod = Block()
    compiled = torch.compile(mod, fullgraph=True, backend="aot_eager")
    with torch.no_grad():  # the LayerNorm's parameters require grad
        for call in range(3):
            x, res = torch.randn(6, 8), torch.randn(6, 8)
            torch.testing.assert_close(compiled(x, res), mod(x, res))


def test_configs_and_groups_reach_the_op(world1: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple] = []
    real_ag, real_chain = _library._ag_impl, _library._chain_impl

    def spy_ag(a: torch.Tensor, b: torch.Tensor, **kw: Any) -> Any:
        seen.append(("ag", kw["group"], kw["config"]))
        return real_ag(a, b, **kw)

    def spy_chain(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, **kw: Any) -> Any:
        seen.append(("chain", kw["config"], kw["sync"], kw["activation"]))
        return real_chain(x, w1, w2, **kw)

    monkeypatch.setattr(_library, "_ag_impl", spy_ag)
    monkeypatch.setattr(_library, "_chain_impl", spy_chain)

    def fn(a: torch.Tensor, w1: torch.Tensor, cfg: Any, ccfg: Any, group: Any) -> torch.Tensor:
        c = overlap.all_gather_matmul(a, w1, group=group, config=cfg)
        return overlap.mlp_chain(c, w1.t(), w1, config=ccfg, sync="tile")

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    tp = world1.tp_group
    cases = [(OverlapConfig(chunks=1), ChainConfig(reserve_sms=2), None),
             (OverlapConfig(chunks=2), None, tp),
             (None, ChainConfig(reserve_sms=3), tp),
             (OverlapConfig(chunks=2), None, None)]  # equal to an earlier one, another object
    for cfg, ccfg, group in cases:
        a, w1 = torch.randn(4, 8), torch.randn(8, 8)
        seen.clear()
        torch.testing.assert_close(compiled(a, w1, cfg, ccfg, group), fn(a, w1, cfg, ccfg, group))
        compiled_seen = seen[:2]
        assert compiled_seen[0][2] == cfg and compiled_seen[1][1] == ccfg, (compiled_seen, cfg, ccfg)
        assert compiled_seen[1][2:] == ("tile", "gelu")
        # a group travels by name and comes back as the same group; None stays the default
        assert compiled_seen[0][1] is group or compiled_seen[0][1] == group, (compiled_seen, group)
    assert _library.config_for(_library.config_id(OverlapConfig(chunks=2))) == OverlapConfig(chunks=2)
    assert _library.config_id(None) == 0 and _library.config_for(0) is None


def test_inductor(world1: Any) -> None:
    # the default backend; no pointwise op around the custom ops, so no C++ kernel to build
    def fn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, h = overlap.all_reduce_matmul(x, w1)
        return overlap.mlp_chain(h, w1, w2), overlap.all_gather_matmul(y, w2)

    compiled = torch.compile(fn, fullgraph=True)
    for m in (5, 7):
        x, w1, w2 = torch.randn(m, 8), torch.randn(8, 6), torch.randn(6, 8)
        for u, v in zip(compiled(x, w1, w2), fn(x, w1, w2)):
            torch.testing.assert_close(u, v)


@pytest.mark.slow
def test_compiled_gloo_2_ranks() -> None:
    procs = run_ranks(REPO / "tests" / "_compile_worker.py", 2, timeout_s=150, preload=COMPILER)
    for p in procs:
        assert p.returncode == 0 and f"PASS compile rank={p.rank}" in p.out, p


# ---- (b) fake implementations ---------------------------------------------------------

def test_fake_shapes(world1: Any) -> None:
    ag, ar, ch = (getattr(torch.ops.overlap, op).default for op in OPS)
    with FakeTensorMode():
        a, b = torch.empty(5, 8, dtype=torch.float16), torch.empty(6, 8, dtype=torch.float16).t()
        c, gathered = ag(a, b, "", True, 0)
        assert (c.shape, gathered.shape, c.dtype, gathered.dtype) == ((5, 6), (5, 8), torch.float16, torch.float16)
        c, empty = ag(a, b, world1.tp_group.group_name, False, 0)
        assert (c.shape, empty.shape) == ((5, 6), (0,))
        res, lw = torch.empty(5, 8, dtype=torch.float16), torch.empty(8, dtype=torch.float16)
        y, h = ar(a, b, "", res, "layernorm", lw, lw, 1e-5, 0)
        assert (y.shape, h.shape, y.dtype) == ((5, 6), (5, 8), torch.float16)
        z = ch(a, torch.empty(8, 16, dtype=torch.float16), torch.empty(16, 3, dtype=torch.float16),
               "gelu", 0, None, False, 0)
        assert (z.shape, z.dtype) == ((5, 3), torch.float16)
        with pytest.raises(RuntimeError, match="K mismatch"):
            ag(a, torch.empty(9, 6, dtype=torch.float16), "", False, 0)


@pytest.mark.parametrize("case", ["ag", "ag_gathered", "ag_many", "ag_many_gathered", "ar", "ar_norm", "chain"])
def test_opcheck(world1: Any, case: str) -> None:
    x, b, w1, w2 = torch.randn(5, 8), torch.randn(6, 8).t(), torch.randn(6, 16), torch.randn(16, 3)
    bs = [b, torch.randn(3, 8).t(), torch.randn(8, 4)]
    op, args = {
        "ag": (torch.ops.overlap.all_gather_matmul.default, (x, b, "", False, 0)),
        "ag_many": (torch.ops.overlap.all_gather_matmul_many.default, (x, bs, "", False, 0)),
        "ag_many_gathered": (torch.ops.overlap.all_gather_matmul_many.default,
                             (x, bs, world1.tp_group.group_name, True, 0)),
        "ag_gathered": (torch.ops.overlap.all_gather_matmul.default, (x, b, world1.tp_group.group_name, True, 0)),
        "ar": (torch.ops.overlap.all_reduce_matmul.default, (x, b, "", None, None, None, None, 0.0, 0)),
        "ar_norm": (torch.ops.overlap.all_reduce_matmul.default,
                    (x, b, "", torch.randn(5, 8), "layernorm", torch.rand(8), torch.randn(8), 1e-5, 0)),
        "chain": (torch.ops.overlap.mlp_chain.default, (x @ b, w1, w2, "gelu", 0, None, False, 0)),
    }[case]
    torch.library.opcheck(op, args)


def test_weight_list_is_one_custom_op_compiled(world1: Any) -> None:
    """A list of weights under torch.compile: one ``all_gather_matmul_many`` call (one gather,
    one grid over the weights' GEMMs) with the list whole, not one op per weight; N-D input,
    gather dim 1; outputs equal eager's with inputs changing between calls; fake shapes."""
    rec = GraphRecorder()

    def f(x: torch.Tensor, b0: torch.Tensor, b1: torch.Tensor, b2: torch.Tensor) -> Any:
        return overlap.all_gather_matmul(x, [b0, b1, b2], gather_dim=1, return_gathered=True)

    fc = torch.compile(f, backend=rec, fullgraph=True)
    for call in range(3):
        g = torch.Generator().manual_seed(call)
        x = torch.randn(2, 3, 8, generator=g)
        bs = [torch.randn(n, 8, generator=g).t() for n in (6, 4, 4)]
        (cs, gathered), (cs_e, gathered_e) = fc(x, *bs), f(x, *bs)
        assert torch.equal(gathered, gathered_e) and torch.equal(gathered, x)
        for c, c_e, b in zip(cs, cs_e, bs):
            torch.testing.assert_close(c, c_e)
            torch.testing.assert_close(c, x @ b)
    targets = [t for t in rec.targets() if "overlap" in t]
    assert targets == ["overlap.all_gather_matmul_many.default"], targets
    with FakeTensorMode():
        cs, g = torch.ops.overlap.all_gather_matmul_many(torch.empty(5, 8), [torch.empty(8, 6), torch.empty(8, 2)],
                                                         "", False, 0)
        assert [c.shape for c in cs] == [(5, 6), (5, 2)] and g.shape == (0,)
        with pytest.raises(RuntimeError, match="K mismatch"):
            torch.ops.overlap.all_gather_matmul_many(torch.empty(5, 8), [torch.empty(9, 6)], "", False, 0)


def test_all_reduce_weight_list_is_one_custom_op_compiled(world1: Any) -> None:
    """all_reduce_matmul with a list of weights under torch.compile: one
    ``all_reduce_matmul_many`` call (one all-reduce and norm, one grid over the GEMMs),
    N-D input, residual and LayerNorm; equal to eager and to torch with inputs changing."""
    rec = GraphRecorder()
    lw, lb = torch.rand(8) + 0.5, torch.randn(8)
    norm = Norm("layernorm", lw, lb, 1e-5)

    def f(x: torch.Tensor, r: torch.Tensor, b0: torch.Tensor, b1: torch.Tensor) -> Any:
        return overlap.all_reduce_matmul(x, [b0, b1], residual=r, norm=norm)

    fc = torch.compile(f, backend=rec, fullgraph=True)
    for call in range(3):
        g = torch.Generator().manual_seed(10 + call)
        x, r = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
        bs = [torch.randn(n, 8, generator=g).t() for n in (6, 4)]
        (cs, h), (cs_e, h_e) = fc(x, r, *bs), f(x, r, *bs)
        y = torch.nn.functional.layer_norm(x + r, (8,), lw, lb, 1e-5)
        torch.testing.assert_close(h, h_e)
        torch.testing.assert_close(h, x + r)
        for c, c_e, b in zip(cs, cs_e, bs):
            torch.testing.assert_close(c, c_e)
            torch.testing.assert_close(c, y @ b)
    targets = [t for t in rec.targets() if "overlap" in t]
    assert targets == ["overlap.all_reduce_matmul_many.default"], targets
    torch.library.opcheck(torch.ops.overlap.all_reduce_matmul_many.default,
                          (torch.randn(6, 8), [torch.randn(8, 3), torch.randn(5, 8).t()], "", torch.randn(6, 8),
                           "rmsnorm", lw, None, 1e-6, 0))


# ---- (c) inputs that require grad -----------------------------------------------------

def _grad_calls() -> list[tuple[str, Any, int]]:
    """(op, call given the index of the tensor that requires grad, number of tensors)."""

    def ag(t: list[torch.Tensor]) -> Any:
        return overlap.all_gather_matmul(t[0], t[1])

    def ar(t: list[torch.Tensor]) -> Any:
        return overlap.all_reduce_matmul(t[0], t[1], residual=t[2], norm=Norm("layernorm", t[3], t[4]))

    def ch(t: list[torch.Tensor]) -> Any:
        return overlap.mlp_chain(t[0], t[1], t[2])

    return [("all_gather_matmul", ag, [(4, 8), (8, 6)]),
            ("all_reduce_matmul", ar, [(4, 8), (8, 6), (4, 8), (8,), (8,)]),
            ("mlp_chain", ch, [(4, 8), (8, 6), (6, 3)])]


@pytest.mark.parametrize("op,call,shapes", _grad_calls(), ids=[c[0] for c in _grad_calls()])
def test_requires_grad_raises_eager(world1: Any, op: str, call: Any, shapes: list) -> None:
    for i in range(len(shapes)):
        ts = [torch.randn(s, requires_grad=(j == i)) for j, s in enumerate(shapes)]
        with pytest.raises(RuntimeError, match=rf"overlap\.{op}: .*no backward yet.*overlap\.nn"):
            call(ts)
        with torch.no_grad():
            call(ts)  # without grad mode the same inputs run
        with torch.inference_mode():
            call(ts)


@pytest.mark.parametrize("op,call,shapes", _grad_calls(), ids=[c[0] for c in _grad_calls()])
def test_requires_grad_raises_compiled(world1: Any, op: str, call: Any, shapes: list, monkeypatch) -> None:
    ran: list[int] = []
    real = {"all_gather_matmul": "_ag_impl", "all_reduce_matmul": "_ar_impl", "mlp_chain": "_chain_impl"}[op]
    impl = getattr(_library, real)
    monkeypatch.setattr(_library, real, lambda *a, **kw: ran.append(1) or impl(*a, **kw))
    ts = [torch.randn(s, requires_grad=(j == len(shapes) - 1)) for j, s in enumerate(shapes)]
    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match=rf"overlap\.{op}: .*no backward yet"):
        compiled(ts)
    assert not ran, "the error must come before the op runs"
    # the custom op itself, called directly, refuses too
    if op == "all_gather_matmul":
        args = (ts[0], ts[1], "", False, 0)
    elif op == "all_reduce_matmul":
        args = (ts[0], ts[1], "", ts[2], "layernorm", ts[3], ts[4], 1e-5, 0)
    else:
        args = (ts[0], ts[1], ts[2], "gelu", 0, None, False, 0)
    with pytest.raises(RuntimeError, match="no backward yet"):
        getattr(torch.ops.overlap, op)(*args)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ts), call(ts))


# ---- (d) the top-level names ----------------------------------------------------------

def test_top_level_names() -> None:
    want = {"all_gather_matmul", "all_reduce_matmul", "mlp_chain", "tune_all_gather_matmul",
            "tune_all_reduce_matmul", "tune_mlp_chain", "OverlapConfig", "NcclTransport", "PeerCopyTransport",
            "ChainConfig", "Norm", "check_errors", "dist", "init", "shutdown", "get_context"}
    assert want <= set(overlap.__all__), want - set(overlap.__all__)
    for name in overlap.__all__:
        assert hasattr(overlap, name), name
    for op in (*OPS, "matmul_reduce_scatter", "matmul_all_reduce", "matmul_all_reduce_matmul"):
        wrapper, inner = getattr(overlap, op), getattr(overlap.ops, op)
        assert wrapper is getattr(_library, op) and wrapper is not inner
        # the call convention of overlap.ops (names, kinds, defaults), plus the N-D keywords
        # (docs/ops/compat.md), keyword-only with defaults that keep the 2-D meaning
        sw, si = inspect.signature(wrapper), inspect.signature(inner)
        ps = list(sw.parameters.values())
        assert [(p.name, p.kind, p.default) for p in ps[:len(si.parameters)]] == \
               [(p.name, p.kind, p.default) for p in si.parameters.values()], (op, sw, si)
        extra = {p.name: p.default for p in ps[len(si.parameters):]}
        assert all(p.kind is p.KEYWORD_ONLY for p in ps[len(si.parameters):]), (op, sw)
        assert extra == {"all_gather_matmul": {"gather_dim": 0},
                         "matmul_reduce_scatter": {"scatter_dim": 0, "reduce_op": "sum"}}.get(op, {}), (op, extra)
        assert wrapper.__doc__.strip().startswith("``"), "the meaning in one line of plain code"
    for name in ("tune_all_gather_matmul", "tune_all_reduce_matmul", "tune_mlp_chain", "OverlapConfig",
                 "NcclTransport", "PeerCopyTransport", "ChainConfig", "Norm"):
        assert getattr(overlap, name) is getattr(overlap.ops, name), name
    assert callable(overlap.check_errors)
    if hasattr(overlap.ops, "check_errors"):
        assert overlap.check_errors is overlap.ops.check_errors


def test_import_loads_no_cuda_module() -> None:
    import subprocess
    import sys

    code = ("import sys, overlap; overlap.all_gather_matmul; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('cupy', 'mpi4py', 'triton') "
            "or m.startswith(('cuda.bindings', 'torch._dynamo'))]; assert not bad, bad[:5]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_baselines_module_holds_every_baseline() -> None:
    """overlap.ops.baselines: every *_ref, *_chunked and stream-sync baseline of overlap.ops,
    the same objects."""
    import overlap.ops.baselines as baselines

    want = {n for n in overlap.ops.__all__ if n.endswith(("_ref", "_chunked", "_stream_sync"))}
    assert set(baselines.__all__) == want, set(baselines.__all__) ^ want
    assert all(getattr(baselines, n) is getattr(overlap.ops, n) for n in want)
