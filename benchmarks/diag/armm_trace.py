"""Where the time of one p2p all-reduce -> GEMM call goes: a GPU timeline per config.

    bash launch/torchrun.sh 2 benchmarks/diag/armm_trace.py [--M 16384 --N 2048 --K 8192] \
        [--cases nonorm:16:16:8,fold:16:20:2] [--out DIR]

A case is ``kind:chunks:reduce_sms:split_tail[:BMxBN]`` (split_tail ``<n>f``: exactly n
K pieces per tile of the last chunk, not capped by the SMs) with kind ``nonorm`` (no
residual, no norm), ``res`` (the residual, no norm), ``ln`` (residual + LayerNorm, normed rows written) or ``fold`` (the
LayerNorm folded into the GEMM); BMxBN: the GEMM's tile (128x128: 4 stages, 8 warps),
with a suffix ``ws`` its K loop warp-specialized (``GemmConfig.warp_specialize``).
``--time``: first time every case, interleaved, as the suite does (ms per call, slowest rank). Each case runs a few warm-up calls, then ``--calls`` calls back
to back under torch.profiler (CUPTI). Every rank then splits its GPU activities into
calls (a call's work all starts after the previous call's GEMM grids end, since its
streams fork from the caller's stream behind them) and prints, per call relative to the
start of its first push, medians over the calls after the first:

    push       first copy's start .. first copy's end .. last copy's end
    reduce     the reduce kernel's start .. end
    fold       the fold pass over B (fold only)
    gemm       the GEMM grid's start .. end; give-back grid's start .. end
    gap        previous call's end .. this call's first push (stream fork, memsets)

and the ends relative to the last push's end (what follows the communication). Also the
tile GEMM alone on all SMs and on those each case's reduce kernel leaves, and torch.mm.
``--soak S``: at the end, each of these back to back for S seconds with UTC stamps, to line
up with a clock and power log sampled beside (``benchmarks/diag/power_table.py`` reads both):
every case, the first case's communication with a thin GEMM, the tile GEMM alone on all
SMs and on those the first case leaves, torch.mm, NCCL's all-reduce, and idle.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


FORCED_PARTS: set[int] = set()
"""split_tail values that cases give as ``<n>f``: the last chunk's tiles in exactly n K
pieces, not capped at the pieces the GPU's SMs run at once (``policies.tail_parts``)."""


def parse_case(s: str) -> tuple[str, int, int, int, tuple[int, int, bool] | None]:
    kind, ch, rc, sp, *tile = s.split(":")
    if kind not in ("nonorm", "res", "ln", "fold"):
        raise SystemExit(f"bad case kind {kind!r}")
    bm_bn = None
    if tile:
        ws = tile[0].endswith("ws")
        bm, bn = (int(v) for v in tile[0].removesuffix("ws").split("x"))
        bm_bn = (bm, bn, ws)
    if sp.endswith("f"):
        sp = sp[:-1]
        FORCED_PARTS.add(int(sp))
    return kind, int(ch), int(rc), int(sp), bm_bn


def force_parts(cases: list[str]) -> None:
    """Make the ``<n>f`` split values exact for every case of the run (so a case may not
    also ask for the same n capped)."""
    specs = [parse_case(c)[3] for c in cases]
    if not FORCED_PARTS:
        return
    capped = [c for c, sp in zip(cases, specs) if sp in FORCED_PARTS and not c.split(":")[3].endswith("f")]
    if capped:
        raise SystemExit(f"cases {capped} ask for a forced split value capped")
    import overlap.ops.all_reduce as ar

    plain = ar.tail_parts

    def tail_parts(tail_tiles: int, sms: int, k_steps: int, max_parts: int) -> int:
        if max_parts in FORCED_PARTS and tail_tiles > 0:
            return min(max_parts, k_steps)
        return plain(tail_tiles, sms, k_steps, max_parts)

    ar.tail_parts = tail_parts


