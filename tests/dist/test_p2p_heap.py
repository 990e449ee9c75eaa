"""overlap._p2p's bookkeeping on the CPU: a fake cupy runtime and a fake two-rank gather
stand in for CUDA IPC and torch's process group. What is checked is what must hold for
the ranks not to hang or use freed memory: every failure goes through the handle
exchange (so no peer is left waiting in it), a failed grow never leaves a closed block
behind, and flag regions do not depend on which op asks first."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

import overlap._p2p as p2p


class _FakeRuntime:
    memcpyDefault = 4

    def __init__(self) -> None:
        self.fail_malloc = False
        self.next_ptr = 1 << 20
        self.freed: list[int] = []
        self.closed: list[int] = []
        self.copies: list[tuple[int, int, int, int]] = []

    def malloc(self, n: int) -> int:
        if self.fail_malloc:
            raise MemoryError("out of memory (fake)")
        p, self.next_ptr = self.next_ptr, self.next_ptr + n + (1 << 20)
        return p

    def memset(self, p: int, v: int, n: int) -> None:
        pass

    def deviceSynchronize(self) -> None:  # noqa: N802 - cupy's name
        pass

    def ipcGetMemHandle(self, p: int) -> bytes:  # noqa: N802
        return p.to_bytes(8, "little")

    def ipcOpenMemHandle(self, h: bytes, flags: int) -> int:  # noqa: N802
        return int.from_bytes(h, "little") + (1 << 40)  # the peer's block, mapped here

    def ipcCloseMemHandle(self, p: int) -> None:  # noqa: N802
        self.closed.append(p)

    def free(self, p: int) -> None:
        self.freed.append(p)

    def memcpyAsync(self, dst: int, src: int, n: int, kind: int, stream: int) -> None:  # noqa: N802
        self.copies.append((dst, src, n, kind))


class _Device:
    def __init__(self, idx: Any) -> None:
        pass

    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Any:
    rt = _FakeRuntime()
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    cuda.runtime = rt  # type: ignore[attr-defined]
    cuda.Device = _Device  # type: ignore[attr-defined]
    cupy.cuda = cuda  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setattr(p2p, "_view", lambda ptr, n, dev: torch.zeros(n, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    import torch.distributed as tdist

    monkeypatch.setattr(tdist, "barrier", lambda *a, **k: None)
    state = types.SimpleNamespace(rt=rt, peer_error="", gathers=[])

    def gather(obj: Any, group: Any, world: int) -> list[Any]:
        state.gathers.append(obj)
        if isinstance(obj, tuple):  # (handle, error) of this rank; the peer's made up
            peer = (int(7 << 30).to_bytes(8, "little"), state.peer_error)
        else:  # the open step's error string
            peer = ""
        return [obj, peer]

    monkeypatch.setattr(p2p, "_all_gather_obj", gather)
    return state


DEV = torch.device("cpu")


def test_shared_block_maps_every_peer(fake: Any) -> None:
    b = p2p.SharedBlock(None, 2, 0, DEV, 1 << 20)
    assert b.ptrs[0] != b.ptrs[1] and b.ptrs[1] == (7 << 30) + (1 << 40)
    assert len(fake.gathers) == 2  # handles, then the open step's errors
    b.close(collective=False)
    assert fake.rt.closed == [(7 << 30) + (1 << 40)] and len(fake.rt.freed) == 1
    b.close(collective=False)  # twice is harmless
    assert len(fake.rt.freed) == 1


def test_allocation_failure_is_reported_through_the_exchange(fake: Any) -> None:
    fake.rt.fail_malloc = True
    with pytest.raises(p2p.P2PUnavailable, match="out of memory"):
        p2p.SharedBlock(None, 2, 0, DEV, 1 << 20)
    # the failing rank still took part in the exchange, so its peers were not left waiting
    assert fake.gathers and "out of memory" in fake.gathers[0][1]


def test_peer_failure_raises_here_and_frees(fake: Any) -> None:
    fake.peer_error = "rank 1: cudaIpcGetMemHandle: not supported"
    with pytest.raises(p2p.P2PUnavailable, match="rank 1"):
        p2p.SharedBlock(None, 2, 0, DEV, 1 << 20)
    assert len(fake.rt.freed) == 1  # this rank's own block


def test_failed_grow_leaves_no_closed_block(fake: Any) -> None:
    heap = p2p.PeerHeap(None, 2, 0, DEV)
    b1 = heap.block("op", 1000)
    assert heap.block("op", 500) is b1 and b1.nbytes == 2 << 20  # rounded up, reused when it fits
    fake.rt.fail_malloc = True
    with pytest.raises(p2p.P2PUnavailable):
        heap.block("op", 10 << 20)
    assert b1.ptrs == [] and "op" not in heap._blocks  # closed, and not handed out again
    fake.rt.fail_malloc = False
    b2 = heap.block("op", 500)
    assert b2 is not b1 and b2.ptrs


def test_flag_regions_fixed_by_op(fake: Any) -> None:
    h1 = p2p.PeerHeap(None, 2, 0, DEV)
    h2 = p2p.PeerHeap(None, 2, 1, DEV)
    # the two "ranks" ask in different orders: the regions still match
    a1, r1 = h1.flags("all_gather_matmul", 4), h1.flags("all_reduce_matmul", 4)
    r2, a2 = h2.flags("all_reduce_matmul", 4), h2.flags("all_gather_matmul", 4)
    assert (a1._offset, r1._offset) == (a2._offset, r2._offset) == (0, p2p._FLAG_REGION * 4)
    assert h1.flags("bench", 1)._offset == 2 * p2p._FLAG_REGION * 4
    with pytest.raises(ValueError):
        h1.flags("all_gather_matmul", p2p._FLAG_REGION + 1)
    assert p2p.flag_stride(2) == p2p._FLAG_REGION // 2 and p2p.flag_stride(8) == p2p._FLAG_REGION // 8


def test_epoch_counts_and_wraps(fake: Any) -> None:
    """Epochs count calls modulo 2**32 as signed int32 (what the kernels compare by
    difference), with a parity that keeps alternating across both wraps."""
    f = p2p.PeerHeap(None, 2, 0, DEV).flags("all_gather_matmul", 2)
    assert [f.next_epoch() for _ in range(3)] == [1, 2, 3]
    f.epoch = 2**31 - 2
    got = [f.next_epoch() for _ in range(3)]
    assert got == [2**31 - 1, -(2**31), -(2**31) + 1]
    f.epoch = 2**32 - 2
    got += [f.next_epoch() for _ in range(3)]
    assert got[3:] == [-1, 0, 1]
    assert [e % 2 for e in got] == [1, 0, 1, 1, 0, 1]


def test_memcpy_async_passes_the_stream(fake: Any) -> None:
    class _S:
        cuda_stream = 1234

    p2p.memcpy_async(10, 20, 30, _S())  # type: ignore[arg-type]
    p2p.memcpy_async(10, 20, 0, _S())  # type: ignore[arg-type]  # nothing to copy: no call
    assert fake.rt.copies == [(10, 20, 30, _FakeRuntime.memcpyDefault)]
