"""One rank of the gloo test of the producer ops' reference path (test_matmul_reduce.py).

One unsharded reference per call (A [M, K], W [N, K], residual [M, N], new values every
call), sharded along K per rank: ``matmul_reduce_scatter`` gives this rank's rows of
A @ W^T, ``matmul_all_reduce`` all of them (+ residual); the chunked baselines and the
references agree; bad inputs and ranks that disagree raise on every rank.
"""

from __future__ import annotations

import os
import warnings

import torch

from overlap import dist
from overlap.ops import (Norm, matmul_all_reduce, matmul_all_reduce_chunked, matmul_all_reduce_matmul,
                         matmul_all_reduce_matmul_ref, matmul_all_reduce_ref, matmul_reduce_scatter,
                         matmul_reduce_scatter_chunked, matmul_reduce_scatter_ref)
from overlap.ops import matmul_reduce as mr


def main() -> None:
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init(timeout_s=30)
    warnings.simplefilter("error", FutureWarning)
    warnings.filterwarnings("ignore", message=".*no tile-flag path.*")
    m, k, n = 6 * ws, 4 * ws, 5
    ks = k // ws
    for call in range(4):
        g = torch.Generator().manual_seed(call)
        a_full = torch.randn(m, k, generator=g)
        w = torch.randn(n, k, generator=g)
        res = torch.randn(m, n, generator=g)
        a = a_full[:, rank * ks:(rank + 1) * ks]
        b = w[:, rank * ks:(rank + 1) * ks].t()  # nn.Linear layout, no copy
        full = a_full @ w.t()
        mine = full[rank * (m // ws):(rank + 1) * (m // ws)]
        torch.testing.assert_close(matmul_reduce_scatter(a, b), mine)
        torch.testing.assert_close(matmul_reduce_scatter_ref(a, b), mine)
        torch.testing.assert_close(matmul_reduce_scatter_chunked(a, b, chunks=2), mine)
        torch.testing.assert_close(matmul_all_reduce(a, b), full)
        torch.testing.assert_close(matmul_all_reduce(a, b, residual=res), full + res)
        torch.testing.assert_close(matmul_all_reduce_ref(a, b, residual=res), full + res)
        torch.testing.assert_close(matmul_all_reduce_chunked(a, b, residual=res), full + res)
        # the block boundary: h = sum + residual, c = layer_norm(h) @ w2 shard
        w2 = torch.randn(3 * ws, n, generator=g)  # the next layer's weight [N2, N], column-parallel
        nw, nb = torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g)
        b2 = w2[rank * 3:(rank + 1) * 3].t()  # this rank's N2 / R columns, as w.t()
        want_h = full + res
        want_c = torch.nn.functional.layer_norm(want_h, (n,), nw, nb) @ b2
        for fn in (matmul_all_reduce_matmul, matmul_all_reduce_matmul_ref):
            c, h = fn(a, b, b2, residual=res, norm=Norm("layernorm", nw, nb))
            torch.testing.assert_close(h, want_h)
            torch.testing.assert_close(c, want_c)
        c, h = matmul_all_reduce_matmul(a, b, b2)  # no residual, no norm: c = sum @ b2
        torch.testing.assert_close(c, full @ b2)
    assert mr.stats["reference"] >= 16, mr.stats
    # bad inputs: the same error on every rank, before any collective
    for fn, args, exc, text in [
            (matmul_reduce_scatter, (torch.randn(m + 1, ks), torch.randn(ks, n)), ValueError, "multiple"),
            (matmul_reduce_scatter, (torch.randn(m, ks), torch.randn(ks + 1, n)), ValueError, "K mismatch"),
            (matmul_all_reduce, (torch.randn(m, ks), torch.randn(ks, n).double()), TypeError, "dtype"),
            (matmul_all_reduce, (torch.randn(m, ks, 2), torch.randn(ks, n)), ValueError, "[M, K/R]")]:
        try:
            fn(*args)
        except exc as e:
            assert text in str(e), e
        else:
            raise AssertionError(f"{fn.__name__}{[tuple(t.shape) for t in args]} accepted")
    for kw, text in [({"b_next": torch.randn(n + 1, 3)}, "b_next must be [N, N2]"),
                     ({"norm": Norm("rmsnorm", torch.ones(n + 1))}, "norm weight must be [N]")]:
        args = {"a": torch.randn(m, ks), "b": torch.randn(ks, n), "b_next": torch.randn(n, 3), **kw}
        try:
            matmul_all_reduce_matmul(args.pop("a"), args.pop("b"), args.pop("b_next"), **args)
        except ValueError as e:
            assert text in str(e), e
        else:
            raise AssertionError(f"matmul_all_reduce_matmul accepted {kw}")
    try:
        matmul_all_reduce(torch.randn(m, ks), torch.randn(ks, n), residual=torch.randn(m, n + 1))
    except ValueError as e:
        assert "residual" in str(e), e
    else:
        raise AssertionError("a residual of the wrong shape was accepted")
    # ranks that disagree on M: every rank raises, naming the values
    mm = m if rank else m + ws
    try:
        matmul_reduce_scatter(torch.randn(mm, ks), torch.randn(ks, n))
    except ValueError as e:
        assert "disagree" in str(e), e
    else:
        raise AssertionError("ranks that disagree on M were not refused")
    n2 = 3 if rank else 4  # the next layer's shard: ranks disagree on N2
    try:
        matmul_all_reduce_matmul(torch.randn(m, ks), torch.randn(ks, n), torch.randn(n, n2))
    except ValueError as e:
        assert "disagree" in str(e), e
    else:
        raise AssertionError("ranks that disagree on N2 were not refused")
    try:
        matmul_all_reduce(torch.randn(m, ks, requires_grad=True), torch.randn(ks, n))
    except RuntimeError as e:
        assert "no backward" in str(e), e
    else:
        raise AssertionError("an input that requires grad was accepted")
    # still usable
    torch.testing.assert_close(matmul_all_reduce(a, b), full)
    dist.shutdown()
    print(f"PASS matmul_reduce rank={rank}", flush=True)


if __name__ == "__main__":
    main()
