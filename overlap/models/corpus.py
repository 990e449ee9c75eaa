"""A tiny character-level corpus, generated (no downloads), and its tokenizer.

The text comes from a small fixed grammar driven by ``random.Random(seed)``: sentences
about a few made-up creatures, places and things, with agreement between subject and
verb and a few recurring phrases, so a small model has structure to learn within tens
of steps. The same seed gives the same text on every machine and Python version
(``Random.random`` and ``Random.choice`` have been stable since Python 3.2).

    text = corpus_text()                 # ~300 KB of str, same every time
    tok = CharTokenizer.from_text(text)  # vocab: the sorted characters of the text
    x, y = get_batch("train", 8, 64, torch.Generator().manual_seed(0))  # (8, 64) each
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import torch

__all__ = ["CharTokenizer", "corpus_text", "get_batch", "tokens", "tokenizer"]

DEFAULT_SEED = 1234
DEFAULT_CHARS = 300_000
VAL_FRACTION = 0.1

_NAMES = ["the fox", "the owl", "a small crab", "the old heron", "my cat", "the miller",
          "a grey wolf", "the queen", "the baker", "a young otter"]
_PLURALS = ["the foxes", "two owls", "the crabs", "the herons", "our cats", "the millers",
            "the wolves", "the children"]
_VERBS = [("sees", "see"), ("finds", "find"), ("carries", "carry"), ("wants", "want"),
          ("hides", "hide"), ("paints", "paint"), ("follows", "follow"), ("counts", "count")]
_THINGS = ["a red apple", "the silver key", "three stones", "a paper boat", "the map",
           "an empty jar", "the lantern", "a long rope", "the blue feather", "some bread"]
_PLACES = ["by the river", "under the bridge", "in the forest", "at the market",
           "on the hill", "near the mill", "behind the wall", "in the snow"]
_TIMES = ["at dawn", "every morning", "in winter", "after the rain", "at night", "today"]
_CONJ = ["and then", "but", "so", "while"]
_FEELINGS = ["happy", "tired", "hungry", "curious", "quiet", "brave"]


def _clause(rng: random.Random) -> str:
    if rng.random() < 0.6:
        subj, verb = rng.choice(_NAMES), rng.choice(_VERBS)[0]
    else:
        subj, verb = rng.choice(_PLURALS), rng.choice(_VERBS)[1]
    words = [subj, verb, rng.choice(_THINGS)]
    if rng.random() < 0.5:
        words.append(rng.choice(_PLACES))
    if rng.random() < 0.3:
        words.append(rng.choice(_TIMES))
    return " ".join(words)


def _sentence(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.15:
        name = rng.choice(_NAMES)
        s = f"{name} is {rng.choice(_FEELINGS)} {rng.choice(_PLACES)}"
    elif r < 0.55:
        s = f"{_clause(rng)} {rng.choice(_CONJ)} {_clause(rng)}"
    else:
        s = _clause(rng)
    end = "?" if rng.random() < 0.1 else "."
    return s[0].upper() + s[1:] + end


@functools.cache
def corpus_text(seed: int = DEFAULT_SEED, n_chars: int = DEFAULT_CHARS) -> str:
    """About ``n_chars`` characters of generated prose (paragraphs of 3-7 sentences)."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_chars:
        para = " ".join(_sentence(rng) for _ in range(rng.randint(3, 7))) + "\n\n"
        parts.append(para)
        size += len(para)
    return "".join(parts)[:n_chars]


@dataclass(frozen=True)
class CharTokenizer:
    """One token per character; ids are positions in ``chars`` (sorted)."""

    chars: str

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> list[int]:
        stoi = self._stoi
        return [stoi[c] for c in s]

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)

    @functools.cached_property
    def _stoi(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.chars)}


@functools.cache
def tokenizer() -> CharTokenizer:
    """The tokenizer of the default corpus."""
    return CharTokenizer.from_text(corpus_text())


@functools.cache
def tokens(split: str) -> torch.Tensor:
    """The default corpus's token ids [N] (int64): the first 90% is 'train', the rest 'val'."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    text = corpus_text()
    data = torch.tensor(tokenizer().encode(text), dtype=torch.int64)  # (N,)
    n_train = int(len(data) * (1 - VAL_FRACTION))
    return data[:n_train] if split == "train" else data[n_train:]


def get_batch(split: str, batch: int, block: int, generator: torch.Generator,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random windows of the split: inputs x [batch, block] and targets y, the
    same windows shifted by one token. Only ``generator`` is drawn from."""
    data = tokens(split)
    if block + 1 > len(data):
        raise ValueError(f"block={block} is longer than the {split} split ({len(data)} tokens)")
    starts = torch.randint(len(data) - block, (batch,), generator=generator)  # (batch,)
    offsets = torch.arange(block + 1)  # (block + 1,)
    windows = data[starts[:, None] + offsets]  # (batch, block + 1)
    x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # (batch, block) each
    return x.to(device), y.to(device)
