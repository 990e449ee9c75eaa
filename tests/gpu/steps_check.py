"""Refusals and threads on the tile-flag paths at world size 1 (one process; see test_steps_gpu.py).

Each check prints ``PASS <name> ...`` or ``FAIL <name>: ...``; the script exits 1 if any
failed. Inputs change on every call.

    refusals   each group op on its fast path (fp16, NCCL transport): a bad input (1-D,
               empty M, a/b dtypes, int16, requires_grad, a norm weight of float64, a bad
               config) raises an error naming the op, at a new signature and at one agreed
               before; the next call is right and took the tile-flag path
    threads    two threads, each on its own stream, calling all_gather_matmul and
               all_reduce_matmul at once: every result right (at one rank the calls are
               serialized, none refused)
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import overlap  # noqa: E402
from overlap.ops import Norm, OverlapConfig  # noqa: E402
from overlap.ops import all_gather as agmod  # noqa: E402
from overlap.ops import all_reduce as armod  # noqa: E402
from overlap.ops import boundary as bdmod  # noqa: E402
from overlap.ops import matmul_reduce as mrmod  # noqa: E402
from overlap.ops._runtime import check_errors  # noqa: E402

DEV = torch.device("cuda", 0)
DT = torch.float16
TOL = 2e-2
CFG = OverlapConfig(transport="nccl", chunks=2, nccl_ctas=8)
M, K, N = 512, 256, 384


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()


def rnd(*shape: int, dtype: torch.dtype = DT) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV) / shape[-1] ** 0.25).to(dtype)


def check(name: str, fn: Callable[[], str]) -> bool:
    try:
        msg = fn()
    except Exception as e:  # noqa: BLE001 - every check reports
        traceback.print_exc()
        print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
        return False
    print(f"PASS {name} {msg}", flush=True)
    return True


def good(tag: str) -> None:
    """Each group op once on the tile-flag path, against torch in fp32; the fused count moves."""
    before = (agmod.stats["fused"], armod.stats["fused"], mrmod.stats["fused"], bdmod.stats["fused"])
    a, w = rnd(M, K), rnd(N, K)
    assert rel(overlap.ops.all_gather_matmul(a, w.t(), config=CFG), a.float() @ w.float().t()) < TOL, tag
    res, nw, nb = rnd(M, K), rnd(K), rnd(K)
    norm = Norm("layernorm", nw, nb, 1e-5)
    c, h = overlap.ops.all_reduce_matmul(a, w.t(), residual=res, norm=norm, config=CFG)
    h_ref = a.float() + res.float()
    assert rel(h, h_ref) < TOL, tag
    y_ref = torch.nn.functional.layer_norm(h_ref, (K,), nw.float(), nb.float(), 1e-5) @ w.float().t()
    assert rel(c, y_ref) < TOL, tag
    b = rnd(K, N)
    assert rel(overlap.ops.matmul_reduce_scatter(a, b, config=CFG), a.float() @ b.float()) < TOL, tag
    assert rel(overlap.ops.matmul_all_reduce(a, b, config=CFG), a.float() @ b.float()) < TOL, tag
    b2 = rnd(N, 128)
    c2, h2 = overlap.ops.matmul_all_reduce_matmul(a, b, b2, config=CFG)
    assert rel(h2, a.float() @ b.float()) < TOL and rel(c2, (a.float() @ b.float()) @ b2.float()) < TOL, tag
    after = (agmod.stats["fused"], armod.stats["fused"], mrmod.stats["fused"], bdmod.stats["fused"])
    assert all(x > y for x, y in zip(after, before)), f"{tag}: a tile-flag path did not run ({before} -> {after})"


def expect(fn: Callable[[], Any], op: str, what: str) -> None:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as e:
        assert op in str(e), f"{what}: the error does not name {op}: {type(e).__name__}: {e}"
        return
    raise AssertionError(f"{what}: accepted")


def refusals() -> str:
    good("start")  # every signature below agreed (and its kernels built) before the bad calls
    a, w, b = rnd(M, K), rnd(N, K), rnd(K, N)
    bad: list[tuple[str, Callable[[], Any]]] = [
        ("all_gather_matmul", lambda: overlap.ops.all_gather_matmul(rnd(K), w.t(), config=CFG)),
        ("all_gather_matmul", lambda: overlap.ops.all_gather_matmul(rnd(0, K), w.t(), config=CFG)),
        ("all_gather_matmul", lambda: overlap.ops.all_gather_matmul(a, w.t().float(), config=CFG)),
        ("all_gather_matmul", lambda: overlap.ops.all_gather_matmul(a.to(torch.int16), w.t().to(torch.int16))),
        ("all_gather_matmul", lambda: overlap.ops.all_gather_matmul(a.clone().requires_grad_(), w.t())),
        ("all_gather_matmul", lambda: overlap.ops.all_gather_matmul(a[:, :K - 4], rnd(N, K - 4).t(), config=CFG)),
        ("all_reduce_matmul", lambda: overlap.ops.all_reduce_matmul(
            a, w.t(), norm=Norm("layernorm", rnd(K, dtype=torch.float64)), config=CFG)),
        ("all_reduce_matmul", lambda: overlap.ops.all_reduce_matmul(a, w.t(), residual=rnd(M + 1, K), config=CFG)),
        ("matmul_reduce_scatter", lambda: overlap.ops.matmul_reduce_scatter(a, b[:-1], config=CFG)),
        ("matmul_all_reduce", lambda: overlap.ops.matmul_all_reduce(a, b.float(), config=CFG)),
        ("matmul_all_reduce_matmul", lambda: overlap.ops.matmul_all_reduce_matmul(a, b, rnd(N + 1, 128),
                                                                                config=CFG)),
        ("mlp_chain", lambda: overlap.ops.mlp_chain(a, rnd(K + 1, N), rnd(N, K))),
    ]
    for i, (op, fn) in enumerate(bad):
        expect(fn, op, f"case {i}")
        good(f"after case {i}")
    check_errors()
    return f"{len(bad)} refusals, each followed by right calls on the tile-flag paths"


def threads() -> str:
    errs: list[str] = []
    done = [0]

    def work(seed: int) -> None:
        try:
            torch.manual_seed(seed)
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                w = rnd(N, K)
                for i in range(20):
                    a = rnd(M, K)
                    e1 = rel(overlap.ops.all_gather_matmul(a, w.t(), config=CFG), a.float() @ w.float().t())
                    c, h = overlap.ops.all_reduce_matmul(a, w.t(), config=CFG)
                    e2 = rel(c, a.float() @ w.float().t())
                    if max(e1, e2) >= TOL:
                        errs.append(f"thread {seed} call {i}: rel errs {e1}, {e2}")
                    done[0] += 1
            s.synchronize()
        except Exception as e:  # noqa: BLE001
            errs.append(f"thread {seed}: {type(e).__name__}: {e}")

    ts = [threading.Thread(target=work, args=(s,), name=f"caller-{s}") for s in (1, 2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in ts), "a thread did not finish within 180 s"
    assert not errs, errs
    check_errors()
    return f"2 threads x 20 calls of two ops, all right ({done[0]} pairs)"


def main() -> None:
    torch.manual_seed(0)
    overlap.dist.init()
    ok = True
    try:
        for name, fn in (("refusals", refusals), ("threads", threads)):
            ok &= check(name, fn)
    finally:
        overlap.dist.shutdown()
    print("ALL PASS" if ok else "SOME FAILED", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
