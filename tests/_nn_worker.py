"""One rank of the gloo tests of ``overlap.nn`` (started by test_nn.py).

Every layer against one unsharded reference (an nn.Linear / LayerNorm built from the same
seed on every rank, sharded per rank): outputs and every gradient (input, weight, bias,
norm parameters, residual), sequence-parallel and not, 2-D and 3-D inputs, new inputs on
every call. The gradient of the sharded job is that of the sum of every rank's loss over
its own outputs; replicated outputs (a row layer's, the residual stream) give each rank
the whole upstream gradient, as in a real model. Then: overlap=True against
overlap=False (equal, and only the first through the library's ops), ``from_linear``
round trip, ``parallelize`` on a small GPT, bad arguments. ``compile`` as the first
argument runs the layers under torch.compile (aot_eager) instead.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as tdist
from torch import nn

from overlap import dist, observe
from overlap.nn import (ColumnParallelLinear, NormColumnParallelLinear, RowParallelLinear, SequenceParallelNorm,
                        functional, parallelize)

RANK, WS = 0, 1
DEV, DT, S = torch.device("cpu"), torch.float32, 1  # the GPU check (tests/gpu/nn_check.py): cuda, bf16, 16
TOL = {"rtol": 1e-5, "atol": 1e-5}  # fp32: sums over ranks in another order than the reference's
REL_BF16 = 3e-2  # bf16: the relative error norm, against a reference in bf16 too


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if DT == torch.float32:
        torch.testing.assert_close(got, want, **TOL, msg=lambda s: f"rank {RANK}: {what}: {s}")
        return
    assert got.shape == want.shape, f"rank {RANK}: {what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12)).item()
    assert err < REL_BF16, f"rank {RANK}: {what}: relative error {err:.3g} >= {REL_BF16}"


def rand(*shape: int, generator: torch.Generator) -> torch.Tensor:
    """torch.randn from a CPU generator (the same on every rank and device), on DEV in DT."""
    return torch.randn(*shape, generator=generator).to(DEV, DT)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rows(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """This rank's contiguous chunk of ``t`` along ``dim``."""
    return t.chunk(WS, dim)[RANK]


def linear(k: int, n: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)  # the same on every rank
    return nn.Linear(k, n, bias=bias).to(DEV, DT)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


# ---- column -----------------------------------------------------------------------------

def check_column(sp: bool, seq_dim: int, gather_output: bool, bias: bool, overlap: bool, shape: tuple,
                 save_gathered: bool | str = "auto") -> None:
    k, n = 8 * S, 4 * WS * S
    ref = linear(k, n, bias, seed=1)
    tp = ColumnParallelLinear.from_linear(ref, sequence_parallel=sp, gather_output=gather_output, overlap=overlap,
                                          sequence_dim=seq_dim, save_gathered=save_gathered)
    ns = n // WS
    cols = slice(RANK * ns, (RANK + 1) * ns)
    for call in range(3):  # new inputs every call
        g = gen(100 + call)
        x_full = rand(*shape, k, generator=g)
        g_full = rand(*shape, n, generator=g)  # the upstream gradient of y
        x_ref = leaf(x_full)
        y_ref = ref(x_ref)
        (y_ref * g_full).sum().backward()
        x = leaf(rows(x_full, seq_dim) if sp else x_full)
        raw: list = []
        x.register_hook(raw.append)  # the gradient as the layer hands it back
        y = tp(x)
        what = (f"column sp={sp} dim={seq_dim} gather={gather_output} bias={bias} overlap={overlap} "
                f"save_gathered={save_gathered} call {call}")
        if gather_output:
            close(y, y_ref, f"{what}: y")
            (y * g_full).sum().backward()
        else:
            close(y, y_ref[..., cols], f"{what}: y")
            (y * g_full[..., cols]).sum().backward()
        close(x.grad, rows(x_ref.grad, seq_dim) if sp else x_ref.grad, f"{what}: grad x")
        # a gradient in the moved (T-major) layout misleads some kernels upstream (CUDA
        # attention's backward did): each layer hands back its input's natural layout
        assert raw[0].is_contiguous() and y.is_contiguous(), f"{what}: strides {raw[0].stride()} {y.stride()}"
        close(tp.weight.grad, ref.weight.grad[cols], f"{what}: grad w")
        if bias:
            close(tp.bias.grad, ref.bias.grad[cols], f"{what}: grad b")
        for p in (*ref.parameters(), *tp.parameters()):
            p.grad = None


