"""Structured outputs through the engine process (``LLM``): the fake runner samples
inside each request's grammar bitmask, with the real backends over a small byte-level
tokenizer trained in the test. The fake runner's tokens are a fixed function of the
request, so an unconstrained request must come out the same whatever its neighbours'
constraints."""

from __future__ import annotations

import json
import re

import pytest

from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.llm import LLM

pytestmark = pytest.mark.slow  # grammars on the paged runner, end to end

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["Ada", "Bob"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok(bpe_tokenizer):
    return bpe_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, bpe_tokenizer):
    path = tmp_path_factory.mktemp("tok")
    bpe_tokenizer.save_pretrained(path)
    return path


def config(tokenizer_dir, backend: str, **extra):
    return config_from_dict({
        "model": {"tokenizer": str(tokenizer_dir)},
        "runner": {"vocab_size": 336, "eos_token_id": 0},
        "structured_outputs": {"backend": backend, **extra.pop("structured_outputs", {})},
        **extra})


def params(**so) -> SamplingParams:
    return SamplingParams(max_tokens=120, eos_token_id=0, structured_outputs=so or None)


def generate(llm, prompts, sampling):
    outs = llm.generate(prompts, sampling, use_tqdm=False)
    return outs, [llm.tokenizer.decode(o.output_token_ids, skip_special_tokens=True) for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_every_kind_of_constraint_holds(tokenizer_dir, tok, async_scheduling):
    pytest.importorskip("xgrammar")
    cfg = config(tokenizer_dir, "xgrammar", scheduler={"async_scheduling": async_scheduling},
                 cache={"num_blocks": 40, "block_size": 4})
    prompts = [[5 + i, 6, 7] for i in range(12)]
    sampling = []
    for i in range(12):
        kind = i % 6
        if kind == 0:
            sampling.append(params(json=SCHEMA, disable_any_whitespace=True))
        elif kind == 1:
            sampling.append(params(regex=r"[a-c]{2,5}-[0-9]{1,3}"))
        elif kind == 2:
            sampling.append(params(choice=["yes", "no", "maybe"]))
        elif kind == 3:
            sampling.append(params(json_object=True, disable_any_whitespace=True))
        elif kind == 4:
            sampling.append(params(grammar='root ::= "(" [a-b]+ ")"'))
        else:
            sampling.append(SamplingParams(max_tokens=30, eos_token_id=0))
    with LLM(cfg, tokenizer=tok) as llm:
        outs, got = generate(llm, prompts, sampling)
    for i, (o, text) in enumerate(zip(outs, got, strict=True)):
        kind = i % 6
        if kind == 0:
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == 1:
            assert re.fullmatch(r"[a-c]{2,5}-[0-9]{1,3}", text), text
        elif kind == 2:
            assert text in ("yes", "no", "maybe")
        elif kind == 3:  # any object: the fake runner's walk may not close its strings in time
            assert text.startswith("{") and (o.finish_reason == "length" or isinstance(json.loads(text), dict))
        elif kind == 4:
            assert re.fullmatch(r"\([ab]+\)", text), text
        if kind not in (3, 5):
            assert o.finish_reason == "stop", (i, o.finish_reason, text)


def test_unconstrained_outputs_do_not_depend_on_neighbours_grammars(tokenizer_dir, tok):
    pytest.importorskip("xgrammar")
    cfg = config(tokenizer_dir, "xgrammar")
    plain = [SamplingParams(max_tokens=25, eos_token_id=0, seed=100 + i) for i in range(4)]
    constrained = [params(json=SCHEMA, disable_any_whitespace=True) for _ in range(4)]
    prompts = [[9, 8, 7 + i] for i in range(8)]
    with LLM(cfg, tokenizer=tok) as llm:
        mixed = llm.generate(prompts, plain + constrained, use_tqdm=False)
        only_plain = llm.generate(prompts, plain + [SamplingParams(max_tokens=25, seed=i) for i in range(4)],
                                  use_tqdm=False)
    assert [o.output_token_ids for o in mixed[:4]] == [o.output_token_ids for o in only_plain[:4]]
    for o in mixed[4:]:
        jsonschema.validate(json.loads(llm.tokenizer.decode(o.output_token_ids, skip_special_tokens=True)),
                            SCHEMA)


def test_the_python_backend_serves_regex_and_choice_and_refuses_json(tokenizer_dir, tok):
    pytest.importorskip("regex")
    with LLM(config(tokenizer_dir, "python"), tokenizer=tok) as llm:
        outs, got = generate(llm, [[5, 6], [7, 8]], [params(regex=r"(ab|c)+!"), params(choice=["yes", "no"])])
        assert re.fullmatch(r"(ab|c)+!", got[0]) and got[1] in ("yes", "no")
        assert all(o.finish_reason == "stop" for o in outs)
        (refused,) = llm.generate([[1, 2]], params(json=SCHEMA), use_tqdm=False)
        assert refused.finish_reason == "error" and "python backend supports regex and choice" in refused.error


@pytest.mark.parametrize("bad,needle", [
    ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "json"),
    ({"regex": "(ab"}, "regex"),
    ({"grammar": "root ::= ("}, "grammar"),
])
def test_a_constraint_that_does_not_compile_is_refused_and_the_engine_goes_on(tokenizer_dir, tok, bad, needle):
    pytest.importorskip("xgrammar")
    with LLM(config(tokenizer_dir, "xgrammar"), tokenizer=tok) as llm:
        refused, out = llm.generate([[1, 2], [3, 4]], [params(**bad), params(choice=["yes"])], use_tqdm=False)
        assert refused.finish_reason == "error" and re.search(f"the {needle}.*does not compile", refused.error)
        assert llm.tokenizer.decode(out.output_token_ids, skip_special_tokens=True) == "yes"


