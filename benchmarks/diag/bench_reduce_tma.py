"""Does the reduce kernel go faster with its loads through TMA into a software pipeline?

    python benchmarks/diag/bench_reduce_tma.py

A probe on one GPU, flags left out: h = x + recv (+ residual) over [M, K] bf16 with
each 256-column segment's mean and squared deviations, by row chunks, the loads
as TMA boxes of [R, 256] that Triton's pipeliner keeps ``stages`` deep in shared
memory, so that the bytes in flight no longer depend on the registers. Compared
in the same process with ``reduce_norm_kernel`` (the op's kernel) on the same
program counts.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from overlap.kernels.add_norm import _store_in_place, launch_reduce_norm  # noqa: E402


@triton.jit
def tma_reduce_kernel(x_desc, r_desc, res_desc, h_ptr, seg_ptr, M, K, chunk_rows, n_chunks,
                      R: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, HAS_RES: tl.constexpr,
                      STATS: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    nkb = K // BK
    n_seg = K // BK
    for c in range(n_chunks):
        r0 = c * chunk_rows
        r1 = tl.minimum(r0 + chunk_rows, M)
        nrb = (r1 - r0 + R - 1) // R
        mine = tl.maximum(nrb - pid + G - 1, 0) // G
        for t in tl.range(0, mine * nkb, num_stages=STAGES):
            rb = r0 + (pid + (t // nkb) * G) * R
            k0 = (t % nkb) * BK
            xv = x_desc.load([rb, k0])
            rv = r_desc.load([rb, k0])
            tot = xv.to(tl.float32) + rv.to(tl.float32)
            hv = tot.to(tl.bfloat16)
            if HAS_RES:
                resv = res_desc.load([rb, k0])
                hv = (hv.to(tl.float32) + resv.to(tl.float32)).to(tl.bfloat16)
            rows = rb + tl.arange(0, R)
            ok = rows < r1
            off2 = rows.to(tl.int64)[:, None] * K + k0 + tl.arange(0, BK)[None, :]
            tl.store(h_ptr + off2, hv, mask=ok[:, None])
            if STATS:
                hf = hv.to(tl.float32)
                smean = tl.sum(hf, axis=1) / BK
                d = hf - smean[:, None]
                sm2 = tl.sum(d * d, axis=1)
                sidx = rows.to(tl.int64) * n_seg + k0 // BK
                _store_in_place(seg_ptr + sidx, smean, ok, True)
                _store_in_place(seg_ptr + M * n_seg + sidx, sm2, ok, True)


def main() -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    dev = torch.device("cuda", 0)
    m, k, chunks = 16384, 8192, 16
    dt = torch.bfloat16
    x = torch.randn(m, k, device=dev, dtype=dt)
    recv = torch.randn(1, m, k, device=dev, dtype=dt)
    res = torch.randn(m, k, device=dev, dtype=dt)
    h = torch.empty_like(x)
    seg = torch.empty(2 * m * (k // 256), device=dev, dtype=torch.float32)
    moved = 4 * m * k * 2

    def timeit(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / 10

    ref = ((x.float() + recv[0].float()).to(dt).float() + res.float()).to(dt)
    print(f"reduce probe: M={m} K={k} bf16 x + recv + residual, {chunks} chunks; ms, GB/s", flush=True)
    starts = torch.tensor([i * m // chunks for i in range(chunks + 1)], dtype=torch.int32, device=dev)
    rflags = torch.ones(chunks, dtype=torch.int32, device=dev)
    err = torch.zeros(8, dtype=torch.int32, device=dev)
    stats = torch.empty(m, 2, device=dev, dtype=torch.float32)
    for programs in (8, 12, 16, 24):
        for folded in (False, True):
            ready = torch.zeros(chunks, dtype=torch.int32, device=dev)

            def op() -> None:
                launch_reduce_norm(x, recv, h, starts=starts, rflags=rflags, ready=ready, err=err, epoch=1, rank=0,
                                   world=2, programs=programs, residual=res, norm="layernorm" if folded else None,
                                   stats=stats if folded else None)

            ms = timeit(op)
            print(f"  op kernel {'add+stats' if folded else 'add      '} programs {programs:3d}: {ms:.3f} ms "
                  f"{moved / ms / 1e6:6.0f} GB/s", flush=True)
    for r in (16, 32):
        for stages in (3, 4):
            for warps in (4, 8):
                xd = TensorDescriptor(x, x.shape, x.stride(), [r, 256])
                rd = TensorDescriptor(recv[0], recv[0].shape, recv[0].stride(), [r, 256])
                sd = TensorDescriptor(res, res.shape, res.stride(), [r, 256])
                for stats_on in (False, True):
                    for programs in (8, 12, 16, 24):
                        h.zero_()

                        def run() -> None:
                            tma_reduce_kernel[(programs,)](xd, rd, sd, h, seg, m, k, m // chunks, chunks, R=r, BK=256,
                                                           STAGES=stages, HAS_RES=True, STATS=stats_on,
                                                           num_warps=warps)

                        try:
                            ms = timeit(run)
                        except Exception as ex:  # noqa: BLE001
                            print(f"  tma R={r} stages={stages} warps={warps}: failed {type(ex).__name__} {ex}"[:200])
                            break
                        ok = "" if torch.equal(h, ref) else "  WRONG h"
                        print(f"  tma R={r:2d} stages={stages} warps={warps} {'add+stats' if stats_on else 'add      '} "
                              f"programs {programs:3d}: {ms:.3f} ms {moved / ms / 1e6:6.0f} GB/s{ok}", flush=True)


if __name__ == "__main__":
    main()
