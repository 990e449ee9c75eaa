"""The benchmark runner: every op's variants side by side in one process group.

    bash launch/torchrun.sh 2 benchmarks/run.py --ops agmm,armm,chain \
        --shapes gpt3-175b,llama-70b,comm-heavy --out DIR
    bash launch/mpirun.sh   2 benchmarks/run.py --ops agmm --shape 8192x1024x8192 --out DIR

Every rank runs the same cases in the same order (the timers hold collectives); rank 0
prints a progress line per case, the tables at the end, and writes DIR/results.json,
DIR/results.md and DIR/<op>.png. ``--profile`` adds, per case and variant, what
``overlap.report()`` saw of a few profiled calls after the timing (``suite/observed.py``):
the path taken and why, CUDA-event phase times and the hidden fraction. Without a GPU it
runs on gloo with every shape scaled down (largest dim <= --cpu-max-dim) and says that
its figures are not GPU figures.
Exit status: 0, or 1 when a variant of the library or a baseline raised (the reports
are written either way; the error is in them).
"""

from __future__ import annotations

import argparse
import gc
import shlex
import sys
import time
import traceback
import warnings
from typing import Any

import torch

from . import available_ops, load_op, report
from .shapes import CPU_MAX_DIM, SETS, check_suffixes, for_cpu, select
from .spec import Case, Env, OpSpec, Shape
from .timing import Timer, any_rank, slowest

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="all", help=f"comma list of ops, or all (known: {','.join(available_ops())})")
    ap.add_argument("--shapes", default=None,
                    help=f"comma list of named shape sets, or all (known: {','.join(SETS)}); "
                         "default all, or none when --shape is given")
    ap.add_argument("--shape", action="append", default=[], metavar="MxNxK",
                    help="a shape by numbers, M x N x K (e.g. 8192x1024x8192; armm takes +ln); repeatable")
    ap.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                    help="auto: bf16 on GPUs, fp32 on CPU")
    ap.add_argument("--iters", type=int, default=20, help="timed calls (GPU: per batch)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls before timing")
    ap.add_argument("--reps", type=int, default=5, help="GPU: batches of --iters calls back to back; median batch")
    ap.add_argument("--out", default=None, help="directory for results.json, results.md, <op>.png")
    ap.add_argument("--no-tune", action="store_true", help="skip the library's tuners")
    ap.add_argument("--no-synced", action="store_true", help="GPU: skip the every-call-synchronized timings")
    ap.add_argument("--cpu-max-dim", type=int, default=CPU_MAX_DIM,
                    help="CPU: scale every shape so its largest dim is at most this (0: run shapes as given)")
    ap.add_argument("--timeout", type=float, default=300.0, help="bound on waits for other ranks, seconds")
    ap.add_argument("--profile", action="store_true",
                    help="after timing each case, profile a few calls of each variant and add what "
                         "overlap.report() says (path, phase times, hidden fraction) to the JSON")
    ap.add_argument("--profile-calls", type=int, default=5, help="with --profile: calls per variant")
    args = ap.parse_args(argv)
    ops = available_ops() if args.ops.strip() in ("", "all") else [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in available_ops()]
    if unknown:
        ap.error(f"unknown op(s) {', '.join(unknown)}; known: {', '.join(available_ops())}")
    args.ops = ops
    args.sets = ([] if args.shape else ["all"]) if args.shapes is None else [
        s.strip() for s in args.shapes.split(",") if s.strip()]
    if args.iters < 1 or args.warmup < 0 or args.reps < 1 or args.profile_calls < 1:
        ap.error("--iters, --reps and --profile-calls must be >= 1, --warmup >= 0")
    try:
        specs = [load_op(o) for o in ops]  # every shape argument must make sense before any process starts
        for op in specs:
            select(op, args.sets, args.shape)
        check_suffixes(specs, args.shape)
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from overlap import dist

    ctx = dist.init(timeout_s=args.timeout)
    try:
        return run(args, ctx, argv if argv is not None else sys.argv[1:])
    finally:
        dist.shutdown()


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


