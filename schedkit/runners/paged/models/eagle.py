"""An EAGLE draft head: one decoder layer over the target model's hidden states.

The head reads, at each position ``p``, the target's final hidden state there and the
embedding of the token at ``p + 1``, projects the two (concatenated, embedding first)
back to the hidden size, runs one decoder layer, and predicts the token at ``p + 2``
with the target's LM head. Drafting on from there, it feeds its own output in place of
the target's hidden state. This is EAGLE-1 as vLLM loads it: the layer has no input
norm unless the checkpoint brings one, there is no final norm, and the embedding is the
target's unless the checkpoint has its own.

A head's folder holds a transformers ``config.json`` of one Llama / Qwen2 layer (the
target's hidden size) and safetensors named ``fc.weight`` (optionally ``fc.bias``),
``layers.0.*`` as in transformers and optionally ``embed_tokens.weight``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from schedkit.errors import ConfigError
from schedkit.runners.paged.attention_metadata import AttentionMetadata
from schedkit.runners.paged.models.args import ModelArgs
from schedkit.runners.paged.models.llama import DecoderLayer, RotaryEmbedding


class EagleHead(nn.Module):
    """Args:
        args: The head's shape (one layer; the target's hidden size and vocabulary).
        max_positions: Longest sequence served (its RoPE tables).
        fc_bias: Whether the projection has a bias.
        input_norm: Whether the layer normalises its input.
        own_embedding: Whether the head has its own token embedding.
    """

    def __init__(self, args: ModelArgs, max_positions: int, *, fc_bias: bool = False,
                 input_norm: bool = False, own_embedding: bool = False) -> None:
        super().__init__()
        self.args = args
        self.fc = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=fc_bias)
        self.layer = DecoderLayer(args)
        if not input_norm:
            self.layer.input_layernorm = nn.Identity()  # type: ignore[assignment]
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size) if own_embedding else None
        self.rotary_emb = RotaryEmbedding(args, max_positions)

    def forward(self, input_ids: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                target_embedding: nn.Embedding) -> torch.Tensor:
        """The head's hidden states [T, hidden] (its KV written on the way): ``input_ids``
        are the tokens one past ``target_hidden``'s positions."""
        embed = self.embed_tokens if self.embed_tokens is not None else target_embedding
        e = embed(input_ids)
        x = self.fc(torch.cat((e, target_hidden.to(e.dtype)), dim=-1))
        return self.layer(x, positions, self.rotary_emb, kv_cache, meta)


def load_eagle_head(path: Path, args: ModelArgs, target: ModelArgs, *, dtype: torch.dtype,
                    device: torch.device, max_positions: int) -> EagleHead:
    """Build the head in ``path`` (config parsed into ``args``) for ``target``.

    Raises:
        ConfigError: Not one layer, another hidden size or vocabulary than the target's,
            or weights missing, unexpected or of the wrong shape.
    """
    from safetensors import safe_open

    from schedkit.runners.paged.loader import fill_parameters

    where = str(path)
    if args.num_layers != 1:
        raise ConfigError(f"{where}: an EAGLE head has one decoder layer, its config has {args.num_layers}")
    for key, got, want in (("hidden_size", args.hidden_size, target.hidden_size),
                           ("vocab_size", args.vocab_size, target.vocab_size)):
        if got != want:
            raise ConfigError(f"{where}: the head's {key} is {got}, the target's {want}")
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[name] = f.get_tensor(name)
    if "fc.weight" not in tensors:
        raise ConfigError(f"{where}: no fc.weight: not an EAGLE head")
    with torch.device("meta"):
        head = EagleHead(args, max_positions, fc_bias="fc.bias" in tensors,
                         input_norm="layers.0.input_layernorm.weight" in tensors,
                         own_embedding="embed_tokens.weight" in tensors)
    head = head.to_empty(device=device).to(dtype)
    head.rotary_emb = RotaryEmbedding(args, max_positions).to(device)

    def renamed() -> Iterator[tuple[str, torch.Tensor, str]]:
        for name, tensor in tensors.items():
            yield ("layer." + name[len("layers.0."):] if name.startswith("layers.0.") else name), tensor, where

    fill_parameters(head, renamed(), args, where)
    return head.eval()


__all__ = ["EagleHead", "load_eagle_head"]
