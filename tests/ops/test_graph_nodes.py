"""Plan graphs whose copies are memcpy nodes of their own, re-pointed per call
(``overlap.ops._graph_nodes``, ``OVERLAP_PLAN_GRAPH_COPIES=nodes``), on the CPU: the stand-in
graph of ``test_plan_graphs`` kept after its capture, and a stand-in driver whose captured
copies are nodes: a node's parameters are the executable graph's, changed by an update and
read by each launch, and its copy moves host memory. The GPU run of the same is
``tests/gpu/plan_graphs_check.py --copies nodes``."""

from __future__ import annotations

import ctypes
import warnings

import pytest
import torch

from overlap import _driver
from overlap.ops import _graph_nodes, _graphs, _state
from tests.ops.test_plan_graphs import _Body, _call, _Graph, fake  # noqa: F401 - ``fake`` is a fixture

Memcpy3D = _driver.Memcpy3D


class _KeptGraph(_Graph):
    """The stand-in graph, kept after its capture: its memcpy nodes are found by its handle."""

    by_handle: dict[int, "_KeptGraph"] = {}

    def __init__(self, keep_graph: bool = False) -> None:
        super().__init__()
        self.keep, self.memcpys, self.instantiated, self.torch_replays = keep_graph, [], 0, 0
        _KeptGraph.by_handle[id(self)] = self

    def instantiate(self) -> None:
        self.instantiated += 1

    def raw_cuda_graph(self) -> int:
        assert self.keep, "a graph not kept has no graph after its capture"
        return id(self)

    def raw_cuda_graph_exec(self) -> int:
        if not self.instantiated:  # (torch: none until ``instantiate`` for a kept graph)
            raise RuntimeError("You cannot access the raw cudaGraphExec_t instance until instantiate()")
        return id(self) + 1

    def replay(self) -> None:  # torch's replay (not the launch of the executable graph)
        self.torch_replays += 1
        super().replay()


