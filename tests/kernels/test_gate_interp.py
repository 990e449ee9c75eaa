"""The stream gate (``overlap.kernels.gate``) under the Triton interpreter: it returns
once its flag holds the expected count, records a timeout (tile -1) when the flag stays
short, a protocol error when it is at or past ``ahead``, and a grid behind a gate that
timed out finds the record and skips its waits."""

from __future__ import annotations

import torch

from tests._interp import interpreted


@interpreted
def test_gate_passes_times_out_and_flags_a_run_ahead() -> None:
    from overlap import protocol as P
    from overlap.kernels.gate import GATE_TILE, launch_gate

    flags = torch.tensor([0, 1, 5, 3], dtype=torch.int32)
    err = torch.zeros(P.ERR_WORDS, dtype=torch.int32)
    for idx, expected in ((1, 1), (2, 4), (2, 5)):  # at or above the expected count
        launch_gate(flags, idx, expected, expected + 2, err, rank=3, timeout_ns=10**9, max_spins=50)
        assert err.tolist() == [0] * P.ERR_WORDS, (idx, err)
    # short: a timeout naming the gate, the flag and the values
    launch_gate(flags, 0, 1, 3, err, rank=3, timeout_ns=10**9, max_spins=50)
    rec = err.tolist()
    assert rec[P.ERR_CODE] == P.ERR_TIMEOUT and rec[P.ERR_RANK] == 3 and rec[P.ERR_FLAG] == 0, rec
    assert (rec[P.ERR_EXPECTED], rec[P.ERR_SEEN], rec[P.ERR_TILE]) == (1, 0, GATE_TILE), rec
    # at or past "ahead": a protocol error (ranks out of step)
    err.zero_()
    launch_gate(flags, 3, 1, 3, err, rank=0, timeout_ns=10**9, max_spins=50)
    assert err[P.ERR_CODE].item() == P.ERR_AHEAD and err[P.ERR_SEEN].item() == 3, err
    # int32 wrap: expected just past 2**31 against a flag that wrapped to it
    err.zero_()
    wrapped = torch.tensor([-2**31 + 1], dtype=torch.int32)
    launch_gate(wrapped, 0, -2**31 + 1, -2**31 + 3, err, rank=0, timeout_ns=10**9, max_spins=50)
    assert err[P.ERR_CODE].item() == 0, err


@interpreted
def test_a_grid_behind_a_timed_out_gate_skips_its_waits() -> None:
    """The gate's record stops the tiles' waits at once (one bound, not two): the tile GEMM
    behind it, waiting on the same short flag with a huge spin budget, returns, stores NaN
    over every waiting tile (it has no data for them), and the record stays the gate's."""
    from overlap import protocol as P
    from overlap.kernels.gate import GATE_TILE, launch_gate
    from overlap.kernels.tile_gemm import GemmConfig, launch_tile_gemm
    from overlap.policies import Segment, build_tile_table

    cfg = GemmConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)
    m, n, k = 32, 16, 16
    a = torch.randn(m, k)
    b = torch.randn(k, n)
    c = torch.full((m, n), 7.0)
    flags = torch.zeros(2, dtype=torch.int32)
    err = torch.zeros(P.ERR_WORDS, dtype=torch.int32)
    table = torch.tensor(build_tile_table([Segment(a_src=0, a_row=0, c_row=0, rows=m, wait_idx=0)], n,
                                          cfg.block_m, cfg.block_n), dtype=torch.int32)
    launch_gate(flags, 0, 1, 3, err, rank=1, timeout_ns=10**9, max_spins=20)
    assert err[P.ERR_TILE].item() == GATE_TILE
    launch_tile_gemm(a, b, c, table, flags=flags, err=err, epoch=1, rank=1, grid=2, config=cfg, wait=True,
                     max_spins=10**9)
    # skipped, not run: every waiting tile stores NaN (never a product, never the old 7.0)
    assert torch.isnan(c).all(), "a waiting tile ran behind a gate that timed out, or kept the buffer's old values"
    assert err[P.ERR_TILE].item() == GATE_TILE and err[P.ERR_CODE].item() == P.ERR_TIMEOUT, err
