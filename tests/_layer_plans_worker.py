"""One rank of test_layer_plans.py: the layers' call plans on gloo.

``counts`` (world size 1): the Python calls a layer's forward + backward makes outside
its ops (``benchmarks/diag/layer_calls.py``), each within a budget over torch's own
``nn.Linear`` / ``LayerNorm`` forward + backward of the same shape. ``settings`` (2
ranks): a plan follows the layer's settings and input signature: ``overlap`` and
``config`` set on a layer after calls reach the ops; ``save_gathered`` set after calls
changes what is kept; "auto" decides per token count (the rates patched so that a small
and a large count decide differently), and the first count's decision stands when it
comes again; with batch 1, a sequence-parallel layer on ``[1, T/R, C]`` (``sequence_dim``
1, a view: no move of the sequence dim) gives what it gives on ``[T/R, C]`` (``sequence_dim``
0), output and gradients, the input's gradient contiguous. Prints
``PASS layer_plans <mode> ...``.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.diag.layer_calls import count_calls, layer_rows  # noqa: E402
from overlap import dist  # noqa: E402
from overlap.nn import ColumnParallelLinear, RowParallelLinear, functional  # noqa: E402
from overlap.ops import OverlapConfig  # noqa: E402
from overlap.ops import all_gather as _ag  # noqa: E402

# Python + built-in calls a layer's forward + backward may make outside its ops beyond
# torch's own module's (nn.Linear; LayerNorm for the norm). The calls of torch's
# autograd.Function.apply and of the backward's own GEMMs and sums are in these; a layer
# that decided its plan per call again (the group's size, save_gathered, the ops' config)
# or wrapped its forward and backward in torch.no_grad would not fit.
BUDGET = {"column": 48, "column_sp": 58, "row": 48, "row_sp": 72, "norm_column": 96, "sequence_norm": 72}


def counts() -> str:
    ctx = dist.init()
    rows = layer_rows(ctx.tp_group, ctx.device, torch.float32)
    n = {name: count_calls(fn, 10)["layer"] for name, fn in rows.items()}
    over = []
    for name, budget in BUDGET.items():
        base = n["torch LayerNorm" if name == "sequence_norm" else "torch nn.Linear"]
        if n[name] - base > budget:
            over.append(f"{name}: {n[name] - base:.0f} calls beyond torch's > budget {budget}")
    assert not over, f"{over}; all counts {n}"
    hooks(ctx.tp_group)
    return " ".join(f"{k}={v:.0f}" for k, v in n.items())


def hooks(group: object) -> None:
    """A sequence-parallel norm runs its module's hooks on every call, as the module would
    (the direct call of torch's norm is for modules with none): a forward pre-hook that
    scales the input per feature and a forward hook that records the output, each call."""
    from overlap.nn.norms import SequenceParallelNorm

    for cls in (torch.nn.LayerNorm, torch.nn.RMSNorm):
        m = cls(8)
        seen: list = []
        scale = torch.arange(1.0, 9.0)
        m.register_forward_pre_hook(lambda mod, args, scale=scale: (args[0] * scale,))
        m.register_forward_hook(lambda mod, args, out: seen.append(out.detach().clone()))
        sp = SequenceParallelNorm(m, group)
        del seen[:]  # the module ran while being checked as a norm
        for _ in range(2):
            x = torch.randn(3, 8).requires_grad_()
            y = sp(x)
            want = torch.nn.functional.layer_norm(x * scale, (8,), m.weight, m.bias, m.eps) \
                if cls is torch.nn.LayerNorm else torch.nn.functional.rms_norm(x * scale, (8,), m.weight, m.eps)
            assert torch.allclose(y, want, atol=1e-5), (cls.__name__, "the pre-hook's input was not used")
        assert len(seen) == 2, (cls.__name__, f"the forward hook ran {len(seen)} times in 2 calls")


def _saved_bytes(fn: object) -> int:
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()  # type: ignore[operator]
    return sum(sizes)


def settings() -> str:
    ctx = dist.init()
    ws, rank = ctx.tp_size, ctx.rank
    k, n = 16, 8 * ws
    g = torch.Generator().manual_seed(5 + rank)
    col = ColumnParallelLinear(k, n, bias=False, sequence_parallel=True, group=ctx.tp_group)
    seen: list[object] = []
    real = _ag.all_gather_matmul

    def spy(*a: object, **kw: object) -> object:
        seen.append(kw.get("config"))
        return real(*a, **kw)

    def step(m_shard: int) -> int:
        x = torch.randn(m_shard, k, generator=g).requires_grad_()  # new every call
        return _saved_bytes(lambda: col(x).sum().backward())

    _ag.all_gather_matmul = spy
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the ops' "no tile-flag path" on the CPU
            # overlap and config set after calls reach the ops
            step(4)
            assert len(seen) == 1 and seen[0] is None, seen
            col.overlap = False
            step(4)
            assert len(seen) == 1, f"rank {rank}: overlap=False still ran the fused op"
            col.overlap, cfg = True, OverlapConfig(chunks=1)
            col.config = cfg
            step(4)
            assert len(seen) == 2 and seen[1] is cfg, f"rank {rank}: the new config did not reach the op: {seen}"
            # save_gathered set after calls: the gathered rows [M, K] kept, or the shard [M/R, K]
            w_bytes = col.weight.numel() * 4
            col.save_gathered = True
            kept = step(4) - w_bytes
            col.save_gathered = False
            shard = step(4) - w_bytes
            assert (kept, shard) == (4 * ws * k * 4, 4 * k * 4), (kept, shard)
            # "auto" per token count, decided once: with these rates a 4-row shard keeps the
            # gathered rows and a 32-row shard gathers again (its GEMM outlasts the fixed cost)
            rates = (functional.GEMM_FLOPS_PER_S_FP32, functional.COLLECTIVE_FIXED_S, functional.LINK_BYTES_PER_S)
            functional.COLLECTIVE_FIXED_S, functional.LINK_BYTES_PER_S = 1.0, 1e30
            functional.GEMM_FLOPS_PER_S_FP32 = 2.0 * (16 * ws) * (n // ws) * k  # GEMM of 16 * R rows: 1 s
            try:
                col.save_gathered = "auto"
                small, large = step(4) - w_bytes, step(32) - w_bytes
                assert small == 4 * ws * k * 4 and large == 32 * k * 4, (small, large)
                functional.COLLECTIVE_FIXED_S = 0.0  # would make the small count regather, if asked again
                assert step(4) - w_bytes == small, "the small count's plan was made again"
            finally:
                functional.GEMM_FLOPS_PER_S_FP32, functional.COLLECTIVE_FIXED_S, functional.LINK_BYTES_PER_S = rates
    finally:
        _ag.all_gather_matmul = real
    batch_one(ctx, g)
    return f"world={ws} rank={rank}"


def batch_one(ctx: object, g: torch.Generator) -> None:
    ws = ctx.tp_size  # type: ignore[attr-defined]
    for cls, k, n in ((ColumnParallelLinear, 16, 8 * ws), (RowParallelLinear, 8 * ws, 16)):
        torch.manual_seed(3)  # the same weights on every rank
        m = cls(k, n, sequence_parallel=True, sequence_dim=1, group=ctx.tp_group)  # type: ignore[attr-defined]
        for call in range(2):
            rows = 4 * ws if cls is RowParallelLinear else 4  # the row layer's input: every token
            x = torch.randn(rows, k if cls is ColumnParallelLinear else k // ws, generator=g)
            got = []
            for dim, xin in ((1, x[None]), (0, x)):
                m.sequence_dim = dim
                xi = xin.clone().requires_grad_()
                y = m(xi)
                dy = torch.randn(y.shape[-2:], generator=torch.Generator().manual_seed(call))
                y.backward(dy.view(y.shape))
                got.append((y.detach().reshape(-1, y.shape[-1]), xi.grad.reshape(x.shape), m.weight.grad.clone(),
                            xi.grad.is_contiguous(), tuple(y.shape)))
                m.weight.grad = None
            (y1, gx1, gw1, c1, s1), (y0, gx0, gw0, _, s0) = got
            assert s1 == (1, *s0), (cls.__name__, s1, s0)
            assert c1, f"{cls.__name__}: the input's gradient is not contiguous"
            for a, b, what in ((y1, y0, "y"), (gx1, gx0, "grad x"), (gw1, gw0, "grad w")):
                torch.testing.assert_close(a, b, msg=lambda s, w=what: f"{cls.__name__} batch 1: {w}: {s}")


def main() -> None:
    mode = sys.argv[1]
    try:
        what = {"counts": counts, "settings": settings}[mode]()
    finally:
        dist.shutdown()
    print(f"PASS layer_plans {mode} {what}", flush=True)


if __name__ == "__main__":
    main()
