"""One rank of the gloo test that the ranks never get silently out of step (test_steps.py).

Every op on its reference path (the host-side checks and exchanges are the real ones):

    refusals     a bad input on one rank only (1-D, empty M, a/b dtypes, a bad norm, a
                 norm of another dtype, requires_grad, int16, not a tensor, an N-D dim):
                 that rank raises its own error, every other rank RanksRefusedError
                 naming it; every message names the op; the next calls are right
    dtypes       int16 / complex64 on every rank: refused as dtypes the ops do not take
    disagree     a LayerNorm eps, an N-D leading shape, a gather / scatter dim that differ
    before       a KeyboardInterrupt before the data all-gather on one rank: the group ends
                 with a clear error on every rank (no result), on a group of its own
    spent        a KeyboardInterrupt before the agreement on one rank: the next exchange
                 finds the counters apart on every rank; overlap.reset brings them back
    after        an exception after the collective on one rank: the peers' results are
                 right and the next calls too
    agreed       a refusal at a signature agreed before (the fast path's rule): the refusing
                 rank's exchange ends at the group's timeout and ends the group there
    threads      two threads per rank calling at once: no wrong result, only clear errors

Inputs change on every call. Prints ``PASS steps rank=<r>``.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as tdist

import overlap
from overlap import dist
from overlap.ops import (Norm, all_gather_matmul, all_reduce_matmul, matmul_all_reduce, matmul_all_reduce_matmul,
                         matmul_reduce_scatter)
from overlap.ops import all_gather as agmod
from overlap.ops._agree import RanksOutOfStepError, RanksRefusedError

K, N = 8, 6
RANK, WS = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
BAD = WS - 1  # the rank that refuses
_seed = [0]


def rnd(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Fresh values on every call, the same on every rank (the seed counts calls)."""
    _seed[0] += 1
    return torch.randn(*shape, generator=torch.Generator().manual_seed(_seed[0])).to(dtype)


