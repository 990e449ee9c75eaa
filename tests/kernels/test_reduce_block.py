"""The p2p all-reduce's reduce kernel picks its block shape on the host (measured on
H200: a row block in registers up to 8192 columns, 4096-column blocks above; blocks of
32K elements with 16 warps)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from overlap.kernels.add_norm import reduce_block_shape  # noqa: E402


@pytest.mark.parametrize("K, want", [
    (40, (64, 8, 8)),          # a small row: 8 rows of 64 (512 elements), 8 warps
    (1024, (1024, 8, 8)),
    (4096, (4096, 8, 16)),     # measured best at 8192 x 4096
    (8192, (8192, 4, 16)),     # measured best at 16384 x 8192
    (8200, (4096, 8, 16)),     # just over 8K columns: K blocks, not one padded 16K row
    (12288, (4096, 8, 16)),    # measured best at 8192 x 12288, with and without a norm
    (28672, (4096, 8, 16)),
])
def test_default_block_shape(K: int, want: tuple[int, int, int]) -> None:
    assert reduce_block_shape(K) == want


def test_given_block_k_sets_rows_and_warps() -> None:
    assert reduce_block_shape(8192, 2048) == (2048, 8, 16)
    assert reduce_block_shape(64, 16) == (16, 8, 8)
    assert reduce_block_shape(12288, 4096) == (4096, 8, 16)


@pytest.mark.parametrize("K, want", [
    (8192, (4096, 8, 16)),     # a residual without a norm: measured best at 16384 x 8192
    (4096, (4096, 8, 16)),
    (1024, (1024, 8, 8)),
    (12288, (4096, 8, 16)),
])
def test_split_block_shape(K: int, want: tuple[int, int, int]) -> None:
    assert reduce_block_shape(K, split=True) == want
