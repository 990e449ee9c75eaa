"""A plan graph's copies as kernels (``overlap.kernels.relay``) under the Triton interpreter:
a "replay" is the relay's launches in the order a captured graph runs them (copies in, the
graph's work, copies out, advance), each call's addresses posted first; new inputs and new
outputs every call (a stale read fails), the ring wrapped several times, an address of 0
copying nothing, a slot never posted found by the kernel and reported (no copy made), and a
host far ahead waiting for its slot.

The tests run in a child process with TRITON_INTERPRET=1 (``tests._interp``)."""

from __future__ import annotations

import re

import pytest
import torch

from tests._interp import interpreted


def _replay(r, cols_in, statics_in, work, statics_out, cols_out):  # noqa: ANN001, ANN202
    r.begin()
    for col, st in zip(cols_in, statics_in):
        r._launch_copy(col, st, True)
    work()
    for col, st in zip(cols_out, statics_out):
        r._launch_copy(col, st, False)
    r.advance()


@interpreted
def test_copies_follow_the_posted_addresses() -> None:
    from overlap.kernels import relay as R

    dev = torch.device("cpu")
    r = R.Relay(dev, 4)
    x_st = torch.zeros(33, 7, dtype=torch.bfloat16)    # 462 bytes: 2-byte words
    res_st = torch.zeros(5, 8, dtype=torch.float32)
    out_st = torch.zeros(33, 7, dtype=torch.bfloat16)
    odd_st = torch.zeros(3, dtype=torch.int8)           # 3 bytes: 1-byte words
    r.seq_dev.fill_(696037)  # memory the allocator gave back: the warm-up starts the count itself
    r.warm([x_st, res_st], [0, 1])
    assert r.seq == 1 and int(r.seq_dev[0]) == 1 and int(r.status[0]) == 1 and not r.failed()
    assert not x_st.any() and not res_st.any(), "the warm-up copied something"

    def work() -> None:
        out_st.copy_(x_st * 2)
        odd_st.copy_(res_st[0, :3].to(torch.int8))

    gen = torch.Generator().manual_seed(0)
    for call in range(2 * R.RING + 3):  # the ring wraps twice
        x = torch.randn(33, 7, generator=gen).to(torch.bfloat16)
        res = torch.randint(0, 100, (5, 8), generator=gen).float()
        out, odd = torch.empty_like(out_st), torch.empty_like(odd_st)
        r.post([x.data_ptr(), res.data_ptr(), out.data_ptr(), odd.data_ptr()])
        _replay(r, (1, 2), (x_st, res_st), work, (out_st, odd_st), (3, 4))
        assert torch.equal(out, x * 2), call
        assert torch.equal(odd, res[0, :3].to(torch.int8)), call
        assert int(r.status[0]) == r.seq == call + 2 and not r.failed()
    # an address of 0: that copy is not made (the host copied a strided input itself)
    keep = res_st.clone()
    x = torch.randn(33, 7, generator=gen).to(torch.bfloat16)
    out, odd = torch.empty_like(out_st), torch.empty_like(odd_st)
    r.post([x.data_ptr(), 0, out.data_ptr(), odd.data_ptr()])
    _replay(r, (1, 2), (x_st, res_st), work, (out_st, odd_st), (3, 4))
    assert torch.equal(res_st, keep) and torch.equal(out, x * 2)


@interpreted
def test_a_slot_never_posted_is_reported_not_read(monkeypatch) -> None:  # noqa: ANN001
    from overlap.kernels import relay as R

    monkeypatch.setattr(R, "SPIN", 3)
    r = R.Relay(torch.device("cpu"), 1)
    st = torch.zeros(8, dtype=torch.float32)
    x = torch.ones(8)
    r.post([x.data_ptr()])
    r.begin()
    r._launch_copy(1, st, True)
    r.advance()
    assert torch.equal(st, x) and not r.failed()
    st.zero_()
    r.begin()  # a replay whose call was never posted: slot 2 holds no tag 2
    r._launch_copy(1, st, True)
    r.advance()
    assert r.failed() == 2 and not st.any(), "a copy read a slot not written for its call"


def test_a_host_far_ahead_waits_for_its_slot_bounded(monkeypatch) -> None:  # noqa: ANN001
    """(No kernel: the host side.) A slot is written only once the call that used it last
    has ended its copies; past the bound the wait raises."""
    import threading
    import time

    from overlap.kernels import relay as R

    monkeypatch.setattr(R, "RING", 4)
    r = R.Relay(torch.device("cpu"), 1)
    for _ in range(4):
        assert r.room()
        r.post([7])
    assert not r.room()
    threading.Timer(0.05, lambda: r.status.__setitem__(0, 1)).start()  # the GPU ends call 1
    t0 = time.monotonic()
    r.post([8])
    assert time.monotonic() - t0 >= 0.04 and r.seq == 5 and int(r.slots[5 % 4, 1]) == 8
    monkeypatch.setattr(R, "WAIT_S", 0.05)
    with pytest.raises(RuntimeError, match="has not ended call 2 of this graph's copies"):
        r.post([9])
    assert r.seq == 5, "a call that raised was counted"


def _sm90(fn, sig, consts):  # noqa: ANN001, ANN202
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        return triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4))
    except Exception as e:  # noqa: BLE001 - a Triton without the CUDA backend's tools here
        if "ptxas" in str(e) or "No such file" in str(e):
            pytest.skip(f"no sm_90 build here: {type(e).__name__}: {e}")
        raise


def test_sm90_slot_reads_are_system_atomics_and_done_is_a_system_release() -> None:
    """Built for sm_90 on the CPU: the fetch kernel reads the slot with system-scope atomics
    (a load of pinned host memory was served stale on an H200), and stores a failure with a
    system-scope release; the copies read the device mirror and the counter with volatile
    loads; ``done`` is a system-scope release."""
    from overlap.kernels import relay as R

    sys_release = r"atom(\.global)?\.sys\.release|atom(\.global)?\.release\.sys"
    k = _sm90(R.relay_fetch_kernel, {"slots_addr": "i64", "status_addr": "i64", "seq_addr": "i64",
                                     "mirror_addr": "i64", "WIDTH": "constexpr", "WP2": "constexpr",
                                     "RING_": "constexpr", "SPIN_": "constexpr"},
              {"WIDTH": 4, "WP2": 4, "RING_": R.RING, "SPIN_": R.SPIN})
    ptx = k.asm["ptx"]
    assert re.search(r"atom(\.global)?(\.relaxed)?\.sys(\.relaxed)?\.add", ptx), ptx[:3000]
    assert re.search(sys_release, ptx), "the failure store is not a system-scope release"
    for into in (True, False):
        for nbytes in (4, 2, 1):
            k = _sm90(R.relay_copy_kernel, {"mirror_addr": "i64", "seq_addr": "i64", "static_addr": "i64",
                                            "n_words": "i32", "COL": "constexpr", "IN": "constexpr",
                                            "BYTES": "constexpr", "BLOCK_": "constexpr"},
                      {"COL": 1, "IN": into, "BYTES": nbytes, "BLOCK_": R.BLOCK})
            assert k.asm["ptx"].count("ld.volatile.global") >= 3
    k = _sm90(R.relay_advance_kernel, {"seq_addr": "i64", "status_addr": "i64"}, {})
    ptx = k.asm["ptx"]
    assert re.search(sys_release, ptx), ptx[:2000]
    assert "ld.volatile.global" in ptx