def close(x: torch.Tensor, y: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")


def good(tag: str, group: Any = None) -> None:
    """Every op once, checked against torch on the unsharded data."""
    world = WS if group is None else tdist.get_world_size(group)
    me = RANK if group is None else tdist.get_rank(group)
    full = rnd(world * 4, K)
    w = rnd(N, K)
    close(all_gather_matmul(full[me * 4:(me + 1) * 4], w.t(), group=group), full @ w.t(), f"agmm after {tag}")
    parts = [rnd(6, K) for _ in range(world)]
    res, norm = rnd(6, K), Norm("layernorm", rnd(K), rnd(K), 1e-5)
    c, h = all_reduce_matmul(parts[me], w.t(), residual=res, norm=norm, group=group)
    close(h, sum(parts) + res, f"armm h after {tag}")
    close(c, norm.apply(sum(parts) + res) @ w.t(), f"armm after {tag}")
    a = [rnd(2 * world, K) for _ in range(world)]
    b = [rnd(K, N) for _ in range(world)]
    y = sum(x @ v for x, v in zip(a, b))
    close(matmul_reduce_scatter(a[me], b[me], group=group), y[2 * me:2 * me + 2], f"mrs after {tag}")
    close(matmul_all_reduce(a[me], b[me], group=group), y, f"mar after {tag}")
    b2 = rnd(N, 4)
    c2, h2 = matmul_all_reduce_matmul(a[me], b[me], b2, group=group)
    close(h2, y, f"boundary h after {tag}")
    close(c2, y @ b2, f"boundary after {tag}")


def expect(fn: Callable[[], Any], what: str, types: tuple[type, ...], *needles: str) -> str:
    try:
        fn()
    except types as e:
        msg = str(e)
        for s in needles:
            assert s in msg, f"{what}: {s!r} not in {type(e).__name__}: {msg}"
        return msg
    except BaseException as e:  # noqa: BLE001
        raise AssertionError(f"{what}: {type(e).__name__}: {e}") from e
    raise AssertionError(f"{what}: no error")


def refusals() -> None:
    """Each op with a bad input on rank BAD only; the others pass good ones."""
    bad = RANK == BAD
    # every rank draws the same tensors (the seeds count draws), then picks its own
    w, x4, x1, x0, k1, wh, r3 = rnd(N, K), rnd(4, K), rnd(K), rnd(0, K), rnd(K + 1), rnd(K).half(), rnd(3, K)
    x22, x2w, m_odd, m_ok, b_k1, b_k = rnd(2, 2, K), rnd(2, WS, K), rnd(2 * WS + 1, K), rnd(2 * WS, K), \
        rnd(K + 1, N), rnd(K, N)
    bn2, bn, wk, wn = rnd(N + 2, 3), rnd(N, 3), rnd(K), rnd(N)
    nrm = Norm("layernorm", rnd(K), rnd(K), 1e-5)
    grad = x4.clone().requires_grad_(True)
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("all_gather_matmul", lambda: all_gather_matmul(x1 if bad else x4, w.t())),
        ("all_gather_matmul", lambda: all_gather_matmul(x0 if bad else x4, w.t())),
        ("all_gather_matmul", lambda: all_gather_matmul(x4.double() if bad else x4, w.t())),
        ("all_gather_matmul", lambda: all_gather_matmul(grad if bad else x4, w.t())),
        ("all_gather_matmul", lambda: all_gather_matmul(x4.to(torch.int16) if bad else x4, w.t())),
        ("all_gather_matmul", lambda: all_gather_matmul("rows" if bad else x4, w.t())),
        ("all_gather_matmul", lambda: overlap.all_gather_matmul(x22, w.t(), gather_dim=5 if bad else 1)),
        ("all_reduce_matmul", lambda: all_reduce_matmul(x4, w.t(), norm=Norm("layernorm", k1) if bad else nrm)),
        ("all_reduce_matmul", lambda: all_reduce_matmul(x4, w.t(), norm=Norm("layernorm", wh) if bad else nrm)),
        ("all_reduce_matmul", lambda: all_reduce_matmul(x4, w.t(), residual=r3 if bad else None)),
        ("all_reduce_matmul", lambda: overlap.all_reduce_matmul(grad if bad else x4, w.t())),
        ("matmul_reduce_scatter", lambda: matmul_reduce_scatter(m_odd if bad else m_ok, b_k)),
        ("matmul_reduce_scatter", lambda: overlap.matmul_reduce_scatter(x2w, b_k, scatter_dim=-1 if bad else 1)),
        ("matmul_all_reduce", lambda: matmul_all_reduce(x4, b_k1 if bad else b_k)),
        ("matmul_all_reduce_matmul", lambda: matmul_all_reduce_matmul(x4, b_k, bn2 if bad else bn)),
        ("matmul_all_reduce_matmul", lambda: matmul_all_reduce_matmul(x4, b_k, bn, norm=Norm(
            "rmsnorm", wk if bad else wn))),
    ]
    for i, (op, fn) in enumerate(cases):
        what = f"refusal case {i} ({op})"
        if bad:
            msg = expect(fn, what, (ValueError, TypeError, RuntimeError), op)
            assert not isinstance(msg, RanksRefusedError), what
        else:
            msg = expect(fn, what, (RanksRefusedError,), op, f"group rank {BAD}")
        if i % 4 == 3:
            good(what)
    good("the refusals")


def dtypes() -> None:
    for dt in (torch.int16, torch.complex64):
        for op, fn in (("all_gather_matmul", lambda: all_gather_matmul(rnd(4, K).to(dt), rnd(K, N).to(dt))),
                       ("all_reduce_matmul", lambda: all_reduce_matmul(rnd(4, K).to(dt), rnd(K, N).to(dt))),
                       ("matmul_all_reduce", lambda: matmul_all_reduce(rnd(4, K).to(dt), rnd(K, N).to(dt)))):
            msg = expect(fn, f"{dt} on every rank", (TypeError,), op, str(dt), "float16, bfloat16")
            assert "disagree" not in msg, msg
    good("unsupported dtypes")


