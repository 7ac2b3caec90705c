"""bfloat16 on CPU: teacher-forced top-1 agreement with transformers in bfloat16.

Random weights give flat logits, so near-ties flip under bf16 rounding even between
transformers' own bf16 and fp32 runs (about 97% agreement). The runner must be as close
to transformers as that noise floor allows, and agree on every clear decision."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from schedkit.runners.paged.model_runner import PagedModelRunner  # noqa: E402
from schedkit.runners.paged.testing import (  # noqa: E402
    hf_next_tokens,
    load_hf_model,
    paged_config,
    paged_next_tokens,
    random_prompts,
    top1_agreement,
)


def test_bf16_top1_agreement_with_transformers(model_dir: Any) -> None:
    path = model_dir("qwen2", hidden_size=128, num_layers=3, num_heads=8, num_kv_heads=2,
                     intermediate_size=256)
    seqs = random_prompts([150, 120, 90, 150], 512, seed=9)
    runner = PagedModelRunner.from_config(paged_config(path, dtype="bfloat16", max_model_len=256))
    runner.initialize(64, 16)
    got = paged_next_tokens(runner, seqs, chunk=40)
    hf_bf16, _ = hf_next_tokens(load_hf_model(path, dtype=torch.bfloat16), seqs)
    hf_fp32, margins = hf_next_tokens(load_hf_model(path), seqs)
    noise_floor = top1_agreement(hf_bf16, hf_fp32)
    assert top1_agreement(got, hf_bf16) >= noise_floor - 0.02
    assert top1_agreement(got, hf_bf16, margins, min_margin=0.05) >= 0.99
