"""A plan graph's copies as memcpy nodes of the graph, re-pointed per call
(``OVERLAP_PLAN_GRAPH_COPIES=nodes``).

A replayed call with driver copies (``_graphs``) spends most of its host time outside the
graph: one driver copy per activation into the graph's static input, torch's replay, one
new tensor and one driver copy per output (on an H200 host about 5 us per copy and 7.5 us
per replay, of some 42 us a call). Here the copies are part of the graph instead. Its
capture queues, before the body, one device copy per moving input from a placeholder
buffer into the static input the body reads, and after the body one copy per output from
the body's output into a placeholder buffer; each becomes a memcpy node. The graph is kept
after its capture (torch's ``keep_graph``) so that those nodes can be found. A call then:

- points each input node's source at the call's activation (a contiguous one of the
  captured shape and dtype; any other is first copied into the node's placeholder), and
  each output node's destination at a new tensor, with
  ``cuGraphExecMemcpyNodeSetParams``: a change of the executable graph that holds for its
  later launches, not for those queued already;
- launches the executable graph itself (``cuGraphLaunch``, on the caller's stream: what
  torch's replay does for a graph without random numbers, as an op's body is).

Before every launch every node points at the call's own tensor: it is updated unless the
last successful update already pointed it at that address (a loop's caching allocator
often hands the same blocks back call after call; the node then copies what lies there
when the launch runs, in stream order), so no launch reads an earlier call's tensors.
Where the driver refuses an update (``CUDA_ERROR_INVALID_VALUE``: memory it does not take
for the node), every node is pointed back at its placeholder, and the graph's
calls copy with the driver from then on: into the placeholders, out of them; where even
that is refused, the graph is dropped and the call runs the op's fused body. Neither
raises on one rank alone after the agreement point. Another error code (the context's
sticky error of an earlier launch) raises, as a failed launch does.

``driver()`` holds the calls (``overlap._driver``; a stand-in in the CPU tests).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["Nodes", "NodeUpdateError", "usable", "new_graph", "capture_copy", "bind", "driver", "maker"]

_drv: Any = None
"""The driver calls (``driver()``): None until first asked; False where there are none."""


def driver() -> Any:
    """The calls a node-copying graph makes, as plain functions of ints (``dtod``,
    ``memcpy_nodes``, ``setp``, ``launch``, ``context``, ``check``), or False: no driver
    library, or one without the graph calls."""
    global _drv
    if _drv is None:
        from .. import _driver

        parts = dict(dtod=_driver.memcpy_dtod(), memcpy_nodes=_driver.memcpy_nodes, setp=_driver.exec_memcpy_set(),
                     launch=_driver.graph_launch(), context=_driver.current_context, check=_driver.check,
                     stand_in=False)
        _drv = SimpleNamespace(**parts) if all(v is not None for v in parts.values()) else False
    return _drv


def usable(dev: Any, cuda: Any) -> bool:
    """A graph on ``dev`` made with ``cuda`` can copy through its own nodes: a CUDA device
    under ``torch.cuda`` whose graphs can be kept and instantiated by hand, and a driver
    with the graph calls (or the CPU tests' stand-in)."""
    d = driver()
    if not d:
        return False
    if d.stand_in:
        return True
    if cuda is not torch.cuda or getattr(dev, "type", None) != "cuda":
        return False
    g = torch.cuda.CUDAGraph
    return all(hasattr(g, a) for a in ("raw_cuda_graph", "raw_cuda_graph_exec", "instantiate"))


def new_graph(cuda: Any) -> Any:
    """A graph kept after its capture (its nodes are looked up), or None where this torch
    cannot keep one."""
    try:
        return cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        return None


def capture_copy(dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
    """``dst[:] = src`` as one driver copy on ``stream`` (capturing: a memcpy node);
    both contiguous, of one size."""
    d = driver()
    nbytes = src.numel() * src.element_size()
    code = d.dtod(dst.data_ptr(), src.data_ptr(), nbytes, stream.cuda_stream)
    if code:
        d.check(code, "cuMemcpyDtoDAsync")


_FAST_EMPTY = {"cuda": "_empty_strided_cuda", "cpu": "_empty_strided_cpu"}
"""torch's allocation without the dispatcher (what code compiled by Inductor allocates
with), by device type: ``(sizes, strides, dtype)``, on the current device."""


def maker(proto: torch.Tensor) -> Any:
    """A function of no arguments that makes a new tensor like ``proto`` (its shape,
    strides, dtype and device; uninitialized, no autograd): what a replayed call's outputs
    are made with. Where torch has it, its allocation without the dispatcher (about half
    the host time of ``torch.empty_like`` on the CPU), checked once here on one trial
    tensor; else ``torch.empty_like``. A CUDA tensor is made on the current device: the
    caller sets it to ``proto``'s (``Nodes.call`` runs on the graph's device). Unlike
    ``torch.empty_like`` it is not filled under ``torch.use_deterministic_algorithms`` and
    not seen by a Python dispatch mode: the output node writes every byte of it before any
    reader, in stream order (``bind`` takes only such nodes)."""
    fallback = functools.partial(torch.empty_like, proto)
    name = _FAST_EMPTY.get(proto.device.type)
    if name is None or not proto.is_contiguous():
        return fallback
    try:
        from torch._C._dynamo import guards

        make = functools.partial(getattr(guards, name), tuple(proto.shape), tuple(proto.stride()), proto.dtype)
        with torch.cuda.device(proto.device) if proto.is_cuda else contextlib.nullcontext():
            t = make()
    except Exception:  # noqa: BLE001 - (a torch without it, or with another signature)
        return fallback
    if type(t) is not torch.Tensor or (t.device, t.shape, t.stride(), t.dtype, t.requires_grad, t.layout) != \
            (proto.device, proto.shape, proto.stride(), proto.dtype, False, torch.strided):
        return fallback
    return make


INVALID_VALUE = 1
"""``CUDA_ERROR_INVALID_VALUE``: the driver refused an update's parameters."""


class NodeUpdateError(RuntimeError):
    """The driver refused a memcpy node's update: the call copies with the driver instead."""


class Nodes:
    """The executable graph, its context, and per moving input and per output its memcpy
    node with the parameters a call changes (see the module docstring)."""

    __slots__ = ("exec", "ctx", "ins", "outs", "pair", "setp", "launch", "check", "first", "at")

    def __init__(self, ex: int, ctx: int, ins: list, outs: list, pair: bool, d: Any) -> None:
        self.exec, self.ctx, self.pair = ex, ctx, pair
        self.ins = tuple(ins)
        """Per moving input: (its argument index, node, parameters, their reference, the
        placeholder, its address, shape, dtype)."""
        self.outs = tuple(outs)
        """Per output: (node, parameters, their reference, the function making a new output
        like its placeholder: ``maker``)."""
        self.setp, self.launch, self.check = d.setp, d.launch, d.check
        self.first = [(node, type(prm).from_buffer_copy(prm)) for _i, node, prm, *_r in self.ins] + \
            [(node, type(prm).from_buffer_copy(prm)) for node, prm, *_r in self.outs]
        """Each node's parameters as captured (its placeholder): ``restore``."""
        self.at = [0] * (len(self.ins) + len(self.outs))
        """Per node (inputs, then outputs), the address the executable graph's node was last
        pointed at by a successful update (0: unknown, or its placeholder): a call whose
        tensor sits at that address makes no update (the node already copies it)."""

    def __repr__(self) -> str:
        return f"memcpy nodes: {len(self.ins)} in, {len(self.outs)} out"

    def call(self, args: tuple, raw: int) -> Any:
        """Point the nodes at this call's activations and at new outputs, launch the graph on
        the stream ``raw`` (the current device must be the graph's: the outputs are made
        there, ``maker``); the new outputs (a tensor, a pair, or None where the graph's
        outputs are cloned by the caller). ``NodeUpdateError`` before the launch where the
        driver refused an update; ``RuntimeError`` naming the call for another failure."""
        setp, ex, ctx, at = self.setp, self.exec, self.ctx, self.at
        k = 0
        for i, node, prm, ref, ph, ph_ptr, shape, dtype in self.ins:
            x = args[i]
            if x.dtype is dtype and x.shape == shape and x.is_contiguous():
                ptr = x.data_ptr()
            else:  # (a broadcast or strided activation: into the placeholder the node read at its capture)
                ph.copy_(x)
                ptr = ph_ptr
            if ptr != at[k]:
                prm.srcDevice, at[k] = ptr, 0
                code = setp(ex, node, ref, ctx)
                if code:
                    self._failed(code)
                at[k] = ptr
            k += 1
        news = []
        for node, prm, ref, make in self.outs:
            t = make()
            ptr = t.data_ptr()
            if ptr != at[k]:
                prm.dstDevice, at[k] = ptr, 0
                code = setp(ex, node, ref, ctx)
                if code:
                    self._failed(code)
                at[k] = ptr
            k += 1
            news.append(t)
        code = self.launch(ex, raw)
        if code:
            self.check(code, "cuGraphLaunch")
        if not news:
            return None
        return (news[0], news[1]) if self.pair else news[0]

    def _failed(self, code: int) -> None:
        if code == INVALID_VALUE:
            raise NodeUpdateError(code)
        self.check(code, "cuGraphExecMemcpyNodeSetParams")

    def restore(self) -> bool:
        """Every node pointed back at its placeholder (as captured); False where an update
        failed."""
        ok = True
        self.at[:] = [0] * len(self.at)  # (pointed back, or unknown after a failed update)
        for node, prm in self.first:
            ok = not self.setp(self.exec, node, ctypes.byref(prm), self.ctx) and ok
        return ok


def bind(graph: Any, ins: list, outs: list, pair: bool) -> Nodes | None:
    """The ``Nodes`` of a graph captured with ``capture_copy``'s copies, or None where they
    cannot be found (the caller then copies with the driver). ``ins``: per moving input
    (index, static, placeholder); ``outs``: per output (the body's output, its
    placeholder: contiguous, of the output's shape and dtype). The graph is instantiated."""
    d = driver()
    try:  # (instantiated by the caller: a kept graph is not by its capture)
        ex, raw_graph = int(graph.raw_cuda_graph_exec()), int(graph.raw_cuda_graph())
    except (RuntimeError, AttributeError, TypeError):
        return None
    found = d.memcpy_nodes(raw_graph)
    ctx = d.context()
    if not ex or not found or not ctx:
        return None
    for _n, p in found:  # an address as base + offset, should the driver keep it so: one address
        p.srcDevice, p.srcXInBytes = p.srcDevice + p.srcXInBytes, 0
        p.dstDevice, p.dstXInBytes = p.dstDevice + p.dstXInBytes, 0

    def node_of(dst: torch.Tensor, src: torch.Tensor) -> tuple | None:
        """The one node copying all of ``src`` into ``dst`` as one row of bytes (the form a
        call's update keeps), or None."""
        n = src.numel() * src.element_size()
        hits = [(nd, p) for nd, p in found if p.dstDevice == dst.data_ptr() and p.srcDevice == src.data_ptr()]
        if len(hits) != 1:
            return None
        p = hits[0][1]
        return hits[0] if (p.WidthInBytes, max(p.Height, 1), max(p.Depth, 1)) == (n, 1, 1) else None

    node_ins, node_outs = [], []
    for i, static, ph in ins:
        hit = node_of(static, ph)
        if hit is None:
            return None
        node, prm = hit
        node_ins.append((i, node, prm, ctypes.byref(prm), ph, ph.data_ptr(), static.shape, static.dtype))
    for o, ob in outs:
        hit = node_of(ob, o)
        if hit is None:
            return None
        node, prm = hit
        node_outs.append((node, prm, ctypes.byref(prm), maker(ob)))
    return Nodes(ex, ctx, node_ins, node_outs, pair, d)
