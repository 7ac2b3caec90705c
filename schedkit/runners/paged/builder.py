"""Small seeded random-weight models, saved as Hugging Face folders.

The folder (``config.json`` plus ``model.safetensors`` with transformers' weight names)
loads both in the paged runner and in transformers, which makes transformers the
oracle on exactly the same weights. Only torch and safetensors are needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def tiny_config(family: str = "llama", *, vocab_size: int = 512, hidden_size: int = 64,
                intermediate_size: int = 128, num_layers: int = 2, num_heads: int = 4,
                num_kv_heads: int = 2, max_position_embeddings: int = 2048,
                tie_word_embeddings: bool = False, rope_theta: float = 10000.0,
                rope_scaling: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """A transformers-style config dict of a small Llama or Qwen2 model.

    ``extra`` keys are copied verbatim (e.g. ``head_dim``, ``attention_bias``).
    """
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[family]], "model_type": family,
        "vocab_size": vocab_size, "hidden_size": hidden_size,
        "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "hidden_act": "silu", "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6, "rope_theta": rope_theta, "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": None, "eos_token_id": None, "torch_dtype": "float32",
    }
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    cfg.update(extra)
    return cfg


def random_state_dict(config: dict[str, Any], seed: int = 0,
                      std: float = 0.05) -> dict[str, torch.Tensor]:
    """Weights with transformers' names: normal(0, std) matrices and biases, and
    norm weights near 1 (perturbed, so a wrongly loaded norm shows up in tests)."""
    from schedkit.runners.paged.models.args import model_args_from_hf

    a = model_args_from_hf(config, "random model config")
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(dim, generator=g)

    sd = {"model.embed_tokens.weight": normal(a.vocab_size, a.hidden_size)}
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm(a.hidden_size)
        sd[p + "post_attention_layernorm.weight"] = norm(a.hidden_size)
        for name, rows in (("q_proj", a.q_size), ("k_proj", a.kv_size), ("v_proj", a.kv_size)):
            sd[p + f"self_attn.{name}.weight"] = normal(rows, a.hidden_size)
            if a.qkv_bias:
                sd[p + f"self_attn.{name}.bias"] = normal(rows)
        sd[p + "self_attn.o_proj.weight"] = normal(a.hidden_size, a.q_size)
        if a.o_bias:
            sd[p + "self_attn.o_proj.bias"] = normal(a.hidden_size)
        sd[p + "mlp.gate_proj.weight"] = normal(a.intermediate_size, a.hidden_size)
        sd[p + "mlp.up_proj.weight"] = normal(a.intermediate_size, a.hidden_size)
        sd[p + "mlp.down_proj.weight"] = normal(a.hidden_size, a.intermediate_size)
    sd["model.norm.weight"] = norm(a.hidden_size)
    if not a.tie_word_embeddings:
        sd["lm_head.weight"] = normal(a.vocab_size, a.hidden_size)
    return sd


def build_random_model(path: str | Path, config: dict[str, Any], seed: int = 0,
                       std: float = 0.05, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of a seeded random model to ``path``
    (weights drawn in float32, stored as ``dtype``).

    Returns:
        The folder, ready for the paged runner and ``AutoModelForCausalLM.from_pretrained``.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = {k: v.to(dtype) for k, v in random_state_dict(config, seed, std).items()}
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def build_random_eagle_head(path: str | Path, target_config: dict[str, Any], seed: int = 0,
                            std: float = 0.05, *, fc_bias: bool = False, input_norm: bool = False,
                            own_embedding: bool = False) -> Path:
    """Write a seeded random EAGLE head for a model of ``target_config`` to ``path``:
    ``config.json`` of one layer of the target's shape, ``model.safetensors`` with
    ``fc.weight`` (and ``fc.bias``), ``layers.0.*`` (with ``input_layernorm`` if
    ``input_norm``) and ``embed_tokens.weight`` if ``own_embedding``
    (:func:`~schedkit.runners.paged.models.eagle.load_eagle_head` reads it)."""
    from safetensors.torch import save_file

    config = {**target_config, "num_hidden_layers": 1}
    drawn = random_state_dict(config, seed, std)
    hidden = config["hidden_size"]
    g = torch.Generator().manual_seed(seed + 1)
    weights = {"fc.weight": torch.randn(hidden, 2 * hidden, generator=g) * std}
    if fc_bias:
        weights["fc.bias"] = torch.randn(hidden, generator=g) * std
    for name, tensor in drawn.items():
        if name.startswith("model.layers.0."):
            short = name[len("model."):]
            if input_norm or "input_layernorm" not in short:
                weights[short] = tensor
    if own_embedding:
        weights["embed_tokens.weight"] = drawn["model.embed_tokens.weight"]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
