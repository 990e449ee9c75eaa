"""One rank of the gloo test of the ops under torch.compile (started by test_compile.py).

Compiled (fullgraph, aot_eager) against eager and against one unsharded reference,
inputs new on every call; then the fake implementations' shapes at this world size.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as tdist
from torch._subclasses.fake_tensor import FakeTensorMode

import overlap
from overlap import Norm


def step(a_shard: torch.Tensor, b: torch.Tensor, x_partial: torch.Tensor, residual: torch.Tensor,
         lw: torch.Tensor, lb: torch.Tensor, w2: torch.Tensor, group: object) -> tuple[torch.Tensor, ...]:
    c, gathered = overlap.all_gather_matmul(a_shard, b, return_gathered=True)
    c2 = overlap.all_gather_matmul(a_shard, b, group=group)  # an explicit group, by name in the graph
    y, h = overlap.all_reduce_matmul(x_partial, b, group=group, residual=residual,
                                     norm=Norm("layernorm", lw, lb, 1e-5))
    y2, h2 = overlap.all_reduce_matmul(x_partial, b)
    z = overlap.mlp_chain(h, b, w2)
    # the block boundary: all_reduce(x_partial @ b.t-like) + residual, layer norm, @ w2
    u, hb = overlap.matmul_all_reduce_matmul(x_partial, b, w2, group=group, residual=residual[:, :b.shape[1]],
                                             norm=Norm("layernorm", lw[:b.shape[1]], lb[:b.shape[1]], 1e-5))
    return c, c2, gathered, y, h, y2, h2, z, u, hb


def main() -> None:
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    warnings.simplefilter("ignore")  # the CPU fallback's one-time warning
    overlap.dist.init(timeout_s=30)
    group = tdist.group.WORLD
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    ms, k, n, f = 3, 8, 6, 5
    for call in range(3):
        m = ms  # new values every call; new shapes are tested at world size 1 (a recompile each costs seconds)
        g = torch.Generator().manual_seed(call)
        full = torch.randn(ws * m, k, generator=g)
        parts = [torch.randn(ws * m, k, generator=g) for _ in range(ws)]
        b, residual = torch.randn(k, n, generator=g), torch.randn(ws * m, k, generator=g)
        lw, lb, w2 = torch.rand(k, generator=g) + 0.5, torch.randn(k, generator=g), torch.randn(n, f, generator=g)
        args = (full[rank * m:(rank + 1) * m], b, parts[rank], residual, lw, lb, w2, group)
        got, want = compiled(*args), step(*args)
        for i, (u, v) in enumerate(zip(got, want)):
            torch.testing.assert_close(u, v, msg=lambda s: f"call {call} output {i}: {s}")
        c, c2, gathered, y, h, y2, h2, z, u, hb = got
        total = sum(parts)
        torch.testing.assert_close(gathered, full)
        torch.testing.assert_close(c, full @ b)
        torch.testing.assert_close(c2, full @ b)
        torch.testing.assert_close(h, total + residual)
        torch.testing.assert_close(y, torch.nn.functional.layer_norm(total + residual, (k,), lw, lb, 1e-5) @ b)
        torch.testing.assert_close(h2, total)
        torch.testing.assert_close(y2, total @ b)
        torch.testing.assert_close(z, torch.nn.functional.gelu(h @ b) @ w2)
        hb_want = sum(p @ b for p in parts) + residual[:, :n]
        torch.testing.assert_close(hb, hb_want)
        torch.testing.assert_close(u, torch.nn.functional.layer_norm(hb_want, (n,), lw[:n], lb[:n], 1e-5) @ w2)
    with FakeTensorMode():
        a, b = torch.empty(4, 8), torch.empty(8, 6)
        c, gathered = torch.ops.overlap.all_gather_matmul(a, b, "", True, 0)
        assert c.shape == (ws * 4, 6) and gathered.shape == (ws * 4, 8), (c.shape, gathered.shape)
        c, _ = torch.ops.overlap.all_gather_matmul(a, b, group.group_name, False, 0)
        assert c.shape == (ws * 4, 6), c.shape
    tdist.barrier()
    overlap.dist.shutdown()
    print(f"PASS compile rank={rank}", flush=True)


if __name__ == "__main__":
    main()
