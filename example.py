import torch
import overlap

ctx = overlap.init()                   # under torchrun, mpirun, or plain `python` (one rank)
R, dev = ctx.tp_size, ctx.device
dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
M, N, K = 4096, 1024, 1024             # M: rows after the gather
a_shard = torch.randn(M // R, K, device=dev, dtype=dt)     # [M/R, K] this rank's rows
w = torch.randn(N, K, device=dev, dtype=dt)                # [N, K]   an nn.Linear weight
if dev.type == "cuda":                                     # optional; collective; cached per shape
    overlap.tune_all_gather_matmul(a_shard, w.t())
c = overlap.all_gather_matmul(a_shard, w.t())              # all_gather(a_shard) @ w.t(): [M, N]
torch.testing.assert_close(c, overlap.ops.all_gather_matmul_ref(a_shard, w.t()), rtol=2e-2, atol=2e-2)
ln = torch.nn.LayerNorm(K, device=dev, dtype=dt)           # h = all_reduce(x) + res; c = ln(h) @ w.t()
x, res = torch.randn(M, K, device=dev, dtype=dt), torch.randn(M, K, device=dev, dtype=dt)
with torch.no_grad():                                      # the ops have no backward (overlap.nn has)
    c, h = overlap.all_reduce_matmul(x, w.t(), residual=res, norm=overlap.Norm.from_module(ln))
overlap.check_errors()                 # raise any flag-wait timeout recorded so far
if ctx.is_main:
    print(overlap.report())            # per op and shape: the path each call took, and why
overlap.shutdown()                     # (on CPU or in fp32 the ops ran their reference, warning once)
