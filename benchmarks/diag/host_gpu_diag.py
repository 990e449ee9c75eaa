"""Host time against GPU time of the p2p ops at real shapes (2+ GPUs, torchrun or mpirun).

    bash launch/torchrun.sh 2 benchmarks/diag/host_gpu_diag.py [--calls 20] [--breakdown]

Per case (a fixed p2p config, no tuner), rank 0 prints, in ms per call:

back-to-back    the public op, calls back to back between two events (as the suite times it)
check none      the same with ``check="none"`` (no error-word snapshot per call)
direct          the op's internal ``_fused_p2p`` with ``check="none"`` (as the tuner times it)
host            host time to queue one call, the GPU held behind a sleep kernel (perf_counter)
gpu             GPU time per call with the host far ahead: the calls queued behind the
                sleep, timed from the sleep's end

When back-to-back is above gpu and close to host, the op is host-bound at that shape.
``--breakdown``: host time per call of the all-reduce op at a tiny shape with parts of it
replaced by no-ops in turn (each line drops one more part), so the differences say what
each part costs on the host.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from overlap import dist  # noqa: E402
from overlap.ops import Norm, OverlapConfig, all_gather_matmul, all_reduce_matmul  # noqa: E402
from overlap.ops import all_gather_p2p as _agp  # noqa: E402
from overlap.ops import all_reduce_p2p as _arp  # noqa: E402
from overlap.ops._runtime import get_runtime  # noqa: E402

SLEEP_CYCLES = 60_000_000  # ~30 ms at H200 clocks: longer than queueing the calls takes


def _slowest(v: float) -> float:
    t = torch.tensor([v], device="cuda")
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return float(t.item())


def back_to_back(fn, calls: int, reps: int = 5) -> float:
    out = []
    for _ in range(reps):
        tdist.barrier()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) / calls)
    out.sort()
    return _slowest(out[len(out) // 2])


def queued_ahead(fn, calls: int, reps: int = 3) -> tuple[float, float]:
    """(host ms per call, GPU ms per call) with the GPU held behind a sleep kernel."""
    hosts, gpus = [], []
    for _ in range(reps):
        tdist.barrier()
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        hosts.append((time.perf_counter() - t0) * 1e3 / calls)
        e.record()
        busy = not s.query()  # the sleep still ran when the last call was queued
        e.synchronize()
        gpus.append(s.elapsed_time(e) / calls if busy else float("nan"))
    hosts.sort()
    gpus.sort()
    return _slowest(hosts[len(hosts) // 2]), _slowest(gpus[len(gpus) // 2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--breakdown", action="store_true")
    args = ap.parse_args()
    dist.init()
    rank, world = tdist.get_rank(), tdist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    rt = get_runtime(tdist.group.WORLD, dev)
    bf = torch.bfloat16
    torch.manual_seed(rank)

    cases = []
    for m, n, k in ((8192, 1024, 8192), (16384, 2048, 8192)):
        a = torch.randn(m // world, k, device=dev, dtype=bf)
        w = torch.randn(n, k, device=dev, dtype=bf)
        cfg = OverlapConfig(chunks=1 if m == 8192 else 2, transport="p2p")
        cases.append((f"agmm {m}x{n}x{k} {cfg.chunks} chunks",
                      lambda a=a, w=w, cfg=cfg, c=None: all_gather_matmul(a, w.t(), config=cfg if c is None else c),
                      lambda a=a, w=w, cfg=cfg: _agp._fused_p2p(rt, a, w.t(), False, replace(cfg, check="none")),
                      cfg))
    for m, n, k, ln, fold in ((8192, 1024, 8192, False, False), (8192, 1024, 8192, True, False),
                              (8192, 1024, 8192, True, True), (16384, 2048, 8192, False, False)):
        x = torch.randn(m, k, device=dev, dtype=bf)
        w = torch.randn(n, k, device=dev, dtype=bf)
        res = torch.randn(m, k, device=dev, dtype=bf) if ln else None
        norm = Norm("layernorm", torch.ones(k, device=dev, dtype=bf), torch.zeros(k, device=dev, dtype=bf)) \
            if ln else None
        cfg = OverlapConfig(chunks=2 if m == 8192 else 16, reduce_ctas=32 if m == 8192 else 16, transport="p2p")
        if fold:  # the tuner's pick for this case at 48345d1 and cc75d86
            cfg = OverlapConfig(chunks=8, reduce_ctas=48, fold_norm=True, transport="p2p")
        cases.append((f"armm {m}x{n}x{k}{'+ln' if ln else ''} {cfg.chunks} chunks {cfg.reduce_ctas} SMs"
                      f"{' folded' if fold else ''}",
                      lambda x=x, w=w, res=res, norm=norm, cfg=cfg, c=None: all_reduce_matmul(
                          x, w.t(), residual=res, norm=norm, config=cfg if c is None else c),
                      lambda x=x, w=w, res=res, norm=norm, cfg=cfg: _arp._fused_p2p(
                          rt, x, w.t(), res, norm, replace(cfg, check="none")),
                      cfg))
    for name, fn, direct, cfg in cases:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        none_cfg = replace(cfg, check="none")
        b2b = back_to_back(fn, args.calls)
        b2b_none = back_to_back(lambda: fn(c=none_cfg), args.calls)
        b2b_direct = back_to_back(direct, args.calls)
        host, gpu = queued_ahead(fn, args.calls)
        if rank == 0:
            print(f"{name:44s} back-to-back {b2b:.3f}  check none {b2b_none:.3f}  direct {b2b_direct:.3f}  "
                  f"host {host:.3f}  gpu {gpu:.3f}", flush=True)

    if args.breakdown:
        launch_costs(dev, rank)
        breakdown(rt, dev, args.calls * 10, rank)
    tdist.barrier()
    dist.shutdown()


def launch_costs(dev, rank: int, n: int = 2000) -> None:
    """Host us per launch of the tile GEMM and the reduce kernel (tiny shapes, flags
    already satisfied): the library's calls, and Triton's compiled launcher alone."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from overlap import flags as F
    from overlap.kernels import add_norm, tile_gemm
    from overlap.policies import Segment, build_tile_table

    bf = torch.bfloat16
    a = torch.randn(256, 1024, device=dev, dtype=bf)
    w = torch.randn(512, 1024, device=dev, dtype=bf)
    c = torch.empty(256, 512, device=dev, dtype=bf)
    table = torch.tensor(build_tile_table([Segment(0, 0, 0, 256)], 512, 128, 256), dtype=torch.int32, device=dev)
    fl = torch.zeros(8, dtype=torch.int32, device=dev)
    cnt = torch.zeros(1, dtype=torch.int32, device=dev)
    ew = F.ErrorWord(dev)

    def us(fn) -> float:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        return out

    kw = dict(flags=fl, err=ew.word, wait=True, counter=cnt)
    gp = tile_gemm.TileGemmPlan(a, w.t(), c, table, **kw)
    descs = gp.operands(a, w.t())
    gp.launch(descs, c, epoch=0, grid=2)
    k = next(iter(tile_gemm._launcher._cache.values()))
    vals = (*descs, c, table, fl, ew.word, cnt, 512, 1024, table.shape[0], 0, 0, 500_000_000, 2_000_000, 2, 0, 512, 1,
            *[gp.meta[nm] for nm in tile_gemm._launcher.const_names])
    stream = torch.cuda.current_stream().cuda_stream
    x = torch.randn(512, 1024, device=dev, dtype=bf)
    recv = torch.randn(1, 512, 1024, device=dev, dtype=bf)
    h = torch.empty_like(x)
    starts = torch.tensor([0, 256, 512], dtype=torch.int32, device=dev)
    rf = torch.zeros(64, dtype=torch.int32, device=dev)
    ready = torch.zeros(2, dtype=torch.int32, device=dev)
    red = lambda: add_norm.launch_reduce_norm(x, recv, h, starts=starts, rflags=rf, ready=ready,  # noqa: E731
                                              err=ew.word, epoch=0, rank=0, world=2, programs=2, flag_stride=32)
    red()
    kr = next(iter(add_norm._reduce_launcher._cache.values()))
    rp = add_norm.ReducePlan(x, recv, h, starts=starts, rflags=rf, ready=ready, err=ew.word, rank=0, world=2,
                             programs=2, flag_stride=32)
    cases = {
        "torch.mm": lambda: torch.mm(a, w.t()),
        "launch_tile_gemm": lambda: tile_gemm.launch_tile_gemm(a, w.t(), c, table, grid=2, **kw),
        "TileGemmPlan.operands": lambda: gp.operands(a, w.t()),
        "TileGemmPlan.launch": lambda: gp.launch(descs, c, epoch=0, grid=2),
        "TensorDescriptor x1": lambda: TensorDescriptor(a, a.shape, a.stride(), [128, 64]),
        "tile GEMM compiled run alone": lambda: k.run(2, 1, 1, stream, k.function, k.packed_metadata, None, None,
                                                      None, *vals),
        "launch_reduce_norm": red,
        "ReducePlan.launch": lambda: rp.launch(x, recv, h, epoch=0),
        "reduce compiled run alone": lambda: kr.run(
            2, 1, 1, stream, kr.function, kr.packed_metadata, None, None, None, x, recv, x, h, h, x, x, rf, ready,
            ew.word, starts, 1024, 1e-5, 2, 32, 0, 0, 512 * 1024, 500_000_000, 2_000_000,
            *[v for v in (2, False, 0, False, 8, 1024, True, True, True)]),
        "stream_write_value": lambda: F.stream_write_value(torch.cuda.current_stream(), fl, 0, 0),
        "ErrorWord.check(block=False)": lambda: ew.check(block=False),
        "torch.empty_like 512x1024": lambda: torch.empty_like(x),
    }
    for name, fn in cases.items():
        try:
            t = us(fn)
            line = f"{t:8.1f} us"
        except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
            line = f"error {e!r}"[:160]
        if rank == 0:
            print(f"launch cost {name:32s} {line}", flush=True)


