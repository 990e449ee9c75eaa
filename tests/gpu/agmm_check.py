"""GPU correctness of all_gather_matmul on R ranks (run under torchrun or mpirun).

Every call gets fresh inputs (a stale chunk read would fail), several chunkings,
a shard that does not divide into chunks or tiles, both B layouts, fp16 and
bf16, ``return_gathered`` (exact), many epochs, and a provoked flag timeout that
must raise instead of hanging. Prints ``PASS agmm <launcher>`` on success.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from overlap import dist  # noqa: E402
from tests.gpu._mode import exit_if_shared  # noqa: E402
from overlap.flags import FlagTimeoutError  # noqa: E402
from overlap.ops import all_gather as agmod  # noqa: E402
from overlap.kernels.tile_gemm import GemmConfig, warp_specialize_supported  # noqa: E402
from overlap.ops._runtime import NcclTransport, OverlapConfig  # noqa: E402


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item()


def main() -> None:
    ctx = dist.init()
    exit_if_shared("agmm_check.py", "the NCCL transport's variants, the chunked baseline")
    world, rank = tdist.get_world_size(), tdist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    launcher = ctx.launch.launcher
    cases = [
        # (M/R, N, K, dtype, chunks, b_layout)
        (512, 256, 256, torch.bfloat16, 1, "wt"),
        (512, 384, 512, torch.bfloat16, 2, "wt"),
        (1000, 256, 320, torch.float16, 3, "kn"),   # uneven: partial tiles, uneven chunks
        (777, 512, 128, torch.bfloat16, 4, "kn"),
        (2048, 1024, 1024, torch.bfloat16, 4, "wt"),
    ]
    calls = 0
    for (ms, n, k, dt, chunks, layout) in cases:
        # (transport, give-back, split tail: the tiles after the last full wave in K pieces)
        variants = [("nccl", True, 0, False), ("nccl", False, 0, False), ("p2p", True, 0, False),
                    ("nccl", True, 8, False), ("p2p", True, 8, False)]
        if warp_specialize_supported():  # the GEMM's K loop warp-specialized
            variants += [("nccl", True, 0, True), ("p2p", True, 8, True)]
        for transport, give_back, split, ws in variants:
            cfg = OverlapConfig(chunks=chunks, give_back=give_back, check="sync",
                                transport=NcclTransport(ctas=8) if transport == "nccl" else "p2p",
                                split_tail=split, gemm=GemmConfig(warp_specialize=True) if ws else None)
            for it in range(6):
                g = torch.Generator(device=dev).manual_seed(10_000 * rank + 100 * it + ms + chunks)
                a = torch.randn(ms, k, device=dev, dtype=dt, generator=g)
                gw = torch.Generator(device=dev).manual_seed(99 + it)
                w = torch.randn(n, k, device=dev, dtype=dt, generator=gw) / k ** 0.5
                b = w.t() if layout == "wt" else w.t().contiguous()
                c, gathered = agmod.all_gather_matmul(a, b, return_gathered=True, config=cfg)
                c_ref, g_ref = agmod.all_gather_matmul_ref(a, b, return_gathered=True)
                assert torch.equal(gathered, g_ref), f"gathered differs (case {ms, n, k, chunks}, it {it})"
                c64 = g_ref.double() @ b.double()
                e_ours, e_cublas = rel(c, c64), rel(c_ref, c64)
                assert e_ours <= 2 * e_cublas + 1e-3, (
                    f"rank {rank} case {(ms, n, k, dt, chunks, layout)} it {it}: err {e_ours:.2e} vs cuBLAS {e_cublas:.2e}")
                calls += 1
    assert agmod.stats["fused"] >= calls, agmod.stats
    # chunked baseline agrees too
    a = torch.randn(1024, 512, device=dev, dtype=torch.bfloat16)
    w = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
    c1, g1 = agmod.all_gather_matmul_chunked(a, w.t(), chunks=3, return_gathered=True)
    c2, g2 = agmod.all_gather_matmul_ref(a, w.t(), return_gathered=True)
    assert torch.equal(g1, g2) and rel(c1, c2) < 1e-2
    assert agmod.stats["p2p"] >= calls // 3, agmod.stats
    # many epochs on one shape, inputs changing every call, both transports (p2p:
    # the shared buffer's two halves are reused every other call, with no handshake)
    for transport in ("nccl", "p2p"):
        cfg = OverlapConfig(chunks=2, check="async", transport=NcclTransport(ctas=8) if transport == "nccl" else "p2p")
        for it in range(200):
            a = torch.randn(256, 256, device=dev, dtype=torch.bfloat16) * (1 + rank + it)
            c = agmod.all_gather_matmul(a, torch.eye(256, device=dev, dtype=torch.bfloat16), config=cfg)
            ref = agmod.all_gather_matmul_ref(a, torch.eye(256, device=dev, dtype=torch.bfloat16))
            assert torch.equal(c, ref), f"identity GEMM differs at call {it} ({transport})"
    # back to back with no host sync in between, shapes alternating (the halves of
    # the shared buffer are fixed, whatever the shape), checked at the end
    outs = []
    for it in range(40):
        ms_i = 256 if it % 2 else 384
        a = torch.randn(ms_i, 256, device=dev, dtype=torch.bfloat16) * (1 + rank + it)
        outs.append((a, agmod.all_gather_matmul(a, torch.eye(256, device=dev, dtype=torch.bfloat16),
                                                config=OverlapConfig(chunks=2, transport="p2p"))))
    for it, (a, c) in enumerate(outs):
        assert torch.equal(c, agmod.all_gather_matmul_ref(a, torch.eye(256, device=dev, dtype=torch.bfloat16))), \
            f"back-to-back p2p call {it} differs"
    # a provoked timeout raises (flag never posted), does not hang
    from overlap.kernels.tile_gemm import launch_tile_gemm
    from overlap.policies import Segment, build_tile_table
    from overlap.flags import ErrorWord
    fl = torch.zeros(2, dtype=torch.int32, device=dev)
    ew = ErrorWord(dev, what="provoked")
    table = torch.tensor(build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=256, wait_idx=1)], 256, 128, 256),
                         dtype=torch.int32, device=dev)
    out = torch.empty(256, 256, device=dev, dtype=torch.bfloat16)
    # the kernel built first, its flag posted: the bound below times the wait, not a cold compile
    fl.fill_(3)
    launch_tile_gemm(a, torch.eye(256, device=dev, dtype=torch.bfloat16), out, table, flags=fl, err=ew.word, epoch=3,
                     rank=rank, grid=8, wait=True, timeout_ns=50_000_000)
    ew.check(block=True)
    fl.zero_()
    torch.cuda.synchronize()
    t0 = time.time()
    launch_tile_gemm(a, torch.eye(256, device=dev, dtype=torch.bfloat16), out, table, flags=fl, err=ew.word, epoch=3,
                     rank=rank, grid=8, wait=True, timeout_ns=50_000_000)
    try:
        ew.check(block=True)
    except FlagTimeoutError as e:
        assert e.flag_idx == 1 and e.expected == 3 and e.seen == 0 and e.rank == rank, e
        took = time.time() - t0
        assert took < 5, took
    else:
        raise AssertionError("timeout was not reported")
    # the same failure seen by the non-blocking check, which reads the word's pinned host
    # mirror: the failing kernel stores its code there, nothing is copied per call
    ew2 = ErrorWord(dev, what="provoked async")
    launch_tile_gemm(a, torch.eye(256, device=dev, dtype=torch.bfloat16), out, table, flags=fl, err=ew2.word, epoch=3,
                     rank=rank, grid=8, wait=True, timeout_ns=50_000_000)
    seen = None
    t0 = time.time()
    while seen is None and time.time() - t0 < 5:
        try:
            ew2.check(block=False)
        except FlagTimeoutError as e:
            seen = e
        time.sleep(0.005)
    assert seen is not None, "the non-blocking check never saw the timeout"
    assert seen.flag_idx == 1 and seen.expected == 3 and seen.seen == 0 and seen.rank == rank, seen
    ew2.check(block=True)  # reported once, then cleared: a later check passes
    # p2p: a peer whose pushes come late (rank 1's copy stream sleeps ~0.2 s before each push) makes
    # rank 0's 50 ms wait expire and raise; rank 1's own wait (default bound) succeeds
    from overlap._p2p import flag_stride
    from tests.gpu._late import late_pushes

    torch.cuda.synchronize()
    tdist.barrier()
    a = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    cfg = OverlapConfig(chunks=2, check="sync", transport="p2p", timeout_ms=50 if rank == 0 else 5000)
    with late_pushes(rank == 1):
        try:
            agmod.all_gather_matmul(a, torch.eye(256, device=dev, dtype=torch.bfloat16), config=cfg)
        except FlagTimeoutError as e:
            # rank 1's flags: 1 * stride + chunk
            assert rank == 0 and e.rank == 0 and e.flag_idx in (flag_stride(world), flag_stride(world) + 1), e
        else:
            assert rank != 0, "p2p timeout was not reported"
    torch.cuda.synchronize()
    tdist.barrier()
    if rank == 0:
        print(f"PASS agmm {launcher} world={world} calls={calls} stats={agmod.stats}", flush=True)
    dist.shutdown()


if __name__ == "__main__":
    main()
