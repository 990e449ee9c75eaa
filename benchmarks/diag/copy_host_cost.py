"""Host time of one cudaMemcpyAsync to a peer GPU by size, the GPU held behind a sleep (2 GPUs, one process).

    python benchmarks/diag/copy_host_cost.py

Tells whether the host cost of the p2p ops' pushes grows with the bytes pushed.
"""
import time

import torch
from cupy.cuda import runtime

torch.cuda.set_device(0)
with torch.cuda.device(1):
    torch.zeros(1, device="cuda:1")
runtime.setDevice(0)
try:
    runtime.deviceEnablePeerAccess(1)
except Exception as e:  # noqa: BLE001 - already enabled
    print("peer access:", e)
s = torch.cuda.Stream(device=0)
for mb in (1, 4, 16, 64, 256):
    n = mb << 20
    src = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(n, dtype=torch.uint8, device="cuda:1")
    runtime.memcpyAsync(dst.data_ptr(), src.data_ptr(), n, runtime.memcpyDefault, s.cuda_stream)
    torch.cuda.synchronize(0)
    out = []
    for _ in range(3):
        with torch.cuda.stream(s):
            torch.cuda._sleep(200_000_000)
        t0 = time.perf_counter()
        for _ in range(20):
            runtime.memcpyAsync(dst.data_ptr(), src.data_ptr(), n, runtime.memcpyDefault, s.cuda_stream)
        out.append((time.perf_counter() - t0) / 20 * 1e6)
        torch.cuda.synchronize(0)
    print(f"memcpyAsync to peer {mb:4d} MB: host {min(out):7.1f} us per call (min of 3 x 20)", flush=True)
for mb in (1, 128):
    x = torch.empty(mb << 20, dtype=torch.uint8, device="cuda:0")
    out = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(20):
            y = torch.empty_like(x)
            del y
        out.append((time.perf_counter() - t0) / 20 * 1e6)
    print(f"torch.empty_like {mb:4d} MB: host {min(out):7.1f} us per call", flush=True)
