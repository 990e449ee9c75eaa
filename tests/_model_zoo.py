"""Tiny models for the ``parallelize`` tests (``_models_worker.py``): HF transformers' Llama,
Mistral, Qwen2, Qwen3 and GPT-2 built from their configs (never downloaded), and models
written here with the module layout of torchtitan's Llama, gpt-fast's Transformer and
nanoGPT's GPT (their structure, not their code). Sizes: vocabulary V, hidden C, 4 heads,
2 layers."""

from __future__ import annotations

import torch

V, C = 96, 64


def families(kv: int, ws: int) -> dict:
    import transformers as tf

    kv = kv or max(2, ws)  # GQA at 2 ranks; at 4, one key/value head per rank
    common = dict(vocab_size=V, hidden_size=C, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64)
    return {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_key_value_heads=kv)),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**common, num_key_value_heads=kv, sliding_window=None,
                                                                  attn_implementation="eager")),  # repeat_kv
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, num_key_value_heads=kv, tie_word_embeddings=True)),
        "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, num_key_value_heads=kv, head_dim=16,
                                                            tie_word_embeddings=True)),
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_positions=64, n_embd=C, n_layer=2, n_head=4,
                                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    }


class TitanLinear(torch.nn.Linear):
    """A subclass of nn.Linear keeping its forward, as torchtitan's models use."""


class TitanAttention(torch.nn.Module):
    """Laid out as torchtitan's Llama attention: wq, wk, wv, wo; n_heads, n_kv_heads, n_rep."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.n_rep = n_heads // n_kv_heads
        self.wq = TitanLinear(dim, n_heads * self.head_dim, bias=False)
        self.wk = TitanLinear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = TitanLinear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = TitanLinear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape  # the whole sequence, also under sequence parallelism
        q = self.wq(x).view(bs, seqlen, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.wk(x).view(bs, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.wv(x).view(bs, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope[0, :seqlen], rope[1, :seqlen]  # (T, hd / 2)

        def rot(t: torch.Tensor) -> torch.Tensor:
            a, b = t[..., ::2], t[..., 1::2]
            return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)

        q, k = rot(q), rot(k).repeat_interleave(self.n_rep, 1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v.repeat_interleave(self.n_rep, 1), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(bs, seqlen, -1))  # (B, T, C)


class TitanFeedForward(torch.nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (TitanLinear(dim, hidden, bias=False), TitanLinear(hidden, dim, bias=False),
                                     TitanLinear(dim, hidden, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class TitanBlock(torch.nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.attention = TitanAttention(dim, n_heads, n_kv_heads)
        self.feed_forward = TitanFeedForward(dim, 2 * dim)
        self.attention_norm, self.ffn_norm = torch.nn.RMSNorm(dim, eps=1e-5), torch.nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(torch.nn.Module):
    """Built like torchtitan's Llama (tok_embeddings; layers in a ModuleDict called with the
    rotary table positionally; norm; output), written here, no torchtitan needed."""

    def __init__(self, n_kv_heads: int) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(V, C)
        self.layers = torch.nn.ModuleDict({str(i): TitanBlock(C, 4, n_kv_heads) for i in range(2)})
        self.norm, self.output = torch.nn.RMSNorm(C, eps=1e-5), TitanLinear(C, V, bias=False)
        hd = C // 4
        f = torch.outer(torch.arange(64.0), 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd))  # (T, hd / 2)
        self.register_buffer("rope", torch.stack((f.cos(), f.sin())), persistent=False)  # (2, T, hd / 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        return self.output(self.norm(h))


class FastAttention(torch.nn.Module):
    """Laid out as gpt-fast's attention: one fused wqkv ([q | k | v], GQA), wo; n_head,
    n_local_heads (its key/value heads), head_dim, dim read in forward."""

    def __init__(self, dim: int, n_head: int, n_kv: int) -> None:
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim, self.dim = n_head, n_kv, dim // n_head, dim
        self.wqkv = torch.nn.Linear(dim, (n_head + 2 * n_kv) * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim).transpose(1, 2)
        rep = self.n_head // self.n_local_heads
        y = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                                             v.repeat_interleave(rep, 1), is_causal=True)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim))  # (B, T, C)


class FastBlock(torch.nn.Module):
    def __init__(self, dim: int, n_kv: int) -> None:
        super().__init__()
        self.attention = FastAttention(dim, 4, n_kv)
        self.feed_forward = TitanFeedForward(dim, 2 * dim)
        self.ffn_norm, self.attention_norm = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class FastGPT(torch.nn.Module):
    """Built like gpt-fast's Transformer (fused wqkv with GQA; learned positions here)."""

    def __init__(self, n_kv: int) -> None:
        super().__init__()
        self.tok_embeddings, self.pos = torch.nn.Embedding(V, C), torch.nn.Embedding(64, C)
        self.layers = torch.nn.ModuleList(FastBlock(C, n_kv) for _ in range(2))
        self.norm, self.output = torch.nn.RMSNorm(C), torch.nn.Linear(C, V, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx) + self.pos(torch.arange(idx.shape[1]))
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


