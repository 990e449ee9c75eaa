"""The chain model (``benchmarks/chain_model.py``): waves of tiles on the SMs, stream sync
against RowSync flags."""

from __future__ import annotations

import pytest

from benchmarks import chain_model as cm

SMS = 132


def test_flag_time_by_hand() -> None:
    """Four SMs, one left to the producer: the producer's 5 tiles end at 1 (four) and 2 (one);
    the consumer's tiles of row block 0 start at 1 on the three SMs freed first, row block
    1's wait for 2."""
    prod = [0, 0, 0, 1, 1]
    cons = [0, 0, 1, 1]
    assert cm.flag_time(prod, cons, 1.0, 1.0, 4, reserve=1) == 3.0
    assert cm.flag_time(prod, cons, 1.0, 0.5, 4, reserve=1) == 2.5
    # with every SM reserved but one, the consumer's tiles run one after another
    assert cm.flag_time(prod, cons, 1.0, 1.0, 4, reserve=3) == 5.0
    with pytest.raises(ValueError, match="exceed"):
        cm.flag_time(prod, cons, 1.0, 1.0, 2, reserve=2)
    with pytest.raises(ValueError, match="row block 2"):
        cm.flag_time(prod, [2], 1.0, 1.0, 4)


def test_row_order_fills_the_last_wave() -> None:
    """GPT-3 175B's MLP at TP 4, M 512, 128x256 tiles: 192 tiles per GEMM (1.45 waves each),
    4 waves stream-synced. In row-block order fc1's first wave stores row blocks 0 and 1,
    whose fc2 tiles fill the second wave beside fc1's last 60 tiles: 3 waves. In GROUP_M
    order no row block is stored before fc1's last wave: 4."""
    t = cm.tile_time(128, 256, 12288)
    row = cm.plan(512, 12288, 12288, 12288, 128, 256, 256, 1, 1, SMS)
    grouped = cm.plan(512, 12288, 12288, 12288, 128, 256, 256, 8, 8, SMS)
    assert row.sync == grouped.sync == 4 * t
    assert row.flag == 3 * t
    assert grouped.flag == 4 * t
    assert cm.plans(512, 12288, 12288, 12288, SMS)[0].flag == 3 * t


def test_single_wave_producer_gains_nothing() -> None:
    """LLaMA-2 70B at TP 8, M 512: fc1's 112 tiles of 128x128 are one wave; every row block
    is stored at its end, so flags cannot start fc2 sooner in either order."""
    for g in (1, 8):
        p = cm.plan(512, 8192, 3584, 8192, 128, 128, 256, g, g, SMS)
        assert p.flag == p.sync


def test_best_sync_takes_each_gemms_fastest_tile() -> None:
    t128, t256 = cm.tile_time(128, 128, 12288), cm.tile_time(128, 256, 12288)
    # 384 tiles of 128x128 are 3 waves (0.97 full), 192 of 128x256 are 2 (0.73)
    assert cm.sync_time(512, 12288, 12288, 128, 128, SMS) == 3 * t128
    assert cm.sync_time(512, 12288, 12288, 128, 256, SMS) == 2 * t256
    assert cm.best_sync(512, 12288, 12288, 12288, SMS) == 2 * min(3 * t128, 2 * t256)
