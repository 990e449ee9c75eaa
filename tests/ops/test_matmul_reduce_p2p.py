"""The producer ops' peer-copy transport (``overlap/ops/matmul_reduce_p2p.py``).

Pure logic: the push layout (every destination's rows reach it once from every peer,
into the slot and at the flag its reduce kernel reads). Under the Triton interpreter:
the whole p2p path (``run_p2p`` around ``_fused_p2p``: the GEMM posting per-chunk
counters, the pushes behind them, the flags, the reduce kernel) for 2 ranks, each rank a
thread on a stand-in runtime whose pushes really copy into the peer's buffer and write the
peer's flags, against one unsharded reference with new inputs every call; a lost push
(a timeout naming rank, flag, expected and seen values), ranks that disagree, and an
exception before the first push, each followed by a correct call. The front's choice of
transport on a CPU runtime.
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import ExitStack
from typing import Any
from unittest import mock

import pytest
import torch

from overlap.ops import matmul_reduce_p2p as mrp
from overlap.ops.matmul_reduce import ChunkMap, producer_table
from overlap.policies import push_slot
from tests._interp import interpreted

TOL16 = 2e-3


# --------------------------------------------------------------------------
# the push layout, as pure logic
# --------------------------------------------------------------------------

@pytest.mark.parametrize("world,m,chunks", [(2, 600, 3), (3, 390, 2), (4, 1024, 4), (8, 8 * 300, 2), (2, 40, 3)])
@pytest.mark.parametrize("scatter", [True, False])
def test_push_layout_delivers_every_row_once(world: int, m: int, chunks: int, scatter: bool) -> None:
    """Every rank's partial C_r [M, N] pushed by the layouts of all ranks into their
    destinations' receive buffers, then summed there as the reduce kernel does (own rows
    from C, a peer's from its slot, once the flag it waits on is set): each rank gets
    the sum of its block (reduce-scatter) or of all rows (all-reduce), every flag is
    set once, and no push writes outside its slot's chunk."""
    n, align = 3, 16
    g = torch.Generator().manual_seed(world * 1000 + m + chunks)
    parts = [torch.randn(m, n, generator=g, dtype=torch.float64) for _ in range(world)]
    lays = [mrp.push_layout(world, r, m, chunks, scatter, align) for r in range(world)]
    rows = m // world if scatter else m
    assert all(lay.block_rows == rows and sum(lay.chunk_rows) == rows for lay in lays)
    recv = [torch.full(((world - 1) * rows, n), float("nan"), dtype=torch.float64) for _ in range(world)]
    flags = [dict() for _ in range(world)]
    for s, lay in enumerate(lays):
        for c in range(len(lay.chunk_rows)):
            pushes = lay.pushes(c)
            assert sorted(p.dest for p in pushes) == [d for d in range(world) if d != s]
            for p in pushes:
                slot = push_slot(s, p.dest, world)
                # inside the destination's slot, at this chunk's rows of the block
                assert p.dst_row == slot * rows + lay.chunk_starts[c] and p.rows == lay.chunk_rows[c]
                assert p.src_row == lay.block_start(p.dest) + lay.chunk_starts[c]
                assert torch.isnan(recv[p.dest][p.dst_row:p.dst_row + p.rows]).all(), "written twice"
                recv[p.dest][p.dst_row:p.dst_row + p.rows] = parts[s][p.src_row:p.src_row + p.rows]
                assert p.flag not in flags[p.dest], "a flag set twice"
                assert p.flag % lay.stride < lay.stride - 2, "a push on a signature word"
                flags[p.dest][p.flag] = s
    full = sum(parts)
    for r, lay in enumerate(lays):
        assert not torch.isnan(recv[r]).any(), "rows never pushed"
        x = parts[r][lay.block_start(r):lay.block_start(r) + rows]
        got = torch.empty_like(x)
        for c, (st, cr) in enumerate(zip(lay.chunk_starts, lay.chunk_rows)):
            tot = torch.zeros(cr, n, dtype=torch.float64)
            for q in range(world):
                if q == r:
                    tot += x[st:st + cr]
                    continue
                assert flags[r].pop(lay.recv_flag(q, c)) == q, "the reduce kernel waits on another flag"
                slot = push_slot(q, r, world)
                tot += recv[r][slot * rows + st:slot * rows + st + cr]
            got[st:st + cr] = tot
            # the own flag: in the region after every sender slot's, not a signature word
            assert lay.own_flag(c) // lay.stride == world - 1 and lay.own_flag(c) % lay.stride < lay.stride - 2
        assert not flags[r], f"flags nobody waits on: {flags[r]}"
        want = full[r * rows:(r + 1) * rows] if scatter else full
        torch.testing.assert_close(got, want)


