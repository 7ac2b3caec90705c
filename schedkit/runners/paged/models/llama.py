"""A Llama / Qwen2-family decoder over packed, paged batches.

Parameter names mirror transformers' (``model.layers.0.self_attn...``) except for the
two fused projections, ``qkv_proj`` (q, k, v stacked on the output dim) and
``gate_up_proj`` (gate, up); the loader maps checkpoints into them. Numerics follow
transformers' (RMSNorm in float32, the same RoPE tables) so greedy outputs in float32
match it token for token.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from schedkit.runners.paged.attention import (
    AttentionMetadata,
    paged_attention,
    rope_store_attention_cpu,
    store_kv,
)
from schedkit.runners.paged.cpu_kernels import add_rms_norm, silu_and_mul
from schedkit.runners.paged.models.args import ModelArgs, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions`` (neox layout)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(args))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.sizes = [args.q_size, args.kv_size, args.kv_size]
        self.scale = args.head_dim ** -0.5
        self.qkv_proj = nn.Linear(args.hidden_size, sum(self.sizes), bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.q_size, args.hidden_size, bias=args.o_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        k_cache, v_cache = kv_cache
        store_kv(k, v.view(num_tokens, self.num_kv_heads, self.head_dim), k_cache, v_cache,
                 meta.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.view(num_tokens, -1))

    def forward_cpu(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                    kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """The same on the CPU (float32 or bfloat16 activations): RoPE, the KV store and
        attention in one kernel."""
        o = rope_store_attention_cpu(self.qkv_proj(x), positions, rope.cos, rope.sin, *kv_cache, meta,
                                     self.num_heads, self.scale)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(args, max_positions)


class CausalLM(nn.Module):
    """The decoder plus its LM head (tied to the embedding when the config says so).

    Args:
        args: Parsed model hyper-parameters.
        max_positions: Longest sequence served (size of the RoPE tables).
    """

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        self.args = args
        self.model = DecoderModel(args, max_positions)
        self._norm_w32: list[torch.Tensor] | None = None
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(
            args.hidden_size, args.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [T, hidden] of the packed tokens (KV written on the way)."""
        m = self.model
        x = m.embed_tokens(input_ids)
        if meta.backend == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and len(m.layers):
            return self._forward_cpu(x, positions, kv_caches, meta)
        for layer, kv_cache in zip(m.layers, kv_caches, strict=True):
            x = layer(x, positions, m.rotary_emb, kv_cache, meta)
        return m.norm(x)

    def _forward_cpu(self, x: torch.Tensor, positions: torch.Tensor,
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                     meta: AttentionMetadata) -> torch.Tensor:
        """The CPU pass: the compiled kernels for each layer's norms (each fused with the
        residual add before it), RoPE + KV store + attention and SiLU-and-mul, between the
        linear layers. Activations stay in the model's dtype (float32 or bfloat16, which
        the GEMMs take), rounded where torch rounds; the residual stream is updated in
        place; the kernels' arithmetic is float32."""
        m, eps, residual = self.model, self.args.rms_norm_eps, x
        layers = cast(list[DecoderLayer], list(m.layers))
        weights = self._norm_weights_f32()
        h = add_rms_norm(residual, None, weights[0], eps)
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            a = layer.self_attn.forward_cpu(h, positions, m.rotary_emb, kv_cache, meta)
            h = add_rms_norm(a, residual, weights[2 * i + 1], eps)
            h = add_rms_norm(layer.mlp.forward_cpu(h), residual, weights[2 * i + 2], eps)
        return h

    def _norm_weights_f32(self) -> list[torch.Tensor]:
        """Every RMSNorm weight in pass order (input, post-attention per layer, then the
        final norm) as float32: the parameters themselves in a float32 model, copies
        made once otherwise (the weights do not change after loading)."""
        cached = self._norm_w32
        if cached is None:
            norms = [n for layer in cast(list[DecoderLayer], list(self.model.layers))
                     for n in (layer.input_layernorm, layer.post_attention_layernorm)] + [self.model.norm]
            cached = [n.weight if n.weight.dtype == torch.float32 else n.weight.detach().float()
                      for n in norms]
            self._norm_w32 = cached
        return cached

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] of the selected hidden states."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.model.embed_tokens.weight).float()
