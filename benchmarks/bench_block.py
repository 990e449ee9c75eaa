"""One GPT block, forward + backward, at TP R: the library's layers against the plain
path and against torch.compile's async tensor parallelism. Modes:

    plain            eager ``overlap.nn`` layers with ``overlap=False``: NCCL + cuBLAS
                     (Megatron's schedule)
    library          eager ``overlap.nn`` layers (``overlap.parallelize``); sequence
                     parallel, the column layers' ``save_gathered`` is ``--save-gathered``
                     (default "auto", the layers' own: ``regather_plan`` per shape)
    library-save     as ``library``, sequence parallel, ``save_gathered=True``: the weight
                     gradient's gathered input kept from forward
    library-regather as ``library``, sequence parallel, ``save_gathered=False``: the input
                     all-gathered again in backward, behind the input gradient's GEMM ->
                     reduce-scatter (less memory, one more all-gather, hidden or not)
    plain-graphed    ``plain``'s block captured whole, forward and backward, with
                     ``torch.cuda.make_graphed_callables`` (a GPU): each step copies its
                     new input into the graph's and replays the two graphs; the loss and
                     the gradients' accumulation stay eager. Checked first against the
                     same block run eagerly (same weights), new inputs each step.
    library-graphed  the same for ``library``: host cost to zero where users want it
    compiled         torch.compile without async TP (sequence parallel only, below)
    compiled-torch   Inductor's async-TP pass (``_micro_pipeline_tp``), torch's symm_mem ops
    compiled-overlap the same pass, its fused nodes retargeted to overlap's ops
                     (``overlap.compat.enable_inductor_async_tp``, docs/ops/compat.md)

The eager modes run ``overlap.models.gpt.Block`` through ``overlap.parallelize``. The
compiled modes run the block as torchtitan writes it, with functional collectives along
the sequence dim (1 of [B, T, C]): LayerNorm -> all-gather -> qkv mm -> attention ->
proj mm -> reduce-scatter -> residual -> LayerNorm -> all-gather -> fc1 mm -> GeLU -> fc2
mm -> reduce-scatter -> residual. The async-TP pass fuses all-gather -> mm and mm ->
reduce-scatter, forward and backward; it has nothing to fuse without sequence
parallelism (an all-reduce), so the compiled modes run only with ``--sp``.

Per mode: ms per step (median over steps, each step timed alone and synchronized, slowest
rank), ``ms_per_step_queued`` (``--steps`` steps queued back to back, CUDA events, no
profiler: the pace the slower of host and GPU sets), tokens per second, peak memory,
for the eager modes the activation memory (MiB) autograd keeps from forward to backward (one
step through ``saved_tensors_hooks``, distinct storages), and for the compiled modes
which fused ops Inductor's generated code calls (a pass that did not fire shows). With
``--sp``, what ``regather_plan`` picks for the block's column layers is printed and saved.

    bash launch/torchrun.sh 2 benchmarks/bench_block.py --sp [--batch 1 --seq 4096 --embd 8192 --heads 64]
        [--modes plain,library,...] [--save-gathered true|false|auto] [--steps 20] [--out DIR] [--busy 5]

``--busy N`` (a GPU): N more steps, queued back to back, under torch.profiler (device
activity only, so the profiler adds no host work per op): the GPU-busy share, the union of
the intervals of every kernel, memcpy and memset over the span from the first one's start
to the last one's end. Where the host is slower than the GPU the kernels wait for it and
the share falls below 1 (``gpu_busy`` per mode; the issue's target for the layers is 0.95).
The profiler's device tracing slows the host's launches, so ``busy_share_of_queued`` also
gives the busy milliseconds per step over ``ms_per_step_queued`` (the same steps without the
profiler): an estimate of the share without it.

``--host N`` (eager modes): N more steps back to back, each step's host time (to queue it,
no synchronization: ``host_ms_per_step``, the median), then N under cProfile: where the
host time goes (``<out>/host_profile_<mode>.txt``) and ``overlap.report()`` after them
(``<out>/report_<mode>.txt``). A host time per step near ``ms_per_step_queued`` is a
host-bound step.

Writes ``block_sp.json`` or ``block.json`` (context: GPU, versions, commit) under ``--out``
on rank 0 and prints a table. Without a GPU it runs tiny shapes on gloo and says its
figures are not GPU figures; ``compiled-torch`` needs CUDA, and ``compiled-overlap`` needs
the pass's NCCL check, which ``--pretend-nccl`` patches on a CPU torch (the pass only reads
the graph).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as tdist
from torch.distributed import _functional_collectives as funcol

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.context import run_context  # noqa: E402
from overlap import dist  # noqa: E402

MODES = ("plain", "library", "library-save", "library-regather", "plain-graphed", "library-graphed", "compiled",
         "compiled-torch", "compiled-overlap")
GRAPH_CHECK_STEPS = 3
GRAPH_CHECK_TOL = 3e-2  # relative error, bf16: graph and eager run the same kernels, so far below this
SAVE_GATHERED = {"true": True, "false": False, "auto": "auto"}


def _save_gathered(mode: str, args: argparse.Namespace) -> bool | str:
    """The column layers' ``save_gathered`` in an eager mode."""
    return {"library-save": True, "library-regather": False}.get(mode, SAVE_GATHERED[args.save_gathered])


