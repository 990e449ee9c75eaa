"""Host and GPU time per call of the ops that run on one GPU, for before/after comparisons.

    PYTHONPATH=<a checkout of the library> python benchmarks/diag/host_per_call.py --out F.json [--graph]

The library is imported from ``PYTHONPATH`` (not from this file's tree), so one run can
time two versions of it side by side. Per case: host microseconds per call (500 calls
enqueued back to back, timed on the host, on shapes small enough that the GPU keeps
up), and GPU milliseconds per call (CUDA events over 200 calls). ``--graph`` adds the
same call captured in a CUDA graph and replayed (needs a library whose ops replay
correctly). Cases: mlp_chain and its stream-synced kernels at M = 256 and 2048;
all_gather_matmul and all_reduce_matmul (+ residual, LayerNorm) at world size 1 on the
NCCL transport.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def host_us(fn, n: int = 500) -> float:  # noqa: ANN001
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt


def gpu_ms(fn, n: int = 200) -> float:  # noqa: ANN001
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n


def replay(fn):  # noqa: ANN001, ANN201
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", default="")
    ap.add_argument("--graph", action="store_true")
    args = ap.parse_args()
    import overlap
    from overlap import dist
    from overlap.ops import Norm, OverlapConfig, all_gather_matmul, all_reduce_matmul
    from overlap.ops import chain as ch

    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    rows = []

    def case(name: str, fn, graph: bool = True) -> None:  # noqa: ANN001
        r = {"case": name, "host_us": host_us(fn), "gpu_ms": gpu_ms(fn)}
        if args.graph and graph:
            rp = replay(fn)
            r["graph_gpu_ms"] = gpu_ms(rp)
            r["graph_host_us"] = host_us(rp)
        rows.append(r)
        print(json.dumps(r), flush=True)

    for m, k, f in ((256, 1024, 1024), (2048, 4096, 8192)):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w1 = (torch.randn(f, k, device=dev, dtype=torch.bfloat16) / k ** 0.5).t()
        w2 = (torch.randn(k, f, device=dev, dtype=torch.bfloat16) / f ** 0.5).t()
        case(f"mlp_chain {m}x{k}x{f}x{k}", lambda: ch.mlp_chain(x, w1, w2))
        case(f"mlp_chain_stream_sync {m}x{k}x{f}x{k}", lambda: ch.mlp_chain_stream_sync(x, w1, w2))
        case(f"torch fc1+gelu+fc2 {m}x{k}x{f}x{k}",
             lambda: torch.nn.functional.gelu(x @ w1) @ w2)
    dist.init()
    cfg = OverlapConfig(transport="nccl", chunks=2, nccl_ctas=8)
    a = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
    b = (torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16) / 32).t()
    case("all_gather_matmul world 1 nccl x2 1024x1024x1024", lambda: all_gather_matmul(a, b, config=cfg))
    r = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
    norm = Norm("layernorm", torch.ones(1024, device=dev, dtype=torch.bfloat16),
                torch.zeros(1024, device=dev, dtype=torch.bfloat16), 1e-5)
    case("all_reduce_matmul+ln world 1 nccl x2 1024x1024x1024",
         lambda: all_reduce_matmul(a, b, residual=r, norm=norm, config=cfg))
    dist.shutdown()
    ctx = {"tag": args.tag, "version": getattr(overlap, "__version__", ""), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d")}
    with open(args.out, "w") as fh:
        json.dump({"context": ctx, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