def test_push_layout_gemm_order_and_counts() -> None:
    """The GEMM's segments come chunk by chunk, C in natural row order (c_row == a_row),
    every row once; each chunk's tile count is what its tiles post."""
    lay = mrp.push_layout(2, 1, 600, 2, True)
    segs = lay.segments()
    assert [c for _, c in segs] == [0, 0, 1, 1]
    assert [(s.a_row, s.c_row, s.rows) for s, _ in segs] == [(0, 0, 256), (300, 300, 256), (256, 256, 44),
                                                            (556, 556, 44)]
    table, counts = producer_table(ChunkMap(lay.chunk_starts, lay.chunk_rows, tuple(segs), 600), 300, 64, 128)
    assert counts == [2 * 4 * 3, 2 * 1 * 3] and [row[7] for row in table] == [0] * 24 + [1] * 6
    ar = mrp.push_layout(3, 2, 300, 3, False)
    assert [(s.a_row, s.rows) for s, _ in ar.segments()] == [(0, 128), (128, 128), (256, 44)]
    assert [(p.dest, p.src_row, p.dst_row, p.flag) for p in ar.pushes(1)] == \
        [(0, 128, 300 + 128, ar.stride + 1), (1, 128, 128, 1)]  # rank 2 is rank 0's slot 1, rank 1's slot 0


def test_push_layout_refuses() -> None:
    with pytest.raises(ValueError, match="at least 2 ranks"):
        mrp.push_layout(1, 0, 256, 1, True)
    with pytest.raises(ValueError, match="multiple of the 3 ranks"):
        mrp.push_layout(3, 0, 100, 1, True)
    with pytest.raises(ValueError, match="at most 126 chunks"):
        mrp.push_layout(8, 0, 8 * 200, 200, True, align=1)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        mrp.push_layout(2, 2, 256, 1, False)


def test_front_picks_the_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    """``transport="p2p"`` (or ``PeerCopyTransport``, or ``OVERLAP_TRANSPORT=p2p``) selects the
    peer-copy path; where peer memory is unavailable (here one rank) it raises the all-reduce
    op's RuntimeError; a config naming none takes NCCL."""
    from overlap.ops import OverlapConfig, PeerCopyTransport
    from overlap.ops import matmul_reduce as mr
    from tests.ops._cpu_runtime import cpu_runtime

    monkeypatch.delenv("OVERLAP_TRANSPORT", raising=False)
    rt = cpu_runtime()
    assert mr._transport(rt, OverlapConfig()) == "nccl"
    assert mr._transport(rt, OverlapConfig(transport="nccl")) == "nccl"
    for cfg in (OverlapConfig(transport="p2p"), OverlapConfig(transport=PeerCopyTransport(reduce_ctas=8))):
        with pytest.raises(RuntimeError, match="cannot use peer memory: one rank"):
            mr._transport(rt, cfg)
    monkeypatch.setenv("OVERLAP_TRANSPORT", "p2p")
    with pytest.raises(RuntimeError, match="cannot use peer memory"):
        mr._transport(rt, OverlapConfig())
    assert mr._transport(rt, OverlapConfig(transport="nccl")) == "nccl"
    # the p2p runtime stand-in says yes
    monkeypatch.setattr(rt, "transport", lambda cfg: "p2p")
    assert mr._transport(rt, OverlapConfig()) == "p2p"