def run(args: argparse.Namespace, ctx: Any, argv: list[str]) -> int:
    on_gpu = ctx.device.type == "cuda"
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if on_gpu else torch.float32)
    env = Env(device=ctx.device, dtype=dtype, group=ctx.tp_group, world=ctx.tp_size, rank=ctx.tp_rank,
              tune=not args.no_tune, verbose=ctx.is_main)
    timer = Timer(group=env.group, device=env.device, iters=args.iters, warmup=args.warmup, reps=args.reps)
    say = (lambda *a: print(*a, flush=True)) if ctx.is_main else (lambda *a: None)
    if not on_gpu:  # the tables label these fallbacks; one warning per op and rank is noise
        warnings.filterwarnings("ignore", message=r".*no tile-flag path", category=UserWarning)
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor. is deprecated", category=FutureWarning)

    plan: list[tuple[OpSpec, list[tuple[Shape, Shape]], list[str]]] = []
    for name in args.ops:
        op = load_op(name)
        shapes, notes = select(op, args.sets, args.shape)
        scale = not on_gpu and args.cpu_max_dim > 0
        plan.append((op, [(s, for_cpu(s, env.world, args.cpu_max_dim) if scale else s) for s in shapes], notes))
    total = sum(len(p[1]) for p in plan)
    dname = str(dtype).removeprefix("torch.")
    say(f"benchmark suite: ops {','.join(args.ops)}; {total} cases; {env.world} ranks on {ctx.backend}; "
        f"{dname}; {timer.method}")
    if on_gpu:
        say(f"GPU: {torch.cuda.get_device_name(env.device)}")
    else:
        say(f"*** {report.NOT_GPU} ***")
        if args.cpu_max_dim > 0:
            say(f"CPU: every shape scaled down to a largest dim <= {args.cpu_max_dim} (run dims in the JSON)")

    doc: dict[str, Any] = {
        "gpu": on_gpu,
        "note": None if on_gpu else report.NOT_GPU,
        "cpu_max_dim": None if on_gpu or args.cpu_max_dim <= 0 else args.cpu_max_dim,
        "world": env.world, "backend": ctx.backend, "dtype": dname, "timing": timer.method,
        "command": "benchmarks/run.py " + shlex.join(argv),
        "args": dict(vars(args)),
        "ops": {}, "results": [],
    }
    failed = 0
    i = 0
    for op, shapes, notes in plan:
        meta: dict[str, Any] = {"title": op.title, "comm": op.comm, "status": "ok", "library": op.library,
                                "floor": op.floor, "part_titles": dict(op.part_titles),
                                "floor_title": op.floor_title, "speedup": op.speedup, "set_notes": notes,
                                "variants": {}}
        doc["ops"][op.name] = meta
        for n in notes:
            say(n)
        for j, (shape, run_shape) in enumerate(shapes):
            i += 1
            t0 = time.perf_counter()
            status, rec = run_case(op, shape, run_shape, env, timer, args, meta)
            if status == "unavailable":
                meta["status"], meta["error"] = "unavailable", rec
                say(f"op {op.name} unavailable: {rec}")
                i += len(shapes) - j - 1
                break
            doc["results"].append(rec)
            failed += sum(1 for n in rec.get("errors", {})
                          if meta["variants"].get(n, {}).get("role") != "external")
            say(progress(i, total, op, rec, meta, time.perf_counter() - t0))
            del rec
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
    if ctx.is_main:
        from benchmarks.context import run_context

        doc["context"] = run_context(env.world)
        if args.out:
            written = report.write(doc, args.out)
        else:
            written = []
        print("\n" + report.text_report(doc), flush=True)
        if doc.get("plot_note"):
            print(doc["plot_note"], flush=True)
        if written:
            print("wrote " + ", ".join(written), flush=True)
        elif not args.out:
            print("no --out given: nothing written", flush=True)
        if failed:
            print(f"{failed} variant(s) or part(s) failed; see ERROR lines above and 'errors' in the JSON", flush=True)
    return 1 if failed else 0


