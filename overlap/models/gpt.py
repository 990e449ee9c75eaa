"""A small GPT (nanoGPT-like), plain single-device code.

The model has no distributed code. Tensor parallelism is applied to it from outside
(``overlap.nn.parallelize``), which swaps ``attn.qkv`` / ``mlp.fc1`` for column-parallel
layers and ``attn.proj`` / ``mlp.fc2`` for row-parallel ones. Two choices here make that
work without the model knowing:

- ``attn.qkv``'s output features are laid out per head, ``(n_head, 3, head_dim)``
  (Megatron's layout), so a contiguous slice of ``3 * n_embd / R`` rows, which is what a
  column-parallel layer holds, is the q, k and v of ``n_head / R`` whole heads.
- Attention reads its head count from the qkv output at run time
  (``n_local = qkv.shape[-1] // (3 * head_dim)``), and the batch and sequence sizes too
  (a sequence-parallel column layer returns the gathered sequence).

Shapes (B batch, T sequence, C = n_embd, nh heads, hs = C / nh, V vocab)::

    idx, targets   [B, T]        int64 token ids
    x (residual)   [B, T, C]
    qkv            [B, T, nh * 3 * hs]   per head: q, k, v
    logits         [B, T, V]     lm_head shares wte's weight
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "GPTConfig"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """The model's sizes; every rank of a job builds the same one."""

    vocab_size: int
    """Tokens in the vocabulary (the corpus's character count)."""
    block_size: int
    """Longest sequence: the position embedding's rows."""
    n_layer: int
    """Transformer blocks."""
    n_head: int
    """Attention heads; a tensor-parallel size must divide it."""
    n_embd: int
    """Hidden size C; n_head must divide it."""
    dropout: float = 0.0
    """Dropout after the embeddings, attention and MLP. Keep 0.0 to compare sharded and
    unsharded runs: a sharded layer draws its dropout mask from other random numbers."""
    bias: bool = True
    """Biases in the Linear and LayerNorm layers."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not a multiple of n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # per head: q, k, v
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, nh * 3 * hs); nh = local heads once qkv is column-parallel
        b, t, c3 = qkv.shape  # T: the whole sequence, also when x holds a sequence shard
        hs = self.head_dim
        nh = c3 // (3 * hs)
        q, k, v = qkv.view(b, t, nh, 3, hs).permute(3, 0, 2, 1, 4).unbind(0)  # 3 x (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(b, t, nh * hs)  # (B, T, nh * hs)
        return self.resid_drop(self.proj(y))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.fc2 = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(F.gelu(self.fc1(x))))  # (B, T, C), via (B, T, 4C)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then + mlp(ln_2(.))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embedding, ``n_layer`` pre-LN blocks, final LayerNorm, tied head.

    ``GPT(config, seed=s)`` initializes every parameter from its own generator seeded
    with ``s`` (the global RNG is not consulted), so every rank builds the same weights.
    """

    def __init__(self, config: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """nanoGPT's init, from a generator: N(0, 0.02), residual projections (attn.proj,
        mlp.fc2) N(0, 0.02 / sqrt(2 * n_layer)), biases 0, LayerNorms 1 and 0."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        std_resid = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, m in self.named_modules():  # registration order: the same on every rank
            if isinstance(m, nn.Linear) and m is not self.lm_head:
                std = std_resid if name.endswith(("attn.proj", "mlp.fc2")) else 0.02
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * std)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.Embedding):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.02)
            elif isinstance(m, nn.LayerNorm):
                m.weight.fill_(1.0)
                if m.bias is not None:
                    m.bias.zero_()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``idx`` [B, T] -> ``(logits [B, T, V], mean cross-entropy or None)``."""
        b, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size={self.config.block_size}")
        pos = torch.arange(t, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = None
        if targets is not None:
            flat = logits.reshape(b * t, -1).float()  # (B*T, V); the loss in fp32 whatever the dtype
            loss = F.cross_entropy(flat, targets.reshape(b * t))  # targets (B*T,)
        return logits, loss

    def num_params(self) -> int:
        """Parameters, the tied embedding counted once."""
        return sum(p.numel() for p in self.parameters())
