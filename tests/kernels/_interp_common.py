"""What the interpreted kernel tests share: small GEMM configs, tolerances, table and
error helpers, and stand-ins for an op's runtime (``_StandIn``: rank 0 of 2 on the
peer-copy transport; ``_NcclStandIn``: world size 1 on NCCL) whose stream calls the
tests patch out. Imported by the tests, which run under ``tests._interp.interpreted``."""

from __future__ import annotations

import torch

from overlap.flags import ErrorWord, FlagProtocolError, FlagTimeoutError  # noqa: F401
from overlap.kernels.tile_gemm import GemmConfig, launch_tile_gemm, split_workspace  # noqa: F401
from overlap.kernels.add_norm import ReducePlan, ReduceShape, launch_add_norm, launch_reduce_norm  # noqa: F401
from overlap.ops._runtime import Runtime
from overlap.policies import (RowSync, Segment, all_gather_layout, all_gather_push_layout,  # noqa: F401
                              build_tile_table, push_slot, row_block_segments, row_chunk_segments,
                              rowsync_chain_tables, split_tail, tilesync_chain_tables)

CFG = GemmConfig(block_m=16, block_n=16, block_k=16, num_stages=1, num_warps=4)


CFG32 = GemmConfig(block_m=32, block_n=16, block_k=16, num_stages=1, num_warps=4)  # split tiles need 32 rows


TOL = {torch.float16: 2e-3, torch.float32: 1e-5}


def _table(segs, n, cfg=CFG, group_m=2):
    return torch.tensor(build_tile_table(segs, n, cfg.block_m, cfg.block_n, group_m), dtype=torch.int32)


def _rel(x, y):
    return ((x.double() - y.double()).norm() / y.double().norm()).item()


class _StandIn:
    """A stand-in for the runtime of a p2p op on rank 0 of 2 (``overlap.ops._runtime.Runtime``
    and its ``PeerHeap``), for the ops' ``_fused_p2p`` with kernels interpreted: the
    peer's pushes have landed when a call starts (its flags at the call's epoch, its rows
    where the test put them with ``recv``), this rank's pushes and stream work are only
    recorded. ``with stand_in.patched():`` replaces the CUDA stream calls."""

    class Stream:
        pass

    class Flags:
        def __init__(self, n):
            self.local = torch.zeros(n, dtype=torch.int32)
            self.remote = torch.zeros(n, dtype=torch.int32)
            self.epoch = 0

        def next_epoch(self):
            self.epoch += 1
            self.local.fill_(self.epoch)
            return self.epoch

        def peer(self, r):
            return self.remote

    class Block:
        def __init__(self, nbytes):
            self.nbytes, self.ptrs, self.bufs = nbytes, [1 << 20, 1 << 30], {}

        def tensor(self, rank, off, shape, dtype):  # both parities share one buffer here
            return self.bufs.setdefault((tuple(shape), dtype), torch.zeros(shape, dtype=dtype))

    world, rank, ranks, device, num_sms = 2, 0, (0, 1), torch.device("cpu"), 12
    group = None  # the default wait bound's group (no process group here)

    STRIDE = 512  # overlap._p2p.flag_stride(2)

    cache = Runtime.cache  # the ops' plans and tuned configs live on their runtime

    def __init__(self):
        self._caches = {}
        self.blocks, self.fl, self.errs, self.counters, self.pushes = {}, {}, {}, {}, []
        self.disagree = False  # the peer's signature words differ from this rank's
        self.comm_stream, self.aux_stream, self.copy_stream = self.Stream(), self.Stream(), self.Stream()
        self.copies = []  # memcpy_async calls made outside push (dst, src, nbytes)

    def recv(self, name, shape, dtype):
        """The peer's landing buffer of op ``name`` (made on first use)."""
        return self.block(name, 0).tensor(0, 0, shape, dtype)

    def p2p(self):
        return self

    def block(self, name, nbytes):
        return self.blocks.setdefault(name, self.Block(nbytes))

    def flags(self, name, n):  # a region of 1024 flags per name, as overlap._p2p.PeerHeap's
        assert n <= 1024, n
        return self.fl.setdefault(name, self.Flags(1024))

    def err(self, name):
        return self.errs.setdefault(name, ErrorWord("cpu", what=name))

    def counter(self, name, n=1):
        c = self.counters.get(name)
        if c is None or c.numel() < n:
            c = self.counters[name] = torch.zeros(n, dtype=torch.int32)
        return c

    def push(self, dst, src, nbytes, flags, idx, value):
        self.pushes.append((dst, src, nbytes, idx, value))

    def current_stream(self):
        return torch.cuda.current_stream()

    def p2p_begin(self, *a):
        pass

    fork = join = p2p_end = p2p_begin

    def patched(self):
        import contextlib
        from unittest import mock

        from overlap import flags as fl

        def write_value(stream, flags, idx, value):
            flags[idx] = value
            # a signature word this rank writes into the peer's flags: the peer makes the
            # same call (or, with ``disagree``, another one) and writes its own into every
            # region of this rank's flags at the same word
            off = idx % self.STRIDE
            if off >= self.STRIDE - 2:
                for f in self.fl.values():
                    if flags is f.remote:
                        v = value ^ 2 if self.disagree else value
                        for r in range(0, f.local.numel(), self.STRIDE):
                            f.local[r + off] = v

        def zero(stream, t, n):
            t[:n] = 0

        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(torch.cuda, "current_stream", lambda *a: self.Stream()))
        stack.enter_context(mock.patch.object(torch.cuda, "set_stream", lambda s: None))
        stack.enter_context(mock.patch.object(fl, "stream_write_value", write_value))
        stack.enter_context(mock.patch.object(fl, "stream_zero", zero))
        stack.enter_context(mock.patch.object(fl, "stream_wait_value", lambda *a: None))
        from overlap import _p2p
        stack.enter_context(mock.patch.object(_p2p, "memcpy_async",
                                              lambda dst, src, nbytes, stream: self.copies.append((dst, src, nbytes))))
        return stack


