"""overlap.observe on one GPU: CUDA-event phases read without waiting, the tile GEMM's
launch metadata through a Triton launch hook, mlp_chain's ranges and kernels in a
profiler trace, and the cost of the ranges when profiling is off."""

from __future__ import annotations

import inspect
import time
import timeit

import pytest
import torch

from overlap import observe

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _clean():
    was = observe.profile()
    observe.reset_report()
    yield
    observe.profile(was)
    observe.reset_report()


def test_event_timer_phases_and_hidden() -> None:
    """A serial call (comm-like copy, then a matmul) gives the alone-times; an overlapped
    one (the two on two streams) the op time; the report reads them once complete."""
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev, dtype=torch.float16)
    big = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(big)
    side = torch.cuda.Stream()
    cur = torch.cuda.current_stream()
    observe.profile(True)
    shape = (4096, 4096, 4096)
    for _ in range(3):
        tm = observe.timer("fake", shape, "serial", serial=True)
        tm.start("comm", cur)
        dst.copy_(big)
        tm.stop("comm", cur)
        tm.start("gemm", cur)
        a @ a
        tm.stop("gemm", cur)
        tm.commit()
        tm = observe.timer("fake", shape, "overlapped")
        tm.start("op", cur)
        side.wait_stream(cur)
        tm.start("comm", side)
        with torch.cuda.stream(side):
            dst.copy_(big)
        tm.stop("comm", side)
        a @ a
        cur.wait_stream(side)
        tm.stop("op", cur)
        tm.commit()
    torch.cuda.synchronize()
    rep = observe.report()
    assert rep.pending == 0
    t = {x["path"]: x for x in rep.rows[0]["timing"]}
    ov = t["overlapped"]
    assert ov["calls"] == 3 and ov["op_ms"] > 0 and ov["comm_alone_ms"] > 0 and ov["gemm_alone_ms"] > 0
    assert ov["hidden"] is not None and 0.0 <= ov["hidden"] <= 1.0
    print(rep)


def test_report_does_not_wait_on_running_work() -> None:
    """Events behind a long kernel stay pending; report() returns at once."""
    observe.profile(True)
    tm = observe.timer("fake", (1,), "p")
    tm.start("op")
    torch.cuda._sleep(int(2e9))  # about a second of GPU time
    tm.stop("op")
    tm.commit()
    t0 = time.perf_counter()
    rep = observe.report()
    assert time.perf_counter() - t0 < 0.1
    assert rep.pending == 1
    torch.cuda.synchronize()
    assert observe.report().pending == 0


def test_tile_gemm_launch_metadata_through_hook() -> None:
    from triton import knobs

    from overlap.kernels.tile_gemm import DEFAULT_CONFIG as cfg
    from overlap.kernels.tile_gemm import launch_tile_gemm
    from overlap.policies import Segment, build_tile_table

    m, n, k = 512, 512, 256
    dev = torch.device("cuda")
    a = torch.randn(m, k, device=dev, dtype=torch.float16)
    b = torch.randn(k, n, device=dev, dtype=torch.float16)
    c = torch.empty(m, n, device=dev, dtype=torch.float16)
    table = torch.tensor(build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, cfg.block_m, cfg.block_n),
                         dtype=torch.int32, device=dev)
    got: list[dict] = []

    def hook(md) -> None:
        got.append(md.get())

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
    try:
        launch_tile_gemm(a, b, c, table, grid=8)
        torch.cuda.synchronize()
    finally:
        if hasattr(chain, "remove"):
            chain.remove(hook)
        else:
            knobs.runtime.launch_enter_hook = chain
    torch.testing.assert_close(c, a @ b, rtol=2e-2, atol=2e-2)
    mds = [d for d in got if "tile_gemm" in d.get("name", "")]
    assert mds, got
    assert mds[-1]["flops16"] == 2.0 * m * n * k
    assert mds[-1]["bytes"] == 2 * (m * k + n * k + m * n)


def test_mlp_chain_ranges_and_kernels_in_trace() -> None:
    from overlap.ops import chain

    if "observe" not in inspect.getsource(chain):
        pytest.skip("mlp_chain does not call overlap.observe yet")
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda")
    x = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(1024, 2048, device=dev, dtype=torch.bfloat16) * 0.03
    w2 = torch.randn(2048, 1024, device=dev, dtype=torch.bfloat16) * 0.03
    for _ in range(2):
        chain.mlp_chain(x, w1, w2)
    torch.cuda.synchronize()
    observe.profile(True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            chain.mlp_chain(x, w1, w2)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any(n.startswith("overlap.mlp_chain[") for n in names), sorted(set(names))[:50]
    assert sum("tile_gemm" in n for n in names) >= 6, sorted(set(names))[:50]  # two grids a call
    rows = [r for r in observe.report().rows if r["op"] == "mlp_chain"]
    assert rows and rows[0]["calls"] >= 3


def test_noop_ranges_cost_under_a_microsecond() -> None:
    observe.profile(False)
    shape = (1024, 1024, 2048)

    def call() -> None:
        with observe.op_range("mlp_chain", "fused"):
            observe.record_call("mlp_chain", shape, "fused", "default config")

    n = 50000
    best = min(timeit.repeat(call, number=n, repeat=5, timer=time.process_time)) / n
    print(f"op_range + record_call, profiling off: {best * 1e9:.0f} ns")
    assert best < 1e-6
