"""Train the small GPT (overlap.models) with tensor parallelism applied from outside.

    python launch/train_gpt.py                                   # one process
    bash launch/torchrun.sh 2 launch/train_gpt.py --tp 2         # 2 ranks, TP 2
    bash launch/torchrun.sh 4 launch/train_gpt.py --tp 2 --sp    # TP 2 x DP 2, sequence parallel
    bash launch/mpirun.sh   2 launch/train_gpt.py --tp 2 --path overlap

Every rank builds the same unsharded GPT from ``--seed``; with ``--tp`` > 1
``overlap.nn.parallelize`` then swaps its Linear layers for column / row-parallel ones
(attn.qkv, mlp.fc1 column; attn.proj, mlp.fc2 row) over the tensor-parallel group.

Data: every rank draws the same global batch [batch, block] from one generator seeded by
``--seed``; a data-parallel rank (world > tp) trains on its slice of the rows and the
gradients are averaged over the data-parallel group, so the loss curve is the one a
single process computes on the whole batch, whatever the layout.

Outputs (rank 0 writes the shared ones):

    OUT/train.json        config, run context (torch, device, date, commit), per-step loss and
                          tokens/s, validation losses
    OUT/loss.png          training loss per step and validation loss (needs matplotlib; skipped
                          with a note without it)
    OUT/ckpt/rank{r}.pt   with --save-every N only (checkpoints are off by default): every rank's
                          own shard (model, optimizer, step, RNG states, loss history) with a
                          checksum and the run's config (overlap.models.checkpoint)

``--steps`` is the step to stop at, counted from the start of the run: ``--resume``
continues from the checkpoint's step to ``--steps`` (which must be past it) and reproduces
the loss curve of an uninterrupted run exactly (the learning rate is constant, so nothing
depends on where a run stops).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

import overlap
from overlap.models import GPT, GPTConfig, checkpoint, corpus

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size; must divide the world size")
    p.add_argument("--sp", action="store_true", help="sequence parallel (needs --tp > 1)")
    p.add_argument("--path", choices=["plain", "overlap"], default="plain",
                   help="overlap.nn layers' overlap=False (plain collectives) or overlap=True (fused ops)")
    p.add_argument("--steps", type=int, default=20, help="stop after this many steps (counted from 0)")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--block", type=int, default=64, help="sequence length T")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (constant)")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="parameter and activation dtype (auto: bf16 on GPUs, fp32 on CPU); the "
                        "fused ops' tile-flag paths need bf16/fp16 on a GPU, fp32 runs their references")
    p.add_argument("--out", type=Path, default=Path("runs/train_gpt"),
                   help="output directory: train.json, loss.png, ckpt/ (default: %(default)s)")
    p.add_argument("--save-every", type=int, default=0,
                   help="write OUT/ckpt/rank{r}.pt every N steps and at the end (default 0: no checkpoints)")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT/ckpt to --steps (which must be past the checkpoint's step)")
    p.add_argument("--log-every", type=int, default=10, help="progress line every N steps (rank 0)")
    p.add_argument("--eval-every", type=int, default=10,
                   help="validation loss every N steps and at the end (0: at the end only)")
    p.add_argument("--timeout", type=float, default=120.0, help="start-up and collective timeout, s")
    args = p.parse_args(argv)
    for name in ("tp", "steps", "batch", "block", "n_layer", "n_head", "n_embd", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.save_every < 0:
        p.error("--save-every must be >= 0")
    if args.eval_every < 0:
        p.error("--eval-every must be >= 0")
    if args.n_embd % args.n_head:
        p.error(f"--n-embd {args.n_embd} is not a multiple of --n-head {args.n_head}")
    if args.n_head % args.tp:
        p.error(f"--n-head {args.n_head} is not a multiple of --tp {args.tp}")
    if args.sp and args.tp == 1:
        p.error("--sp needs --tp > 1 (sequence parallelism shards over the tensor-parallel group)")
    if args.sp and args.block % args.tp:
        p.error(f"--sp: --block {args.block} is not a multiple of --tp {args.tp}")
    return args


_EPILOG = """outputs (in --out; rank 0 writes the shared ones):
  train.json       the flags, the model config, the run context, per-step loss and tokens/s,
                   the validation losses, the path each fused op took (overlap.report())
  loss.png         training loss per step, validation loss at --eval-every (needs matplotlib)
  ckpt/rank{r}.pt  each rank's shard; only with --save-every N (checkpoints are off by default)