def disagree() -> None:
    w = rnd(N, K)
    eps = 1e-6 if RANK == BAD else 1e-5
    expect(lambda: all_reduce_matmul(rnd(4, K), w.t(), norm=Norm("layernorm", rnd(K), rnd(K), eps)), "eps",
           (ValueError,), "all_reduce_matmul", "disagree", f"group ranks [{BAD}]")
    # the same rows (8 per rank), another leading shape
    shape = (4, 2, K) if RANK == BAD else (2, 4, K)
    expect(lambda: overlap.all_gather_matmul(rnd(*shape), w.t(), gather_dim=1), "agmm leading shape",
           (ValueError,), "all_gather_matmul", "disagree", "leading shape")
    expect(lambda: overlap.all_gather_matmul(rnd(2, 2, K), w.t(), gather_dim=0 if RANK == BAD else 1),
           "agmm gather_dim", (ValueError,), "disagree", "gather_dim")
    expect(lambda: overlap.matmul_reduce_scatter(rnd(WS, WS, K), rnd(K, N), scatter_dim=0 if RANK == BAD else 1),
           "mrs scatter_dim", (ValueError,), "matmul_reduce_scatter", "disagree", "scatter_dim")
    expect(lambda: overlap.all_reduce_matmul(rnd(*((3, 2, K) if RANK == BAD else (2, 3, K))), w.t()),
           "armm leading shape", (ValueError,), "all_reduce_matmul", "disagree", "leading shape")
    # the same N-D call on every rank: right
    full = rnd(2, 4 * WS, K)
    c = overlap.all_gather_matmul(full[:, 4 * RANK:4 * RANK + 4], w.t(), gather_dim=1)
    close(c, full @ w.t(), "agmm N-D")
    good("the disagreements")


def before() -> None:
    """A KeyboardInterrupt on rank 0 between the agreement and its data all-gather, on a
    group of its own with a short timeout: rank 0 raises it, the peers' all-gather ends in
    RanksOutOfStepError (never a result), and every later call on that group raises
    RanksOutOfStepError on every rank before any collective."""
    grp = tdist.new_group(list(range(WS)), timeout=timedelta(seconds=3))
    good("a new group", grp)
    real = agmod.all_gather_single

    def interrupted(*a: Any, **kw: Any) -> Any:
        raise KeyboardInterrupt("injected before the data all-gather")

    full = rnd(WS * 4, K)
    w = rnd(N, K)
    if RANK == 0:
        agmod.all_gather_single = interrupted
        try:
            expect(lambda: all_gather_matmul(full[:4], w.t(), group=grp), "interrupted", (KeyboardInterrupt,))
        finally:
            agmod.all_gather_single = real
    else:
        expect(lambda: all_gather_matmul(full[RANK * 4:RANK * 4 + 4], w.t(), group=grp), "peer of the interrupt",
               (RanksOutOfStepError,), "all_gather_matmul", "ended")
    for _ in range(2):
        expect(lambda: all_gather_matmul(full[RANK * 4:RANK * 4 + 4], w.t(), group=grp), "after the interrupt",
               (RanksOutOfStepError,), "all_gather_matmul", "out of step")
    good("an ended group beside it")


def spent() -> None:
    """A KeyboardInterrupt on rank BAD before its agreement: the call is spent there, the
    next exchange finds the counters apart on every rank; reset brings the group back."""
    real = agmod._check_inputs

    def interrupted(*a: Any) -> None:
        raise KeyboardInterrupt("injected before the agreement")

    w, x = rnd(N, K), rnd(4, K)
    if RANK == BAD:
        agmod._check_inputs = interrupted
        try:
            expect(lambda: all_gather_matmul(x, w.t()), "spent", (KeyboardInterrupt,))
        finally:
            agmod._check_inputs = real
    # the peers' call below waits in its exchange: it meets this rank's next call's
    expect(lambda: all_gather_matmul(x, w.t()), "counters apart", (RanksOutOfStepError,),
           "all_gather_matmul", "out of step")
    expect(lambda: all_reduce_matmul(x, w.t()), "ended", (RanksOutOfStepError,), "all_reduce_matmul", "reset")
    overlap.reset()
    good("reset")


