"""The words the host and the kernels share, in one place: the tile table's columns and
the error record's slots and codes. Pure Python (no torch, no triton), so the host side,
the tests and the kernels (as ``tl.constexpr`` copies) read the same numbers.

Tile table: int32 [tiles, TABLE_COLS], one row per output tile, in the order the
persistent grid takes them (``overlap.policies.build_tile_table``):

    COL_A_ROW     first row of A the tile reads
    COL_A_SRC     0: A (the local operand), 1: A2 (the gathered / reduced buffer)
    COL_C_ROW     first row of C the tile writes
    COL_C_ROWS    rows of the tile (<= BLOCK_M: the last tile of a segment may be short)
    COL_N_TILE    the tile's column block (pid_n) in its low N_TILE_BITS bits; in a table
                  of several weights (one grid over the GEMMs of weights that read the
                  same A rows, ``overlap.policies.build_multi_tile_table``) the tile's
                  weight index above them (0 in a one-weight table: the column unchanged)
    COL_WAIT      the flag the tile waits on before reading A (-1: none)
    COL_WAIT_MULT the flag's expected value per epoch (a count of posts)
    COL_POST      the flag the tile posts after its stores (NO_FLAG: none)

Error record: int32 [ERR_WORDS] on the device, mirrored into pinned host memory whose
address ERR_HOST_LO / ERR_HOST_HI hold (``overlap.flags.ErrorWord``); the first failing
wait stores it, the code last:

    ERR_CODE ERR_RANK ERR_FLAG ERR_EXPECTED ERR_SEEN ERR_TILE ERR_HOST_LO ERR_HOST_HI

Codes: ERR_TIMEOUT (a wait passed its bound: ``FlagTimeoutError``), ERR_AHEAD (a flag at or
past the next call's value: ranks out of step, ``FlagProtocolError``), ERR_DISAGREE (a
peer's call signature differs: ``RanksDisagreeError``).
"""

from __future__ import annotations

TABLE_COLS = 8
(COL_A_ROW, COL_A_SRC, COL_C_ROW, COL_C_ROWS, COL_N_TILE, COL_WAIT, COL_WAIT_MULT, COL_POST) = range(TABLE_COLS)

N_TILE_BITS = 24
N_TILE_MASK = (1 << N_TILE_BITS) - 1

ERR_WORDS = 8
(ERR_CODE, ERR_RANK, ERR_FLAG, ERR_EXPECTED, ERR_SEEN, ERR_TILE, ERR_HOST_LO, ERR_HOST_HI) = range(ERR_WORDS)

ERR_TIMEOUT = 1
ERR_AHEAD = 2
ERR_DISAGREE = 3

__all__ = ["TABLE_COLS", "COL_A_ROW", "COL_A_SRC", "COL_C_ROW", "COL_C_ROWS", "COL_N_TILE", "COL_WAIT",
           "COL_WAIT_MULT", "COL_POST", "N_TILE_BITS", "N_TILE_MASK", "ERR_WORDS", "ERR_CODE", "ERR_RANK", "ERR_FLAG", "ERR_EXPECTED", "ERR_SEEN",
           "ERR_TILE", "ERR_HOST_LO", "ERR_HOST_HI", "ERR_TIMEOUT", "ERR_AHEAD", "ERR_DISAGREE"]
