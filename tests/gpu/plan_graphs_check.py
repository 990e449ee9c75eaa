"""Plan graphs (``overlap.ops._graphs``) at world size 1 on the NCCL transport (one process;
see test_ops_gpu.py), with ``OVERLAP_PLAN_GRAPHS=always``.

Per op (the five with bound bodies, bf16): ten calls with new inputs every call against
torch (a stale read fails), the signature captured once and replayed from its third
planned call, every earlier output unchanged after the later calls; the weight changed in
place (read by the next replay); a new weight tensor (that call runs the bound body, the
graph is parked and the new weight captured); calls alternating between two streams; two
layers' weights in turn (each replays a graph of its own; every graph's memory measured);
a user's CUDA graph captured at the graphed signature (the full path) replayed
with new inputs. Then the host time per call of all_gather_matmul at 512 x 1024 x 1024,
graphed and not. ``--copies graph|driver|nodes`` (default ``graph``): how the graphs copy
their activations in and outputs out (``_graphs.copies``: kernels of their own,
``kernels.relay``; a driver copy per call; memcpy nodes of their own re-pointed per call,
``_graph_nodes``); the check asserts which ran. Prints ``PASS plan_graphs ...`` or ``FAIL
plan_graphs: ...``; exits 1 on a failure.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
os.environ["OVERLAP_PLAN_GRAPHS"] = "always"

from overlap import dist  # noqa: E402
from overlap.ops import (Norm, OverlapConfig, all_gather_matmul, all_reduce_matmul, matmul_all_reduce,  # noqa: E402
                         matmul_all_reduce_matmul, matmul_reduce_scatter, mlp_chain)
from overlap.ops import _calls, _graphs  # noqa: E402

M, K, N, N2 = 384, 256, 512, 128
CFG = OverlapConfig(transport="nccl", chunks=2)
DT = torch.bfloat16
TOL = 4e-2


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()


def two_streams(op: str, call: Any) -> None:
    """Six calls alternating between two streams, their inputs made on each (``call() ->
    (got, want)``), checked once all have run."""
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    outs = []
    for it in range(6):
        s = (s1, s2)[it % 2]
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            outs.append(call())
    torch.cuda.synchronize()
    for it, (got, want) in enumerate(outs):
        assert rel(got, want) < TOL, (op, "two streams", it, rel(got, want))


def main() -> None:
    argv = sys.argv[1:]
    copies = argv[argv.index("--copies") + 1] if "--copies" in argv else "graph"
    assert copies in ("graph", "driver", "nodes"), copies
    _graphs.COPIES = copies
    ctx = dist.init()
    dev, group = ctx.device, ctx.tp_group
    torch.manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=dev) / shape[-1] ** 0.25).to(DT)

    nrm_k = Norm("layernorm", (torch.rand(K, device=dev) + 0.5).to(DT), torch.randn(K, device=dev).to(DT))
    nrm_n = Norm("rmsnorm", (torch.rand(N, device=dev) + 0.5).to(DT))

    # each case: f(x, w, w_next) -> (got, want); the weights given per call (a test moves them)
    def agmm(x, w, w2):
        return all_gather_matmul(x, w.t(), group=group, config=CFG), x.float() @ w.float().t()

    def armm(x, w, w2):
        res = rnd(M, K)
        c, h = all_reduce_matmul(x, w.t(), group=group, residual=res, norm=nrm_k, config=CFG)
        h_ref = x.float() + res.float()
        return torch.cat([c.float(), h.float()], 1), torch.cat(
            [nrm_k.apply(h_ref.to(DT)).float() @ w.float().t(), h_ref], 1)

    def mrs(x, w, w2):
        return matmul_reduce_scatter(x, w.t(), group=group, config=CFG), x.float() @ w.float().t()

    def mar(x, w, w2):
        res = rnd(M, N)
        return (matmul_all_reduce(x, w.t(), group=group, residual=res, config=CFG),
                x.float() @ w.float().t() + res.float())

    def marm(x, w, w2):
        res = rnd(M, N)
        c, h = matmul_all_reduce_matmul(x, w.t(), w2.t(), group=group, residual=res, norm=nrm_n, config=CFG)
        h_ref = x.float() @ w.float().t() + res.float()
        return torch.cat([c.float(), h.float()], 1), torch.cat(
            [nrm_n.apply(h_ref.to(DT)).float() @ w2.float().t(), h_ref], 1)

    cases = {"all_gather_matmul": agmm, "all_reduce_matmul": armm, "matmul_reduce_scatter": mrs,
             "matmul_all_reduce": mar, "matmul_all_reduce_matmul": marm}
    try:
        done = 0
        for op, fn in cases.items():
            w, w2 = rnd(N, K), rnd(N2, N)
            cap0, rep0 = _graphs.stats["captured"], _graphs.stats["replayed"]
            kept = []
            for it in range(10):
                got, want = fn(rnd(M, K), w, w2)
                assert rel(got, want) < TOL, (op, it, rel(got, want))
                kept.append((got, want))
            torch.cuda.synchronize()
            for it, (got, want) in enumerate(kept):  # a later replay changed no earlier output
                assert rel(got, want) < TOL, (op, "earlier output", it, rel(got, want))
            assert _graphs.stats["captured"] - cap0 == 1, (op, "captured", _graphs.stats)
            # the plan's first call is the full path; its planned calls 1-2 are counted, the 3rd captures
            assert _graphs.stats["replayed"] - rep0 == 10 - _graphs.CAPTURE_AT, (op, "replayed", _graphs.stats)
            # the weight changed in place: the next replay reads it
            w.mul_(-0.5)
            got, want = fn(rnd(M, K), w, w2)
            assert rel(got, want) < TOL, (op, "weight changed in place", rel(got, want))
            # a new weight tensor: that call runs the bound body; captured after CAPTURE_AT calls
            w = rnd(N, K)
            b0, cap1 = _calls.stats["bound"], _graphs.stats["captured"]
            for it in range(_graphs.CAPTURE_AT + 2):
                got, want = fn(rnd(M, K), w, w2)
                assert rel(got, want) < TOL, (op, "new weight", it, rel(got, want))
            assert _calls.stats["bound"] - b0 == _graphs.CAPTURE_AT - 1, (op, "bound after a move", _calls.stats)
            assert _graphs.stats["captured"] - cap1 == 1, (op, "captured again", _graphs.stats)
            two_streams(op, lambda: fn(rnd(M, K), w, w2))
            # two layers of this shape, each with its own weight, called in turn: each keeps a
            # graph of its own (the second captured once its weight came in CAPTURE_AT calls)
            wb = rnd(N, K)
            b1, cap2, rep1 = _calls.stats["bound"], _graphs.stats["captured"], _graphs.stats["replayed"]
            for it in range(2 * (_graphs.CAPTURE_AT + 2)):
                got, want = fn(rnd(M, K), w if it % 2 == 0 else wb, w2)
                assert rel(got, want) < TOL, (op, "layers in turn", it, rel(got, want))
            assert _graphs.stats["captured"] - cap2 == 1, (op, "a graph per layer", _graphs.stats)
            assert _calls.stats["bound"] - b1 == _graphs.CAPTURE_AT - 1, (op, "layers in turn: bound", _calls.stats)
            assert _graphs.stats["replayed"] - rep1 == 2 * (_graphs.CAPTURE_AT + 2) - (_graphs.CAPTURE_AT - 1), \
                (op, "layers in turn: replayed", _graphs.stats)
            done += 1
            sizes = [g.bytes for g in list(_graphs.live)]  # each graph's memory, measured at its capture
            assert sizes and all(b > 0 for b in sizes), (op, "graph bytes", sizes)
            print(f"ok {op}: {_graphs.stats}, graphs hold {sum(sizes) / 2**20:.1f} MiB", flush=True)
        # mlp_chain: new inputs every call, earlier outputs kept, a weight changed in place and moved
        def chain(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            mid = torch.nn.functional.gelu(x.float() @ w1.float()).to(DT)
            return mlp_chain(x, w1, w2), mid.float() @ w2.float()

        w1, w2 = rnd(K, N), rnd(N, N2)
        cap0, rep0, p0 = _graphs.stats["captured"], _graphs.stats["replayed"], _calls.stats["planned"]
        kept = []
        for it in range(10):
            got, want = chain(rnd(M, K), w1, w2)
            assert rel(got, want) < TOL, ("mlp_chain", it, rel(got, want))
            kept.append((got, want))
        torch.cuda.synchronize()
        for it, (got, want) in enumerate(kept):
            assert rel(got, want) < TOL, ("mlp_chain", "earlier output", it, rel(got, want))
        assert _calls.stats["planned"] - p0 == 9, ("mlp_chain planned", _calls.stats)
        assert _graphs.stats["captured"] - cap0 == 1, ("mlp_chain captured", _graphs.stats)
        assert _graphs.stats["replayed"] - rep0 == 10 - _graphs.CAPTURE_AT, ("mlp_chain replayed", _graphs.stats)
        w2.mul_(-0.5)
        got, want = chain(rnd(M, K), w1, w2)
        assert rel(got, want) < TOL, ("mlp_chain", "weight changed in place", rel(got, want))
        w1, cap1 = rnd(K, N), _graphs.stats["captured"]
        for it in range(_graphs.CAPTURE_AT + 2):
            got, want = chain(rnd(M, K), w1, w2)
            assert rel(got, want) < TOL, ("mlp_chain", "new weight", it, rel(got, want))
        assert _graphs.stats["captured"] - cap1 == 1, ("mlp_chain captured again", _graphs.stats)
        two_streams("mlp_chain", lambda: chain(rnd(M, K), w1, w2))
        done += 1
        print(f"ok mlp_chain: {_graphs.stats}", flush=True)
        # a broadcast residual (stride 0): copied into the graph's contiguous input
        w = rnd(N, K)
        for it in range(_graphs.CAPTURE_AT + 3):
            x, row = rnd(M, K), rnd(K)
            c, h = all_reduce_matmul(x, w.t(), group=group, residual=row.expand(M, K), norm=nrm_k, config=CFG)
            h_ref = x.float() + row.float()
            assert rel(h, h_ref) < TOL and rel(c, nrm_k.apply(h_ref.to(DT)).float() @ w.float().t()) < TOL, \
                ("broadcast residual", it)
        # a user's graph at a graphed signature: the capture takes the full path
        w = rnd(N, K)
        x = rnd(M, K)
        for _ in range(_graphs.CAPTURE_AT + 1):
            all_gather_matmul(x, w.t(), group=group, config=CFG)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
            out = all_gather_matmul(x, w.t(), group=group, config=CFG)
        torch.cuda.current_stream().wait_stream(s)
        for it in range(3):
            x.copy_(rnd(M, K))
            g.replay()
            torch.cuda.synchronize()
            assert rel(out, x.float() @ w.float().t()) < TOL, ("user graph", it)
        # host time per call, graphed and not (one process; not a benchmark)
        a, b = rnd(512, 1024), rnd(1024, 1024)
        times = {}
        for setting in ("off", "always"):
            os.environ["OVERLAP_PLAN_GRAPHS"] = setting
            _calls.clear_call_plans()
            for _ in range(10):
                all_gather_matmul(a, b, group=group, config=CFG)
            torch.cuda.synchronize()
            t = []
            for _ in range(200):
                t0 = time.perf_counter()
                all_gather_matmul(a, b, group=group, config=CFG)
                t.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            times[setting] = sorted(t)[len(t) // 2] * 1e6
        for how, stat in (("graph", "relayed"), ("nodes", "noded")):  # every replay made its copies as asked
            assert (_graphs.stats[stat] == _graphs.stats["replayed"]) if copies == how else not _graphs.stats[stat], \
                (stat, _graphs.stats)
        print(f"PASS plan_graphs world={ctx.tp_size} ops={done} copies={copies} "
              f"captured={_graphs.stats['captured']} "
              f"replayed={_graphs.stats['replayed']} host_us_p50 bound={times['off']:.1f} "
              f"graphed={times['always']:.1f}", flush=True)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        print(f"FAIL plan_graphs: {type(e).__name__}: {e}", flush=True)
        dist.shutdown()
        sys.exit(1)
    dist.shutdown()


if __name__ == "__main__":
    main()
