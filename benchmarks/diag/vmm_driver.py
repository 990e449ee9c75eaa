"""Peer memory through the CUDA driver's virtual-memory API, shared by file descriptor.

The legacy IPC path (``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle``) maps a peer's
``cudaMalloc`` allocation; the exporting process owns it. The virtual-memory API splits
an allocation into a physical handle (``cuMemCreate``) and mappings of it
(``cuMemAddressReserve`` + ``cuMemMap`` + ``cuMemSetAccess``). The handle can be exported
as a POSIX file descriptor (``cuMemExportToShareableHandle``), passed to another process
over a Unix socket (``SCM_RIGHTS``), and imported there (``cuMemImportFromShareableHandle``):
the importer then holds a reference of its own to the physical memory, which is freed only
once every handle is released and every mapping unmapped, in whichever process.

Only the driver calls are here (through ``ctypes`` on ``libcuda``), behind a small class
(used by ``mps_kill_diag.py``, which passes the descriptors over a socket pair).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

__all__ = ["VmmError", "VmmDriver", "load_driver"]

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
_ATTR_VMM_SUPPORTED = 102
_ATTR_POSIX_FD_SUPPORTED = 103


class VmmError(RuntimeError):
    """A virtual-memory driver call failed, or the driver or device lacks the API."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):
    """``CUmemAllocationProp``."""

    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    """``CUmemAccessDesc``."""

    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_NAMES = ("cuDeviceGet", "cuDeviceGetAttribute", "cuMemGetAllocationGranularity", "cuMemCreate",
          "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle", "cuMemAddressReserve",
          "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemAddressFree", "cuMemRelease")


class VmmDriver:
    """The driver calls of peer memory by virtual-memory handles, on CUDA device ``ordinal``
    (the calling thread must have that device's primary context current: any runtime call
    on the device, such as torch's or cupy's, makes it so).

    Every method raises ``VmmError`` naming the call and the driver's error."""

    def __init__(self, lib: Any) -> None:
        missing = [n for n in _NAMES if not hasattr(lib, n)]
        if missing:
            raise VmmError(f"the CUDA driver lacks {', '.join(missing)}")
        self._lib = lib

    def _call(self, name: str, *args: Any) -> None:
        rc = getattr(self._lib, name)(*args)
        if rc != 0:
            msg = ctypes.c_char_p()
            text = ""
            get = getattr(self._lib, "cuGetErrorString", None)
            if get is not None and get(rc, ctypes.byref(msg)) == 0 and msg.value:
                text = ": " + msg.value.decode(errors="replace")
            raise VmmError(f"{name} failed with CUDA error {rc}{text}")

    def _device(self, ordinal: int) -> int:
        dev = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        return dev.value

    def supported(self, ordinal: int) -> str:
        """Why device ``ordinal`` cannot share memory by file descriptor ("" where it can)."""
        dev = self._device(ordinal)
        for attr, what in ((_ATTR_VMM_SUPPORTED, "virtual memory management"),
                           (_ATTR_POSIX_FD_SUPPORTED, "POSIX file-descriptor handles")):
            v = ctypes.c_int()
            self._call("cuDeviceGetAttribute", ctypes.byref(v), ctypes.c_int(attr), ctypes.c_int(dev))
            if not v.value:
                return f"device {ordinal} does not support {what}"
        return ""

    def _prop(self, ordinal: int) -> _AllocProp:
        p = _AllocProp()
        p.type = _CU_MEM_ALLOCATION_TYPE_PINNED
        p.requestedHandleTypes = _CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        p.location.type = _CU_MEM_LOCATION_TYPE_DEVICE
        p.location.id = self._device(ordinal)
        return p

    def granularity(self, ordinal: int) -> int:
        g = ctypes.c_size_t()
        prop = self._prop(ordinal)
        self._call("cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(prop),
                   ctypes.c_int(_CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return int(g.value)

    def create(self, ordinal: int, nbytes: int) -> int:
        """A physical allocation of ``nbytes`` (a multiple of ``granularity``) on the device,
        exportable as a file descriptor; returns its handle."""
        h = ctypes.c_ulonglong()
        prop = self._prop(ordinal)
        self._call("cuMemCreate", ctypes.byref(h), ctypes.c_size_t(nbytes), ctypes.byref(prop), ctypes.c_ulonglong(0))
        return int(h.value)

    def export_fd(self, handle: int) -> int:
        """A new file descriptor for ``handle`` (the caller closes it)."""
        fd = ctypes.c_int(-1)
        self._call("cuMemExportToShareableHandle", ctypes.byref(fd), ctypes.c_ulonglong(handle),
                   ctypes.c_int(_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), ctypes.c_ulonglong(0))
        return int(fd.value)

    def import_fd(self, fd: int) -> int:
        """A handle of this process's own for the allocation behind ``fd`` (``fd`` stays open)."""
        h = ctypes.c_ulonglong()
        self._call("cuMemImportFromShareableHandle", ctypes.byref(h), ctypes.c_void_p(fd),
                   ctypes.c_int(_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        return int(h.value)

    def map(self, ordinal: int, handle: int, nbytes: int, align: int) -> int:
        """Map ``handle`` read-write for device ``ordinal`` at a new address; returns it.
        On failure nothing stays reserved or mapped."""
        ptr = ctypes.c_ulonglong()
        self._call("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(nbytes), ctypes.c_size_t(align),
                   ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
        mapped = False
        try:
            self._call("cuMemMap", ctypes.c_ulonglong(ptr.value), ctypes.c_size_t(nbytes), ctypes.c_size_t(0),
                       ctypes.c_ulonglong(handle), ctypes.c_ulonglong(0))
            mapped = True
            desc = _AccessDesc()
            desc.location.type = _CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = self._device(ordinal)
            desc.flags = _CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            self._call("cuMemSetAccess", ctypes.c_ulonglong(ptr.value), ctypes.c_size_t(nbytes),
                       ctypes.byref(desc), ctypes.c_size_t(1))
        except VmmError:
            if mapped:
                self._lib.cuMemUnmap(ctypes.c_ulonglong(ptr.value), ctypes.c_size_t(nbytes))
            self._lib.cuMemAddressFree(ctypes.c_ulonglong(ptr.value), ctypes.c_size_t(nbytes))
            raise
        return int(ptr.value)

    def unmap(self, ptr: int, nbytes: int) -> None:
        """Undo ``map``: unmap, then give the address range back."""
        try:
            self._call("cuMemUnmap", ctypes.c_ulonglong(ptr), ctypes.c_size_t(nbytes))
        finally:
            self._call("cuMemAddressFree", ctypes.c_ulonglong(ptr), ctypes.c_size_t(nbytes))

    def release(self, handle: int) -> None:
        self._call("cuMemRelease", ctypes.c_ulonglong(handle))


_DRIVER: VmmDriver | None = None


def load_driver() -> VmmDriver:
    """The process's ``VmmDriver`` on ``libcuda``.

    Raises:
        VmmError: no CUDA driver library, or one without the virtual-memory calls.
    """
    global _DRIVER
    if _DRIVER is None:
        name = ctypes.util.find_library("cuda") or "libcuda.so.1"
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            raise VmmError(f"cannot load the CUDA driver library ({name}): {e}") from e
        _DRIVER = VmmDriver(lib)
    return _DRIVER
