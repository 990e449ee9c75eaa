"""overlap.protocol: the tile table's columns and the error record as the host builds and
reads them (the kernels read the same constants; the interpreted kernel tests run them)."""

from __future__ import annotations

import pytest
import torch

from overlap import protocol as P
from overlap.flags import ErrorWord, FlagProtocolError, FlagTimeoutError, RanksDisagreeError
from overlap.policies import NO_FLAG, Segment, build_tile_table


def test_slots_are_a_permutation() -> None:
    cols = [P.COL_A_ROW, P.COL_A_SRC, P.COL_C_ROW, P.COL_C_ROWS, P.COL_N_TILE, P.COL_WAIT, P.COL_WAIT_MULT,
            P.COL_POST]
    assert sorted(cols) == list(range(P.TABLE_COLS))
    errs = [P.ERR_CODE, P.ERR_RANK, P.ERR_FLAG, P.ERR_EXPECTED, P.ERR_SEEN, P.ERR_TILE, P.ERR_HOST_LO, P.ERR_HOST_HI]
    assert sorted(errs) == list(range(P.ERR_WORDS)) and P.ERR_HOST_HI == P.ERR_HOST_LO + 1
    # the host clears the record's fields (the slots before the mirror's address) in one go
    assert max(P.ERR_CODE, P.ERR_RANK, P.ERR_FLAG, P.ERR_EXPECTED, P.ERR_SEEN, P.ERR_TILE) < P.ERR_HOST_LO
    assert len({0, P.ERR_TIMEOUT, P.ERR_AHEAD, P.ERR_DISAGREE}) == 4


def test_tile_table_columns_by_name() -> None:
    seg = Segment(a_row=100, a_src=1, c_row=300, rows=200, wait_idx=5, wait_mult=2, post_base=NO_FLAG)
    t = build_tile_table([seg], n=96, block_m=128, block_n=32, group_m=8, array=True)
    assert t.shape == (2 * 3, P.TABLE_COLS)
    assert sorted(set(t[:, P.COL_A_ROW])) == [100, 228] and set(t[:, P.COL_A_SRC]) == {1}
    assert sorted(set(t[:, P.COL_C_ROW])) == [300, 428]
    assert sorted(t[:, P.COL_C_ROWS]) == [72] * 3 + [128] * 3  # the last row tile is short
    assert sorted(set(t[:, P.COL_N_TILE])) == [0, 1, 2]
    assert set(t[:, P.COL_WAIT]) == {5} and set(t[:, P.COL_WAIT_MULT]) == {2} and set(t[:, P.COL_POST]) == {NO_FLAG}


@pytest.mark.parametrize("code,cls", [(P.ERR_TIMEOUT, FlagTimeoutError), (P.ERR_AHEAD, FlagProtocolError),
                                      (P.ERR_DISAGREE, RanksDisagreeError)])
def test_error_record_read_by_slot(code: int, cls: type) -> None:
    w = ErrorWord("cpu", "test op")
    rec = [0] * P.ERR_WORDS
    rec[P.ERR_CODE], rec[P.ERR_RANK], rec[P.ERR_FLAG] = code, 3, 17
    rec[P.ERR_EXPECTED], rec[P.ERR_SEEN], rec[P.ERR_TILE] = 40, 39, 250
    w.word.copy_(torch.tensor(rec, dtype=torch.int32))
    with pytest.raises(cls) as e:
        w.check()
    text = str(e.value)
    # every field from its slot: rank, flag (or signature word), expected and seen (the
    # signatures, in hex, for a disagreement) and tile
    want = ["rank 3", "17"] + (["0x00000027", "0x00000028"] if cls is RanksDisagreeError else ["40", "39", "tile 250"])
    assert all(w in text for w in want), (want, text)
    w.check()  # reported once, then cleared
