"""benchmarks/bench_block.py's GPU-busy share: the union of device intervals over their span."""

from __future__ import annotations

import pytest

from benchmarks.bench_block import busy_share


def test_busy_share_is_the_union_over_the_span() -> None:
    # overlapping intervals count once, a gap counts as idle
    assert busy_share([(3.0, 4.0), (0.0, 1.0), (0.5, 2.0)]) == (0.75, 4.0)
    # nested and touching intervals
    assert busy_share([(0.0, 10.0), (2.0, 3.0), (10.0, 12.0)]) == (1.0, 12.0)
    share, span = busy_share([(0.0, 1.0), (9.0, 10.0)])
    assert span == 10.0 and share == pytest.approx(0.2)
    assert busy_share([]) == (0.0, 0.0)
