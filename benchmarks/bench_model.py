"""An 8B-shaped Llama layer stack (HF transformers' decoder layers, built from a config),
forward + backward at TP R: ``overlap.parallelize`` against torch's ``parallelize_module``
(DTensor) and torch's async-TP. Modes:

    plain         ``overlap.parallelize(..., overlap=False)``: the same autograd on plain
                  NCCL collectives and cuBLAS (Megatron's schedule); the reference
    overlap       ``overlap.parallelize``: the library's fused ops, q/k/v and gate/up
                  from one gather (sequence parallel) or one all-reduce (backward)
    dtensor       torch's ``parallelize_module`` with ColwiseParallel / RowwiseParallel
                  (and SequenceParallel / PrepareModuleInput with ``--sp``), as torchtitan
                  plans a Llama
    async-tp      ``dtensor`` with ``--sp`` under torch.compile with Inductor's async-TP
                  pass (``_micro_pipeline_tp``, torch's symm_mem ops; CUDA only)

The stack: rotary tables for every token, then the decoder layers; sequence parallel, the
input [B, T, C] is split along T at the first layer and gathered after the last (the
overlap modes do it themselves; the DTensor modes take this rank's shard). Per mode: ms
per step (median, slowest rank), tokens per second, peak memory, and the first step's
output's relative error against the unsharded stack (a wrong mode shows).

    bash launch/torchrun.sh 2 benchmarks/bench_model.py --sp [--layers 4 --seq 8192]
        [--modes plain,overlap,dtensor,async-tp] [--steps 10] [--out DIR]

Default shape: Llama-3-8B's layers (hidden 4096, 32 heads, 8 KV heads, MLP 14336), bf16.
Writes ``model_sp.json`` or ``model.json`` (with the run's context) under ``--out`` on rank
0 and prints a table. Without a GPU it runs tiny shapes on gloo and says so.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as tdist

here = os.path.dirname(os.path.abspath(__file__))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != here]
sys.path.insert(0, os.path.join(here, ".."))

from benchmarks.context import run_context  # noqa: E402
from overlap import dist  # noqa: E402
from overlap.nn import functional as F  # noqa: E402

MODES = ("plain", "overlap", "dtensor", "async-tp")


class Stack(torch.nn.Module):
    """Rotary tables for the whole sequence, then the decoder layers; ``config`` carries the
    head counts ``parallelize`` reads."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.config = config
        self.rotary = LlamaRotaryEmbedding(config)
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, seq: int) -> torch.Tensor:  # x [B, T, C] (dtensor --sp: [B, T/R, C])
        pos = torch.arange(seq, device=x.device).unsqueeze(0)  # (1, T): every token's position
        rope = self.rotary(x, pos)
        for layer in self.layers:
            x = layer(x, position_embeddings=rope)
        return x


