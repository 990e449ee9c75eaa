"""A flag post as a kernel (``overlap.kernels.post``) under the Triton interpreter, and
where the ops queue it: a post, a zeroing and a count wait made while a graph is captured
take their kernel forms, and outside a capture (or on a device not warmed) the driver's."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests._interp import interpreted


@interpreted
def test_post_kernel_stores_the_value() -> None:
    from overlap.kernels.post import launch_post

    flags = torch.zeros(8, dtype=torch.int32)
    launch_post(flags, 3, 7)
    launch_post(flags[1:], 0, -5)  # a pointer off a 16-byte boundary
    launch_post(flags, 6, -2**31)
    assert flags.tolist() == [0, -5, 0, 7, 0, 0, -2**31, 0], flags


def test_captured_posts_zeroings_and_waits_take_their_kernel_forms(monkeypatch) -> None:  # noqa: ANN001
    from overlap import flags
    from overlap.kernels import gate, post
    from overlap.ops import _plans

    import contextlib

    got: list = []
    on: list = [None]  # the stream the launches go to (``torch.cuda.stream``'s)

    @contextlib.contextmanager
    def stream(s):  # noqa: ANN001, ANN202
        prev, on[0] = on[0], s
        try:
            yield
        finally:
            on[0] = prev

    monkeypatch.setattr(post, "launch_post", lambda t, idx, value: got.append(("post", on[0], idx, value)))
    monkeypatch.setattr(gate, "launch_gate", lambda fl, idx, exp, ahead, err, **kw: got.append(
        ("gate", on[0], idx, exp, ahead, kw["timeout_ns"])))
    monkeypatch.setattr(flags, "_cuda_driver", lambda: False)  # (the eager forms: the fill fallback)
    monkeypatch.setattr(flags, "_warned_fallback", True)
    monkeypatch.setattr(flags, "stream_wait_value", lambda s, fl, idx, v: got.append(("wait", s, idx, v)))
    monkeypatch.setattr(torch.cuda, "stream", stream)
    t = torch.ones(8, dtype=torch.int32)
    err = SimpleNamespace(word=torch.zeros(8, dtype=torch.int32))
    for captured in (True, False):
        got.clear()
        t.fill_(1)
        monkeypatch.setattr(flags, "kernel_form", lambda x, c=captured: c)
        flags.stream_write_value("comm", t, 2, 5 + (1 << 32))
        flags.stream_zero("caller", t, 4)
        _plans.wait_count("comm", t, 1, 6, err, 0, 1000)
        _plans.wait_count("comm", t, 1, 0, err, 0, 1000)  # (a chunk with no tile: no wait)
        if captured:  # each on the stream it was queued for
            assert got == [("post", "comm", 2, 5), ("gate", "comm", 1, 6, 18, 1000)], got
            assert t.tolist() == [0, 0, 0, 0, 1, 1, 1, 1], t  # zeroed by torch's fill
        else:
            assert got == [("wait", "comm", 1, 6)], got
            assert t.tolist() == [0, 0, 0, 0, 1, 1, 1, 1], t


def test_kernel_form_needs_a_warm_device_and_a_capture(monkeypatch) -> None:  # noqa: ANN001
    from overlap import flags

    t = torch.zeros(4, dtype=torch.int32)
    monkeypatch.setattr(flags, "capturing_now", lambda: True)
    assert not flags.kernel_form(t)  # a CPU tensor
    cuda_t = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 3))
    assert not flags.kernel_form(cuda_t)  # device 3 not warmed
    monkeypatch.setattr(flags, "_warm", {3})
    assert flags.kernel_form(cuda_t)
    monkeypatch.setattr(flags, "capturing_now", lambda: False)
    assert not flags.kernel_form(cuda_t)
    monkeypatch.setenv("OVERLAP_GRAPH_KERNEL_POSTS", "0")
    monkeypatch.setattr(flags, "_warm", set())
    flags.warm_kernel_forms(torch.device("cuda", 3))  # off: never warmed (no CUDA needed to say so)
    assert flags._warm == set()


def test_warm_up_covers_both_widths_of_a_wait_bound() -> None:
    """The gate is warmed with a bound that fits an int32 and one that does not (the ops'
    default, minutes in ns): Triton compiles a kernel per argument width, and a width not
    warmed would be compiled inside the capture."""
    from overlap import flags
    from overlap.kernels._launch import _widths

    warm = {_widths((t,)) for t in flags.WARM_TIMEOUTS_NS}
    for bound_ns in (int(flags.default_timeout_ms() * 1e6), 10 ** 6, int(30 * 60 * 1e9)):
        assert _widths((bound_ns,)) in warm, bound_ns
