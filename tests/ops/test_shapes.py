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


def test_a_list_goes_whole_to_the_op_that_takes_it() -> None:
    """Eager calls hand the whole list to the 2-D op (one grid); each output keeps torch's
    fallback strides (a view of a T-major tensor moved to gather_dim), the gathered rows too."""
    a = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(2))
    bs = _widths([16, 24, 8])
    given = []

    def fused(rows, b0, need_g):  # noqa: ANN001 - not called with a list
        raise AssertionError("the one-weight op was called")

    def fused_many(rows: torch.Tensor, ws: list, need_g: bool):
        given.append(ws)
        cs = [rows @ w for w in ws]
        return (cs, rows) if need_g else cs

    for ret in (False, True):
        out = _shapes.all_gather_matmul(fused, a, bs, gather_dim=1, return_gathered=ret, fused_many=fused_many)
        cs, g = out if ret else (out, None)
        assert given[-1] == bs and len(cs) == 3
        for c, b in zip(cs, bs):
            want = torch.matmul(a.movedim(1, 0), b).movedim(0, 1)  # torch's fallback
            torch.testing.assert_close(c, want)
            assert c.stride() == want.stride(), (c.stride(), want.stride())
        if ret:
            torch.testing.assert_close(g, a)
    # one weight in a list: the one-weight op
    one = []
    _shapes.all_gather_matmul(lambda rows, b0, need_g: one.append(b0) or rows @ b0, a, bs[:1], gather_dim=1,
                              return_gathered=False, fused_many=fused_many)
    assert len(one) == 1 and len(given) == 2


def test_weight_lists_the_one_grid_refuses_or_rejects() -> None:
    """The op's list checks (no process group needed): more than MAX_WEIGHTS weights or mixed
    B layouts fall back (a reason, for the report); K, dtype or an empty list: ValueError."""
    import pytest

    from overlap.ops import all_gather as ag

    a = torch.randn(4, 32)
    w = torch.randn(16, 32)  # nn.Linear [N, K]
    assert ag._many_refusal([w.t()] * 4) is None
    assert ag._many_refusal([w.t().contiguous()] * 2) is None
    assert "at most 4" in ag._many_refusal([w.t()] * 5)
    assert "mixed layouts" in ag._many_refusal([w.t(), w.t().contiguous()])
    for bad, want in (([w.t(), torch.randn(48, 16)], "b\\[1\\].*K mismatch"), ([w.t(), w.t().half()], "b\\[1\\].*dtype"),
                      ([], "empty list"), ([w.t(), "q"], "not a tensor")):
        with pytest.raises(ValueError, match=want):
            ag._check_many(a, bad)
    # the all-reduce op's list: the same checks, named for it, before any communication
    from overlap.ops import all_reduce as ar

    for bad, want in (([w.t(), torch.randn(48, 16)], "all_reduce_matmul: b\\[1\\].*K mismatch"),
                      ([w.t(), w.t().half()], "b\\[1\\].*x_partial is torch.float32"),
                      ([], "empty list"), ([w.t(), "q"], "not a tensor")):
        with pytest.raises(ValueError, match=want):
            ar.all_reduce_matmul(a, bad)
