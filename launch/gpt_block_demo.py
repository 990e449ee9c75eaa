"""Tensor-parallel GPT-block forward: the main job's entry point.

    bash launch/torchrun.sh 2 launch/gpt_block_demo.py [--hidden 1024 --heads 16 ...]
    bash launch/mpirun.sh   2 launch/gpt_block_demo.py

The block (pre-LN GPT, plain tensor parallelism, no sequence parallelism)::

    x ─ LN1 ─ QKV (column-parallel) ─ attention, local heads ─ proj (row-parallel) ─ all-reduce ─(+x)─ h
    h ─ LN2 ─ fc1 (column-parallel) ─ GeLU ─ fc2 (row-parallel) ─ all-reduce ─(+h)─ out

Shapes (R = tp size, B batch, T sequence, H hidden, nh heads, hs = H / nh):

    x, h, out        [B, T, H]         replicated on every rank of a tp group
    w_qkv_shard_n    [3 * H / R, H]    q, k, v rows of this rank's nh / R heads
    w_proj_shard_k   [H, H / R]        proj columns of those heads; partial sums
    w_fc1_shard_n    [4H / R, H]
    w_fc2_shard_k    [H, 4H / R]       partial sums, then all-reduce

``--path reference`` (default): torch.distributed all-reduces (nccl on GPUs, gloo on
CPU) and torch matmuls. ``--path overlap``: the all-reduce after proj, the residual add,
LN2 and fc1 run as one ``overlap.ops.all_reduce_matmul`` (tile flags on fp16/bf16 GPUs;
its reference with a warning elsewhere). On rank 0 it checks the sharded result against
one unsharded computation of the same block (small shapes), then times the forward.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.distributed as tdist
import torch.nn.functional as F

import overlap

# Error allowed beyond twice the unsharded computation's own error against fp32, per dtype
# (the sharded sum of partial products rounds differently, not worse).
ATOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class BlockWeights:
    """One GPT block's parameters, nn.Linear layout (weight [out, in])."""

    ln1_w: torch.Tensor  # [H]
    ln1_b: torch.Tensor  # [H]
    w_qkv: torch.Tensor  # [3H, H] (rows: q heads, k heads, v heads) or a shard of it
    b_qkv: torch.Tensor  # [3H]
    w_proj: torch.Tensor  # [H, H]
    b_proj: torch.Tensor  # [H]  added once, after the all-reduce
    ln2_w: torch.Tensor  # [H]
    ln2_b: torch.Tensor  # [H]
    w_fc1: torch.Tensor  # [4H, H]
    b_fc1: torch.Tensor  # [4H]
    w_fc2: torch.Tensor  # [H, 4H]
    b_fc2: torch.Tensor  # [H]  added once, after the all-reduce

    def to(self, dtype: torch.dtype) -> BlockWeights:
        return BlockWeights(**{f.name: getattr(self, f.name).to(dtype) for f in fields(self)})