# ---- row --------------------------------------------------------------------------------

def check_row(sp: bool, seq_dim: int, input_is_parallel: bool, bias: bool, overlap: bool, shape: tuple) -> None:
    k, n = 4 * WS * S, 6 * S
    ref = linear(k, n, bias, seed=2)
    tp = RowParallelLinear.from_linear(ref, sequence_parallel=sp, input_is_parallel=input_is_parallel,
                                       overlap=overlap, sequence_dim=seq_dim)
    ks = k // WS
    cols = slice(RANK * ks, (RANK + 1) * ks)
    for call in range(3):
        g = gen(200 + call)
        x_full = rand(*shape, k, generator=g)
        g_full = rand(*shape, n, generator=g)
        x_ref = leaf(x_full)
        y_ref = ref(x_ref)
        (y_ref * g_full).sum().backward()
        x = leaf(x_full[..., cols] if input_is_parallel else x_full)
        raw: list = []
        x.register_hook(raw.append)  # the gradient as the layer hands it back
        y = tp(x)
        what = f"row sp={sp} dim={seq_dim} parallel_in={input_is_parallel} bias={bias} overlap={overlap} call {call}"
        if sp:
            close(y, rows(y_ref, seq_dim), f"{what}: y")
            (y * rows(g_full, seq_dim)).sum().backward()
        else:
            close(y, y_ref, f"{what}: y")
            (y * g_full).sum().backward()
        close(x.grad, x_ref.grad[..., cols] if input_is_parallel else x_ref.grad, f"{what}: grad x")
        assert raw[0].is_contiguous() and y.is_contiguous(), f"{what}: strides {raw[0].stride()} {y.stride()}"
        close(tp.weight.grad, ref.weight.grad[:, cols], f"{what}: grad w")
        if bias:
            close(tp.bias.grad, ref.bias.grad, f"{what}: grad b")
        for p in (*ref.parameters(), *tp.parameters()):
            p.grad = None


# ---- norm + column ----------------------------------------------------------------------

