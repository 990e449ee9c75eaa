"""The Python examples of README.md and docs/training.md run as written: each ```python
block, saved as a file, on one rank and on two (gloo), the way the README says to run it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests._procs import REPO, run_ranks


def _blocks(doc: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / doc).read_text(), re.S)


CASES = [(doc, i) for doc in ("README.md", "docs/training.md") for i in range(len(_blocks(doc)))]


def test_the_docs_have_examples() -> None:
    assert len(_blocks("README.md")) == 2 and len(_blocks("docs/training.md")) >= 1


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("doc,index", CASES)
def test_example_runs(doc: str, index: int, world_size: int, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(_blocks(doc)[index])
    procs = run_ranks(script, world_size, timeout_s=240)
    for p in procs:
        assert p.returncode == 0, (doc, index, p.rank, p.out[-4000:])