def make_weights(hidden: int, *, device: torch.device, dtype: torch.dtype, seed: int) -> BlockWeights:
    """Full (unsharded) weights; the same on every rank because the seed is."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    h = hidden
    return BlockWeights(
        ln1_w=1 + rand(h, scale=0.1), ln1_b=rand(h, scale=0.1),
        w_qkv=rand(3 * h, h, scale=h**-0.5), b_qkv=rand(3 * h, scale=0.02),
        w_proj=rand(h, h, scale=h**-0.5), b_proj=rand(h, scale=0.02),
        ln2_w=1 + rand(h, scale=0.1), ln2_b=rand(h, scale=0.1),
        w_fc1=rand(4 * h, h, scale=h**-0.5), b_fc1=rand(4 * h, scale=0.02),
        w_fc2=rand(h, 4 * h, scale=(4 * h) ** -0.5), b_fc2=rand(h, scale=0.02),
    )


def shard_weights(w: BlockWeights, *, heads: int, tp_rank: int, tp_size: int) -> BlockWeights:
    """This tp rank's slice: column-parallel layers split their rows, row-parallel their columns."""
    h = w.w_proj.shape[0]
    hs, nh_local = h // heads, heads // tp_size
    heads_sl = slice(tp_rank * nh_local, (tp_rank + 1) * nh_local)
    cols = slice(tp_rank * h // tp_size, (tp_rank + 1) * h // tp_size)  # this rank's heads
    ff = slice(tp_rank * 4 * h // tp_size, (tp_rank + 1) * 4 * h // tp_size)
    return BlockWeights(
        ln1_w=w.ln1_w, ln1_b=w.ln1_b,
        # (3, nh, hs, H) -> this rank's heads of q, k and v -> (3 * nh_local * hs, H)
        w_qkv=w.w_qkv.view(3, heads, hs, h)[:, heads_sl].reshape(3 * nh_local * hs, h).contiguous(),
        b_qkv=w.b_qkv.view(3, heads, hs)[:, heads_sl].reshape(3 * nh_local * hs).contiguous(),
        w_proj=w.w_proj[:, cols].contiguous(), b_proj=w.b_proj,
        ln2_w=w.ln2_w, ln2_b=w.ln2_b,
        w_fc1=w.w_fc1[ff].contiguous(), b_fc1=w.b_fc1[ff].contiguous(),
        w_fc2=w.w_fc2[:, ff].contiguous(), b_fc2=w.b_fc2,
    )


def block_forward(x: torch.Tensor, w: BlockWeights, n_head: int,
                  all_reduce: Callable[[torch.Tensor], torch.Tensor],
                  ar_ln_fc1: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
    """One block. Unsharded when ``w`` is full and ``all_reduce`` is the identity;
    tensor-parallel when ``w`` is a shard, ``n_head`` the local heads and ``all_reduce``
    sums over the tp group. The model code knows nothing else about distribution.
    ``ar_ln_fc1(partial, residual, w)``, when given, returns ``(LN2(h1) @ w_fc1.t(), h1)``
    with ``h1 = all_reduce(partial) + residual`` in one overlapped op."""
    b, t, h = x.shape
    hs = w.w_proj.shape[1] // n_head
    # attention
    a = F.layer_norm(x, (h,), w.ln1_w, w.ln1_b)
    qkv = F.linear(a, w.w_qkv, w.b_qkv)  # (B, T, 3 * n_head * hs)
    q, k, v = (z.view(b, t, n_head, hs).transpose(1, 2)  # (B, n_head, T, hs)
               for z in qkv.split(n_head * hs, dim=-1))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, n_head, T, hs)
    y = y.transpose(1, 2).reshape(b, t, n_head * hs)  # (B, T, H / R)
    # >>> OVERLAP SWITCH-IN POINT 1 (not in overlap.ops yet): the row-parallel proj GEMM
    # and its all-reduce become one overlapped op (GEMM tiles post per-chunk counters, the
    # comm stream all-reduces each chunk as it is produced: matmul_all_reduce).
    if ar_ln_fc1 is None:
        h1 = x + all_reduce(F.linear(y, w.w_proj)) + w.b_proj  # (B, T, H)
        m = F.layer_norm(h1, (h,), w.ln2_w, w.ln2_b)
        m = F.gelu(F.linear(m, w.w_fc1, w.b_fc1))  # (B, T, 4H / R)
    else:
        # all-reduce + residual + LN2 + fc1 in one op: fc1 tiles wait on the flags of
        # the all-reduce chunks they read (overlap.ops.all_reduce_matmul)
        c, h1 = ar_ln_fc1(F.linear(y, w.w_proj).reshape(b * t, h), (x + w.b_proj).reshape(b * t, h), w)
        h1 = h1.view(b, t, h)
        m = F.gelu(c.view(b, t, -1) + w.b_fc1)  # (B, T, 4H / R)
    return h1 + all_reduce(F.linear(m, w.w_fc2)) + w.b_fc2  # (B, T, H)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024, help="H")
    p.add_argument("--heads", type=int, default=16, help="nh; tp must divide it")
    p.add_argument("--seq", type=int, default=256, help="T")
    p.add_argument("--batch", type=int, default=2, help="B")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: world)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="auto: bf16 on GPU, fp32 on CPU")
    p.add_argument("--iters", type=int, default=10, help="timed forwards (after 2 warm-up)")
    p.add_argument("--check", choices=["auto", "on", "off"], default="auto",
                   help="compare with an unsharded forward on rank 0 (auto: small shapes only)")
    p.add_argument("--path", choices=["reference", "overlap"], default="reference",
                   help="overlap: all-reduce + residual + LN2 + fc1 through overlap.ops.all_reduce_matmul")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="start-up timeout, s")
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    if args.iters < 1:
        p.error("--iters must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        ctx = overlap.init(tp_size=args.tp, timeout_s=args.timeout)
    except overlap.DistInitError as exc:  # a start-up problem: the message, no traceback
        print(f"gpt_block_demo.py: {exc}", file=sys.stderr)
        return 2
    try:
        return run(args, ctx)
    finally:
        overlap.shutdown()


def run(args: argparse.Namespace, ctx: overlap.DistContext) -> int:
    dev, R = ctx.device, ctx.tp_size
    if args.heads % R:
        raise SystemExit(f"--heads {args.heads} is not a multiple of the tp size {R}")
    on_gpu = dev.type == "cuda"
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if on_gpu else torch.float32)
    B, T, H, nh = args.batch, args.seq, args.hidden, args.heads

    def say(*a: object) -> None:
        if ctx.is_main:
            print(*a, flush=True)

    full = make_weights(H, device=dev, dtype=dtype, seed=args.seed)
    w = shard_weights(full, heads=nh, tp_rank=ctx.tp_rank, tp_size=R)

    def tp_all_reduce(t: torch.Tensor) -> torch.Tensor:
        tdist.all_reduce(t, group=ctx.tp_group)
        return t

    # ---- path selection -----------------------------------------------------------------
    ar_ln_fc1 = None
    if args.path == "overlap":
        from overlap import ops

        ln2 = ops.Norm("layernorm", w.ln2_w, w.ln2_b, 1e-5)

        def ar_ln_fc1(partial: torch.Tensor, residual: torch.Tensor,
                      ww: BlockWeights) -> tuple[torch.Tensor, torch.Tensor]:
            return ops.all_reduce_matmul(partial, ww.w_fc1.t(), group=ctx.tp_group, residual=residual, norm=ln2)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return block_forward(x, w, nh // R, tp_all_reduce, ar_ln_fc1)

    what = ("overlap (all-reduce + residual + LN2 + fc1 in overlap.ops.all_reduce_matmul; other "
            "all-reduces through torch.distributed)" if ar_ln_fc1 else
            f"reference (torch.distributed all_reduce on {ctx.backend} + torch matmul)")
    path = f"{what}, tp={R}, world={ctx.world_size}, device={dev}, dtype={str(dtype).removeprefix('torch.')}"
    say(f"path: {path}")
    if on_gpu:
        say(f"GPU: {torch.cuda.get_device_name(dev)}")
    else:
        say("CPU reference path; figures are not GPU figures")
    say(f"shape: batch={B} seq={T} hidden={H} heads={nh}")

    def make_x(seed: int) -> torch.Tensor:
        g = torch.Generator(device=dev).manual_seed(seed)
        return torch.randn(B, T, H, generator=g, device=dev).to(dtype)  # (B, T, H)

    status = 0
    check = args.check == "on" or (args.check == "auto" and B * T * H <= 1 << 21 and H <= 4096)
    if check:
        # Two different inputs, so a result left over from the first cannot pass the second.
        worst = 0.0
        for i in range(2):
            x = make_x(args.seed + 1 + i)
            out = forward(x.clone())
            if ctx.is_main:
                ref32 = block_forward(x.float(), full.to(torch.float32), nh, lambda t: t)
                ref = block_forward(x, full, nh, lambda t: t)
                err = (out.float() - ref32).abs().max().item()
                err_ref = (ref.float() - ref32).abs().max().item()
                bound = 2 * err_ref + ATOL[dtype]
                worst = max(worst, err / bound)
                if not err <= bound:
                    status = 1
                say(f"check {i}: max|tp - fp32 ref| = {err:.3e}, max|unsharded - fp32 ref| = "
                    f"{err_ref:.3e}, bound {bound:.3e} -> {'PASS' if err <= bound else 'FAIL'}")
        say(f"check: {'PASS' if status == 0 else 'FAIL'} (sharded vs unsharded, worst {worst:.2f} of bound)")
    else:
        say("check: skipped (large shape; --check on forces it)")

    x = make_x(args.seed)
    for _ in range(2):  # warm-up: NCCL/gloo connections, allocator, kernels
        forward(x)
    ctx.barrier()
    if on_gpu:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            forward(x)
        end.record()
        torch.cuda.synchronize(dev)
        ms = start.elapsed_time(end) / args.iters
    else:
        t0 = time.perf_counter()
        for _ in range(args.iters):
            forward(x)
        ms = (time.perf_counter() - t0) * 1e3 / args.iters
    slowest = torch.tensor([ms], device=dev, dtype=torch.float64)
    tdist.all_reduce(slowest, op=tdist.ReduceOp.MAX)
    flops = 2 * B * T * 12 * H * H + 4 * B * T * T * H  # GEMMs + attention, whole block
    say(f"forward: {slowest.item():.3f} ms/iter (slowest rank, {args.iters} iters, "
        f"{'CUDA events' if on_gpu else 'perf_counter'}); "
        f"{flops / R / (slowest.item() * 1e-3) / 1e12:.3f} TFLOP/s per rank")
    if not math.isfinite(ms):
        status = 1
    # every rank exits with rank 0's verdict, so a launcher sees the failure
    verdict = torch.tensor([status], device=dev, dtype=torch.int32)
    tdist.all_reduce(verdict, op=tdist.ReduceOp.MAX)
    return int(verdict.item())


if __name__ == "__main__":
    sys.exit(main())
