"""Every error of an op's call names the op (no process group needed: the checks come
first), and a norm whose weight dtype the input cannot take is refused, naming the op and
the norm, before torch's norm would fail inside."""

from __future__ import annotations

import pytest
import torch

from overlap.ops import Norm, all_gather_matmul, all_reduce_matmul, matmul_all_reduce, matmul_all_reduce_matmul
from overlap.ops import matmul_reduce_scatter, mlp_chain, mlp_chain_ref

K, N = 8, 6


def _bad_calls() -> list:
    x, w = torch.randn(4, K), torch.randn(K, N)
    return [
        ("all_gather_matmul", lambda: all_gather_matmul(torch.randn(K), w)),
        ("all_gather_matmul", lambda: all_gather_matmul(x, torch.randn(K + 1, N))),
        ("all_gather_matmul", lambda: all_gather_matmul(x, w.double())),
        ("all_gather_matmul", lambda: all_gather_matmul(x[:0], w)),
        ("all_gather_matmul", lambda: all_gather_matmul(x.to(torch.int16), w.to(torch.int16))),
        ("all_gather_matmul", lambda: all_gather_matmul([x], w)),
        ("all_reduce_matmul", lambda: all_reduce_matmul(torch.randn(K), w)),
        ("all_reduce_matmul", lambda: all_reduce_matmul(x, w, residual=torch.randn(5, K))),
        ("all_reduce_matmul", lambda: all_reduce_matmul(x, w, norm=Norm("layernorm", torch.ones(K).half()))),
        ("all_reduce_matmul", lambda: all_reduce_matmul(x, w, norm=Norm("rmsnorm", torch.ones(K + 1)))),
        ("all_reduce_matmul", lambda: all_reduce_matmul(x, w, norm="layernorm")),
        ("all_reduce_matmul", lambda: all_reduce_matmul(x.to(torch.complex64), w.to(torch.complex64))),
        ("matmul_reduce_scatter", lambda: matmul_reduce_scatter(x, w.half())),
        ("matmul_all_reduce", lambda: matmul_all_reduce(x, torch.randn(K + 2, N))),
        ("matmul_all_reduce_matmul", lambda: matmul_all_reduce_matmul(x, w, torch.randn(N + 1, 3))),
        ("matmul_all_reduce_matmul", lambda: matmul_all_reduce_matmul(
            x, w, torch.randn(N, 3), norm=Norm("layernorm", torch.ones(N, dtype=torch.float64)))),
        ("mlp_chain", lambda: mlp_chain(x, torch.randn(K + 1, N), torch.randn(N, 3))),
        ("mlp_chain", lambda: mlp_chain(x, w, torch.randn(N, 3), activation="relu")),
        ("mlp_chain", lambda: mlp_chain(x, w, torch.randn(N, 3), config="fast")),
        ("mlp_chain", lambda: mlp_chain_ref(x, w, torch.randn(N, 3).double())),
    ]


@pytest.mark.parametrize("i", range(len(_bad_calls())))
def test_every_error_names_its_op(i: int) -> None:
    op, call = _bad_calls()[i]
    with pytest.raises((ValueError, TypeError, RuntimeError)) as e:
        call()
    assert str(e.value).startswith(f"{op}: "), f"{type(e.value).__name__}: {e.value}"


def test_norm_dtype_refused_naming_op_and_norm() -> None:
    x, w = torch.randn(4, K), torch.randn(K, N)
    with pytest.raises(TypeError, match=r"all_reduce_matmul: norm weight is torch.float16, x_partial is "
                                        r"torch.float32 \(the layernorm's weight\)"):
        all_reduce_matmul(x, w, norm=Norm("layernorm", torch.ones(K).half(), torch.zeros(K).half()))
    with pytest.raises(TypeError, match=r"all_reduce_matmul: norm bias is torch.float64, x_partial is torch.float32 "
                                        r"\(the layernorm's bias\)"):
        all_reduce_matmul(x, w, norm=Norm("layernorm", torch.ones(K), torch.zeros(K).double()))
    with pytest.raises(TypeError, match="matmul_all_reduce_matmul: norm weight is torch.float64, a is torch.float32"):
        matmul_all_reduce_matmul(x, w, torch.randn(N, 3), norm=Norm("rmsnorm", torch.ones(N).double()))
    for bad in ({"eps": float("nan")}, {"eps": "1e-5"}, {"eps": True}, {"eps": 2.0}, {"kind": None}):
        with pytest.raises(ValueError, match=r"Norm\.(eps|kind)"):
            Norm(**{"kind": "layernorm", "weight": torch.ones(K), **bad})