class Block(torch.nn.Module):
    """This rank's shard of a sequence-parallel block: weights split Megatron's way."""

    def __init__(self, c: int, heads: int, world: int, group: Any, dev: torch.device, dt: torch.dtype) -> None:
        super().__init__()
        self.group, self.world, self.hs = group, world, c // heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(c), torch.nn.LayerNorm(c)
        self.qkv = torch.nn.Linear(c, 3 * c // world, bias=False)
        self.proj = torch.nn.Linear(c // world, c, bias=False)
        self.fc1 = torch.nn.Linear(c, 4 * c // world, bias=False)
        self.fc2 = torch.nn.Linear(4 * c // world, c, bias=False)
        self.to(dev, dt)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        # along dim 1 as funcol.all_gather_tensor(x, 1, group) does it (gather dim 0, then
        # chunk + cat, the form the async-TP pass matches), spelled out: torch 2.11's Dynamo
        # refuses to trace the helper that function calls for a dim other than 0
        g = funcol.all_gather_tensor(x.contiguous(), 0, self.group)  # [R * B, T/R, C]
        return torch.cat(torch.chunk(g, self.world, dim=0), dim=1)  # [B, T, C]

    def _scatter(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.reduce_scatter_tensor(x, "sum", 1, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T/R, C]
        h = self._gather(self.ln1(x))  # [B, T, C]
        b, t, _ = h.shape
        q, k, v = self.qkv(h).view(b, t, -1, 3, self.hs).permute(3, 0, 2, 1, 4).unbind(0)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self._scatter(self.proj(y.transpose(1, 2).reshape(b, t, -1)))
        h = self._gather(self.ln2(x))
        return x + self._scatter(self.fc2(torch.nn.functional.gelu(self.fc1(h))))


def _set_mode(mode: str, group: Any, saved: dict[str, Any], pretend_nccl: bool) -> None:
    """Inductor's config for ``mode``, from the values saved at start (no pass left over)."""
    from torch._inductor import config

    config._micro_pipeline_tp = saved["_micro_pipeline_tp"]
    config.post_grad_custom_post_pass = saved["post_grad_custom_post_pass"]
    if pretend_nccl and not tdist.is_nccl_available():
        tdist.is_nccl_available = lambda: True
    if mode == "compiled-torch":
        import warnings

        import torch.distributed._symmetric_memory as symm

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm.enable_symm_mem_for_group(group.group_name)
        config._micro_pipeline_tp = True
    elif mode == "compiled-overlap":
        from overlap import compat

        compat.enable_inductor_async_tp(group)


def _fused_calls(codes: list[str]) -> dict[str, int]:
    text = "\n".join(codes)
    names = ("fused_all_gather_matmul", "fused_matmul_reduce_scatter")
    return {f"{ns}.{n}": text.count(f"torch.ops.{ns}.{n}.default(") for ns in ("overlap", "symm_mem") for n in names}


def _eager_block(mode: str, args: argparse.Namespace, env: dict[str, Any]) -> torch.nn.Module:
    from overlap.models.gpt import Block as GPTBlock
    from overlap.models.gpt import GPTConfig
    from overlap.nn import parallelize
    from overlap.nn.parallelize import DEFAULT_PLAN

    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=1, n_head=args.heads, n_embd=args.embd,
                    bias=False)
    torch.manual_seed(0)
    blk = GPTBlock(cfg).to(env["dev"], env["dt"])
    plan = {**DEFAULT_PLAN, "*ln_1": "sequence_norm", "*ln_2": "sequence_norm"} if args.sp else None
    blk = parallelize(blk, env["group"], plan, sequence_parallel=args.sp, overlap=mode != "plain")
    for m in blk.modules():
        if hasattr(m, "save_gathered"):
            m.save_gathered = _save_gathered(mode, args)
    return blk


class _Whole(torch.nn.Module):
    """The block behind a module without hooks (``make_graphed_callables`` refuses a module
    that has any; ``parallelize`` may have put some on the block)."""

    def __init__(self, blk: torch.nn.Module) -> None:
        super().__init__()
        self.blk = blk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blk(x)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _graphed_block(mode: str, args: argparse.Namespace, env: dict[str, Any],
                   shape: tuple[int, ...]) -> tuple[torch.nn.Module, dict[str, Any]]:
    """``mode``'s eager block captured whole (forward + backward) by make_graphed_callables,
    checked against a twin run eagerly (same weights: the same seed) on ``GRAPH_CHECK_STEPS``
    new inputs: the output, the input's gradient and every parameter's gradient."""
    dev, dt = env["dev"], env["dt"]
    whole, twin = _Whole(_eager_block(mode, args, env)), _Whole(_eager_block(mode, args, env))
    sample = torch.randn(shape, device=dev, dtype=dt, requires_grad=True)
    whole(sample).float().square().mean().backward()  # kernels compiled and plans made outside capture
    for p in whole.parameters():
        p.grad = None
    graphed = torch.cuda.make_graphed_callables(whole, (sample,))
    g = torch.Generator(device="cpu").manual_seed(7)
    errs: list[float] = []
    for _ in range(GRAPH_CHECK_STEPS):
        x = torch.randn(shape, generator=g).to(dev, dt)  # new every step: a stale replay fails
        got = []
        for mod in (graphed, twin):
            params = list(mod.parameters())
            for p in params:
                p.grad = None
            xi = x.clone().requires_grad_()
            y = mod(xi)
            y.float().square().mean().backward()
            got.append([y.detach().clone(), xi.grad.clone(), *(p.grad.clone() for p in params)])
        errs += [_rel(a, b) for a, b in zip(*got)]
    for p in graphed.parameters():
        p.grad = None
    check = {"graph_check_steps": GRAPH_CHECK_STEPS, "graph_check_tensors": len(errs),
             "graph_check_max_rel_err": max(errs), "graph_check_ok": max(errs) < GRAPH_CHECK_TOL}
    del twin
    return graphed, check


def _saved_bytes(one: Any) -> int:
    """Bytes of the distinct storages autograd keeps from one step's forward for its backward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        one(0)
    return sum(seen.values())


def _regather_plans(args: argparse.Namespace, world: int, dt: torch.dtype) -> list[dict[str, Any]]:
    """What ``save_gathered="auto"`` picks for the block's sequence-parallel column layers."""
    from overlap.nn.functional import regather_plan

    m, k = args.batch * args.seq, args.embd
    out = []
    for name, n in (("qkv", 3 * k), ("fc1", 4 * k)):
        p = regather_plan(m, n // world, k, world, dt)
        out.append({"layer": name, "m": m, "n_shard": n // world, "k": k, "regather": p.regather,
                    "gather_ms": p.gather_s * 1e3, "reduce_scatter_ms": p.reduce_scatter_s * 1e3,
                    "gemm_ms": p.gemm_s * 1e3, "saved_mib": p.saved_bytes / 2 ** 20})
    return out


def busy_share(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(union of ``intervals`` / their span, span): the share of the span from the first
    start to the last end that at least one interval covers."""
    if not intervals:
        return 0.0, 0.0
    iv = sorted(intervals)
    busy, (lo, hi), span_lo, span_hi = 0.0, iv[0], iv[0][0], max(e for _, e in iv)
    for s, e in iv[1:]:
        if s > hi:
            busy += hi - lo
            lo, hi = s, e
        else:
            hi = max(hi, e)
    busy += hi - lo
    span = span_hi - span_lo
    return (busy / span if span > 0 else 0.0), span


def _gpu_busy(one: Any, steps: int, dev: torch.device) -> dict[str, Any]:
    """``steps`` steps queued back to back under torch.profiler (device activity only): the
    GPU-busy share of their span (``busy_share`` of the kernels', memcpys' and memsets'
    intervals in the trace) and the span per step."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            one(i)
        torch.cuda.synchronize(dev)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    iv = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in trace.get("traceEvents", [])
          if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    share, span = busy_share(iv)
    return {"gpu_busy": share, "busy_span_ms_per_step": span / 1e3 / steps, "busy_events": len(iv),
            "busy_ms_per_step": share * span / 1e3 / steps}


def _queued_ms(one: Any, steps: int, dev: torch.device, group: Any) -> float:
    """Milliseconds per step of ``steps`` steps queued back to back, between two CUDA events
    (no profiler, no synchronization between steps), the slowest rank's."""
    tdist.barrier(group=group)
    torch.cuda.synchronize(dev)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for i in range(steps):
        one(i)
    e.record()
    e.synchronize()
    ms = torch.tensor([s.elapsed_time(e) / steps], dtype=torch.float64, device=dev)
    tdist.all_reduce(ms, op=tdist.ReduceOp.MAX, group=group)
    return ms.item()


def _host_steps(one: Any, steps: int, dev: torch.device, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """``--host``: the host time to queue each of ``steps`` steps (no synchronization
    between them), then where it goes (cProfile) and the report, written under ``--out``."""
    import overlap
    from benchmarks.host_overhead import profile_calls

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda d: None)
    sync(dev)
    ts = []
    for i in range(steps):
        t0 = time.perf_counter()
        one(i)
        ts.append((time.perf_counter() - t0) * 1e3)
    sync(dev)
    if args.out and tdist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        overlap.reset_report()
        text = profile_calls(lambda it=iter(range(10 ** 9)): one(next(it)), steps, dev)
        with open(os.path.join(args.out, f"host_profile_{mode}.txt"), "w") as f:
            f.write(f"===== {mode}: {steps} steps =====\n{text}\n")
        with open(os.path.join(args.out, f"report_{mode}.txt"), "w") as f:
            f.write(str(overlap.report()))
    return {"host_ms_per_step": statistics.median(ts)}


def run_mode(mode: str, args: argparse.Namespace, env: dict[str, Any]) -> dict[str, Any]:
    from torch._inductor.utils import run_and_get_code

    dev, dt, group, world, rank = env["dev"], env["dt"], env["group"], env["world"], env["rank"]
    compiled = mode.startswith("compiled")
    if compiled and not args.sp:
        return {"mode": mode, "na": "sequence parallel only (--sp): the async-TP pass fuses all-gather and "
                                    "reduce-scatter, not all-reduce"}
    if mode in ("library-save", "library-regather") and not args.sp:
        return {"mode": mode, "na": "sequence parallel only (--sp)"}
    if mode == "compiled-torch" and dev.type != "cuda":
        return {"mode": mode, "na": "torch's symm_mem ops need CUDA"}
    graphed = mode.endswith("-graphed")
    if graphed and dev.type != "cuda":
        return {"mode": mode, "na": "CUDA graphs need a GPU"}
    _set_mode(mode, group, env["saved"], args.pretend_nccl)
    torch._dynamo.reset()
    t_in = args.seq // world if args.sp else args.seq
    check: dict[str, Any] = {}
    if compiled:
        torch.manual_seed(0)
        step = torch.compile(Block(args.embd, args.heads, world, group, dev, dt), fullgraph=True)
    elif graphed:
        t0 = time.perf_counter()
        step, check = _graphed_block(mode[:-len("-graphed")], args, env, (args.batch, t_in, args.embd))
        check["capture_and_check_s"] = time.perf_counter() - t0
        if not check["graph_check_ok"]:
            print(f"FAIL {mode}: the replayed step differs from the eager one (max relative error "
                  f"{check['graph_check_max_rel_err']:.2e})", flush=True)
    else:
        step = _eager_block(mode, args, env)
    g = torch.Generator(device="cpu").manual_seed(100 + (rank if args.sp else 0))
    xs = [torch.randn(args.batch, t_in, args.embd, generator=g).to(dev, dt).requires_grad_() for _ in range(2)]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def one(i: int) -> torch.Tensor:
        y = step(xs[i % 2])
        y.float().square().mean().backward()
        return y

    t0 = time.perf_counter()
    if compiled:
        _, codes = run_and_get_code(one, 0)  # compiles forward and backward
    else:
        one(0)
    first_s = time.perf_counter() - t0
    for i in range(args.warmup):
        one(i)
    saved = None if compiled or graphed else _saved_bytes(one)
    sync()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.steps):
        tdist.barrier(group=group)
        sync()
        t0 = time.perf_counter()
        one(i)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    med = torch.tensor([statistics.median(times)], dtype=torch.float64, device=dev)  # NCCL: a device tensor
    tdist.all_reduce(med, op=tdist.ReduceOp.MAX, group=group)  # the slowest rank's median
    out = {"mode": mode, "ms_per_step": med.item(), "tokens_per_s": args.batch * args.seq / med.item() * 1e3,
           "first_step_s": first_s, **check}
    if dev.type == "cuda":
        out["ms_per_step_queued"] = _queued_ms(one, args.steps, dev, group)
    if compiled:
        out["fused_calls"] = _fused_calls(codes)
    elif graphed:
        pass
    else:
        out["saved_mib"] = saved / 2 ** 20
        if args.sp:
            out["save_gathered"] = _save_gathered(mode, args)
    if args.host and not compiled and not graphed:
        out.update(_host_steps(one, args.host, dev, mode, args))
    if dev.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        if args.busy:
            out.update(_gpu_busy(one, args.busy, dev))
            # the GPU's busy time per step (the profile's) over the step's pace without the profiler
            out["busy_share_of_queued"] = out["busy_ms_per_step"] / out["ms_per_step_queued"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", action="store_true", help="sequence parallel (the compiled modes need it)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--embd", type=int, default=8192)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--save-gathered", choices=tuple(SAVE_GATHERED), default="auto",
                   help="sequence parallel: the column layers' save_gathered in the plain and library modes")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--pretend-nccl", action="store_true", help="patch the pass's NCCL check (CPU smoke runs)")
    p.add_argument("--host", type=int, default=0, metavar="STEPS",
                   help="eager modes: the host time per step, where it goes and the report (see above)")
    p.add_argument("--busy", type=int, default=0, metavar="STEPS",
                   help="a GPU: the GPU-busy share of STEPS more steps under torch.profiler (device activity)")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"unknown modes {bad}; known: {', '.join(MODES)}")
    ctx = dist.init()
    group, world, rank = ctx.tp_group, tdist.get_world_size(ctx.tp_group), tdist.get_rank(ctx.tp_group)
    dev = ctx.device if ctx.device.type == "cuda" else torch.device("cpu")
    if dev.type != "cuda":  # tiny shapes on gloo
        args.batch, args.seq, args.embd, args.heads = 2, 8 * world, 64, 4 * world
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    if args.seq % world or args.embd % args.heads or args.heads % world:
        p.error(f"seq {args.seq} must divide by the {world} ranks, embd {args.embd} by heads {args.heads}, "
                f"heads by the ranks")
    from torch._inductor import config

    env = {"dev": dev, "dt": torch.bfloat16 if dev.type == "cuda" else torch.float32, "group": group,
           "world": world, "rank": rank,
           "saved": {"_micro_pipeline_tp": config._micro_pipeline_tp,
                     "post_grad_custom_post_pass": config.post_grad_custom_post_pass}}
    rows = []
    for m in modes:
        try:
            rows.append(run_mode(m, args, env))
        except Exception as e:  # noqa: BLE001 - a capture that fails is a result; the other modes still run
            if not m.endswith("-graphed") or world > 1:
                raise
            import traceback

            traceback.print_exc()
            rows.append({"mode": m, "na": f"FAILED: {type(e).__name__}: {e}"[:2000]})
            torch.cuda.synchronize(dev)
    if rank == 0:
        doc = {"context": run_context(world), "args": vars(args), "rows": rows}
        if args.sp:
            doc["regather_plan"] = _regather_plans(args, world, env["dt"])
        if dev.type != "cuda":
            doc["note"] = "CPU run (gloo, tiny shapes): figures are not GPU figures"
            print(doc["note"])
        print(f"GPT block B={args.batch} T={args.seq} C={args.embd} heads={args.heads}, {world} ranks, "
              f"{'sequence parallel' if args.sp else 'not sequence parallel'}, {str(env['dt'])[6:]}, "
              f"forward + backward per step")
        print(f"{'mode':17} {'ms/step':>9} {'tokens/s':>10} {'peak GiB':>9} {'saved MiB':>9} {'1st step s':>10}  "
              f"save_gathered, or fused calls in the generated code")
        for r in rows:
            if "na" in r:
                print(f"{r['mode']:17} n/a: {r['na']}")
                continue
            calls = (", ".join(f"{k} x{v}" for k, v in r["fused_calls"].items() if v) or "none"
                     if "fused_calls" in r else str(r.get("save_gathered", "")))
            print(f"{r['mode']:17} {r['ms_per_step']:9.3f} {r['tokens_per_s']:10.0f} "
                  f"{r.get('peak_gib', float('nan')):9.2f} {r.get('saved_mib', float('nan')):9.2f} "
                  f"{r['first_step_s']:10.1f}  {calls}")
            if "ms_per_step_queued" in r:
                print(f"{'':17} {r['ms_per_step_queued']:.3f} ms per step with {args.steps} steps queued back to "
                      f"back (CUDA events, no profiler)")
            if "host_ms_per_step" in r:
                print(f"{'':17} {r['host_ms_per_step']:.3f} ms of host time to queue a step (median)")
            if "graph_check_ok" in r:
                print(f"{'':17} replay against the eager step, {r['graph_check_steps']} new inputs, "
                      f"{r['graph_check_tensors']} tensors: max relative error {r['graph_check_max_rel_err']:.2e} "
                      f"{'PASS' if r['graph_check_ok'] else 'FAIL'}")
            if "gpu_busy" in r:
                print(f"{'':17} GPU busy {r['gpu_busy']:.1%} of {r['busy_span_ms_per_step']:.3f} ms per step "
                      f"({args.busy} steps back to back, {r['busy_events']} device events); its "
                      f"{r['busy_ms_per_step']:.3f} busy ms are {r['busy_share_of_queued']:.1%} of the queued step")
        for q in doc.get("regather_plan", ()):
            print(f"save_gathered='auto' at {q['layer']} ({q['m']} x {q['n_shard']} x {q['k']}): "
                  f"{'regather' if q['regather'] else 'save'}; estimated gather {q['gather_ms']:.3f} + "
                  f"reduce-scatter {q['reduce_scatter_ms']:.3f} ms against GEMM {q['gemm_ms']:.3f} ms, "
                  f"{q['saved_mib']:.0f} MiB kept less")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, "block_sp.json" if args.sp else "block.json")
            with open(path, "w") as f:
                json.dump(doc, f, indent=1)
            print(f"wrote {path}")
    tdist.barrier(group=group)
    dist.shutdown()


if __name__ == "__main__":
    main()
