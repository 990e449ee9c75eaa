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
turns it into ``FlagTimeoutError``. ``check()`` either synchronizes
(``block=True``) or reads a pinned host word that the failing kernel stores
its code into as well (``block=False``: a read of host memory on the hot path,
nothing queued on the GPU).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from . import protocol as P

__all__ = ["FlagArray", "ErrorWord", "FlagTimeoutError", "FlagProtocolError", "RanksDisagreeError",
           "RanksRefusedError", "PeerRefusedError", "GpuContextLostError", "refusal_hooks",
           "stream_write_value", "bound_write_value", "bound_zero", "bound_wait_value",
           "stream_wait_value", "default_timeout_ms", "wrap32"]


def wrap32(v: int) -> int:
    """``v`` modulo 2**32 as a signed int32: how flags, epochs and counts are compared.

    Every comparison of a flag with an epoch is ``(int32)(flag - expected) >= 0`` (the
    kernels' waits, and ``cuStreamWaitValue32``'s GEQ, which CUDA defines that way), so
    counts that wrap past 2**31 or 2**32 compare as they did before the wrap, as long as
    a waiter and its writer are less than 2**31 apart. No flag is ever zeroed on a wrap:
    a peer may already have written the next call's value."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def default_timeout_ms(group: Any = None) -> float:
    """Bound of a flag wait (and of shutdown's drain) where the op's config sets none, in ms.

    1. ``OVERLAP_WAIT_TIMEOUT_MS``, if set (a finite number > 0);
    2. else the timeout of ``overlap.dist.init``'s context (``DistContext.timeout_s``),
       which is also its process groups' timeout;
    3. else torch's default process-group timeout for ``group``'s backend (or the
       default group's; 30 min, NCCL's 10 min where torch sets one).

    Minutes, not milliseconds, by design: in a real job one rank regularly arrives
    seconds after its peers (a GC pause, a checkpoint write, a slow data loader), and a
    wait that expired then would fail a healthy job. A rank whose peer is dead still
    gets ``FlagTimeoutError`` within this bound, as NCCL's watchdog ends a collective
    after the process group's timeout. Tests and tuners that provoke timeouts pass a
    short ``timeout_ms`` of their own."""
    v = os.environ.get("OVERLAP_WAIT_TIMEOUT_MS")
    if v is not None:
        try:
            out = float(v)
        except ValueError:
            raise ValueError(f"OVERLAP_WAIT_TIMEOUT_MS must be a number, got {v!r}") from None
        if not (0 < out < float("inf")):  # nan and inf too: a wait must end
            raise ValueError(f"OVERLAP_WAIT_TIMEOUT_MS must be a finite number > 0, got {v!r}")
        return out
    from . import dist

    ctx = dist.get_context()
    if ctx is not None:
        return _finite_ms(float(ctx.timeout_s) * 1000.0, "overlap.dist context's timeout_s")
    return _finite_ms(_torch_default_timeout_s(group) * 1000.0, "torch's default process-group timeout")


def _finite_ms(ms: float, what: str) -> float:
    if not (0 < ms < float("inf")):
        raise ValueError(f"{what} must give a finite wait bound > 0, got {ms} ms")
    return ms


def _torch_default_timeout_s(group: Any) -> float:
    """torch's default timeout for ``group``'s backend (the default group's where
    ``group`` is None; gloo's where none is initialized), in seconds."""
    import torch.distributed as tdist
    from torch.distributed import constants

    backend = ""
    try:
        if tdist.is_available() and tdist.is_initialized():
            backend = str(tdist.get_backend(group)).lower()
    except Exception:  # noqa: BLE001 - a group this rank is not in: the generic default
        backend = ""
    nccl = getattr(constants, "default_pg_nccl_timeout", None)
    if backend == "nccl" and nccl is not None:
        return float(nccl.total_seconds())
    return float(constants.default_pg_timeout.total_seconds())


class FlagTimeoutError(RuntimeError):
    """A GEMM tile waited on a flag past its bound; the op's output is not valid."""

    def __init__(self, what: str, rank: int, flag_idx: int, expected: int, seen: int, tile: int) -> None:
        self.rank, self.flag_idx, self.expected, self.seen, self.tile = rank, flag_idx, expected, seen, tile
        super().__init__(
            f"{what}: rank {rank} timed out waiting on flag {flag_idx} (chunk/row block): expected >= {expected}, "
            f"saw {seen} ({'the stream gate before the GEMM grid' if tile < 0 else f'tile {tile}'}). A peer did not "
            f"send, NCCL got no SMs, or the wait bound "
            f"(OVERLAP_WAIT_TIMEOUT_MS) is shorter than the skew between ranks."
        )


class RanksDisagreeError(FlagTimeoutError):
    """A peer-copy op's kernel found that the peer whose rows it waited for made its call
    with another signature (shapes, dtype, chunks or config) than this rank: the ranks
    disagree. The output is not valid; the next calls are, once the ranks agree again."""

    def __init__(self, what: str, rank: int, flag_idx: int, expected: int, seen: int, tile: int) -> None:
        super().__init__(what, rank, flag_idx, expected, seen, tile)
        self.args = (f"{what}: rank {rank}: the peer that writes signature word {flag_idx} made this call with "
                     f"signature {seen & 0xFFFFFFFF:#010x}, this rank with {expected & 0xFFFFFFFF:#010x}: the ranks "
                     "disagree on the call's shapes, dtype or config (the same call must be made on every rank); "
                     "the output is not valid",)

    def __str__(self) -> str:
        return str(self.args[0])


class RanksRefusedError(ValueError):
    """Another rank of the group refused this call (its inputs or settings), so no rank ran it
    (``overlap.ops.RanksRefusedError``)."""


class PeerRefusedError(RanksDisagreeError, RanksRefusedError):
    """A peer refused a call of the group's ops at a signature the ranks had agreed before,
    while this rank's call was already in its data movement (the tile-flag path makes no
    exchange there): the peer wrote a refusal record where its signature word goes, and
    this rank's kernel found it after its wait (``overlap.ops._refusal``). The output is not
    valid; the group's ops are ended on every rank until ``overlap.reset(group)``.
    ``refuser``: the refusing group rank; ``calls``: the low 16 bits of the group's call
    counter there; ``kind``: its error's type; ``why``: its message where the store had it."""

    def __init__(self, what: str, rank: int, flag_idx: int, expected: int, seen: int, tile: int) -> None:
        FlagTimeoutError.__init__(self, what, rank, flag_idx, expected, seen, tile)
        self.what = what
        self.refuser, self.calls, self.kind = P.read_refusal(seen) or (-1, -1, "an error")
        self.why = ""
        self.args = (self._message(),)

    def _message(self) -> str:
        why = (f" ({self.why})" if self.why else
               f" (call {self.calls} mod 2**16 of the group's ops; {self.kind}: its message is in that rank's error)")
        return (f"{self.what}: rank {self.rank}: group rank {self.refuser} refused this call{why}. Its peers were "
                "already moving the call's data (a signature agreed before makes no exchange), so the refusal came "
                "through peer memory; no rank "
                "ran the call and the output is not valid. The group's ops are ended on every rank: call "
                "overlap.reset(group) on every rank to go on")

    def explain(self, why: str) -> None:
        """Add the refusing rank's own message (from the job's store)."""
        self.why = why
        self.args = (self._message(),)

    def __str__(self) -> str:
        return str(self.args[0])


class GpuContextLostError(RuntimeError):
    """Shared-GPU mode (``overlap.dist.shared``): this process's CUDA context failed with a
    sticky error while ranks share its GPU. Under MPS a rank that exits with GPU work in
    flight (killed, or crashed mid-call) faults every process on that GPU, so the
    survivors see this instead of ``FlagTimeoutError``; the message names the ranks on the
    GPU whose process has exited. ``gone``: those ranks' ``overlap.dist.shared.GpuPeer``.
    The context cannot be used again (``reset()`` cannot help): restart the job."""

    def __init__(self, message: str, gone: list[Any]) -> None:
        super().__init__(message)
        self.gone = gone


def _cuda_failure(e: BaseException) -> bool:
    """``e`` is a CUDA error raised by torch or cupy (a sticky one leaves the context unusable)."""
    return type(e).__name__ in ("AcceleratorError", "CUDARuntimeError", "CUDADriverError") or \
        "CUDA error" in str(e)


def _context_lost(what: str, e: BaseException) -> GpuContextLostError | None:
    """The ``GpuContextLostError`` for CUDA error ``e`` where ranks share this GPU, else None."""
    from .dist import shared

    if not shared.gpu_peers() or not _cuda_failure(e):
        return None
    gone = shared.gone_gpu_peers()
    cause = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return GpuContextLostError(shared.lost_context_message(what, cause, gone), gone)


_shared: Any = None  # overlap.dist.shared, once a check has asked for it

refusal_hooks: list[Any] = []
"""Called as ``hook(error_word, PeerRefusedError)`` before a refusal record is raised
(``overlap.ops._refusal`` ends the group there and adds the refusing rank's message)."""


class FlagProtocolError(FlagTimeoutError):
    """A kernel saw a flag two or more calls ahead of its own epoch: the ranks fell out
    of step (a rank whose wait timed out ran on without waiting). The op's output is
    not valid, and neither are later calls until every rank rebuilds the op's state
    (``overlap.dist.shutdown`` and a new ``init``)."""

    def __init__(self, what: str, rank: int, flag_idx: int, expected: int, seen: int, tile: int) -> None:
        super().__init__(what, rank, flag_idx, expected, seen, tile)
        self.args = (f"{what}: rank {rank} saw flag {flag_idx} at {seen}, two or more calls ahead of the "
                     f"expected {expected} ({'the stream gate before the GEMM grid' if tile < 0 else f'tile {tile}'}): "
                     f"a peer ran on after an earlier failure and the ranks "
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


_warm: set[int] = set()
"""Devices whose kernel forms of a post, a zeroing and a count wait (``kernels.post``) were
compiled and loaded outside any capture (``warm_kernel_forms``)."""


_cold: set[int] = set()
"""Devices whose warm-up failed (warned once; not tried again)."""

WARM_TIMEOUTS_NS = (10 ** 9, 1 << 40)
"""Wait bounds the gate is warmed with: one that fits an int32 and one that does not (the
ops' default bound, minutes in ns, is the second kind); Triton compiles a kernel for each."""


def warm_kernel_forms(device: torch.device) -> None:
    """Compile and load on ``device``, outside a capture, what a captured post, zeroing and
    count wait launch (``kernels.post``'s store, torch's int32 fill, ``kernels.gate``),
    queued on the current stream once per process; a capture on a device not warmed keeps
    the driver forms (a Triton compile or a first module load inside a capture is avoided).
    Called when an op's runtime is made; a no-op while capturing."""
    if device.type != "cuda" or device.index in _warm or device.index in _cold or not kernel_forms_wanted() \
            or not torch.cuda.is_available():
        return
    try:
        from .kernels.gate import launch_gate
        from .kernels.post import launch_post

        with torch.cuda.device(device):  # (a launch goes to the current device: this one)
            if capturing_now():
                return
            w = torch.zeros(32, dtype=torch.int32, device=device)
            launch_post(w, 0, 1)
            launch_post(w[1:], 0, 1)  # (a pointer off a 16-byte boundary: Triton's other specialization)
            w[2:4].zero_()
            for timeout_ns in WARM_TIMEOUTS_NS:  # (a bound past 2**31 ns is an int64: Triton's other kernel)
                launch_gate(w[16:], 0, 0, 1 << 30, w[24:], rank=0, timeout_ns=timeout_ns)
    except Exception as e:  # noqa: BLE001 - captures keep the driver forms
        _cold.add(device.index)
        warnings.warn(f"overlap: the kernel forms of a captured post could not be made ({type(e).__name__}: {e}); "
                      "captured calls post and wait with stream memory operations", stacklevel=2)
        return
    _warm.add(device.index)


def kernel_forms_wanted() -> bool:
    """``OVERLAP_GRAPH_KERNEL_POSTS`` is not ``0``: captures queue the kernel forms."""
    return os.environ.get("OVERLAP_GRAPH_KERNEL_POSTS", "1") != "0"


def capturing_now() -> bool:
    """The current stream is being captured into a CUDA graph."""
    cuda = torch.cuda
    return bool(cuda._initialized) and not cuda._is_in_bad_fork() and torch._C._cuda_isCurrentStreamCapturing()


def kernel_form(t: torch.Tensor) -> bool:
    """A post, zeroing or count wait on ``t`` queued now takes its kernel form: the current
    stream is being captured (the ops' side streams are captured with it) on a device
    whose kernel forms are warm (``warm_kernel_forms``)."""
    return t.is_cuda and t.device.index in _warm and capturing_now()


def stream_write_value(stream: torch.cuda.Stream, flags: torch.Tensor, idx: int, value: int) -> None:
    """Enqueue ``flags[idx] = value`` on ``stream`` after all its earlier work (no SM);
    while a graph is captured, one thread's release store (``kernels.post``: a kernel
    node costs a graph's launch less host time than a stream memory operation)."""
    if kernel_form(flags):
        from .kernels.post import launch_post

        with torch.cuda.stream(stream):
            launch_post(flags, idx, wrap32(value))
        return
    drv = _cuda_driver()
    if drv:
        ptr = flags.data_ptr() + idx * 4
        _check(drv.cuStreamWriteValue32(drv.CUstream(stream.cuda_stream), drv.CUdeviceptr(ptr),
                                        value & 0xFFFFFFFF, 0),
               "cuStreamWriteValue32")
        return
    _warn_fallback()
    with torch.cuda.stream(stream):
        flags[idx : idx + 1].fill_(wrap32(value))


def stream_zero(stream: torch.cuda.Stream, t: torch.Tensor, n: int) -> None:
    """Enqueue ``t[:n] = 0`` (int32) on ``stream``: one ``cuStreamWriteValue32`` for one
    word, else one ``cuMemsetD32Async``; while a graph is captured, a fill kernel."""
    if n <= 1:
        stream_write_value(stream, t, 0, 0)
        return
    if n > t.numel():
        raise ValueError(f"stream_zero: {n} words asked of a tensor of {t.numel()}")
    if kernel_form(t):  # a fill kernel: a kernel node costs a graph's launch less than a memset node
        with torch.cuda.stream(stream):
            t[:n].zero_()
        return
    drv = _cuda_driver()
    if drv:
        _check(drv.cuMemsetD32Async(drv.CUdeviceptr(t.data_ptr()), 0, n, drv.CUstream(stream.cuda_stream)),
               "cuMemsetD32Async")
        return
    _warn_fallback()
    with torch.cuda.stream(stream):
        t[:n].zero_()


def bound_write_value(stream: torch.cuda.Stream, flags: torch.Tensor, idx: int, value: int) -> Any:
    """``stream_write_value(stream, flags, idx, value)`` with its driver arguments made
    once (a call plan's flag post; ``stream`` a fixed side stream): a function of no
    arguments. Without cuda-bindings, or on CPU, it calls ``stream_write_value``."""
    from . import _driver

    fast = _driver.write_value32() if flags.is_cuda else None
    if fast is not None:  # plain ints through ctypes: no Python object per argument
        raw, addr, v32, check = stream.cuda_stream, flags.data_ptr() + idx * 4, value & 0xFFFFFFFF, _driver.check

        def post_fast() -> None:
            code = fast(raw, addr, v32, 0)
            if code:
                check(code, "cuStreamWriteValue32")
        return post_fast
    drv = _cuda_driver()
    if not drv or not flags.is_cuda:
        return lambda: stream_write_value(stream, flags, idx, value)
    fn, s, p, v = (drv.cuStreamWriteValue32, drv.CUstream(stream.cuda_stream),
                   drv.CUdeviceptr(flags.data_ptr() + idx * 4), value & 0xFFFFFFFF)

    def post() -> None:
        res = fn(s, p, v, 0)
        if int(res[0]):
            _check(res, "cuStreamWriteValue32")
    return post


def bound_zero(t: torch.Tensor, n: int) -> Any:
    """``stream_zero(stream, t, n)`` with its driver arguments made once (a call plan's
    words): a function of the stream's raw handle and the stream."""
    if n > t.numel():
        raise ValueError(f"stream_zero: {n} words asked of a tensor of {t.numel()}")
    from . import _driver

    fast = _driver.memset_d32() if t.is_cuda and n > 1 else None
    if fast is not None:  # plain ints through ctypes: no Python object per argument
        addr, check = t.data_ptr(), _driver.check

        def zero_fast(raw: int, stream: Any) -> None:
            code = fast(addr, 0, n, raw)
            if code:
                check(code, "cuMemsetD32Async")
        return zero_fast
    drv = _cuda_driver()
    if not drv or not t.is_cuda or n <= 1:
        return lambda raw, stream: stream_zero(stream, t, n)
    fn, mk, p = drv.cuMemsetD32Async, drv.CUstream, drv.CUdeviceptr(t.data_ptr())

    def zero(raw: int, stream: Any) -> None:
        res = fn(p, 0, n, mk(raw))
        if int(res[0]):
            _check(res, "cuMemsetD32Async")
    return zero


def stream_wait_value(stream: torch.cuda.Stream, flags: torch.Tensor, idx: int, value: int) -> None:
    """Make ``stream`` wait until ``flags[idx] >= value``, compared as
    ``(int32)(flags[idx] - value) >= 0`` (``wrap32``; no SM).

    Queue the work that sets the flag first. Until the wait is released, a host read of a
    GPU tensor queued on ``stream`` does not return, nor (with CUDA's lazy module loading) a
    kernel's first launch in the process queued on it: docs/design.md, "Order of queuing"."""
    drv = _cuda_driver()
    if not drv:
        raise RuntimeError("stream_wait_value needs cuda-bindings: pip install 'overlap[cu13]' (or [cu12])")
    ptr = flags.data_ptr() + idx * 4
    _check(drv.cuStreamWaitValue32(drv.CUstream(stream.cuda_stream), drv.CUdeviceptr(ptr), value & 0xFFFFFFFF,
                                   drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
           "cuStreamWaitValue32")


def bound_wait_value(stream: torch.cuda.Stream, flags: torch.Tensor, idx: int, value: int) -> Any:
    """``stream_wait_value(stream, flags, idx, value)`` with its driver arguments made once
    (a call plan's wait; ``stream`` a fixed side stream): a function of no arguments.
    Without cuda-bindings, or on CPU, it calls ``stream_wait_value``."""
    from . import _driver

    fast = _driver.wait_value32() if flags.is_cuda else None
    if fast is not None:  # plain ints through ctypes: no Python object per argument
        raw, addr, v32, geq, check = (stream.cuda_stream, flags.data_ptr() + idx * 4, value & 0xFFFFFFFF,
                                      _driver.WAIT_GEQ, _driver.check)

        def wait_fast() -> None:
            code = fast(raw, addr, v32, geq)
            if code:
                check(code, "cuStreamWaitValue32")
        return wait_fast
    drv = _cuda_driver()
    if not drv or not flags.is_cuda:
        return lambda: stream_wait_value(stream, flags, idx, value)
    fn, s, p, v = (drv.cuStreamWaitValue32, drv.CUstream(stream.cuda_stream),
                   drv.CUdeviceptr(flags.data_ptr() + idx * 4), value & 0xFFFFFFFF)
    geq = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ

    def wait() -> None:
        res = fn(s, p, v, geq)
        if int(res[0]):
            _check(res, "cuStreamWaitValue32")
    return wait


class FlagArray:
    """``n`` int32 flags on ``device``, zeroed by each call that uses them (local flags:
    ``overlap.ops._runtime.LocalWords``; the epochs of shared flags are
    ``overlap._p2p.SharedFlags``')."""

    def __init__(self, n: int, device: torch.device | str) -> None:
        if n <= 0:
            raise ValueError(f"need at least one flag, got {n}")
        self.flags = torch.zeros(n, dtype=torch.int32, device=device)

    def __len__(self) -> int:
        return self.flags.numel()


class ErrorWord:
    """Device int32[8]: [code, rank, flag index, expected, seen, tile, host lo, host hi]
    (``overlap.protocol``'s ERR_* slots and codes).

    Slots 6-7 hold the address of a pinned host word (0: none). A kernel that
    records a failure also stores its code there, so ``check(block=False)`` reads
    host memory: nothing is queued on the GPU per call. Where the device cannot
    store to pinned host memory (checked once, when the word is made), every
    ``snapshot()`` queues a copy of the word instead and ``check(block=False)``
    reads the latest landed copy."""

    def __init__(self, device: torch.device | str, what: str = "overlap op") -> None:
        self.word = torch.zeros(P.ERR_WORDS, dtype=torch.int32, device=device)
        self.what = what
        self.ranks: tuple[int, ...] | None = None
        """The group's ranks, where a group's runtime made the word (a refusal record ends
        that group's ops)."""
        dev = torch.device(device)
        self._host = torch.zeros(P.ERR_WORDS, dtype=torch.int32, pin_memory=dev.type == "cuda")
        self._host_np = self._host.numpy()
        self._event: Any = None
        self._on_gpu = self.word.is_cuda
        self._mirror = self._on_gpu and self._open_mirror()

    def _open_mirror(self) -> bool:
        """Point slots 6-7 at the pinned words after one checked store into them by a
        kernel (synchronizes once); False (copies instead) where that store fails."""
        try:
            from .kernels.words import HostWords, copy_words

            self._host.fill_(-1)
            with torch.cuda.device(self.word.device):  # the kernel runs on the word's device
                copy_words(self.word, HostWords(self._host))
            torch.cuda.synchronize(self.word.device)
            if self._host.tolist() != self.word.tolist():
                raise RuntimeError("the pinned words did not receive the kernel's stores")
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"error word: no host mirror ({e}); timeouts are seen through copies", stacklevel=3)
            self._host.zero_()
            return False
        ptr = self._host.data_ptr()
        halves = [(ptr >> s) & 0xFFFFFFFF for s in (0, 32)]
        self.word[P.ERR_HOST_LO:P.ERR_HOST_HI + 1] = torch.tensor([h - (1 << 32) if h >= 1 << 31 else h for h in halves], dtype=torch.int32)
        self._host.zero_()
        torch.cuda.synchronize(self.word.device)
        return True

    def snapshot(self) -> None:
        """Without a host mirror: queue a copy of the word to host memory on the current
        stream (for ``check(block=False)``). With one (the usual case): nothing."""
        if self._mirror or not self.word.is_cuda:
            return
        if self._event is not None and not self._event.query():
            return  # the last copy has not landed yet: one in flight is enough
        self._host.copy_(self.word, non_blocking=True)
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record()

    def check_async(self) -> None:
        """``check(block=False)``, then ``snapshot()``: what an eager call reports after its
        launches. In one frame where the host mirror shows no record and no rank shares
        this GPU (the usual call: nothing to raise, nothing to queue)."""
        if self._mirror and self._host_np[P.ERR_CODE] == 0 and _shared is not None and not _shared._gpu_peers:
            return
        self.check(block=False)
        self.snapshot()

    def check(self, block: bool = True) -> None:
        """Raise ``FlagTimeoutError`` if a kernel recorded a timeout.

        Where ranks share this GPU (``overlap.dist.shared.gpu_peers``), a failed CUDA
        context is raised as ``GpuContextLostError`` naming the peers that exited, and
        ``block=False`` with no record also asks the current stream (a query, no wait)
        whether the context failed: under MPS a dead peer's exit does that, and no
        timeout is then ever recorded.

        ``block=True`` waits for the current stream's work so far, polling: it raises as
        soon as the host mirror shows a record (a stream held by a dead peer's NCCL
        kernel, behind a tile that timed out, cannot hold the report), and past the wait
        bound plus 5 s with nothing recorded raises ``TimeoutError`` instead of waiting on.
        ``block=False`` reads the host mirror (the failing kernel stores the whole record
        there), or without one the latest landed snapshot; it never waits on the GPU.
        """
        try:
            self._check_word(block)
        except (FlagTimeoutError, TimeoutError):
            raise
        except Exception as e:
            lost = _context_lost(self.what, e)
            if lost is not None:
                raise lost from e
            raise

    def _probe_context(self) -> None:
        """Raise the context's sticky CUDA error, if any (a stream query: never waits)."""
        torch.cuda.current_stream(self.word.device).query()

    def _check_word(self, block: bool) -> None:
        if block and self._on_gpu and self._mirror:
            vals = self._poll_until_done()
        elif block or not self._on_gpu:
            vals = self.word.tolist()
        elif self._mirror:
            if self._host_np[P.ERR_CODE] == 0:
                self._probe_if_shared()
                return
            # the kernel stored the whole record here before the code: no
            # synchronization, so a stream that never finishes cannot hold the report
            vals = self._host.tolist()
        else:
            if self._event is None or not self._event.query():
                self._probe_if_shared()
                return
            vals = self._host.tolist()
        if vals[P.ERR_CODE] != 0:
            # A recorded timeout makes every later tile of every call skip its
            # work; once reported, clear it so the next call computes again.
            self.clear()
            cls = {P.ERR_AHEAD: FlagProtocolError, P.ERR_DISAGREE: RanksDisagreeError}.get(vals[P.ERR_CODE],
                                                                                         FlagTimeoutError)
            if cls is RanksDisagreeError and P.read_refusal(vals[P.ERR_SEEN]) is not None:
                cls = PeerRefusedError
            e = cls(self.what, *(vals[i] for i in (P.ERR_RANK, P.ERR_FLAG, P.ERR_EXPECTED, P.ERR_SEEN, P.ERR_TILE)))
            if isinstance(e, PeerRefusedError):
                for hook in refusal_hooks:
                    hook(self, e)
            raise e

    def _probe_if_shared(self) -> None:
        global _shared
        if _shared is None:
            from .dist import shared as _shared_mod

            _shared = _shared_mod
        if _shared._gpu_peers:  # (a dict read: asked after every eager call)
            self._probe_context()

    def _poll_until_done(self) -> list[int]:
        import time

        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.word.device))
        deadline = time.monotonic() + default_timeout_ms() / 1000.0 + 5.0
        while not ev.query():
            if self._host_np[P.ERR_CODE] != 0:
                return self._host.tolist()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.what}: the op's work did not end within the wait bound and no wait "
                                   "recorded a timeout (an NCCL call whose peer is gone?); overlap.dist.shutdown() "
                                   "aborts the library's communicators")
            time.sleep(0.0005)
        return self.word.tolist()

    def clear(self) -> None:
        self.word[:P.ERR_HOST_LO].zero_()  # the host slots hold the mirror's address
        self._host.zero_()
        self._event = None
