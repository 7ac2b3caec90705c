"""The shape of a supported decoder, parsed and checked from a transformers config.json.

Everything the model, the loader and the runner need is read here once, so an
unsupported feature fails with a :class:`ConfigError` naming the key before any weight
is touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from schedkit.errors import ConfigError

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
"""transformers architecture name -> model family."""

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """Hyper-parameters of a Llama / Qwen2-family decoder."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    rope_params: tuple[tuple[str, float], ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _get(cfg: dict[str, Any], key: str, source: str) -> Any:
    if key not in cfg:
        raise ConfigError(f"{source}: config.json has no '{key}'")
    return cfg[key]


def _rope_settings(cfg: dict[str, Any], source: str) -> tuple[float, str, dict[str, float]]:
    """(theta, type, extra parameters) from either the transformers-5 ``rope_parameters``
    form or the older ``rope_theta`` + ``rope_scaling`` form."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = str(params.pop("rope_type", params.pop("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{source}: rope type {rope_type!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if float(params.pop("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor != 1 is not supported")
    required = {"default": (), "linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings")}[rope_type]
    missing = [k for k in required if k not in params]
    if missing:
        raise ConfigError(f"{source}: rope type {rope_type!r} needs {missing}")
    return theta, rope_type, {k: float(params[k]) for k in required}


def model_args_from_hf(cfg: dict[str, Any], source: str = "config.json") -> ModelArgs:
    """Parse a transformers config dict.

    Raises:
        ConfigError: The architecture or one of its features is not supported.
    """
    archs = cfg.get("architectures") or []
    family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if family is None and not archs:
        family = {"llama": "llama", "qwen2": "qwen2"}.get(cfg.get("model_type", ""))
    if family is None:
        raise ConfigError(f"{source}: architecture {archs or cfg.get('model_type')!r} is not "
                          f"supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported (silu only)")
    if cfg.get("mlp_bias", False):
        raise ConfigError(f"{source}: mlp_bias is not supported")
    if cfg.get("use_sliding_window", False):
        raise ConfigError(f"{source}: sliding-window attention is not supported")
    num_heads = int(_get(cfg, "num_attention_heads", source))
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ConfigError(f"{source}: num_attention_heads ({num_heads}) is not a multiple of "
                          f"num_key_value_heads ({num_kv_heads})")
    hidden = int(_get(cfg, "hidden_size", source))
    theta, rope_type, rope_params = _rope_settings(cfg, source)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelArgs(
        family=family, vocab_size=int(_get(cfg, "vocab_size", source)), hidden_size=hidden,
        intermediate_size=int(_get(cfg, "intermediate_size", source)),
        num_layers=int(_get(cfg, "num_hidden_layers", source)), num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_type=rope_type,
        rope_params=tuple(sorted(rope_params.items())),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or attention_bias, o_bias=family == "llama" and attention_bias,
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies, computed exactly as transformers does (float32)."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    p = dict(args.rope_params)
    if args.rope_type == "linear":
        inv_freq = inv_freq / p["factor"]
    elif args.rope_type == "llama3":
        factor, old_len = p["factor"], p["original_max_position_embeddings"]
        low, high = p["low_freq_factor"], p["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq
