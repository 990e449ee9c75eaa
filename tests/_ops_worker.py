"""One rank of the gloo test of the ops' reference path (started by test_ops_gloo.py)."""

from __future__ import annotations

import os
import warnings

import torch

from overlap import dist
from overlap.ops import all_gather_matmul, all_gather_matmul_chunked, all_gather_matmul_ref
from overlap.ops import all_gather as agmod


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
    dist.shutdown()
    print(f"PASS ops rank={rank}", flush=True)


if __name__ == "__main__":
    main()
