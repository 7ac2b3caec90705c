"""bfloat16 on CPU: teacher-forced top-1 agreement with transformers in bfloat16.

On a trained model (tests/fixtures/byte-lm) the two must agree on at least 99% of
positions, the issue's target. Random weights give flat logits, where near-ties flip
under bf16 rounding even between transformers' own bf16 and fp32 runs (about 97%
agreement); there the runner must be as close as that noise floor allows, and agree
on every clear decision."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from schedkit.runners.paged.model_runner import PagedModelRunner  # noqa: E402
from schedkit.runners.paged.testing import (  # noqa: E402
    BYTE_LM,
    held_out_text_sequences,
    hf_next_tokens,
    load_hf_model,
    paged_config,
    paged_next_tokens,
    random_prompts,
    top1_agreement,
)


@pytest.mark.parametrize("compute_dtype", ["model", "float32"])
def test_bf16_top1_agreement_on_a_trained_model(compute_dtype: str) -> None:
    """``model``: bfloat16 arithmetic, against transformers in bfloat16. ``float32`` (what
    ``auto`` picks on a CPU without native bf16 matmul): float32 arithmetic on the
    bfloat16 weights with a bfloat16 KV cache, against transformers in float32 on the
    same bfloat16-rounded weights."""
    seqs = held_out_text_sequences(6, 300)
    hf_fp32, _ = hf_next_tokens(load_hf_model(BYTE_LM), seqs)
    # the fixture has learnt something: it predicts most held-out bytes
    accuracy = sum(p == t for s, pred in zip(seqs, hf_fp32, strict=True)
                   for p, t in zip(pred[:-1], s[1:], strict=True)) / sum(len(s) - 1 for s in seqs)
    assert accuracy > 0.4
    runner = PagedModelRunner.from_config(paged_config(BYTE_LM, dtype="bfloat16", vocab_size=256,
                                                       max_model_len=512, compute_dtype=compute_dtype))
    assert runner.kv_dtype == torch.bfloat16
    assert runner.dtype == (torch.bfloat16 if compute_dtype == "model" else torch.float32)
    runner.initialize(160, 16)
    got = paged_next_tokens(runner, seqs, chunk=48)  # later chunks attend to cached context
    hf = load_hf_model(BYTE_LM, dtype=torch.bfloat16)
    if compute_dtype == "float32":
        hf = hf.float()
    expected, _ = hf_next_tokens(hf, seqs)
    assert top1_agreement(got, expected) >= 0.99


def test_bf16_top1_agreement_on_random_weights(model_dir: Any) -> None:
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
