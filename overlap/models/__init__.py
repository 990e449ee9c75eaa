"""Models that the tensor-parallel layers are applied to from outside.

``GPT`` / ``GPTConfig``: a small GPT as plain single-device code (``gpt.py``);
``corpus``: a generated character-level corpus, its tokenizer and ``get_batch``;
``checkpoint``: checkpoint files with a checksum and the run's config.
"""

from . import checkpoint, corpus
from .corpus import CharTokenizer, get_batch
from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "CharTokenizer", "checkpoint", "corpus", "get_batch"]
