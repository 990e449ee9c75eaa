"""The Gluon API as the warp-specialized GEMM uses it, across Triton versions.

Gluon (``triton.experimental.gluon``) moves between releases; every difference the
kernel meets is resolved here, once, at import:

=====================  ============================================  ==========================
what                   Triton 3.6                                    Triton 3.9
=====================  ============================================  ==========================
TMA global -> shared   ``tma.async_copy_global_to_shared``           ``tma.async_load``
TMA shared -> global   ``tma.async_copy_shared_to_global``           ``tma.async_store``
a barrier of threads   ``gl.thread_barrier``                         ``gl.barrier``
``warp_specialize``    ``([(fn, args), ...], warps, regs)``          the same (3.5 took
                                                                     ``default_args, default_partition,
                                                                     worker_args, ...``, one
                                                                     worker signature: refused)
=====================  ============================================  ==========================

3.9 keeps the 3.6 names of the TMA copies only to raise "has been removed" at compile
time, so the new names are looked up first. A Triton without Gluon, or without the
Hopper pieces the kernel needs, leaves ``AVAILABLE`` False and ``REASON`` saying why;
the ``triton.language`` tile GEMM (``overlap.kernels.tile_gemm``) is then the only engine.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["AVAILABLE", "REASON", "WS_LIST_FORM", "gluon", "gl", "tma", "mbarrier", "fence_async_shared",
           "warpgroup_mma", "warpgroup_mma_wait", "TensorDescriptor", "tma_load", "tma_store", "thread_barrier",
           "version"]

AVAILABLE = False
REASON = ""
WS_LIST_FORM = True
gluon: Any = None
gl: Any = None
tma: Any = None
mbarrier: Any = None
fence_async_shared: Any = None
warpgroup_mma: Any = None
warpgroup_mma_wait: Any = None
TensorDescriptor: Any = None
tma_load: Any = None
tma_store: Any = None
thread_barrier: Any = None


def version() -> str:
    """The running Triton's version ("" when there is none)."""
    try:
        import triton
    except ImportError:  # pragma: no cover - the package requires triton
        return ""
    return str(triton.__version__)


def _resolve() -> None:
    global AVAILABLE, REASON, WS_LIST_FORM, gluon, gl, tma, mbarrier, fence_async_shared
    global warpgroup_mma, warpgroup_mma_wait, TensorDescriptor, tma_load, tma_store, thread_barrier
    try:
        from triton.experimental import gluon as _gluon
        from triton.experimental.gluon import language as _gl
        from triton.experimental.gluon.language.nvidia import hopper as _hopper
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _TD
    except Exception as e:  # noqa: BLE001 - any Triton without these modules
        REASON = f"triton {version()} has no Gluon Hopper API ({type(e).__name__}: {e})"
        return
    _tma = _hopper.tma
    load = getattr(_tma, "async_load", None) or getattr(_tma, "async_copy_global_to_shared", None)
    store = getattr(_tma, "async_store", None) or getattr(_tma, "async_copy_shared_to_global", None)
    # a barrier of the partition's threads: ``gl.thread_barrier`` in 3.6, ``gl.barrier`` since
    barrier = getattr(_gl, "barrier", None) or getattr(_gl, "thread_barrier", None)
    missing = [n for n, v in (("TMA load", load), ("TMA store", store), ("a thread barrier", barrier),
                              ("warpgroup_mma", getattr(_hopper, "warpgroup_mma", None)),
                              ("warp_specialize", getattr(_gl, "warp_specialize", None)))
               if v is None]
    if missing:
        REASON = f"triton {version()}'s Gluon lacks {', '.join(missing)}"
        return
    try:
        params = list(inspect.signature(_gl.warp_specialize).parameters)
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        params = []
    WS_LIST_FORM = not (params and params[0] == "default_args")
    if not WS_LIST_FORM:
        REASON = (f"triton {version()}'s gl.warp_specialize takes the 3.5 form (default_args, ...); the "
                  "Gluon GEMM's partitions of two signatures need the list form of 3.6 and later")
        return
    gluon, gl, tma, mbarrier = _gluon, _gl, _tma, _hopper.mbarrier
    fence_async_shared = _hopper.fence_async_shared
    warpgroup_mma, warpgroup_mma_wait = _hopper.warpgroup_mma, _hopper.warpgroup_mma_wait
    TensorDescriptor, tma_load, tma_store = _TD, load, store
    thread_barrier = barrier
    AVAILABLE = True


_resolve()
