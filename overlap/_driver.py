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

__all__ = ["memcpy_dtod", "memset_d32", "write_value32", "wait_value32", "WAIT_GEQ", "check", "Memcpy3D",
           "graph_launch", "exec_memcpy_set", "memcpy_nodes", "node_kinds", "current_context"]


class Memcpy3D(ctypes.Structure):
    """``CUDA_MEMCPY3D``: a memcpy node's parameters (a 1-D device copy sets ``srcDevice``,
    ``dstDevice`` and ``WidthInBytes``, with ``Height`` and ``Depth`` 1)."""

    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcZ", ctypes.c_size_t),
                ("srcLOD", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p),
                ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p), ("reserved0", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t), ("srcHeight", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstZ", ctypes.c_size_t),
                ("dstLOD", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p),
                ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p), ("reserved1", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t), ("dstHeight", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t), ("Depth", ctypes.c_size_t)]


_GRAPH_NODE_MEMCPY = 1
"""``CU_GRAPH_NODE_TYPE_MEMCPY``."""

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
                    _bind(lib)
                except (OSError, AttributeError):
                    lib = False
                _lib = lib
    return _lib


def _bind(lib: Any) -> None:
    """Argument and result types of the driver calls on ``lib`` (the driver library, or a
    stand-in that takes attributes); ``AttributeError`` where the driver lacks one."""
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
    _graph_api(lib)
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuGetErrorName.restype = ctypes.c_int


def _graph_api(lib: Any) -> None:
    """Argument types of the graph calls (``memcpy_nodes``, ``exec_memcpy_set``,
    ``graph_launch``); a driver without one leaves ``lib.graphs`` False."""
    vp, size = ctypes.c_void_p, ctypes.c_size_t
    try:
        # CUresult cuGraphLaunch(CUgraphExec exec, CUstream s)
        lib.cuGraphLaunch.argtypes = [vp, vp]
        lib.cuGraphLaunch.restype = ctypes.c_int
        # CUresult cuGraphExecMemcpyNodeSetParams(CUgraphExec exec, CUgraphNode node,
        #                                         const CUDA_MEMCPY3D *params, CUcontext ctx)
        lib.cuGraphExecMemcpyNodeSetParams.argtypes = [vp, vp, ctypes.POINTER(Memcpy3D), vp]
        lib.cuGraphExecMemcpyNodeSetParams.restype = ctypes.c_int
        # CUresult cuGraphGetNodes(CUgraph graph, CUgraphNode *nodes, size_t *count)
        lib.cuGraphGetNodes.argtypes = [vp, ctypes.POINTER(vp), ctypes.POINTER(size)]
        lib.cuGraphGetNodes.restype = ctypes.c_int
        # CUresult cuGraphNodeGetType(CUgraphNode node, CUgraphNodeType *type)
        lib.cuGraphNodeGetType.argtypes = [vp, ctypes.POINTER(ctypes.c_int)]
        lib.cuGraphNodeGetType.restype = ctypes.c_int
        # CUresult cuGraphMemcpyNodeGetParams(CUgraphNode node, CUDA_MEMCPY3D *params)
        lib.cuGraphMemcpyNodeGetParams.argtypes = [vp, ctypes.POINTER(Memcpy3D)]
        lib.cuGraphMemcpyNodeGetParams.restype = ctypes.c_int
        # CUresult cuCtxGetCurrent(CUcontext *ctx)
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(vp)]
        lib.cuCtxGetCurrent.restype = ctypes.c_int
        lib.graphs = True
    except AttributeError:
        lib.graphs = False


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


def graph_launch() -> Callable[[int, int], int] | None:
    """``f(exec, stream) -> CUresult``: ``cuGraphLaunch`` of an executable graph, or None."""
    lib = _load()
    return lib.cuGraphLaunch if lib and lib.graphs else None


def exec_memcpy_set() -> Callable[[int, int, Any, int], int] | None:
    """``f(exec, node, params, ctx) -> CUresult``: ``cuGraphExecMemcpyNodeSetParams`` (the
    executable graph's memcpy node ``node`` takes ``params``, a ``Memcpy3D`` passed by
    reference, for its later launches; those queued already keep theirs), or None."""
    lib = _load()
    return lib.cuGraphExecMemcpyNodeSetParams if lib and lib.graphs else None


def memcpy_nodes(graph: int) -> list[tuple[int, Memcpy3D]] | None:
    """The memcpy nodes of the (not executable) graph ``graph``: (node, its parameters) each,
    in the graph's order; None without a driver, or where a call fails."""
    lib = _load()
    typed = _typed_nodes(lib, graph)
    if typed is None:
        return None
    out = []
    for node, kind in typed:
        if kind != _GRAPH_NODE_MEMCPY:
            continue
        params = Memcpy3D()
        if lib.cuGraphMemcpyNodeGetParams(node, ctypes.byref(params)):
            return None
        out.append((int(node), params))
    return out


NODE_KINDS = ("kernel", "memcpy", "memset", "host", "child graph", "empty", "event wait", "event record",
              "semaphore signal", "semaphore wait", "mem alloc", "mem free", "batch mem op", "conditional")
"""``CUgraphNodeType`` by value."""


def node_kinds(graph: int) -> dict[str, int] | None:
    """How many nodes of each kind the (not executable) graph ``graph`` has, by
    ``NODE_KINDS``' names; None without a driver, or where a call fails."""
    typed = _typed_nodes(_load(), graph)
    if typed is None:
        return None
    out: dict[str, int] = {}
    for _node, kind in typed:
        name = NODE_KINDS[kind] if 0 <= kind < len(NODE_KINDS) else f"kind {kind}"
        out[name] = out.get(name, 0) + 1
    return out


def _typed_nodes(lib: Any, graph: int) -> list[tuple[Any, int]] | None:
    """(node, its ``CUgraphNodeType``) of each node of ``graph``, in the graph's order; None
    without a driver, or where a call fails."""
    if not lib or not lib.graphs:
        return None
    count = ctypes.c_size_t(0)
    if lib.cuGraphGetNodes(graph, None, ctypes.byref(count)):
        return None
    nodes = (ctypes.c_void_p * count.value)()
    if count.value and lib.cuGraphGetNodes(graph, nodes, ctypes.byref(count)):
        return None
    out = []
    kind = ctypes.c_int()
    for node in nodes[:count.value]:
        if lib.cuGraphNodeGetType(node, ctypes.byref(kind)):
            return None
        out.append((node, kind.value))
    return out


def current_context() -> int | None:
    """The calling thread's current context (``cuCtxGetCurrent``), or None."""
    lib = _load()
    if not lib or not lib.graphs:
        return None
    ctx = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) or not ctx.value:
        return None
    return int(ctx.value)


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