def gpu_events(path: str) -> list[dict]:
    with open(path) as f:
        ev = json.load(f)["traceEvents"]
    out = []
    for e in ev:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        out.append({"cat": e["cat"], "name": e.get("name", ""), "ts": float(e["ts"]), "end": float(e["ts"]) + float(e["dur"]),
                    "stream": (e.get("args") or {}).get("stream", e.get("tid"))})
    out.sort(key=lambda e: e["ts"])
    return out


def split_calls(evs: list[dict]) -> list[list[dict]]:
    """Calls by GEMM grids: a call ends with its tile_gemm launches (the main grid and,
    overlapping it on another stream, the give-back grid); the next call's work all
    starts after them."""
    gemms = [e for e in evs if "tile_gemm" in e["name"]]
    ends = []
    i = 0
    while i < len(gemms):
        grp = [gemms[i]]
        if i + 1 < len(gemms) and gemms[i + 1]["stream"] != gemms[i]["stream"] and gemms[i + 1]["ts"] < gemms[i]["end"]:
            grp.append(gemms[i + 1])
            i += 1
        ends.append(max(e["end"] for e in grp))
        i += 1
    bounds = [-1e30] + ends
    return [[e for e in evs if bounds[c] <= e["ts"] < bounds[c + 1]] for c in range(len(ends))]


def summarize(call: list[dict], prev_end: float | None) -> dict[str, float]:
    cps = [e for e in call if e["cat"] == "gpu_memcpy"]
    if not cps:
        return {}
    t0 = cps[0]["ts"]
    r: dict[str, float] = {"push first end": cps[0]["end"] - t0, "push last end": cps[-1]["end"] - t0,
                           "copies": len(cps)}
    red = [e for e in call if "reduce_norm" in e["name"]]
    fold = [e for e in call if "fold_norm" in e["name"]]
    gem = [e for e in call if "tile_gemm" in e["name"]]
    if red:
        r["reduce start"], r["reduce end"] = red[0]["ts"] - t0, red[0]["end"] - t0
    if fold:
        r["fold start"], r["fold end"] = fold[0]["ts"] - t0, fold[0]["end"] - t0
    if gem:
        r["gemm start"], r["gemm end"] = gem[0]["ts"] - t0, gem[0]["end"] - t0
    if len(gem) > 1:
        r["giveback start"], r["giveback end"] = gem[1]["ts"] - t0, gem[1]["end"] - t0
    end = max(e["end"] for e in call)
    r["call end"] = end - t0
    r["after push: reduce end"] = r.get("reduce end", 0.0) - r["push last end"]
    r["after push: call end"] = r["call end"] - r["push last end"]
    if prev_end is not None:
        r["gap before"] = t0 - prev_end
    return r


