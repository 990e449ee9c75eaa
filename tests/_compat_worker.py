"""One rank of the compat / N-D checks (test_compat.py on gloo; tests/gpu/compat_check.py on
CUDA). Every case against torch's own async-TP fallbacks (values and strides) and against
a local computation from the full tensors every rank can build; inputs new every call.

Covers what torch's async-TP tests cover: batch 8, gather_dim 0, 1 and 2 (the last on
3-D inputs: torch's column gather), three weights, fp32 / bf16 / fp16, scatter_dim 0, 1
and 2, "sum" and "avg", return_A; plus torch.compile of the compat ops, the N-D top-level
ops, several weights after an all-reduce + norm, and bad inputs.

    python tests/_compat_worker.py [cuda]     (RANK / WORLD_SIZE / MASTER_* from the launcher)
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import overlap  # noqa: E402
from overlap import dist  # noqa: E402
from overlap import compat  # noqa: E402
from overlap.ops import Norm  # noqa: E402

RANK = WS = 0
DEV = torch.device("cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()


def close(got: torch.Tensor, want: torch.Tensor, what: str, strides: bool = True) -> None:
    assert got.shape == want.shape, f"rank {RANK}: {what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if strides:
        assert got.stride() == want.stride(), f"rank {RANK}: {what}: strides {got.stride()} != {want.stride()}"
    e = rel(got, want)
    assert e < TOL[want.dtype], f"rank {RANK}: {what}: relative error {e:.3g}"


def full(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The same tensor on every rank (CPU generator), scaled so sums stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) / shape[-1] ** 0.5).to(DEV, dtype)


def shard(t: torch.Tensor, dim: int, r: int | None = None) -> torch.Tensor:
    return t.chunk(WS, dim)[RANK if r is None else r].contiguous()


def torch_ag(a_shard: torch.Tensor, bs: list[torch.Tensor], gather_dim: int, name: str) -> tuple:
    from torch.distributed._symmetric_memory import _fused_all_gather_matmul_fallback as fb

    return fb(a_shard, bs, gather_dim, name, return_A=True)


def torch_rs(a: torch.Tensor, b: torch.Tensor, reduce_op: str, scatter_dim: int, name: str) -> torch.Tensor:
    from torch.distributed._symmetric_memory import _fused_matmul_reduce_scatter_fallback as fb

    return fb(a, b, reduce_op, scatter_dim, name)


def check_all_gather(dtype: torch.dtype, name: str) -> None:
    b0 = 8 if 8 % WS == 0 else 8 * WS  # batch 8 where the ranks divide it
    cases = [((b0, 4 * WS, 32), 0), ((8, 4 * WS, 32), 1), ((8, 6, 16 * WS), 2), ((8 * WS, 6, 32), -3),
             ((2, 4 * WS, 3, 32), 1), ((2, 4, 3 * WS, 32), 2), ((4 * WS, 32), 0)]
    for call, (shape, gd) in enumerate(cases):
        base = 10 * call + 100 * list(TOL).index(dtype)
        a_full = full(shape, dtype, base)
        k = shape[-1]
        bs = [full((k, n), dtype, base + 1 + i) for i, n in enumerate((16, 24, 8))]
        a_shard = shard(a_full, gd)
        what = f"fused_all_gather_matmul {dtype} shape {shape} gather_dim {gd}"
        a_got, outs = compat.fused_all_gather_matmul(a_shard, bs, gd, name)
        a_ref, outs_ref = torch_ag(a_shard, bs, gd % len(shape), name)  # torch's: dims >= 0
        # at one rank torch's fallback hands back a view whose strides follow from flatten's
        # view rules on a size-1 dim; the library returns the layout of every world size
        close(a_got, a_ref, f"{what}: A", strides=WS > 1)
        close(a_got, a_full, f"{what}: A against the full input", strides=False)
        if DEV.type == "cuda" and WS > 1:  # torch's own op (symmetric memory), where it runs
            a_t, outs_t = torch.ops.symm_mem.fused_all_gather_matmul(a_shard, bs, gd % len(shape), name)
            close(a_got, a_t, f"{what}: A against torch.ops.symm_mem")
            for i, o in enumerate(outs_t):
                close(outs[i], o, f"{what}: out {i} against torch.ops.symm_mem")
        for i, (o, o_ref) in enumerate(zip(outs, outs_ref)):
            close(o, o_ref, f"{what}: out {i}")
            close(o, a_full @ bs[i], f"{what}: out {i} against the full product", strides=False)
        none, outs2 = torch.ops.overlap.fused_all_gather_matmul(a_shard, bs[:1], gd, name, return_A=False)
        assert none is None and len(outs2) == 1, (none, len(outs2))
        close(outs2[0], outs_ref[0], f"{what}: return_A=False")
        if gd % len(shape) != len(shape) - 1:
            # the top-level op: one weight -> one tensor; a list -> a list; gathered when asked
            c = overlap.all_gather_matmul(a_shard, bs[1], gather_dim=gd)
            close(c, outs_ref[1], f"{what}: overlap.all_gather_matmul")
            cs, g = overlap.all_gather_matmul(a_shard, bs, gather_dim=gd, return_gathered=True)
            assert isinstance(cs, list) and len(cs) == 3
            close(g, a_ref, f"{what}: overlap.all_gather_matmul gathered", strides=WS > 1)
            for i in range(3):
                close(cs[i], outs_ref[i], f"{what}: overlap.all_gather_matmul out {i}")


def check_reduce_scatter(dtype: torch.dtype, name: str) -> None:
    cases = [((8 * WS, 6, 32), 0), ((8, 4 * WS, 32), 1), ((2, 3, 2 * WS, 32), 2), ((4 * WS, 32), 0),
             ((8, 4 * WS, 32), -2), ((8, 6, 32), 2)]  # the last: a scatter of the output's columns (N)
    for call, (shape, sd) in enumerate(cases):
        for op in ("sum", "avg"):
            base = 1000 + 10 * call + 100 * list(TOL).index(dtype) + (op == "avg")
            parts = [full(shape, dtype, base + r) for r in range(WS)]  # every rank's A
            b_full = full((shape[-1] * WS, 16 * WS), dtype, base + 50)
            a, b = parts[RANK], shard(b_full, 0)
            what = f"fused_matmul_reduce_scatter {dtype} shape {shape} scatter_dim {sd} {op}"
            got = compat.fused_matmul_reduce_scatter(a, b, op, sd, name)
            ref = torch_rs(a, b, op, sd % len(shape), name)
            close(got, ref, what)
            if DEV.type == "cuda" and WS > 1:
                close(got, torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, op, sd % len(shape), name),
                      f"{what}: against torch.ops.symm_mem")
            total = sum(p.double() @ shard(b_full, 0, r).double() for r, p in enumerate(parts))
            if op == "avg":
                total = total / WS
            close(got, shard(total.to(dtype), sd), f"{what}: against the full product", strides=False)
            if sd % len(shape) != len(shape) - 1:  # the top-level op scatters any dim but the features
                got2 = overlap.matmul_reduce_scatter(a, b, scatter_dim=sd, reduce_op=op)
                close(got2, ref, f"{what}: overlap.matmul_reduce_scatter")
            else:
                close(compat.fused_matmul_reduce_scatter(a, b, op.upper(), sd, name), ref, f"{what}: {op.upper()}")


def check_all_reduce_lists(dtype: torch.dtype) -> None:
    """QKV after an all-reduce + norm: one all-reduce, three weights; N-D inputs."""
    shape, k = (2, 3, 32), 32
    for call in range(2):
        base = 3000 + 10 * call + 100 * list(TOL).index(dtype)
        parts = [full(shape, dtype, base + r) for r in range(WS)]
        res = full(shape, dtype, base + 60)
        bs = [full((k, n), dtype, base + 70 + i) for i, n in enumerate((16, 8, 8))]
        norm = Norm("layernorm", full((k,), dtype, base + 80) + 1, full((k,), dtype, base + 81))
        h_ref = sum(p.double() for p in parts).to(dtype) + res
        y_ref = torch.nn.functional.layer_norm(h_ref.float(), (k,), norm.weight.float(), norm.bias.float(),
                                               norm.eps).to(dtype)
        cs, h = overlap.all_reduce_matmul(parts[RANK], bs, residual=res, norm=norm)
        what = f"all_reduce_matmul {dtype} list call {call}"
        assert isinstance(cs, list) and len(cs) == 3 and h.shape == shape
        close(h, h_ref, f"{what}: h")
        for i in range(3):
            close(cs[i], y_ref @ bs[i], f"{what}: out {i}", strides=False)
        c1, _ = overlap.all_reduce_matmul(parts[RANK], bs[0], residual=res, norm=norm)
        assert torch.is_tensor(c1) and c1.shape == (2, 3, 16)
        close(c1, cs[0], f"{what}: one weight")
        b2 = full((k * WS, 16), dtype, base + 90)
        got = overlap.matmul_all_reduce(parts[RANK], shard(b2, 0), residual=res[..., :16].contiguous())
        want = sum(p.double() @ shard(b2, 0, r).double() for r, p in enumerate(parts)).to(dtype) + res[..., :16]
        close(got, want, f"matmul_all_reduce {dtype} N-D call {call}", strides=False)


def check_compiled(name: str) -> None:
    dtype = torch.float32
    a_full = full((8, 4 * WS, 32), dtype, 5000)
    bs = [full((32, n), dtype, 5001 + n) for n in (16, 8)]
    a_shard = shard(a_full, 1)
    w_rs = full((32, 8), dtype, 5009)

    def f(a: torch.Tensor) -> tuple:
        ag, outs = torch.ops.overlap.fused_all_gather_matmul(a, bs, 1, name)
        rs = torch.ops.overlap.fused_matmul_reduce_scatter(ag, w_rs, "avg", 1, name)
        top = overlap.all_gather_matmul(a, bs, gather_dim=1)
        return ag, outs, rs, top

    eager = f(a_shard)
    torch._dynamo.reset()
    comp = torch.compile(f, fullgraph=True, backend="aot_eager")(a_shard)
    close(comp[0], eager[0], "compiled A")
    for i in range(2):
        close(comp[1][i], eager[1][i], f"compiled out {i}")
        close(comp[3][i], eager[3][i], f"compiled top-level out {i}")
    close(comp[2], eager[2], "compiled reduce-scatter")


def check_bad(name: str) -> None:
    a = full((4, 8), torch.float32, 7000)
    b = full((8, 4), torch.float32, 7001)

    def raises(fn, exc, text: str) -> None:  # noqa: ANN001
        try:
            fn()
        except exc as e:
            assert text in str(e), f"rank {RANK}: {text!r} not in {e}"
        else:
            raise AssertionError(f"rank {RANK}: no {exc.__name__} ({text})")

    raises(lambda: compat.fused_all_gather_matmul(a, [b], 2, name), ValueError, "out of range")
    raises(lambda: compat.fused_all_gather_matmul(a, [], 0, name), ValueError, "empty list")
    raises(lambda: compat.fused_all_gather_matmul(a, [b, b.t()], 0, name), ValueError, "b[1] has 4 rows")
    raises(lambda: compat.fused_matmul_reduce_scatter(a, b, "max", 0, name), ValueError, "reduce_op")
    raises(lambda: compat.fused_matmul_reduce_scatter(a, b, "sum", 2, name), ValueError, "out of range")
    raises(lambda: overlap.matmul_reduce_scatter(a, b, scatter_dim=1), ValueError, "feature (last) dim")
    raises(lambda: overlap.all_gather_matmul(a, b, gather_dim=-1), ValueError, "gather_dim=-1 is the feature")
    if WS > 1:  # a column gather multiplies K by the ranks (at one rank, 8 rows fit)
        raises(lambda: compat.fused_all_gather_matmul(a, [b], -1, name), ValueError,
               f"has 8 rows, the input's last dim is K={8 * WS}")
    raises(lambda: overlap.matmul_reduce_scatter(a, [b]), ValueError, "one weight")
    raises(lambda: overlap.matmul_all_reduce(a, [b]), ValueError, "one weight")
    raises(lambda: overlap.matmul_all_reduce_matmul(a, [b], b.t()), ValueError, "b must be a 2-D tensor")
    raises(lambda: overlap.all_gather_matmul(a.view(1, 4, 8), [b, b.half()]), ValueError, "b[1] is torch.float16")
    raises(lambda: overlap.all_reduce_matmul(a, [b], residual=a[:2]), ValueError, "does not match")
    raises(lambda: compat.fused_all_gather_scaled_matmul(a, [b], a, [b], 0, name, [None], [None], [None], [False]),
           NotImplementedError, "FP8")
    raises(lambda: compat.fused_scaled_matmul_reduce_scatter(a, b, a, b, "sum", 0, 0, name, None),
           NotImplementedError, "FP8")
    if WS > 1:  # a scattered dim that the ranks do not divide, though the rows do
        a3 = full((2, WS + 1, 8), torch.float32, 7002)
        if (2 * (WS + 1)) % WS == 0:
            raises(lambda: overlap.matmul_reduce_scatter(a3, b, scatter_dim=1), ValueError, "not a multiple")
    with torch.enable_grad():
        w = b.clone().requires_grad_()
        raises(lambda: overlap.all_gather_matmul(a.view(1, 4, 8), [b, w]), RuntimeError, "no backward")
        # torch's ops warn and drop the gradient; ours refuse
        raises(lambda: compat.fused_all_gather_matmul(a, [w], 0, name), RuntimeError, "no backward")
        a_rows = full((4 * WS, 8), torch.float32, 7003)  # rows the ranks divide: the op runs, then refuses
        raises(lambda: compat.fused_matmul_reduce_scatter(a_rows, w, "sum", 0, name), RuntimeError, "no backward")


def main() -> None:
    global RANK, WS, DEV
    cuda = sys.argv[1:] == ["cuda"]
    dist.init(timeout_s=60)
    RANK, WS = tdist.get_rank(), tdist.get_world_size()
    DEV = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    name = dist.get_context().tp_group.group_name
    if cuda and WS > 1:
        import torch.distributed._symmetric_memory as symm

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm.enable_symm_mem_for_group(name)
    warnings.filterwarnings("ignore", message=".*no tile-flag path.*")
    warnings.filterwarnings("ignore", message=".*no overlapped path.*")
    # the library makes no deprecated torch call (docs/guarantees.md); torch's own fallbacks may
    warnings.filterwarnings("error", category=FutureWarning, module="overlap")
    with torch.no_grad():
        dtypes = (torch.bfloat16, torch.float16) if cuda else (torch.float32, torch.bfloat16, torch.float16)
        for dt in dtypes:
            check_all_gather(dt, name)
            check_reduce_scatter(dt, name)
            check_all_reduce_lists(dt)
        check_bad(name)
    check_compiled(name)
    tdist.barrier()
    dist.shutdown()
    print(f"PASS compat rank={RANK} world={WS} device={DEV.type}", flush=True)


if __name__ == "__main__":
    main()
