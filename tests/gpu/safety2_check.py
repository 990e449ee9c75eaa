"""The "safe in production" guarantees at two ranks (run under torchrun or mpirun; see
test_safety2_gpu.py). Each check prints ``PASS <name> ...`` on rank 0 or raises; the
script prints ``ALL PASS safety2 <launcher>`` at the end.

    graphs        all_gather_matmul and all_reduce_matmul (+ residual, LayerNorm) captured in
                  a CUDA graph and replayed with new inputs on every replay, eager calls
                  between, both transports (the peer-copy transport's captured call runs
                  the reference: checked by its counter)
    streams       the same op on two streams at once, both transports
    disagree      ranks that pass different M, K or dtype to a fused path: the same clear
                  error on every rank, and the op usable afterwards
    reset         rank 1's pushes come late: rank 0's wait times out (a clear error), then
                  ``overlap.ops.reset`` brings both ranks back and later calls are correct
    dead_peer     rank 1 stops calling: rank 0 gets a clear error within the bound on both
                  transports, and ``overlap.dist.shutdown`` returns within its bound
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from overlap import dist  # noqa: E402
from tests.gpu._mode import exit_if_shared  # noqa: E402
from overlap.flags import FlagTimeoutError  # noqa: E402
from overlap.ops import Norm, OverlapConfig, all_gather_matmul, all_reduce_matmul, check_errors, reset  # noqa: E402
from overlap.ops import all_gather as agmod  # noqa: E402
from overlap.ops import all_reduce as armod  # noqa: E402

TRANSPORTS = ("nccl", "p2p")


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()


def say(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def shared_randn(*shape: int, dev: torch.device, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The same tensor on every rank (a seeded generator on the device)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=dev, dtype=dtype)


def graphs(rank: int, world: int, dev: torch.device) -> str:
    out = []
    ms, k, n = 1024, 1024, 768
    for tr in TRANSPORTS:
        cfg = OverlapConfig(transport=tr, chunks=2)
        a = torch.randn(ms, k, device=dev, dtype=torch.bfloat16)
        b = (shared_randn(n, k, dev=dev, dtype=torch.bfloat16, seed=1) / 32).t()
        x = torch.randn(ms * world, k, device=dev, dtype=torch.bfloat16)
        r = shared_randn(ms * world, k, dev=dev, dtype=torch.bfloat16, seed=2)
        w = torch.ones(k, device=dev, dtype=torch.bfloat16)
        nb = torch.zeros(k, device=dev, dtype=torch.bfloat16)
        norm = Norm("layernorm", w, nb, 1e-5)

        def refs() -> tuple[torch.Tensor, torch.Tensor]:
            full = torch.empty(ms * world, k, device=dev, dtype=a.dtype)
            tdist.all_gather_into_tensor(full, a)
            s = x.float().clone()
            tdist.all_reduce(s)
            h = s + r.float()
            return full.float() @ b.float(), torch.nn.functional.layer_norm(h, (k,), w.float(), nb.float()) @ b.float()

        def refill(i: int) -> None:
            a.normal_()
            x.normal_()
            r.copy_(shared_randn(ms * world, k, dev=dev, dtype=torch.bfloat16, seed=100 + i))

        for i in range(2):  # eager before capture
            refill(i)
            all_gather_matmul(a, b, config=cfg)
            all_reduce_matmul(x, b, residual=r, norm=norm, config=cfg)
        torch.cuda.synchronize()
        ref_before = agmod.stats["reference_in_capture"] + armod.stats["reference_in_capture"]
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            c1 = all_gather_matmul(a, b, config=cfg)
            c2, _ = all_reduce_matmul(x, b, residual=r, norm=norm, config=cfg)
        captured_ref = agmod.stats["reference_in_capture"] + armod.stats["reference_in_capture"] - ref_before
        assert captured_ref == (2 if tr == "p2p" else 0), (tr, captured_ref)
        worst = 0.0
        for i in range(100):
            refill(10 + i)
            g.replay()
            e1, e2 = refs()
            errs = (rel(c1, e1), rel(c2, e2))
            worst = max(worst, *errs)
            assert max(errs) < 3e-2, (tr, i, errs)
            if i % 25 == 3:  # eager calls between replays
                refill(1000 + i)
                e1, e2 = refs()
                assert rel(all_gather_matmul(a, b, config=cfg), e1) < 3e-2
                assert rel(all_reduce_matmul(x, b, residual=r, norm=norm, config=cfg)[0], e2) < 3e-2
        check_errors()
        out.append(f"{tr}: 100 replays, worst {worst:.1e}")
    return "; ".join(out)


def streams(rank: int, world: int, dev: torch.device) -> str:
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    ms, k, n = 2048, 1024, 1024
    for tr in TRANSPORTS:
        cfg = OverlapConfig(transport=tr, chunks=2)
        b = (shared_randn(n, k, dev=dev, dtype=torch.float16, seed=3) / 32).t()
        for i in range(10):
            a1 = torch.randn(ms, k, device=dev, dtype=torch.float16)
            a2 = torch.randn(ms, k, device=dev, dtype=torch.float16)
            torch.cuda.synchronize()
            with torch.cuda.stream(s1):
                c1 = all_gather_matmul(a1, b, config=cfg)
            with torch.cuda.stream(s2):
                c2 = all_gather_matmul(a2, b, config=cfg)
            torch.cuda.synchronize()
            for a_, c_ in ((a1, c1), (a2, c2)):
                full = torch.empty(ms * world, k, device=dev, dtype=a_.dtype)
                tdist.all_gather_into_tensor(full, a_)
                e = rel(c_, full.float() @ b.float())
                assert e < 2e-2, (tr, i, e)
    check_errors()
    return f"10 iterations x 2 streams, {TRANSPORTS}"


def expect(fn: Callable[[], Any], exc: type, text: str) -> str:
    try:
        fn()
    except exc as e:
        assert text in str(e), e
        return str(e)
    raise AssertionError(f"no {exc.__name__} ({text})")


def disagree(rank: int, world: int, dev: torch.device) -> str:
    k, n = 512, 256
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    for tr in TRANSPORTS:
        cfg = OverlapConfig(transport=tr)
        ms = 512 + 128 * rank  # a signature no rank ran before
        expect(lambda: all_gather_matmul(torch.randn(ms, k, device=dev, dtype=torch.bfloat16), b, config=cfg),
               ValueError, "disagree")
        dt = torch.float16 if rank else torch.bfloat16
        expect(lambda: all_reduce_matmul(torch.randn(256, k, device=dev, dtype=dt), b.to(dt), config=cfg),
               ValueError, "disagree")
        a = torch.randn(512, k, device=dev, dtype=torch.bfloat16)
        full = torch.empty(512 * world, k, device=dev, dtype=a.dtype)
        tdist.all_gather_into_tensor(full, a)
        assert rel(all_gather_matmul(a, b, config=cfg), full.float() @ b.float()) < 2e-2
    return "M/R and dtype, both transports; usable afterwards"


def reset_after_timeout(rank: int, world: int, dev: torch.device) -> str:
    from tests.gpu._late import late_pushes

    a = torch.randn(512, 512, device=dev, dtype=torch.bfloat16)
    b = shared_randn(512, 512, dev=dev, dtype=torch.bfloat16, seed=5)
    cfg = OverlapConfig(chunks=2, check="sync", transport="p2p", timeout_ms=50 if rank == 0 else 5000)
    all_gather_matmul(a, b, config=cfg)
    torch.cuda.synchronize()
    tdist.barrier()
    seen = ""
    with late_pushes(rank == 1):
        try:
            all_gather_matmul(a, b, config=cfg)
        except FlagTimeoutError as e:
            seen = str(e)
    assert (rank == 0) == bool(seen), (rank, seen)
    reset()
    good = OverlapConfig(chunks=2, transport="p2p")
    for i in range(10):
        a.normal_()
        full = torch.empty(512 * world, 512, device=dev, dtype=a.dtype)
        tdist.all_gather_into_tensor(full, a)
        e = rel(all_gather_matmul(a, b, config=good), full.float() @ b.float())
        assert e < 2e-2, (i, e)
    check_errors()
    return f"rank 0 saw: {seen[:70]}...; 10 correct calls after reset"


def dead_peer(rank: int, world: int, dev: torch.device) -> str:
    """Last: rank 1 stops calling; rank 0's calls end in clear errors within the bound."""
    took = {}
    a = torch.randn(512, 512, device=dev, dtype=torch.bfloat16)
    b = shared_randn(512, 512, dev=dev, dtype=torch.bfloat16, seed=6)
    for tr in ("p2p", "nccl"):
        cfg = OverlapConfig(chunks=2, transport=tr, timeout_ms=2000, check="async")
        all_gather_matmul(a, b, config=cfg)  # both ranks: warmed, agreed
        torch.cuda.synchronize()
        tdist.barrier()
        if rank == 0:
            t0 = time.time()
            all_gather_matmul(a, b, config=cfg)  # rank 1 never makes this call
            err = None
            while err is None and time.time() - t0 < 30:
                try:
                    check_errors(block=False)  # never waits on the GPU (NCCL may be stuck)
                except FlagTimeoutError as e:
                    err = e
                time.sleep(0.01)
            assert err is not None, f"{tr}: no error within 30 s"
            took[tr] = time.time() - t0
            assert took[tr] < 10, (tr, took[tr])
        if tr == "p2p":
            tdist.barrier()
            reset()  # the p2p call rank 1 skipped: back in step before the NCCL case
    t0 = time.time()
    dist.shutdown()  # rank 0's NCCL call never completes: shutdown aborts it, bounded
    took["shutdown"] = time.time() - t0
    return ", ".join(f"{k} {v:.1f} s" for k, v in took.items())


def main() -> None:
    ctx = dist.init()
    exit_if_shared("safety2_check.py", "each guarantee on the NCCL transport beside the peer-copy one")
    world, rank = tdist.get_world_size(), tdist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(1234 + rank)
    torch.cuda._sleep(1)
    for name, fn in (("graphs", graphs), ("streams", streams), ("disagree", disagree),
                     ("reset", reset_after_timeout)):
        msg = fn(rank, world, dev)
        torch.cuda.synchronize()
        tdist.barrier()
        say(rank, f"PASS {name} {msg}")
    msg = dead_peer(rank, world, dev)
    say(rank, f"PASS dead_peer {msg}")
    say(rank, f"ALL PASS safety2 {ctx.launch.launcher}")


if __name__ == "__main__":
    main()
