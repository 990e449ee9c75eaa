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

Refusal record: one int32 that a rank which refused a call writes where its signature word
goes (``overlap.ops._refusal``); a peer's kernel records it as the "seen" signature of code
ERR_DISAGREE. A signature is always odd (``overlap.ops._runtime.call_sig``), a record even:

    bit 0      0
    bit 1      1 (0 is the flags' value before any write)
    bits 2-4   the refusal's kind (REFUSAL_KINDS)
    bits 5-14  the refusing rank (group rank)
    bits 15-30 the group's call counter, its low 16 bits
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

REFUSAL_KINDS = ("ValueError", "TypeError", "RuntimeError", "an error")
"""Kinds 1..4 of a refusal record (the refusing rank's exception type)."""


def refusal_word(rank: int, calls: int, kind: str) -> int:
    """The refusal record of group rank ``rank`` (< 1024) at the group's call ``calls``."""
    if not 0 <= rank < 1024:
        raise ValueError(f"refusal record: rank {rank} out of 0..1023")
    k = REFUSAL_KINDS.index(kind) + 1 if kind in REFUSAL_KINDS else len(REFUSAL_KINDS)
    return 2 | (k << 2) | (rank << 5) | ((calls & 0xFFFF) << 15)


def read_refusal(word: int) -> tuple[int, int, str] | None:
    """(rank, the call counter's low 16 bits, kind) of a refusal record, or None where
    ``word`` is not one (a signature, 0, or a value no rank writes)."""
    w = int(word) & 0xFFFFFFFF
    k = (w >> 2) & 7
    if w & 3 != 2 or w >> 31 or not 1 <= k <= len(REFUSAL_KINDS):
        return None
    return (w >> 5) & 1023, (w >> 15) & 0xFFFF, REFUSAL_KINDS[k - 1]


__all__ = ["REFUSAL_KINDS", "refusal_word", "read_refusal",
           "TABLE_COLS", "COL_A_ROW", "COL_A_SRC", "COL_C_ROW", "COL_C_ROWS", "COL_N_TILE", "COL_WAIT",
           "COL_WAIT_MULT", "COL_POST", "N_TILE_BITS", "N_TILE_MASK", "ERR_WORDS", "ERR_CODE", "ERR_RANK", "ERR_FLAG", "ERR_EXPECTED", "ERR_SEEN",
           "ERR_TILE", "ERR_HOST_LO", "ERR_HOST_HI", "ERR_TIMEOUT", "ERR_AHEAD", "ERR_DISAGREE"]
