"""The p2p all-reduce's reduce kernel picks its block shape on the host (measured on
H200: blocks of 32K elements with 16 warps up to 8192 columns; one row a block above,
16 warps with a norm; rows over 16384 columns in several K blocks)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from overlap.kernels.add_norm import reduce_block_shape  # noqa: E402


@pytest.mark.parametrize("K, norm, want", [
    (40, False, (64, 8, 8)),          # a small row: 8 rows of 64 (512 elements), 8 warps
    (1024, True, (1024, 8, 8)),
    (4096, False, (4096, 8, 16)),     # measured best at 8192 x 4096
    (8192, False, (8192, 4, 16)),     # measured best at 16384 x 8192
    (8192, True, (8192, 4, 16)),
    (12288, False, (16384, 1, 8)),    # one row in registers
    (12288, True, (16384, 1, 16)),
    (28672, True, (16384, 1, 16)),    # several K blocks of 16K columns
])
def test_default_block_shape(K: int, norm: bool, want: tuple[int, int, int]) -> None:
    assert reduce_block_shape(K, norm=norm) == want


def test_given_block_k_sets_rows_and_warps() -> None:
    assert reduce_block_shape(8192, 2048) == (2048, 8, 16)
    assert reduce_block_shape(64, 16) == (16, 8, 8)
    assert reduce_block_shape(12288, 4096) == (4096, 8, 16)
