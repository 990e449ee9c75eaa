"""Shared-GPU mode on a GPU: R ranks on one device (``OVERLAP_SHARED_GPU=1``, or more ranks
than GPUs), run by ``launch/shared_gpu.sh`` as ``bash launch/torchrun.sh R
tests/gpu/shared_gpu_check.py SECTION...``.

Sections (each test prints ``RESULT <name> <passed|failed> <seconds> <detail>`` on rank 0
and the script goes on to the next after a failure):

    ops         every op on the peer-copy transport against its ``*_ref``, inputs new on
                every call: all_gather_matmul (one weight, a list), all_reduce_matmul (plain,
                + residual with LayerNorm, RMSNorm), matmul_reduce_scatter,
                matmul_all_reduce (+ residual); back-to-back calls with per-call values;
                matmul_all_reduce_matmul (+ residual, the norms) as its two halves, and
                its transport='nccl' refused with the mode's error
    guarantees  a capture refused with a clear error and the op right afterwards; two
                streams; ranks that disagree (host check: ValueError; cached host check:
                the kernels' signature words, RanksDisagreeError); a late peer's timeout,
                then ``reset`` and correct calls
    layers      the overlap.nn checks (tests/_nn_worker.py) in bf16: forward and backward,
                sequence parallel and not, against one unsharded reference
    kill        the last rank dies mid-call: the survivors get FlagTimeoutError within the
                bound (under MPS, where the dead process faults every context on the GPU:
                GpuContextLostError naming the dead rank) and ``overlap.dist.shutdown`` returns
    refusals    for each op on the peer-copy transport, the last rank refuses a call (a 1-D
                input) that the others make right: at a new signature (the exchange: every
                rank raises, the next calls are right) and at one agreed before (the peers
                are in the data movement: PeerRefusedError on them naming the rank, within
                seconds, with check="sync" and, for all_gather_matmul, "async" (every row
                returned is right or NaN); the group ended on every rank until ``reset``,
                then right calls). Inputs new on every call

Times printed here are not performance figures: the ranks share one GPU.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as tdist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from overlap import dist  # noqa: E402
from overlap.flags import FlagTimeoutError, GpuContextLostError, PeerRefusedError, RanksDisagreeError, RanksRefusedError  # noqa: E402
from overlap.ops import (Norm, OverlapCaptureError, OverlapConfig, all_gather_matmul,  # noqa: E402
                         all_gather_matmul_ref, all_reduce_matmul, all_reduce_matmul_ref, check_errors,
                         matmul_all_reduce, matmul_all_reduce_matmul, matmul_all_reduce_matmul_ref,
                         matmul_all_reduce_ref, matmul_reduce_scatter,
                         matmul_reduce_scatter_ref, reset)
from overlap.ops import all_gather as agmod  # noqa: E402
from overlap.ops import all_reduce as armod  # noqa: E402
from overlap.ops import matmul_reduce as mrmod  # noqa: E402
from overlap.ops._agree import RanksOutOfStepError  # noqa: E402
from overlap.ops._runtime import get_runtime, resolve_group  # noqa: E402

BF16 = torch.bfloat16
CALLS = 4
"""Calls per case, each with new inputs (both buffer halves, twice)."""


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()


def close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 2e-2) -> None:
    e = rel(got, want)
    assert e < tol, f"{what}: relative error {e:.2e} >= {tol}"


def same_on_all(*shape: int, seed: int, dev: torch.device, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=dev, dtype=BF16) * scale


def mine(*shape: int, dev: torch.device) -> torch.Tensor:
    return torch.randn(*shape, device=dev, dtype=BF16)


class Runner:
    def __init__(self, rank: int) -> None:
        self.rank, self.failed = rank, 0

    def __call__(self, name: str, fn: Callable[[], str]) -> None:
        t0 = time.time()
        try:
            detail, ok = fn(), True
        except Exception as e:  # noqa: BLE001 - reported, then the next test
            detail, ok = f"{type(e).__name__}: {e}".replace("\n", " ")[:400], False
            traceback.print_exc()
        took = time.time() - t0
        # every rank's verdict: a test passes only where it passed on every rank
        flag = torch.tensor([0 if ok else 1])
        try:
            tdist.all_reduce(flag)
        except Exception as e:  # noqa: BLE001
            detail += f"; the ranks could not compare verdicts: {e}"
            flag[0] = 1
        if flag.item() and ok:
            detail = "failed on another rank"
        ok = ok and flag.item() == 0
        if not ok:
            self.failed += 1
            try:
                torch.cuda.synchronize()
                reset()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
        if self.rank == 0:
            print(f"RESULT {name} {'passed' if ok else 'failed'} {took:.1f} {detail}", flush=True)


# --------------------------------------------------------------------------------------
# ops
# --------------------------------------------------------------------------------------


def t_agmm(rank: int, world: int, dev: torch.device) -> str:
    n, k = 768, 512
    stats0 = agmod.stats["p2p"]
    for chunks, ms in ((2, 512), (3, 1000)):  # uneven: partial tiles and chunks
        cfg = OverlapConfig(chunks=chunks, check="sync")
        for it in range(CALLS):
            a = mine(ms, k, dev=dev)
            b = same_on_all(n, k, seed=10 + it, dev=dev, scale=k ** -0.5).t()
            c, g = all_gather_matmul(a, b, return_gathered=True, config=cfg)
            c_ref, g_ref = all_gather_matmul_ref(a, b, return_gathered=True)
            assert torch.equal(g, g_ref), f"gathered rows differ (chunks {chunks}, call {it})"
            close(c, c_ref, f"chunks {chunks} call {it}")
    got = agmod.stats["p2p"] - stats0
    assert got >= 2 * CALLS, f"only {got} calls took the peer-copy path"
    return f"{got} peer-copy calls"


def t_agmm_list(rank: int, world: int, dev: torch.device) -> str:
    k = 512
    many0 = agmod.stats["many"]
    cfg = OverlapConfig(chunks=2, check="sync")
    for it in range(CALLS):
        a = mine(384, k, dev=dev)
        bs = [same_on_all(n, k, seed=20 + n + it, dev=dev, scale=k ** -0.5).t() for n in (512, 256, 256)]
        cs = all_gather_matmul(a, bs, config=cfg)
        refs = all_gather_matmul_ref(a, bs)
        for i, (c, r) in enumerate(zip(cs, refs)):
            close(c, r, f"weight {i} call {it}")
    assert agmod.stats["many"] - many0 >= CALLS, agmod.stats
    # all_reduce_matmul with a list: its one grid runs on NCCL, so here the widest weight's
    # GEMM on the peer-copy transport and the others after it (default config and chunks=2)
    widest0 = armod.stats["many_widest"]
    for cfg in (None, OverlapConfig(chunks=2, check="sync")):
        for it in range(CALLS):
            x = mine(512, k, dev=dev)
            res = same_on_all(512, k, seed=25 + it, dev=dev)
            bs = [same_on_all(n, k, seed=26 + n + it, dev=dev, scale=k ** -0.5).t() for n in (256, 512)]
            norm = Norm("rmsnorm", same_on_all(k, seed=27 + it, dev=dev) * 0.1 + 1, None, 1e-5)
            cs, h = all_reduce_matmul(x, bs, residual=res, norm=norm, config=cfg)
            for i, (c, w) in enumerate(zip(cs, bs)):
                c_ref, h_ref = all_reduce_matmul_ref(x, w, residual=res, norm=norm)
                close(c, c_ref, f"armm list weight {i} call {it}")
            close(h, h_ref, f"armm list h call {it}")
    assert armod.stats["many_widest"] - widest0 >= 2 * CALLS, armod.stats
    return "all_gather_matmul: 3 weights as one grid; all_reduce_matmul: 2 weights, the widest on p2p"


def t_armm(rank: int, world: int, dev: torch.device) -> str:
    m, n, k = 1024, 512, 512
    p0 = armod.stats.get("p2p", 0)
    out = []
    for norm_kind in (None, "layernorm", "rmsnorm"):
        cfg = OverlapConfig(chunks=2, check="sync")
        for it in range(CALLS):
            x = mine(m, k, dev=dev)
            b = same_on_all(n, k, seed=30 + it, dev=dev, scale=k ** -0.5).t()
            res = same_on_all(m, k, seed=40 + it, dev=dev) if norm_kind else None
            norm = None
            if norm_kind:
                w = same_on_all(k, seed=50 + it, dev=dev) * 0.1 + 1
                bias = same_on_all(k, seed=60 + it, dev=dev) * 0.1 if norm_kind == "layernorm" else None
                norm = Norm(norm_kind, w, bias, 1e-5)
            c, h = all_reduce_matmul(x, b, residual=res, norm=norm, config=cfg)
            c_ref, h_ref = all_reduce_matmul_ref(x, b, residual=res, norm=norm)
            close(h, h_ref, f"h ({norm_kind}, call {it})")
            close(c, c_ref, f"c ({norm_kind}, call {it})")
        out.append(str(norm_kind))
    got = armod.stats.get("p2p", 0) - p0
    assert got >= 3 * CALLS, f"only {got} calls took the peer-copy path ({armod.stats})"
    return f"norms {out}, residual with the norms; {got} peer-copy calls"


def t_producers(rank: int, world: int, dev: torch.device) -> str:
    m, n, k = 1024, 512, 512 * world
    ks = k // world
    p0 = mrmod.stats["p2p"]
    for chunks in (1, 2, 3):
        cfg = OverlapConfig(chunks=chunks, check="sync")
        for it in range(CALLS):
            a = mine(m, ks, dev=dev)
            b = same_on_all(ks, n, seed=70 + rank + it, dev=dev, scale=k ** -0.5)
            res = same_on_all(m, n, seed=80 + it, dev=dev)
            close(matmul_reduce_scatter(a, b, config=cfg), matmul_reduce_scatter_ref(a, b), f"rs x{chunks} {it}")
            close(matmul_all_reduce(a, b, residual=res, config=cfg), matmul_all_reduce_ref(a, b, residual=res),
                  f"ar x{chunks} {it}")
    got = mrmod.stats["p2p"] - p0
    assert got >= 6 * CALLS, f"only {got} calls took the peer-copy path ({mrmod.stats})"
    return f"reduce-scatter and all-reduce (+ residual), chunks 1-3; {got} peer-copy calls"


def t_back_to_back(rank: int, world: int, dev: torch.device) -> str:
    """60 calls of each consumer op queued with no host sync, each with its own values
    (identity weights: the output is the gathered / summed input), checked at the end."""
    k = 256
    eye = torch.eye(k, device=dev, dtype=BF16)
    cfg = OverlapConfig(chunks=2)
    outs = []
    torch.cuda.synchronize()
    t0 = time.time()
    for it in range(60):
        a = torch.full((256, k), float(it % 7 + 2 * rank), device=dev, dtype=BF16)
        a[it % 256] += 1
        outs.append((a, all_gather_matmul(a, eye, config=cfg), all_reduce_matmul(a, eye, config=cfg)[1]))
    torch.cuda.synchronize()
    per_call = (time.time() - t0) / 120 * 1e3
    for it, (a, c, h) in enumerate(outs):
        assert torch.equal(c, all_gather_matmul_ref(a, eye)), f"all-gather call {it} differs"
        want = all_reduce_matmul_ref(a, eye)[1]
        assert torch.equal(h, want), f"all-reduce call {it} differs"
    return f"60 x 2 ops, values new per call; {per_call:.1f} ms per call with the GPU shared (not a performance figure)"


def t_marm(rank: int, world: int, dev: torch.device) -> str:
    """matmul_all_reduce_matmul's pipeline runs on NCCL: in the mode it runs as
    matmul_all_reduce on the peer-copy transport, then norm(h) @ b_next; against its *_ref."""
    from overlap.ops import boundary as bmod

    m, n, n2, k = 1024, 512, 384, 512 * world
    ks = k // world
    s0, p0 = bmod.stats["shared_gpu"], mrmod.stats["p2p"]
    for norm_kind in (None, "layernorm", "rmsnorm"):
        for cfg in (None, OverlapConfig(chunks=2, check="sync")):
            for it in range(CALLS):
                a = mine(m, ks, dev=dev)
                b = same_on_all(n, ks, seed=94 + rank + it, dev=dev, scale=k ** -0.5).t()
                b_next = same_on_all(n2, n, seed=95 + it, dev=dev, scale=n ** -0.5).t()
                res = same_on_all(m, n, seed=96 + it, dev=dev) if norm_kind else None
                norm = None
                if norm_kind:
                    w = same_on_all(n, seed=97 + it, dev=dev) * 0.1 + 1
                    bias = same_on_all(n, seed=98 + it, dev=dev) * 0.1 if norm_kind == "layernorm" else None
                    norm = Norm(norm_kind, w, bias, 1e-5)
                c, h = matmul_all_reduce_matmul(a, b, b_next, residual=res, norm=norm, config=cfg)
                c_ref, h_ref = matmul_all_reduce_matmul_ref(a, b, b_next, residual=res, norm=norm)
                close(h, h_ref, f"h ({norm_kind}, {cfg}, call {it})")
                close(c, c_ref, f"c ({norm_kind}, {cfg}, call {it})")
    got, p2p = bmod.stats["shared_gpu"] - s0, mrmod.stats["p2p"] - p0
    assert got == 6 * CALLS and p2p >= 6 * CALLS, \
        f"{got} calls in two halves, {p2p} on the peer-copy path (want {6 * CALLS})"
    a = mine(512, 256, dev=dev)
    b = same_on_all(256, 256, seed=90, dev=dev).t()
    try:
        matmul_all_reduce_matmul(a, b, b, config=OverlapConfig(chunks=2, transport="nccl"))
    except (RuntimeError, ValueError) as e:
        assert "shared-GPU mode" in str(e), e
        return (f"{got} calls: matmul_all_reduce on p2p, then the norm and GEMM; transport='nccl' refused: "
                f"{str(e)[:60]}...")
    raise AssertionError("matmul_all_reduce_matmul ran transport='nccl' in shared-GPU mode")


# --------------------------------------------------------------------------------------
# guarantees
# --------------------------------------------------------------------------------------


def t_capture_refused(rank: int, world: int, dev: torch.device) -> str:
    cfg = OverlapConfig(chunks=2)
    a = mine(512, 512, dev=dev)
    b = same_on_all(512, 512, seed=91, dev=dev).t()
    all_gather_matmul(a, b, config=cfg)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    msg = ""
    try:
        with torch.cuda.graph(g):
            all_gather_matmul(a, b, config=cfg)
    except OverlapCaptureError as e:
        msg = str(e)
    assert "cannot be captured" in msg, f"no clear capture error: {msg!r}"
    for it in range(3):
        a.normal_()
        close(all_gather_matmul(a, b, config=cfg), all_gather_matmul_ref(a, b), f"after the refusal, call {it}")
    return f"{msg[:80]}...; right afterwards"


def t_streams(rank: int, world: int, dev: torch.device) -> str:
    from tests.gpu import safety2_check as s2

    s2.TRANSPORTS = ("p2p",)
    return s2.streams(rank, world, dev)


def t_disagree_host(rank: int, world: int, dev: torch.device) -> str:
    from tests.gpu import safety2_check as s2

    s2.TRANSPORTS = ("p2p",)
    return s2.disagree(rank, world, dev)


def t_disagree_signature(rank: int, world: int, dev: torch.device) -> str:
    """Both ranks ran both configs (the host's agreement check is cached for each); then
    they call with different chunks: the kernels compare the signature words."""
    a = mine(512, 512, dev=dev)
    b = same_on_all(512, 512, seed=92, dev=dev).t()
    cfgs = [OverlapConfig(chunks=2, check="sync", timeout_ms=20_000),
            OverlapConfig(chunks=4, check="sync", timeout_ms=20_000)]
    for cfg in cfgs:
        all_gather_matmul(a, b, config=cfg)
    torch.cuda.synchronize()
    tdist.barrier()
    err = None
    try:
        all_gather_matmul(a, b, config=cfgs[rank % 2])
    except RanksDisagreeError as e:
        err = e
    assert err is not None, "no RanksDisagreeError"
    assert "disagree" in str(err), err
    torch.cuda.synchronize()
    tdist.barrier()
    reset()
    for it in range(3):
        a.normal_()
        close(all_gather_matmul(a, b, config=cfgs[0]), all_gather_matmul_ref(a, b), f"after, call {it}")
    check_errors()
    return f"{str(err)[:90]}...; right afterwards"


def t_reset(rank: int, world: int, dev: torch.device) -> str:
    from tests.gpu import safety2_check as s2

    return s2.reset_after_timeout(rank, world, dev)


# --------------------------------------------------------------------------------------
# refusals: the last rank refuses a call the others make
# --------------------------------------------------------------------------------------


def _refusal_cases(rank: int, world: int,
                   dev: torch.device) -> dict[str, tuple[Callable[..., tuple], Callable, Callable]]:
    """Per op: (inputs for M rows, new values on every call; the op; its reference)."""
    k, n = 256, 256
    seed = [1000]

    def b_all() -> torch.Tensor:
        seed[0] += 1
        return same_on_all(n, k, seed=seed[0], dev=dev, scale=k ** -0.5).t()

    def b_mine() -> torch.Tensor:
        seed[0] += 1
        return same_on_all(k, n, seed=seed[0] + 7 * rank, dev=dev, scale=k ** -0.5)

    b_next = same_on_all(n, 128, seed=999, dev=dev, scale=n ** -0.5)
    k2 = 192  # matmul_all_reduce_matmul runs matmul_all_reduce here: a K of its own keeps its signatures
    # new to the group (at matmul_all_reduce's K, its row bucket was agreed by that op's case before,
    # and the refusal at "a new signature" came in band: 2026-12-04_1xH200_a6d2ccb)

    def b_mine2() -> torch.Tensor:
        seed[0] += 1
        return same_on_all(k2, n, seed=seed[0] + 7 * rank, dev=dev, scale=k2 ** -0.5)

    return {
        "all_gather_matmul": (lambda m: (mine(m, k, dev=dev), b_all()),
                              lambda a, b, cfg: all_gather_matmul(a, b, config=cfg), all_gather_matmul_ref),
        "all_reduce_matmul": (lambda m: (mine(m, k, dev=dev), b_all()),
                              lambda a, b, cfg: all_reduce_matmul(a, b, config=cfg)[0],
                              lambda a, b: all_reduce_matmul_ref(a, b)[0]),
        "matmul_reduce_scatter": (lambda m: (mine(m, k, dev=dev), b_mine()),
                                  lambda a, b, cfg: matmul_reduce_scatter(a, b, config=cfg), matmul_reduce_scatter_ref),
        "matmul_all_reduce": (lambda m: (mine(m, k, dev=dev), b_mine()),
                              lambda a, b, cfg: matmul_all_reduce(a, b, config=cfg), matmul_all_reduce_ref),
        # in this mode: matmul_all_reduce on the peer-copy transport, then the second GEMM
        "matmul_all_reduce_matmul": (lambda m: (mine(m, k2, dev=dev), b_mine2()),
                                     lambda a, b, cfg: matmul_all_reduce_matmul(a, b, b_next, config=cfg)[0],
                                     lambda a, b: matmul_all_reduce_matmul_ref(a, b, b_next)[0]),
    }


def _refused(fn: Callable[[], object], bad: bool, op: str, agreed: bool) -> tuple[str, float]:
    """Run ``fn``; the refusing rank must raise its own ValueError (a note on the in-band
    way where ``agreed``), the others RanksRefusedError naming it (PeerRefusedError where
    ``agreed``: the refusal came through peer memory). Returns (message, seconds)."""
    t0 = time.time()
    try:
        fn()
    except RanksRefusedError as e:
        took = time.time() - t0
        assert not bad, f"{op}: the refusing rank got {type(e).__name__}: {e}"
        assert isinstance(e, PeerRefusedError) == agreed, f"{op}: {type(e).__name__} (agreed: {agreed}): {e}"
        assert f"group rank {tdist.get_world_size() - 1}" in str(e), e
        return str(e), took
    except ValueError as e:
        took = time.time() - t0
        assert bad, f"{op}: a rank with good inputs got ValueError: {e}"
        notes = " ".join(getattr(e, "__notes__", []))
        assert ("peer memory" in notes) == agreed, f"{op}: notes {notes!r} (agreed: {agreed})"
        return str(e), took
    raise AssertionError(f"{op}: no error (refusing rank: {bad})")


def _right(op: str, fn: Callable, ref: Callable, mk: Callable, m: int, cfg: OverlapConfig, calls: int,
           tag: str) -> None:
    for it in range(calls):
        a, b = mk(m)
        close(fn(a, b, cfg), ref(a, b), f"{op} {tag}, call {it}")


def t_refusal(op: str) -> Callable[[int, int, torch.device], str]:
    def run(rank: int, world: int, dev: torch.device) -> str:
        mk, fn, ref = _refusal_cases(rank, world, dev)[op]
        bad = rank == world - 1
        cfg = OverlapConfig(chunks=2, check="sync", timeout_ms=20_000)
        m1, m2 = 384, 640  # row buckets 512 and 1024: signatures new to the group
        _right(op, fn, ref, mk, 256, cfg, 1, "warm")
        # a new signature: every rank is in the exchange
        a, b = mk(m1)
        msg_new, t_new = _refused(lambda: fn(a[0] if bad else a, b, cfg), bad, op, agreed=False)
        _right(op, fn, ref, mk, m1, cfg, 2, "after a refusal at a new signature")
        # agreed before: the peers are in the data movement
        a, b = mk(m1)
        msg, took = _refused(lambda: fn(a[0] if bad else a, b, cfg), bad, op, agreed=True)
        assert took < 15, f"{op}: the refusal at an agreed signature took {took:.1f} s"
        a, b = mk(m1)
        try:
            fn(a, b, cfg)
        except RanksOutOfStepError:
            pass
        else:
            raise AssertionError(f"{op}: the group was not ended after the in-band refusal")
        torch.cuda.synchronize()
        reset()
        _right(op, fn, ref, mk, m1, cfg, 3, "after the in-band refusal and reset")
        _right(op, fn, ref, mk, m2, cfg, 1, "after the in-band refusal and reset, a new signature")
        check_errors()
        return f"new: {t_new:.2f} s; agreed: {took:.2f} s: {msg[:150]}"
    return run


def t_refusal_async(rank: int, world: int, dev: torch.device) -> str:
    """all_gather_matmul with check="async": the peer's call returns (each row right or
    NaN, never a wrong value); check_errors raises PeerRefusedError and ends the group."""
    mk, fn, ref = _refusal_cases(rank, world, dev)["all_gather_matmul"]
    bad = rank == world - 1
    cfg = OverlapConfig(chunks=2, check="async", timeout_ms=20_000)
    m = 320
    _right("agmm async", fn, ref, mk, m, cfg, 2, "warm")
    torch.cuda.synchronize()
    a, b = mk(m)
    want = ref(a, b)  # on every rank (a collective), before the refused call
    torch.cuda.synchronize()
    t0 = time.time()
    detail = ""
    if bad:
        msg, _ = _refused(lambda: fn(a[0], b, cfg), True, "agmm async", agreed=True)
        detail = msg[:80]
    else:
        c = fn(a, b, cfg)
        try:
            check_errors(block=True)
        except PeerRefusedError as e:
            detail = str(e)[:120]
        else:
            raise AssertionError("check_errors raised nothing after an in-band refusal")
        rows_nan = torch.isnan(c).all(dim=1)
        rows_right = torch.isclose(c.float(), want.float(), rtol=2e-2, atol=2e-2).all(dim=1)
        assert bool((rows_nan | rows_right).all()), "a row neither right nor NaN"
        peer_rows = slice((world - 1) * m, world * m)
        assert bool(rows_nan[peer_rows].all()), "rows of the refusing rank are not NaN"
        detail = f"{int(rows_nan.sum())} NaN rows, the rest right; " + detail
    took = time.time() - t0
    assert took < 15, f"took {took:.1f} s"
    a, b = mk(m)
    try:
        fn(a, b, cfg)
    except RanksOutOfStepError:
        pass
    else:
        raise AssertionError("the group was not ended")
    torch.cuda.synchronize()
    reset()
    _right("agmm async", fn, ref, mk, m, cfg, 3, "after reset")
    torch.cuda.synchronize()
    check_errors()
    return f"{took:.2f} s; {detail}"


# --------------------------------------------------------------------------------------
# kill: the last rank dies mid-call
# --------------------------------------------------------------------------------------


DEAD_PUSH_CYCLES = 40_000_000_000
"""The dying rank's pushes wait behind a sleep this long (~20 s at 1.98 GHz), far past the
survivors' 3 s bound, so that they cannot land within it whatever becomes of a dead
process's queued work (under MPS that work belongs to the server, not the process)."""


def _call_state(done: torch.cuda.Event) -> str:
    """What became of a call that reported no timeout: done, running, or its context faulted
    (under MPS at 1e9b153: 'an illegal memory access' once the peer had died)."""
    try:
        return "the call completed" if done.query() else "the call is still running"
    except Exception as e:  # noqa: BLE001 - a sticky CUDA error: reported, the check goes on to shutdown
        return f"the survivor's CUDA context failed: {type(e).__name__}: {str(e).splitlines()[0]}"


def kill(rank: int, world: int, dev: torch.device) -> None:
    from tests.gpu._late import late_pushes

    a = mine(512, 512, dev=dev)
    b = same_on_all(512, 512, seed=93, dev=dev).t()
    cfg = OverlapConfig(chunks=2, timeout_ms=3000, check="async")
    all_gather_matmul(a, b, config=cfg)  # warm and agreed on every rank
    torch.cuda.synchronize()
    tdist.barrier()
    if rank == world - 1:
        with late_pushes(True, cycles=DEAD_PUSH_CYCLES):
            all_gather_matmul(a, b, config=cfg)  # queued, its pushes behind a long sleep
        os._exit(0)  # dies with its call in flight
    # under MPS (the launcher's daemon) a process that exits with work in flight faults every
    # context on the GPU (benchmarks/diag/mps_kill_diag.py): the survivors must say so, naming it
    mps = bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))
    want = GpuContextLostError if mps else FlagTimeoutError
    t0 = time.time()
    state, failed_before = "", False
    done: torch.cuda.Event | None = None
    try:
        all_gather_matmul(a, b, config=cfg)
        done = torch.cuda.Event()
        done.record()
    except Exception as e:  # noqa: BLE001 - under MPS the context can fail while the call is queued
        if not mps:
            raise
        state = f"the survivor's call raised {type(e).__name__}: {str(e).splitlines()[0]}"
    err: Exception | None = None
    while err is None and time.time() - t0 < 30:
        try:
            check_errors(block=False)
        except (FlagTimeoutError, GpuContextLostError) as e:
            err = e
            break
        if done is not None:
            state = _call_state(done)
        if "failed" in state or "raised" in state:
            if failed_before:  # check_errors had one more look after the context failed
                break
            failed_before = True
        time.sleep(0.01)
    took = time.time() - t0
    ok = isinstance(err, want) and took < 3.0 + 10.0
    if ok and isinstance(err, GpuContextLostError):
        ok = [p.rank for p in err.gone] == [world - 1] and f"rank {world - 1} (pid" in str(err)
    why = (f"{type(err).__name__} (wanted {want.__name__}): {str(err)[:240]}..." if err is not None else
           f"no {want.__name__} after {took:.1f} s; {state}")
    if rank == 0:  # before shutdown: a shutdown that hangs still leaves this line
        print(f"KILL error after {took:.1f} s: {why}", flush=True)
    t1 = time.time()
    dist.shutdown()
    took_down = time.time() - t1
    if rank == 0:
        verdict = "passed" if ok else "failed"
        print(f"RESULT kill_peer {verdict} {took + took_down:.1f} error after {took:.1f} s (bound 3 s): "
              f"{why}; shutdown returned in {took_down:.1f} s", flush=True)


def main() -> None:
    sections = sys.argv[1:] or ["ops", "guarantees"]
    if sections == ["layers"]:
        from tests import _nn_worker as w

        t0 = time.time()
        w.main(device="cuda", dtype="bfloat16", scale=16, compile_too=False)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"RESULT layers passed {time.time() - t0:.1f} forward and backward, sp and not", flush=True)
        return
    ctx = dist.init(timeout_s=10 if "kill" in sections else 60)  # shutdown waits this long for the dead rank
    world, rank = tdist.get_world_size(), tdist.get_rank()
    dev = ctx.device
    rt = get_runtime(resolve_group(None), dev)
    assert rt.p2p() is not None, f"peer memory unavailable: {rt.p2p_why}"
    assert ctx.shared_gpu and rt.shared_gpu, (ctx.shared_gpu, rt.shared_gpu)
    if rank == 0:
        print(f"MODE shared_gpu={ctx.shared_gpu} gpu_share={ctx.gpu_share} backend={ctx.backend} "
              f"device={dev} sms_per_rank={rt.num_sms}", flush=True)
    torch.manual_seed(1234 + rank)
    if "kill" in sections:
        kill(rank, world, dev)
        return
    run = Runner(rank)
    tests: dict[str, list[tuple[str, Callable[..., str]]]] = {
        "ops": [("all_gather_matmul", t_agmm), ("all_gather_matmul_weight_list", t_agmm_list),
                ("all_reduce_matmul_residual_norms", t_armm), ("matmul_reduce_scatter_and_all_reduce", t_producers),
                ("back_to_back", t_back_to_back), ("matmul_all_reduce_matmul", t_marm)],
        "guarantees": [("capture_refused", t_capture_refused), ("two_streams", t_streams),
                       ("disagree_host_check", t_disagree_host), ("disagree_signature_words", t_disagree_signature),
                       ("reset_after_timeout", t_reset)],
        "refusals": [(f"refusal_{op}", t_refusal(op)) for op in ("all_gather_matmul", "all_reduce_matmul",
                                                                  "matmul_reduce_scatter", "matmul_all_reduce",
                                                                  "matmul_all_reduce_matmul")]
        + [("refusal_all_gather_matmul_async", t_refusal_async)],
    }
    for sec in sections:
        for name, fn in tests[sec]:
            run(name, lambda fn=fn: fn(rank, world, dev))
            torch.cuda.synchronize()
            tdist.barrier()
    dist.shutdown()
    if rank == 0:
        print(f"DONE shared_gpu_check failed={run.failed}", flush=True)


if __name__ == "__main__":
    main()
