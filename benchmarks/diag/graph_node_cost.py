"""What a CUDA graph's launch costs the host, by the kinds of node in it (1 GPU).

    python benchmarks/diag/graph_node_cost.py --out DIR

A plan graph (``overlap.ops._graphs``) of ``all_reduce_matmul`` + LayerNorm holds memcpy,
memset, kernel and stream memory-op nodes over three streams, and its launch took some
20 us of host time against about 3 us for a graph of eight small kernels. Here small graphs
are captured, each eight kernels plus one kind of node (or a fork over three streams), and
each launch is timed on the host (median of 1000 launches, a synchronize every 100):
which kinds make a launch dear. Writes ``DIR/graph_node_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))


def launch_us(replay: Callable[[], Any], calls: int = 1000) -> float:
    for _ in range(20):
        replay()
    torch.cuda.synchronize()
    t = []
    for i in range(calls):
        if i % 100 == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        replay()
        t.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return round(statistics.median(t), 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from benchmarks.context import run_context
    from overlap import _driver

    dev = torch.device("cuda")
    small = torch.zeros(256, device=dev)
    src = torch.randn(512 * 1024, device=dev, dtype=torch.bfloat16)
    dsts = [torch.empty_like(src) for _ in range(6)]
    words = torch.zeros(64, dtype=torch.int32, device=dev)
    dtod, memset, write, wait = _driver.memcpy_dtod(), _driver.memset_d32(), _driver.write_value32(), \
        _driver.wait_value32()
    side = [torch.cuda.Stream() for _ in range(2)]
    from overlap.flags import ErrorWord
    from overlap.kernels.gate import launch_gate

    err = ErrorWord(dev)

    def kernels(n: int) -> None:
        for _ in range(n):
            small.add_(1.0)

    def memcpys(n: int) -> Callable[[], None]:
        def f() -> None:
            raw = torch.cuda.current_stream().cuda_stream
            for i in range(n):
                assert dtod(dsts[i].data_ptr(), src.data_ptr(), src.numel() * 2, raw) == 0
        return f

    def memsets(n: int) -> Callable[[], None]:
        def f() -> None:
            raw = torch.cuda.current_stream().cuda_stream
            for i in range(n):
                assert memset(words.data_ptr() + 4 * 8 * i, 0, 8, raw) == 0
        return f

    def memops(n: int) -> Callable[[], None]:
        def f() -> None:  # write a word, then wait for it (met at once)
            raw = torch.cuda.current_stream().cuda_stream
            for i in range(n):
                addr = words.data_ptr() + 4 * (48 + i)
                assert write(raw, addr, 1, 0) == 0
                assert wait(raw, addr, 1, 0) == 0
        return f

    def writes(n: int) -> Callable[[], None]:
        def f() -> None:
            raw = torch.cuda.current_stream().cuda_stream
            for i in range(n):
                assert write(raw, words.data_ptr() + 4 * (40 + i), 1, 0) == 0
        return f

    def waits(n: int) -> Callable[[], None]:
        def f() -> None:  # a word set before the capture: met at once
            raw = torch.cuda.current_stream().cuda_stream
            for i in range(n):
                assert wait(raw, words.data_ptr() + 4 * 63, 0, 0) == 0
        return f

    def word_memsets(n: int) -> Callable[[], None]:
        def f() -> None:  # a flag post as a memset of one word
            raw = torch.cuda.current_stream().cuda_stream
            for i in range(n):
                assert memset(words.data_ptr() + 4 * (40 + i), 1, 1, raw) == 0
        return f

    def gates(n: int) -> Callable[[], None]:
        def f() -> None:  # the library's bounded one-warp wait, on a word already set
            for _ in range(n):
                launch_gate(words, 63, 0, 1 << 30, err.word, rank=0, timeout_ns=10 ** 9)
        return f

    def kernel_copies(n: int) -> Callable[[], None]:
        def f() -> None:
            for i in range(n):
                torch.add(src, 0, out=dsts[i])  # (an elementwise kernel, not a memcpy node)
        return f

    def fork(n_side: int, extra: Callable[[], None] | None = None) -> Callable[[], None]:
        def f() -> None:
            cur = torch.cuda.current_stream()
            for s in side[:n_side]:
                s.wait_stream(cur)
            for s in side[:n_side]:
                with torch.cuda.stream(s):
                    kernels(2)
                    if extra is not None:
                        extra()
            for s in side[:n_side]:
                cur.wait_stream(s)
        return f

    cases: dict[str, Callable[[], None]] = {
        "(warm-up: 8 kernels)": lambda: kernels(8),
        "1 kernel": lambda: kernels(1),
        "8 kernels": lambda: kernels(8),
        "16 kernels": lambda: kernels(16),
        "8 kernels + 1 memcpy": lambda: (kernels(8), memcpys(1)()),
        "8 kernels + 2 memcpy": lambda: (kernels(8), memcpys(2)()),
        "8 kernels + 4 memcpy": lambda: (kernels(8), memcpys(4)()),
        "8 kernels + 6 memcpy": lambda: (kernels(8), memcpys(6)()),
        "8 kernels + 4 copy kernels": lambda: (kernels(8), kernel_copies(4)()),
        "8 kernels + 1 memset": lambda: (kernels(8), memsets(1)()),
        "8 kernels + 2 memset": lambda: (kernels(8), memsets(2)()),
        "8 kernels + 1 write/wait pair": lambda: (kernels(8), memops(1)()),
        "8 kernels + 2 write/wait pairs": lambda: (kernels(8), memops(2)()),
        "8 kernels + 2 writes": lambda: (kernels(8), writes(2)()),
        "8 kernels + 2 waits": lambda: (kernels(8), waits(2)()),
        "8 kernels + 2 one-word memsets": lambda: (kernels(8), word_memsets(2)()),
        "8 kernels + 2 gate kernels": lambda: (kernels(8), gates(2)()),
        "8 kernels, fork to 1 side stream": lambda: (kernels(4), fork(1)(), kernels(2)),
        "8 kernels, fork to 2 side streams": lambda: (kernels(4), fork(2)(), kernels(0)),
        "8 kernels + 2 memcpy on a side stream": lambda: (kernels(6), fork(1, memcpys(2))()),
        "mix: 5 kernels, 6 memcpy, 1 memset, 1 write/wait, 2 side streams":
            lambda: (memsets(1)(), memcpys(2)(), fork(2, memcpys(1))(), memops(1)(), memcpys(2)()),
    }
    rows = []
    for name, body in cases.items():
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            body()  # (warm: kernels loaded outside the capture)
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            body()
        torch.cuda.synchronize()
        kinds = None
        try:
            g2 = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(g2, stream=s):
                body()
            kinds = _driver.node_kinds(int(g2.raw_cuda_graph()))
            del g2
        except Exception as e:  # noqa: BLE001 - the kinds are a label only
            kinds = repr(e)
        us = launch_us(g.replay)
        rows.append({"case": name, "launch_us": us, "nodes": kinds})
        print(f"{name:70s} {us:7.2f} us  {kinds}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "graph_node_cost.json"), "w") as f:
        json.dump({"context": run_context(1), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
