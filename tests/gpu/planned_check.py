"""Call plans (``overlap.ops._calls``) at world size 1 (one process; see test_ops_gpu.py).

Per op on the NCCL transport: the first call of a signature makes its plan, the next ones
run from it (counted), every result right against torch with new inputs every call (a
stale read fails); at a planned signature an input that requires grad and an unaligned
input take the full path, which refuses them with the op's name; another dtype makes
another plan; a CUDA graph captured at a planned signature replays right with new inputs.
``--engine auto|tile|gluon`` sets ``OVERLAP_GEMM_ENGINE`` (default: as the environment says;
``gluon`` binds the Gluon GEMM's launches wherever it runs). Prints ``PASS planned ...`` or
``FAIL planned: ...``; exits 1 on a failure.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
os.environ["OVERLAP_PLAN_GRAPHS"] = "off"  # the bound bodies themselves (plan graphs: plan_graphs_check.py)
if "--engine" in sys.argv:
    os.environ["OVERLAP_GEMM_ENGINE"] = sys.argv[sys.argv.index("--engine") + 1]

from overlap import dist  # noqa: E402
from overlap.ops import (Norm, OverlapConfig, all_gather_matmul, all_reduce_matmul, matmul_all_reduce,  # noqa: E402
                         matmul_all_reduce_matmul, matmul_reduce_scatter)
from overlap.ops import _calls  # noqa: E402
from overlap.ops._runtime import get_runtime  # noqa: E402

M, K, N, N2 = 384, 256, 512, 128
CFG = OverlapConfig(transport="nccl", chunks=2)
BOUND = ("all_gather_matmul", "all_reduce_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "matmul_all_reduce_matmul")
"""The ops whose call plans run a bound body (``_calls.BoundBody``)."""


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()


def main() -> None:
    ctx = dist.init()
    dev, group = ctx.device, ctx.tp_group
    torch.manual_seed(0)

    def rnd(*shape: int, dt: torch.dtype) -> torch.Tensor:
        return (torch.randn(*shape, device=dev) / shape[-1] ** 0.25).to(dt)

    def ln(dt: torch.dtype) -> Norm:
        return Norm("layernorm", (torch.rand(N, device=dev) + 0.5).to(dt), torch.randn(N, device=dev).to(dt))

    def cases(dt: torch.dtype) -> dict:
        w = rnd(N, K, dt=dt)                      # [N, K]: w.t() is b [K, N]
        w_next = rnd(N2, N, dt=dt)                # the next layer's [N2, N]
        nrm_k = Norm("layernorm", (torch.rand(K, device=dev) + 0.5).to(dt), torch.randn(K, device=dev).to(dt))
        nrm_n = ln(dt)

        def agmm(x):
            return all_gather_matmul(x, w.t(), group=group, config=CFG), x.float() @ w.float().t()

        def armm(x):
            res = rnd(M, K, dt=dt)
            c, h = all_reduce_matmul(x, w.t(), group=group, residual=res, norm=nrm_k, config=CFG)
            h_ref = x.float() + res.float()
            return torch.cat([c.float(), h.float()], 1), torch.cat([nrm_k.apply(h_ref.to(dt)).float() @ w.float().t(),
                                                                    h_ref], 1)

        def mrs(x):
            return matmul_reduce_scatter(x, w.t(), group=group, config=CFG), x.float() @ w.float().t()

        def mar(x):
            res = rnd(M, N, dt=dt)
            return (matmul_all_reduce(x, w.t(), group=group, residual=res, config=CFG),
                    x.float() @ w.float().t() + res.float())

        def marm(x):
            res = rnd(M, N, dt=dt)
            c, h = matmul_all_reduce_matmul(x, w.t(), w_next.t(), group=group, residual=res, norm=nrm_n, config=CFG)
            h_ref = x.float() @ w.float().t() + res.float()
            return torch.cat([c.float(), h.float()], 1), torch.cat(
                [nrm_n.apply(h_ref.to(dt)).float() @ w_next.float().t(), h_ref], 1)

        return {"all_gather_matmul": agmm, "all_reduce_matmul": armm, "matmul_reduce_scatter": mrs,
                "matmul_all_reduce": mar, "matmul_all_reduce_matmul": marm}

    try:
        made = 0
        engines: set[str] = set()  # the engines the bound consumer GEMMs picked
        for dt in (torch.float16, torch.bfloat16):
            tol = 2e-2 if dt == torch.float16 else 4e-2
            for op, fn in cases(dt).items():
                m0, p0, b0 = _calls.stats["made"], _calls.stats["planned"], _calls.stats["bound"]
                for it in range(4):
                    got, want = fn(rnd(M, K, dt=dt))
                    e = rel(got, want)
                    assert e < tol, (op, dt, it, e)
                assert _calls.stats["made"] - m0 == 1, (op, dt, "made", _calls.stats["made"] - m0)
                assert _calls.stats["planned"] - p0 == 3, (op, dt, "planned", _calls.stats["planned"] - p0)
                if op in BOUND:  # the planned calls ran through the bound body, its launches bound
                    assert _calls.stats["bound"] - b0 == 3, (op, dt, "bound", _calls.stats["bound"] - b0)
                    body = next(iter(get_runtime(group, dev).cache(f"{op}.calls", _calls.CALLS_CAP).values())).body
                    # an engine plan's launch is bound as its pick's: the tile GEMM's or the Gluon GEMM's
                    gluon = [vars(x).get("decided") is True and vars(x).get("gluon") is not None
                             for x in (getattr(body, g, None) for g in ("gp", "gl", "gp1", "gp2"))
                             if type(x).__name__ == "EnginePlan"]
                    print(op, dt, body, "(the Gluon GEMM)" if any(gluon) else "")
                    assert "launches bound" in repr(body), body
                    engines.update("gluon" if x else "tile" for x in gluon)
                made += 1
                # an input that requires grad at a planned signature: the full path refuses it
                try:
                    with torch.enable_grad():
                        fn(rnd(M, K, dt=dt).requires_grad_())
                    raise AssertionError(f"{op}: an input requiring grad was not refused")
                except RuntimeError as ex:
                    assert op in str(ex), ex
                # an unaligned input (2 bytes past a 16-byte boundary): not from the plan
                p1 = _calls.stats["planned"]
                big = rnd(M * K + 8, dt=dt)
                x_odd = big[1:1 + M * K].view(M, K)
                try:
                    got, want = fn(x_odd)
                    assert rel(got, want) < tol, (op, "unaligned", rel(got, want))
                except ValueError as ex:  # refused for TMA by the full path, with the op's name
                    assert op in str(ex) or "TMA" in str(ex), ex
                assert _calls.stats["planned"] == p1, (op, "an unaligned input ran from the plan")
                # the plan still serves the next aligned call
                got, want = fn(rnd(M, K, dt=dt))
                assert rel(got, want) < tol and _calls.stats["planned"] == p1 + 1, (op, "after")
        rt = get_runtime(group, dev)
        print("plans:", *[repr(cp) for cp in rt.cache("all_reduce_matmul.calls", _calls.CALLS_CAP).values()],
              sep="\n  ")
        # a CUDA graph at a planned signature: the capture takes the full path; replays right
        dt = torch.float16
        w = rnd(N, K, dt=dt)
        x = rnd(M, K, dt=dt)
        for _ in range(2):
            all_gather_matmul(x, w.t(), group=group, config=CFG)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
            out = all_gather_matmul(x, w.t(), group=group, config=CFG)
        torch.cuda.current_stream().wait_stream(s)
        for it in range(3):
            x.copy_(rnd(M, K, dt=dt))
            g.replay()
            torch.cuda.synchronize()
            e = rel(out, x.float() @ w.float().t())
            assert e < 2e-2, ("graph replay", it, e)
        print(f"PASS planned world={ctx.tp_size} ops={made} planned={_calls.stats['planned']} "
              f"made={_calls.stats['made']} engines={','.join(sorted(engines)) or 'none'}", flush=True)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        print(f"FAIL planned: {type(e).__name__}: {e}", flush=True)
        dist.shutdown()
        sys.exit(1)
    dist.shutdown()


if __name__ == "__main__":
    main()
