"""overlap._shapes: the weight-list calls' choice of the fused GEMM (no process group: the
2-D op is a stand-in that records what it was given)."""

from __future__ import annotations

import torch

from overlap import _shapes


def _widths(ns: list[int], k: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(sum(ns))
    return [torch.randn(k, n, generator=g) for n in ns]


def test_the_widest_weight_is_the_fused_one_and_outputs_keep_their_order() -> None:
    a = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    for ns, want in (([16, 24, 8], 1), ([8, 8, 8], 0), ([4, 8, 8], 1), ([32], 0)):
        bs = _widths(ns)
        given = []

        def fused(rows: torch.Tensor, b0: torch.Tensor, need_g: bool):  # world size 1
            given.append(b0)
            return (rows @ b0, rows) if need_g else rows @ b0

        cs = _shapes.all_gather_matmul(fused, a, bs, gather_dim=1, return_gathered=False)
        assert len(given) == 1 and given[0] is bs[want], (ns, [b.shape for b in given])
        assert [c.shape[-1] for c in cs] == ns
        for c, b in zip(cs, bs):
            torch.testing.assert_close(c, a @ b)

        given.clear()

        def fused_ar(rows: torch.Tensor, b0: torch.Tensor, res: torch.Tensor | None):
            given.append(b0)
            h = rows if res is None else rows + res
            return h @ b0, h

        res = torch.randn_like(a)
        cs, h = _shapes.all_reduce_matmul(fused_ar, a, bs, residual=res, norm=None)
        assert len(given) == 1 and given[0] is bs[want]
        torch.testing.assert_close(h, a + res)
        for c, b in zip(cs, bs):
            torch.testing.assert_close(c, (a + res) @ b)
