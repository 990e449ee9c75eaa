"""The hot path's driver calls through ``ctypes`` (``overlap._driver``) on the CPU: stand-in
driver functions that take plain ints as the real ones do; a plan graph's copies in and
clones out and a bound body's zeroing and flag posts use them, and a failure raises an
error naming the call."""

from __future__ import annotations

import ctypes

import pytest
import torch

from overlap import _driver, flags
from overlap.ops import _graphs


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA (the driver paths' first look)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def _cuda_like(t: torch.Tensor) -> torch.Tensor:
    return torch.Tensor._make_subclass(_OnCuda, t)


def test_no_driver_library_on_this_machine_means_none() -> None:
    if _driver._load():
        pytest.skip("a CUDA driver library is installed here")
    assert _driver.memcpy_dtod() is None and _driver.memset_d32() is None and _driver.write_value32() is None
    assert _driver.wait_value32() is None


def test_check_names_the_call_and_the_code() -> None:
    _driver.check(0, "cuMemcpyDtoDAsync")  # success: nothing
    with pytest.raises(RuntimeError, match=r"cuMemsetD32Async failed with CUresult 700"):
        _driver.check(700, "cuMemsetD32Async")


def test_plan_graph_copies_take_plain_ints(monkeypatch) -> None:  # noqa: ANN001
    """The copy into a static input and the clone of an output: one ``cuMemcpyDtoDAsync``
    each with the pointers, byte count and raw stream as ints; a failed copy raises."""
    calls: list = []
    code = [0]

    def dtod(dst, src, n, raw):  # noqa: ANN001, ANN202
        assert all(type(v) is int for v in (dst, src, n, raw))
        calls.append(raw)
        if not code[0]:
            ctypes.memmove(dst, src, n)
        return code[0]

    monkeypatch.setattr(_driver, "memcpy_dtod", lambda: dtod)
    static = _cuda_like(torch.zeros(6, 8))
    copy = _graphs._copier(static)
    src = torch.randn(6, 8)
    assert copy(src, 3) and torch.equal(static, src) and calls == [3]
    assert not copy(torch.randn(8, 6).t(), 3) and calls == [3]  # not contiguous: copy_ does it
    out = _cuda_like(torch.randn(6, 4))
    a = _graphs._cloner(out)(4)
    assert torch.equal(a, out) and a.data_ptr() != out.data_ptr() and calls == [3, 4]
    code[0] = 700
    with pytest.raises(RuntimeError, match="cuMemcpyDtoDAsync failed with CUresult 700"):
        copy(torch.randn(6, 8), 3)
    with pytest.raises(RuntimeError, match="cuMemcpyDtoDAsync failed with CUresult 700"):
        _graphs._cloner(out)(4)


def test_bound_zero_and_post_take_plain_ints(monkeypatch) -> None:  # noqa: ANN001
    """A bound body's words zeroed with one ``cuMemsetD32Async`` and a flag posted with one
    ``cuStreamWriteValue32``: the word's address (the flag's element), the value, the raw
    stream; a failure raises naming the call."""
    got: list = []
    code = [0]

    def memset(addr, value, n, raw):  # noqa: ANN001, ANN202
        got.append(("memset", addr, value, n, raw))
        return code[0]

    def write(raw, addr, value, fl):  # noqa: ANN001, ANN202
        got.append(("write", raw, addr, value, fl))
        return code[0]

    monkeypatch.setattr(_driver, "memset_d32", lambda: memset)
    monkeypatch.setattr(_driver, "write_value32", lambda: write)

    def wait(raw, addr, value, fl):  # noqa: ANN001, ANN202
        got.append(("wait", raw, addr, value, fl))
        return code[0]

    monkeypatch.setattr(_driver, "wait_value32", lambda: wait)
    words = _cuda_like(torch.zeros(8, dtype=torch.int32))
    zero = flags.bound_zero(words, 5)
    zero(11, None)
    assert got == [("memset", words.data_ptr(), 0, 5, 11)]
    stream = type("S", (), {"cuda_stream": 13})()
    post = flags.bound_write_value(stream, words, 3, -1)
    post()
    assert got[-1] == ("write", 13, words.data_ptr() + 12, 0xFFFFFFFF, 0)
    hold = flags.bound_wait_value(stream, words, 2, 7)
    hold()
    assert got[-1] == ("wait", 13, words.data_ptr() + 8, 7, 0)  # 0: CU_STREAM_WAIT_VALUE_GEQ
    with pytest.raises(ValueError, match="9 words asked of a tensor of 8"):
        flags.bound_zero(words, 9)
    code[0] = 1
    with pytest.raises(RuntimeError, match="cuMemsetD32Async failed"):
        zero(11, None)
    with pytest.raises(RuntimeError, match="cuStreamWriteValue32 failed"):
        post()
    with pytest.raises(RuntimeError, match="cuStreamWaitValue32 failed"):
        hold()