def _torch_norm(h, kind, w, b, eps):
    if kind == "layernorm":
        return torch.nn.functional.layer_norm(h.float(), (h.shape[1],), w.float(), None if b is None else b.float(),
                                              eps)
    return torch.nn.functional.rms_norm(h.float(), (h.shape[1],), w.float(), eps)


class _NcclStandIn:
    """A stand-in for the runtime of an NCCL-transport op, for the ops' ``_fused`` host side
    with kernels interpreted. The interpreter runs a grid to its end at launch, so stream
    order is program order: a stream wait on a chunk's counter asserts that the counter is
    complete (every tile of the chunk posted). At world size 1 the collectives copy. As
    rank 0 of 2 (``_NcclStandIn(world=2)``) the all-gather and all-reduce take the peer's
    rows from ``peer`` (its shard, or its partial sums), found by the rows' offset in
    ``base`` (the tensor the op slices its sends from)."""

    class Stream:
        cuda_stream = 0  # a raw handle (a call plan's bound body reads it; nothing launches on it here)

        def wait_event(self, ev):
            pass

    class Event:
        def record(self, stream=None):
            pass

    class Comm:
        def __init__(self, rt):
            self.rt, self.log = rt, rt.log

        def _peer_rows(self, send):
            base = self.rt.base
            row_bytes = base.stride(0) * base.element_size()
            start = (send.data_ptr() - base.data_ptr()) // row_bytes
            if not 0 <= start < base.shape[0]:
                # a padded copy of base's last rows (a plan of a row bucket sends the chunk
                # that holds the last row whole): found by its first row; the peer's rows
                # past its shard are NaN, which the op must never store
                start = int((base == send[0]).all(dim=1).nonzero()[0])
            rows = self.rt.peer[start:start + send.shape[0]]
            pad = send.shape[0] - rows.shape[0]
            if pad:
                rows = torch.cat([rows, torch.full((pad, *rows.shape[1:]), float("nan"), dtype=rows.dtype)])
            return rows

        def all_reduce(self, send, recv, stream=None):
            self.log.append(("all_reduce", send.shape[0]))
            if self.rt.world == 2:
                recv.copy_((send.float() + self._peer_rows(send).float()).to(recv.dtype))
            elif recv.data_ptr() != send.data_ptr():
                recv.copy_(send)

        def all_gather(self, send, recv, stream=None):
            self.log.append(("all_gather", send.shape[0]))
            rows = send.shape[0]
            recv[:rows].copy_(send)
            if self.rt.world == 2:
                recv[rows:].copy_(self._peer_rows(send))

        def reduce_scatter(self, send, recv, stream=None):
            self.log.append(("reduce_scatter", send.shape[0]))
            recv.copy_(send)

    class Order:
        def __init__(self):
            import threading

            self.lock = threading.RLock()

        def begin(self, cur):
            pass

        end = begin

    rank, device, num_sms, group = 0, torch.device("cpu"), 12, None

    cache = Runtime.cache  # the ops' plans and tuned configs live on their runtime

    def __init__(self, world=1):
        from overlap.ops._runtime import LocalWords

        self._caches = {}
        self.world, self.ranks = world, tuple(range(world))
        self.peer = self.base = None

        self.comm_stream, self.aux_stream = self.Stream(), self.Stream()
        self.order, self._local, self.errs, self.log, self.waits = self.Order(), LocalWords(self.device), {}, [], []

    def local_words(self, name, n_counters, n_flags):
        return self._local.get(name, n_counters, n_flags)

    def current_stream(self):
        return torch.cuda.current_stream()

    def comm(self, max_ctas):
        return self.Comm(self)

    def p2p(self):
        return None

    def err(self, name):
        return self.errs.setdefault(name, ErrorWord("cpu", what=name))

    def fork(self, *streams):
        pass

    join = fork

    def event(self, key):
        return self.Event()

    def patched(self):
        import contextlib
        from unittest import mock

        from overlap import flags as fl

        def wait_value(stream, flags, idx, value):
            self.waits.append((idx, value))
            assert int(flags[idx]) >= value, f"the comm stream would wait on counter {idx}: {int(flags[idx])} < {value}"

        def write_value(stream, flags, idx, value):
            flags[idx] = value

        def zero(stream, t, n):
            t[:n] = 0

        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(torch.cuda, "current_stream", lambda *a: self.Stream()))
        stack.enter_context(mock.patch.object(torch.cuda, "set_stream", lambda s: None))
        stack.enter_context(mock.patch.object(torch.cuda, "Event", self.Event))
        stack.enter_context(mock.patch.object(fl, "stream_write_value", write_value))
        stack.enter_context(mock.patch.object(fl, "stream_zero", zero))
        stack.enter_context(mock.patch.object(fl, "stream_wait_value", wait_value))
        return stack

