"""One rank of the Inductor async-TP check (test_compat.py): a function written with
torch's functional collectives (all-gather -> mm, mm -> reduce-scatter), compiled by
Inductor with ``overlap.compat.enable_inductor_async_tp()``: the generated code calls
``torch.ops.overlap.fused_*`` and no symm_mem op, and the results match eager. On a CPU
torch (no NCCL) ``is_nccl_available`` is patched: the pass only looks at the graph.

    python tests/_inductor_tp_worker.py [cuda]
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as tdist
from torch.distributed import _functional_collectives as funcol

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from overlap import compat, dist  # noqa: E402


def main() -> None:
    cuda = sys.argv[1:] == ["cuda"]
    dist.init(timeout_s=60)
    rank, ws = tdist.get_rank(), tdist.get_world_size()
    group = dist.get_context().tp_group
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dt = torch.bfloat16 if cuda else torch.float32
    if not tdist.is_nccl_available():
        tdist.is_nccl_available = lambda: True  # the pass's gate; nothing here uses NCCL
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Count(CustomGraphPass):  # a pass the user had set: kept, beside ours
        def __call__(self, graph: torch.fx.Graph) -> None:
            pass

        def uuid(self) -> str:
            return "count-v1"

    config.post_grad_custom_post_pass = Count()
    compat.enable_inductor_async_tp(group)
    compat.enable_inductor_async_tp(group)  # twice: installed once
    got = config.post_grad_custom_post_pass
    passes = list(got) if isinstance(got, (list, tuple)) else [got, getattr(got, "prev", None)]
    assert [type(p).__name__ for p in passes] in (["Count", "Retarget"], ["Retarget", "Count"]), passes
    assert all(p.uuid() for p in passes), "a keyed pass: Inductor's graph cache stays on"
    g = torch.Generator().manual_seed(1)
    t, k, n = 64, 128, 64
    w1 = (torch.randn(k, n, generator=g) / k ** 0.5).to(dev, dt)
    w2 = (torch.randn(n, k, generator=g) / n ** 0.5).to(dev, dt)

    def block(x_shard: torch.Tensor) -> torch.Tensor:  # [B, T/R, K]: sequence parallel, dim 1
        x = funcol.all_gather_tensor(x_shard, 1, group)  # [B, T, K]
        h = torch.relu(x @ w1)  # [B, T, N]
        return funcol.reduce_scatter_tensor(h @ w2, "sum", 1, group)  # [B, T/R, K]

    from torch._inductor.utils import run_and_get_code

    compiled = torch.compile(block, fullgraph=True)
    for call in range(3):  # new inputs every call
        x_shard = (torch.randn(2, t // ws, k, generator=torch.Generator().manual_seed(10 * call + rank))).to(dev, dt)
        want = block(x_shard)
        want = want.wait() if hasattr(want, "wait") else want
        if call == 0:
            got, codes = run_and_get_code(compiled, x_shard)
            code = "\n".join(codes)
            assert "torch.ops.overlap.fused_all_gather_matmul" in code, code[-3000:]
            assert "torch.ops.overlap.fused_matmul_reduce_scatter" in code, code[-3000:]
            assert "symm_mem" not in code, code[-3000:]
        else:
            got = compiled(x_shard)
        e = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert e < (2e-2 if cuda else 1e-5), f"rank {rank}: call {call}: relative error {e:.3g}"
    tdist.barrier()
    dist.shutdown()
    print(f"PASS inductor_tp rank={rank} world={ws} device={dev.type}", flush=True)


if __name__ == "__main__":
    main()