more than one rank needs a launcher:
  bash launch/torchrun.sh 2 launch/train_gpt.py --tp 2
  bash launch/mpirun.sh   2 launch/train_gpt.py --tp 2
"""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        ctx = overlap.init(tp_size=args.tp, timeout_s=args.timeout)
    except overlap.DistInitError as exc:  # a start-up problem: the message, no traceback
        print(f"train_gpt.py: {exc}", file=sys.stderr)
        try:
            single = overlap.detect_launch().launcher == "single"
        except overlap.DistInitError:
            single = False
        if single and args.tp > 1:
            cmd = " ".join(["launch/train_gpt.py", *(sys.argv[1:] if argv is None else argv)])
            print(f"train_gpt.py: --tp {args.tp} needs {args.tp} ranks (or a multiple); start them "
                  f"with a launcher:\n  bash launch/torchrun.sh {args.tp} {cmd}\n"
                  f"  bash launch/mpirun.sh {args.tp} {cmd}", file=sys.stderr)
        return 2
    try:
        return train(args, ctx)
    finally:
        overlap.shutdown()


# --------------------------------------------------------------------------------------
# model, optimizer, checkpoints
# --------------------------------------------------------------------------------------


def model_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(vocab_size=corpus.tokenizer().vocab_size, block_size=args.block,
                     n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)


def build_model(args: argparse.Namespace, ctx: overlap.DistContext, dtype: torch.dtype) -> tuple[GPT, int]:
    """The same unsharded GPT on every rank, then sharded over the tp group; and its
    unsharded parameter count. Parameters in ``dtype`` (bf16 on GPUs: no fp32 master
    weights, a demo's trade-off; the layers' fused ops take the weights as they are)."""
    model = GPT(model_config(args), seed=args.seed).to(device=ctx.device, dtype=dtype)
    n_params = model.num_params()
    if ctx.tp_size > 1:
        overlap.parallelize(model, ctx.tp_group, sequence_parallel=args.sp, overlap=args.path == "overlap")
    return model, n_params


def make_optimizer(model: GPT, lr: float) -> torch.optim.AdamW:
    """AdamW, nanoGPT's groups: weight decay on matrices, none on biases and LayerNorms.
    Elementwise, so a shard's update is the slice of the unsharded update."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def ckpt_path(out: Path, rank: int) -> Path:
    return out / "ckpt" / f"rank{rank}.pt"


def load_checkpoint(args: argparse.Namespace, ctx: overlap.DistContext, model: GPT,
                    opt: torch.optim.Optimizer, gen: torch.Generator) -> tuple[int, list[dict], list[dict]]:
    """Restore this rank's shard; returns (step to continue from, history, validation
    points so far). Every rank checks its own file (checksum, layout, state) and the
    verdicts travel in one all-reduce before anything else is collective, so a bad file
    on one rank stops every rank at once, each naming the ranks and the reason."""
    path = ckpt_path(args.out, ctx.rank)
    layout = ckpt_layout(args, ctx, model)
    step, history, val, err = -1, [], [], ""
    try:
        if not path.exists():
            raise checkpoint.CheckpointError(f"rank {ctx.rank} has no checkpoint {path}")
        state, config = checkpoint.load(path, map_location=ctx.device)
        if config.get("layout") != layout:
            raise checkpoint.CheckpointError(f"checkpoint {path} was written by {config.get('layout')}, "
                                             f"this run is {layout}")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["data_rng"])
        torch.set_rng_state(state["torch_rng"])
        if torch.cuda.is_available() and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], ctx.device)
        step, history, val = int(state["step"]), list(state["history"]), list(state.get("val", []))
    except (checkpoint.CheckpointError, KeyError, TypeError, ValueError, RuntimeError) as exc:
        err = f"{type(exc).__name__}: {exc}" if not isinstance(exc, checkpoint.CheckpointError) else str(exc)
    # [failed?, step] per rank, each rank in its own slot: one all-reduce tells all
    verdicts = torch.zeros(ctx.world_size, 2, dtype=torch.int64, device=ctx.device)
    verdicts[ctx.rank] = torch.tensor([1 if err else 0, step])
    tdist.all_reduce(verdicts)
    failed = [r for r in range(ctx.world_size) if verdicts[r, 0].item()]
    if failed:
        mine = f": {err}" if err else ""
        raise SystemExit(f"--resume: the checkpoints of rank(s) {failed} cannot be used (each names its "
                         f"reason); rank {ctx.rank}{mine or ' is fine'}")
    steps = sorted({int(v) for v in verdicts[:, 1].tolist()})
    if len(steps) > 1:
        raise SystemExit(f"--resume: the ranks' checkpoints are at different steps {steps}; "
                         f"delete {args.out / 'ckpt'}")
    if step >= args.steps:
        raise SystemExit(f"--resume: the checkpoint in {args.out / 'ckpt'} is at step {step}, --steps is "
                         f"{args.steps}: nothing to train (--steps counts from the start of the run; pass "
                         f"--steps > {step} to continue, or another --out to start over)")
    return step, history, val


