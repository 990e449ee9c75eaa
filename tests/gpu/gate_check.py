"""The stream gate on one GPU (run by test_real_jobs_gpu.py): what a late first chunk costs
the GPU's other work. Prints ``PASS gate1 ...`` or raises.

At world size 1 on the NCCL transport, each chunk's NCCL call is held back about 1 s on the
comm stream (``torch.cuda._sleep``), as a peer that arrives late holds it. Behind the
queued ``all_reduce_matmul`` call, a loop of cuBLAS GEMMs runs on another stream; its GPU
time is compared with the same loop alone:

    gated    the op's grid is queued behind a one-program gate: the loop gets the GPU
    ungated  ``OVERLAP_STREAM_GATE=0``: the op's grid is resident and spinning on its first
             chunk for the whole delay, and the loop runs on the SMs it left

Both give the right result and no error. The block boundary (``matmul_all_reduce_matmul``)
with the late comm: right result. A bound shorter than the delay raises
``FlagTimeoutError`` naming the gate.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from overlap import dist  # noqa: E402
from overlap.flags import FlagTimeoutError  # noqa: E402
from overlap.ops import (Norm, OverlapConfig, all_reduce_matmul, all_reduce_matmul_ref, check_errors,  # noqa: E402
                         clear_call_plans,
                         matmul_all_reduce_matmul, matmul_all_reduce_matmul_ref)
from overlap.ops import _runtime  # noqa: E402
from tests.gpu.skew_check import _Late, cycles_for, rel  # noqa: E402

TOL = 2e-2
DELAY_S = 1.0


def side_loop_ms(side: torch.cuda.Stream, x: torch.Tensor, w: torch.Tensor, iters: int) -> float:
    """GPU ms of ``iters`` GEMMs queued on ``side`` now (events on that stream)."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        s.record()
        for _ in range(iters):
            torch.mm(x, w)
        e.record()
    return s, e


def main() -> None:
    os.environ.pop("OVERLAP_WAIT_TIMEOUT_MS", None)
    os.environ.pop("OVERLAP_STREAM_GATE", None)
    dist.init(timeout_s=60)
    dev = torch.device("cuda", torch.cuda.current_device())
    cyc = cycles_for(DELAY_S, dev)
    from overlap.dist import get_context

    rt = _runtime.get_runtime(get_context().tp_group, dev)
    real_comm = rt.comm
    m, k, n = 4096, 4096, 4096
    b = (torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 64).t()
    res = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    norm = Norm("layernorm", torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5,
                torch.randn(k, device=dev, dtype=torch.bfloat16))
    cfg = OverlapConfig(transport="nccl", chunks=2)
    short = OverlapConfig(transport="nccl", chunks=2, timeout_ms=200, check="sync")
    b_next = (torch.randn(2048, k, device=dev, dtype=torch.bfloat16) / 64).t()
    xs = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ws = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) / 90
    side = torch.cuda.Stream(device=dev)
    iters = 60
    # warm: both gate settings, both bounds (a short bound is another kernel variant), the
    # boundary, the side loop
    for gate in ("1", "0"):
        os.environ["OVERLAP_STREAM_GATE"] = gate
        for c_ in (cfg, short):
            all_reduce_matmul(torch.randn(m, k, device=dev, dtype=torch.bfloat16), b, residual=res, norm=norm,
                              config=c_)
    os.environ.pop("OVERLAP_STREAM_GATE")
    matmul_all_reduce_matmul(torch.randn(m, k, device=dev, dtype=torch.bfloat16), b, b_next, residual=res,
                             norm=norm, config=cfg)
    side_loop_ms(side, xs, ws, 3)
    torch.cuda.synchronize()
    s, e = side_loop_ms(side, xs, ws, iters)
    torch.cuda.synchronize()
    alone = s.elapsed_time(e)
    out = {"alone": alone}
    rt.comm = lambda max_ctas: _Late(real_comm(max_ctas), cyc)  # type: ignore[method-assign]
    try:
        for gate in ("1", "0"):
            os.environ["OVERLAP_STREAM_GATE"] = gate
            clear_call_plans()  # a call plan's body read the gate and took the communicator when it was made
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            c, h = all_reduce_matmul(a, b, residual=res, norm=norm, config=cfg)
            s, e = side_loop_ms(side, xs, ws, iters)  # queued while the op waits on its first chunk
            torch.cuda.synchronize()
            check_errors()
            out["gated" if gate == "1" else "ungated"] = s.elapsed_time(e)
            want = all_reduce_matmul_ref(a, b, residual=res, norm=norm)
            assert rel(c, want[0]) < TOL and rel(h, want[1]) < TOL, (gate, rel(c, want[0]), rel(h, want[1]))
        os.environ.pop("OVERLAP_STREAM_GATE")
        clear_call_plans()
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        c, h = matmul_all_reduce_matmul(a, b, b_next, residual=res, norm=norm, config=cfg)
        torch.cuda.synchronize()
        check_errors()
        want = matmul_all_reduce_matmul_ref(a, b, b_next, residual=res, norm=norm)
        assert rel(c, want[0]) < TOL and rel(h, want[1]) < TOL, ("boundary", rel(c, want[0]), rel(h, want[1]))
        try:
            all_reduce_matmul(a, b, residual=res, norm=norm, config=short)
        except FlagTimeoutError as exc:
            assert exc.tile == -1 and "stream gate" in str(exc), exc
        else:
            raise AssertionError("a wait bound shorter than the delay did not raise")
    finally:
        rt.comm = real_comm  # type: ignore[method-assign]
        os.environ.pop("OVERLAP_STREAM_GATE", None)
        clear_call_plans()
    torch.cuda.synchronize()
    # the gated op leaves the GPU to the loop: within 1.5x of the loop alone
    assert out["gated"] < 1.5 * out["alone"], out
    print(f"PASS gate1 {iters} GEMMs 8192^3 on another stream: alone {out['alone']:.1f} ms, behind a gated wait "
          f"{out['gated']:.1f} ms, ungated {out['ungated']:.1f} ms (first chunk {DELAY_S:.0f} s late)", flush=True)


if __name__ == "__main__":
    main()
