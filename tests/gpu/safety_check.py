"""The "safe in production" guarantees on one GPU (one process; see test_safety_gpu.py).

Each check prints ``PASS <name> ...`` or ``FAIL <name>: ...`` and the script exits 1 if
any failed. Inputs change on every call and every replay (a tile that read before its
rows were written would read the last call's data and fail).

    graph_chain      mlp_chain (RowSync and TileSync) captured in a CUDA graph and replayed
                     with new inputs every replay, eager calls before, between and after
    streams_chain    the chain on two streams at once
    threads_chain    the chain from two threads, each on its own stream
    failure_chain    an exception at each host-side point of a call (a bad wait bound from
                     the environment, the producer's launch, the consumer's launch), then
                     correct calls
    replay_timeout   a timeout inside a replay surfaces in ``check_errors`` and the next
                     eager call is correct; the calls that timed out returned NaN
    graph_agmm       all_gather_matmul at world size 1 (NCCL transport) captured and replayed
    graph_armm       all_reduce_matmul (+ residual, LayerNorm) at world size 1 captured and replayed
    capture_unwarmed a capture of a shape never run eagerly raises OverlapCaptureError
    sig_kernels      the peer-copy signature check of the tile GEMM and the reduce kernel
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import overlap  # noqa: E402
from overlap import flags as fl  # noqa: E402
from overlap.ops import chain as chmod  # noqa: E402
from overlap.ops import ChainConfig, OverlapConfig, Norm  # noqa: E402
from overlap.ops._runtime import OverlapCaptureError, check_errors  # noqa: E402

DEV = torch.device("cuda", 0)
TOL = {torch.float16: 2e-2, torch.bfloat16: 4e-2}


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()


def chain_ref(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x.float() @ w1.float()) @ w2.float()


def operands(m: int, k: int, f: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    w1 = (torch.randn(f, k, device=DEV, dtype=dtype) / k ** 0.5).t()  # nn.Linear layout, no copy
    w2 = (torch.randn(n, f, device=DEV, dtype=dtype) / f ** 0.5).t()
    return x, w1, w2


def check(name: str, fn: Callable[[], str]) -> bool:
    try:
        msg = fn()
    except Exception as e:  # noqa: BLE001 - every check reports
        traceback.print_exc()
        print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
        return False
    print(f"PASS {name} {msg}", flush=True)
    return True


def graph_chain() -> str:
    out = []
    for sync, replays in (("row", 1000), ("tile", 200)):
        m, k, f, n, dtype = 1000, 1024, 2048, 512, torch.float16
        x, w1, w2 = operands(m, k, f, n, dtype)
        cfg = ChainConfig(sync=sync)
        for _ in range(3):  # eager before: compiles, builds the tables
            x.normal_()
            y = chmod.mlp_chain(x, w1, w2, config=cfg)
            assert rel(y, chain_ref(x, w1, w2)) < TOL[dtype]
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y_static = chmod.mlp_chain(x, w1, w2, config=cfg)
        worst = 0.0
        t0 = time.perf_counter()
        for i in range(replays):
            x.normal_()
            if i % 100 == 7:
                w1.normal_().mul_(k ** -0.5)  # the weights change in place too
            g.replay()
            e = rel(y_static, chain_ref(x, w1, w2))
            worst = max(worst, e)
            assert e < TOL[dtype], f"{sync}: replay {i}: rel err {e}"
            if i % 100 == 50:  # eager calls between replays, inputs changing
                x2, _, _ = operands(m, k, f, n, dtype)
                e2 = rel(chmod.mlp_chain(x2, w1, w2, config=cfg), chain_ref(x2, w1, w2))
                assert e2 < TOL[dtype], f"{sync}: eager call between replays: rel err {e2}"
        check_errors()
        out.append(f"{sync}: {replays} replays, worst rel err {worst:.2e}, {time.perf_counter() - t0:.1f} s")
    return "; ".join(out)


def streams_chain() -> str:
    m, k, f, n, dtype = 2048, 1024, 4096, 1024, torch.bfloat16
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    a = operands(m, k, f, n, dtype)
    b = operands(m, k, f, n, dtype)
    worst = 0.0
    for i in range(20):
        a[0].normal_()
        b[0].normal_()
        torch.cuda.synchronize()
        with torch.cuda.stream(s1):
            ya = chmod.mlp_chain(*a)
        with torch.cuda.stream(s2):
            yb = chmod.mlp_chain(*b)
        torch.cuda.synchronize()
        ea, eb = rel(ya, chain_ref(*a)), rel(yb, chain_ref(*b))
        worst = max(worst, ea, eb)
        assert ea < TOL[dtype] and eb < TOL[dtype], f"iteration {i}: rel errs {ea}, {eb}"
    check_errors()
    return f"20 iterations on two streams, worst rel err {worst:.2e}"


def threads_chain() -> str:
    m, k, f, n, dtype = 1024, 1024, 2048, 1024, torch.float16
    errs: list[str] = []
    worst = [0.0]

    def work(seed: int) -> None:
        try:
            torch.manual_seed(seed)
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                ops = operands(m, k, f, n, dtype)
                for i in range(20):
                    ops[0].normal_()
                    y = chmod.mlp_chain(*ops)
                    e = rel(y, chain_ref(*ops))
                    worst[0] = max(worst[0], e)
                    if e >= TOL[dtype]:
                        errs.append(f"thread {seed} call {i}: rel err {e}")
        except Exception as e:  # noqa: BLE001
            errs.append(f"thread {seed}: {type(e).__name__}: {e}")

    ts = [threading.Thread(target=work, args=(s,)) for s in (1, 2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts), "a thread did not finish within 120 s"
    assert not errs, errs
    check_errors()
    return f"2 threads x 20 calls, worst rel err {worst[0]:.2e}"


def failure_chain() -> str:
    from overlap.kernels import tile_gemm

    m, k, f, n, dtype = 1024, 1024, 2048, 1024, torch.float16
    ops = operands(m, k, f, n, dtype)
    real = tile_gemm.launch_tile_gemm
    injected = []

    def failing(which: str) -> Callable[..., Any]:
        def launch(*a: Any, **kw: Any) -> Any:
            if (which == "consumer") == bool(kw.get("wait")):
                raise RuntimeError(f"injected failure at the {which}'s launch")
            return real(*a, **kw)
        return launch

    def calls_ok(tag: str) -> None:
        for i in range(5):
            ops[0].normal_()
            e = rel(chmod.mlp_chain(*ops), chain_ref(*ops))
            assert e < TOL[dtype], f"after {tag}: call {i}: rel err {e}"

    calls_ok("start")
    # a setting is read, and a launch made, when a call plan's fused body runs or its graph is
    # captured: with the plans cleared the next call takes the full path
    from overlap.ops._calls import clear_call_plans

    clear_call_plans()
    os.environ["OVERLAP_WAIT_TIMEOUT_MS"] = "inf"
    try:
        chmod.mlp_chain(*ops)
    except ValueError:
        injected.append("wait bound inf")
    finally:
        del os.environ["OVERLAP_WAIT_TIMEOUT_MS"]
    calls_ok("a bad wait bound")
    for which in ("producer", "consumer"):
        clear_call_plans()
        tile_gemm.launch_tile_gemm = failing(which)
        try:
            chmod.mlp_chain(*ops)
        except RuntimeError as e:
            assert "injected" in str(e), e
            injected.append(which)
        finally:
            tile_gemm.launch_tile_gemm = real
        calls_ok(f"a failed {which} launch")
    check_errors()
    assert injected == ["wait bound inf", "producer", "consumer"], injected
    return f"failures injected at {injected}; every later call correct"


def replay_timeout() -> str:
    m, k, f, n, dtype = 1024, 1024, 2048, 1024, torch.float16
    ops = operands(m, k, f, n, dtype)
    torch.cuda._sleep(1)  # load the delay kernel now, not while a kernel spins
    torch.cuda.synchronize()
    cfg = ChainConfig(timeout_ms=2.0, check="none")
    delay = 200_000_000  # ~100 ms of GPU cycles before the producer starts

    def late() -> torch.Tensor:
        # the consumer first (no start gate: with it the consumer would only start
        # once the late producer runs), the producer held back past the bound
        return chmod._mlp_chain(*ops, config=cfg, consumer_first=True, producer_delay_cycles=delay)

    out = late()
    torch.cuda.synchronize()
    # every consumer tile timed out or was skipped after the first timeout (the producer
    # starts ~100 ms after the 2 ms bound): NaN, not whatever the output's memory held
    assert torch.isnan(out).all(), f"a timed-out call returned {int((~torch.isnan(out)).sum())} non-NaN values"
    try:
        # non-blocking: the record comes from the pinned host words the kernel wrote
        check_errors(block=False)
        raise AssertionError("an eager timeout was not reported by check_errors")
    except fl.FlagTimeoutError as e:
        assert e.rank == 0 and e.expected > 0 and e.seen < e.expected and e.tile >= 0, (e.rank, e.expected, e.seen)
        first = str(e)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = late()
    out.fill_(7.0)
    g.replay()
    torch.cuda.synchronize()
    assert torch.isnan(out).all(), "a replay that timed out returned numbers"
    try:
        check_errors()
        raise AssertionError("a timeout inside a replay was not reported by check_errors")
    except fl.FlagTimeoutError as e:
        second = str(e)
    for i in range(3):
        ops[0].normal_()
        e = rel(chmod.mlp_chain(*ops), chain_ref(*ops))
        assert e < TOL[dtype], f"eager call {i} after the replay's timeout: rel err {e}"
    check_errors()
    return f"reported: {first[:80]}... / {second[:60]}..."


def _graph_op(name: str, make: Callable[[], tuple], call: Callable[..., Any], ref: Callable[..., Any],
              refill: Callable[[tuple], None], replays: int = 200) -> str:
    args = make()
    for _ in range(2):
        refill(args)
        out = call(*args)
        e = rel(out, ref(*args))
        assert e < 3e-2, f"eager: rel err {e}"
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_static = call(*args)
    worst = 0.0
    for i in range(replays):
        refill(args)
        g.replay()
        e = rel(out_static, ref(*args))
        worst = max(worst, e)
        assert e < 3e-2, f"replay {i}: rel err {e}"
        if i % 50 == 25:
            refill(args)
            e2 = rel(call(*args), ref(*args))
            assert e2 < 3e-2, f"eager call between replays: rel err {e2}"
    check_errors()
    return f"{replays} replays, worst rel err {worst:.2e}"


def graph_agmm() -> str:
    cfg = OverlapConfig(transport="nccl", chunks=2, nccl_ctas=8)

    def make() -> tuple:
        a = torch.randn(1024, 1024, device=DEV, dtype=torch.float16)
        b = (torch.randn(768, 1024, device=DEV, dtype=torch.float16) / 32).t()
        return a, b

    def refill(args: tuple) -> None:
        args[0].normal_()

    before = overlap.ops.all_gather.stats["fused"]
    msg = _graph_op("agmm", make, lambda a, b: overlap.ops.all_gather_matmul(a, b, config=cfg),
                    lambda a, b: a.float() @ b.float(), refill)
    assert overlap.ops.all_gather.stats["fused"] > before, "the fused path did not run"
    return msg


def graph_armm() -> str:
    cfg = OverlapConfig(transport="nccl", chunks=2, nccl_ctas=8)
    k = 1024

    def make() -> tuple:
        x = torch.randn(1024, k, device=DEV, dtype=torch.bfloat16)
        b = (torch.randn(512, k, device=DEV, dtype=torch.bfloat16) / 32).t()
        r = torch.randn(1024, k, device=DEV, dtype=torch.bfloat16)
        w = torch.rand(k, device=DEV, dtype=torch.bfloat16) + 0.5
        bias = torch.randn(k, device=DEV, dtype=torch.bfloat16)
        return x, b, r, w, bias

    def refill(args: tuple) -> None:
        args[0].normal_()
        args[2].normal_()

    def call(x, b, r, w, bias):  # noqa: ANN001, ANN202
        return overlap.ops.all_reduce_matmul(x, b, residual=r, norm=Norm("layernorm", w, bias, 1e-5), config=cfg)[0]

    def ref(x, b, r, w, bias):  # noqa: ANN001, ANN202
        h = x.float() + r.float()
        return torch.nn.functional.layer_norm(h, (k,), w.float(), bias.float(), 1e-5) @ b.float()

    before = overlap.ops.all_reduce.stats["fused"]
    msg = _graph_op("armm", make, call, ref, refill)
    assert overlap.ops.all_reduce.stats["fused"] > before, "the fused path did not run"
    return msg


def capture_unwarmed() -> str:
    ops = operands(640, 512, 1024, 256, torch.float16)  # a shape no call ran
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            chmod.mlp_chain(*ops)
    except OverlapCaptureError as e:
        msg = str(e)
    else:
        raise AssertionError("a capture of an unwarmed shape did not raise")
    torch.cuda.synchronize()
    # the op is still usable afterwards
    e = rel(chmod.mlp_chain(*ops), chain_ref(*ops))
    assert e < TOL[torch.float16], f"after the refused capture: rel err {e}"
    return f"raised: {msg[:90]}..."


def sig_kernels() -> str:
    """The peer-copy signature check of both kernels compiled and run on the GPU, with the
    peer's flags and signature words written locally: the same signature passes, another
    one records code 3, reported by the blocking and the non-blocking check alike."""
    from overlap.kernels.add_norm import ReducePlan
    from overlap.kernels.tile_gemm import launch_tile_gemm
    from overlap.policies import Segment, build_tile_table

    stride, epoch, sig = 512, 3, 0x1234567  # epoch 3: parity word stride - 2
    out = []
    a = torch.randn(256, 256, device=DEV, dtype=torch.bfloat16)
    peer = torch.randn(256, 256, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(256, 256, device=DEV, dtype=torch.bfloat16) / 16
    table = torch.tensor(build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=256),
                                           Segment(a_src=1, a_row=0, c_row=256, rows=256, wait_idx=stride)],
                                          256, 128, 256), dtype=torch.int32, device=DEV)
    for seen_sig, expect in ((sig, "ok"), (sig ^ 2, "disagree")):
        flags = torch.zeros(2 * stride, dtype=torch.int32, device=DEV)
        flags[stride] = epoch
        flags[stride + stride - 1 - (epoch & 1)] = seen_sig
        flags[stride + stride - 2 + (epoch & 1)] = 77  # the other parity's word: never read
        ew = fl.ErrorWord(DEV, what="sig gemm")
        c = torch.full((512, 256), 7.0, device=DEV, dtype=torch.bfloat16)  # finite: a skipped tile must store NaN
        launch_tile_gemm(a, b, c, table, a2=peer, flags=flags, err=ew.word, epoch=epoch, grid=8, wait=True,
                         timeout_ns=2_000_000_000, sig=(sig, stride))
        torch.cuda.synchronize()
        try:
            ew.check(block=False)
            got = "ok"
        except fl.RanksDisagreeError as e:
            assert (e.flag_idx, e.expected, e.seen) == (stride + stride - 2, sig, seen_sig), e
            got = "disagree"
        assert got == expect, (seen_sig, got)
        if got == "ok":
            ref = torch.cat([a, peer]).float() @ b.float()
            assert rel(c, ref) < 1e-2 and not torch.isnan(c).any()
        else:
            assert torch.isnan(c[256:]).all(), "a tile whose peer disagreed left C's values (not NaN)"
        ew.check(block=True)  # reported once, then cleared
    out.append("tile GEMM: same signature computes, another raises RanksDisagreeError")
    m, k, chunks = 512, 1024, 2
    starts = torch.tensor([0, 256, 512], dtype=torch.int32, device=DEV)
    for seen_sig, expect in ((sig, "ok"), (sig ^ 2, "disagree")):
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        recv = torch.randn(1, m, k, device=DEV, dtype=torch.bfloat16)
        h = torch.full_like(x, 7.0)  # finite: a skipped chunk must store NaN
        rflags = torch.zeros(stride, dtype=torch.int32, device=DEV)
        rflags[:chunks] = epoch
        rflags[stride - 1 - (epoch & 1)] = seen_sig
        ready = torch.zeros(chunks, dtype=torch.int32, device=DEV)
        ew = fl.ErrorWord(DEV, what="sig reduce")
        rp = ReducePlan(x, recv, h, starts=starts, rflags=rflags, ready=ready, err=ew.word, rank=0, world=2,
                        programs=4, flag_stride=stride, timeout_ns=2_000_000_000, sig=True)
        rp.launch(x, recv, h, epoch=epoch, sig=sig)
        torch.cuda.synchronize()
        try:
            ew.check(block=True)
            got = "ok"
        except fl.RanksDisagreeError:
            got = "disagree"
        assert got == expect, (seen_sig, got)
        assert ready.tolist() == [4] * chunks, ready  # posted either way: nothing waits in vain
        if got == "ok":
            assert rel(h, x.float() + recv[0].float()) < 1e-2
        else:
            assert torch.isnan(h).all(), "a chunk whose peer disagreed left h's values (not NaN)"
    out.append("reduce kernel: the same")
    return "; ".join(out)


def main() -> None:
    torch.manual_seed(0)
    ok = True
    for name, fn in (("graph_chain", graph_chain), ("streams_chain", streams_chain),
                     ("threads_chain", threads_chain), ("failure_chain", failure_chain),
                     ("replay_timeout", replay_timeout), ("capture_unwarmed", capture_unwarmed),
                     ("sig_kernels", sig_kernels)):
        ok &= check(name, fn)
    overlap.dist.init()
    try:
        for name, fn in (("graph_agmm", graph_agmm), ("graph_armm", graph_armm)):
            ok &= check(name, fn)
    finally:
        overlap.dist.shutdown()
    print("ALL PASS" if ok else "SOME FAILED", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