def after() -> None:
    """An exception on rank 0 after its data all-gather (the call's last collective): the
    peers' results are right, and so are the next calls everywhere."""

    class Failing(dict):
        def __setitem__(self, key: str, value: int) -> None:
            raise RuntimeError("injected after the all-gather")

    full = rnd(WS * 4, K)
    w = rnd(N, K)
    call = lambda: all_gather_matmul(full[RANK * 4:RANK * 4 + 4], w.t())  # noqa: E731
    if RANK == 0:
        real, agmod.stats = agmod.stats, Failing(agmod.stats)
        try:
            expect(call, "after", (RuntimeError,), "injected", "all_gather_matmul")
        finally:
            agmod.stats = real
    else:
        close(call(), full @ w.t(), "peer of the failure after the collective")
    good("an exception after the collective")


def agreed() -> None:
    """A refusal at a signature agreed before, with the fast path's rule (no exchange for
    an agreed key), on a group of its own with a short timeout: the peers go on without an
    exchange (on a GPU their flag waits would time out); the refusing rank's exchange ends
    at the group's timeout in RanksOutOfStepError, and the group is ended there."""
    from overlap.ops._agree import group_call
    from overlap.ops._runtime import Runtime, check_agree
    from tests.ops._cpu_runtime import cuda_stand_ins

    grp = tdist.new_group(list(range(WS)), timeout=timedelta(seconds=3))
    with cuda_stand_ins():
        rt = Runtime(grp, tuple(range(WS)), RANK, torch.device("cpu"))

    @group_call("toy", opens_p2p=False)
    def toy(x: torch.Tensor, *, group: Any = None) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError("toy: x must be 2-D")
        check_agree(rt, "toy", ("M", "K"), tuple(x.shape))
        return x

    toy(rnd(4, K), group=grp)  # the signature agreed: an exchange on every rank
    x = rnd(4, K)
    if RANK == BAD:
        expect(lambda: toy(x[0], group=grp), "refusal at an agreed signature", (RanksOutOfStepError,), "toy",
               "agreement exchange", "ended")
        expect(lambda: toy(x, group=grp), "after it", (RanksOutOfStepError,), "toy", "out of step")
    else:
        assert toy(x, group=grp) is x  # no exchange: the peers cannot learn of the refusal here
    good("a refusal at an agreed signature beside it")


def threads() -> None:
    """Two threads per rank calling all_gather_matmul at once, 12 calls each, the same
    shapes: every result that comes back is right; the rest are clear errors."""
    wrong: list[str] = []
    seen: dict[str, int] = {}
    lock = threading.Lock()

    def work(t: int) -> None:
        for i in range(12):
            g = torch.Generator().manual_seed(10_000 + 100 * t + i)  # the same on every rank
            full, w = torch.randn(WS * 4, K, generator=g), torch.randn(N, K, generator=g)
            try:
                c = all_gather_matmul(full[RANK * 4:RANK * 4 + 4], w.t())
            except (ValueError, RanksOutOfStepError) as e:
                with lock:
                    key = type(e).__name__ + (": thread" if "thread" in str(e) else "")
                    seen[key] = seen.get(key, 0) + 1
                continue
            if not torch.allclose(c, full @ w.t(), rtol=1e-4, atol=1e-4):
                wrong.append(f"thread {t} call {i}")
            with lock:
                seen["right"] = seen.get("right", 0) + 1

    ts = [threading.Thread(target=work, args=(t,), name=f"caller-{t}") for t in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts), "a thread did not finish"
    assert not wrong, f"wrong results: {wrong} ({seen})"
    assert "RanksOutOfStepError" not in seen, seen
    print(f"rank {RANK}: two threads: {seen}", flush=True)
    good("two threads")


def main() -> None:
    dist.init(timeout_s=30)
    warnings.filterwarnings("ignore", message=".*no tile-flag path.*")
    good("start")
    only = sys.argv[1:]  # case names to run (default: all)
    for case in (refusals, dtypes, disagree, before, spent, after, agreed, threads):
        if not only or case.__name__ in only:
            case()
    print(f"PASS steps rank={RANK}", flush=True)
    dist.shutdown()


if __name__ == "__main__":
    main()
