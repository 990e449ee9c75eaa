"""All-gather -> GEMM on R GPUs: every variant side by side in one process group.

    bash launch/torchrun.sh 2 benchmarks/bench_all_gather_matmul.py --out DIR
    bash launch/mpirun.sh 2 benchmarks/bench_all_gather_matmul.py --out DIR

Columns: all-gather alone (library communicator, NCCL's default CTAs), cuBLAS
GEMM alone, floor = max of the two, sequential (reference), chunked stream
overlap, tile-flag overlap (tuned), torch's symm_mem fused_all_gather_matmul.
Each figure: median over iterations (CUDA events), slowest rank. Shapes are
(M, N, K) with M the rows after the gather.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.context import run_context  # noqa: E402

SHAPES = {
    "comm-heavy-16k": (16384, 2048, 8192),
    "comm-heavy-8k": (8192, 1024, 8192),
    "gpt3-fc1": (8192, 18432, 12288),
    "gpt3-qkv-like": (8192, 24576, 12288),
    "llama70b-fc1": (8192, 14336, 8192),
}


def timeit(fn, iters: int, warmup: int = 3, synced: bool = False) -> float:
    """Milliseconds per call, slowest rank.

    Default (pipelined): ``iters`` calls back to back between two events, the
    host running ahead as in a training step; the median of 5 such runs.
    ``synced``: every call alone between a barrier and a synchronize (host
    launch latency shows); the median over ``iters`` calls.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters if synced else 5):
        tdist.barrier()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(1 if synced else iters):
            fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / (1 if synced else iters))
    t = torch.tensor([statistics.median(times)], device="cuda")
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return float(t.item())


COLUMNS = [("allgather_ms", "all-gather"), ("gemm_ms", "cuBLAS GEMM"), ("floor_ms", "floor"),
           ("sequential_ms", "sequential"), ("chunked2_ms", "chunked x2"), ("chunked4_ms", "chunked x4"),
           ("tileflag_ms", "tile-flag"), ("symm_mem_ms", "symm_mem fused")]