def progress(i: int, total: int, op: OpSpec, rec: dict, meta: dict, secs: float) -> str:
    ms = rec["ms"]
    parts = " ".join(f"{t} {report.fmt(ms.get(p))}" for p, t in meta["part_titles"].items())
    vs = " ".join(f"{v['title']} {'err' if n in rec.get('errors', {}) else report.fmt(ms.get(n))}"
                  for n, v in meta["variants"].items())
    shape = rec["label"]
    if rec.get("run_dims"):
        shape += f" (ran {'x'.join(str(v) for v in rec['run_dims'].values())})"
    lib = op.library
    lib_title = meta["variants"].get(lib, {}).get("title", lib)
    extra = f"{lib_title} / floor {report.fmt(rec.get('vs_floor', {}).get(lib), 2)}"
    if op.comm:
        h = rec.get("hidden_frac", {}).get(lib)
        extra += f" hidden {'n/a' if h is None else f'{100 * h:.0f}%'}"
    if "observed" in rec:
        h = rec["observed"].get(lib, {}).get("hidden")
        extra += f" report-hidden {'n/a' if h is None else f'{100 * h:.0f}%'}"
    if rec.get("speedup"):
        extra += " " + " ".join(f"{k} {report.fmt(v, 2)}" for k, v in rec["speedup"].items())
    if "tuned" in rec:
        extra += f" tuned {rec['tuned']}"
    if rec.get("errors"):
        extra += f" ERRORS: {', '.join(rec['errors'])}"
    w = len(str(total))
    return (f"[{i:>{w}}/{total}] {op.name} {rec['set']} {shape} {rec['dtype']}: {parts} floor "
            f"{report.fmt(rec.get('floor_ms'))} | {vs} | {extra} ({secs:.1f} s)")


def run_case(op: OpSpec, shape: Shape, run_shape: Shape, env: Env, timer: Timer, args: argparse.Namespace,
             meta: dict) -> tuple[str, Any]:
    """Set up and time one shape of one op on every rank. ("unavailable", reason) when the
    op cannot be imported; else ("ok", record)."""
    rec: dict[str, Any] = {"op": op.name, "set": shape.set, "label": shape.label, "name": shape.name,
                           "dims": dict(shape.dims), "params": dict(shape.params),
                           "dtype": str(env.dtype).removeprefix("torch."), "world": env.world,
                           "ms": {}, "na": {}, "notes": {}, "errors": {}}
    if run_shape.dims != shape.dims:
        rec["run_dims"] = dict(run_shape.dims)
    if args.profile:
        from overlap import observe

        observe.reset_report()  # this case's calls, tuning and warnings alone
    case: Case | None = None
    code, why = 0, ""
    try:
        case = op.setup(run_shape, env)
    except ImportError as e:
        code, why = 1, _err(e)
    except Exception as e:
        code, why = 2, _err(e)
        traceback.print_exc()
    worst = int(slowest(float(code), env.group, env.device))
    if worst == 1:
        return "unavailable", why or "not importable on another rank"
    if worst == 2 or case is None:
        rec["errors"]["setup"] = why or "setup failed on another rank"
        meta["variants"].setdefault("setup", {"title": "setup", "role": "baseline"})
        return "ok", rec
    for n, v in case.variants.items():
        meta["variants"].setdefault(n, {"title": v.title, "role": v.role, "note": v.note})
    ms, errors = rec["ms"], rec["errors"]

    def measure(key: str, fn: Any, synced: bool = False) -> float | None:
        err = None
        try:
            t = timer.time(fn, synced=synced)
        except Exception as e:
            err, t = _err(e), None
            if env.verbose:
                traceback.print_exc()
        if any_rank(err is not None, env.group, env.device):
            errors[key] = err or "failed on another rank"
            return None
        return t

    # tuners first, then every figure of the case
    fns: dict[str, Any] = dict(case.parts)
    fns.update(case.extra)
    counted: dict[str, Any] = {}
    for n, v in case.variants.items():
        if v.na is not None:
            ms[n] = None
            rec["na"][n] = v.na
            continue
        if v.note:
            rec["notes"][n] = v.note
        if v.prepare is not None:
            try:
                rec["tuned"] = v.prepare()
            except Exception as e:
                rec["tuned"] = None
                errors[f"{n}_prepare"] = _err(e)
        fns[n] = v.fn
        if v.counter:
            counted[n] = (v.counter, v.counter())
    if timer.cuda:
        # interleaved rounds: clock and temperature drift over a case hits all alike
        def failed(name: str, exc: BaseException | None) -> None:
            errors[name] = _err(exc) if exc is not None else "failed on another rank"
            if exc is not None and env.verbose:
                traceback.print_exception(exc)

        got = timer.time_interleaved(fns, failed)
        for name in fns:
            ms[name] = got.get(name)
    else:
        for name, fn in fns.items():
            ms[name] = measure(name, fn)
    fast: dict[str, int] = {n: c() - before for n, (c, before) in counted.items()}
    synced: dict[str, float | None] = {}
    for n, v in case.variants.items():
        if v.synced and env.on_gpu and not args.no_synced and ms.get(n) is not None:
            synced[n] = measure(f"{n}_synced", v.fn, synced=True)
    if synced:
        rec["synced_ms"] = synced
    if fast:
        rec["fast_path_calls"] = fast
    if args.profile and op.observed:
        profile_case(op, case, env, args, rec)
    if case.check is not None and ms.get(op.library) is not None:
        try:
            rec["check"] = case.check()
        except Exception as e:
            errors["check"] = _err(e)
    if case.finish is not None:
        try:
            case.finish()
        except Exception as e:
            errors["finish"] = _err(e)
    rec["info"] = case.info
    derive(op, case, rec, env.world)
    return "ok", rec