def norm_ref(kind: str, k: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.LayerNorm(k) if kind == "layernorm" else nn.RMSNorm(k, eps=1e-6)
    with torch.no_grad():  # not 1 and 0: a wrong parameter gradient must show
        m.weight.uniform_(0.5, 1.5)
        if getattr(m, "bias", None) is not None:
            m.bias.normal_()
    return m.to(DEV, DT)


def check_norm_column(sp: bool, kind: str, with_residual: bool, with_input_bias: bool, overlap: bool,
                      shape: tuple, save_gathered: bool | str = "auto") -> None:
    k, n = 8 * S, 4 * WS * S
    norm, lin = norm_ref(kind, k, seed=3), linear(k, n, True, seed=4)
    tp = NormColumnParallelLinear.from_modules(norm, lin, sequence_parallel=sp, overlap=overlap,
                                               save_gathered=save_gathered)
    ns = n // WS
    cols = slice(RANK * ns, (RANK + 1) * ns)
    for call in range(3):
        g = gen(300 + call)
        parts = [rand(*shape, k, generator=g) for _ in range(WS)]  # every rank's partial sums
        res, ib = rand(*shape, k, generator=g), rand(k, generator=g)
        g_y, g_h = rand(*shape, n, generator=g), rand(*shape, k, generator=g)
        total = sum(parts)
        t_ref, r_ref, b_ref = leaf(total), leaf(res), leaf(ib)
        h_ref = t_ref + (r_ref if with_residual else 0) + (b_ref if with_input_bias else 0)
        y_ref = lin(norm(h_ref))
        ((y_ref * g_y).sum() + (h_ref * g_h).sum()).backward()
        x = leaf(rows(total) if sp else parts[RANK])
        r = leaf(rows(res) if sp else res) if with_residual else None
        b = leaf(ib) if with_input_bias else None
        y, h = tp(x, r, input_bias=b)
        what = (f"norm+column {kind} sp={sp} residual={with_residual} input_bias={with_input_bias} "
                f"save_gathered={save_gathered} call {call}")
        close(y, y_ref[..., cols], f"{what}: y")
        close(h, rows(h_ref) if sp else h_ref, f"{what}: h")
        ((y * g_y[..., cols]).sum() + (h * (rows(g_h) if sp else g_h)).sum()).backward()
        close(x.grad, rows(t_ref.grad) if sp else t_ref.grad, f"{what}: grad x")
        if with_residual:
            close(r.grad, rows(r_ref.grad) if sp else r_ref.grad, f"{what}: grad residual")
        if with_input_bias:
            close(b.grad, b_ref.grad, f"{what}: grad input_bias")
        close(tp.norm.weight.grad, norm.weight.grad, f"{what}: grad norm weight")
        if kind == "layernorm":
            close(tp.norm.bias.grad, norm.bias.grad, f"{what}: grad norm bias")
        close(tp.weight.grad, lin.weight.grad[cols], f"{what}: grad w")
        close(tp.bias.grad, lin.bias.grad[cols], f"{what}: grad b")
        for p in (*norm.parameters(), *lin.parameters(), *tp.parameters()):
            p.grad = None


def check_norm_backward() -> None:
    """``functional.norm_backward`` against torch's autograd, both norms, with and without bias."""
    for kind, has_bias in (("layernorm", True), ("layernorm", False), ("rmsnorm", False)):
        g = gen(7)
        h, gn = leaf(rand(5, 16, generator=g) * 3 + 1), rand(5, 16, generator=g)
        w, b = leaf(torch.rand(16, generator=g).to(DEV, DT) + 0.5), leaf(rand(16, generator=g)) if has_bias else None
        out = functional._apply_norm(h, kind, w, b, 1e-5)
        want = torch.autograd.grad(out, [t for t in (h, w, b) if t is not None], gn)
        args = (gn, h.detach(), kind, w.detach(), None if b is None else b.detach(), 1e-5)
        got = functional.norm_backward(*args)
        for i, (u, v) in enumerate(zip(got, want)):
            close(u, v, f"norm_backward {kind} bias={has_bias} output {i}")
        # both routes: torch's LayerNorm backward kernels (with the normed output they make
        # on the way) and the closed form
        for fused in ((True, False) if kind == "layernorm" else (False,)):
            *grads, normed = functional._norm_backward_with_out(*args, fused=fused)
            for i, (u, v) in enumerate(zip(grads, want)):
                close(u, v, f"norm_backward {kind} bias={has_bias} fused={fused} output {i}")
            assert (normed is None) != fused, (kind, fused)
            if normed is not None:
                close(normed, out.detach(), f"norm_backward {kind} bias={has_bias}: the normed output")


# ---- save_gathered: the weight gradient's input kept, or gathered again -----------------

def _saved_bytes(fn: object) -> int:
    """Bytes of the tensors autograd keeps from ``fn()``'s forward for its backward."""
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(sizes)


def check_save_gathered() -> None:
    """``all_gather_linear`` with ``save_gathered`` True / False / "auto": outputs and
    gradients against the unsharded linear (new inputs every call; with and without the
    input's gradient, with and without the fused path); what it keeps for backward
    ([M, K] or [M/R, K], measured through ``saved_tensors_hooks``); "auto" following
    ``regather_plan`` (its rates patched so that the tiny shape picks each side); the
    backward's order: the gather started before the input gradient's op, waited for after."""
    k, n, m = 8 * S, 4 * WS * S, 3 * WS
    ref = linear(k, n, True, seed=13)
    ns = n // WS
    cols = slice(RANK * ns, (RANK + 1) * ns)
    grp = tdist.group.WORLD
    w, b = leaf(ref.weight[cols]), leaf(ref.bias[cols])
    for mode in (True, False, "auto"):
        for need_x, fused in ((True, True), (False, True), (True, False)):
            for call in range(2):
                g = gen(800 + call)
                x_full, g_full = rand(m, k, generator=g), rand(m, n, generator=g)
                x_ref = leaf(x_full)
                (ref(x_ref) * g_full).sum().backward()
                x = rows(x_full).clone().requires_grad_(need_x)
                y = functional.all_gather_linear(x, w, b, group=grp, fused=fused, save_gathered=mode)
                what = f"all_gather_linear save_gathered={mode} need_x={need_x} fused={fused} call {call}"
                close(y, ref(x_full)[..., cols], f"{what}: y")
                (y * g_full[..., cols]).sum().backward()
                if need_x:
                    close(x.grad, rows(x_ref.grad), f"{what}: grad x")
                close(w.grad, ref.weight.grad[cols], f"{what}: grad w")
                close(b.grad, ref.bias.grad[cols], f"{what}: grad b")
                for p in (*ref.parameters(), w, b):
                    p.grad = None
    # memory kept for backward: the gathered input [M, K] or the shard [M/R, K] (+ the weight)
    elt = torch.empty((), dtype=DT).element_size()
    x = rand(m // WS, k, generator=gen(900)).requires_grad_()
    kept = {mode: _saved_bytes(lambda: functional.all_gather_linear(x, w, b, group=grp, save_gathered=mode))
            for mode in (True, False)}
    assert kept[True] - kept[False] == (m - m // WS) * k * elt, (kept, m, k)
    assert kept[True] - kept[False] == functional.regather_plan(m, ns, k, WS, DT).saved_bytes
    # "auto" follows the rule: at these rates the tiny shape keeps; patched, it regathers
    plan = functional.regather_plan(m, ns, k, WS, DT)
    assert not plan.regather and kept[True] == _saved_bytes(
        lambda: functional.all_gather_linear(x, w, b, group=grp, save_gathered="auto")), (plan, kept)
    rates = functional.GEMM_FLOPS_PER_S, functional.GEMM_FLOPS_PER_S_FP32, functional.COLLECTIVE_FIXED_S
    functional.GEMM_FLOPS_PER_S = functional.GEMM_FLOPS_PER_S_FP32 = 1e3  # GEMMs "slow": gather behind them
    functional.COLLECTIVE_FIXED_S = 0.0
    try:
        assert functional.regather_plan(m, ns, k, WS, DT).regather == (WS > 1)
        got = _saved_bytes(lambda: functional.all_gather_linear(x, w, b, group=grp, save_gathered="auto"))
        assert got == kept[WS == 1], (got, kept)
    finally:
        functional.GEMM_FLOPS_PER_S, functional.GEMM_FLOPS_PER_S_FP32, functional.COLLECTIVE_FIXED_S = rates
    # the backward's order: gather started, input gradient's GEMM -> reduce-scatter, gather waited for
    order: list[str] = []
    wrapped = {name: getattr(functional, name) for name in ("_start_gather_rows", "_mm_rs", "_finish_gather")}

    def spy(name: str) -> object:
        def call(*a: object, **kw: object) -> object:
            order.append(name)
            return wrapped[name](*a, **kw)
        return call

    for name in wrapped:
        setattr(functional, name, spy(name))
    try:
        for mode, want in ((False, ["_start_gather_rows", "_mm_rs", "_finish_gather"]), (True, ["_mm_rs"])):
            order.clear()
            functional.all_gather_linear(x, w, b, group=grp, save_gathered=mode).sum().backward()
            assert order == want, f"rank {RANK}: save_gathered={mode}: backward ran {order}, want {want}"
    finally:
        for name, fn in wrapped.items():
            setattr(functional, name, fn)
    if RANK == 0:
        print(f"saved for backward per layer (M={m}, K={k}, R={WS}, {str(DT)[6:]}): save_gathered=True "
              f"{kept[True]} B, False {kept[False]} B (weight {w.numel() * elt} B in both)", flush=True)


# ---- overlap=True vs overlap=False ------------------------------------------------------

def _op_calls() -> int:
    return sum(observe._count(c) for (op, *_), c in list(observe._calls.items()))


def check_fused_vs_plain() -> None:
    """Both paths give the same numbers; only overlap=True goes through the library's ops
    (counted by overlap.observe); overlap=False through the references alone."""
    k, n = 8 * S, 4 * WS * S
    torch.manual_seed(5)
    col, row = nn.Linear(k, n).to(DEV, DT), nn.Linear(n, k).to(DEV, DT)
    norm = norm_ref("layernorm", k, seed=6)
    outs = {}
    for ov in (True, False):
        before = _op_calls()
        c = ColumnParallelLinear.from_linear(col, sequence_parallel=True, overlap=ov)
        r = RowParallelLinear.from_linear(row, sequence_parallel=True, overlap=ov)
        nc = NormColumnParallelLinear.from_modules(norm, col, overlap=ov)
        x = leaf(rand(3 * WS, k, generator=gen(RANK)))
        p = leaf(rand(3 * WS, k, generator=gen(10 + RANK)))
        y = r(torch.relu(c(x)))
        z, h = nc(p, None)
        (y.square().sum() + z.sum() + h.sum()).backward()
        outs[ov] = [y, z, h, x.grad, p.grad] + [q.grad for m in (c, r, nc) for q in m.parameters()]
        calls = _op_calls() - before
        # forward: agmm, mmrs, armm; backward: mmrs, agmm, mmar
        assert (calls == 6) if ov else (calls == 0), (ov, calls)
    for i, (u, v) in enumerate(zip(outs[True], outs[False])):
        if DEV.type == "cpu":  # the same reference code underneath
            assert torch.equal(u, v), f"rank {RANK}: overlap=True vs False, tensor {i} differs"
        else:
            close(u, v, f"overlap=True vs False, tensor {i}")


# ---- from_linear ------------------------------------------------------------------------

def check_from_linear() -> None:
    """Shards all-gathered give back the layer, on every rank, for both kinds."""
    ref = linear(4 * WS * S, 4 * WS * S, True, seed=8)
    c = ColumnParallelLinear.from_linear(ref)
    r = RowParallelLinear.from_linear(ref)
    wc = [torch.empty_like(c.weight) for _ in range(WS)]
    tdist.all_gather(wc, c.weight.detach())
    bc = [torch.empty_like(c.bias) for _ in range(WS)]
    tdist.all_gather(bc, c.bias.detach())
    wr = [torch.empty_like(r.weight) for _ in range(WS)]
    tdist.all_gather(wr, r.weight.detach())
    assert torch.equal(torch.cat(wc, 0), ref.weight) and torch.equal(torch.cat(bc), ref.bias)
    assert torch.equal(torch.cat(wr, 1), ref.weight) and torch.equal(r.bias, ref.bias)
    assert c.weight.shape == (4 * S, 4 * WS * S) and r.weight.shape == (4 * WS * S, 4 * S), (c.weight.shape,
                                                                                          r.weight.shape)


# ---- parallelize on a small GPT ---------------------------------------------------------

class Attn(nn.Module):
    def __init__(self, c: int, nh: int) -> None:
        super().__init__()
        self.hs = c // nh
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, nh * 3 * hs); nh local after parallelize
        b, t, c3 = qkv.shape
        nh = c3 // (3 * self.hs)
        q, k, v = qkv.view(b, t, nh, 3, self.hs).permute(3, 0, 2, 1, 4).unbind(0)  # 3 x (B, nh, T, hs)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(b, t, nh * self.hs))  # (B, T, C)


class Mlp(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, c: int, nh: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(c), Attn(c, nh), nn.LayerNorm(c), Mlp(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    def __init__(self, c: int = 0, nh: int = 4, layers: int = 2, seed: int = 9) -> None:
        super().__init__()
        c = c or 16 * S
        torch.manual_seed(seed)
        self.drop = nn.Dropout(0.0)
        self.h = nn.ModuleList(Block(c, nh) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.normal_()
        self.to(DEV, DT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(x)
        for blk in self.h:
            x = blk(x)
        return self.ln_f(x)


def check_parallelize(sp: bool) -> None:
    ref, tp = TinyGPT(), parallelize(TinyGPT(), sequence_parallel=sp)
    assert tp.tp_size == WS and isinstance(tp.h[0].attn.qkv, ColumnParallelLinear), tp
    assert isinstance(tp.h[1].mlp.fc2, RowParallelLinear) and tp.h[1].mlp.fc2.sequence_parallel == sp
    assert tp.state_dict().keys() == ref.state_dict().keys()  # names kept: checkpoints load either way
    refp = dict(ref.named_parameters())
    for call in range(2):
        x_full = rand(2, 4 * WS, 16 * S, generator=gen(400 + call))  # (B, T, C)
        gy = rand(2, 4 * WS, 16 * S, generator=gen(500 + call))
        x_ref, x = leaf(x_full), leaf(x_full)
        (ref(x_ref) * gy).sum().backward()
        y = tp(x)
        close(y, ref(x_ref.detach()), f"parallelize sp={sp} call {call}: y")
        (y * gy).sum().backward()
        close(x.grad, x_ref.grad, f"parallelize sp={sp} call {call}: grad x")
        for name, p in tp.named_parameters():
            q = refp[name]
            m = tp.get_submodule(name.rpartition(".")[0]) if "." in name else tp
            if isinstance(m, ColumnParallelLinear):
                want = q.grad.chunk(WS, 0)[RANK]
            elif isinstance(m, RowParallelLinear) and name.endswith("weight"):
                want = q.grad.chunk(WS, 1)[RANK]
            else:
                want = q.grad
            close(p.grad, want, f"parallelize sp={sp} call {call}: grad {name}")
        for p in (*ref.parameters(), *tp.parameters()):
            p.grad = None


# ---- bad arguments ----------------------------------------------------------------------

def check_bad_arguments() -> None:
    divisible = [  # nothing to divide at one rank
        (lambda: ColumnParallelLinear(8, 4 * WS + 1), "out_features"),
        (lambda: RowParallelLinear(4 * WS + 1, 8), "in_features"),
        (lambda: NormColumnParallelLinear(8, 4 * WS + 1), "out_features"),
        (lambda: RowParallelLinear(4 * WS, 8, sequence_parallel=True)(rand(4 * WS + 1, 4, generator=gen(0))),
         "multiple"),
    ]
    cases = divisible * (WS > 1) + [
        (lambda: ColumnParallelLinear(8, 4 * WS, sequence_parallel=True, gather_output=True), "gather_output"),
        (lambda: RowParallelLinear(4 * WS, 8, sequence_parallel=True, input_is_parallel=False), "input_is_parallel"),
        (lambda: RowParallelLinear(4 * WS, 8, sequence_parallel=True, reduce_output=False), "reduce_output"),
        (lambda: NormColumnParallelLinear(8, 4 * WS, norm="batchnorm"), "norm"),
        (lambda: ColumnParallelLinear(8, 4 * WS, sequence_parallel=True, save_gathered="sometimes"), "save_gathered"),
        (lambda: ColumnParallelLinear(8, 4 * WS, save_gathered=1), "save_gathered"),
        (lambda: NormColumnParallelLinear(8, 4 * WS, sequence_parallel=True, save_gathered=None), "save_gathered"),
        (lambda: functional.all_gather_linear(rand(2, 8, generator=gen(0)), rand(4, 8, generator=gen(1)),
                                              group=tdist.group.WORLD, save_gathered="never"), "save_gathered"),
        (lambda: parallelize(TinyGPT(), plan={"*nothing": "column"}), "matched no module"),
        (lambda: parallelize(TinyGPT(), plan={"*fc1": "diagonal"}), "kinds"),
        (lambda: parallelize(TinyGPT(), plan={"*ln_1": "sequence_norm"}), "sequence_parallel"),
    ]
    for i, (fn, text) in enumerate(cases):
        try:
            fn()
        except ValueError as e:
            assert text in str(e), (i, e)
        else:
            raise AssertionError(f"rank {RANK}: bad case {i} ({text}) accepted")
    try:
        parallelize(TinyGPT(), plan={"*ln_1": "column"})
    except TypeError as e:
        assert "nn.Linear" in str(e), e
    else:
        raise AssertionError("a LayerNorm planned as column was accepted")


# ---- torch.compile ----------------------------------------------------------------------

def check_compiled() -> None:
    """A sequence-parallel norm, column (sequence-parallel, the gathered input kept and
    gathered again), row (sequence-parallel and not) and norm + column under torch.compile(fullgraph=True,
    backend="aot_eager"): outputs and gradients equal eager's, inputs new every call, the
    graphs hold the library's custom ops, and the regather's wait comes after the input
    gradient's GEMM -> reduce-scatter in the backward graph."""
    k, n = 8 * S, 4 * WS * S
    torch.manual_seed(11)
    col, row, norm = nn.Linear(k, n).to(DEV, DT), nn.Linear(n, k).to(DEV, DT), norm_ref("layernorm", k, seed=12)
    layers = nn.ModuleDict({
        "c": ColumnParallelLinear.from_linear(col, sequence_parallel=True),
        "c4": ColumnParallelLinear.from_linear(col, sequence_parallel=True, save_gathered=False),
        "r": RowParallelLinear.from_linear(row, sequence_parallel=True),
        "c2": ColumnParallelLinear.from_linear(col),
        "r2": RowParallelLinear.from_linear(row, reduce_output=False),
        "nc": NormColumnParallelLinear.from_modules(norm, col),
        "r3": RowParallelLinear.from_linear(row),
        "sn": SequenceParallelNorm(norm_ref("layernorm", k, seed=13), tdist.group.WORLD),
    })

    def step(x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        x = layers["sn"](x)  # this rank's tokens: the norm's gradients summed over ranks
        y = layers["r"](torch.relu(layers["c"](x)) + layers["c4"](x).square())  # (M/R, K): sequence parallel
        full = functional.gather_from_region(y, group=layers["c"].group, dim=0)  # (M, K)
        p = layers["r2"](torch.relu(layers["c2"](full)))  # partial sums
        z, h = layers["nc"](p, res, input_bias=layers["r2"].bias)
        return (layers["r3"](z).square().sum() + h.sum()) / 10

    targets: dict[str, list[str]] = {"forward": [], "backward": []}
    graphs: dict[str, list[torch.fx.Graph]] = {"forward": [], "backward": []}

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        def keep(which: str) -> object:
            def compiler(g: torch.fx.GraphModule, _: list) -> object:
                targets[which].extend(str(nd.target) for nd in g.graph.nodes if nd.op == "call_function")
                graphs[which].append(g.graph)
                return make_boxed_func(g.forward)
            return compiler

        return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))(gm, example_inputs)

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for call in range(3):
        x = rand(2 * WS, k, generator=gen(600 + call + 10 * RANK))
        res = rand(2 * WS * WS, k, generator=gen(700 + call))
        grads = []
        for fn in (step, compiled):
            xl, rl = leaf(x), leaf(res)
            loss = fn(xl, rl)
            loss.backward()
            grads.append([loss, xl.grad, rl.grad] + [p.grad.clone() for p in layers.parameters()])
            for p in layers.parameters():
                p.grad = None
        for i, (u, v) in enumerate(zip(*grads)):
            close(v, u, f"compiled vs eager, call {call}, tensor {i}")
    # forward: agmm (c), mmrs (r), armm (nc), mmar (r3); backward: mmrs (c), agmm (r), mmar (c2, nc)
    for which, ops in (("forward", ("all_gather_matmul", "matmul_reduce_scatter", "all_reduce_matmul",
                                    "matmul_all_reduce")),
                       ("backward", ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"))):
        for op in ops:
            assert f"overlap.{op}.default" in targets[which], (which, op, sorted(set(targets[which])))
    # c4's regather: started before an input gradient's reduce-scatter op, waited for after it
    overlapped = 0
    for gr in graphs["backward"]:
        nodes = list(gr.nodes)
        for i, nd in enumerate(nodes):
            if str(nd.target) != "_c10d_functional.all_gather_into_tensor.default":
                continue
            j = next(j for j, u in enumerate(nodes) if str(u.target) == "_c10d_functional.wait_tensor.default"
                     and u.args[0] is nd)
            overlapped += any(str(u.target) == "overlap.matmul_reduce_scatter.default" for u in nodes[i + 1:j])
    assert overlapped == 1, f"rank {RANK}: {overlapped} all-gathers in the backward graph span a reduce-scatter op"


def main(device: str = "cpu", dtype: str = "float32", scale: int = 1, compile_too: bool = False) -> None:
    global RANK, WS, DEV, DT, S
    RANK, WS = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    ctx = dist.init(timeout_s=30)
    DEV = ctx.device if device == "cuda" else torch.device(device)
    DT, S = getattr(torch, dtype), scale
    warnings.filterwarnings("ignore", message=".*no tile-flag path.*")
    if sys.argv[1:] == ["compile"]:
        check_compiled()
        tdist.barrier()
        dist.shutdown()
        print(f"PASS nn compile world={WS} rank={RANK}", flush=True)
        return
    check_norm_backward()
    for ov in (True, False):
        for bias in (True, False):
            check_column(False, 0, False, bias, ov, (3, 2))
            check_row(False, 0, True, bias, ov, (3, 2))
        check_column(True, 0, False, True, ov, (2 * WS, 3))
        check_row(True, 0, True, True, ov, (2 * WS, 3))
    check_column(False, 0, True, True, True, (5,))
    for mode in (True, False, "auto"):
        check_column(True, 0, False, True, True, (3 * WS,), save_gathered=mode)  # 2-D
    for mode in (True, False):  # "auto" (the default) above
        check_norm_column(True, "rmsnorm", True, False, True, (2 * WS, 3), save_gathered=mode)
    check_save_gathered()
    check_column(True, 1, False, False, True, (2, 2 * WS))  # batch-first, sequence dim 1
    check_row(False, 0, False, True, True, (5,))
    check_row(True, 0, True, False, True, (3 * WS,))
    check_row(True, 1, True, True, True, (2, 2 * WS))
    for kind in ("layernorm", "rmsnorm"):
        for sp in (False, True):
            check_norm_column(sp, kind, True, True, True, (2 * WS, 3))
    check_norm_column(False, "layernorm", False, False, True, (3 * WS,))
    check_norm_column(True, "layernorm", False, True, False, (3 * WS,))
    check_fused_vs_plain()
    check_from_linear()
    check_parallelize(False)
    check_parallelize(True)
    check_bad_arguments()
    if compile_too:
        check_compiled()
    tdist.barrier()
    dist.shutdown()
    print(f"PASS nn world={WS} rank={RANK} device={DEV.type} dtype={dtype}", flush=True)


if __name__ == "__main__":
    main()