def markdown_table(rows: list[dict], context: dict) -> str:
    """The run's table (ms, pipelined timing), with its context line."""
    head = "| shape (M, N, K) | " + " | ".join(c for _, c in COLUMNS) + " | tile-flag / floor | tuned |\n"
    head += "|---" * (len(COLUMNS) + 3) + "|\n"
    lines = []
    for r in rows:
        vals = " | ".join(f"{r[k]:.3f}" if isinstance(r.get(k), float) else "n/a" for k, _ in COLUMNS)
        lines.append(f"| {r['M']}, {r['N']}, {r['K']} | {vals} | {r['tileflag_ms'] / r['floor_ms']:.2f} "
                     f"| {r.get('tuned')} |")
    ctx = (f"{context.get('date')}, {context.get('gpu_count')}x {context.get('gpu')}, torch {context.get('torch')}, "
           f"triton {context.get('triton')}, NCCL {context.get('nccl')}, commit {context.get('commit')}")
    return f"All-gather -> GEMM, bf16, {rows[0]['world'] if rows else '?'} ranks ({ctx}); ms per call, " \
           "median, slowest rank, calls back to back.\n\n" + head + "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return
    labels = [f"{r['M']}x{r['N']}x{r['K']}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    x = range(len(rows))
    for key, name in COLUMNS[3:]:
        ys = [r.get(key, float("nan")) / r["floor_ms"] for r in rows]
        ax.plot(x, ys, marker="o", label=name)
    ax.axhline(1.0, color="k", lw=1, ls="--", label="floor = max(all-gather, GEMM)")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=15, fontsize=8)
    ax.set_ylabel("time / floor")
    ax.set_title("all_gather(A) @ B, bf16, 2x H200")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-tune", action="store_true")
    args = ap.parse_args()

    import overlap
    from overlap import dist
    from overlap.ops import all_gather as agmod
    from overlap.ops.all_gather import (all_gather_matmul, all_gather_matmul_chunked,
                                               all_gather_matmul_ref, tune_all_gather_matmul)

    ctx = dist.init()
    world, rank = tdist.get_world_size(), tdist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    main_rank = rank == 0
    symm = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.enable_symm_mem_for_group(tdist.group.WORLD.group_name)
        symm = symm_mem
    except Exception as e:  # reported in the JSON
        symm_err = repr(e)
    else:
        symm_err = None

    rows = []
    for name in args.shapes:
        m, n, k = SHAPES[name] if name in SHAPES else tuple(int(v) for v in name.split(","))
        ms = m // world
        g = torch.Generator(device=dev).manual_seed(1000 * rank + m + n + k)
        a = torch.randn(ms, k, device=dev, dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=torch.Generator(device=dev).manual_seed(7))
        w /= k ** 0.5
        b = w.t()
        gathered = torch.empty(m, k, device=dev, dtype=torch.bfloat16)
        rt = agmod.get_runtime(tdist.group.WORLD, dev)
        comm = rt.comm(None)
        rec = {"shape": name, "M": m, "N": n, "K": k, "world": world}
        rec["allgather_ms"] = timeit(lambda: comm.all_gather(a, gathered), args.iters)
        rec["allgather_torch_ms"] = timeit(lambda: tdist.all_gather_into_tensor(gathered, a), args.iters)
        full = torch.empty(m, k, device=dev, dtype=torch.bfloat16).normal_()
        rec["gemm_ms"] = timeit(lambda: full @ b, args.iters)
        rec["floor_ms"] = max(rec["allgather_ms"], rec["gemm_ms"])
        rec["sequential_ms"] = timeit(lambda: all_gather_matmul_ref(a, b), args.iters)
        rec["chunked2_ms"] = timeit(lambda: all_gather_matmul_chunked(a, b, chunks=2), args.iters)
        rec["chunked4_ms"] = timeit(lambda: all_gather_matmul_chunked(a, b, chunks=4), args.iters)
        if not args.no_tune:
            from overlap.ops import OverlapConfig

            cands = [OverlapConfig(chunks=ch, nccl_ctas=ct) for ch in (1, 2, 4) for ct in (16, 24, 32)]
            cands.append(OverlapConfig(chunks=2, nccl_ctas=8, sm_margin=12))  # SM-budget probe
            cands.append(OverlapConfig(chunks=2, nccl_ctas=24, give_back=False))  # give-back probe
            best = tune_all_gather_matmul(a, b, candidates=cands, verbose=main_rank)
            rec["tuned"] = best if isinstance(best, str) else {"chunks": best.chunks, "nccl_ctas": best.nccl_ctas}
        before = agmod.stats["fused"]
        rec["tileflag_ms"] = timeit(lambda: all_gather_matmul(a, b), args.iters)
        rec["tileflag_fast_path_calls"] = agmod.stats["fused"] - before
        rec["tileflag_synced_ms"] = timeit(lambda: all_gather_matmul(a, b), args.iters, synced=True)
        rec["sequential_synced_ms"] = timeit(lambda: all_gather_matmul_ref(a, b), args.iters, synced=True)
        rt.err("all_gather_matmul").check(block=True)
        # correctness of the timed configuration on fresh data
        a2 = torch.randn_like(a)
        c = all_gather_matmul(a2, b)
        ref = all_gather_matmul_ref(a2, b)
        rec["rel_err_vs_cublas"] = ((c.float() - ref.float()).norm() / ref.float().norm()).item()
        if symm is not None:
            try:
                gname = tdist.group.WORLD.group_name
                fn = lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], gather_dim=0, group_name=gname)
                rec["symm_mem_ms"] = timeit(fn, args.iters)
            except Exception as e:
                rec["symm_mem_error"] = repr(e)[:300]
        else:
            rec["symm_mem_error"] = symm_err
        rec["hidden_frac"] = (rec["sequential_ms"] - rec["tileflag_ms"]) / rec["allgather_ms"]
        rows.append(rec)
        if main_rank:
            print(f"{name:>16} M={m} N={n} K={k}: AG {rec['allgather_ms']:.3f} (torch {rec['allgather_torch_ms']:.3f}) "
                  f"GEMM {rec['gemm_ms']:.3f} floor {rec['floor_ms']:.3f} | seq {rec['sequential_ms']:.3f} "
                  f"chunked2 {rec['chunked2_ms']:.3f} chunked4 {rec['chunked4_ms']:.3f} "
                  f"tileflag {rec['tileflag_ms']:.3f} ({rec.get('tuned')}) symm {rec.get('symm_mem_ms', float('nan')):.3f} "
                  f"| x{rec['tileflag_ms'] / rec['floor_ms']:.2f} of floor, err {rec['rel_err_vs_cublas']:.1e} "
                  f"| synced: tileflag {rec['tileflag_synced_ms']:.3f} seq {rec['sequential_synced_ms']:.3f}",
                  flush=True)
    if main_rank:
        os.makedirs(args.out, exist_ok=True)
        context = run_context(world)
        with open(os.path.join(args.out, "all_gather_matmul.json"), "w") as f:
            json.dump({"context": context, "results": rows}, f, indent=1)
        with open(os.path.join(args.out, "all_gather_matmul.md"), "w") as f:
            f.write(markdown_table(rows, context))
        plot(rows, os.path.join(args.out, "all_gather_matmul.png"))
    dist.shutdown()


if __name__ == "__main__":
    main()
