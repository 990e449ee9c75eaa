"""The library's own NCCL communicator.

Why a communicator of our own, beside torch's process group: the overlapped ops
run NCCL on a side stream while a persistent GEMM holds most SMs, so the
library's traffic needs a cap on NCCL's CTAs (``ncclConfig_t.maxCTAs``) that
torch's own communicator must not get (a data-parallel all-reduce on torch's
group should keep its full bandwidth). ``cupy.cuda.nccl`` exposes no
``ncclConfig_t``, so the default backend binds ``ncclCommInitRankConfig`` with
``ctypes`` on the very ``libnccl.so.2`` that torch loaded (one NCCL library in
the process, never two). The cupy backend (``backend="cupy"``) is kept for
communicators without settings and for the start-up version check.

Everything CUDA-only is imported lazily: importing this module needs neither a
GPU nor cupy.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from typing import Any

__all__ = [
    "NcclConfig",
    "NcclCommunicator",
    "NcclError",
    "get_unique_id",
    "nccl_version",
    "check_nccl_versions",
    "libnccl_path",
]

UNIQUE_ID_BYTES = 128
_UNDEF_INT = -(2**31)  # NCCL_CONFIG_UNDEF_INT
_API_MAGIC = 0xCAFEBEEF


class NcclError(RuntimeError):
    """An NCCL call returned an error code."""


@dataclass(frozen=True, kw_only=True)
class NcclConfig:
    """Per-communicator NCCL settings (fields left ``None`` keep NCCL's default).

    ``max_ctas`` is the one that matters here: it bounds the SMs NCCL's kernels
    take (NCCL's bandwidth grows with its CTAs, each one an SM the GEMM loses; see
    docs/experiments.md, "Before the library"), so the persistent GEMM that spins
    on chunk flags can be sized to the SMs left.
    """

    max_ctas: int | None = None
    """Upper bound on NCCL's CTAs (channels) per collective kernel."""
    min_ctas: int | None = None
    """Lower bound on NCCL's CTAs; set equal to ``max_ctas`` to pin the count."""
    cga_cluster_size: int | None = None
    """Thread-block cluster size of NCCL's kernels (Hopper); ``None``: NCCL's default."""

    def __post_init__(self) -> None:
        for name in ("max_ctas", "min_ctas", "cga_cluster_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0 or (v == 0 and name != "cga_cluster_size")):
                raise ValueError(f"NcclConfig.{name} must be a positive int or None, got {v!r}")
        if self.max_ctas is not None and self.max_ctas > 64:
            raise ValueError(f"NcclConfig.max_ctas={self.max_ctas} exceeds NCCL's channel limit (64)")
        if self.min_ctas is not None and self.max_ctas is not None and self.min_ctas > self.max_ctas:
            raise ValueError(f"NcclConfig.min_ctas={self.min_ctas} > max_ctas={self.max_ctas}")

    @property
    def is_default(self) -> bool:
        return self.max_ctas is None and self.min_ctas is None and self.cga_cluster_size is None


class _NcclConfigStruct(ctypes.Structure):
    # Prefix of ncclConfig_t as of NCCL 2.18+. NCCL copies min(size, its own
    # sizeof) bytes and keeps its defaults for fields past ``size``, so a prefix
    # is a valid config for any newer library.
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),
    ]


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


_lib_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_path: str | None = None


