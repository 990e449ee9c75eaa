"""A plan graph's per-call copies, made inside the graph from addresses the host leaves in
a ring of pinned host slots.

A replayed plan graph (``overlap.ops._graphs``) reads its activations from static inputs
and writes its outputs to static buffers, so each call copies the caller's activations in
and clones the outputs out: one driver copy each, some 5 us of host time apiece on an
H200 host, most of what a replay costs beyond the replay itself. Here those copies are
kernels captured in the graph: each call the host writes the source and destination
addresses (the caller's activations, the call's new outputs) into the next slot of a ring
of pinned host memory, tagged with the call's number, and replays; the graph's first
kernels copy the activations in from the slot's addresses, its last ones copy the outputs
out to them, and a last kernel moves the graph's call counter on (in device memory) and
stores it in pinned memory for the host (``done``).

Safety:

- A slot is written only once the replay that used it last has ended its copies (the
  host reads ``done``; at most ``RING`` replays are in flight per graph, and a host that
  far ahead waits, bounded).
- Each copy kernel checks the slot's tag against the call number the graph counted: a
  slot not yet written for this call (which the ordering above rules out) is waited for
  a bounded while, then no copy is made and ``failed`` is set, which the host raises
  on the graph's next call (the outputs of the failing call hold what ``torch.empty``
  gave them).
- An address of 0 means "no copy" (the host copied that input itself: an input that is
  not contiguous).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import triton
import triton.language as tl

__all__ = ["Relay", "RING", "relay_copy_kernel", "relay_advance_kernel"]

RING = 64
"""Slots per graph: replays of one graph queued ahead of the GPU before the host waits."""

BLOCK = 2048
"""Words a copy program moves."""

SPIN = 1 << 10
"""Reads of a slot's tag before a copy kernel gives up on it (a slot is written before its
replay is launched: a tag not yet seen is a visibility delay at most)."""

WAIT_S = 60.0
"""How long a host waits for a free slot (the GPU ``RING`` replays behind) before raising."""


@triton.jit
def relay_fetch_kernel(slots_addr, status_addr, seq_addr, mirror_addr, WIDTH: tl.constexpr, WP2: tl.constexpr,
                       RING_: tl.constexpr, SPIN_: tl.constexpr):
    # this replay's number: the graph's counter (moved on by the advance kernel at its end) + 1
    seq = tl.load(seq_addr.to(tl.pointer_type(tl.int64)), volatile=True) + 1
    row = slots_addr.to(tl.pointer_type(tl.int64)) + (seq % RING_) * WIDTH
    # the slot read by system-scope atomics: a plain (even volatile) load of pinned host
    # memory was served stale for about a millisecond after the host's write (measured)
    tag = tl.atomic_add(row, 0, sem="relaxed", scope="sys")
    i = 0
    while (tag != seq) & (i < SPIN_):
        tag = tl.atomic_add(row, 0, sem="relaxed", scope="sys")
        i += 1
    cols = tl.arange(0, WP2)
    live = (cols >= 1) & (cols < WIDTH)
    vals = tl.atomic_add(row + cols, tl.zeros([WP2], tl.int64), mask=live, sem="relaxed", scope="sys")
    mirror = mirror_addr.to(tl.pointer_type(tl.int64))
    if tag == seq:
        tl.store(mirror + cols, tl.where(cols == 0, seq, vals), mask=cols < WIDTH)
    else:  # no copy this call (tag 0 in the mirror); the host raises at the graph's next call
        tl.store(mirror + cols, tl.zeros([WP2], tl.int64), mask=cols < WIDTH)
        tl.atomic_xchg(status_addr.to(tl.pointer_type(tl.int64)) + 1, seq, sem="release", scope="sys")


@triton.jit
def relay_copy_kernel(mirror_addr, seq_addr, static_addr, n_words, COL: tl.constexpr, IN: tl.constexpr,
                      BYTES: tl.constexpr, BLOCK_: tl.constexpr):
    # the slot as the fetch kernel copied it to device memory (before, in stream order)
    seq = tl.load(seq_addr.to(tl.pointer_type(tl.int64)), volatile=True) + 1
    mirror = mirror_addr.to(tl.pointer_type(tl.int64))
    tag = tl.load(mirror, volatile=True)
    addr = tl.load(mirror + COL, volatile=True)
    if (tag == seq) & (addr != 0):
        offs = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
        mask = offs < n_words
        if BYTES == 4:
            ty = tl.int32
        elif BYTES == 2:
            ty = tl.int16
        else:
            ty = tl.int8
        if IN:
            src, dst = addr.to(tl.pointer_type(ty)), static_addr.to(tl.pointer_type(ty))
        else:
            src, dst = static_addr.to(tl.pointer_type(ty)), addr.to(tl.pointer_type(ty))
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def relay_advance_kernel(seq_addr, status_addr):
    seq_ptr = seq_addr.to(tl.pointer_type(tl.int64))
    seq = tl.load(seq_ptr, volatile=True) + 1
    tl.store(seq_ptr, seq)
    # ``done`` for the host: every copy of this replay has ended (they come before, in stream order)
    tl.atomic_xchg(status_addr.to(tl.pointer_type(tl.int64)), seq, sem="release", scope="sys")


def _word_bytes(nbytes: int) -> int:
    return 4 if nbytes % 4 == 0 else (2 if nbytes % 2 == 0 else 1)


class Relay:
    """One plan graph's ring of slots (``cols`` addresses a call) and counters. Inside the
    capture: ``begin`` first, ``copy_in`` / ``copy_out`` per tensor (a column each, in
    order), then ``advance`` last. Per call, before the replay: ``post(addresses)``."""

    def __init__(self, device: Any, cols: int) -> None:
        import torch

        self.cols, self.width = cols, cols + 1
        pin = device.type == "cuda"
        self.slots = torch.zeros(RING, self.width, dtype=torch.int64, pin_memory=pin)
        self.status = torch.zeros(2, dtype=torch.int64, pin_memory=pin)
        """[0]: ``done``, the replays whose copies have ended; [1]: the call number of a
        copy that found its slot unwritten (0: none)."""
        self.seq_dev = torch.zeros(1, dtype=torch.int64, device=device)
        self.mirror = torch.zeros(self.width, dtype=torch.int64, device=device)
        """The call's slot in device memory, as the fetch kernel read it (tag 0: no copies)."""
        self._slots, self._status = self.slots.numpy(), self.status.numpy()
        self.seq = 0
        """Calls posted (the host's count; the graph's counter follows it on the GPU)."""
        self.next_col = 1

    def _launch_copy(self, col: int, static: Any, into: bool) -> None:
        nbytes = static.numel() * static.element_size()
        wb = _word_bytes(nbytes)
        n = nbytes // wb
        grid = max(1, -(-n // BLOCK))
        # Triton's own dispatch (it specializes integers on their divisibility): these
        # launches are made once per graph, at its capture
        relay_copy_kernel[(grid,)](self.mirror.data_ptr(), self.seq_dev.data_ptr(), static.data_ptr(), n,
                                   COL=col, IN=into, BYTES=wb, BLOCK_=BLOCK, num_warps=4)

    def begin(self) -> None:
        """Queue the start of a call: its slot read (system-scope atomics) into device memory."""
        wp2 = 1 << max(0, (self.width - 1).bit_length())
        relay_fetch_kernel[(1,)](self.slots.data_ptr(), self.status.data_ptr(), self.seq_dev.data_ptr(),
                                 self.mirror.data_ptr(), WIDTH=self.width, WP2=wp2, RING_=RING, SPIN_=SPIN,
                                 num_warps=1)

    def warm(self, statics: Sequence[Any], cols: Sequence[int]) -> None:
        """Before the capture, on its stream: one call that copies nothing (a slot of zero
        addresses), with every copy kernel the capture will launch for the inputs
        ``statics[i]``, ``i`` in ``cols``, and a guess at the outputs' (4-byte words):
        Triton compiles and CUDA loads them here, not inside the capture."""
        self.seq_dev.zero_()  # on this stream, before the kernels that count on it
        self.post([0] * self.cols)
        self.begin()
        for col, i in enumerate(cols, 1):
            self._launch_copy(col, statics[i], True)
        if cols:
            for col in range(len(cols) + 1, self.cols + 1):
                self._launch_copy(col, statics[cols[0]], False)
        self.advance()

    def column(self) -> int:
        if self.next_col > self.cols:
            raise ValueError(f"relay: {self.cols} columns, all taken")
        col, self.next_col = self.next_col, self.next_col + 1
        return col

    def copy_in(self, static: Any) -> int:
        """Queue ``static[:] = *slot[col]`` (a column of its own, returned)."""
        col = self.column()
        self._launch_copy(col, static, True)
        return col

    def copy_out(self, static: Any) -> int:
        """Queue ``*slot[col] = static[:]`` (a column of its own, returned)."""
        col = self.column()
        self._launch_copy(col, static, False)
        return col

    def advance(self) -> None:
        """Queue the end of a call: the graph's counter moved on, ``done`` stored for the host."""
        relay_advance_kernel[(1,)](self.seq_dev.data_ptr(), self.status.data_ptr(), num_warps=1)

    def lost(self) -> None:
        """A call posted and never replayed (its replay raised): the graph's counter would
        stay one behind its slots, so the graph is failed from here on (``failed``)."""
        self._status[1] = self.seq

    def failed(self) -> int:
        """The call number of a copy that found its slot unwritten, or 0."""
        return int(self._status[1])

    def room(self) -> bool:
        """A slot is free for the next call without a wait."""
        return self.seq + 1 - int(self._status[0]) <= RING

    def post(self, addrs: Sequence[int]) -> None:
        """Leave the next call's addresses (one per column; 0: no copy) in its slot, tagged
        with its number; wait (bounded: ``WAIT_S``) while that slot's last call has not
        ended its copies."""
        s = self.seq + 1
        if s - int(self._status[0]) > RING:
            end = time.monotonic() + WAIT_S
            while s - int(self._status[0]) > RING:
                if time.monotonic() > end:
                    raise RuntimeError(f"plan graph: the GPU has not ended call {s - RING} of this graph's "
                                       f"copies within {WAIT_S:.0f} s (call {s} waits for its slot)")
                time.sleep(20e-6)
        row = self._slots[s % RING]
        row[1:] = addrs
        row[0] = s  # the tag last: a slot tagged for this call holds its addresses
        self.seq = s
