"""Peer memory on one node: buffers and flags that every rank of a group can write.

The NCCL path of the overlapped ops pays for bandwidth with SMs (each NCCL CTA
holds one), and those SMs are taken from the GEMM. Between GPUs of one node there
is a second way: the copy engines. A rank *pushes* its rows straight into a
peer's buffer with ``cudaMemcpyAsync`` over NVLink (no SM, and faster than NCCL's
all-gather holding all its SMs; see docs/experiments.md, "Before the library"),
then writes the peer's flag with ``cuStreamWriteValue32`` on the same
stream. The write is ordered after the copy and carries a memory barrier, so a
GEMM tile on the peer that acquires the flag sees the rows. This is the
put-with-signal of NVSHMEM and of torch's symmetric memory, here on legacy CUDA
IPC handles (``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle`` through cupy),
exchanged once over torch's process group.

Every rank allocates the same blocks in the same order (the ops agree on shapes
across ranks before they touch a block), so block ``name`` on rank r is what
every peer writes into for rank r.

Reuse of a buffer (write-after-read across ranks) needs no extra handshake when
a block is used as two halves by call parity: a rank pushes call e + 2 only
after its own work of call e + 1 finished, which needed the peer's pushes of
call e + 1, which the peer queued only after its work of call e (the ops make
their copy stream wait for the previous call's work). So the peer is done with
the half of call e before anyone writes it again.

That argument needs every rank's kernels to really wait. A rank whose wait timed
out skips its later waits until the error is reported, finishes its calls early and
may push into a half a peer still reads. The waits catch that: a healthy peer is
at most one call ahead, so a flag two or more calls ahead is reported as an error
(``overlap.flags.FlagProtocolError``) instead of being taken as "landed".

Memory: the blocks are outside torch's caching allocator and never shrink; the
all-reduce holds 2 (R - 1) M K elements per rank (R = 8, M = 16384, K = 8192, bf16:
3.5 GiB), the all-gather 2 M K.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["P2PUnavailable", "SharedBlock", "SharedFlags", "PeerHeap", "memcpy_async", "flag_stride"]

_FLAG_REGION = 1024
"""int32 flags per name in the shared flag block."""
_FLAG_NAMES = 16
_FIXED_REGIONS = {"all_gather_matmul": 0, "all_reduce_matmul": 1}
"""Regions by name, the same on every rank whichever op runs first; other names take
the next free region in the order they are first asked for."""
_ALIGN = 2 << 20


def flag_stride(world: int) -> int:
    """Shared flags each of ``world`` senders owns in an op's region: the most chunks
    one call of a p2p op may use."""
    return _FLAG_REGION // max(1, world)


class P2PUnavailable(RuntimeError):
    """The group's ranks cannot map each other's memory (not one node, no peer access, no cupy)."""


class _CudaArray:
    """Just enough ``__cuda_array_interface__`` for ``torch.as_tensor`` to view raw device memory."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _view(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(_CudaArray(ptr, nbytes), device=device)


def memcpy_async(dst: int, src: int, nbytes: int, stream: torch.cuda.Stream) -> None:
    """Copy ``nbytes`` from device address ``src`` to ``dst`` (local or a peer's) on ``stream``."""
    if nbytes <= 0:
        return
    from cupy.cuda import runtime

    runtime.memcpyAsync(dst, src, nbytes, runtime.memcpyDefault, stream.cuda_stream)


def _all_gather_obj(obj: Any, group: Any, world: int) -> list[Any]:
    import torch.distributed as tdist

    out: list[Any] = [None] * world
    tdist.all_gather_object(out, obj, group=group)
    return out


