"""Clear errors before serving starts: a missing or unsupported model folder, a config
the model cannot serve, and a KV cache that does not fit in memory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from schedkit.engine.core import EngineCore  # noqa: E402
from schedkit.errors import ConfigError  # noqa: E402
from schedkit.runners import runner_class  # noqa: E402
from schedkit.runners.paged.builder import build_random_model, tiny_config  # noqa: E402
from schedkit.runners.paged.kv_cache import KVCacheAllocationError  # noqa: E402
from schedkit.runners.paged.testing import paged_config  # noqa: E402


def _start(path: Any, **kw: Any) -> EngineCore:
    return EngineCore(paged_config(path, **kw))


def test_paged_is_a_registered_runner_kind() -> None:
    assert runner_class("paged").__name__ == "PagedModelRunner"


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="neither a built-in model"):
        _start(tmp_path / "nope")


def test_folder_without_config_or_weights(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no config.json"):
        _start(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        _start(tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architecture .* is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_sliding_window": True}, "sliding-window"),
    ({"num_key_value_heads": 3}, "not a multiple"),
])
def test_unsupported_model_configs(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    path = build_random_model(tmp_path, tiny_config("qwen2"))
    cfg = json.loads((path / "config.json").read_text()) | change
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        _start(path)


def test_missing_and_misshapen_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = build_random_model(tmp_path, tiny_config())
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.1.self_attn.v_proj.weight"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ConfigError, match="lacks weights.*layers.1.self_attn.qkv_proj"):
        _start(path)
    weights["model.layers.1.self_attn.v_proj.weight"] = torch.zeros(8, 64)
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ConfigError, match="has shape \\(8, 64\\)"):
        _start(path)


def test_config_that_does_not_fit_the_model(model_dir: Any) -> None:
    path = model_dir("llama", max_position_embeddings=256)
    with pytest.raises(ConfigError, match="max_model_len = 512 exceeds"):
        _start(path, max_model_len=512)
    with pytest.raises(ConfigError, match="runner.vocab_size = 32000 exceeds"):
        _start(path, max_model_len=256, vocab_size=32000)
    with pytest.raises(ConfigError, match="attention_backend = 'triton' needs"):
        _start(path, max_model_len=256, attention_backend="triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_requested_without_cuda(model_dir: Any) -> None:
    with pytest.raises(ConfigError, match="no CUDA device"):
        _start(model_dir("llama"), device="cuda")


def test_kv_cache_that_does_not_fit_memory(model_dir: Any) -> None:
    with pytest.raises(KVCacheAllocationError, match="KV cache .* needs .* GiB") as err:
        _start(model_dir("llama"), num_blocks=1 << 24, block_size=1024)  # the ceiling: ~TBs of KV
    assert isinstance(err.value, ConfigError)


def test_out_of_vocabulary_prompt_is_rejected_at_add(model_dir: Any) -> None:
    """A token id >= the vocabulary is refused when the request is added, so it cannot
    fail the whole step (an IndexError in the embedding) and every request in it."""
    from schedkit.errors import RequestError
    from schedkit.runners.paged.testing import greedy_request, run_engine

    engine = _start(model_dir("llama"))
    vocab = engine.runner.vocab_size
    with pytest.raises(RequestError, match=f"token id {vocab} is outside the model's vocabulary of {vocab}"):
        engine.add_request(greedy_request("oov", [1, 2, vocab], 3))
    assert "oov" not in engine.scheduler.requests
    outs = run_engine(engine, [greedy_request(f"ok{i}", [1 + i, 2, 3], 3) for i in range(3)])
    assert all(len(v) == 3 for v in outs.values())


@pytest.mark.slow
def test_replicas_building_the_same_model_at_once_do_not_break_each_other(tmp_path: Path) -> None:
    """Two processes resolving a built-in model on a cold cache (replicas starting
    together): one builds, the other waits for it; neither removes the folder the other
    is about to read."""
    import subprocess
    import sys

    code = ("import sys; from schedkit.runners.paged.loader import resolve_model_path, read_model_args; "
            "p = resolve_model_path('tiny-llama', 3); read_model_args(p); "
            "assert (p / 'config.json').is_file() and any(p.glob('*.safetensors')); print(p)")
    env = {**__import__("os").environ, "SCHEDKIT_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    assert len({out.strip() for out, _ in results}) == 1
    assert not list((tmp_path / "models").glob("*.tmp*"))
