"""Models that the tensor-parallel layers are applied to from outside.

``GPT`` / ``GPTConfig``: a small GPT as plain single-device code (``gpt.py``);
``corpus``: a generated character-level corpus, its tokenizer and ``get_batch``.
"""

from . import corpus
from .corpus import CharTokenizer, get_batch
from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "CharTokenizer", "corpus", "get_batch"]
