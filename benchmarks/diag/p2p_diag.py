"""p2p transport diagnosis: copy-engine push bandwidth and the reduce kernel's speed alone.

    bash launch/torchrun.sh 2 benchmarks/diag/p2p_diag.py [--mb 256] [--M 16384 --K 8192 --N 2048] [--sweep]

push S streams   every rank pushes ``--mb`` MB into its peers' memory at the same time,
                 split into S equal pieces on S streams (one copy engine each, or not);
                 ms per call and GB/s received per rank
push N chunks    the same in N chunks through ``Runtime.push``, a peer flag write after each
reduce P ...     the p2p all-reduce's reduce kernel alone over [M, K] (peer rows already
                 landed, flags set) on P programs: ms and GB/s of HBM traffic
gemm on S SMs    the tile GEMM [M, K] x [K, N] alone on S SMs
armm ...         the fused p2p op at a few chunk counts and reduce-kernel SMs
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--M", type=int, default=16384)
    ap.add_argument("--K", type=int, default=8192)
    ap.add_argument("--N", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--sweep", action="store_true", help="also time the reduce kernel's block shapes")
    ap.add_argument("--no-fused", action="store_true", help="skip the GEMM and fused-op timings")
    ap.add_argument("--trace", default="", help="write a torch.profiler trace of a few fused calls here")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    from benchmarks.suite.timing import Timer
    from overlap import dist
    from overlap._p2p import memcpy_async
    from overlap.kernels.add_norm import ReduceShape, launch_reduce_norm
    from overlap.ops._runtime import get_runtime

    dist.init()
    rank, world = tdist.get_rank(), tdist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = tdist.group.WORLD
    rt = get_runtime(g, dev)
    heap = rt.p2p()
    if heap is None:
        raise SystemExit(f"no peer memory: {rt.p2p_why}")
    timer = Timer(group=g, device=dev, iters=args.iters, warmup=3, reps=5)
    res: dict[str, float] = {}

    def on_error(name: str, e: BaseException | None) -> None:
        if rank == 0:
            print(f"  {name}: error {e!r}", flush=True)

    # --- push bandwidth
    nbytes = args.mb << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(rank + 1)
    blk = heap.block("diag_push_bw", nbytes * (world - 1))
    streams = [torch.cuda.Stream(dev) for _ in range(4)]
    cur = torch.cuda.current_stream(dev)

    def push(s_count: int) -> None:
        piece = nbytes // s_count
        for i in range(s_count):
            st = streams[i]
            st.wait_stream(cur)
            for step in range(1, world):
                peer = (rank + step) % world
                memcpy_async(blk.ptrs[peer] + (step - 1) * nbytes + i * piece, src.data_ptr() + i * piece,
                             piece, st)
        for i in range(s_count):
            cur.wait_stream(streams[i])

    sf = heap.flags("diag_push_flags", 64)
    epoch = [0]

    def push_chunks(chunks: int) -> None:
        rt.p2p_begin("diag", cur)
        epoch[0] += 1
        piece = nbytes // chunks
        for c in range(chunks):
            for step in range(1, world):
                peer = (rank + step) % world
                rt.push(blk.ptrs[peer] + (step - 1) * nbytes + c * piece, src.data_ptr() + c * piece, piece,
                        sf.peer(peer), c, epoch[0])
        cur.wait_stream(rt.comm_stream)
        rt.p2p_end("diag", cur)

    fns = {f"push {s} streams": (lambda s=s: push(s)) for s in (1, 2, 4)}
    fns.update({f"push {c} chunks + flags": (lambda c=c: push_chunks(c)) for c in (4, 8, 16)})
    got = timer.time_interleaved(fns, on_error)
    for name, ms in got.items():
        res[name] = ms
        if rank == 0:
            print(f"{name}: {ms:.3f} ms, {nbytes * (world - 1) / ms / 1e6:.0f} GB/s received", flush=True)

    # --- the reduce kernel alone
    m, k = args.M, args.K
    gen = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
    recv = torch.randn(world - 1, m, k, device=dev, generator=gen).to(torch.bfloat16)
    resid = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
    h = torch.empty_like(x)
    y = torch.empty_like(x)
    w = torch.ones(k, device=dev, dtype=torch.bfloat16)
    bias = torch.zeros(k, device=dev, dtype=torch.bfloat16)
    chunks = 8
    starts = torch.tensor([m * i // chunks for i in range(chunks + 1)], dtype=torch.int32, device=dev)
    rflags = torch.ones((world - 1) * chunks, dtype=torch.int32, device=dev)
    ready = torch.zeros(chunks, dtype=torch.int32, device=dev)
    err = torch.zeros(8, dtype=torch.int32, device=dev)

    def reduce(programs: int, ln: bool) -> None:
        launch_reduce_norm(x, recv, h, starts=starts, rflags=rflags, ready=ready, err=err, epoch=1, rank=rank,
                           world=world, programs=programs, residual=resid if ln else None,
                           norm="layernorm" if ln else None, weight=w if ln else None, bias=bias if ln else None,
                           y=y if ln else None)

    fns = {f"reduce {p} programs{' +res+ln' if ln else ''}": (lambda p=p, ln=ln: reduce(p, ln))
           for ln in (False, True) for p in (16, 24, 32, 48, 132)}
    if args.sweep:  # the kernel's block shape on 24 programs: rows per block x K block x warps
        import triton

        p2 = min(triton.next_power_of_2(k), 16384)
        shapes = [(16384 // p2, p2, 8), (16384 // p2, p2, 16), (32768 // p2, p2, 16)] + [
            (r, bk, 16) for bk in (8192, 4096, 2048) if bk < p2 for r in (16384 // bk, 32768 // bk)]
        for ln in (False, True):
            for rows, bk, nw in shapes:
                if rows < 1 or rows > 16:
                    continue
                fns[f"reduce 24 programs{' +res+ln' if ln else ''} rows {rows} bk {bk} w{nw}"] = (
                    lambda ln=ln, rows=rows, bk=bk, nw=nw: launch_reduce_norm(
                        x, recv, h, starts=starts, rflags=rflags, ready=ready, err=err, epoch=1, rank=rank,
                        world=world, programs=24, residual=resid if ln else None,
                        norm="layernorm" if ln else None, weight=w if ln else None,
                        bias=bias if ln else None, y=y if ln else None,
                        shape=ReduceShape(rows=rows, block_k=bk, num_warps=nw)))
    got = timer.time_interleaved(fns, on_error)
    esz = x.element_size()
    for name, ms in got.items():
        res[name] = ms
        ln = "+ln" in name
        traffic = m * k * esz * ((world + 1) if not ln else (world + 3))  # reads (+res), writes h (+y)
        if rank == 0:
            print(f"{name} [{m}x{k}]: {ms:.3f} ms, {traffic / ms / 1e6:.0f} GB/s HBM", flush=True)
    # --- the fused op and its GEMM on the SMs the reduce kernel leaves
    from overlap.kernels.tile_gemm import DEFAULT_CONFIG, launch_tile_gemm
    from overlap.ops import Norm, OverlapConfig, all_reduce_matmul
    from overlap.policies import Segment, build_tile_table

    n = args.N
    b = (torch.randn(n, k, device=dev, generator=gen) * k ** -0.5).to(torch.bfloat16).t()
    c = x.new_empty(m, n)
    table = torch.tensor(build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, DEFAULT_CONFIG.block_m,
                                          DEFAULT_CONFIG.block_n), dtype=torch.int32, device=dev)
    nrm = Norm("layernorm", w, bias)
    fns = {f"gemm on {s} SMs": (lambda s=s: launch_tile_gemm(y, b, c, table, grid=s)) for s in (132, 108, 84)}

    def armm(cfg: OverlapConfig, ln: bool) -> None:
        all_reduce_matmul(x, b, group=g, residual=resid if ln else None, norm=nrm if ln else None, config=cfg)

    for ln, ch, rc in ((False, 8, 24), (False, 16, 16), (False, 16, 24), (True, 8, 48), (True, 16, 48)):
        cfg = OverlapConfig(chunks=ch, reduce_ctas=rc, transport="p2p")
        fns[f"armm {m}x{n}x{k}{'+ln' if ln else ''} c{ch} r{rc}"] = lambda cfg=cfg, ln=ln: armm(cfg, ln)
    got = timer.time_interleaved(fns, on_error) if not args.no_fused else {}
    for name, ms in got.items():
        res[name] = ms
        if rank == 0:
            print(f"{name}: {ms:.3f} ms", flush=True)
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        cases = {"armm": lambda: all_reduce_matmul(x, b, group=g, config=OverlapConfig(chunks=16, reduce_ctas=24,
                                                                                         transport="p2p")),
                 "armm_ln": lambda: all_reduce_matmul(x, b, group=g, residual=resid, norm=nrm,
                                                      config=OverlapConfig(chunks=8, reduce_ctas=48, transport="p2p"))}
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for name, fn in cases.items():
                tdist.barrier()
                torch.cuda.synchronize()
                for _ in range(4):
                    fn()
                torch.cuda.synchronize()
        prof.export_chrome_trace(f"{args.trace}.rank{rank}.json")
    if int(err[0].item()):
        print(f"rank {rank}: error word {err.tolist()}", flush=True)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    tdist.barrier()
    dist.shutdown()


if __name__ == "__main__":
    main()
