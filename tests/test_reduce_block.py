"""The p2p all-reduce's reduce kernel picks its block shape on the host: rows of up to
8192 columns whole in registers, 32K elements a block; longer rows in 4096-column blocks
(a 16K-column row in registers moved half the bytes per SM at K = 12288 on H200)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from overlap.kernels.add_norm import LONG_ROW_BLOCK_K, reduce_block_shape  # noqa: E402


@pytest.mark.parametrize("K, want", [
    (40, (64, 8, 8)),          # a small row: 8 rows of 64 (512 elements), 8 warps
    (1024, (1024, 8, 8)),
    (4096, (4096, 8, 16)),     # measured best at 8192 x 4096
    (8192, (8192, 4, 16)),     # measured best at 16384 x 8192
    (12288, (LONG_ROW_BLOCK_K, 8, 16)),
    (16384, (LONG_ROW_BLOCK_K, 8, 16)),
    (28672, (LONG_ROW_BLOCK_K, 8, 16)),
])
def test_default_block_shape(K: int, want: tuple[int, int, int]) -> None:
    assert reduce_block_shape(K) == want


def test_given_block_k_sets_rows_and_warps() -> None:
    assert reduce_block_shape(8192, 2048) == (2048, 8, 16)
    assert reduce_block_shape(64, 16) == (16, 8, 8)
    block_k, rows, _ = reduce_block_shape(12288)
    assert block_k < 12288 and block_k * rows == 32768  # several K blocks, 32K elements each