def ckpt_layout(args: argparse.Namespace, ctx: overlap.DistContext, model: GPT) -> dict[str, Any]:
    """What a checkpoint's shards depend on; a resumed run must have the same."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return {"world_size": ctx.world_size, "tp_size": ctx.tp_size, "sp": args.sp, "batch": args.batch,
            "dtype": dtype, "model": model_config_dict(model)}


def model_config_dict(model: GPT) -> dict[str, Any]:
    c = model.config
    return {f: getattr(c, f) for f in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd",
                                       "dropout", "bias")}


# --------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------


def train(args: argparse.Namespace, ctx: overlap.DistContext) -> int:
    dev = ctx.device
    if args.batch % ctx.dp_size:
        raise SystemExit(f"--batch {args.batch} is not a multiple of the data-parallel size {ctx.dp_size}")
    on_gpu = dev.type == "cuda"
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if on_gpu else torch.float32)

    def say(*a: object) -> None:
        if ctx.is_main:
            print(*a, flush=True)

    torch.manual_seed(args.seed)  # dropout, if a config turns it on
    model, n_params = build_model(args, ctx, dtype)
    opt = make_optimizer(model, args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)  # the data order, the same on every rank
    start, history, val_points = 0, [], []
    if args.resume:
        start, history, val_points = load_checkpoint(args, ctx, model, opt, gen)

    b_local = args.batch // ctx.dp_size
    rows = slice(ctx.dp_rank * b_local, (ctx.dp_rank + 1) * b_local)
    tokens_per_step = args.batch * args.block
    say(f"GPT {n_params / 1e6:.3f}M params, "
        f"layers={args.n_layer} heads={args.n_head} embd={args.n_embd} vocab={model.config.vocab_size}")
    say(f"world={ctx.world_size} tp={ctx.tp_size} dp={ctx.dp_size} sp={args.sp} path={args.path} "
        f"device={dev} backend={ctx.backend} dtype={str(dtype).removeprefix('torch.')}"
        + ("" if on_gpu else " (CPU: figures are not GPU figures)"))
    if args.path == "overlap" and ctx.tp_size == 1:
        say("note: --path overlap changes nothing at --tp 1 (no tensor-parallel layers)")
    if start:
        say(f"resumed at step {start} from {args.out / 'ckpt'}")

    model.train()
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        x, y = corpus.get_batch("train", args.batch, args.block, gen)  # (batch, block) each
        x, y = x[rows].to(dev), y[rows].to(dev)  # (batch / dp, block): this dp rank's rows
        _, loss = model(x, y)
        loss.backward()
        if ctx.dp_size > 1:
            average_grads(model, ctx.dp_group, ctx.dp_size)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_all = loss.detach().float().reshape(1)  # (1,)
        if ctx.dp_size > 1:  # the loss of the whole batch: mean of equal-sized slices
            tdist.all_reduce(loss_all, group=ctx.dp_group)
            loss_all /= ctx.dp_size
        loss_val = loss_all.item()  # also waits for the step's GPU work
        dt = time.perf_counter() - t0
        history.append({"step": step, "loss": loss_val, "tokens_per_s": tokens_per_step / dt})
        if (step + 1) % args.log_every == 0 or step == start or step + 1 == args.steps:
            say(f"step {step + 1:5d}/{args.steps}  loss {loss_val:.4f}  {tokens_per_step / dt:,.0f} tokens/s")
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 != args.steps:
            val_points.append({"step": step + 1, "loss": val_loss(model, args, dev)})
            say(f"step {step + 1:5d}/{args.steps}  val loss {val_points[-1]['loss']:.4f}")
        if step + 1 == args.steps:
            val_points.append({"step": step + 1, "loss": val_loss(model, args, dev)})
        if args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
            checkpoint.save(ckpt_path(args.out, ctx.rank), {
                "step": step + 1, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "data_rng": gen.get_state(), "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state(dev) if on_gpu else None,
                "history": history, "val": val_points,
            }, {"layout": ckpt_layout(args, ctx, model), "args": run_args(args), "rank": ctx.rank})

    val = val_points[-1]["loss"]
    say(f"val loss {val:.4f}")
    if args.path == "overlap":  # which path each fused op took, and why (rank 0's calls)
        say(str(overlap.report()))
    if ctx.is_main:
        write_results(args, ctx, model, history, val_points)
    ctx.barrier()
    return 0


def average_grads(model: GPT, group: tdist.ProcessGroup, n: int) -> None:
    """Data parallelism kept simple: one all-reduce of every gradient, flattened."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])  # (sum of numels,)
    tdist.all_reduce(flat, group=group)
    flat /= n
    for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(chunk.view_as(g))


