"""The public ops under torch.compile on one GPU, fp16 and bf16: no graph break, the
tile-flag path runs inside the compiled graph, results match eager.

mlp_chain runs in the pytest process; the collective ops at world size 1 run in a
child process (``python tests/gpu/test_compile_gpu.py DTYPE``: one rank, NCCL), so no
process group outlives the test.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import overlap  # noqa: E402
from overlap import Norm  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()


def _close(got: torch.Tensor, ref64: torch.Tensor, torch_out: torch.Tensor, what: str) -> None:
    # the op's error against an fp64 reference, bounded by a small multiple of torch's own
    e, e_t = _rel(got, ref64), _rel(torch_out, ref64)
    assert e <= 2 * e_t + 2e-3, f"{what}: {e:.2e} vs torch {e_t:.2e}"


class _Graphs:
    """A backend that counts Dynamo's graphs and keeps their targets, then runs ``inner``."""

    def __init__(self, inner: str) -> None:
        self.inner, self.targets, self.count = inner, [], 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        from torch._dynamo.backends.registry import lookup_backend

        self.count += 1
        self.targets += [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        return lookup_backend(self.inner)(gm, example_inputs)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_mlp_chain_compiled_gpu(dtype: str, backend: str) -> None:
    from overlap.ops import chain as chmod

    dt, dev = DTYPES[dtype], torch.device("cuda", 0)

    def block(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return overlap.mlp_chain(x, w1, w2) + x  # (M, K): the MLP and its residual

    rec = _Graphs(backend)
    compiled = torch.compile(block, fullgraph=True, backend=rec)
    k, f = 512, 1536
    for it, m in enumerate((256, 256, 1000)):  # new inputs every call; M not a multiple of the tile
        g = torch.Generator(device=dev).manual_seed(it)
        x = torch.randn(m, k, device=dev, dtype=dt, generator=g)
        w1 = (torch.randn(f, k, device=dev, dtype=dt, generator=g) / k ** 0.5).t()  # fc1.weight.t()
        w2 = (torch.randn(k, f, device=dev, dtype=dt, generator=g) / f ** 0.5).t()
        fused0 = chmod.stats["fused"]
        with torch.no_grad():
            y = compiled(x, w1, w2)
        assert chmod.stats["fused"] == fused0 + 1, "the compiled graph ran the tile-flag chain"
        y_eager = block(x, w1, w2)
        if backend == "aot_eager":  # the same kernels, the same bits (inductor fuses the add its own way)
            torch.testing.assert_close(y, y_eager, atol=0, rtol=0)
        r64 = torch.nn.functional.gelu(x.double() @ w1.double()) @ w2.double() + x.double()
        _close(y, r64, chmod.mlp_chain_ref(x, w1, w2) + x, f"{dtype} {backend} M={m} it {it}")
    torch.cuda.synchronize()
    overlap.check_errors()
    assert "overlap.mlp_chain.default" in rec.targets and rec.count <= 2, (rec.count, rec.targets)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_world1_ops_compiled_gpu(dtype: str) -> None:
    from tests._procs import REPO, run_ranks

    procs = run_ranks(REPO / "tests" / "gpu" / "test_compile_gpu.py", 1, [dtype], timeout_s=300)
    assert procs[0].returncode == 0 and "PASS compile gpu world1" in procs[0].out, procs[0]


# ---- the child process ----------------------------------------------------------------

def _step(a: torch.Tensor, b: torch.Tensor, res: torch.Tensor, lw: torch.Tensor,
          lb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    c, gathered = overlap.all_gather_matmul(a, b, return_gathered=True)
    c1 = overlap.all_gather_matmul(a, b)
    y, h = overlap.all_reduce_matmul(a, b, residual=res, norm=Norm("layernorm", lw, lb, 1e-5))
    y2, h2 = overlap.all_reduce_matmul(a, b, norm=Norm("rmsnorm", lw, None, 1e-6))
    return c, gathered, c1, y, h, y2, h2


def _world1_main(dtype: str) -> None:
    from overlap.ops import all_gather as agmod
    from overlap.ops import all_reduce as armod

    dt = DTYPES[dtype]
    ctx = overlap.dist.init(timeout_s=60)
    dev = ctx.device
    rec = _Graphs("aot_eager")
    compiled = torch.compile(_step, fullgraph=True, backend=rec)
    k, n = 1024, 768
    for it, m in enumerate((512, 512, 1000)):
        g = torch.Generator(device=dev).manual_seed(it)
        a = torch.randn(m, k, device=dev, dtype=dt, generator=g)
        b = (torch.randn(n, k, device=dev, dtype=dt, generator=g) / k ** 0.5).t()
        res = torch.randn(m, k, device=dev, dtype=dt, generator=g)
        lw = torch.rand(k, device=dev, dtype=dt, generator=g) + 0.5
        lb = torch.randn(k, device=dev, dtype=dt, generator=g)
        fused0 = (agmod.stats["fused"], armod.stats["fused"])
        with torch.no_grad():
            got = compiled(a, b, res, lw, lb)
        assert (agmod.stats["fused"], armod.stats["fused"]) == (fused0[0] + 2, fused0[1] + 2), \
            ("the compiled graph ran the tile-flag ops", fused0, agmod.stats, armod.stats)
        want = _step(a, b, res, lw, lb)
        for i, (u, v) in enumerate(zip(got, want)):
            torch.testing.assert_close(u, v, msg=lambda s: f"it {it} output {i}: {s}")
        c, gathered, c1, y, h, y2, h2 = got
        assert torch.equal(gathered, a)
        h64 = a.double() + res.double()
        _close(c, a.double() @ b.double(), a @ b, "all_gather_matmul")
        _close(h, h64, a + res, "all_reduce_matmul h")
        ln = torch.nn.functional.layer_norm
        _close(y, ln(h64, (k,), lw.double(), lb.double(), 1e-5) @ b.double(),
               ln(a + res, (k,), lw, lb, 1e-5) @ b, "all_reduce_matmul layernorm")
        _close(y2, torch.nn.functional.rms_norm(a.double(), (k,), lw.double(), 1e-6) @ b.double(),
               torch.nn.functional.rms_norm(a, (k,), lw, 1e-6) @ b, "all_reduce_matmul rmsnorm")
    torch.cuda.synchronize()
    overlap.check_errors()
    for op in ("all_gather_matmul", "all_reduce_matmul"):
        assert f"overlap.{op}.default" in rec.targets, rec.targets
    overlap.dist.shutdown()
    print(f"PASS compile gpu world1 {dtype} graphs={rec.count}", flush=True)


if __name__ == "__main__":
    _world1_main(sys.argv[1])
