"""Vocab-parallel embedding, output head and cross-entropy (Megatron-LM's
``VocabParallelEmbedding`` and ``vocab_parallel_cross_entropy``): each rank holds V/R rows
of the vocabulary, and the full logits [tokens, V] never exist on one rank.

    tensor                 shape            meaning
    embedding weight       [V/R, C]         rows [rank * V/R, (rank + 1) * V/R) of the vocabulary
    embedding output       [..., C]         all-reduced: each token's row from the rank holding it
    head weight            [V/R, C]         the same rows (tied: the same parameter)
    logits                 [..., V/R]       this rank's columns of the logits
    cross-entropy          [tokens]         per token, from three all-reduces of [tokens] numbers
                                            (the max, the sum of exponentials, the target's logit)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import functional as F
from .layers import _group_info

__all__ = ["VocabParallelEmbedding", "vocab_parallel_cross_entropy", "reduce_from_region", "causal_lm_loss"]


class _ReduceFromRegion(torch.autograd.Function):
    """forward: all-reduce (sum); backward: identity (every rank's part gets the whole gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        with torch.no_grad():
            return F._all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None


def reduce_from_region(x: torch.Tensor, *, group: Any) -> torch.Tensor:
    """``all_reduce(x)`` forward; the identity backward. For partial results (a vocab-parallel
    embedding's rows) whose sum is the replicated value."""
    return _ReduceFromRegion.apply(x, group)


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with this rank's V/R rows: ``sum over ranks of (embedding of the ids
    this rank holds, 0 elsewhere)``. ``weight`` [V/R, C]; ``shard_index`` its global rows."""

    def __init__(self, emb: nn.Embedding, group: Any) -> None:
        super().__init__()
        if emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
            raise ValueError("vocab_parallel: an embedding with max_norm, scale_grad_by_freq or sparse is not "
                             "supported")
        self.group, self.tp_size, self.tp_rank = _group_info(group)
        v = emb.num_embeddings
        if v % self.tp_size:
            raise ValueError(f"vocab_parallel: a vocabulary of {v} does not divide over the tensor-parallel size "
                             f"{self.tp_size}; pad it (HF: model.resize_token_embeddings(n, pad_to_multiple_of=R))")
        self.num_embeddings, self.embedding_dim = v, emb.embedding_dim
        n = v // self.tp_size
        self.lo, self.hi = self.tp_rank * n, (self.tp_rank + 1) * n
        self.weight = nn.Parameter(emb.weight.detach()[self.lo:self.hi].clone())  # [V/R, C]
        pad = emb.padding_idx
        self.padding_idx = pad - self.lo if pad is not None and self.lo <= pad < self.hi else None
        self.shard_index = torch.arange(self.lo, self.hi)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.lo) | (ids >= self.hi)
        local = (ids - self.lo).masked_fill(outside, 0)
        y = torch.nn.functional.embedding(local, self.weight, self.padding_idx)  # (..., C)
        return reduce_from_region(y.masked_fill(outside.unsqueeze(-1), 0), group=self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} (/{self.tp_size}: rows {self.lo}..{self.hi}), {self.embedding_dim}"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """forward: per-token cross-entropy from the rank's logit columns and three all-reduces;
    backward: ``softmax - onehot`` on the rank's columns (no communication)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Any, ignore_index: int) -> torch.Tensor:
        import torch.distributed as tdist

        rank, world = F._rank_world(group)
        x = logits.float()  # [N, V/R]
        n = x.shape[-1]
        m = x.max(-1).values  # [N]
        tdist.all_reduce(m, tdist.ReduceOp.MAX, group=group)
        x = x - m.unsqueeze(-1)
        valid = target != ignore_index
        local = target - rank * n
        mine = valid & (local >= 0) & (local < n)
        local = local.masked_fill(~mine, 0)
        tl = x.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine  # [N]: the target's logit, on its rank
        e = x.exp()
        s = e.sum(-1)
        both = torch.stack((tl, s))  # one all-reduce for the two sums
        tdist.all_reduce(both, group=group)
        tl, s = both
        loss = (s.log() - tl).masked_fill(~valid, 0.0)
        ctx.save_for_backward(e.div_(s.unsqueeze(-1)), local, mine, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        p, local, mine, valid = ctx.saved_tensors
        g = p.clone()
        rows = mine.nonzero().squeeze(-1)
        g[rows, local[rows]] -= 1.0
        g.mul_((grad * valid).unsqueeze(-1))
        return g.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, *, group: Any = None,
                                 ignore_index: int = -100) -> torch.Tensor:
    """``F.cross_entropy(all_gather(logits_shard, dim=-1), target, reduction="none")`` without the
    gather: per token, in fp32; ignored targets give 0.

    =============  =========  ================================================
    tensor         shape      meaning
    =============  =========  ================================================
    logits_shard   [N, V/R]   this rank's vocabulary columns (rank-major)
    target         [N]        class ids in [0, V), or ``ignore_index``
    returns        [N]        the loss per token (the same on every rank)
    =============  =========  ================================================
    """
    group, _, _ = _group_info(group)
    if logits_shard.dim() != 2 or target.shape != logits_shard.shape[:1]:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits_shard.shape)} must be [N, V/R] and "
                         f"target {tuple(target.shape)} [N]")
    return _VocabParallelCrossEntropy.apply(logits_shard, target, group, ignore_index)


def causal_lm_loss(group: Any) -> Any:
    """HF transformers' ``ForCausalLMLoss`` (labels shifted left, mean over the tokens not
    ignored, or the sum over ``num_items_in_batch``) on vocab-parallel logits."""

    def loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int = 0,
             num_items_in_batch: torch.Tensor | None = None, ignore_index: int = -100,
             shift_labels: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        if shift_labels is None:
            labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:]
        t = shift_labels.reshape(-1).to(logits.device)
        per = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), t, group=group,
                                           ignore_index=ignore_index)
        if num_items_in_batch is not None:
            return per.sum() / torch.as_tensor(num_items_in_batch).to(per.device)
        return per.sum() / (t != ignore_index).sum()

    return loss