class SharedBlock:
    """``nbytes`` of device memory on every rank of the group, each rank's block
    opened on every other rank. Collective to create and to close."""

    def __init__(self, group: Any, world: int, rank: int, device: torch.device, nbytes: int) -> None:
        import cupy
        from cupy.cuda import runtime

        self.group, self.world, self.rank, self.device = group, world, rank, device
        self.nbytes = nbytes
        self.ptrs: list[int] = []
        err = ""
        handle = b""
        self._own: int | None = None
        with cupy.cuda.Device(device.index):
            # every failure is reported through the gather below, so that no rank is
            # left waiting in it (an out-of-memory here must not hang the peers)
            try:
                self._own = runtime.malloc(nbytes)
                runtime.memset(self._own, 0, nbytes)
                runtime.deviceSynchronize()
                handle = bytes(runtime.ipcGetMemHandle(self._own))
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                err = f"rank {rank}: allocating or exporting {nbytes} bytes: {e}"
        handles = _all_gather_obj((handle, err), group, world)
        errs = [e for _, e in handles if e]
        opened: list[int] = []
        if not errs:
            with cupy.cuda.Device(device.index):
                for r, (h, _) in enumerate(handles):
                    if r == rank:
                        opened.append(self._own)
                        continue
                    try:
                        opened.append(runtime.ipcOpenMemHandle(h, 1))  # 1: cudaIpcMemLazyEnablePeerAccess
                    except Exception as e:  # noqa: BLE001
                        err = f"rank {rank}: cudaIpcOpenMemHandle of rank {r}: {e}"
                        break
        oks = _all_gather_obj(err, group, world)
        errs = errs or [e for e in oks if e]
        if errs:
            self.ptrs = opened
            self.close(collective=False)
            raise P2PUnavailable("; ".join(errs))
        self.ptrs = opened
        self.peers = [_view(p, nbytes, device) for p in self.ptrs]
        """Torch uint8 views of every rank's block (``peers[rank]`` is this rank's own)."""

    def close(self, collective: bool = True) -> None:
        """Unmap the peers' blocks and free this rank's. ``collective``: first wait
        until every rank's work is done (peers may still be copying into this block)."""
        if not self.ptrs and self._own is None:
            return
        import cupy
        from cupy.cuda import runtime

        if collective:
            import torch.distributed as tdist

            torch.cuda.synchronize(self.device)
            tdist.barrier(group=self.group)
        with cupy.cuda.Device(self.device.index):
            for r, p in enumerate(self.ptrs):
                if r != self.rank:
                    try:
                        runtime.ipcCloseMemHandle(p)
                    except Exception:  # noqa: BLE001 - best effort at teardown
                        pass
            if self._own is not None:
                try:
                    runtime.free(self._own)
                except Exception:  # noqa: BLE001 - a failed context (a dead peer under MPS) frees nothing
                    if collective:
                        raise
        self.ptrs, self._own = [], None
        self.peers = None  # type: ignore[assignment]

    def tensor(self, r: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A typed view of rank ``r``'s block (``r == rank``: this rank's own)."""
        esize = torch.empty((), dtype=dtype).element_size()
        n = 1
        for s in shape:
            n *= s
        if offset % esize or offset + n * esize > self.nbytes:
            raise ValueError(f"view of {shape} {dtype} at byte {offset} does not fit a {self.nbytes}-byte block")
        return self.peers[r][offset:offset + n * esize].view(dtype).view(shape)


class SharedFlags:
    """``n`` int32 flags in the shared flag block: this rank's (``local``, waited
    on by its kernels) and every peer's (``peer(r)``, written by this rank's copy
    stream). Epochs count the op's calls; they agree across ranks because every
    rank makes the same calls. A sender's chunk c sets flag
    ``sender_or_slot * flag_stride(world) + c``."""

    def __init__(self, block: SharedBlock, offset: int, n: int) -> None:
        self._block, self._offset, self.n = block, offset, n
        self.local = block.tensor(block.rank, offset, (n,), torch.int32)
        self._peers = [block.tensor(r, offset, (n,), torch.int32) for r in range(block.world)]
        self.epoch = 0

    def peer(self, r: int) -> torch.Tensor:
        return self._peers[r]

    def next_epoch(self) -> int:
        """The next call's epoch as the kernels and flag writes take it: a signed int32
        that wraps with the flags (``overlap.flags.wrap32``); its parity picks the
        buffer half, and stays alternating across the wrap (2**32 is even)."""
        from .flags import wrap32

        self.epoch = (self.epoch + 1) & 0xFFFFFFFF
        return wrap32(self.epoch)


class PeerHeap:
    """Shared flags and growable data blocks for one group on one device."""

    def __init__(self, group: Any, world: int, rank: int, device: torch.device) -> None:
        self.group, self.world, self.rank, self.device = group, world, rank, device
        self._flag_block = SharedBlock(group, world, rank, device, _FLAG_REGION * _FLAG_NAMES * 4)
        self._flags: dict[str, SharedFlags] = {}
        self._region: dict[str, int] = {}
        self._blocks: dict[str, SharedBlock] = {}

    def flags(self, name: str, n: int) -> SharedFlags:
        """The flags of op ``name`` (at most 1024; the same region on every rank)."""
        f = self._flags.get(name)
        if f is None:
            used = {self._region[k] for k in self._flags}
            region = _FIXED_REGIONS.get(name)
            if region is None:
                free = [i for i in range(len(_FIXED_REGIONS), _FLAG_NAMES) if i not in used]
                if not free:
                    raise RuntimeError(f"more than {_FLAG_NAMES} flag regions in a peer heap")
                region = free[0]
            self._region[name] = region
            f = SharedFlags(self._flag_block, region * _FLAG_REGION * 4, _FLAG_REGION)
            self._flags[name] = f
        if n > f.n:
            raise ValueError(f"{name}: {n} shared flags asked, at most {f.n} (fewer chunks or ranks)")
        return f

    def block(self, name: str, nbytes: int) -> SharedBlock:
        """Block ``name`` of at least ``nbytes`` on every rank. Collective when it is
        created or grown (every rank asks for the same sizes in the same order)."""
        b = self._blocks.get(name)
        if b is not None and b.nbytes >= nbytes:
            return b
        if b is not None:
            del self._blocks[name]  # never hand out a closed block, even if the new one fails
            b.close(collective=True)
        size = -(-nbytes // _ALIGN) * _ALIGN
        b = self._blocks[name] = SharedBlock(self.group, self.world, self.rank, self.device, size)
        return b

    def close(self) -> None:
        """Free everything (not collective: for process teardown)."""
        for b in self._blocks.values():
            b.close(collective=False)
        self._blocks.clear()
        self._flag_block.close(collective=False)