def test_structured_requests_without_a_tokenizer_are_refused_with_the_reason():
    with LLM(config_from_dict({})) as llm:
        refused, out = llm.generate([[1, 2], [3, 4]], [params(choice=["yes"]), SamplingParams(max_tokens=3)],
                                    use_tqdm=False)
        assert refused.finish_reason == "error" and "need the model's tokenizer" in refused.error
        assert len(out.output_token_ids) == 3


def test_jump_forward_takes_fewer_steps_than_tokens_and_gives_valid_json(tokenizer_dir, tok):
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {
        "first_name": {"enum": ["Ada"]}, "last_name": {"enum": ["Lovelace"]},
        "year_of_birth": {"type": "integer", "minimum": 1800, "maximum": 1899}},
        "required": ["first_name", "last_name", "year_of_birth"], "additionalProperties": False}
    results = {}
    for jump in (False, True):
        with LLM(config(tokenizer_dir, "xgrammar", structured_outputs={"jump_forward": jump}), tokenizer=tok) as llm:
            (out,) = llm.generate([[3, 4, 5]], params(json=schema, disable_any_whitespace=True),
                                  use_tqdm=False)
            stats = llm.call_utility("stats")
        text = llm.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), schema)
        results[jump] = (len(out.output_token_ids), stats["num_busy_steps"], text,
                         stats["jump_forward_tokens"])
    assert results[False][1] == results[False][0] and results[False][3] == 0  # a step per token
    assert results[True][1] < results[True][0] and results[True][3] > 0  # fewer steps than tokens


def test_an_empty_regex_allows_only_the_empty_output(tokenizer_dir, tok):
    pytest.importorskip("xgrammar")
    with LLM(config(tokenizer_dir, "xgrammar"), tokenizer=tok) as llm:
        (out,) = llm.generate([[1, 2]], params(regex=""), use_tqdm=False)
    assert out.output_token_ids == [0] and out.finish_reason == "stop"  # the stop token alone
