"""Host time of each step of a tile-kernel launch and of the MLP chain (one GPU).

    python benchmarks/diag/host_overhead.py

Microseconds of host (Python + driver) time per call, 2000 calls back to back on tiny
shapes (the GPU is never the bottleneck), then a cProfile of 300 chain calls. Tells where
the per-call host cost of the ops goes: at small M it, not the GPU, sets their speed.
"""
import os, sys, time
import torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from overlap import flags as F
from overlap.kernels import tile_gemm as tg
from overlap.policies import Segment, build_tile_table
from triton.tools.tensor_descriptor import TensorDescriptor
dev = torch.device("cuda", 0)
a = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16); w = torch.randn(512, 1024, device=dev, dtype=torch.bfloat16)
c = torch.empty(256, 512, device=dev, dtype=torch.bfloat16)
table = torch.tensor(build_tile_table([Segment(0, 0, 0, 256)], 512, 128, 256), dtype=torch.int32, device=dev)
fl = torch.zeros(8, dtype=torch.int32, device=dev); ew = F.ErrorWord(dev)
ps = torch.cuda.Stream(priority=-1); cur = torch.cuda.current_stream()
def T(name, fn, n=2000):
    for _ in range(20): fn()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): fn()
    dt = (time.perf_counter() - t0) / n * 1e6; torch.cuda.synchronize(); print(f"{name:40s} {dt:8.1f} us", flush=True)
T("torch.mm", lambda: torch.mm(a, w.t()))
T("launch_tile_gemm (plain)", lambda: tg.launch_tile_gemm(a, w.t(), c, table, grid=132))
T("launch_tile_gemm (wait, counter)", lambda: tg.launch_tile_gemm(a, w.t(), c, table, grid=132, flags=fl, err=ew.word, wait=True, counter=fl[7:8]))
ad = TensorDescriptor.from_tensor(a, [128, 64]); bd = TensorDescriptor.from_tensor(w, [256, 64])
args = (ad, ad, bd, c, table, table, table, table, 512, 1024, table.shape[0], 0, 0, 1, 1, 2, 0, c.stride(0), c.stride(1))
kw = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, HAS_A2=False, B_KN=False, HAS_WAIT=False, HAS_POST=False, ACTIVATION=0,
          USE_TIMER=True, FENCE_ASYNC=True, UPCAST=False, DYNAMIC=False, POST_START=False, num_warps=8, num_stages=3)
T("raw kernel[grid](...) prebuilt descs", lambda: tg.tile_gemm_kernel[(2,)](*args, **kw))
T("TensorDescriptor.from_tensor x3", lambda: (TensorDescriptor.from_tensor(a, [128, 64]), TensorDescriptor.from_tensor(a, [128, 64]), TensorDescriptor.from_tensor(w, [256, 64])))
T("stream_write_value", lambda: F.stream_write_value(cur, fl, 0, 0))
T("stream_wait_value (satisfied)", lambda: F.stream_wait_value(cur, fl, 0, 0))
T("ps.wait_stream(cur)", lambda: ps.wait_stream(cur))
T("with torch.cuda.stream(ps): pass", lambda: torch.cuda.stream(ps).__enter__() or torch.cuda.set_stream(cur))
T("record_stream", lambda: a.record_stream(ps))
T("err.snapshot + check(async)", lambda: (ew.check(block=False), ew.snapshot()))
T("torch.empty 256x512", lambda: torch.empty(256, 512, device=dev, dtype=torch.bfloat16))
from overlap.ops import chain as ch
x = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16); w1 = torch.randn(1024, 512, device=dev, dtype=torch.bfloat16); w2 = torch.randn(512, 1024, device=dev, dtype=torch.bfloat16)
T("mlp_chain_stream_sync", lambda: ch.mlp_chain_stream_sync(x, w1, w2), 500)
T("mlp_chain", lambda: ch.mlp_chain(x, w1, w2), 500)
import cProfile, pstats
pr = cProfile.Profile(); pr.enable()
for _ in range(300): ch.mlp_chain(x, w1, w2)
pr.disable(); torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
