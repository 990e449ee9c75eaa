"""The p2p all-reduce's reduce (+ add + norm) kernel alone, on one GPU, flags pre-set.

    python benchmarks/bench_reduce_norm.py [--m 16384] [--k 8192] [--programs 16 32] [--quick] [--fold N ...]

Every wait is already satisfied, so this is the kernel's own speed: ms and GB/s moved
(partials and residual read, h and y written) per program count and block shape: the
sum alone, with the residual, with residual and LayerNorm (y written), and with the
LayerNorm folded into the consumer GEMM (row statistics written instead of y); the
statistics from whole rows ("rows") or summed over column segments and merged
("segs", ``segment``); loads through L1 or
streamed past it; and the residual placed off the other tensors' alignment.
``--quick``: the default block shape and the shared reduce's small programs only. The op leaves the kernel a few SMs while the
GEMM runs; how fast it is on them decides how much of the copy time it can hide behind.
``--fold N``: also the folded norm's pass over B [K, N] (``overlap.kernels.norm_fold``) alone,
B as an nn.Linear weight's ``w.t()`` and row-major.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from overlap.kernels.add_norm import ReduceShape, launch_reduce_norm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--programs", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--fold", type=int, nargs="*", default=[],
                    help="also time fold_norm (the folded norm's pass over B [K, N]) for these N")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    m, k, world = args.m, args.k, args.world
    dt = torch.bfloat16
    x = torch.randn(m, k, device=dev, dtype=dt)
    recv = torch.randn(world - 1, m, k, device=dev, dtype=dt)
    res = torch.randn(m, k, device=dev, dtype=dt)
    h = torch.empty_like(x)
    y = torch.empty_like(x)
    w = torch.ones(k, device=dev, dtype=dt)
    bias = torch.zeros(k, device=dev, dtype=dt)
    chunks = 8
    starts = torch.tensor([i * m // chunks for i in range(chunks + 1)], dtype=torch.int32, device=dev)
    rflags = torch.full(((world - 1) * chunks,), 1, dtype=torch.int32, device=dev)
    err = torch.zeros(8, dtype=torch.int32, device=dev)
    stats = torch.empty(m, 2, device=dev, dtype=torch.float32)
    print(f"reduce_norm alone: M={m} K={k} world={world} bf16, {chunks} chunks; ms, GB/s", flush=True)
    # (name, residual, norm, folded, segment): folded writes each row's statistics instead
    # of y, from whole rows (segment 0) or from segments (None: the kernel's width)
    # "segs": the output pass in blocks of the block's rows; "y2x": of twice them (y_rows;
    # the op's default where the block is exactly K columns)
    modes = (("sum", False, False, False, None), ("add", True, False, False, None),
             ("add+ln rows", True, True, False, 0), ("add+ln segs", True, True, False, None),
             ("add+ln segs y2x", True, True, False, None),
             ("add+ln fold rows", True, True, True, 0), ("add+ln fold segs", True, True, True, None))
    # (block_k, rows, warps) or None (the kernel's default for this K), loads streamed past L1
    variants = ((None, False), (None, True), ((None, 2, 16), False), ((None, 2, 16), True), ((None, 1, 16), True),
                ((None, 1, 8), True), ((4096, 8, 16), True), ((2048, 2, 4), False))
    if args.quick:  # the default shape, and the shared reduce's small programs (overlap.ops.all_reduce)
        variants = ((None, False), ((2048, 2, 4), False))
    # the residual 1 MB + 4 KB away from the partials' and h's alignment (DRAM and L2 slice spread)
    res_off = torch.empty(m * k + (1 << 19) + 2048, device=dev, dtype=dt)[(1 << 19) + 2048:].view(m, k)
    res_off.copy_(res)
    for name, with_res, ln, folded, segment in modes:
        tensors = (world + (1 if with_res else 0)) * m * k * 2 + m * k * 2  # partials (+ residual) read, h written
        moved = tensors + (m * k * 2 if ln and not folded else 0)
        runs = [(shape, stream, res) for shape, stream in variants]
        if with_res and not args.quick:
            runs.append((None, True, res_off))
        for shape, stream, r_t in runs:
            bk, rows, nw = shape if shape is not None else (None, None, None)
            for programs in args.programs:
                ready = torch.zeros(chunks, dtype=torch.int32, device=dev)

                def run() -> None:
                    launch_reduce_norm(x, recv, h, starts=starts, rflags=rflags, ready=ready, err=err, epoch=1,
                                       rank=0, world=world, programs=programs,
                                       residual=r_t if with_res else None, norm="layernorm" if ln else None,
                                       weight=w if ln and not folded else None,
                                       bias=bias if ln and not folded else None,
                                       y=y if ln and not folded else None, stats=stats if folded else None,
                                       shape=ReduceShape(
                                           num_warps=nw, rows=rows, block_k=bk, stream_loads=stream,
                                           segment=segment if ln else None,
                                           y_rows=(2 if name.endswith("y2x") else 1) * (rows or _default_rows(k, bk))
                                           if ln and not folded and segment is None else None))

                label = (f"{name:16s} block {str(shape or 'default'):15s} {'streamed' if stream else 'cached  '}"
                         f"{' residual offset' if r_t is res_off else ''}")
                try:
                    for _ in range(3):
                        run()
                    torch.cuda.synchronize()
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    for _ in range(10):
                        run()
                    e.record()
                    torch.cuda.synchronize()
                    ms = s.elapsed_time(e) / 10
                    bad = _check(x, recv, r_t if with_res else None, h, stats if folded else None,
                                 y if ln and not folded else None)
                    print(f"  {label} programs {programs:3d}: {ms:.3f} ms {moved / ms / 1e6:7.0f} GB/s "
                          f"({moved / ms / 1e6 / programs:5.1f} per program){bad}", flush=True)
                except Exception as ex:  # noqa: BLE001 - e.g. too many registers for a block shape
                    print(f"  {label} programs {programs}: failed ({type(ex).__name__}: {ex})"[:200], flush=True)
    assert err[0].item() == 0, err
    for n in args.fold:
        _time_fold(k, n, dev, dt)


def _time_fold(k: int, n: int, dev: torch.device, dt: torch.dtype) -> None:
    """fold_norm alone on the whole GPU: B as an nn.Linear weight's w.t() and row-major,
    LayerNorm weight and bias; ms and GB/s (B read, B' written)."""
    from overlap.kernels.norm_fold import FoldPlan

    w = torch.randn(k, device=dev, dtype=dt)
    bias = torch.randn(k, device=dev, dtype=dt)
    moved = 2 * k * n * 2
    for layout, b in (("w.t()", torch.randn(n, k, device=dev, dtype=dt).t()),
                      ("row-major", torch.randn(k, n, device=dev, dtype=dt))):
        fp = FoldPlan(b, w, bias, num_sms=torch.cuda.get_device_properties(dev).multi_processor_count)
        out, vec = fp.launch(b, w, bias)
        ref = b.float() * w.float()[:, None]
        off = (out.float() - ref).abs().max().item()
        bad = "" if off <= 1e-2 * ref.abs().max().item() else f"  WRONG B' ({off:.2e})"
        for _ in range(3):
            fp.launch(b, w, bias, out, vec)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            fp.launch(b, w, bias, out, vec)
        e.record()
        torch.cuda.synchronize()
        ms = s.elapsed_time(e) / 20
        print(f"fold_norm alone: K={k} N={n} B {layout:9s} {fp.grid} programs: {ms:.4f} ms "
              f"{moved / ms / 1e6:7.0f} GB/s{bad}", flush=True)


def _default_rows(k: int, block_k: int | None) -> int:
    from overlap.kernels.add_norm import reduce_block_shape

    return reduce_block_shape(k, block_k)[1]


def _check(x: torch.Tensor, recv: torch.Tensor, res: torch.Tensor | None, h: torch.Tensor,
           stats: torch.Tensor | None, y: torch.Tensor | None = None) -> str:
    """'' if h (and the folded statistics, or y: LayerNorm with unit weight, no bias)
    match torch's, else what is off."""
    ref = (x.float() + recv.float().sum(0)).to(x.dtype)
    if res is not None:
        ref = (ref.float() + res.float()).to(x.dtype)
    if not torch.equal(h, ref):
        return "  WRONG h"
    if stats is not None:
        var, mean = torch.var_mean(ref.float(), dim=1, unbiased=False)
        rstd = torch.rsqrt(var + 1e-5)
        err = max((stats[:, 0] - rstd).abs().max().item() / rstd.abs().max().item(),
                  (stats[:, 1] - mean * rstd).abs().max().item())
        if err > 1e-4:
            return f"  WRONG statistics ({err:.2e})"
    if y is not None:
        err = (y.float() - torch.nn.functional.layer_norm(ref.float(), (ref.shape[1],), eps=1e-5)).abs().max().item()
        if err > 0.05:
            return f"  WRONG y ({err:.2e})"
    return ""


if __name__ == "__main__":
    main()
