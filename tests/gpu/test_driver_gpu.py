"""The hot path's driver calls through ctypes (``overlap._driver``) on a GPU: each does what
its cuda-bindings or torch counterpart does, in stream order."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
def test_driver_calls_in_stream_order() -> None:
    from overlap import _driver, flags

    assert _driver.memcpy_dtod() is not None, "no driver library loaded on a GPU machine"
    s = torch.cuda.Stream()
    src = torch.randn(333, 17, device="cuda")
    dst = torch.zeros_like(src)
    words = torch.full((8,), 7, dtype=torch.int32, device="cuda")
    want = src * 2
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)  # the calls below must queue behind this, not run at once
        src.mul_(2)
    _driver.check(_driver.memcpy_dtod()(dst.data_ptr(), src.data_ptr(), src.numel() * 4, s.cuda_stream),
                  "cuMemcpyDtoDAsync")
    flags.bound_zero(words, 5)(s.cuda_stream, s)
    flags.bound_write_value(s, words, 6, -3)()
    torch.cuda.synchronize()
    assert torch.equal(dst, want), "the copy did not run after the stream's earlier work"
    assert words.tolist() == [0, 0, 0, 0, 0, 7, -3, 7]
    # a wait on one stream released by a post on another, queued later behind a sleep
    flag = torch.zeros(4, dtype=torch.int32, device="cuda")
    out = torch.zeros(4, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    flags.bound_wait_value(s2, flag, 1, 1)()
    with torch.cuda.stream(s2):
        out.fill_(5.0)
    with torch.cuda.stream(s1):
        torch.cuda._sleep(20_000_000)
        out.fill_(1.0)
    flags.bound_write_value(s1, flag, 1, 1)()
    torch.cuda.synchronize()
    assert out.tolist() == [5.0] * 4, "the waiting stream's work ran before the post released it"


@pytest.mark.gpu
def test_graph_memcpy_nodes_repointed_per_launch() -> None:
    """``_graph_nodes`` on a real graph: copies captured as memcpy nodes are found, each
    launch of the executable graph reads the sources and writes the destinations its nodes
    were last pointed at (launches queued before an update keep theirs), new values every
    launch; ``restore`` points the nodes back at the placeholders (after an update to
    pinned host memory, whose code is printed)."""
    import time

    from overlap.ops import _graph_nodes

    assert _graph_nodes.usable(torch.device("cuda", 0), torch.cuda), "no graph calls in the driver"
    s = torch.cuda.Stream()
    w = torch.randn(64, 32, device="cuda")
    ph, static, ob = (torch.zeros(48, 64, device="cuda") for _ in range(3))
    g = _graph_nodes.new_graph(torch.cuda)
    assert g is not None, "this torch cannot keep a graph after its capture"
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        static @ w  # (cuBLAS's handle and workspace made before the capture, which cannot)
        g.capture_begin(capture_error_mode="thread_local")
        _graph_nodes.capture_copy(static, ph, s)
        out = static @ w
        obuf = torch.empty_like(out)
        _graph_nodes.capture_copy(obuf, out, s)
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    g.instantiate()
    nd = _graph_nodes.bind(g, [(0, static, ph)], [(out, obuf)], False)
    assert nd is not None, "the captured copies were not found among the graph's memcpy nodes"
    raw = torch.cuda.current_stream().cuda_stream
    kept = []
    for it in range(5):
        x = torch.randn(48, 64, device="cuda")
        if it == 1:
            torch.cuda._sleep(50_000_000)  # the launches after this one are queued behind it
        got = nd.call((x,), raw)
        kept.append((got, x @ w))
    torch.cuda.synchronize()
    for it, (got, want) in enumerate(kept):
        torch.testing.assert_close(got, want, msg=f"launch {it} read or wrote another call's tensors")
    assert len({got.data_ptr() for got, _ in kept}) == 5
    # behind a busy GPU the updates and launch queue, they do not wait for the launches before
    x0 = torch.randn(48, 64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    t0 = time.perf_counter()
    for _ in range(3):
        nd.call((x0,), raw)
    busy_us = (time.perf_counter() - t0) / 3 * 1e6
    torch.cuda.synchronize()
    print(f"nodes behind a busy GPU: {busy_us:.1f} us per call")
    assert busy_us < 5000, f"a node update or launch waited for the GPU ({busy_us:.0f} us per call)"
    torch.testing.assert_close(nd.call((x0,), raw), x0 @ w)
    # a broadcast input goes through the placeholder
    row = torch.randn(64, device="cuda")
    got = nd.call((row.expand(48, 64),), raw)
    torch.testing.assert_close(got, row.expand(48, 64) @ w)
    # an update to pinned host memory (taken or not: its code printed), then the placeholders back
    host = torch.randn(48, 64).pin_memory()
    prm = nd.ins[0][2]
    prm.srcDevice = host.data_ptr()
    code = nd.setp(nd.exec, nd.ins[0][1], nd.ins[0][3], nd.ctx)
    assert nd.restore(), "the nodes could not be pointed back at their placeholders"
    print(f"update to pinned host memory: CUresult {code}")
    # host time per call: node updates + launch, against torch's replay of the same graph
    x = torch.randn(48, 64, device="cuda")
    # (torch's replay first: the nodes still read and write the placeholders, not a freed output)
    for name, fn in (("torch replay", g.replay), ("nodes", lambda: nd.call((x,), raw))):
        t = []
        for _ in range(200):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        print(f"{name}: {sorted(t)[100] * 1e6:.1f} us per call")
    del g