# --------------------------------------------------------------------------
# two ranks as threads, kernels interpreted
# --------------------------------------------------------------------------

class _World:
    """What the two ranks share: the peer blocks (real CPU memory, every rank's block
    addressable by its pointer) and the lock that serializes the interpreter's kernels."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.blocks: dict[str, list[torch.Tensor]] = {}
        self.lock = threading.RLock()
        self.kernel_lock = threading.Lock()
        self.barrier = threading.Barrier(world)
        self.outs: dict[int, torch.Tensor] = {}  # each rank's last reduce kernel's output
        self.lost: set[tuple[int, int]] = set()  # (flags address, index): stream flag writes that never land

    def block(self, name: str, nbytes: int) -> list[torch.Tensor]:
        with self.lock:
            b = self.blocks.get(name)
            if b is None or b[0].numel() < nbytes:
                b = self.blocks[name] = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(self.world)]
            return b


class _RankBlock:
    """``overlap._p2p.SharedBlock`` as rank ``rank`` sees it."""

    def __init__(self, bufs: list[torch.Tensor], rank: int) -> None:
        self.bufs, self.rank, self.world = bufs, rank, len(bufs)
        self.nbytes = bufs[0].numel()
        self.ptrs = [b.data_ptr() for b in bufs]

    def tensor(self, r: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        esize = torch.empty((), dtype=dtype).element_size()
        assert offset + n * esize <= self.nbytes
        return self.bufs[r][offset:offset + n * esize].view(dtype).view(shape)


class _Heap:
    """``overlap._p2p.PeerHeap`` over a ``_World``, with the real ``SharedFlags``."""

    def __init__(self, world: _World, rank: int) -> None:
        from overlap._p2p import SharedFlags

        self.w, self.rank, self._SharedFlags = world, rank, SharedFlags
        self.flag_block = _RankBlock(world.block("<flags>", 16 * 1024 * 4), rank)
        self._flags: dict[str, Any] = {}

    def flags(self, name: str, n: int) -> Any:
        f = self._flags.get(name)
        if f is None:
            f = self._flags[name] = self._SharedFlags(self.flag_block, 1024 * 4 * (2 + len(self._flags)), 1024)
        assert n <= f.n, n
        return f

    def block(self, name: str, nbytes: int) -> _RankBlock:
        return _RankBlock(self.w.block(name, nbytes), self.rank)


class _PeerRt:
    """A ``Runtime`` of rank ``rank`` on the CPU for the p2p producer path: its pushes copy
    the bytes into the peer's block (``ctypes.memmove``) and then set the peer's flag."""

    from overlap.ops._runtime import Runtime as _R

    cache = _R.cache
    device, num_sms, group = torch.device("cpu"), 12, None

    class Stream:
        def wait_event(self, ev: Any) -> None:
            pass

    class Order:
        def __init__(self) -> None:
            self.lock = threading.RLock()

        def begin(self, cur: Any) -> None:
            pass

        end = begin

    def __init__(self, world: _World, rank: int) -> None:
        from overlap.ops._runtime import LocalWords

        self.w, self.world, self.rank, self.ranks = world, world.world, rank, tuple(range(world.world))
        self._caches: dict[str, Any] = {}
        self.heap = _Heap(world, rank)
        self.comm_stream, self.aux_stream, self.copy_stream = self.Stream(), self.Stream(), self.Stream()
        self.order, self._local, self.errs = self.Order(), LocalWords(self.device), {}
        self.pushes, self.log = 0, []
        self.drop: set[int] = set()  # chunk indices whose pushes this rank loses (a failing link)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream()

    def p2p(self) -> _Heap:
        return self.heap

    def local_words(self, name: str, n_counters: int, n_flags: int) -> Any:
        return self._local.get(name, n_counters, n_flags)

    def err(self, name: str) -> Any:
        from overlap.flags import ErrorWord

        return self.errs.setdefault(name, ErrorWord("cpu", what=f"{name} (rank {self.rank})"))

    def push(self, dst: int, src: int, nbytes: int, flags: torch.Tensor, idx: int, value: int) -> None:
        self.log.append((dst, src, nbytes, idx, value))
        self.pushes += 1
        if idx % (1024 // self.world) in self.drop:
            return
        ctypes.memmove(dst, src, nbytes)
        flags[idx] = value

    def fork(self, *a: Any) -> None:
        pass

    join = p2p_begin = p2p_end = fork


def _patched(world: _World) -> ExitStack:
    """Stream calls as program order (the interpreter runs a grid to its end at launch), the
    kernels one at a time, and each reduce kernel launched only once both ranks have queued
    their GEMM and pushes (a real GPU runs them at once; the interpreter cannot)."""
    from overlap import flags as fl
    from overlap.kernels.add_norm import ReducePlan
    from overlap.kernels.tile_gemm import TileGemmPlan

    def wait_value(stream: Any, flags: torch.Tensor, idx: int, value: int) -> None:
        assert int(flags[idx]) >= value, f"the copy stream would wait on counter {idx}: {int(flags[idx])} < {value}"

    def write_value(stream: Any, flags: torch.Tensor, idx: int, value: int) -> None:
        if (flags.data_ptr(), idx) not in world.lost:
            flags[idx] = value

    def zero(stream: Any, t: torch.Tensor, n: int) -> None:
        t[:n] = 0

    gemm_launch, reduce_launch, reduce_init = TileGemmPlan.launch, ReducePlan.launch, ReducePlan.__init__

    def gemm(self: Any, *a: Any, **kw: Any) -> Any:
        with world.kernel_lock:
            return gemm_launch(self, *a, **kw)

    def reduce(self: Any, *a: Any, **kw: Any) -> Any:
        world.barrier.wait(timeout=120)
        world.outs[self.tail[0]] = a[2]
        with world.kernel_lock:
            return reduce_launch(self, *a, **kw)

    def init(self: Any, *a: Any, **kw: Any) -> None:
        kw["max_spins"] = 50  # an interpreted wait is bounded by spins, not time
        reduce_init(self, *a, **kw)

    stack = ExitStack()
    stack.enter_context(mock.patch.object(torch.cuda, "current_stream", lambda *a: _PeerRt.Stream()))
    stack.enter_context(mock.patch.object(torch.cuda, "set_stream", lambda s: None))
    stack.enter_context(mock.patch.object(fl, "stream_write_value", write_value))
    stack.enter_context(mock.patch.object(fl, "stream_zero", zero))
    stack.enter_context(mock.patch.object(fl, "stream_wait_value", wait_value))
    stack.enter_context(mock.patch.object(TileGemmPlan, "launch", gemm))
    stack.enter_context(mock.patch.object(ReducePlan, "launch", reduce))
    stack.enter_context(mock.patch.object(ReducePlan, "__init__", init))
    return stack


def _both(rts: list[_PeerRt], fn: Any) -> list[Any]:
    """``fn(rank)`` on every rank at once, one thread each; results or raised exceptions."""
    out: list[Any] = [None] * len(rts)

    def run(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out[r] = e

    ths = [threading.Thread(target=run, args=(r,)) for r in range(len(rts))]
    for t in ths:
        t.start()
    for t in ths:
        t.join(timeout=180)
        assert not t.is_alive(), "a rank hung"
    return out


def _case(world: int, m: int, n: int, k: int, seed: int, layout: str, with_res: bool) -> tuple:
    """One unsharded problem (A [M, K], W [N, K], residual [M, N]), sharded along K."""
    g = torch.Generator().manual_seed(seed)
    a_full = torch.randn(m, k, generator=g).half()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).half()
    res = torch.randn(m, n, generator=g).half() if with_res else None
    ks = k // world
    shards = []
    for r in range(world):
        wr = w[:, r * ks:(r + 1) * ks]
        shards.append((a_full[:, r * ks:(r + 1) * ks].contiguous(), wr.t() if layout == "wt" else wr.t().contiguous()))
    return shards, res, a_full.double() @ w.double().t()


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return ((x.double() - y.double()).norm() / y.double().norm()).item()


def _call(rt: _PeerRt, op: str, a: torch.Tensor, b: torch.Tensor, res: Any, cfg: Any) -> torch.Tensor:
    from overlap.ops._runtime import run_p2p

    return run_p2p(rt, op, mrp._fused_p2p, rt, op, a, b, res, cfg)  # what the op's front calls


GEMM = dict(block_m=32, block_n=32, block_k=16, num_stages=1, num_warps=4)


@interpreted
def test_p2p_producer_ops() -> None:
    """Both ops at 2 ranks, kernels interpreted: chunkings of 1-3 row chunks (M/R = 300:
    chunks of 128, 128 and 44 rows), both B layouts, the residual or not, the reduce
    programs on SMs of their own or beside the GEMM's, 3 calls each with new inputs (both
    call parities, then plans and views reused): every rank's output against the unsharded
    product, each call's pushes (one per chunk and peer, the destination's rows only for
    the reduce-scatter), every chunk's own flag and peer flag at the call's epoch."""
    from overlap.kernels.tile_gemm import GemmConfig
    from overlap.ops import OverlapConfig
    from overlap.ops import matmul_reduce as mr
    from overlap.ops.all_reduce_p2p import SHARED_SMS

    world = _World(2)
    rts = [_PeerRt(world, r) for r in range(2)]
    m, n, k = 600, 32, 32
    calls, before = 0, dict(mr.stats)
    only: list = []
    real_plan = mrp.gemm_plan
    with _patched(world), mock.patch.object(mrp, "gemm_plan", lambda *a_, **kw: (only.append(
            kw.get("tile_only")), real_plan(*a_, **kw))[1]):
        for op, chunks, layout, with_res, shared in (
                ("matmul_reduce_scatter", 3, "wt", False, False), ("matmul_reduce_scatter", 1, "kn", False, True),
                ("matmul_all_reduce", 3, "wt", True, False), ("matmul_all_reduce", 2, "kn", False, True)):
            scatter = op == "matmul_reduce_scatter"
            cfg = OverlapConfig(chunks=chunks, reduce_ctas=2, reduce_shared=shared, check="sync", transport="p2p",
                                gemm=GemmConfig(**GEMM))
            for it in range(3):
                shards, res, full = _case(2, m, n, k, 100 * it + chunks + 7 * scatter, layout, with_res)
                marks = [len(rt.log) for rt in rts]
                outs = _both(rts, lambda r: _call(rts[r], op, *shards[r], res, cfg))
                for r, got in enumerate(outs):
                    assert isinstance(got, torch.Tensor), (op, r, it, got)
                    want = (full[r * (m // 2):(r + 1) * (m // 2)] if scatter
                            else full + (res.double() if res is not None else 0))
                    assert got.shape == want.shape and _rel(got, want) < TOL16, (op, chunks, layout, r, it,
                                                                                 _rel(got, want))
                    lay = mrp.push_layout(2, r, m, chunks, scatter)
                    rows = lay.chunk_rows
                    log = rts[r].log[marks[r]:]
                    assert [nb for _, _, nb, _, _ in log] == [cr * n * 2 for cr in rows], (op, log)
                    sf = rts[r].heap.flags(op, 1)
                    e = sf.epoch
                    # C's rows of the peer's block (or of all M), chunk by chunk, into the peer's
                    # slot 0 of the call parity's half, each with its chunk's flag and the epoch
                    src0 = min(s for _, s, _, _, _ in log)
                    assert [s - src0 for _, s, _, _, _ in log] == [st * n * 2 for st in lay.chunk_starts], log
                    base, half = world.blocks[op][1 - r].data_ptr(), world.blocks[op][1 - r].numel() // 2
                    assert [(d - base) // half for d, *_ in log] == [e & 1] * len(rows), (log, e)
                    assert [(d - base) % half for d, *_ in log] == [st * n * 2 for st in lay.chunk_starts], log
                    assert [(i, v) for *_, i, v in log] == [(c, e) for c in range(len(rows))], log
                    assert [int(sf.local[lay.own_flag(c)]) for c in range(len(rows))] == [e] * len(rows)
                    assert [int(sf.local[lay.recv_flag(1 - r, c)]) for c in range(len(rows))] == [e] * len(rows)
                calls += 2
                # the reduce programs beside the GEMM's count on the tile GEMM's room: never Gluon
                assert set(only) == {SHARED_SMS if shared else None}, (shared, only)
                del only[:]
    assert mr.stats["p2p"] - before["p2p"] == calls and mr.stats["fused"] - before["fused"] == calls, mr.stats


@interpreted
def test_p2p_producer_failures() -> None:
    """At 2 ranks, kernels interpreted, with new inputs every call:

    - rank 1 loses its push of the last chunk: rank 0's reduce kernel times out on that
      chunk's flag and the call raises FlagTimeoutError naming rank 0, the flag (rank 1's
      slot, the chunk), the call's epoch expected and the last call's seen; rank 0's other
      chunks and rank 1's output are right;
    - rank 0's own flag of chunk 1 is not written (its copy stream never got there): its
      reduce kernel waits for it, times out naming it, and reads no partial before it;
    - the ranks disagree on the residual: both raise RanksDisagreeError;
    - both ranks fail before their first push (a GEMM launch that raises): the epoch is
      taken back on both;
    and after each, the next call is right on both ranks."""
    from dataclasses import replace

    from overlap.flags import FlagTimeoutError, RanksDisagreeError
    from overlap.kernels.tile_gemm import GemmConfig, TileGemmPlan
    from overlap.ops import OverlapConfig

    world = _World(2)
    rts = [_PeerRt(world, r) for r in range(2)]
    m, n, k = 600, 32, 32
    op = "matmul_all_reduce"
    cfg = OverlapConfig(chunks=3, reduce_ctas=2, check="sync", transport="p2p", gemm=GemmConfig(**GEMM))
    seed = [0]

    def good() -> None:
        seed[0] += 1
        shards, res, full = _case(2, m, n, k, seed[0], "wt", True)
        outs = _both(rts, lambda r: _call(rts[r], op, *shards[r], res, cfg))
        for r, got in enumerate(outs):
            assert isinstance(got, torch.Tensor) and _rel(got, full + res.double()) < TOL16, (r, got)

    with _patched(world):
        good()
        # a lost push
        rts[1].drop = {2}
        seed[0] += 1
        shards, res, full = _case(2, m, n, k, seed[0], "wt", True)
        # one reduce program: it reduces chunks 0 and 1 before its wait on chunk 2 (the
        # interpreter runs programs one after another, and a program skips its rows once
        # another recorded a timeout)
        one = replace(cfg, reduce_ctas=1)
        outs = _both(rts, lambda r: _call(rts[r], op, *shards[r], res, one))
        rts[1].drop = set()
        e = rts[0].heap.flags(op, 1).epoch
        assert isinstance(outs[0], FlagTimeoutError) and not isinstance(outs[0], RanksDisagreeError), outs[0]
        err = outs[0]
        stride = 512
        assert (err.rank, err.flag_idx, err.expected, err.seen) == (0, push_slot(1, 0, 2) * stride + 2, e, e - 1), \
            str(err)
        assert "rank 0" in str(err) and f"expected >= {e}" in str(err) and f"saw {e - 1}" in str(err)
        want = full + res.double()
        assert _rel(world.outs[0][:512], want[:512]) < TOL16, "chunks before the lost one"
        assert isinstance(outs[1], torch.Tensor) and _rel(outs[1], want) < TOL16
        good()
        # rank 0's local partial of chunk 1 never said complete
        seed[0] += 1
        shards, res, full = _case(2, m, n, k, seed[0], "wt", True)
        sf0 = rts[0].heap.flags(op, 1)
        own = mrp.push_layout(2, 0, m, 3, False).own_flag(1)
        world.lost = {(sf0.local.data_ptr(), own)}
        outs = _both(rts, lambda r: _call(rts[r], op, *shards[r], res, one))
        world.lost = set()
        assert isinstance(outs[0], FlagTimeoutError) and isinstance(outs[1], torch.Tensor), outs
        assert _rel(outs[1], full + res.double()) < TOL16
        assert (outs[0].flag_idx, outs[0].expected, outs[0].seen) == (own, sf0.epoch, sf0.epoch - 1), str(outs[0])
        assert own == stride + 1
        good()
        # ranks that disagree (rank 1 passes no residual)
        seed[0] += 1
        shards, res, full = _case(2, m, n, k, seed[0], "wt", True)
        outs = _both(rts, lambda r: _call(rts[r], op, *shards[r], res if r == 0 else None, cfg))
        assert all(isinstance(o, RanksDisagreeError) and "disagree" in str(o) for o in outs), outs
        good()
        # an exception before the first push, on both ranks
        epochs = [rt.heap.flags(op, 1).epoch for rt in rts]
        pushes = [rt.pushes for rt in rts]
        with mock.patch.object(TileGemmPlan, "launch", side_effect=RuntimeError("launch failed")):
            outs = _both(rts, lambda r: _call(rts[r], op, *shards[r], res, cfg))
        assert all(isinstance(o, RuntimeError) and "launch failed" in str(o) for o in outs), outs
        assert [rt.heap.flags(op, 1).epoch for rt in rts] == epochs and [rt.pushes for rt in rts] == pushes
        good()


def test_plan_refuses() -> None:
    """Configs the producer ops' p2p path cannot run, refused before any work with the reason."""
    from overlap.kernels.tile_gemm import GemmConfig
    from overlap.ops import OverlapConfig

    world = _World(2)
    rt = _PeerRt(world, 0)
    for cfg, text in ((OverlapConfig(transport="p2p", two_shot=True), "two_shot"),
                      (OverlapConfig(transport="p2p", reduce_ctas=12), "no SMs left for the GEMM"),
                      (OverlapConfig(transport="p2p", reduce_ctas=13, reduce_shared=True), "one reduce program per SM"),
                      (OverlapConfig(reduce_shared=True, gemm=GemmConfig(warp_specialize=True)), "warp-specialized")):
        with pytest.raises(ValueError, match=text):
            mrp._plan(rt, "matmul_reduce_scatter", 600, 32, 32, cfg)
    with pytest.raises(ValueError, match="multiple of the 2 ranks"):
        mrp._plan(rt, "matmul_reduce_scatter", 601, 32, 32, OverlapConfig(transport="p2p"))
    p = mrp._plan(rt, "matmul_all_reduce", 600, 32, 32, OverlapConfig(transport="p2p", reduce_ctas=4, chunks=3,
                                                                     gemm=GemmConfig(**GEMM)))
    assert (p.grid, p.programs, p.counts) == (8, 4, (8, 8, 3)), p  # 12 SMs - 4; 32-row tiles of 256, 256, 88
