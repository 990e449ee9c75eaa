"""Every ``OVERLAP_*`` environment variable the package reads is in docs/tuning.md's
Environment table."""

from __future__ import annotations

import re

from tests._procs import REPO


def test_every_variable_read_is_documented() -> None:
    read = set()
    for path in (REPO / "overlap").rglob("*.py"):
        read |= set(re.findall(r"environ(?:\.get)?\(?\[?\s*[\"'](OVERLAP_[A-Z_]+)[\"']", path.read_text()))
    assert {"OVERLAP_TRANSPORT", "OVERLAP_WAIT_TIMEOUT_MS", "OVERLAP_STREAM_GATE"} <= read, read  # the scan works
    table = (REPO / "docs" / "tuning.md").read_text().split("## Environment", 1)[1]
    documented = set(re.findall(r"^\| `(OVERLAP_[A-Z_]+)`", table, re.M))
    assert read <= documented, sorted(read - documented)
