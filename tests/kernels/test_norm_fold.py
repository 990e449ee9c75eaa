"""Host-side checks of the folded norm: what fold_norm and the reduce kernel's plan refuse,
and the fold kernel's column blocks (the kernels themselves run under the interpreter in
tests/kernels/test_norm_interp.py::test_norm_fold)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from overlap.kernels.add_norm import ReducePlan  # noqa: E402
from overlap.kernels.norm_fold import fold_block_n, fold_norm, foldable  # noqa: E402


def test_foldable_layouts() -> None:
    w = torch.zeros(48, 32)
    assert foldable(w.t())             # an nn.Linear weight's w.t()
    assert foldable(w.t().contiguous())  # row-major [K, N]
    assert not foldable(torch.zeros(32, 96)[:, ::2])  # strided columns


@pytest.mark.parametrize("bad", ["weight", "bias", "layout", "out"])
def test_fold_norm_refuses(bad: str) -> None:
    b = torch.zeros(32, 48, dtype=torch.float16)
    w = torch.ones(32, dtype=torch.float16)
    kw = {}
    if bad == "weight":
        w = torch.ones(31, dtype=torch.float16)
    elif bad == "bias":
        kw["bias"] = torch.ones(16, dtype=torch.float16)
    elif bad == "layout":
        b = torch.zeros(32, 96, dtype=torch.float16)[:, ::2]
    else:
        kw["out"] = torch.empty(48, 32, dtype=torch.float16).t()  # other strides than b's
    with pytest.raises(ValueError, match="fold_norm"):
        fold_norm(b, w, **kw)


def test_fold_block_n_keeps_two_programs_per_sm() -> None:
    assert fold_block_n(24576, 132) == 64
    assert fold_block_n(2048, 132) == 8
    assert fold_block_n(1024, 132) == 8   # never below 8 columns
    assert fold_block_n(14336, 132) == 32


def _plan(**kw):
    m, k = 16, 32
    x = torch.zeros(m, k, dtype=torch.float16)
    base = dict(starts=torch.tensor([0, m], dtype=torch.int32), rflags=torch.zeros(1, dtype=torch.int32),
                ready=torch.zeros(1, dtype=torch.int32), err=torch.zeros(8, dtype=torch.int32), rank=0, world=2,
                programs=2)
    base.update(kw)
    return ReducePlan(x, torch.zeros(1, m, k, dtype=torch.float16), torch.empty_like(x), **base)


def test_reduce_plan_stats_checks() -> None:
    _plan(norm="layernorm", stats=torch.zeros(16, 2))  # accepted: statistics instead of y
    with pytest.raises(ValueError, match="stats replace y"):
        _plan(norm="layernorm", y=torch.zeros(16, 32, dtype=torch.float16), stats=torch.zeros(16, 2))
    with pytest.raises(ValueError, match="stats replace y"):
        _plan(stats=torch.zeros(16, 2))  # no norm to fold
    with pytest.raises(ValueError, match="stats must be fp32"):
        _plan(norm="rmsnorm", stats=torch.zeros(16, 3))
    with pytest.raises(ValueError, match="a norm needs y and weight"):
        _plan(norm="layernorm")
