"""``overlap._driver``'s ctypes declarations against the CUDA driver's own header.

No GPU runs the graph calls of ``_driver`` on every machine, and a wrong argument type
or struct offset there would not fail loudly: the driver would read the wrong bytes.
So a C compiler checks them against ``cuda.h`` (the CUDA toolkit's, or the copy Triton
ships): each call's prototype as written here must be the header's
(``__builtin_types_compatible_p``), and each parameter's size (and a pointer's target
size) must be what ``_driver._bind`` declares; ``Memcpy3D`` must have
``CUDA_MEMCPY3D``'s size and every field's offset; the enum values ``_driver`` and
``_graph_nodes`` spell as numbers must be the header's. Skipped without a C compiler or
a ``cuda.h``.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from overlap import _driver
from overlap.ops import _graph_nodes

PROTOTYPES = {
    "cuMemcpyDtoDAsync_v2": ["CUdeviceptr", "CUdeviceptr", "size_t", "CUstream"],
    "cuMemsetD32Async": ["CUdeviceptr", "unsigned int", "size_t", "CUstream"],
    "cuStreamWriteValue32_v2": ["CUstream", "CUdeviceptr", "cuuint32_t", "unsigned int"],
    "cuStreamWaitValue32_v2": ["CUstream", "CUdeviceptr", "cuuint32_t", "unsigned int"],
    "cuGraphLaunch": ["CUgraphExec", "CUstream"],
    "cuGraphExecMemcpyNodeSetParams": ["CUgraphExec", "CUgraphNode", "const CUDA_MEMCPY3D *", "CUcontext"],
    "cuGraphGetNodes": ["CUgraph", "CUgraphNode *", "size_t *"],
    "cuGraphNodeGetType": ["CUgraphNode", "CUgraphNodeType *"],
    "cuGraphMemcpyNodeGetParams": ["CUgraphNode", "CUDA_MEMCPY3D *"],
    "cuCtxGetCurrent": ["CUcontext *"],
    "cuGetErrorName": ["CUresult", "const char **"],
}
"""The driver calls ``_driver`` binds, as ``cuda.h`` declares them (all return CUresult)."""

CONSTANTS = {
    "CU_GRAPH_NODE_TYPE_MEMCPY": _driver._GRAPH_NODE_MEMCPY,
    "CU_STREAM_WAIT_VALUE_GEQ": _driver.WAIT_GEQ,
    "CUDA_ERROR_INVALID_VALUE": _graph_nodes.INVALID_VALUE,
}
NODE_KIND_NAMES = {"KERNEL": "kernel", "MEMCPY": "memcpy", "MEMSET": "memset", "HOST": "host", "GRAPH": "child graph",
                   "EMPTY": "empty", "WAIT_EVENT": "event wait", "EVENT_RECORD": "event record",
                   "EXT_SEMAS_SIGNAL": "semaphore signal", "EXT_SEMAS_WAIT": "semaphore wait",
                   "MEM_ALLOC": "mem alloc", "MEM_FREE": "mem free", "BATCH_MEM_OP": "batch mem op",
                   "CONDITIONAL": "conditional"}
"""``CU_GRAPH_NODE_TYPE_*`` -> the name ``_driver.NODE_KINDS`` must hold at that value."""


def _header_dir() -> str | None:
    dirs = [os.path.join(os.environ[v], "include") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    dirs += sorted(glob.glob("/usr/local/cuda*/include"), reverse=True)
    try:
        import triton

        dirs.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include"))
    except ImportError:
        pass
    return next((d for d in dirs if os.path.isfile(os.path.join(d, "cuda.h"))), None)


def _pointee(t: str) -> str | None:
    """The type a C pointer type points to (None for a non-pointer)."""
    t = t.strip()
    if not t.endswith("*"):
        return None
    return t[:-1].strip().removeprefix("const ").strip() or None


def _c_program() -> str:
    out = ["#include <stddef.h>", "#include <stdio.h>", "#include <cuda.h>", "int main(void) {",
           'printf("{");']
    for fn, params in PROTOTYPES.items():
        out.append(f'_Static_assert(__builtin_types_compatible_p(__typeof__(&{fn}), '
                   f'CUresult (*)({", ".join(params)})), "{fn}: not the header\'s prototype");')
        sizes = ", ".join(f"(int)sizeof({p})" for p in params) or "0"
        targets = ", ".join(f"(int)sizeof({_pointee(p)})" if _pointee(p) and _pointee(p) != "void" else "0"
                            for p in params) or "0"
        fmt = ",".join(["%d"] * len(params))
        out.append(f'printf("\\"{fn}\\": [[{fmt}], [{fmt}]], ", {sizes}, {targets});')
    out.append('printf("\\"CUresult\\": %d, ", (int)sizeof(CUresult));')
    fields = [name for name, _ in _driver.Memcpy3D._fields_]
    offs = ", ".join(f"(int)offsetof(CUDA_MEMCPY3D, {f})" for f in fields)
    out.append(f'printf("\\"memcpy3d\\": [%d, [{",".join(["%d"] * len(fields))}]], ", (int)sizeof(CUDA_MEMCPY3D), '
               f'{offs});')
    for name in CONSTANTS:
        out.append(f'printf("\\"{name}\\": %d, ", (int){name});')
    kinds = ", ".join(f"(int)CU_GRAPH_NODE_TYPE_{k}" for k in NODE_KIND_NAMES)
    out.append(f'printf("\\"node_kinds\\": [{",".join(["%d"] * len(NODE_KIND_NAMES))}]", {kinds});')
    out += ['printf("}\\n");', "return 0;", "}"]
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def header(tmp_path_factory) -> dict:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    inc = _header_dir()
    if cc is None or inc is None:
        pytest.skip("needs a C compiler and the CUDA driver's header (cuda.h)")
    d = tmp_path_factory.mktemp("abi")
    src, exe = d / "abi.c", d / "abi"
    src.write_text(_c_program())
    r = subprocess.run([cc, "-std=gnu11", "-Werror", "-I", inc, str(src), "-o", str(exe)], capture_output=True,
                       text=True)
    assert r.returncode == 0, f"the declarations do not match {inc}/cuda.h:\n{r.stderr[-3000:]}"
    run = subprocess.run([str(exe)], capture_output=True, text=True, check=True)
    return json.loads(run.stdout)


class _Fn:
    argtypes: list = []
    restype: object = None


class _Lib:
    """Takes ``_driver._bind``'s declarations without a driver."""

    def __init__(self) -> None:
        self.fns: dict[str, _Fn] = {}

    def __getattr__(self, name: str) -> _Fn:
        if name.startswith("cu"):
            return self.__dict__["fns"].setdefault(name, _Fn())
        raise AttributeError(name)