@torch.no_grad()
def val_loss(model: GPT, args: argparse.Namespace, dev: torch.device, batches: int = 4) -> float:
    """Mean loss on a few fixed validation batches (its own generator: the training data
    order does not move). Every rank of a tp group computes the same value."""
    model.eval()
    gen = torch.Generator().manual_seed(10_000 + args.seed)
    total = 0.0
    for _ in range(batches):
        x, y = corpus.get_batch("val", args.batch, args.block, gen)  # (batch, block) each
        _, loss = model(x.to(dev), y.to(dev))
        total += loss.item()
    model.train()
    return total / batches


# --------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------


def run_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags, JSON-ready."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def run_context(ctx: overlap.DistContext) -> dict[str, Any]:
    """What produced the figures: versions, device, date, commit."""
    repo = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    dev = ctx.device
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit, "torch": torch.__version__, "python": platform.python_version(),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.machine()})",
        "backend": ctx.backend, "world_size": ctx.world_size, "tp_size": ctx.tp_size,
        "dp_size": ctx.dp_size, "launcher": ctx.launch.launcher,
    }


def write_results(args: argparse.Namespace, ctx: overlap.DistContext, model: GPT,
                  history: list[dict], val_points: list[dict]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    config = run_args(args)
    ops = [{"op": r["op"], "shape": r["shape"], "paths": r["paths"]} for r in overlap.report().rows
           if r["paths"]]
    result = {"config": config, "model": model_config_dict(model), "context": run_context(ctx),
              "losses": [h["loss"] for h in history], "steps": history, "val_loss": val_points[-1]["loss"],
              "val": val_points,  # [{step, loss}]: after step N, on the fixed validation batches
              "ops": ops}  # the library's ops this rank called: path taken and why
    (args.out / "train.json").write_text(json.dumps(result, indent=1) + "\n")
    note = plot_loss(history, val_points, args.out / "loss.png",
                     f"GPT, tp={ctx.tp_size} dp={ctx.dp_size} sp={args.sp} path={args.path}")
    print(f"wrote {args.out / 'train.json'}; {note}", flush=True)


def plot_loss(history: list[dict], val_points: list[dict], path: Path, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "loss.png skipped: matplotlib is not installed (pip install matplotlib)"
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] + 1 for h in history], [h["loss"] for h in history], label="training (batch)")
    ax.plot([v["step"] for v in val_points], [v["loss"] for v in val_points], "o", label="validation")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"wrote {path}"


if __name__ == "__main__":
    sys.exit(main())
