"""Host time per call of the collective ops (run on 2+ GPUs under torchrun or mpirun).

    bash launch/torchrun.sh 2 benchmarks/diag/host_overhead_ops.py [--calls 300]

Small shapes, calls back to back, so the GPU is never the bottleneck: the time per
call is the host's (Python, Triton's launcher, the driver). Rank 0 prints the
microseconds per call of each op and transport, then a cProfile of the p2p calls
(top functions by own time). Where an op's GPU time is below this figure, the op is
host-bound and a benchmark measures the host, not the overlap.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from overlap import dist  # noqa: E402
from overlap.ops import (Norm, NcclTransport, OverlapConfig, PeerCopyTransport, all_gather_matmul,  # noqa: E402
                         all_reduce_matmul)


def per_call_us(fn, calls: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    tdist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return dt


def kernel_table(name: str, fn, rank: int) -> None:
    """GPU side of ``fn``: ms per synchronized call (events), and the kernels of 20 calls."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        tdist.barrier()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    times.sort()
    # start the profiler on every rank before any rank queues work: its start-up
    # stalls one rank's queue for longer than a peer's flag wait may last
    prof = profile(activities=[ProfilerActivity.CUDA])
    prof.start()
    torch.cuda.synchronize()
    tdist.barrier()
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    prof.stop()
    tdist.barrier()
    if rank == 0:
        print(f"--- {name}: GPU ms per synchronized call: median {times[10]:.3f}, min {times[0]:.3f}, "
              f"max {times[-1]:.3f}", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--kernels", action="store_true",
                    help="also print torch.profiler's GPU kernel table of 20 calls of each p2p case, "
                         "and the GPU time per call with the host held off (synchronized calls)")
    args = ap.parse_args()
    dist.init()
    rank = tdist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)
    w = torch.randn(512, 1024, device=dev, dtype=torch.bfloat16)
    res = torch.randn(512, 1024, device=dev, dtype=torch.bfloat16)
    norm = Norm("layernorm", torch.ones(1024, device=dev, dtype=torch.bfloat16),
                torch.zeros(1024, device=dev, dtype=torch.bfloat16))
    x = torch.randn(512, 1024, device=dev, dtype=torch.bfloat16)
    cases = {}
    for tr in ("nccl", "p2p"):
        cfg = OverlapConfig(chunks=2, transport=NcclTransport(ctas=16) if tr == "nccl" else PeerCopyTransport(reduce_ctas=16))
        cases[f"all_gather_matmul {tr}"] = (lambda cfg=cfg: all_gather_matmul(a, w.t(), config=cfg))
        cases[f"all_reduce_matmul {tr}"] = (lambda cfg=cfg: all_reduce_matmul(x, w.t(), config=cfg))
        cases[f"all_reduce_matmul {tr} +res+ln"] = (
            lambda cfg=cfg: all_reduce_matmul(x, w.t(), residual=res, norm=norm, config=cfg))
    cases["torch.mm (for scale)"] = lambda: torch.mm(x, w.t())
    from overlap.kernels import add_norm, tile_gemm, words

    launchers = {"tile_gemm": tile_gemm._launcher, "reduce_norm": add_norm._reduce_launcher,
                 "copy_words": words._launcher}
    for name, fn in cases.items():
        us = per_call_us(fn, args.calls)
        if rank == 0:
            print(f"{name:40s} {us:8.1f} us per call (host)", flush=True)
    if rank == 0:  # launches that reused a compiled kernel (hits) or went through Triton's binding
        print("cached launches: " + ", ".join(f"{n} {lc.hits} hits / {lc.misses} misses"
                                              for n, lc in launchers.items()), flush=True)
    if args.kernels:
        for name in [c for c in cases if "p2p" in c]:
            kernel_table(name, cases[name], rank)
    for name in ("all_gather_matmul p2p", "all_reduce_matmul p2p", "all_reduce_matmul p2p +res+ln"):
        fn = cases[name]
        tdist.barrier()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.calls):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        if rank == 0:
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
            print(f"--- cProfile, {args.calls} calls of {name} (rank 0), by own time", flush=True)
            print("\n".join(ln for ln in s.getvalue().splitlines() if ln.strip())[:6000], flush=True)
    tdist.barrier()
    dist.shutdown()


if __name__ == "__main__":
    main()
