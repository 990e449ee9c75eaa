"""A LayerNorm / RMSNorm folded into the GEMM that follows it.

    y = (h - mean) * rstd * w + bias          (per row of h: mean, rstd; RMSNorm: mean = 0)
    y @ B = rstd * (h @ B') - mean * rstd * u + v,
        B' = diag(w) B  (rounded to B's dtype),  u = colsum(B') (fp32),  v = bias @ B (fp32)

So the kernel that makes h need not write y: it writes each row's rstd and
mean * rstd, and the GEMM reads h and B' and applies the rest in its epilogue
(``tile_gemm_kernel`` with ``NORM_EPI``). u is summed from the rounded B', so
``h @ B' - mean * u`` is the product with the centred rows up to fp32 rounding
(no cancellation of bf16-sized errors when |mean| >> std). B' rounds w * B
where the unfolded path rounds y: one rounding of the same size either way.
The trick is the one used to fold a norm's affine weights into the next linear
layer for inference; here it is applied per call, since weights may change.

``fold_norm`` makes B' (in B's storage layout, so the GEMM reads it as it would
have read B) and [u; v] in one pass over B. One program per ``BLOCK_N``
columns walks all of K, so the sums are in a fixed order (the same bits on
every call) with no atomics.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from .. import observe as _observe

from ._launch import CachedLauncher
from .tile_gemm import interpreting

__all__ = ["fold_norm_kernel", "fold_norm", "fold_block_n", "foldable", "FoldPlan"]


@triton.jit(launch_metadata=_observe.fold_norm_metadata)
def fold_norm_kernel(b_ptr, w_ptr, bias_ptr, out_ptr, vec_ptr, K, N, stride_bk, stride_bn, stride_ok, stride_on,
                     HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    v = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        km = ks < K
        m = km[:, None] & cm[None, :]
        bt = tl.load(b_ptr + ks.to(tl.int64)[:, None] * stride_bk + cols.to(tl.int64)[None, :] * stride_bn,
                     mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + ks, mask=km, other=0.0).to(tl.float32)
        bw = (bt * w[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + ks.to(tl.int64)[:, None] * stride_ok + cols.to(tl.int64)[None, :] * stride_on, bw, mask=m)
        u += tl.sum(bw.to(tl.float32), axis=0)
        if HAS_BIAS:
            bb = tl.load(bias_ptr + ks, mask=km, other=0.0).to(tl.float32)
            v += tl.sum(bt * bb[:, None], axis=0)
    tl.store(vec_ptr + cols, u, mask=cm)
    tl.store(vec_ptr + N + cols, v, mask=cm)


def fold_block_n(n: int, num_sms: int) -> int:
    """Columns per program: the widest of 64, 32, 16, 8 that still gives at least two
    programs per SM (each program walks all of K)."""
    bn = 64
    while bn > 8 and -(-n // bn) < 2 * num_sms:
        bn //= 2
    return bn


def foldable(b: Any) -> bool:
    """True when ``b`` [K, N] is stored as the tile GEMM reads B without a copy: rows
    of N unit-stride elements, or the ``w.t()`` view of a row-major [N, K] ``w``."""
    k, n = b.shape
    return (b.stride(1) == 1 and b.stride(0) >= n) or (b.stride(0) == 1 and b.stride(1) >= k)


def fold_norm(b: Any, weight: Any, bias: Any = None, *, out: Any = None, vec: Any = None,
              num_sms: int = 132) -> tuple[Any, Any]:
    """(B', [u; v]) for ``b`` [K, N] and the norm's ``weight`` (and ``bias``) [K], on the
    current stream. B' has b's shape, dtype and strides (``b`` must be ``foldable``:
    row-major [K, N] or the ``w.t()`` view of an nn.Linear weight); [u; v] is fp32 [2, N] (v = 0
    without a bias). ``out`` and ``vec`` may be given to be filled instead."""
    import torch

    if b.dim() != 2 or weight.dim() != 1 or weight.shape[0] != b.shape[0]:
        raise ValueError(f"fold_norm: b must be [K, N] and weight [K]; got {tuple(b.shape)} and "
                         f"{tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != tuple(weight.shape):
        raise ValueError(f"fold_norm: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if not foldable(b):
        raise ValueError(f"fold_norm: b {tuple(b.shape)} with strides {b.stride()} is neither row-major "
                         "nor a transposed row-major matrix")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.stride(0) != 1 and t.numel() > 1:
            raise ValueError(f"fold_norm: {name} must be contiguous")
    K, N = b.shape
    if out is None:
        out = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device=b.device)
    elif tuple(out.shape) != (K, N) or out.stride() != b.stride() or out.dtype != b.dtype:
        raise ValueError("fold_norm: out must have b's shape, strides and dtype")
    if vec is None:
        vec = torch.empty((2, N), dtype=torch.float32, device=b.device)
    elif tuple(vec.shape) != (2, N) or vec.dtype != torch.float32 or not vec.is_contiguous():
        raise ValueError(f"fold_norm: vec must be contiguous fp32 [2, {N}]")
    FoldPlan(b, weight, bias, num_sms=num_sms).launch(b, weight, bias, out, vec)
    return out, vec


class FoldPlan:
    """``fold_norm`` checked and keyed once (an op's plan): B's shape, strides and dtype,
    the weight's and bias's dtypes and the column blocks are fixed; ``launch`` takes
    operands of the plan's layout (the caller's guarantee) and, unless given, allocates
    B' and [u; v] on the current stream. Returns them."""

    def __init__(self, b: Any, weight: Any, bias: Any = None, *, num_sms: int = 132) -> None:
        K, N = b.shape
        self.shape, self.strides = (K, N), b.stride()
        self.has_bias = bias is not None
        bn = fold_block_n(N, num_sms)
        bk = max(16, min(triton.next_power_of_2(K), 4096 // bn))
        self.grid = triton.cdiv(N, bn)
        self.ints = (K, N, b.stride(0), b.stride(1), b.stride(0), b.stride(1))
        meta = dict(HAS_BIAS=bias is not None, BLOCK_K=bk, BLOCK_N=bn)
        bias_t = bias if bias is not None else weight
        # what Triton specializes on: the constexprs, the dtypes, and the integers by value
        key = (tuple(meta.values()), b.dtype, weight.dtype, bias_t.dtype, self.ints)
        self.prepared = _launcher.prepare(key, meta, num_warps=4, interpret=interpreting())

    def launch(self, b: Any, weight: Any, bias: Any = None, out: Any = None, vec: Any = None) -> tuple[Any, Any]:
        import torch

        if (bias is not None) != self.has_bias:
            raise ValueError("fold_norm: bias given as when the plan was made, or not at all")
        if out is None:
            out = torch.empty_strided(self.shape, self.strides, dtype=b.dtype, device=b.device)
        if vec is None:
            vec = torch.empty((2, self.shape[1]), dtype=torch.float32, device=b.device)
        bias_t = bias if bias is not None else weight
        self.prepared.launch(self.grid, (b, weight, bias_t, out, vec, *self.ints),
                             aligned=(b, weight, bias_t, out, vec))
        return out, vec


_launcher = CachedLauncher(fold_norm_kernel)
