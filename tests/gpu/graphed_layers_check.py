"""The layers' forward + backward captured whole, at world size 1 (see test_nn_gpu.py).

``torch.cuda.make_graphed_callables`` over each of ColumnParallelLinear,
RowParallelLinear (each also sequence-parallel) and NormColumnParallelLinear (bf16, the
fused path: NCCL transport, 2 chunks): every replayed step, with new inputs and output gradients, gives the output and
the input's and weights' gradients of the same layer run eagerly (its twin, the same
weights), to bf16 rounding. Prints ``PASS graphed_layers ...`` or ``FAIL graphed_layers: ...``.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from overlap import dist  # noqa: E402
from overlap import nn as onn  # noqa: E402
from overlap.ops import OverlapConfig  # noqa: E402

M, K, N = 256, 512, 384
DT = torch.bfloat16


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()


def main() -> None:
    ctx = dist.init()
    dev, group = ctx.device, ctx.tp_group
    torch.manual_seed(0)
    kw = {"group": group, "device": dev, "dtype": DT, "config": OverlapConfig(transport="nccl", chunks=2)}
    layers = {
        "column": (lambda: onn.ColumnParallelLinear(K, N, **kw), (M, K), (M, N)),
        "row": (lambda: onn.RowParallelLinear(N, K, **kw), (M, N), (M, K)),
        "norm_column": (lambda: onn.NormColumnParallelLinear(K, N, **kw), (M, K), None),
        # sequence-parallel: all-gather -> GEMM forward, GEMM -> reduce-scatter backward (and back)
        "column_sp": (lambda: onn.ColumnParallelLinear(K, N, sequence_parallel=True, **kw), (M, K), (M, N)),
        "row_sp": (lambda: onn.RowParallelLinear(N, K, sequence_parallel=True, **kw), (M, N), (M, K)),
    }
    try:
        for name, (make, x_shape, y_shape) in layers.items():
            layer, twin = make(), make()
            twin.load_state_dict(layer.state_dict())
            sample = torch.randn(*x_shape, device=dev, dtype=DT, requires_grad=True)
            graphed = torch.cuda.make_graphed_callables(layer, (sample,))
            for step in range(4):
                x = torch.randn(*x_shape, device=dev, dtype=DT)
                outs = []
                for mod in (graphed, twin):
                    for p in layer.parameters():
                        p.grad = None
                    for p in twin.parameters():
                        p.grad = None
                    xi = x.clone().requires_grad_()
                    y = mod(xi)
                    ys = list(y) if isinstance(y, tuple) else [y]
                    torch.manual_seed(100 + step)  # the same output gradients for both
                    dys = [torch.randn_like(t) for t in ys]
                    torch.autograd.backward(ys, dys)
                    params = layer if mod is graphed else twin
                    outs.append(([t.detach().clone() for t in ys], xi.grad.clone(),
                                 [p.grad.clone() for p in params.parameters()]))
                torch.cuda.synchronize()
                (ys_g, gx_g, gp_g), (ys_e, gx_e, gp_e) = outs
                errs = [rel(a, b) for a, b in zip(ys_g, ys_e)] + [rel(gx_g, gx_e)] + \
                       [rel(a, b) for a, b in zip(gp_g, gp_e)]
                assert max(errs) < 3e-2, (name, step, errs)
                if y_shape is not None:
                    assert tuple(ys_g[0].shape) == y_shape, (name, tuple(ys_g[0].shape))
            print(f"layer {name}: 4 replayed steps right (max error {max(errs):.1e})", flush=True)
        print(f"PASS graphed_layers world={ctx.tp_size} layers={len(layers)}", flush=True)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        print(f"FAIL graphed_layers: {type(e).__name__}: {e}", flush=True)
        dist.shutdown()
        sys.exit(1)
    dist.shutdown()


if __name__ == "__main__":
    main()
