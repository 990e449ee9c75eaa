"""Host cost of one eager call of each op and layer, beside torch.mm, on a shape already run.

    python benchmarks/host_overhead.py --out DIR                 # world size 1 (a GPU, or the CPU)
    python benchmarks/host_overhead.py --out DIR --profile 200   # and where each row's host time goes
    bash launch/torchrun.sh 2 benchmarks/host_overhead.py --out DIR

Every row times the fused path, the one a call takes at 2 or more ranks (at world size 1
the ops run it too: a one-rank group on the NCCL transport, ``OverlapConfig(transport=
"nccl", chunks=2)``). Without a GPU the ops run their reference paths: the rows then time
the host-side checks and agreement plus the plain collective and matmul, in fp32.

Per row, rank 0 writes (``DIR/host_overhead.json``)::

    {"context": {...}, "rows": [{"op", "host_us_p50", "host_us_p99", "gpu_us", "idle_us_p50", "x_mm"}]}

host_us: wall time to queue one call, each call timed alone (``--calls`` calls after a
warm-up), the slowest rank's median and 99th percentile. The shapes are small
(M x N x K = 512 x 1024 x 1024, bf16: about 10 us of GPU work; 64 x 128 x 128 in fp32 on
the CPU), so the host sets the pace and a call returns as soon as it is queued. gpu_us: GPU time per call with the host far
ahead (the calls queued behind a sleep kernel, timed from its end); None on the CPU.

The rows of a phase are timed in ``--rounds`` interleaved rounds (each round: a few untimed
calls, then ``calls / rounds`` timed ones, row after row), so a host that speeds up or slows
down during the run moves every row alike and ``x_mm`` (the row's p50 over torch.mm's, from
the same rounds) compares like with like. Back to back, a call whose GPU work outlasts its
host work ends up waiting for room in the launch queue: its time is then the GPU's, not the
host's. So each row also times calls queued onto an idle GPU (``idle_us_p50``: a
synchronize before each, outside the timed span): the host's cost alone.
Layers time forward + backward (``y.backward(dy)``) of one layer, beside torch's
``nn.Linear`` of the same shape (M x N x K, not sharded: a layer's ops at one rank). The context's
``call_plans`` counts the ops' call plans made and the calls run from one
(``overlap.ops._calls``): on a GPU nearly every timed call of a group op; ``plan_graphs``
the plan graphs captured and replayed (``overlap.ops._graphs``). On a GPU the ops' rows
run twice: as a user's call runs them (``OVERLAP_PLAN_GRAPHS`` as set, default ``auto``:
a plan graph at this shape) and, named "(no plan graph)", from their bound bodies
(``off``; ``--no-graph-rows`` leaves these out).
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.context import run_context  # noqa: E402


def _slowest(v: float, group: Any) -> float:
    import torch.distributed as tdist

    if not tdist.is_initialized() or tdist.get_world_size(group) == 1:
        return v
    t = torch.tensor([v], dtype=torch.float64)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=group)
    return float(t.item())


def host_times(fn: Callable[[], Any], calls: int, dev: torch.device, barrier: Callable[[], None],
               warm: int = 10, idle: bool = False) -> list[float]:
    """Microseconds to queue each of ``calls`` calls of ``fn`` (after ``warm`` untimed ones),
    back to back, or with ``idle`` each onto an idle GPU (a synchronize before it, untimed)."""
    for _ in range(warm):
        fn()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda d: None)
    sync(dev)
    barrier()
    out = []
    for _ in range(calls):
        if idle:
            sync(dev)
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    sync(dev)
    return out


def interleaved(rows: list[tuple[str, Callable[[], Any], bool]], calls: int, rounds: int, dev: torch.device,
                barrier: Callable[[], None]) -> dict[str, tuple[list[float], list[float]]]:
    """Per row (name, function, whether autograd is on while it runs), its back-to-back and
    its idle-GPU call times (``host_times``), from ``rounds`` rounds that each time every row
    in turn (``calls`` in all per row and way)."""
    per = [calls // rounds + (1 if r < calls % rounds else 0) for r in range(rounds)]
    got: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, _fn, _g in rows}
    for r, n in enumerate(per):
        for name, fn, grad in rows:
            b2b, idle = got[name]
            with torch.set_grad_enabled(grad):
                b2b += host_times(fn, n, dev, barrier, warm=10 if r == 0 else 3)
                idle += host_times(fn, n, dev, barrier, warm=1, idle=True)
    return got


def profile_calls(fn: Callable[[], Any], calls: int, dev: torch.device) -> str:
    """cProfile of ``calls`` calls of ``fn`` (already warm): the top functions by own time
    and by cumulative time, as text."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    st = pstats.Stats(pr)

    def where(f: tuple) -> str:
        path, line, name = f
        for cut in ("site-packages/", "overlap/", "benchmarks/"):
            if cut in path:
                path = path[path.rindex(cut) + (len(cut) if cut == "site-packages/" else 0):]
                break
        return f"{path}:{line}({name})" if line else name

    ent = [(tt, ct, nc, where(f)) for f, (_, nc, tt, ct, _) in st.stats.items()]  # type: ignore[attr-defined]
    # every Python-level and built-in call cProfile saw: a count that falls is progress
    # whatever the host's speed
    total = sum(nc for _, _, nc, _ in ent)
    lines = [f"python calls per call of the row: {total / calls:.1f}",
             f"{'own us':>8s} {'cum us':>8s} {'n':>6s}  (per call of the row)"]
    for title, k in (("by own time", 0), ("by cumulative time", 1)):
        lines.append(f"-- {title}")
        for e in sorted(ent, key=lambda e: -e[k])[:40]:
            lines.append(f"{e[0] / calls * 1e6:8.1f} {e[1] / calls * 1e6:8.1f} {e[2] / calls:6.1f}  {e[3]}")
    return "\n".join(lines)


