"""A producer seconds late, on one GPU, with default settings (run by test_real_jobs_gpu.py).
Prints ``PASS skew1 ...`` or raises.

    chain   mlp_chain's producer held back by ``torch.cuda._sleep`` for about 3 s before
            its grid, in order (the consumer's grid behind the start gate) and consumer
            first (its tiles spin in the kernel for the whole delay; default bound:
            minutes): correct, no error
    ws1     all_gather_matmul and all_reduce_matmul (+ residual, LayerNorm) at world size 1
            (the NCCL transport): each chunk's NCCL call held back about 3 s on the comm
            stream; correct, no error. A short explicit bound still raises (the bound holds)
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from overlap import dist  # noqa: E402
from overlap.flags import FlagTimeoutError  # noqa: E402
from overlap.ops import (Norm, clear_call_plans, OverlapConfig, all_gather_matmul, all_gather_matmul_ref,  # noqa: E402
                         all_reduce_matmul, all_reduce_matmul_ref, check_errors, mlp_chain, mlp_chain_ref)
from overlap.ops import _runtime  # noqa: E402
from overlap.ops.chain import _mlp_chain  # noqa: E402

TOL = 2e-2
DELAY_S = 3.0


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()


def cycles_for(seconds: float, dev: torch.device) -> int:
    """GPU clock cycles of ``torch.cuda._sleep`` that last about ``seconds`` (measured)."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(100_000_000)
    e.record()
    e.synchronize()
    per_ms = 100_000_000 / s.elapsed_time(e)
    return int(per_ms * seconds * 1000)


class _Late:
    """A communicator whose collectives are each preceded on their stream by a sleep."""

    def __init__(self, comm: object, cycles: int) -> None:
        self._comm, self._cycles = comm, cycles

    def __getattr__(self, name: str) -> object:
        return getattr(self._comm, name)

    def _late(self, fn: str, *a: object, stream: torch.cuda.Stream, **kw: object) -> object:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(self._cycles)
        return getattr(self._comm, fn)(*a, stream=stream, **kw)

    def all_gather(self, *a: object, **kw: object) -> object:
        return self._late("all_gather", *a, **kw)

    def all_reduce(self, *a: object, **kw: object) -> object:
        return self._late("all_reduce", *a, **kw)

    def bound(self, kind: str, send: torch.Tensor, recv: torch.Tensor, stream: torch.cuda.Stream,
              op: str = "sum") -> object:
        """A call plan's bound collective (``NcclCommunicator.bound``), late the same way."""
        fn, cycles = self._comm.bound(kind, send, recv, stream, op=op), self._cycles

        def late(s: torch.Tensor, r: torch.Tensor) -> None:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)
            fn(s, r)
        return late


def main() -> None:
    os.environ.pop("OVERLAP_WAIT_TIMEOUT_MS", None)
    dist.init(timeout_s=60)
    dev = torch.device("cuda", torch.cuda.current_device())
    cyc = cycles_for(DELAY_S, dev)
    out = []
    # the chain: the producer ~3 s late
    x = torch.randn(4096, 2048, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(2048, 4096, device=dev, dtype=torch.bfloat16) / 45
    w2 = torch.randn(4096, 2048, device=dev, dtype=torch.bfloat16) / 64
    mlp_chain(x, w1, w2)
    _mlp_chain(x, w1, w2, consumer_first=True)
    # in order, the consumer's grid is held back by the start gate (a stream wait, no SM);
    # consumer first, its tiles spin in the kernel for the whole delay (the bound matters)
    for first in (False, True):
        x.normal_()
        t0 = time.monotonic()
        y = _mlp_chain(x, w1, w2, consumer_first=first, producer_delay_cycles=cyc)
        torch.cuda.synchronize()
        check_errors()
        took = time.monotonic() - t0
        assert took >= 0.8 * DELAY_S, f"the producer was not held back ({took:.2f} s)"
        e = rel(y, mlp_chain_ref(x, w1, w2))
        assert e < TOL, f"chain after a {took:.1f} s late producer: rel err {e}"
    out.append(f"chain {took:.1f} s late (gated and consumer first): ok")
    # world size 1: each chunk's NCCL call ~3 s late on the comm stream
    from overlap.dist import get_context

    group = get_context().tp_group
    rt = _runtime.get_runtime(group, dev)
    real_comm = rt.comm
    m, k, n = 2048, 2048, 1024
    b = (torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 45).t()
    res = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    norm = Norm("layernorm", torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5,
                torch.randn(k, device=dev, dtype=torch.bfloat16))
    cfg = OverlapConfig(transport="nccl", chunks=2)
    short = OverlapConfig(transport="nccl", chunks=2, timeout_ms=200, check="sync")
    all_gather_matmul(torch.randn(m, k, device=dev, dtype=torch.bfloat16), b, config=cfg)
    # warm both bounds: a bound under 2**31 ns is an int32 argument, another kernel variant,
    # and a variant's first load waits for the device's running work (the delayed comm
    # stream), so a cold short-bound call would not wait at all
    for c_ in (cfg, short):
        all_reduce_matmul(torch.randn(m, k, device=dev, dtype=torch.bfloat16), b, residual=res, norm=norm, config=c_)
    torch.cuda.synchronize()
    rt.comm = lambda max_ctas: _Late(real_comm(max_ctas), cyc)  # type: ignore[method-assign]
    clear_call_plans()  # a call plan's body takes the communicator when it is made
    try:
        for it in range(2):
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t0 = time.monotonic()
            c = all_gather_matmul(a, b, config=cfg)
            c2, h = all_reduce_matmul(a, b, residual=res, norm=norm, config=cfg)
            torch.cuda.synchronize()
            check_errors()
            took = time.monotonic() - t0
            assert took >= 0.8 * 2 * DELAY_S, f"the NCCL calls were not held back ({took:.2f} s)"
            assert rel(c, all_gather_matmul_ref(a, b)) < TOL
            assert rel(c2, all_reduce_matmul_ref(a, b, residual=res, norm=norm)[0]) < TOL
        out.append(f"ws1 agmm + armm {took:.1f} s late: ok")
        # the bound still holds: a bound shorter than the delay raises (the all-reduce op: at
        # world size 1 the all-gather op's tiles read the local shard and wait on nothing)
        try:
            all_reduce_matmul(a, b, residual=res, norm=norm, config=short)
        except FlagTimeoutError as e:
            out.append(f"200 ms bound raised ({str(e)[:40]}...)")
        else:
            raise AssertionError("a wait bound shorter than the delay did not raise")
    finally:
        rt.comm = real_comm  # type: ignore[method-assign]
        clear_call_plans()
    torch.cuda.synchronize()
    print("PASS skew1 " + "; ".join(out), flush=True)


if __name__ == "__main__":
    main()
