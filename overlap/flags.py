"""Epoch flags on the device, posts and waits from a stream, and the error word.

A ``FlagArray`` is an int32 device tensor that is never reset. Each call of an
op takes the next epoch; a waiter needs ``flag >= epoch * mult``. A flag left
by an earlier call holds at most ``(epoch - 1) * mult`` and cannot satisfy it.

Stream-side posts and waits take no SM: ``cuStreamWriteValue32`` /
``cuStreamWaitValue32`` through cuda-python's ``cuda.bindings.driver``. The
write is ordered after all earlier work of its stream and carries a memory
barrier (no ``NO_MEMORY_BARRIER`` flag), so a GEMM tile that acquires the flag
sees the chunk NCCL wrote before it. Without cuda-bindings a one-element
``fill_`` on the stream does the same job at the cost of a tiny kernel (a
warning says so once).

The ``ErrorWord`` is where a kernel's bounded wait reports a timeout; the host
turns it into ``FlagTimeoutError``. Checking needs the device value, so
``check()`` either synchronizes (``block=True``) or looks at a copy queued on an
earlier call (``block=False``, free on the hot path).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

__all__ = ["FlagArray", "ErrorWord", "FlagTimeoutError", "FlagProtocolError", "stream_write_value",
           "stream_wait_value", "default_timeout_ms"]

_INT32_MAX = 2**31 - 1


def default_timeout_ms() -> float:
    """Bound of a tile's flag wait: ``OVERLAP_WAIT_TIMEOUT_MS`` or 500 ms."""
    v = os.environ.get("OVERLAP_WAIT_TIMEOUT_MS")
    if v is None:
        return 500.0
    try:
        out = float(v)
    except ValueError:
        raise ValueError(f"OVERLAP_WAIT_TIMEOUT_MS must be a number, got {v!r}") from None
    if out <= 0:
        raise ValueError(f"OVERLAP_WAIT_TIMEOUT_MS must be > 0, got {v!r}")
    return out


class FlagTimeoutError(RuntimeError):
    """A GEMM tile waited on a flag past its bound; the op's output is not valid."""

    def __init__(self, what: str, rank: int, flag_idx: int, expected: int, seen: int, tile: int) -> None:
        self.rank, self.flag_idx, self.expected, self.seen, self.tile = rank, flag_idx, expected, seen, tile
        super().__init__(
            f"{what}: rank {rank} timed out waiting on flag {flag_idx} (chunk/row block): expected >= {expected}, "
            f"saw {seen} (tile {tile}). A peer did not send, NCCL got no SMs, or the wait bound "
            f"(OVERLAP_WAIT_TIMEOUT_MS) is shorter than the skew between ranks."
        )


class FlagProtocolError(FlagTimeoutError):
    """A kernel saw a flag two or more calls ahead of its own epoch: the ranks fell out
    of step (a rank whose wait timed out ran on without waiting). The op's output is
    not valid, and neither are later calls until every rank rebuilds the op's state
    (``overlap.dist.shutdown`` and a new ``init``)."""

    def __init__(self, what: str, rank: int, flag_idx: int, expected: int, seen: int, tile: int) -> None:
        super().__init__(what, rank, flag_idx, expected, seen, tile)
        self.args = (f"{what}: rank {rank} saw flag {flag_idx} at {seen}, two or more calls ahead of the "
                     f"expected {expected} (tile {tile}): a peer ran on after an earlier failure and the ranks "
                     f"are out of step; the output is not valid",)

    def __str__(self) -> str:
        return str(self.args[0])


_driver: Any = None
_warned_fallback = False


def _cuda_driver() -> Any:
    global _driver
    if _driver is None:
        try:
            from cuda.bindings import driver  # type: ignore
        except Exception:
            try:
                from cuda import cuda as driver  # type: ignore  # older cuda-python
            except Exception:
                driver = False
        _driver = driver
    return _driver


def _warn_fallback() -> None:
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn("cuda-bindings not found: flag posts use a one-element fill kernel instead of "
                      "cuStreamWriteValue32 (pip install 'overlap[cu13]' or [cu12])", stacklevel=3)


def _check(res: Any, what: str) -> None:
    err = res[0] if isinstance(res, tuple) else res
    if int(err) != 0:
        raise RuntimeError(f"{what} failed with CUresult {int(err)} ({err})")


def stream_write_value(stream: torch.cuda.Stream, flags: torch.Tensor, idx: int, value: int) -> None:
    """Enqueue ``flags[idx] = value`` on ``stream`` after all its earlier work (no SM)."""
    drv = _cuda_driver()
    if drv:
        ptr = flags.data_ptr() + idx * 4
        _check(drv.cuStreamWriteValue32(drv.CUstream(stream.cuda_stream), drv.CUdeviceptr(ptr), value, 0),
               "cuStreamWriteValue32")
        return
    _warn_fallback()
    with torch.cuda.stream(stream):
        flags[idx : idx + 1].fill_(value)


