"""Where a replayed call's host time goes (1 GPU, world size 1, NCCL x2, bf16, 512 x 1024 x 1024).

    python benchmarks/diag/plan_graph_launch.py --out DIR

Per op with a plan graph (``overlap.ops._graphs``): the host time (median of 300, each
timed alone) of the whole call, of the graph's replay alone, and of the outputs' clones
(torch's, and the driver copies a replay makes); beside a graph of one small kernel, one of eight, and
torch.mm. Then each step of a replayed call alone (``_graphs._replay``'s, and the call up
to it: the op's entry, its call plan found, the graph picked), so their sum can be held
against the whole call. The graphs copy through memcpy nodes of their own
(``OVERLAP_PLAN_GRAPH_COPIES=nodes``); each case's whole call is then timed again with the
graph's own copy kernels (``graph``) and with driver copies (``driver``); a kept graph's
nodes are counted by kind (what its launch submits). Writes ``DIR/plan_graph_launch.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
os.environ.setdefault("OVERLAP_PLAN_GRAPHS", "always")


def host_us(fn: Callable[[], Any], calls: int = 300) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        t.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return round(statistics.median(t), 1)


def _replay_of(g: Any) -> Callable[[], Any] | None:
    """The graph's replay alone; with its own copies, after a post of a slot that copies
    nothing (a replay without its post would find its slot unwritten); None for a graph
    whose memcpy nodes a call re-points (its output nodes point at the last call's outputs,
    which a replay alone would overwrite, freed or not)."""
    if g.nodes is not None:
        return None
    replay = g.replay if g.replay is not None else g.graph.replay
    if g.relay is None:
        return replay
    zeros = [0] * g.relay.cols
    return lambda: (g.relay.post(zeros), replay())


def steps(name: str, fn: Callable[[], Any], g: Any) -> list[dict[str, Any]]:
    """Each step of a replayed call of ``fn`` (whose graph is ``g``), timed alone."""
    from overlap import observe
    from overlap.ops import _calls, _graphs, _sigs
    from overlap.ops._plans import report_eager

    hit = next(e[4] for e in _calls._index.values()
               if getattr(getattr(e[4][1], "body", None), "gstate", None) is not None
               and e[4][1].body.gstate.graph is g)
    rt, cp = hit[0], hit[1]
    body = cp.body
    seen: list[Any] = []
    real = _graphs._replay
    _graphs._replay = lambda rt_, cp_, body_, g_, args: seen.append(args) or g_.out  # the call up to the replay
    try:
        entry = host_us(fn)
    finally:
        _graphs._replay = real
    args = seen[-1]
    cur = rt.current_stream()
    raw = cur.cuda_stream
    out: list[dict[str, Any]] = [{"what": f"{name}: call up to _replay (entry, plan, graph picked)",
                                  "host_us": entry}]
    parts: dict[str, Callable[[], Any]] = {
        "agreement point (check_agreed)": lambda: _sigs.check_agreed(rt, cp.op, cp.names, cp.values, cp.key),
        "call counted (record_call)": lambda: observe.record_call(cp.op, cp.shape, cp.path, cp.why),
        "order lock, current stream, begin, end": lambda: (rt.order.lock.acquire(), rt.order.begin(rt.current_stream()),
                                                           rt.order.end(cur), rt.order.lock.release()),
        "current device": lambda: _graphs._get_device(),
        **({"nodes pointed at the call's tensors, graph launched": lambda: g.nodes.call(args, raw),
            "graph launched alone (no node update)": lambda: g.nodes.launch(g.nodes.exec, raw),
            "new outputs alone": lambda: [t[3]() for t in g.nodes.outs],
            "(not summed) new outputs alone with torch.empty_like":
                lambda: [torch.empty_like(o) for o in (g.out if isinstance(g.out, tuple) else (g.out,))]}
           if g.nodes is not None else
           {"copies in": lambda: [g.copiers[i](args[i], raw) for i in g.moving if args[i] is not None],
            "replay": _replay_of(g),
            "clones out": lambda: g.clone(raw)} if g.relay is None else
           {"replay, its slot posted (the graph copies)": _replay_of(g),
            "new outputs": lambda: [torch.empty_like(o) for _c, o in g.rout]}),
        "error report": lambda: report_eager(body.err, body.check),
        "signature marked warm": lambda: _graphs._seen(rt.seen, (cp.op, cp.sig)),
    }
    total = 0.0
    for what, f in parts.items():
        us = host_us(f)
        total += 0.0 if what.startswith("(not summed)") else us
        out.append({"what": f"{name}: step: {what}", "host_us": us})
    out.append({"what": f"{name}: steps summed (with the call up to _replay)", "host_us": round(total + entry, 1)})
    return out


def _memset_posts() -> None:
    """Flag posts queued while a graph is captured become one-word memsets (memset nodes,
    where the write-value node is a stream memory operation)."""
    from overlap import _driver, flags
    from overlap.ops._state import capturing

    real, memset = flags.stream_write_value, _driver.memset_d32()

    def post(stream: Any, fl: torch.Tensor, idx: int, value: int) -> None:
        if not capturing():
            return real(stream, fl, idx, value)
        code = memset(fl.data_ptr() + 4 * idx, value & 0xFFFFFFFF, 1, stream.cuda_stream)
        if code:
            _driver.check(code, "cuMemsetD32Async")

    flags.stream_write_value = post


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--posts", choices=("write", "memset"), default="write",
                    help="memset: a flag post made while capturing is a one-word memset (an experiment)")
    args = ap.parse_args()
    if args.posts == "memset":
        _memset_posts()

    from benchmarks.context import run_context
    from overlap import dist
    from overlap.ops import (Norm, OverlapConfig, all_gather_matmul, all_reduce_matmul,
                             matmul_all_reduce_matmul)
    from overlap.ops import _calls, _graphs

    first, others = "nodes", ("graph", "driver")
    _graphs.COPIES = first  # each case then again with the other ways of copying
    ctx = dist.init()
    dev, group = ctx.device, ctx.tp_group
    M, N, K = 512, 1024, 1024
    dt = torch.bfloat16
    cfg = OverlapConfig(transport="nccl", chunks=2)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, device=dev, dtype=dt)

    a, w, x, res = rnd(M, K), rnd(N, K), rnd(M, K), rnd(M, K)
    ln = torch.nn.LayerNorm(K, device=dev, dtype=dt)
    norm = Norm.from_module(ln)
    w_proj, w_next, res_n = rnd(K, K), rnd(N, K), rnd(M, K)
    rows: list[dict[str, Any]] = []
    small = torch.zeros(1024, device=dev)
    for n_k in (1, 8):
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
            for _ in range(n_k):
                small.add_(1)
        torch.cuda.current_stream().wait_stream(s)
        rows.append({"what": f"graph of {n_k} small kernel(s): replay", "host_us": host_us(g.replay)})
    rows.append({"what": "torch.mm", "host_us": host_us(lambda: torch.mm(a, w.t()))})
    rows.append({"what": "tensor.clone (512 x 1024)", "host_us": host_us(lambda: a.clone())})
    rows.append({"what": "tensor.copy_ (512 x 1024)", "host_us": host_us(lambda: x.copy_(a))})
    rows.append({"what": "torch.empty_like (512 x 1024)", "host_us": host_us(lambda: torch.empty_like(a))})
    cases = {
        "all_gather_matmul": lambda: all_gather_matmul(a, w.t(), group=group, config=cfg),
        "all_reduce_matmul + layernorm": lambda: all_reduce_matmul(x, w.t(), group=group, residual=res, norm=norm,
                                                                   config=cfg),
        "matmul_all_reduce_matmul + layernorm": lambda: matmul_all_reduce_matmul(
            a, w_proj.t(), w_next.t(), group=group, residual=res_n, norm=norm, config=cfg),
    }
    with torch.no_grad():
        for name, fn in cases.items():
            before = set(map(id, _graphs.live))
            call = host_us(fn)
            g = next(pg for pg in _graphs.live if id(pg) not in before)
            how = "nodes" if g.nodes is not None else "graph" if g.relay is not None else "driver"
            rows.append({"what": f"{name}: call ({how} copies)", "host_us": call})
            kinds = None
            if hasattr(g.graph, "raw_cuda_graph"):  # (a kept graph: its nodes by kind, what its launch submits)
                from overlap import _driver

                try:
                    kinds = _driver.node_kinds(int(g.graph.raw_cuda_graph()))
                except RuntimeError:
                    kinds = None
            if kinds is not None:
                rows.append({"what": f"{name}: graph nodes {kinds}", "host_us": None})
            if _replay_of(g) is not None:
                rows.append({"what": f"{name}: replay alone", "host_us": host_us(_replay_of(g))})
            raw = torch.cuda.current_stream().cuda_stream
            rows.append({"what": f"{name}: outputs cloned (torch clone)",
                         "host_us": host_us(lambda g=g: _graphs._cloned(g.out))})
            rows.append({"what": f"{name}: outputs cloned (as a replay clones them)",
                         "host_us": host_us(lambda g=g: g.clone(raw))})
            rows += steps(name, fn, g)
            for other in others:  # the same calls copying the other ways
                _graphs.COPIES = other
                _calls.clear_call_plans()
                rows.append({"what": f"{name}: call ({other} copies)", "host_us": host_us(fn)})
            _graphs.COPIES = first
            _calls.clear_call_plans()
    for r in rows:
        print(f"{r['what']:55s} " + (f"{r['host_us']:8.1f} us" if r["host_us"] is not None else ""), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "plan_graph_launch.json"), "w") as fh:
        json.dump({"context": {**run_context(1), "shape": [M, N, K], "dtype": "bfloat16", "posts": args.posts,
                               "plan_graphs": dict(_graphs.stats), "call_plans": dict(_calls.stats)},
                   "rows": rows}, fh, indent=1)
    dist.shutdown()


if __name__ == "__main__":
    main()