def _loaded_libnccl() -> str | None:
    """Path of a libnccl already mapped into this process (torch's), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ")[-1]
                if "libnccl.so" in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


def _load() -> ctypes.CDLL:
    global _lib, _lib_path
    with _lib_lock:
        if _lib is not None:
            return _lib
        try:
            import torch  # noqa: F401  (torch's import maps its libnccl)
            import torch.cuda.nccl  # noqa: F401
        except Exception:  # pragma: no cover - torch is a hard dependency
            pass
        candidates = [p for p in (_loaded_libnccl(),) if p]
        try:
            import nvidia.nccl  # type: ignore

            for base in list(getattr(nvidia.nccl, "__path__", [])):
                candidates.append(os.path.join(base, "lib", "libnccl.so.2"))
        except Exception:
            pass
        candidates.append("libnccl.so.2")
        errors = []
        for cand in candidates:
            try:
                lib = ctypes.CDLL(cand, mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                errors.append(f"{cand}: {e}")
                continue
            _bind(lib)
            _lib, _lib_path = lib, cand
            return lib
        raise ImportError(
            "libnccl.so.2 could not be loaded (needed for the library's NCCL communicator). "
            "Install a CUDA build of torch, or pip install 'overlap[cu13]' (or [cu12]). Tried: "
            + "; ".join(errors)
        )


def _bind(lib: ctypes.CDLL) -> None:
    vp, ip, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.ncclGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
    lib.ncclCommInitRankConfig.argtypes = [ctypes.POINTER(vp), ip, _UniqueId, ip, ctypes.POINTER(_NcclConfigStruct)]
    lib.ncclCommDestroy.argtypes = [vp]
    lib.ncclCommAbort.argtypes = [vp]
    lib.ncclCommGetAsyncError.argtypes = [vp, ctypes.POINTER(ctypes.c_int)]
    lib.ncclGetErrorString.argtypes = [ip]
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclGetLastError.argtypes = [vp]
    lib.ncclGetLastError.restype = ctypes.c_char_p
    lib.ncclAllGather.argtypes = [vp, vp, sz, ip, vp, vp]
    lib.ncclAllReduce.argtypes = [vp, vp, sz, ip, ip, vp, vp]
    lib.ncclReduceScatter.argtypes = [vp, vp, sz, ip, ip, vp, vp]
    lib.ncclBroadcast.argtypes = [vp, vp, sz, ip, ip, vp, vp]
    lib.ncclGroupStart.argtypes = []
    lib.ncclGroupEnd.argtypes = []
    for name in ("ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRankConfig", "ncclCommDestroy",
                 "ncclCommAbort", "ncclCommGetAsyncError", "ncclAllGather", "ncclAllReduce",
                 "ncclReduceScatter", "ncclBroadcast", "ncclGroupStart", "ncclGroupEnd"):
        getattr(lib, name).restype = ctypes.c_int


def _check(lib: ctypes.CDLL, code: int, what: str, comm: Any = None) -> None:
    if code != 0:
        msg = lib.ncclGetErrorString(code).decode(errors="replace")
        last = lib.ncclGetLastError(comm).decode(errors="replace") if comm is not None else ""
        raise NcclError(f"{what} failed: NCCL error {code} ({msg}){': ' + last if last else ''}")


def libnccl_path() -> str:
    """Path of the libnccl this module binds (torch's, where torch loaded one)."""
    _load()
    assert _lib_path is not None
    return _lib_path


def _decode_version(code: int) -> tuple[int, int, int]:
    if code < 10000:  # NCCL_VERSION for <= 2.8: X*1000 + Y*100 + Z
        return code // 1000, (code % 1000) // 100, code % 100
    return code // 10000, (code % 10000) // 100, code % 100


def nccl_version() -> tuple[int, int, int]:
    """(major, minor, patch) of the NCCL library this module binds."""
    lib = _load()
    v = ctypes.c_int()
    _check(lib, lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
    return _decode_version(v.value)


def _torch_nccl_version() -> tuple[int, int, int] | None:
    import torch

    try:
        v = torch.cuda.nccl.version()
    except Exception:
        return None
    if isinstance(v, int):
        return _decode_version(v)
    return tuple(int(x) for x in v[:3])  # type: ignore[return-value]


def _cupy_nccl_version() -> tuple[int, int, int] | None:
    try:
        from cupy.cuda import nccl as cnccl  # type: ignore
    except Exception:
        return None
    try:
        return _decode_version(int(cnccl.get_version()))
    except Exception:
        return None


def check_nccl_versions(*, require_cupy: bool = False) -> tuple[int, int, int]:
    """Fail clearly unless cupy's, torch's and the bound NCCL are one version.

    Two different libnccl builds in one process can each pass its own tests and
    still deadlock or corrupt when their communicators meet; the check is cheap.
    """
    ours = nccl_version()
    found = {"bound libnccl (" + libnccl_path() + ")": ours}
    t = _torch_nccl_version()
    if t is not None:
        found["torch"] = t
    c = _cupy_nccl_version()
    if c is not None:
        found["cupy"] = c
    elif require_cupy:
        raise ImportError("cupy with NCCL support is needed: pip install 'overlap[cu13]' (or [cu12])")
    if len(set(found.values())) != 1:
        detail = ", ".join(f"{k}: {'.'.join(map(str, v))}" for k, v in found.items())
        raise NcclError(
            "NCCL versions differ between the libraries in this process (" + detail + "). "
            "Install cupy and nvidia-nccl matching torch's CUDA (pip install 'overlap[cu13]' or [cu12])."
        )
    return ours


def get_unique_id() -> bytes:
    """A fresh ncclUniqueId (128 bytes) to hand to every rank of a new communicator."""
    lib = _load()
    uid = _UniqueId()
    _check(lib, lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)


_DTYPES: dict[str, int] = {
    "torch.int8": 0, "torch.uint8": 1, "torch.int32": 2, "torch.int64": 4,
    "torch.float16": 6, "torch.float32": 7, "torch.float64": 8, "torch.bfloat16": 9,
}
_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}


def _nccl_dtype(t: Any) -> int:
    try:
        return _DTYPES[str(t.dtype)]
    except KeyError:
        raise TypeError(f"NCCL has no datatype for {t.dtype}") from None


def _stream_handle(stream: Any) -> int:
    import torch

    if stream is None:
        stream = torch.cuda.current_stream()
    if isinstance(stream, int):
        return stream
    return int(stream.cuda_stream)


class NcclCommunicator:
    """One NCCL communicator over ``nranks`` processes; this process is ``rank``.

    All collectives are enqueued on the given CUDA stream (default: the current
    one) and return at once. Tensors must be contiguous and on this process's
    CUDA device. Built collectively: every rank must call with the same id.
    """

    def __init__(self, unique_id: bytes, nranks: int, rank: int, *,
                 config: NcclConfig | None = None, backend: str = "ctypes") -> None:
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"unique_id must be {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
        if not (0 <= rank < nranks):
            raise ValueError(f"rank {rank} is outside [0, {nranks})")
        if backend not in ("ctypes", "cupy"):
            raise ValueError(f"backend must be 'ctypes' or 'cupy', got {backend!r}")
        config = config or NcclConfig()
        if backend == "cupy" and not config.is_default:
            raise ValueError("cupy's NCCL binding takes no ncclConfig_t; use backend='ctypes' for NcclConfig settings")
        self.rank, self.nranks, self.config, self.backend = rank, nranks, config, backend
        self._comm: Any = None
        if backend == "cupy":
            from cupy.cuda import nccl as cnccl  # type: ignore

            self._comm = cnccl.NcclCommunicator(nranks, tuple(unique_id), rank)
            return
        lib = _load()
        self._lib = lib
        cfg = _NcclConfigStruct()
        cfg.size = ctypes.sizeof(_NcclConfigStruct)
        cfg.magic = _API_MAGIC
        major, minor, patch = nccl_version()
        cfg.version = major * 10000 + minor * 100 + patch
        cfg.blocking = 1
        cfg.cgaClusterSize = _UNDEF_INT if config.cga_cluster_size is None else config.cga_cluster_size
        cfg.minCTAs = _UNDEF_INT if config.min_ctas is None else config.min_ctas
        cfg.maxCTAs = _UNDEF_INT if config.max_ctas is None else config.max_ctas
        cfg.netName = None
        cfg.splitShare = _UNDEF_INT
        uid = _UniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, UNIQUE_ID_BYTES)
        handle = ctypes.c_void_p()
        _check(lib, lib.ncclCommInitRankConfig(ctypes.byref(handle), nranks, uid, rank, ctypes.byref(cfg)),
               f"ncclCommInitRankConfig(nranks={nranks}, rank={rank}, {config})")
        self._comm = handle

    # -- collectives -------------------------------------------------------
    def _args(self, send: Any, recv: Any) -> tuple[int, int]:
        for name, t in (("send", send), ("recv", recv)):
            if not t.is_cuda or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous CUDA tensor")
        if send.dtype != recv.dtype:
            raise TypeError(f"send dtype {send.dtype} != recv dtype {recv.dtype}")
        return int(send.data_ptr()), int(recv.data_ptr())

    def all_gather(self, send: Any, recv: Any, stream: Any = None) -> None:
        """recv[r * n:(r + 1) * n] = send of rank r, with n = send.numel()."""
        if recv.numel() != send.numel() * self.nranks:
            raise ValueError(f"all_gather: recv has {recv.numel()} elements, expected {send.numel()} x {self.nranks}")
        s, r = self._args(send, recv)
        h = _stream_handle(stream)
        if self.backend == "cupy":
            self._comm.allGather(s, r, send.numel(), _nccl_dtype(send), h)
            return
        _check(self._lib, self._lib.ncclAllGather(s, r, send.numel(), _nccl_dtype(send), self._comm, h),
               "ncclAllGather", self._comm)

    def all_reduce(self, send: Any, recv: Any, op: str = "sum", stream: Any = None) -> None:
        """recv = op over ranks of send (in place when send is recv)."""
        if recv.numel() != send.numel():
            raise ValueError("all_reduce: send and recv differ in size")
        s, r = self._args(send, recv)
        h = _stream_handle(stream)
        if self.backend == "cupy":
            self._comm.allReduce(s, r, send.numel(), _nccl_dtype(send), _OPS[op], h)
            return
        _check(self._lib, self._lib.ncclAllReduce(s, r, send.numel(), _nccl_dtype(send), _OPS[op], self._comm, h),
               "ncclAllReduce", self._comm)

    def reduce_scatter(self, send: Any, recv: Any, op: str = "sum", stream: Any = None) -> None:
        """recv = (op over ranks of send)[rank * n:(rank + 1) * n], n = recv.numel()."""
        if send.numel() != recv.numel() * self.nranks:
            raise ValueError("reduce_scatter: send must hold nranks x recv elements")
        s, r = self._args(send, recv)
        h = _stream_handle(stream)
        if self.backend == "cupy":
            self._comm.reduceScatter(s, r, recv.numel(), _nccl_dtype(send), _OPS[op], h)
            return
        _check(self._lib, self._lib.ncclReduceScatter(s, r, recv.numel(), _nccl_dtype(send), _OPS[op], self._comm, h),
               "ncclReduceScatter", self._comm)

    def bound(self, kind: str, send: Any, recv: Any, stream: Any, op: str = "sum") -> Any:
        """``kind`` ("all_gather", "all_reduce", "reduce_scatter") of tensors shaped as
        ``send`` and ``recv`` on ``stream``, checked and its arguments made once: a call
        plan's collective, called per call as ``f(send, recv)`` with contiguous tensors of
        those sizes and dtype (the plan's, which the caller guarantees)."""
        sizes = {"all_gather": (send.numel() * self.nranks, send.numel()),
                 "all_reduce": (send.numel(), send.numel()),
                 "reduce_scatter": (send.numel() // self.nranks, recv.numel() * self.nranks)}
        if kind not in sizes:
            raise ValueError(f"bound: no collective {kind!r}")
        if recv.numel() != sizes[kind][0] or send.numel() != sizes[kind][1]:
            raise ValueError(f"{kind}: send has {send.numel()} elements, recv {recv.numel()} at {self.nranks} ranks")
        self._args(send, recv)
        count = recv.numel() if kind == "reduce_scatter" else send.numel()
        dt, h = _nccl_dtype(send), _stream_handle(stream)
        if self.backend == "cupy":
            c = self._comm
            fn = {"all_gather": c.allGather, "all_reduce": c.allReduce, "reduce_scatter": c.reduceScatter}[kind]
            tail = (count, dt, h) if kind == "all_gather" else (count, dt, _OPS[op], h)

            def run_cupy(send: Any, recv: Any) -> None:
                fn(send.data_ptr(), recv.data_ptr(), *tail)
            return run_cupy
        lib, comm = self._lib, self._comm
        name = {"all_gather": "ncclAllGather", "all_reduce": "ncclAllReduce",
                "reduce_scatter": "ncclReduceScatter"}[kind]
        fn = getattr(lib, name)
        tail = (count, dt, comm, h) if kind == "all_gather" else (count, dt, _OPS[op], comm, h)

        def run(send: Any, recv: Any) -> None:
            code = fn(send.data_ptr(), recv.data_ptr(), *tail)
            if code:
                _check(lib, code, name, comm)
        return run

    def check_async_error(self) -> None:
        """Raise if NCCL recorded an asynchronous error on this communicator."""
        if self.backend == "cupy" or self._comm is None:
            return
        err = ctypes.c_int()
        _check(self._lib, self._lib.ncclCommGetAsyncError(self._comm, ctypes.byref(err)), "ncclCommGetAsyncError")
        _check(self._lib, err.value, "asynchronous NCCL operation", self._comm)

    def destroy(self) -> None:
        """Free the communicator (collective: call on every rank)."""
        if self._comm is None:
            return
        if self.backend == "cupy":
            self._comm.destroy()
        else:
            _check(self._lib, self._lib.ncclCommDestroy(self._comm), "ncclCommDestroy")
        self._comm = None

    def abort(self) -> None:
        """Free the communicator without waiting for peers (after an error)."""
        if self._comm is None:
            return
        if self.backend == "cupy":
            self._comm.abort()
        else:
            self._lib.ncclCommAbort(self._comm)
        self._comm = None

    def __repr__(self) -> str:
        return f"NcclCommunicator(rank={self.rank}, nranks={self.nranks}, config={self.config}, backend={self.backend!r})"