class NanoAttention(torch.nn.Module):
    """Laid out as nanoGPT's: a fused c_attn split by n_embd, and the input's width C used
    to shape the heads and the output (``B, T, C = x.size()``)."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head, self.n_embd = n_head, n_embd
        self.c_attn, self.c_proj = torch.nn.Linear(n_embd, 3 * n_embd), torch.nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # noqa: N806 (nanoGPT's names)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoBlock(torch.nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.attn = torch.nn.LayerNorm(n_embd), NanoAttention(n_embd, n_head)
        self.ln_2 = torch.nn.LayerNorm(n_embd)
        self.mlp = torch.nn.Sequential()
        self.mlp.c_fc, self.mlp.gelu = torch.nn.Linear(n_embd, 4 * n_embd), torch.nn.GELU()
        self.mlp.c_proj, self.mlp.dropout = torch.nn.Linear(4 * n_embd, n_embd), torch.nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(torch.nn.Module):
    """Built like nanoGPT's GPT: transformer = ModuleDict(wte, wpe, drop, h, ln_f), a tied lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = torch.nn.ModuleDict(dict(
            wte=torch.nn.Embedding(V, C), wpe=torch.nn.Embedding(64, C), drop=torch.nn.Dropout(0.0),
            h=torch.nn.ModuleList(NanoBlock(C, 4) for _ in range(2)), ln_f=torch.nn.LayerNorm(C)))
        self.lm_head = torch.nn.Linear(C, V, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        x = t.drop(t.wte(idx) + t.wpe(torch.arange(idx.shape[1])))
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))


def build(family: str, ws: int, kv: int = 0) -> torch.nn.Module:
    """The same weights on every rank; kv: key/value heads (default: 2, or one per rank)."""
    torch.manual_seed(1234)  # the same weights on every rank
    if family == "nanogpt":
        m = NanoGPT()
    elif family in ("titan", "gptfast"):
        m = (TitanLlama if family == "titan" else FastGPT)(kv or max(2, ws))
    else:
        m = families(kv, ws)[family]()
    with torch.no_grad():  # norms away from 1 / 0 so that their gradients mean something
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    return m.float().train()


def titan_plan(sp: bool) -> dict:
    """torchtitan's Llama plan, in torch's styles (what its users pass to parallelize_module)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    if not sp:
        return {"layers.*.attention.w[qkv]": ColwiseParallel(), "layers.*.attention.wo": RowwiseParallel(),
                "layers.*.feed_forward.w[13]": ColwiseParallel(), "layers.*.feed_forward.w2": RowwiseParallel()}
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                 desired_input_layouts=(Replicate(), None)),
        "layers.*.attention.w[qkv]": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w[13]": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
