"""Real jobs at two ranks (run under torchrun; see test_real_jobs_gpu.py). Each check
prints ``PASS <name> ...`` on rank 0 or raises; ``ALL PASS real_jobs2`` at the end.

    skew     with default settings (no timeout_ms), one rank sleeps 2 to 5 s on the host
             before each call (a GC pause, a checkpoint write): every op on both
             transports returns correct results and raises nothing on either rank. While
             rank 0's op waits, a GEMM on another stream of rank 0 is timed: what the
             waiting op costs other work on the GPU (printed, not asserted; the last NCCL
             round without the stream gate, OVERLAP_STREAM_GATE=0, for comparison)
    ddp      a loop of 100 iterations, inputs changing: a data-parallel all-reduce of a
             large buffer on torch's NCCL communicator and stream (async_op, as DDP's
             gradient buckets), and the ops on a stream of their own at the same time,
             both transports; with OVERLAP_SM_MARGIN at least torch's NCCL CTA cap
             (NCCL_MAX_CTAS, set by the test): no timeout, no deadlock, correct results
"""

from __future__ import annotations

import os
import random
import sys
import time

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from overlap import dist  # noqa: E402
from tests.gpu._mode import exit_if_shared  # noqa: E402
from overlap.ops import (Norm, OverlapConfig, all_gather_matmul, all_gather_matmul_ref,  # noqa: E402
                         all_reduce_matmul, all_reduce_matmul_ref, check_errors)

TRANSPORTS = ("nccl", "p2p")
TOL = 2e-2  # bf16 against the reference (cuBLAS, the same inputs)


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()


def say(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def shared_randn(*shape: int, dev: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=dev, dtype=torch.bfloat16)


def _ops(dev: torch.device, it: int, m: int = 4096, k: int = 4096, n: int = 2048) -> list:
    """(name, fused call, reference call) of every op with inputs new at ``it``."""
    b = (shared_randn(n, k, dev=dev, seed=1000 + it) / 64).t()
    a = torch.randn(m // 2, k, device=dev, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    res = shared_randn(m, k, dev=dev, seed=2000 + it)
    norm = Norm("layernorm", torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5,
                torch.randn(k, device=dev, dtype=torch.bfloat16))
    return [("all_gather_matmul", lambda cfg: all_gather_matmul(a, b, config=cfg),
             lambda: all_gather_matmul_ref(a, b)),
            ("all_reduce_matmul", lambda cfg: all_reduce_matmul(x, b, residual=res, norm=norm, config=cfg)[0],
             lambda: all_reduce_matmul_ref(x, b, residual=res, norm=norm)[0])]


def skew(rank: int, world: int, dev: torch.device) -> str:
    rng = random.Random(7)  # the same draws on every rank: which rank is late, and how long
    probe_a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()  # the probes read it from a stream of their own
    alone = _time_probe(probe_a, dev)
    out = []
    for tr in TRANSPORTS:
        cfg = OverlapConfig(transport=tr)  # default bound: the process groups' timeout
        for it in range(3):
            for name, fused, ref in _ops(dev, it):
                fused(cfg)  # warm (compiles; both ranks together)
                torch.cuda.synchronize()
                tdist.barrier()
                late, pause = rng.randrange(world), rng.uniform(2.0, 5.0)
                # the last round on NCCL without the stream gate, for the probe's comparison
                # (the gate is local to a rank: no agreement needed)
                ungated = tr == "nccl" and it == 2
                if ungated:
                    os.environ["OVERLAP_STREAM_GATE"] = "0"
                t0 = time.monotonic()
                if rank == late:
                    time.sleep(pause)
                c = fused(cfg)
                probe = _time_probe(probe_a, dev) if rank != late else None  # while the op waits
                os.environ.pop("OVERLAP_STREAM_GATE", None)
                torch.cuda.synchronize()
                took = time.monotonic() - t0
                check_errors()
                e = rel(c, ref())
                assert e < TOL, f"{name} {tr} it {it}: rel err {e} after a {pause:.1f} s skew"
                if rank == 0 and probe is not None:
                    out.append(f"{name[:6]} {tr}{' ungated' if ungated else ''} {pause:.1f}s: probe {probe:.1f} ms "
                               f"(alone {alone:.1f})")
                del took
    return "; ".join(out)


def _time_probe(a: torch.Tensor, dev: torch.device) -> float:
    """Milliseconds of one 8192^3 GEMM on a stream of its own, queued now, beside whatever
    the current stream has queued (``a`` is ready: made and synchronized before)."""
    s = torch.cuda.Stream(device=dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(s):
        start.record(s)
        a @ a
        end.record(s)
    end.synchronize()
    return start.elapsed_time(end)


def ddp(rank: int, world: int, dev: torch.device) -> str:
    grads = torch.empty(64 << 20, device=dev, dtype=torch.float32)  # 256 MB of "gradients"
    ops_stream = torch.cuda.Stream(device=dev)
    out = []
    for tr in TRANSPORTS:
        cfg = OverlapConfig(transport=tr)
        t0 = time.monotonic()
        for it in range(100):
            grads.fill_(float(rank + it))
            work = tdist.all_reduce(grads, async_op=True)  # torch's communicator and stream
            ops_stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(ops_stream):
                for name, fused, ref in _ops(dev, it, m=2048, k=2048, n=1024):
                    c = fused(cfg)
                    e = rel(c, ref())
                    assert e < TOL, f"{name} {tr} iteration {it}: rel err {e}"
            work.wait()
            torch.cuda.current_stream(dev).wait_stream(ops_stream)
            want = float(sum(r + it for r in range(world)))
            got = grads[:: 1 << 20]
            assert torch.all(got == want), f"the data-parallel all-reduce at iteration {it}: {got[:4]} != {want}"
        torch.cuda.synchronize()
        check_errors()
        out.append(f"{tr} {time.monotonic() - t0:.1f} s")
    return ", ".join(out)


def main() -> None:
    ctx = dist.init(timeout_s=120)
    exit_if_shared("real_jobs2_check.py", "the NCCL transport beside a data-parallel NCCL all-reduce")
    world, rank = tdist.get_world_size(), tdist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(1234 + rank)
    only = sys.argv[1:] or ["skew", "ddp"]
    for name, fn in (("skew", skew), ("ddp", ddp)):
        if name not in only:
            continue
        msg = fn(rank, world, dev)
        torch.cuda.synchronize()
        tdist.barrier()
        say(rank, f"PASS {name} {msg}")
    say(rank, f"ALL PASS real_jobs2 {ctx.launch.launcher}")


if __name__ == "__main__":
    main()