def push_variants(x: torch.Tensor, g, rank: int, world: int, dev, log) -> None:
    """16 pushes of x's bytes into the peer's memory, a peer flag write after each, in
    four stream orders (what a chunked push costs beyond one copy of the same bytes)."""
    from benchmarks.suite.timing import Timer
    from overlap import flags as _flags
    from overlap._p2p import memcpy_async
    from overlap.ops._runtime import get_runtime

    rt = get_runtime(g, dev)
    heap = rt.p2p()
    if heap is None or world != 2:
        log("push variants: need peer memory and 2 ranks")
        return
    drv = _flags._cuda_driver()
    peer = 1 - rank
    nbytes = x.numel() * x.element_size()
    chunks = 16
    piece = nbytes // chunks
    blk = heap.block("trace_push", nbytes)
    sf = heap.flags("trace_push_flags", 64)
    cur = torch.cuda.current_stream(dev)
    s1, s2, s3 = (torch.cuda.Stream(dev, priority=-1) for _ in range(3))
    evs = [torch.cuda.Event() for _ in range(chunks)]
    epoch = [0]
    src = x.data_ptr()

    def write(stream, idx, fence=True):
        if fence:
            _flags.stream_write_value(stream, sf.peer(peer), idx, epoch[0])
        else:
            ptr = sf.peer(peer).data_ptr() + idx * 4
            drv.cuStreamWriteValue32(drv.CUstream(stream.cuda_stream), drv.CUdeviceptr(ptr), epoch[0],
                                     drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER)

    def run(kind):
        epoch[0] += 1
        for st in (s1, s2, s3):
            st.wait_stream(cur)
        for c in range(chunks):
            dst, sp = blk.ptrs[peer] + c * piece, src + c * piece
            if kind in ("one stream", "one stream, no fence"):
                memcpy_async(dst, sp, piece, s1)
                write(s1, c, kind == "one stream")
            elif kind == "one copy":
                if c == 0:
                    memcpy_async(blk.ptrs[peer], src, nbytes, s1)
                    write(s1, 0)
            elif kind == "two chained streams":
                st = (s1, s2)[c % 2]
                if c:
                    st.wait_event(evs[c - 1])
                memcpy_async(dst, sp, piece, st)
                evs[c].record(st)
                write(st, c)
            elif kind == "flags on own stream":
                memcpy_async(dst, sp, piece, s1)
                evs[c].record(s1)
                s3.wait_event(evs[c])
                write(s3, c)
        for st in (s1, s2, s3):
            cur.wait_stream(st)

    timer = Timer(group=g, device=dev, iters=10, warmup=3, reps=5)
    kinds = ["one copy", "one stream", "one stream, no fence", "two chained streams", "flags on own stream"]
    got = timer.time_interleaved({kk: (lambda kk=kk: run(kk)) for kk in kinds},
                                 lambda name, e: log(f"  {name}: error {e!r}"))
    for name, ms in got.items():
        log(f"push {nbytes >> 20} MB in {chunks if name != 'one copy' else 1}, {name}: {ms * 1000:.1f} us, "
            f"{nbytes / ms / 1e6:.0f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", type=int, default=16384)
    ap.add_argument("--N", type=int, default=2048)
    ap.add_argument("--K", type=int, default=8192)
    ap.add_argument("--cases", default="nonorm:16:16:8,fold:16:20:2,fold:16:20:0,fold:16:16:2,ln:16:32:2")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--soak", type=float, default=0.0,
                    help="at the end, run each case, the first case's communication alone, the GEMMs alone, "
                         "NCCL's all-reduce and idle back to back for this many seconds each; prints UTC stamps")
    ap.add_argument("--out", default="")
    ap.add_argument("--time", action="store_true", help="time the cases first, interleaved")
    ap.add_argument("--push", action="store_true", help="also time push variants: 16 copies of M*K/16 rows' bytes "
                    "with a peer flag write after each, on one stream, on two event-chained streams, "
                    "with the flag writes on a stream of their own, and without the writes' memory fence")
    args = ap.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from benchmarks.suite.timing import Timer
    from overlap import dist
    from overlap.kernels.tile_gemm import DEFAULT_CONFIG, GemmConfig, launch_tile_gemm
    from overlap.ops import Norm, OverlapConfig, all_reduce_matmul
    from overlap.policies import Segment, build_tile_table

    dist.init()
    rank, world = tdist.get_rank(), tdist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = tdist.group.WORLD
    m, n, k = args.M, args.N, args.K
    gen = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
    resid = torch.randn(m, k, device=dev, generator=torch.Generator(device=dev).manual_seed(99)).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(k, device=dev, generator=gen)).to(torch.bfloat16)
    bias = (0.1 * torch.randn(k, device=dev, generator=gen)).to(torch.bfloat16)
    b = (torch.randn(n, k, device=dev, generator=gen) * k ** -0.5).to(torch.bfloat16).t()
    nrm = Norm("layernorm", w, bias)
    outdir = args.out or "."
    os.makedirs(outdir, exist_ok=True)
    report: dict[str, dict] = {}

    def log(s: str) -> None:
        if rank == 0:
            print(s, flush=True)

    log(f"armm trace {m}x{n}x{k} bf16 world {world}; times in us, medians over calls 2..{args.calls}")
    if args.push:
        push_variants(x, g, rank, world, dev, log)
    fns = {}
    fns_cases = fns
    force_parts(args.cases.split(","))
    for spec in args.cases.split(","):
        kind, ch, rc, sp, tile = parse_case(spec)
        gemm = None
        if tile is not None:
            gemm = GemmConfig(block_m=tile[0], block_n=tile[1], num_stages=3 if tile[1] >= 256 else 4, num_warps=8,
                              warp_specialize=tile[2])
        cfg = OverlapConfig(chunks=ch, reduce_ctas=rc, transport="p2p", split_tail=sp, fold_norm=kind == "fold",
                            gemm=gemm)
        kw = {} if kind == "nonorm" else {"residual": resid} if kind == "res" else {"residual": resid, "norm": nrm}
        fns[spec] = lambda cfg=cfg, kw=kw: all_reduce_matmul(x, b, group=g, config=cfg, **kw)
        for _ in range(3):
            fns[spec]()
        torch.cuda.synchronize()
        tdist.barrier()
    if args.time:
        timer = Timer(group=g, device=dev, iters=10, warmup=3, reps=5)
        got = timer.time_interleaved(fns, lambda name, e: log(f"  {name}: error {e!r}"))
        for name, ms in got.items():
            log(f"time {name}: {ms:.3f} ms per call")
            report[f"time {name}"] = ms
    for spec, fn in (fns.items() if args.calls else ()):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        tdist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                fn()
            torch.cuda.synchronize()
        path = os.path.join(outdir, f"trace_{spec.replace(':', '_')}.rank{rank}.json")
        prof.export_chrome_trace(path)
        calls = split_calls(gpu_events(path))
        rows = []
        prev = None
        for c in calls:
            s = summarize(c, prev)
            if s:
                rows.append(s)
            prev = max(e["end"] for e in c) if c else prev
        # absolute times of each call's first push, last push end, reduce end, GEMM end
        absl = []
        for cc in calls:
            cps = [e for e in cc if e["cat"] == "gpu_memcpy"]
            red = [e for e in cc if "reduce_norm" in e["name"]]
            if cps and red:
                absl.append((cps[0]["ts"], cps[-1]["end"], red[0]["end"], max(e["end"] for e in cc)))
        peers = [None] * world
        tdist.all_gather_object(peers, absl)
        if rank == 0 and world == 2 and all(peers):
            print("  per call, us from rank 0's first push (both GPUs on the host's clock): "
                  "start r0 r1 | last push end r0 r1 | reduce end r0 r1 | end r0 r1", flush=True)
            for i in range(min(len(peers[0]), len(peers[1]))):
                z = peers[0][i][0]
                v = [peers[r][i][j] - z for j in range(4) for r in range(2)]
                print("   " + " | ".join(f"{v[2 * j]:7.1f} {v[2 * j + 1]:7.1f}" for j in range(4)), flush=True)
        rows = rows[1:] if len(rows) > 1 else rows
        keys = [kk for kk in rows[0]] if rows else []
        med = {kk: statistics.median(r[kk] for r in rows if kk in r) for kk in keys}
        report[f"{spec} rank{rank}"] = med
        allmed = [None] * world
        tdist.all_gather_object(allmed, med)
        if rank == 0:
            print(f"case {spec} ({len(rows)} calls)", flush=True)
            for kk in keys:
                print(f"  {kk:24s} " + "  ".join(f"{(am or {}).get(kk, float('nan')):8.1f}" for am in allmed),
                      flush=True)
        if rank != 0:
            os.remove(path)  # one rank's trace files are enough to keep
        tdist.barrier()

    # the tile GEMM alone, on all SMs and on fewer; torch.mm
    timer = Timer(group=g, device=dev, iters=20, warmup=3, reps=5)
    a = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
    c = a.new_empty(m, n)
    table = torch.tensor(build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, DEFAULT_CONFIG.block_m,
                                          DEFAULT_CONFIG.block_n), dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    # all SMs, and those each case's reduce kernel leaves the GEMM
    counts = sorted({sms} | {sms - parse_case(sp)[2] for sp in args.cases.split(",") if 0 < parse_case(sp)[2] < sms},
                    reverse=True)
    fns = {f"tile gemm on {s} SMs": (lambda s=s: launch_tile_gemm(a, b, c, table, grid=s)) for s in counts}
    fns["torch.mm"] = lambda: torch.mm(a, b, out=c)
    got = timer.time_interleaved(fns, lambda name, e: log(f"  {name}: error {e!r}"))
    for name, ms in got.items():
        log(f"{name}: {ms * 1000:.1f} us")
        report[name] = ms
    if args.soak:
        # back to back for a while each, with UTC stamps to line up with a clock / power log
        # sampled beside (benchmarks/diag/power_table.py): every case; the first case's
        # communication and reduce kernel with a GEMM of 256 columns (its own GEMM's work
        # about 1/8); the tile GEMM alone on all SMs and on those the first case leaves;
        # torch.mm; NCCL's all-reduce of x; idle
        first = args.cases.split(",")[0]
        kind, ch, rc, sp, tile = parse_case(first)
        grid = sms - rc
        b_thin = (torch.randn(256, k, device=dev, generator=gen) * k ** -0.5).to(torch.bfloat16).t()
        kw = {} if kind == "nonorm" else {"residual": resid} if kind == "res" else {"residual": resid, "norm": nrm}
        cfg = OverlapConfig(chunks=ch, reduce_ctas=rc, transport="p2p", split_tail=sp, fold_norm=kind == "fold")
        xs = x.clone()
        phases = [(f"op {spec}", fn) for spec, fn in fns_cases.items()]
        phases += [(f"comm {first} N=256", lambda: all_reduce_matmul(x, b_thin, group=g, config=cfg, **kw)),
                   (f"tile gemm on {sms} SMs", lambda: launch_tile_gemm(a, b, c, table, grid=sms)),
                   (f"tile gemm on {grid} SMs", lambda: launch_tile_gemm(a, b, c, table, grid=grid)),
                   ("torch.mm", lambda: torch.mm(a, b, out=c)),
                   ("nccl all_reduce", lambda: tdist.all_reduce(xs, group=g)),
                   ("idle", None)]
        for name, fn in phases:
            if fn is not None:
                for _ in range(3):
                    fn()
            torch.cuda.synchronize()
            tdist.barrier()
            t0, calls = time.time(), 0
            if fn is None:
                time.sleep(args.soak)
                calls = 1
            while fn is not None:
                # rank 0's clock decides for every rank whether another batch runs: a rank
                # that made calls its peer did not would wait for the peer's pushes
                go = torch.tensor([int(time.time() - t0 < args.soak)], device=dev)
                tdist.broadcast(go, src=0, group=g)
                if not go.item():
                    break
                for _ in range(50):
                    fn()
                calls += 50
                torch.cuda.synchronize()
            t1 = time.time()
            utc = [datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%H:%M:%S.%f")[:-3]
                   for t in (t0, t1)]
            log(f"soak {name}: {calls} calls from {utc[0]} to {utc[1]} UTC, {(t1 - t0) / max(calls, 1) * 1e3:.3f} ms per call")
            report[f"soak {name}"] = [t0, t1, calls]
    if rank == 0 and args.out:
        with open(os.path.join(outdir, "armm_trace.json"), "w") as f:
            json.dump(report, f, indent=1)
    tdist.barrier()
    dist.shutdown()


if __name__ == "__main__":
    main()
