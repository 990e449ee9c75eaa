"""All-gather -> GEMM diagnosis: where the fused p2p op loses time against its GEMM alone.

    bash launch/torchrun.sh 2 benchmarks/diag/agmm_diag.py [--shapes MxNxK,...] [--iters 10]

Per shape, side by side in rounds (``Timer.time_interleaved``), slowest rank, ms per call:

    cublas        torch.mm over the gathered A (the floor's GEMM)
    tile          the tile GEMM over the gathered A, one operand, no flags
    tile+copy     the same, with this rank's shard pushed to its peers on a side stream
                  (copy engines) at the same time, as the fused op does, but no flags
    tile_a2       the fused op's kernel and table (local shard and gathered buffer as two
                  operands), flags already set, no copy
    tile_a2_wait  the same with the per-tile flag waits on
    fused cN      the fused op, p2p, 1, 2 and 4 chunks

and, for ``--configs``, the tile GEMM alone under other tile shapes (wave quantization).
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
    ap.add_argument("--shapes", default="8192x24576x12288,8192x14336x8192,16384x2048x8192")
    ap.add_argument("--configs", default="8192x14336x8192")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    from benchmarks.suite.timing import Timer
    from overlap._p2p import memcpy_async
    from overlap import dist
    from overlap.kernels.tile_gemm import DEFAULT_CONFIG, GemmConfig, launch_tile_gemm
    from overlap.ops import OverlapConfig, all_gather_matmul
    from overlap.ops._runtime import get_runtime
    from overlap.ops.all_gather import _plan
    from overlap.policies import Segment, build_tile_table

    dist.init()
    rank, world = tdist.get_rank(), tdist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = tdist.group.WORLD
    rt = get_runtime(g, dev)
    heap = rt.p2p()
    if heap is None:
        raise SystemExit(f"no peer memory: {rt.p2p_why}")
    timer = Timer(group=g, device=dev, iters=args.iters, warmup=3, reps=5)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out: list[dict] = []

    def table_for(m: int, n: int, cfg: GemmConfig) -> torch.Tensor:
        rows = build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, cfg.block_m, cfg.block_n)
        return torch.tensor(rows, dtype=torch.int32, device=dev)

    for spec in args.shapes.split(","):
        m, n, k = (int(v) for v in spec.split("x"))
        ms = m // world
        gen = torch.Generator(device=dev).manual_seed(rank + 1)
        a = torch.randn(ms, k, device=dev, generator=gen).to(torch.bfloat16)
        b = (torch.randn(n, k, device=dev, generator=gen) * k ** -0.5).to(torch.bfloat16).t()
        full = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        c = full.new_empty(m, n)
        t_full = table_for(m, n, DEFAULT_CONFIG)
        nbytes = a.numel() * a.element_size()
        blk = heap.block("diag_push", nbytes * (world - 1))
        cur = torch.cuda.current_stream(dev)
        cs = rt.comm_stream
        p = _plan(rt, ms, n, k, OverlapConfig(chunks=1, transport="p2p"), "p2p")
        flags = torch.ones(p.flag_count, dtype=torch.int32, device=dev)
        err = torch.zeros(8, dtype=torch.int32, device=dev)

        def tile() -> None:
            launch_tile_gemm(full, b, c, t_full, grid=sms)

        def tile_copy() -> None:
            cs.wait_stream(cur)
            for step in range(1, world):
                peer = (rank + step) % world
                memcpy_async(blk.ptrs[peer] + (step - 1) * nbytes, a.data_ptr(), nbytes, cs)
            tile()
            cur.wait_stream(cs)

        def tile_a2(wait: bool) -> None:
            launch_tile_gemm(a, b, c, p.table, a2=full, grid=p.grid, wait=wait, flags=flags, err=err, epoch=1,
                             rank=rank, config=p.gemm)

        fns = {
            "cublas": lambda: full @ b,
            "tile": tile,
            "tile+copy": tile_copy,
            "tile_a2": lambda: tile_a2(False),
            "tile_a2_wait": lambda: tile_a2(True),
            "fused c1": lambda: all_gather_matmul(a, b, group=g, config=OverlapConfig(chunks=1, transport="p2p")),
        }

        for chunks in (2, 4):
            fns[f"fused c{chunks}"] = lambda chunks=chunks: all_gather_matmul(
                a, b, group=g, config=OverlapConfig(chunks=chunks, transport="p2p"))
        if spec in args.configs.split(","):
            for cfg in (GemmConfig(block_m=256, block_n=128), GemmConfig(block_m=128, block_n=128, num_stages=4),
                        GemmConfig(block_m=128, block_n=128, num_stages=5, num_warps=4)):
                tb = table_for(m, n, cfg)
                fns[f"tile {cfg.block_m}x{cfg.block_n}x{cfg.block_k} s{cfg.num_stages} w{cfg.num_warps}"] = (
                    lambda cfg=cfg, tb=tb: launch_tile_gemm(full, b, c, tb, grid=sms, config=cfg))

        def on_error(name: str, e: BaseException | None) -> None:
            if rank == 0:
                print(f"  {spec} {name}: error {e!r}", flush=True)

        res = timer.time_interleaved(fns, on_error)
        if int(err[0].item()) != 0:
            print(f"rank {rank}: error word set {err.tolist()}", flush=True)
        if rank == 0:
            print(f"{spec}: " + ", ".join(f"{name} {v:.3f}" for name, v in res.items()), flush=True)
        out.append({"shape": spec, "ms": res})
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    tdist.barrier()
    dist.shutdown()


if __name__ == "__main__":
    main()
