"""A probe: C tiles 192 columns wide, as one 128-column and one 64-column accumulator,
against the library's tuned GEMM and cuBLAS on the shapes where power-of-two tiles leave
SMs idle (one GPU).

    python benchmarks/diag/wide_tile_diag.py [--out DIR] [--rounds 5]
    TRITON_INTERPRET=1 python benchmarks/diag/wide_tile_diag.py --check   (CPU, tiny shapes)

Triton's blocks are powers of two, so a tile is 128x128 or 128x256, and a GEMM whose tile
count falls just under a wave of SMs leaves the rest idle for the whole run: 2048x1536 has
96 tiles of 128x256 on 132 SMs (0.73 of the machine), 2 waves of half-size tiles take as
long. A tile of 128 x (128 + 64) is two power-of-two accumulators over the same A rows and
two B descriptors (blocks of 128 and 64 columns): 2048x1536 is then 128 tiles, 0.97 of the
machine. The probe is the flattened persistent GEMM (one software pipeline over a program's
tiles and K steps, as ``GemmConfig.flatten``), tiles in GROUP_M order, no flags.

Per shape: cuBLAS (``torch.mm``), the library's pick (``tune_gemm(flatten=True)`` through
``launch_gemm``) and the probe at 3 and 4 stages, 8 warps, each checked against cuBLAS,
then CUDA-graph replays in interleaved rounds (medians). Writes ``wide_tile_diag.json``.
``--check``: the probe against torch on tiny shapes (both B layouts, ragged edges) under
the interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

# (M, N, K, B layout, dtype): the sweep's shapes under 0.95x at 1079ae3 where a 192-wide
# tile changes the wave count, and two it should not help (many whole waves)
SHAPES = ((2048, 1536, 4096, "nk", "float16"), (1024, 9216, 6144, "nk", "bfloat16"),
          (4096, 10752, 3584, "nk", "bfloat16"), (1024, 18944, 3584, "kn", "bfloat16"),
          (2048, 1536, 8192, "nk", "bfloat16"), (4096, 3072, 4096, "nk", "bfloat16"),
          (8192, 3696, 8192, "nk", "float16"), (16384, 16384, 4096, "nk", "bfloat16"))


@triton.jit
def wide_gemm_kernel(a_desc, b0_desc, b1_desc, c_ptr, M, N, K, stride_cm, num_progs,
                     BM: tl.constexpr, BN0: tl.constexpr, BN1: tl.constexpr, BK: tl.constexpr,
                     GROUP_M: tl.constexpr, B_KN: tl.constexpr, UPCAST: tl.constexpr):
    """C = A @ B in tiles of BM x (BN0 + BN1): acc0 the first BN0 columns, acc1 the next BN1."""
    pid = tl.program_id(0)
    BN: tl.constexpr = BN0 + BN1
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    in_group = GROUP_M * num_pid_n
    k_tiles = tl.cdiv(K, BK)
    mine = tl.maximum(num_tiles - pid + num_progs - 1, 0) // num_progs
    offs_i = tl.arange(0, BM)
    offs_j0 = tl.arange(0, BN0)
    offs_j1 = tl.arange(0, BN1)
    for j in tl.range(0, mine, flatten=True):
        t = pid + j * num_progs
        first_m = (t // in_group) * GROUP_M
        gsize = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (t % in_group) % gsize
        pid_n = (t % in_group) // gsize
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc0 = tl.zeros((BM, BN0), dtype=tl.float32)
        acc1 = tl.zeros((BM, BN1), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BK
            a = a_desc.load([off_m, off_k])
            if B_KN:
                b0 = b0_desc.load([off_k, off_n])
                b1 = b1_desc.load([off_k, off_n + BN0])
            else:
                b0 = b0_desc.load([off_n, off_k]).T
                b1 = b1_desc.load([off_n + BN0, off_k]).T
            if UPCAST:  # the interpreter's bf16 dot is wrong; fp32 is exact there
                a = a.to(tl.float32)
                b0 = b0.to(tl.float32)
                b1 = b1.to(tl.float32)
            acc0 = tl.dot(a, b0, acc0)
            acc1 = tl.dot(a, b1, acc1)
        rows = off_m + offs_i
        cols0 = off_n + offs_j0
        cols1 = off_n + BN0 + offs_j1
        base = c_ptr + rows[:, None] * stride_cm
        tl.store(base + cols0[None, :], acc0.to(c_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols0[None, :] < N))
        tl.store(base + cols1[None, :], acc1.to(c_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols1[None, :] < N))


def launch_wide(a, b, c, *, grid: int, bm: int = 128, bn0: int = 128, bn1: int = 64, bk: int = 64,
                stages: int = 3, warps: int = 8, group_m: int = 8) -> None:
    """C = A @ B with the probe; ``b`` is [K, N] row-major or ``w.t()`` of an [N, K] ``w``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from overlap.kernels.tile_gemm import b_operand, interpreting

    store, b_kn = b_operand(b)
    m, k = a.shape
    n = c.shape[1]
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    if b_kn:
        b0, b1 = (TensorDescriptor.from_tensor(store, [bk, w]) for w in (bn0, bn1))
    else:
        b0, b1 = (TensorDescriptor.from_tensor(store, [w, bk]) for w in (bn0, bn1))
    tiles = -(-m // bm) * -(-n // (bn0 + bn1))
    progs = max(1, min(grid, tiles))
    interp = interpreting()
    wide_gemm_kernel[(progs,)](a_desc, b0, b1, c, m, n, k, c.stride(0), progs, BM=bm, BN0=bn0, BN1=bn1, BK=bk,
                               GROUP_M=group_m, B_KN=b_kn, UPCAST=interp and str(a.dtype) == "torch.bfloat16",
                               num_warps=warps, num_stages=stages)


def check() -> None:
    """The probe against torch on tiny shapes under the interpreter: both B layouts, rows and
    columns that end inside a tile, more tiles than programs; inputs new every call."""
    import torch

    g = torch.Generator().manual_seed(0)
    for m, n, k, dt in ((70, 104, 48, torch.float16), (33, 48, 32, torch.bfloat16), (96, 152, 16, torch.float16)):
        for kn in (False, True):
            for _ in range(2):
                a = torch.randn(m, k, generator=g).to(dt)
                w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dt)
                b = w.t().contiguous() if kn else w.t()
                c = torch.full((m, n), float("nan"), dtype=dt)
                launch_wide(a, b, c, grid=3, bm=32, bn0=32, bn1=16, bk=16, stages=1, warps=4, group_m=2)
                ref = a.double() @ w.double().t()
                err = ((c.double() - ref).norm() / ref.norm()).item()
                assert not torch.isnan(c).any(), (m, n, k, kn, "an element not written")
                assert err < 1e-2, (m, n, k, kn, dt, err)
    print("PASS wide_tile check", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--check", action="store_true", help="the interpreter check on tiny shapes")
    args = ap.parse_args()
    if args.check:
        check()
        return
    import torch

    from benchmarks.context import run_context
    from overlap.kernels.autotune import GraphTimer, _cfg_str, tune_gemm
    from overlap.kernels.tile_gemm import launch_gemm

    dev = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for m, n, k, lay, dt in SHAPES:
        dtype = getattr(torch, dt)
        g = torch.Generator(device=dev).manual_seed(m + n + k)
        a = torch.randn(m, k, device=dev, dtype=dtype, generator=g)
        w = torch.randn(n, k, device=dev, dtype=dtype, generator=g) / k ** 0.5
        b = w.t().contiguous() if lay == "kn" else w.t()
        ref = torch.mm(a, b)
        pick = tune_gemm(m, n, k, dtype=dtype, device=dev, b_kn=lay == "kn", flatten=True)
        cs = {}
        fns = {"cublas": lambda: torch.mm(a, b),
               "library": lambda: launch_gemm(a, b, cs["library"], grid=sms, config=pick)}
        for st in (3, 4):
            fns[f"wide s{st}"] = lambda st=st: launch_wide(a, b, cs[f"wide s{st}"], grid=sms, stages=st)
        errs = {}
        for name, fn in fns.items():
            if name != "cublas":
                cs[name] = torch.full((m, n), float("nan"), device=dev, dtype=dtype)
                fn()
                torch.cuda.synchronize()
                errs[name] = float((cs[name].float() - ref.float()).norm() / ref.float().norm())
        timers = {name: GraphTimer(fn) for name, fn in fns.items()}
        ms: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, t in timers.items():
                ms[name].append(t.ms())
        med = {name: statistics.median(v) for name, v in ms.items()}
        tiles = {"128x256": -(-m // 128) * -(-n // 256), "128x192": -(-m // 128) * -(-n // 192),
                 "128x128": -(-m // 128) * -(-n // 128)}
        row = {"m": m, "n": n, "k": k, "b_layout": lay, "dtype": dt, "library_config": _cfg_str(pick),
               "ms": med, "rounds": ms, "rel_err": errs, "tiles": tiles,
               "over_cublas": {name: med["cublas"] / v for name, v in med.items()}}
        rows.append(row)
        print(f"{m:6d}x{n:6d}x{k:6d} {lay} {dt:8s} | " + " ".join(f"{name} {v:.4f}" for name, v in med.items())
              + " | /cuBLAS " + " ".join(f"{name} {v:.3f}" for name, v in row["over_cublas"].items())
              + f" | lib {_cfg_str(pick)} | waves 128x256 {tiles['128x256'] / sms:.2f} 128x192 "
              f"{tiles['128x192'] / sms:.2f} | err {max(errs.values()):.1e}", flush=True)
        del timers
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "wide_tile_diag.json"), "w") as fh:
        json.dump({"context": run_context(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
