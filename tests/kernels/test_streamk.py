"""GemmConfig.stream_k: the tile GEMM alone in stream-K order (``overlap.kernels.streamk``),
under the Triton interpreter: outputs against torch below one wave, across waves with a
partial one and with full waves only; the fix-up's counters back at zero after every
launch; what it refuses. The split of programs and tiles is checked on the host.

The interpreted tests run in a child process with TRITON_INTERPRET=1 (``tests._interp``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests._interp import interpreted


def test_streamk_split() -> None:
    """Programs and stream-K tiles: below a wave every tile, the grid cut to MAX_PIECES per
    tile; above it the last full wave and the partial one; none when the waves are full."""
    from overlap.kernels.streamk import MAX_PIECES, streamk_split

    assert streamk_split(96, 132) == (132, 96)
    assert streamk_split(3, 132) == (3 * MAX_PIECES, 3)
    assert streamk_split(288, 132) == (132, 288 % 132 + 132)
    assert streamk_split(264, 132) == (132, 0)
    assert streamk_split(1, 1) == (1, 1)


def test_streamk_config_rules() -> None:
    from overlap.kernels.tile_gemm import GemmConfig

    with pytest.raises(ValueError, match="stream_k"):
        GemmConfig(stream_k=True, flatten=True)
    with pytest.raises(ValueError, match="stream_k"):
        GemmConfig(stream_k=True, warp_specialize=True)


def _sk():
    from tests.kernels._interp_common import CFG32

    return replace(CFG32, stream_k=True)


@interpreted
def test_streamk_outputs() -> None:
    """Tiles below one wave (every tile split), above it with a partial wave (stream-K
    and data-parallel tiles), full waves (data-parallel only); partial tiles, both B
    layouts, fp16 and fp32, GeLU: the same C as torch; a new input every call (a stale
    read fails), and every split tile's counter back at 0 after each launch."""
    from overlap.kernels import streamk
    from tests.kernels._interp_common import TOL, Segment, _rel, _table, launch_tile_gemm

    g = torch.Generator().manual_seed(0)
    cfg = _sk()
    # 32x16 tiles, K steps of 16: (m, n, k) -> tiles, K steps
    cases = (((64, 48, 80), 6, 5),    # 6 tiles of 5 steps
             ((70, 40, 112), 9, 7),   # partial row and column tiles
             ((32, 16, 48), 1, 3))    # one tile
    for dt in (torch.float16, torch.float32):
        for (m, n, k), tiles, steps in cases:
            w = torch.randn(n, k, generator=g).to(dt)
            table = _table([Segment(a_src=0, a_row=0, c_row=0, rows=m)], n, cfg)
            assert table.shape[0] == tiles
            for b in (w.t(), w.t().contiguous()):
                for grid, act in ((4, None), (tiles + 1, "gelu"), (2, None), (3, None), (tiles, None), (64, None)):
                    a = torch.randn(m, k, generator=g).to(dt)
                    c = torch.full((m, n), float("nan"), dtype=dt)
                    launch_tile_gemm(a, b, c, table, grid=grid, config=cfg, activation=act)
                    ref = a.double() @ w.double().t()
                    ref = torch.nn.functional.gelu(ref) if act else ref
                    assert not torch.isnan(c).any(), ("an output element was not written", m, n, k, grid)
                    assert _rel(c, ref) < TOL[dt], (dt, m, n, k, grid, _rel(c, ref))
                    for ws, cnt in streamk._buffers.by.values():
                        assert int(cnt.abs().sum()) == 0, ("a counter left nonzero", grid, cnt[:16].tolist())


@interpreted
def test_streamk_refusals() -> None:
    """The GEMM alone: flags, a second A, a split, rows, a counter refused by name; an op's
    plan refuses the config."""
    from overlap.kernels.tile_gemm import TileGemmPlan
    from tests.kernels._interp_common import Segment, _table, launch_tile_gemm

    cfg = _sk()
    a, w = torch.randn(64, 32), torch.randn(48, 32)
    c = torch.empty(64, 48)
    table = _table([Segment(a_src=0, a_row=0, c_row=0, rows=64)], 48, cfg)
    flags, err = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    for kw, name in ((dict(wait=True, flags=flags, err=err), "waits"), (dict(post=True, flags=flags, err=err), "posts"),
                     (dict(a2=a), "a2"), (dict(counter=flags), "counter"), (dict(rows=(64, 64)), "rows")):
        with pytest.raises(ValueError, match=name):
            launch_tile_gemm(a, w.t(), c, table, grid=4, config=cfg, **kw)
    with pytest.raises(ValueError, match="stream_k"):
        TileGemmPlan(a, w.t(), c, table, config=cfg)
