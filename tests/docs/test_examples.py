"""The Python examples of README.md and docs/training.md run as written: each ```python
block, saved as a file, on one rank and on two (gloo), the way the README says to run it.
The README's first block is ``example.py`` at the repository's root, run as that file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests._procs import REPO, run_ranks


def _blocks(doc: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / doc).read_text(), re.S)


EXAMPLE = REPO / "example.py"
# example.py runs as itself below; its copy in the README is checked to be the same text
CASES = [(doc, i) for doc in ("README.md", "docs/training.md") for i, b in enumerate(_blocks(doc))
         if not (EXAMPLE.exists() and b == EXAMPLE.read_text())]


def test_the_docs_have_examples() -> None:
    assert len(_blocks("README.md")) == 2 and len(_blocks("docs/training.md")) >= 1


def test_readme_shows_example_py() -> None:
    """The README's op example is example.py, word for word: what a user reads is what runs."""
    assert EXAMPLE.exists(), "example.py (the README runs it) is missing"
    assert _blocks("README.md")[0] == EXAMPLE.read_text()


@pytest.mark.parametrize("world_size", [1, 2])
def test_example_py_runs(world_size: int) -> None:
    procs = run_ranks(EXAMPLE, world_size, timeout_s=240)
    for p in procs:
        assert p.returncode == 0, (p.rank, p.out[-4000:])
    assert "all_gather_matmul" in procs[0].out and "path (why)" in procs[0].out, procs[0].out  # the report


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("doc,index", CASES)
def test_example_runs(doc: str, index: int, world_size: int, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(_blocks(doc)[index])
    procs = run_ranks(script, world_size, timeout_s=240)
    for p in procs:
        assert p.returncode == 0, (doc, index, p.rank, p.out[-4000:])