def torch_plan(sp: bool) -> dict[str, Any]:
    """torchtitan's Llama plan, on HF's module names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    if not sp:
        return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    shard, rep = Shard(1), Replicate()
    return {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": shard},
                                        desired_input_kwarg_layouts={"hidden_states": rep}),
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=shard),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(shard,), desired_input_layouts=(rep,)),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=shard),
    }


def build(mode: str, ref: Stack, args: argparse.Namespace, env: dict[str, Any]) -> Any:
    import overlap

    m = copy.deepcopy(ref)
    if mode in ("plain", "overlap"):
        return overlap.parallelize(m, env["group"], sequence_parallel=args.sp, overlap=mode == "overlap")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh(env["dev"].type, (env["world"],))
    for layer in m.layers:
        parallelize_module(layer, mesh, torch_plan(args.sp))
    if mode == "async-tp":
        from torch._inductor import config

        import torch.distributed._symmetric_memory as symm

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm.enable_symm_mem_for_group(mesh.get_group().group_name)
        config._micro_pipeline_tp = True
        return torch.compile(m)
    return m


def run_mode(mode: str, ref: Stack, args: argparse.Namespace, env: dict[str, Any],
             want: torch.Tensor | None) -> tuple[dict[str, Any], torch.Tensor | None]:
    dev, world, rank = env["dev"], env["world"], env["rank"]
    if mode == "async-tp" and (dev.type != "cuda" or not args.sp):
        return {"mode": mode, "na": "CUDA and --sp only (torch's symm_mem ops; the pass fuses all-gather and "
                                    "reduce-scatter)"}, None
    torch._dynamo.reset()
    step = build(mode, ref, args, env)
    shard = args.sp and mode in ("dtensor", "async-tp")  # the DTensor plans take this rank's tokens
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(args.batch, args.seq, args.hidden, generator=g).to(dev, env["dt"]) for _ in range(2)]
    if shard:
        xs = [x.chunk(world, 1)[rank].contiguous() for x in xs]
    xs = [x.requires_grad_() for x in xs]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def one(i: int) -> torch.Tensor:
        y = step(xs[i % 2], args.seq)
        y.float().square().mean().backward()
        return y

    t0 = time.perf_counter()
    y = one(0).detach()
    first_s = time.perf_counter() - t0
    if shard:
        y = F.gather_from_region(y, group=env["group"], dim=1)  # [B, T, C]
    for i in range(args.warmup):
        one(i)
    sync()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.steps):
        tdist.barrier(group=env["group"])
        sync()
        t0 = time.perf_counter()
        one(i)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    med = torch.tensor([statistics.median(times)], dtype=torch.float64, device=dev)
    tdist.all_reduce(med, op=tdist.ReduceOp.MAX, group=env["group"])  # the slowest rank's median
    out = {"mode": mode, "ms_per_step": med.item(), "tokens_per_s": args.batch * args.seq / med.item() * 1e3,
           "first_step_s": first_s}
    if want is not None:
        out["rel_err"] = ((y.double() - want.double()).norm() / want.double().norm()).item()
    if dev.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    return out, y


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", action="store_true", help="sequence parallel")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--mlp", type=int, default=14336)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        p.error(f"unknown modes {bad}; known: {', '.join(MODES)}")
    import transformers

    warnings.filterwarnings("ignore", message=".*no tile-flag path.*")
    ctx = dist.init()
    group, world, rank = ctx.tp_group, tdist.get_world_size(ctx.tp_group), tdist.get_rank(ctx.tp_group)
    dev = ctx.device if ctx.device.type == "cuda" else torch.device("cpu")
    if dev.type != "cuda":  # tiny shapes on gloo
        args.layers, args.batch, args.seq, args.hidden, args.heads, args.kv_heads, args.mlp = (
            2, 2, 8 * world, 64, 4 * world, 2 * world, 128)
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    config = transformers.LlamaConfig(hidden_size=args.hidden, num_attention_heads=args.heads,
                                      num_key_value_heads=args.kv_heads, intermediate_size=args.mlp,
                                      num_hidden_layers=args.layers, max_position_embeddings=args.seq,
                                      vocab_size=256, attn_implementation="sdpa")
    torch.manual_seed(0)  # the same unsharded weights on every rank
    ref = Stack(config).to(dev, dt)
    env = {"dev": dev, "dt": dt, "group": group, "world": world, "rank": rank}
    with torch.no_grad():  # the unsharded stack's output: every mode's error is against it
        want = ref(torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(7)).to(
            dev, dt), args.seq)
    rows = [run_mode(m, ref, args, env, want)[0] for m in modes]
    if rank == 0:
        doc = {"context": run_context(world), "args": vars(args), "rows": rows}
        if dev.type != "cuda":
            doc["note"] = "CPU run (gloo, tiny shapes): figures are not GPU figures"
            print(doc["note"])
        print(f"Llama layer stack: {args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads}, "
              f"MLP {args.mlp}; B={args.batch} T={args.seq}; {world} ranks, "
              f"{'sequence parallel' if args.sp else 'not sequence parallel'}, {str(dt)[6:]}, forward + backward")
        print(f"{'mode':9} {'ms/step':>9} {'tokens/s':>10} {'peak GiB':>9} {'1st step s':>10} {'rel err':>9}")
        for r in rows:
            if "na" in r:
                print(f"{r['mode']:9} n/a: {r['na']}")
                continue
            print(f"{r['mode']:9} {r['ms_per_step']:9.3f} {r['tokens_per_s']:10.0f} "
                  f"{r.get('peak_gib', float('nan')):9.2f} {r['first_step_s']:10.1f} "
                  f"{r.get('rel_err', 0.0):9.2e}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, "model_sp.json" if args.sp else "model.json")
            with open(path, "w") as f:
                json.dump(doc, f, indent=1)
            print(f"wrote {path}")
    tdist.barrier(group=group)
    dist.shutdown()


if __name__ == "__main__":
    main()
