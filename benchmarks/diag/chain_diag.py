"""MLP chain diagnosis on one GPU: consumer-first calls, and host vs GPU time per call.

    python benchmarks/diag/chain_diag.py default|side|maxconn|host

default / side / maxconn: four chain calls in the normal order, then four with the
consumer enqueued first and the producer held back ~10 ms, on the default stream, on a
side stream, or (run it with CUDA_DEVICE_MAX_CONNECTIONS=32) with more hardware queues;
prints each call's outcome and wall time. host: per call, the host time of 100 calls back
to back, their GPU time pipelined, and their GPU time with the 100 calls queued behind a
0.2 s sleep (the host is then never the bottleneck), for torch, stream-sync and tile-flag.
"""
import os, sys, time
import torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from overlap.ops import chain as ch
mode = sys.argv[1]
dev = torch.device("cuda", 0)
m, k, f, n = 256, 1024, 768, 1024
x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
w1 = torch.randn(k, f, device=dev, dtype=torch.bfloat16) / 32
w2 = torch.randn(f, n, device=dev, dtype=torch.bfloat16) / 27
cfg = ch.ChainConfig(check="sync", timeout_ms=3000)
def run(cf):
    ok = 0
    for it in range(4):
        t0 = time.time()
        try:
            y = ch._mlp_chain(x, w1, w2, config=cfg, consumer_first=cf, producer_delay_cycles=20_000_000 if cf else 0)
            torch.cuda.synchronize(); ok += 1
            print(f"{mode} cf={cf} it={it} ok {1e3*(time.time()-t0):.1f} ms", flush=True)
        except Exception as e:
            print(f"{mode} cf={cf} it={it} ERR {1e3*(time.time()-t0):.1f} ms {str(e)[:120]}", flush=True)
if mode in ("default", "maxconn"):
    run(False); run(True)
elif mode == "side":
    with torch.cuda.stream(torch.cuda.Stream()):
        run(False); run(True)
elif mode == "host":
    for M, K, F, N in ((256, 8192, 2752, 8192), (4096, 12288, 6144, 12288)):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16); w1 = torch.randn(K, F, device=dev, dtype=torch.bfloat16) / 90
        w2 = torch.randn(F, N, device=dev, dtype=torch.bfloat16) / 50
        for name, fn in (("ref", lambda: ch.mlp_chain_ref(x, w1, w2)), ("ss", lambda: ch.mlp_chain_stream_sync(x, w1, w2)),
                         ("tf", lambda: ch.mlp_chain(x, w1, w2))):
            for _ in range(5): fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter(); s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(100): fn()
            e.record(); host = (time.perf_counter() - t0) * 10
            torch.cuda.synchronize()
            # GPU busy time per call with the host far ahead: queue 100 calls behind a sleep
            torch.cuda._sleep(400_000_000)
            s2 = torch.cuda.Event(enable_timing=True); e2 = torch.cuda.Event(enable_timing=True); s2.record()
            for _ in range(100): fn()
            e2.record(); torch.cuda.synchronize()
            print(f"host {M}x{F}x{K} {name}: host {host:.3f} ms/call, pipelined {s.elapsed_time(e)/100:.3f} ms/call, queued-ahead {s2.elapsed_time(e2)/100:.3f} ms/call", flush=True)
