"""The few CUDA driver calls on a call's hot path, through ``ctypes`` on the driver library
the process already loaded (``libcuda.so.1``).

A call through cuda-bindings builds a Python object per argument (``CUdeviceptr``,
``CUstream``) and one for its result: some microseconds of host time, paid several
times per call by a replayed plan graph (its copies in and out) and a bound body (its
words' zeroing, its flag posts). A ``ctypes`` function with its argument types set takes
plain ints. The functions here return the ``CUresult`` (0: success); ``check`` turns
another into an error naming the call. Where no driver library can be loaded (no GPU,
another platform) every getter returns None and the callers keep their cuda-bindings or
torch path.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable

__all__ = ["memcpy_dtod", "memset_d32", "write_value32", "wait_value32", "WAIT_GEQ", "check"]

_lib: Any = None
_lock = threading.Lock()


def _load() -> Any:
    """The driver library (False where there is none)."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                try:
                    lib = ctypes.CDLL("libcuda.so.1")
                    u64, size = ctypes.c_uint64, ctypes.c_size_t
                    # CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s)
                    lib.cuMemcpyDtoDAsync_v2.argtypes = [u64, u64, size, ctypes.c_void_p]
                    lib.cuMemcpyDtoDAsync_v2.restype = ctypes.c_int
                    # CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int value, size_t n, CUstream s)
                    lib.cuMemsetD32Async.argtypes = [u64, ctypes.c_uint, size, ctypes.c_void_p]
                    lib.cuMemsetD32Async.restype = ctypes.c_int
                    # CUresult cuStreamWriteValue32_v2(CUstream s, CUdeviceptr addr, cuuint32_t value, unsigned flags)
                    lib.cuStreamWriteValue32_v2.argtypes = [ctypes.c_void_p, u64, ctypes.c_uint32, ctypes.c_uint]
                    lib.cuStreamWriteValue32_v2.restype = ctypes.c_int
                    # CUresult cuStreamWaitValue32_v2(CUstream s, CUdeviceptr addr, cuuint32_t value, unsigned flags)
                    lib.cuStreamWaitValue32_v2.argtypes = [ctypes.c_void_p, u64, ctypes.c_uint32, ctypes.c_uint]
                    lib.cuStreamWaitValue32_v2.restype = ctypes.c_int
                    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
                    lib.cuGetErrorName.restype = ctypes.c_int
                except (OSError, AttributeError):
                    lib = False
                _lib = lib
    return _lib


def memcpy_dtod() -> Callable[[int, int, int, int], int] | None:
    """``f(dst, src, nbytes, stream) -> CUresult``: ``cuMemcpyDtoDAsync`` (device pointers
    and a raw stream handle as ints), or None."""
    lib = _load()
    return lib.cuMemcpyDtoDAsync_v2 if lib else None


def memset_d32() -> Callable[[int, int, int, int], int] | None:
    """``f(dst, value, count, stream) -> CUresult``: ``cuMemsetD32Async``, or None."""
    lib = _load()
    return lib.cuMemsetD32Async if lib else None


def write_value32() -> Callable[[int, int, int, int], int] | None:
    """``f(stream, addr, value, flags) -> CUresult``: ``cuStreamWriteValue32``, or None."""
    lib = _load()
    return lib.cuStreamWriteValue32_v2 if lib else None


def wait_value32() -> Callable[[int, int, int, int], int] | None:
    """``f(stream, addr, value, flags) -> CUresult``: ``cuStreamWaitValue32`` (``WAIT_GEQ``
    is flags 0), or None."""
    lib = _load()
    return lib.cuStreamWaitValue32_v2 if lib else None


WAIT_GEQ = 0
"""``CU_STREAM_WAIT_VALUE_GEQ``: wait until ``(int32)(*addr - value) >= 0``."""


def check(code: int, what: str) -> None:
    """Raise ``RuntimeError`` naming ``what`` and the driver's name of ``code``, unless 0."""
    if code == 0:
        return
    name = f"CUresult {code}"
    lib = _load()
    if lib:
        out = ctypes.c_char_p()
        if lib.cuGetErrorName(code, ctypes.byref(out)) == 0 and out.value:
            name += f" ({out.value.decode()})"
    raise RuntimeError(f"{what} failed with {name}")