def gpu_us(fn: Callable[[], Any], host_us: float, dev: torch.device, barrier: Callable[[], None],
           calls: int = 50) -> float | None:
    """GPU microseconds per call, the calls queued behind a sleep long enough to cover
    their queueing; None where the sleep ended before the last call was queued."""
    if dev.type != "cuda":
        return None
    barrier()
    torch.cuda.synchronize(dev)
    cycles = int(max(2e7, host_us * calls * 2e3 * 2))  # about 2 GHz; twice the host time
    torch.cuda._sleep(cycles)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(calls):
        fn()
    e.record()
    behind = not s.query()
    e.synchronize()
    return round(s.elapsed_time(e) * 1e3 / calls, 2) if behind else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for host_overhead.json")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved rounds the calls of each row are spread over (every row timed once per round)")
    ap.add_argument("--shape", type=int, nargs=3, metavar=("M", "N", "K"), default=None,
                    help="default 512 1024 1024 on a GPU, 64 128 128 on the CPU (where the arithmetic "
                         "of the GPU's shape would outweigh the host work it is to show)")
    ap.add_argument("--only", default="", help="comma-separated row names to run (default: all)")
    ap.add_argument("--no-graph-rows", action="store_true",
                    help="leave out the ops' rows with plan graphs off (OVERLAP_PLAN_GRAPHS=off)")
    ap.add_argument("--profile", type=int, default=0, metavar="CALLS",
                    help="also run CALLS more calls of each row under cProfile and write where their host time "
                         "goes (rank 0: DIR/host_profile.txt, by own time and by cumulative time)")
    ap.add_argument("--copies", choices=("driver", "graph", "nodes"), default=None,
                    help="how plan graphs copy activations in and outputs out (OVERLAP_PLAN_GRAPH_COPIES): a "
                         "driver copy each per call, kernels of the graph (overlap.kernels.relay), or memcpy "
                         "nodes of the graph re-pointed per call; default: as the environment says")
    ap.add_argument("--graph-copies", action="store_true", help="the same as --copies graph")
    ap.add_argument("--alternate", action="store_true",
                    help="the ops' first activation alternates between two tensors call by call (no call finds it "
                         "where the last call's was: its memcpy node is updated every call; a residual and the "
                         "outputs, dropped per call, may still come back to the same address)")
    args = ap.parse_args()
    if args.graph_copies or args.copies:
        from overlap.ops import _graphs

        _graphs.COPIES = args.copies or "graph"

    import overlap
    from overlap import dist
    from overlap import nn as onn
    from overlap.ops import (Norm, OverlapConfig, all_gather_matmul, all_reduce_matmul, matmul_all_reduce,
                             matmul_all_reduce_matmul, matmul_reduce_scatter)

    ctx = dist.init()
    dev, R, group = ctx.device, ctx.tp_size, ctx.tp_group
    gpu = dev.type == "cuda"
    dt = torch.bfloat16 if gpu else torch.float32
    M, N, K = args.shape or ((512, 1024, 1024) if gpu else (64, 128, 128))
    cfg = OverlapConfig(transport="nccl", chunks=2) if gpu else None
    only = {s for s in args.only.split(",") if s}
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dt, generator=gen)

    import torch.distributed as tdist

    def barrier() -> None:
        if R > 1:
            tdist.barrier(group)

    rows: list[dict[str, Any]] = []
    profiles: list[tuple[str, str]] = []
    pending: list[tuple[str, Callable[[], Any], bool]] = []
    mm_p50: list[float] = []

    def row(name: str, fn: Callable[[], Any]) -> None:
        """A row of the phase being gathered (timed by ``flush``, autograd on or off as now)."""
        if not only or name in only:
            pending.append((name, fn, torch.is_grad_enabled()))

    def flush() -> None:
        """Time the gathered rows in interleaved rounds, then each one's GPU time (and profile)."""
        got = interleaved(pending, args.calls, max(1, min(args.rounds, args.calls)), dev, barrier)
        for name, fn, grad in pending:
            ts, idle = got[name]
            p50 = _slowest(statistics.median(ts), group)
            p99 = _slowest(sorted(ts)[min(len(ts) - 1, int(0.99 * len(ts)))], group)
            if name == "torch.mm":
                mm_p50[:] = [p50]
            with torch.set_grad_enabled(grad):
                g = gpu_us(fn, p50, dev, barrier)
            r = {"op": name, "host_us_p50": round(p50, 1), "host_us_p99": round(p99, 1), "gpu_us": g,
                 "idle_us_p50": round(_slowest(statistics.median(idle), group), 1),
                 "x_mm": round(p50 / mm_p50[0], 2) if mm_p50 else None}
            rows.append(r)
            if ctx.rank == 0:
                print(json.dumps(r), flush=True)
            if args.profile:
                with torch.set_grad_enabled(grad):
                    profiles.append((name, profile_calls(fn, args.profile, dev)))
        pending.clear()

    # torch's own, the yardsticks
    a, w = rnd(M, K), rnd(N, K) / K ** 0.5
    ln = torch.nn.LayerNorm(K, device=dev, dtype=dt)
    with torch.no_grad():
        row("torch.mm", lambda: torch.mm(a, w.t()))
        row("torch layer_norm + mm", lambda: torch.mm(ln(a), w.t()))

    # the ops, each on inputs of its own layout (M rows in all, K the reduced dim)
    a_shard = rnd(M // R, K)                                   # [M/R, K]
    x, res = rnd(M, K), rnd(M, K)                              # partial sums, residual
    norm = Norm.from_module(ln)
    a_k = rnd(M, K // R)                                       # [M, K/R]
    w_k = rnd(N, K // R) / K ** 0.5                            # [N, K/R]
    w_proj = rnd(K, K // R) / K ** 0.5                         # [K, K/R]: a row layer's weight
    w_next = rnd(N // R, K) / K ** 0.5                         # [N/R, K]: the next column layer's
    w1, w2 = rnd(4 * K, K) / K ** 0.5, rnd(K, 4 * K) / (4 * K) ** 0.5

    flip = [0]
    twins: dict[int, torch.Tensor] = {}

    def act(t: torch.Tensor) -> torch.Tensor:
        """An activation: ``t`` itself, or with ``--alternate`` it and a copy of it by turns."""
        if not args.alternate:
            return t
        flip[0] ^= 1
        if flip[0]:
            return t
        twin = twins.get(id(t))
        if twin is None:
            twin = twins[id(t)] = t.clone()
        return twin

    def op_rows(suffix: str) -> None:
        with torch.no_grad():
            row("all_gather_matmul" + suffix,
                lambda: all_gather_matmul(act(a_shard), w.t(), group=group, config=cfg))
            row("all_reduce_matmul + layernorm" + suffix,
                lambda: all_reduce_matmul(act(x), w.t(), group=group, residual=res, norm=norm, config=cfg))
            row("matmul_reduce_scatter" + suffix,
                lambda: matmul_reduce_scatter(act(a_k), w_k.t(), group=group, config=cfg))
            row("matmul_all_reduce" + suffix,
                lambda: matmul_all_reduce(act(a_k), w_k.t(), group=group, config=cfg))
            row("matmul_all_reduce_matmul + layernorm" + suffix,
                lambda: matmul_all_reduce_matmul(act(a_k), w_proj.t(), w_next.t(), group=group, residual=res,
                                                 norm=norm, config=cfg))
            if gpu and not suffix:
                row("mlp_chain", lambda: overlap.mlp_chain(act(a), w1.t(), w2.t()))

    op_rows("")  # the default: plan graphs where the host sets the pace (OVERLAP_PLAN_GRAPHS=auto)

    # the layers, forward + backward; torch's own nn.Linear first, the yardstick of a layer
    lin = torch.nn.Linear(K, N, device=dev, dtype=dt)
    xl = rnd(M, K).requires_grad_()
    dy_lin = rnd(M, N)
    row("torch nn.Linear fwd+bwd", lambda: lin(xl).backward(dy_lin))
    kw = {"group": group, "device": dev, "dtype": dt, "config": cfg}
    col = onn.ColumnParallelLinear(K, N, sequence_parallel=R > 1, **kw)
    rowl = onn.RowParallelLinear(N, K, sequence_parallel=R > 1, **kw)
    ncol = onn.NormColumnParallelLinear(K, N, **kw)
    xs = rnd(M // R if R > 1 else M, K).requires_grad_()
    dy_col = rnd(M, N // R)
    xr = rnd(M, N // R).requires_grad_()
    dy_row = rnd(M // R if R > 1 else M, K)
    xn = rnd(M, K).requires_grad_()

    def fb_col() -> None:
        col(xs).backward(dy_col)

    def fb_row() -> None:
        rowl(xr).backward(dy_row)

    def fb_ncol() -> None:
        y, h = ncol(xn)
        torch.autograd.backward([y, h], [dy_col, xn.detach()])

    row("ColumnParallelLinear fwd+bwd", fb_col)
    row("RowParallelLinear fwd+bwd", fb_row)
    row("NormColumnParallelLinear fwd+bwd", fb_ncol)
    flush()  # the yardsticks, the ops and the layers in the same rounds

    if gpu and not args.no_graph_rows:
        from overlap.ops import _calls

        # the same calls from their bound bodies, no plan graph (the plans made again), timed
        # in rounds of their own (the setting is read per call)
        setting = os.environ.get("OVERLAP_PLAN_GRAPHS")
        os.environ["OVERLAP_PLAN_GRAPHS"] = "off"
        _calls.clear_call_plans()
        op_rows(" (no plan graph)")
        mm_p50.clear()  # (no torch.mm in these rounds: no x_mm)
        flush()
        if setting is None:
            os.environ.pop("OVERLAP_PLAN_GRAPHS")
        else:
            os.environ["OVERLAP_PLAN_GRAPHS"] = setting
        _calls.clear_call_plans()

    if ctx.rank == 0:
        os.makedirs(args.out, exist_ok=True)
        from overlap.ops import _calls, _graphs

        out = {"context": {**run_context(R), "shape": [M, N, K], "dtype": str(dt).replace("torch.", ""),
                           "path": "fused (nccl x2)" if gpu else "reference (no GPU)",
                           "call_plans": dict(_calls.stats), "plan_graphs": dict(_graphs.stats),
                           "plan_graphs_setting": os.environ.get("OVERLAP_PLAN_GRAPHS", "auto"),
                           "plan_graph_copies": _graphs.copies(), "alternate": args.alternate,
                           "rounds": args.rounds}, "rows": rows}
        with open(os.path.join(args.out, "host_overhead.json"), "w") as fh:
            json.dump(out, fh, indent=1)
        if profiles:
            with open(os.path.join(args.out, "host_profile.txt"), "w") as fh:
                for name, text in profiles:
                    fh.write(f"===== {name}: {args.profile} calls =====\n{text}\n")
        mm = next((r["host_us_p50"] for r in rows if r["op"] == "torch.mm"), None)
        mm_idle = next((r["idle_us_p50"] for r in rows if r["op"] == "torch.mm"), None)
        print(f"{'op':40s} {'p50 us':>8s} {'p99 us':>8s} {'gpu us':>8s} {'p50/mm':>7s} {'idle us':>8s} "
              f"{'idle/mm':>7s}")
        for r in rows:
            ratio = f"{r['host_us_p50'] / mm:.1f}x" if mm else ""
            iratio = f"{r['idle_us_p50'] / mm_idle:.1f}x" if mm_idle else ""
            print(f"{r['op']:40s} {r['host_us_p50']:8.1f} {r['host_us_p99']:8.1f} "
                  f"{r['gpu_us'] if r['gpu_us'] is not None else '-':>8} {ratio:>7s} {r['idle_us_p50']:8.1f} "
                  f"{iratio:>7s}")
    dist.shutdown()


if __name__ == "__main__":
    main()