class _Driver:
    """The stand-in driver: ``dtod`` in a capture adds a memcpy node whose copy, at each
    launch, moves ``WidthInBytes`` bytes as the executable graph's parameters say."""

    stand_in = True
    check = staticmethod(_driver.check)

    def __init__(self) -> None:
        self.exec_params: dict[int, Memcpy3D] = {}
        self.updates: list[tuple[int, int, int]] = []
        self.fail = lambda node: False  # f(the node being updated): the update fails
        self.launches = 0
        self.next_node = 100
        self.find = True
        self.rows = 1  # a captured copy kept as this many rows of bytes

    def dtod(self, dst: int, src: int, n: int, raw: int) -> int:
        assert all(type(v) is int for v in (dst, src, n, raw))
        g = _Graph.capturing
        if g is None:
            ctypes.memmove(dst, src, n)
            return 0
        node, self.next_node = self.next_node, self.next_node + 1
        p = Memcpy3D(srcDevice=src, dstDevice=dst, WidthInBytes=n // self.rows, Height=self.rows, Depth=1,
                     srcMemoryType=2, dstMemoryType=2, srcPitch=n // self.rows, dstPitch=n // self.rows)
        g.memcpys.append((node, p))
        self.exec_params[node] = Memcpy3D.from_buffer_copy(p)

        def copy(node: int = node) -> None:
            q = self.exec_params[node]
            ctypes.memmove(q.dstDevice, q.srcDevice, q.WidthInBytes * q.Height)

        g.work.append(copy)
        return 0

    def memcpy_nodes(self, handle: int) -> list | None:
        if not self.find:
            return []
        return [(n, Memcpy3D.from_buffer_copy(p)) for n, p in _KeptGraph.by_handle[handle].memcpys]

    def setp(self, ex: int, node: int, ref, ctx: int) -> int:  # noqa: ANN001
        assert ctx == 4242 and node in self.exec_params
        p = Memcpy3D.from_buffer_copy(ref._obj)
        self.updates.append((node, p.srcDevice, p.dstDevice))
        if self.fail(node):
            return 1  # CUDA_ERROR_INVALID_VALUE: the node keeps its parameters
        self.exec_params[node] = p
        return 0

    def launch(self, ex: int, raw: int) -> int:
        self.launches += 1
        _Graph.replay(_KeptGraph.by_handle[ex - 1])  # the executable graph's nodes, not torch's replay
        return 0

    @staticmethod
    def context() -> int:
        return 4242


@pytest.fixture
def noded(fake, monkeypatch):  # noqa: ANN001, ANN201, F811
    drv = _Driver()
    monkeypatch.setattr(_graph_nodes, "_drv", drv)
    monkeypatch.setattr(fake.cuda, "CUDAGraph", _KeptGraph)
    monkeypatch.setenv("OVERLAP_PLAN_GRAPH_COPIES", "nodes")
    fake.drv = drv
    return fake


def _once(node: int):  # noqa: ANN202
    """A ``_Driver.fail`` refusing the first update of ``node`` only."""
    left = [True]

    def fail(n: int) -> bool:
        hit, left[0] = left[0] and n == node, left[0] and n != node
        return hit

    return fail


def _graphed(f, body, b):  # noqa: ANN001, ANN202
    for _ in range(_graphs.CAPTURE_AT):
        _call(f, body, torch.randn(6, 8), b, torch.randn(6, 4))
    g = body.gstate.graph
    assert g is not None and g.nodes is not None
    return g


def test_nodes_follow_each_call(noded) -> None:  # noqa: ANN001
    """Each call points the input nodes at its activations (no host copy of a contiguous
    one) and the output node at a new tensor, then launches the executable graph (not
    torch's replay); a broadcast residual is copied into its node's placeholder; new inputs
    every call, earlier outputs unchanged, the weight read in place."""
    body, b = _Body(), torch.randn(8, 4)
    g = _graphed(noded, body, b)
    assert g.graph.keep and g.graph.instantiated == 1 and len(g.graph.memcpys) == 3  # two in, one out
    assert "memcpy nodes: 2 in, 1 out" in repr(g)
    (_, n_a, *_r), (_, n_r, prm_r, _ref, ph_r, ph_r_ptr, *_s) = g.nodes.ins
    n_out = g.nodes.outs[0][0]
    launches, outs = noded.drv.launches, []
    for it in range(6):
        a, r = torch.randn(6, 8), torch.randn(6, 4)
        if it == 4:
            r = torch.randn(4).expand(6, 4)
        del noded.drv.updates[:]
        was = list(g.nodes.at)  # (a node already at a call's address is not updated again)
        got = _call(noded, body, a, b, r)
        torch.testing.assert_close(got, torch.addmm(r, a, b))
        outs.append((got, got.clone()))
        src_r = ph_r_ptr if it == 4 else r.data_ptr()
        want = [(n_a, a.data_ptr(), g.nodes.ins[0][2].dstDevice), (n_r, src_r, prm_r.dstDevice),
                (n_out, g.nodes.outs[0][1].srcDevice, got.data_ptr())]
        want = [u for u, at, now in zip(want, was, (a.data_ptr(), src_r, got.data_ptr())) if at != now]
        assert noded.drv.updates == want, noded.drv.updates
        assert g.nodes.at == [a.data_ptr(), src_r, got.data_ptr()]
        if it == 4:
            torch.testing.assert_close(ph_r, r)
        if it == 2:
            b.mul_(-1)  # changed in place: read by the next launch
    for got, was in outs:
        assert torch.equal(got, was), "a later call changed an earlier output"
    assert noded.drv.launches - launches == 6 and g.graph.torch_replays == 0
    assert _graphs.stats["noded"] == _graphs.stats["replayed"] == 7  # (and the capturing call's)


def test_a_node_already_at_the_calls_address_is_not_updated(noded) -> None:  # noqa: ANN001
    """An activation at the address its node was last pointed at (a loop's allocator handing
    the same block back) makes no update: the node reads what lies there at the launch, so
    new values in place are read; a tensor elsewhere is updated to; once the nodes are
    pointed back at their placeholders (``restore``) every node is updated again."""
    body, b = _Body(), torch.randn(8, 4)
    g = _graphed(noded, body, b)
    (_, n_a, *_r), (_, n_r, *_s) = g.nodes.ins
    n_out = g.nodes.outs[0][0]
    a, r = torch.randn(6, 8), torch.randn(6, 4)
    got = _call(noded, body, a, b, r)  # (r and the output kept: the next ones lie elsewhere)
    for _ in range(3):
        a.copy_(torch.randn(6, 8))  # new values, same address
        r = torch.randn(6, 4)  # (allocated while the last one lives: another address)
        del noded.drv.updates[:]
        got = _call(noded, body, a, b, r)
        torch.testing.assert_close(got, torch.addmm(r, a, b))
        assert [u[0] for u in noded.drv.updates] == [n_r, n_out], noded.drv.updates
    assert g.nodes.restore()
    a.copy_(torch.randn(6, 8))
    del noded.drv.updates[:]
    got = _call(noded, body, a, b, r)
    torch.testing.assert_close(got, torch.addmm(r, a, b))
    assert [u[0] for u in noded.drv.updates] == [n_a, n_r, n_out], noded.drv.updates


def test_a_failed_update_falls_back_to_driver_copies(noded) -> None:  # noqa: ANN001
    """A node the driver will not update: the nodes are pointed back at their placeholders
    (warned once), and that call and every later one copy into the placeholders and clone
    out of the output's, through torch's replay: right results, no raise."""
    body, b = _Body(), torch.randn(8, 4)
    g = _graphed(noded, body, b)
    phs = {node: ph_ptr for _i, node, _p, _r, _ph, ph_ptr, *_s in g.nodes.ins}
    out_node, out_ph = g.nodes.outs[0][0], g.out.data_ptr()
    del noded.drv.updates[:]
    g.nodes.at[:] = [0] * len(g.nodes.at)  # (every node updated: none left at a freed tensor's address)
    r_node = g.nodes.ins[1][1]
    noded.drv.fail = _once(r_node)  # the call's second update (the restore's taken)
    _state._warned.discard("plan-graph-nodes-update")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a, r = torch.randn(6, 8), torch.randn(6, 4)
        got = _call(noded, body, a, b, r)
    torch.testing.assert_close(got, torch.addmm(r, a, b))
    assert any("could not be updated (CUresult 1)" in str(x.message) for x in w), [str(x.message) for x in w]
    assert g.nodes is None and g.graph.torch_replays == 1
    for node, src in phs.items():  # every node as captured: reading its placeholder
        assert noded.drv.exec_params[node].srcDevice == src
    assert noded.drv.exec_params[out_node].dstDevice == out_ph
    outs = [(got, got.clone())]
    for it in range(3):
        a, r = torch.randn(6, 8), torch.randn(6, 4)
        got = _call(noded, body, a, b, r)
        torch.testing.assert_close(got, torch.addmm(r, a, b))
        outs.append((got, got.clone()))
    for got, was in outs:
        assert torch.equal(got, was)
    assert g.graph.torch_replays == 4 and _graphs.stats["noded"] == 1  # (the capturing call's)


def test_nodes_neither_updated_nor_restored_run_the_fused_body(noded) -> None:  # noqa: ANN001
    """No update taken at all (nor the restore): the graph is dropped before anything is
    launched, the call runs the fused body (the same collectives as its peers' graphs: no
    raise on one rank after the agreement point), warned, and the signature runs without a
    graph from then on (never a launch reading an earlier call's tensors)."""
    body, b = _Body(), torch.randn(8, 4)
    g = _graphed(noded, body, b)
    launches, fused = noded.drv.launches, body.fused_calls
    noded.drv.fail = lambda node: True
    _state._warned.discard("plan-graph-nodes-restore")
    a, r = torch.randn(6, 8), torch.randn(6, 4)
    del noded.log[:]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = _call(noded, body, a, b, r)
    torch.testing.assert_close(got, torch.addmm(r, a, b))
    assert any("nor pointed back at its placeholder" in str(x.message) for x in w), [str(x.message) for x in w]
    assert noded.drv.launches == launches and g.graph is None and body.gstate.off
    assert body.fused_calls == fused + 1 and noded.log[:3] == ["agreed", "recorded", "begin"] and "end" in noded.log
    assert _call(noded, body, torch.randn(6, 8), b, torch.randn(6, 4)) is _graphs.NO


def test_an_update_error_other_than_a_refusal_raises(noded) -> None:  # noqa: ANN001
    """An update failing with another code than ``CUDA_ERROR_INVALID_VALUE`` (the context's
    sticky error of an earlier launch) raises naming the call, as a failed launch does; the
    graph keeps its nodes (the next call points every one of them again)."""
    body, b = _Body(), torch.randn(8, 4)
    g = _graphed(noded, body, b)
    real = noded.drv.setp
    noded.drv.setp = lambda *a: 700
    g.nodes.setp = noded.drv.setp
    with pytest.raises(RuntimeError, match=r"cuGraphExecMemcpyNodeSetParams failed with CUresult 700"):
        _call(noded, body, torch.randn(6, 8), b, torch.randn(6, 4))
    g.nodes.setp = real
    a, r = torch.randn(6, 8), torch.randn(6, 4)
    torch.testing.assert_close(_call(noded, body, a, b, r), torch.addmm(r, a, b))
    assert g.nodes is not None


def test_a_graph_that_cannot_be_instantiated_is_refused(noded, monkeypatch) -> None:  # noqa: ANN001
    """A kept graph is instantiated at its capture: a failure there refuses the capture (the
    call runs as before, the signature never captured again), never a later replay that
    instantiates after the agreement point."""
    def fail(self) -> None:  # noqa: ANN001
        raise RuntimeError("out of memory")

    monkeypatch.setattr(_KeptGraph, "instantiate", fail)
    body, b = _Body(), torch.randn(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2 * _graphs.CAPTURE_AT):
            assert _call(noded, body, torch.randn(6, 8), b, torch.randn(6, 4)) is _graphs.NO
    assert body.gstate.off and body.gstate.graph is None and _graphs.stats["refused"] == 1
    _state._warned.discard("plan-graph-test_op-RuntimeError")  # (warned once per process: others expect it)


def test_nodes_not_found_copy_with_the_driver(noded) -> None:  # noqa: ANN001
    """A graph whose copies are not found among its memcpy nodes: warned, its calls copy into
    the placeholders and out of the output's placeholder (which the graph's own copies
    read and fill), right every call."""
    noded.drv.find = False
    _not_found(noded)


def test_nodes_of_another_form_copy_with_the_driver(noded) -> None:  # noqa: ANN001
    """A captured copy the driver keeps as two rows of bytes (not the one row a call's update
    re-points): not taken as the call's node; the graph copies with the driver."""
    noded.drv.rows = 2
    _not_found(noded)


def _not_found(noded) -> None:  # noqa: ANN001
    body, b = _Body(), torch.randn(8, 4)
    _state._warned.discard("plan-graph-nodes-test_op")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(_graphs.CAPTURE_AT):
            _call(noded, body, torch.randn(6, 8), b, torch.randn(6, 4))
    assert any("memcpy nodes could not be found" in str(x.message) for x in w)
    g = body.gstate.graph
    assert g.nodes is None and len(g.graph.memcpys) == 3
    for _ in range(3):
        a, r = torch.randn(6, 8), torch.randn(6, 4)
        torch.testing.assert_close(_call(noded, body, a, b, r), torch.addmm(r, a, b))
    assert noded.drv.launches == 0 and _graphs.stats["noded"] == 0


@pytest.mark.parametrize("value, want", [("nodes", True), ("driver", False), (None, True), ("graph", False)])
def test_nodes_only_where_asked_and_usable(noded, monkeypatch, value, want) -> None:  # noqa: ANN001
    """Memcpy nodes with ``OVERLAP_PLAN_GRAPH_COPIES=nodes`` or unset (the default) and a
    driver that has the graph calls (none here: the real driver of a machine without a GPU);
    else a graph without copies of its own, its statics read by its body."""
    if value is None:
        monkeypatch.delenv("OVERLAP_PLAN_GRAPH_COPIES")
    elif value == "graph":  # (no relay on the CPU: the graph is as with driver copies)
        monkeypatch.setattr(_graphs, "_relay_ok", lambda dev: False)
        monkeypatch.setenv("OVERLAP_PLAN_GRAPH_COPIES", value)
    else:
        monkeypatch.setenv("OVERLAP_PLAN_GRAPH_COPIES", value)
    body, b = _Body(), torch.randn(8, 4)
    for _ in range(_graphs.CAPTURE_AT):
        _call(noded, body, torch.randn(6, 8), b, torch.randn(6, 4))
    g = body.gstate.graph
    assert (g.nodes is not None) == want and (len(g.graph.memcpys) == 3) == want
    if want:
        monkeypatch.setattr(_graph_nodes, "_drv", False)  # no driver graph calls: a plain graph
        body = _Body()
        for _ in range(_graphs.CAPTURE_AT):
            _call(noded, body, torch.randn(6, 8), b, torch.randn(6, 4))
        g = body.gstate.graph
        assert g.nodes is None and not g.graph.keep and not g.graph.memcpys
    a, r = torch.randn(6, 8), torch.randn(6, 4)
    torch.testing.assert_close(_call(noded, body, a, b, r), torch.addmm(r, a, b))


def test_copy_parameters_are_the_drivers_struct() -> None:
    """``Memcpy3D`` is ``CUDA_MEMCPY3D`` (200 bytes; the pointers and width where the
    driver reads them); without a driver library the graph calls are None."""
    assert ctypes.sizeof(Memcpy3D) == 200
    assert (Memcpy3D.srcDevice.offset, Memcpy3D.dstDevice.offset, Memcpy3D.WidthInBytes.offset) == (48, 136, 176)
    assert (Memcpy3D.srcMemoryType.offset, Memcpy3D.dstMemoryType.offset, Memcpy3D.Depth.offset) == (32, 120, 192)
    if not _driver._load():
        assert _driver.graph_launch() is None and _driver.exec_memcpy_set() is None
        assert _driver.memcpy_nodes(1) is None and _driver.current_context() is None


def test_a_refused_output_update_falls_back_too(noded) -> None:  # noqa: ANN001
    """The output node's update refused (the inputs' taken): every node, the inputs' too, is
    pointed back at its placeholder, and the call's output comes from the output's
    placeholder through torch's replay: right, and a new tensor."""
    body, b = _Body(), torch.randn(8, 4)
    g = _graphed(noded, body, b)
    phs = {node: ph_ptr for _i, node, _p, _r, _ph, ph_ptr, *_s in g.nodes.ins}
    del noded.drv.updates[:]
    g.nodes.at[:] = [0] * len(g.nodes.at)  # (every node updated: none left at a freed tensor's address)
    out_node = g.nodes.outs[0][0]
    noded.drv.fail = _once(out_node)  # the call's last update, its output's (the restore's taken)
    _state._warned.discard("plan-graph-nodes-update")
    a, r = torch.randn(6, 8), torch.randn(6, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _call(noded, body, a, b, r)
    torch.testing.assert_close(got, torch.addmm(r, a, b))
    assert got.data_ptr() != g.out.data_ptr() and g.nodes is None and g.graph.torch_replays == 1
    for node, src in phs.items():
        assert noded.drv.exec_params[node].srcDevice == src, "an input node left on the call's tensor"
    a2, r2 = torch.randn(6, 8), torch.randn(6, 4)
    torch.testing.assert_close(_call(noded, body, a2, b, r2), torch.addmm(r2, a2, b))
    torch.testing.assert_close(got, torch.addmm(r, a, b))  # the earlier output unchanged


def test_a_graphs_nodes_read_through_the_driver(monkeypatch) -> None:  # noqa: ANN001
    """``_driver.memcpy_nodes`` and ``node_kinds`` on a stand-in driver library: the graph's
    nodes listed (count first, then the handles), each one's kind asked, the memcpy nodes'
    parameters read; a failing call gives None."""
    kinds = {11: 0, 12: 1, 13: 12, 14: 1, 15: 3}  # kernel, memcpy, batch mem op, memcpy, host
    fail = {"get": False}

    class Lib:
        graphs = True

        def cuGraphGetNodes(self, graph, nodes, count):  # noqa: ANN001, ANN201, N802
            assert graph == 77
            if fail["get"]:
                return 1
            if nodes is not None:
                for i, n in enumerate(kinds):
                    nodes[i] = n
            count._obj.value = len(kinds)
            return 0

        def cuGraphNodeGetType(self, node, out):  # noqa: ANN001, ANN201, N802
            out._obj.value = kinds[node]
            return 0

        def cuGraphMemcpyNodeGetParams(self, node, out):  # noqa: ANN001, ANN201, N802
            assert kinds[node] == 1
            out._obj.srcDevice, out._obj.dstDevice, out._obj.WidthInBytes = 1000 + node, 2000 + node, 64
            return 0

    monkeypatch.setattr(_driver, "_lib", Lib())
    got = _driver.memcpy_nodes(77)
    assert [(n, p.srcDevice, p.dstDevice, p.WidthInBytes) for n, p in got] == [(12, 1012, 2012, 64),
                                                                               (14, 1014, 2014, 64)]
    assert _driver.node_kinds(77) == {"kernel": 1, "memcpy": 2, "batch mem op": 1, "host": 1}
    fail["get"] = True
    assert _driver.memcpy_nodes(77) is None and _driver.node_kinds(77) is None


def test_new_outputs_are_made_without_the_dispatcher_where_torch_can(noded) -> None:  # noqa: ANN001
    """A replayed call's outputs come from ``maker``: torch's allocation without the
    dispatcher where it has one that makes a tensor like the placeholder (checked once on a
    trial tensor), else ``torch.empty_like``; either way a new tensor of the placeholder's
    shape, strides, dtype and device per call."""
    from torch._C._dynamo import guards

    proto = torch.randn(6, 4)
    make = _graph_nodes.maker(proto)
    assert getattr(make, "func", None) is guards._empty_strided_cpu, make
    a, b = make(), make()
    for t in (a, b):
        assert (t.shape, t.stride(), t.dtype, t.device, t.requires_grad) == (proto.shape, proto.stride(), proto.dtype,
                                                                              proto.device, False)
    assert len({proto.data_ptr(), a.data_ptr(), b.data_ptr()}) == 3
    # another layout, or an allocation that does not make what it is asked for: torch.empty_like
    assert _graph_nodes.maker(proto.t()).func is torch.empty_like
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(guards, "_empty_strided_cpu", lambda size, stride, dtype: torch.empty(size[::-1], dtype=dtype))
        wrong = _graph_nodes.maker(proto)
        assert wrong.func is torch.empty_like and wrong().shape == proto.shape
        mp.delattr(guards, "_empty_strided_cpu")
        assert _graph_nodes.maker(proto).func is torch.empty_like
    # the graph's output node takes the fast one; each call's output is new
    body, w = _Body(), torch.randn(8, 4)
    g = _graphed(noded, body, w)
    assert g.nodes.outs[0][3].func is guards._empty_strided_cpu
    x, r = torch.randn(6, 8), torch.randn(6, 4)
    got = _call(noded, body, x, w, r)
    again = _call(noded, body, torch.randn(6, 8), w, r)
    assert got.data_ptr() != again.data_ptr()
    torch.testing.assert_close(got, torch.addmm(r, x, w))