def stream_wait_value(stream: torch.cuda.Stream, flags: torch.Tensor, idx: int, value: int) -> None:
    """Make ``stream`` wait until ``flags[idx] >= value`` (signed 32-bit compare; no SM)."""
    drv = _cuda_driver()
    if not drv:
        raise RuntimeError("stream_wait_value needs cuda-bindings: pip install 'overlap[cu13]' (or [cu12])")
    ptr = flags.data_ptr() + idx * 4
    _check(drv.cuStreamWaitValue32(drv.CUstream(stream.cuda_stream), drv.CUdeviceptr(ptr), value,
                                   drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
           "cuStreamWaitValue32")


class FlagArray:
    """``n`` int32 flags on ``device`` with a host-side epoch counter."""

    def __init__(self, n: int, device: torch.device | str) -> None:
        if n <= 0:
            raise ValueError(f"need at least one flag, got {n}")
        self.flags = torch.zeros(n, dtype=torch.int32, device=device)
        self.epoch = 0

    def __len__(self) -> int:
        return self.flags.numel()

    def next_epoch(self, max_mult: int = 1) -> int:
        """Epoch for the next call. Before ``epoch * max_mult`` would overflow
        int32 the flags are zeroed on the current stream (all earlier users of
        the flags are ordered before it on that stream) and counting restarts."""
        if (self.epoch + 3) * max(1, max_mult) > _INT32_MAX:  # waits compare with (epoch + 2) * mult
            self.flags.zero_()
            self.epoch = 0
        self.epoch += 1
        return self.epoch


class ErrorWord:
    """Device int32[8]: [code, rank, flag index, expected, seen, tile, 0, 0]."""

    def __init__(self, device: torch.device | str, what: str = "overlap op") -> None:
        self.word = torch.zeros(8, dtype=torch.int32, device=device)
        self.what = what
        dev = torch.device(device)
        self._host = torch.zeros(8, dtype=torch.int32, pin_memory=dev.type == "cuda")
        self._event: Any = None
        self._by_sm: Any = None  # the pinned words as a kernel argument (see snapshot)

    def snapshot(self) -> None:
        """Queue a copy of the word to host memory on the current stream (for ``check(block=False)``)."""
        if self.word.is_cuda:
            if self._event is not None and not self._event.query():
                return  # the last copy has not landed yet: one in flight is enough
            # stored by an SM, not a copy engine: on the p2p transport the copy
            # engines are busy with the op's rows and a memcpy here would wait for them
            if self._by_sm is None:
                self._by_sm = self._probe_by_sm()
            if self._by_sm is not False:
                try:
                    from .kernels.words import copy_words

                    copy_words(self.word, self._by_sm)
                except Exception as e:  # noqa: BLE001 - e.g. a driver that cannot map the pinned words
                    warnings.warn(f"error-word snapshot by a kernel failed ({e}); using a copy", stacklevel=2)
                    self._by_sm = False
            if self._by_sm is False:
                self._host.copy_(self.word, non_blocking=True)
            if self._event is None:
                self._event = torch.cuda.Event()
            self._event.record()

    def _probe_by_sm(self) -> Any:
        """The pinned words as a kernel argument, after one checked copy (synchronizes
        once); False (use a memcpy) where the kernel cannot store there."""
        try:
            from .kernels.words import HostWords, copy_words

            dst = HostWords(self._host)
            self._host.fill_(-1)
            copy_words(self.word, dst)
            torch.cuda.synchronize(self.word.device)
            if self._host.tolist() != self.word.tolist():
                raise RuntimeError("the pinned words did not receive the kernel's stores")
            return dst
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"error-word snapshot by a kernel unavailable ({e}); using a copy", stacklevel=3)
            return False

    def check(self, block: bool = True) -> None:
        """Raise ``FlagTimeoutError`` if a kernel recorded a timeout.

        ``block=True`` synchronizes on the current stream's work; ``block=False``
        reads the latest completed snapshot only (nothing if none completed).
        """
        if block or not self.word.is_cuda:
            vals = self.word.tolist()
        else:
            if self._event is None or not self._event.query():
                return
            vals = self._host.tolist()
        if vals[0] != 0:
            # A recorded timeout makes every later tile of every call skip its
            # work; once reported, clear it so the next call computes again.
            self.clear()
            cls = FlagProtocolError if vals[0] == 2 else FlagTimeoutError
            raise cls(self.what, vals[1], vals[2], vals[3], vals[4], vals[5])

    def clear(self) -> None:
        self.word.zero_()
        self._host.zero_()
        self._event = None