def _bound() -> _Lib:
    lib = _Lib()
    _driver._bind(lib)
    assert lib.graphs is True
    return lib


def test_every_bound_call_is_checked() -> None:
    assert set(_bound().fns) == set(PROTOTYPES)


def test_argument_types_match_the_header(header: dict) -> None:
    lib = _bound()
    for fn, f in lib.fns.items():
        sizes, targets = header[fn]
        assert len(f.argtypes) == len(sizes), f"{fn}: {len(f.argtypes)} arguments declared, the header has {len(sizes)}"
        assert ctypes.sizeof(f.restype) == header["CUresult"], fn
        for i, (t, size, target) in enumerate(zip(f.argtypes, sizes, targets)):
            assert ctypes.sizeof(t) == size, f"{fn} argument {i}: {t.__name__} is {ctypes.sizeof(t)} bytes, " \
                                             f"the header's {size}"
            pointee = getattr(t, "_type_", None)
            if target:  # a pointer to a sized type: ctypes must point to one of that size
                assert isinstance(pointee, type) and ctypes.sizeof(pointee) == target, \
                    f"{fn} argument {i}: {t.__name__} does not point to {target} bytes"


def test_memcpy3d_is_the_headers_struct(header: dict) -> None:
    size, offsets = header["memcpy3d"]
    assert ctypes.sizeof(_driver.Memcpy3D) == size
    for (name, _t), off in zip(_driver.Memcpy3D._fields_, offsets):
        assert getattr(_driver.Memcpy3D, name).offset == off, name


def test_constants_are_the_headers(header: dict) -> None:
    for name, value in CONSTANTS.items():
        assert header[name] == value, name
    assert len(_driver.NODE_KINDS) == len(NODE_KIND_NAMES)
    for (c_name, name), value in zip(NODE_KIND_NAMES.items(), header["node_kinds"]):
        assert _driver.NODE_KINDS[value] == name, f"CU_GRAPH_NODE_TYPE_{c_name} is {value}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
