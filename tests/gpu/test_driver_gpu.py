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
