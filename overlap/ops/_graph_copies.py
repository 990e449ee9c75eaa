"""How a plan graph's replay copies its moving inputs in and its outputs out (``_graphs``).

By default (``OVERLAP_PLAN_GRAPH_COPIES=nodes``) the copies in and out are memcpy nodes of
the graph, pointed at each call's tensors before its launch (``_graph_nodes``); driver
copies of a graph so captured (where an update is refused) go into its placeholders
(``statics``) and out of its output placeholders (``out``), which its nodes read and fill.
Where the driver or torch cannot keep and update a graph, and with
``OVERLAP_PLAN_GRAPH_COPIES=driver``, each copy and clone is one driver copy (``_dtod``,
about 5 us of host time on an H200 host). With ``OVERLAP_PLAN_GRAPH_COPIES=graph`` the
graph makes them (``kernels.relay``):
the call posts the addresses of its moving inputs and of its new outputs into its slot in
a ring of pinned host memory, the graph's first kernels copy the inputs in from there and
its last ones the outputs out (an input that is not contiguous or aligned is copied by the
host, its slot address 0; outputs of another form than a tensor or a pair are cloned).
That saved host time (all_gather_matmul 36.7 us a call against 45.0) and cost GPU time
(some 7-15 us a call: four to six more kernels in the graph), so it is not the default.
"""

from __future__ import annotations

from typing import Any

import torch


def _tensors(out: Any) -> list[torch.Tensor] | None:
    """The tensors of an output (a tensor, or a tuple or list of them; None inside is
    kept), or None for anything else."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        got = []
        for x in out:
            if isinstance(x, (tuple, list)):
                inner = _tensors(x)
                if inner is None:
                    return None
                got.extend(inner)
            elif isinstance(x, torch.Tensor):
                got.append(x)
            elif x is not None:
                return None
        return got
    return None


def _dtod() -> Any:
    """``f(dst, src, nbytes, raw_stream) -> CUresult``: one ``cuMemcpyDtoDAsync`` with its
    pointers as ints (``overlap._driver`` through ``ctypes``; else cuda-bindings, which
    makes a Python object per argument), or None (no driver: off a GPU). A result other
    than 0 goes to ``_driver.check``."""
    from .. import _driver

    fast = _driver.memcpy_dtod()
    if fast is not None:
        return fast
    from .. import flags as _flags

    drv = _flags._cuda_driver()
    if not drv:
        return None
    fn, mk, ptr = drv.cuMemcpyDtoDAsync, drv.CUstream, drv.CUdeviceptr
    return lambda dst, src, nbytes, raw: int(fn(ptr(dst), ptr(src), nbytes, mk(raw))[0])


def _driver_check() -> Any:
    from .. import _driver

    return _driver.check


def _copier(dst: torch.Tensor) -> Any:
    """``f(src, raw_stream) -> bool``: ``dst[:] = src`` as one ``cuMemcpyDtoDAsync`` on the
    stream where ``src`` is contiguous with ``dst``'s shape and dtype (a fraction of
    ``copy_``'s host time), else False; a function that always says False without a
    driver (``_dtod``) or off a GPU."""
    dtod = _dtod()
    if dtod is None or not dst.is_cuda or not dst.is_contiguous():
        return lambda src, raw: False
    d, nbytes, shape, dtype = dst.data_ptr(), dst.numel() * dst.element_size(), dst.shape, dst.dtype
    check = _driver_check()

    def copy(src: torch.Tensor, raw: int) -> bool:
        if src.dtype is not dtype or src.shape != shape or not src.is_contiguous() or not nbytes:
            return False
        code = dtod(d, src.data_ptr(), nbytes, raw)
        if code:
            check(code, "cuMemcpyDtoDAsync")
        return True
    return copy


def _cloner(out: Any) -> Any:
    """A function of the raw stream returning ``out`` with every tensor cloned (its
    structure kept): a contiguous tensor as a new tensor and one driver copy
    (``_dtod``), a tensor's or a pair's without a Python frame per level."""
    def one(t: torch.Tensor) -> Any:
        dtod = _dtod()
        if dtod is None or not t.is_cuda or not t.is_contiguous() or not t.numel():
            return lambda raw: t.clone()
        src, nbytes, empty, check = t.data_ptr(), t.numel() * t.element_size(), torch.empty_like, _driver_check()

        def clone(raw: int) -> torch.Tensor:
            new = empty(t)
            code = dtod(new.data_ptr(), src, nbytes, raw)
            if code:
                check(code, "cuMemcpyDtoDAsync")
            return new
        return clone

    if isinstance(out, torch.Tensor):
        return one(out)
    if isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out):
        a, b = one(out[0]), one(out[1])
        return lambda raw: (a(raw), b(raw))
    return lambda raw: _cloned(out)


def _cloned(out: Any) -> Any:
    """``out`` with every tensor cloned (its structure kept)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple):
        return tuple(_cloned(x) for x in out)
    if isinstance(out, list):
        return [_cloned(x) for x in out]
    return out


def _pair_or_one(out: Any) -> list | None:
    """The output tensors a relay copies out: a contiguous tensor, or a pair of them; else None."""
    if isinstance(out, torch.Tensor):
        outs = [out]
    elif isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out):
        outs = list(out)
    else:
        return None
    return outs if all(o.is_contiguous() and o.numel() for o in outs) else None