def profile_case(op: OpSpec, case: Case, env: Env, args: argparse.Namespace, rec: dict) -> None:
    """``--profile``: rec["observed"] (per variant: what overlap.report() saw, every key
    present, None where it saw nothing) and rec["observed_report"] (the op's report rows)."""
    from .observed import empty, observe_case

    skip = {n for n in rec["errors"]} | {n for n, v in case.variants.items() if v.na is not None}
    sync = (lambda: torch.cuda.synchronize(env.device)) if env.on_gpu else None
    try:
        seen, rows = observe_case(case, op.observed, args.profile_calls, skip, sync)
    except Exception as e:
        rec["errors"]["profile"] = _err(e)
        if env.verbose:
            traceback.print_exc()
        seen, rows = {}, []
    rec["observed"] = {n: seen.get(n, empty()) for n, v in case.variants.items()
                       if v.role != "external" and v.na is None}
    rec["observed_report"] = rows


def derive(op: OpSpec, case: Case, rec: dict, world: int) -> None:
    """floor, time / floor, TFLOP/s, bus bandwidth, fraction of communication hidden."""
    ms = rec["ms"]
    part_t = [ms.get(p) for p in case.parts]
    floor = None
    if part_t and all(t is not None for t in part_t):
        floor = max(part_t) if op.floor == "max" else sum(part_t)
    rec["floor_ms"] = floor
    rec["flops"] = case.flops
    rec["comm_bytes"] = case.comm_bytes
    ref = next((n for n, v in case.variants.items() if v.role == "reference"), None)
    timed = {n: ms[n] for n in case.variants if ms.get(n)}
    rec["sequential_ms"] = floor if op.floor == "sum" else ms.get(ref)
    rec["vs_floor"] = {n: t / floor for n, t in timed.items()} if floor else {}
    rec["tflops"] = {n: case.flops / (t * 1e-3) / 1e12 for n, t in timed.items()}
    if op.comm:
        f = report.BUSBW_FACTOR[op.comm](world)
        rec["busbw_GBps"] = {p: f * case.comm_bytes / (t * 1e-3) / 1e9
                             for p, t in ms.items() if p.startswith("comm") and t}
        comm, seq = ms.get("comm"), ms.get(ref)
        if comm and seq:
            rec["hidden_frac"] = {n: (seq - t) / comm for n, t in timed.items() if n != ref}
    if op.speedup:
        a, b = op.speedup
        if ms.get(a) and ms.get(b):
            rec["speedup"] = {f"{a}_over_{b}": ms[b] / ms[a]}
