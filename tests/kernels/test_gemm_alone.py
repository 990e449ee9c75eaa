"""``launch_gemm``: the tile GEMM alone, one launch or with a tail launch
(``GemmConfig.tail_block_m``), under the Triton interpreter: outputs against torch for
splits at, inside and past every row; the split rule on the host; what refuses a tail.

The interpreted tests run in a child process with TRITON_INTERPRET=1 (``tests._interp``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests._interp import interpreted


def _big():
    from tests.kernels._interp_common import CFG32

    return replace(CFG32, flatten=True)  # 32x16 tiles


def test_tail_rows_rule() -> None:
    """The first launch takes the most row blocks whose tiles fill whole waves: all rows
    when the waves are whole anyway, none when not one wave fills."""
    from overlap.kernels.tile_gemm import GemmConfig, tail_rows

    big = GemmConfig(block_m=128, block_n=256, flatten=True, tail_block_m=128, tail_block_n=128)
    assert tail_rows(1024, 9216, big, 132) == 896       # 7 x 36 = 252 tiles: 2 waves less 12
    assert tail_rows(8192, 3696, big, 132) == 7808      # 61 x 15 = 915 of 924
    assert tail_rows(4224, 4096, big, 132) == 4224      # 33 x 16 = 528: 4 whole waves
    assert tail_rows(2048, 1536, big, 132) == 0         # 96 tiles: no whole wave
    assert tail_rows(100, 256, big, 1) == 100


def test_tail_config_and_rules() -> None:
    from overlap.kernels.tile_gemm import GemmConfig, tail_config

    cfg = GemmConfig(block_m=128, block_n=256, num_stages=3, flatten=True, tail_block_m=64, tail_block_n=256,
                     group_m=16)
    t = tail_config(cfg)
    assert (t.block_m, t.block_n, t.num_stages, t.num_warps, t.flatten, t.group_m, t.tail_block_m) == \
        (64, 256, 4, 8, True, 16, 0)
    with pytest.raises(ValueError, match="flatten"):
        GemmConfig(tail_block_m=128, tail_block_n=128)
    with pytest.raises(ValueError, match="powers of two"):
        GemmConfig(flatten=True, tail_block_m=128, tail_block_n=0)
    from overlap.ops import ChainConfig, OverlapConfig

    tail = GemmConfig(flatten=True, tail_block_m=128, tail_block_n=128)
    with pytest.raises(ValueError, match="GEMM alone"):
        OverlapConfig(gemm=tail, give_back=False)
    with pytest.raises(ValueError, match="GEMM alone"):
        ChainConfig(producer=tail)


@interpreted
def test_launch_gemm_with_a_tail() -> None:
    """One launch and with a tail of 16x16 tiles, grids that split the rows at 0, inside and
    past M; partial tiles, both B layouts, fp16 and fp32, GeLU: the same C as torch, every
    element written, a new input every call (a stale read fails)."""
    from overlap.kernels.tile_gemm import launch_gemm, tail_rows
    from tests.kernels._interp_common import TOL, _rel

    g = torch.Generator().manual_seed(0)
    big = _big()
    tail = replace(big, tail_block_m=16, tail_block_n=16)
    splits = set()
    for dt in (torch.float16, torch.float32):
        for m, n, k in ((100, 48, 32), (64, 40, 48)):
            w = torch.randn(n, k, generator=g).to(dt)
            for b in (w.t(), w.t().contiguous()):
                for cfg, grid, act in ((big, 3, None), (tail, 3, "gelu"), (tail, 2, None), (tail, 4, None),
                                       (tail, 5, None), (tail, 64, None)):
                    a = torch.randn(m, k, generator=g).to(dt)
                    c = torch.full((m, n), float("nan"), dtype=dt)
                    launch_gemm(a, b, c, grid=grid, config=cfg, activation=act)
                    ref = a.double() @ w.double().t()
                    ref = torch.nn.functional.gelu(ref) if act else ref
                    assert not torch.isnan(c).any(), ("an element not written", m, n, grid, cfg)
                    assert _rel(c, ref) < TOL[dt], (dt, m, n, k, grid, _rel(c, ref))
                    if cfg is tail:
                        splits.add((m, grid, tail_rows(m, n, cfg, grid)))
    # the cases cover a split inside M (with a ragged last row block: m = 100), none (all
    # rows whole waves) and all rows in the tail
    assert (100, 5, 96) in splits, splits  # 3 row blocks of 32 in 2 waves of 5, 4 rows left
    assert any(0 < s < m for m, _, s in splits if m == 64), splits
    assert any(s == m for m, _, s in splits) and any(s == 0 for _, _, s in splits), splits


@interpreted
def test_a_tail_is_refused_outside_launch_gemm() -> None:
    from overlap.kernels.tile_gemm import TileGemmPlan, launch_gemm, launch_tile_gemm
    from tests.kernels._interp_common import Segment, _table

    tail = replace(_big(), tail_block_m=16, tail_block_n=16)
    a, w = torch.randn(64, 32), torch.randn(48, 32)
    c = torch.empty(64, 48)
    table = _table([Segment(a_src=0, a_row=0, c_row=0, rows=64)], 48, tail)
    with pytest.raises(ValueError, match="launch_gemm"):
        launch_tile_gemm(a, w.t(), c, table, grid=4, config=tail)
    with pytest.raises(ValueError, match="launch_gemm"):
        TileGemmPlan(a, w.t(), c, table, config=tail)
    with pytest.raises(ValueError, match="rows"):
        launch_gemm(a[:32], w.t(), c, grid=4, config=tail)
