"""Python calls per forward + backward of each ``overlap.nn`` layer, split into the ops'
and the layer's own (everything outside the ops: the module, the autograd functions,
torch's autograd frames, the backward's own GEMMs and sums).

    python benchmarks/diag/layer_calls.py [--calls 20] [--json FILE] [--block]

World size 1 on the CPU (gloo; the ops run their references) or on a GPU; the backward
runs in the calling thread on the CPU, which ``sys.setprofile`` sees (on a GPU autograd
runs the backward on a device thread: only the forward's calls are seen there, so the
count is a CPU figure). A call counts as the op's when it is made inside a frame of
``overlap/ops/``; torch's ``nn.Linear`` forward + backward of the same shape is the
yardstick row. A count that falls is progress whatever the host's speed. ``--block``
adds one GPT block's forward + backward (``benchmarks/bench_block.py``'s eager modes,
batch 1, 8 tokens, hidden 64, sequence parallel and not), all calls counted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

_OPS = os.sep + os.path.join("overlap", "ops") + os.sep


def count_calls(fn: Callable[[], Any], calls: int) -> dict[str, float]:
    """Per call of ``fn`` (warm): Python and built-in calls made inside ``overlap/ops/``
    frames ("ops") and outside them ("layer"), and the layer's own by callee ("where")."""
    for _ in range(3):
        fn()
    inside: list[Any] = []  # the outermost ops frame we are in, if any
    n = Counter()
    where: Counter = Counter()

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            if not inside and _OPS in frame.f_code.co_filename:
                inside.append(frame)
            key = "ops" if inside else "layer"
            n[key] += 1
            if key == "layer":
                where[f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"] += 1
        elif event == "c_call":
            key = "ops" if inside else "layer"
            n[key] += 1
            if key == "layer":
                where[f"C {getattr(arg, '__qualname__', getattr(arg, '__name__', '?'))}"] += 1
        elif event == "return" and inside and frame is inside[0]:
            inside.clear()

    sys.setprofile(prof)
    try:
        for _ in range(calls):
            fn()
    finally:
        sys.setprofile(None)
    return {"ops": n["ops"] / calls, "layer": n["layer"] / calls,
            "where": {k: v / calls for k, v in where.most_common()}}


def layer_rows(group: Any, dev: torch.device, dt: torch.dtype, m: int = 64, n: int = 128,
               k: int = 128) -> dict[str, Callable[[], Any]]:
    """name -> one forward + backward, on new inputs each call (world size 1)."""
    from overlap import nn as onn

    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dt, generator=g)

    kw = {"group": group, "device": dev, "dtype": dt}
    lin = torch.nn.Linear(k, n, device=dev, dtype=dt)
    layers = {
        "column": onn.ColumnParallelLinear(k, n, **kw),
        "column_sp": onn.ColumnParallelLinear(k, n, sequence_parallel=True, **kw),
        "row": onn.RowParallelLinear(n, k, **kw),
        "row_sp": onn.RowParallelLinear(n, k, sequence_parallel=True, **kw),
        "norm_column": onn.NormColumnParallelLinear(k, n, **kw),
    }
    out: dict[str, Callable[[], Any]] = {
        "torch nn.Linear": lambda: lin(rnd(m, k).requires_grad_()).backward(rnd(m, n))}

    def one(layer: torch.nn.Module, kin: int, nout: int) -> Callable[[], Any]:
        def f() -> None:
            y = layer(rnd(m, kin).requires_grad_())
            if isinstance(y, tuple):
                torch.autograd.backward(list(y), [rnd(*t.shape) for t in y])
            else:
                y.backward(rnd(m, nout))
        return f

    for name, layer in layers.items():
        kin, nout = (n, k) if name.startswith("row") else (k, n)
        out[name] = one(layer, kin, nout)
    # a norm on this rank's tokens (parallelize's "sequence_norm"), beside torch's own
    from overlap.nn.norms import SequenceParallelNorm

    ln = torch.nn.LayerNorm(k, device=dev, dtype=dt)
    out["torch LayerNorm"] = one(ln, k, k)
    out["sequence_norm"] = one(SequenceParallelNorm(torch.nn.LayerNorm(k, device=dev, dtype=dt), group), k, k)
    return out


def block_rows(group: Any, dev: torch.device, dt: torch.dtype) -> dict[str, Callable[[], Any]]:
    """name -> one GPT block forward + backward (bench_block's plain and library modes)."""
    from types import SimpleNamespace

    from benchmarks.bench_block import _eager_block

    out: dict[str, Callable[[], Any]] = {}
    for sp in (True, False):
        for mode in ("plain", "library"):
            args = SimpleNamespace(batch=1, seq=8, embd=64, heads=4, sp=sp, save_gathered="auto")
            blk = _eager_block(mode, args, {"dev": dev, "dt": dt, "group": group})

            def step(blk: torch.nn.Module = blk) -> None:
                x = torch.randn(1, 8, 64, device=dev, dtype=dt, requires_grad=True)
                blk(x).float().square().mean().backward()

            out[f"block {mode}{' sp' if sp else ''}"] = step
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--json", default=None, help="write the counts here")
    ap.add_argument("--where", type=int, default=0, metavar="N", help="print the layer's N most frequent callees")
    ap.add_argument("--block", action="store_true", help="also one GPT block forward + backward")
    args = ap.parse_args()
    from overlap import dist

    ctx = dist.init()
    dev = ctx.device
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = {}
    print(f"{'row':18s} {'layer':>7s} {'ops':>7s}  (Python + built-in calls per forward + backward)")
    fns = layer_rows(ctx.tp_group, dev, dt)
    if args.block:
        fns.update(block_rows(ctx.tp_group, dev, dt))
    for name, fn in fns.items():
        c = count_calls(fn, args.calls)
        rows[name] = c
        print(f"{name:18s} {c['layer']:7.1f} {c['ops']:7.1f}")
        for w, v in list(c["where"].items())[:args.where]:
            print(f"{'':20s}{v:5.1f}  {w}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "rows": rows}, f, indent=1)
    dist.shutdown()


if __name__ == "__main__":
    main()
