"""One rank of the gloo test of the ops' reference path (started by test_ops_gloo.py)."""

from __future__ import annotations

import os
import warnings

import torch

from overlap import dist
from overlap.ops import all_gather_matmul, all_gather_matmul_chunked, all_gather_matmul_ref
from overlap.ops import Norm, all_reduce_matmul, all_reduce_matmul_chunked, all_reduce_matmul_ref
from overlap.ops import all_gather as agmod
from overlap.ops import all_reduce as armod


def main() -> None:
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init(timeout_s=30)
    ms, k, n = 5, 8, 6
    for call in range(4):
        # one unsharded reference, sharded per rank; different on every call
        full = torch.randn(ws * ms, k, generator=torch.Generator().manual_seed(call))
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(100 + call))
        shard = full[rank * ms:(rank + 1) * ms]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c, gathered = all_gather_matmul(shard, w.t(), return_gathered=True)
        warned = [x for x in caught if "no tile-flag path" in str(x.message)]
        assert len(warned) == (1 if call == 0 else 0), "the fallback warns once, never silently"
        assert torch.equal(gathered, full)
        torch.testing.assert_close(c, full @ w.t())
        torch.testing.assert_close(all_gather_matmul_chunked(shard, w.t(), chunks=2), full @ w.t())
        torch.testing.assert_close(all_gather_matmul_ref(shard, w.t()), full @ w.t())
    assert agmod.stats["reference"] >= 12, agmod.stats
    for bad, exc, text in [((torch.randn(ms, k), torch.randn(k + 1, n)), ValueError, "K mismatch"),
                           ((torch.randn(ms, k), torch.randn(k, n).double()), TypeError, "dtype"),
                           ((torch.randn(ms, k, 2), torch.randn(k, n)), ValueError, "[M/R, K]")]:
        try:
            all_gather_matmul(*bad)
        except exc as e:
            assert text in str(e), e
        else:
            raise AssertionError(f"accepted {text}")
    check_all_reduce_matmul(rank, ws)
    dist.shutdown()
    print(f"PASS ops rank={rank}", flush=True)


def check_all_reduce_matmul(rank: int, ws: int) -> None:
    m, k, n = 7, 12, 5
    for call in range(3):
        # per-rank partial sums whose total is known; residual and norm params change every call
        parts = [torch.randn(m, k, generator=torch.Generator().manual_seed(1000 * call + r)) for r in range(ws)]
        total = sum(parts)
        res = torch.randn(m, k, generator=torch.Generator().manual_seed(77 + call))
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(55 + call))
        lw = torch.rand(k, generator=torch.Generator().manual_seed(33 + call)) + 0.5
        lb = torch.randn(k, generator=torch.Generator().manual_seed(44 + call))
        ln = Norm("layernorm", lw, lb, 1e-5)
        rms = Norm("rmsnorm", lw, None, 1e-6)
        cases = [(None, None, total, total),
                 (res, None, total + res, total + res),
                 (res, ln, total + res, torch.nn.functional.layer_norm(total + res, (k,), lw, lb, 1e-5)),
                 (None, rms, total, torch.nn.functional.rms_norm(total, (k,), lw, 1e-6))]
        for residual, norm, h_ref, y_ref in cases:
            x = parts[rank].clone()
            for fn in (all_reduce_matmul, all_reduce_matmul_ref, all_reduce_matmul_chunked):
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    c, h = fn(x, w.t(), residual=residual, norm=norm)
                warned = [m for m in caught if "no tile-flag path" in str(m.message)]
                first = fn is all_reduce_matmul and call == 0 and residual is None and norm is None
                assert len(warned) == (1 if first else 0), "the op's fallback warns once, never silently"
                torch.testing.assert_close(h, h_ref)
                torch.testing.assert_close(c, y_ref @ w.t())
            assert torch.equal(x, parts[rank]), "x_partial must not be modified"
    assert armod.stats["reference"] >= 24 and armod.stats["fused"] == 0, armod.stats
    x, b = torch.randn(m, k), torch.randn(k, n)
    bad = [((x, torch.randn(k + 1, n)), {}, ValueError, "K mismatch"),
           ((x, b.double()), {}, TypeError, "dtype"),
           ((x, b), {"residual": torch.randn(m + 1, k)}, ValueError, "residual must be"),
           ((x, b), {"residual": torch.randn(m, k).double()}, TypeError, "residual is"),
           ((x, b), {"norm": Norm("layernorm", torch.ones(k + 1))}, ValueError, "norm weight must be [K]"),
           ((x, b), {"norm": "layernorm"}, TypeError, "overlap.ops.Norm")]
    for args, kw, exc, text in bad:
        try:
            all_reduce_matmul(*args, **kw)
        except exc as e:
            assert text in str(e), e
        else:
            raise AssertionError(f"accepted {text}")
    for kw in ({"kind": "batchnorm"}, {"kind": "rmsnorm", "bias": torch.ones(k)}, {"kind": "layernorm", "eps": 0.0}):
        try:
            Norm(weight=torch.ones(k), **kw)
        except ValueError:
            pass
        else:
            raise AssertionError(f"Norm accepted {kw}")


if __name__ == "__main__":
    main()