def breakdown(rt, dev, calls: int, rank: int) -> None:
    """Host us per call of the p2p all-reduce op at 512x1024x512, parts dropped one by one."""
    from overlap.kernels import tile_gemm
    from overlap.ops import _runtime

    bf = torch.bfloat16
    x = torch.randn(512, 1024, device=dev, dtype=bf)
    w = torch.randn(512, 1024, device=dev, dtype=bf)
    cfg = OverlapConfig(chunks=2, reduce_ctas=16, transport="p2p")

    def host_us() -> float:
        fn = lambda: all_reduce_matmul(x, w.t(), config=cfg)  # noqa: E731
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        tdist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        us = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
        return _slowest(us)

    saved = []

    def drop(obj, name, repl):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, repl)

    steps = [("full op", None),
             ("- report_errors", lambda: drop(_arp, "report_errors", lambda *a, **k: None)),
             ("- GEMM launches", lambda: drop(tile_gemm.TileGemmPlan, "launch", lambda *a, **k: None)),
             ("- GEMM operands", lambda: drop(tile_gemm.TileGemmPlan, "operands", lambda *a, **k: None)),
             ("- reduce launch", lambda: drop(__import__("overlap.kernels.add_norm", fromlist=["x"]).ReducePlan,
                                              "launch", lambda *a, **k: None)),
             ("- pushes", lambda: drop(_runtime.Runtime, "push", lambda *a, **k: None))]
    prev = None
    try:
        for label, act in steps:
            if act is not None:
                act()
            us = host_us()
            if rank == 0:
                d = "" if prev is None else f"  (part: {prev - us:6.1f})"
                print(f"breakdown armm 512x512x1024 p2p 2 chunks: {label:18s} {us:7.1f} us{d}", flush=True)
            prev = us
    finally:
        for obj, name, old in reversed(saved):
            setattr(obj, name, old)


if __name__ == "__main__":
    main()
