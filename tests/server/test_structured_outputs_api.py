"""Structured outputs over the OpenAI API: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` become ``SamplingParams.structured_outputs``; every malformed
constraint is a 400 naming its field. Then through a live ``schedkit serve`` (the fake
runner over a small byte-level tokenizer, xgrammar): constrained outputs parse and
match, streamed or not; a constraint the engine refuses when it receives the request
(it does not compile) is a 400 naming the field, before anything is streamed, and the
server goes on serving.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

pytest.importorskip("prometheus_client")

from schedkit.config import config_from_dict  # noqa: E402
from schedkit.core.grammar import StructuredOutputsParams  # noqa: E402
from schedkit.server.metrics import ServerMetrics  # noqa: E402
from schedkit.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body  # noqa: E402
from schedkit.server.serving import Choice, Server  # noqa: E402

PROMPT = [5, 6, 7]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
CANONICAL = json.dumps(SCHEMA, separators=(",", ":"))  # compact, key order kept


def server(llm: Any = None) -> Server:
    cfg = config_from_dict({"runner": {"kind": "fake", "vocab_size": 64, "eos_token_id": 2},
                            "scheduler": {"max_model_len": 32}})
    return Server(cfg, llm, None, ServerMetrics("m", "fcfs", []), "m")


def parse(kind: str, body: dict[str, Any]) -> CompletionRequest | ChatCompletionRequest:
    if kind == "chat":
        return parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], **body})
    return parse_body(CompletionRequest, {"prompt": PROMPT, **body})


def choices(s: Server, kind: str, **body: Any) -> list[Choice]:
    req = parse(kind, body)
    return s.make_choices(req, "r", [list(PROMPT)], req.max_tokens, "max_tokens")


def constraint(kind: str, **body: Any) -> StructuredOutputsParams | None:
    (c,) = choices(server(), kind, **body)
    return c.params.structured_outputs


@pytest.fixture(params=["completion", "chat"])
def kind(request) -> str:
    return request.param


def _json_schema(**extra: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, **extra}}


# -- 1. the body's constraint becomes SamplingParams.structured_outputs ------------------------
MAPPING: list[tuple[str, dict[str, Any], StructuredOutputsParams]] = [
    ("response_format-json_object", {"response_format": {"type": "json_object"}},
     StructuredOutputsParams(json_object=True)),
    ("response_format-json_schema", {"response_format": _json_schema()}, StructuredOutputsParams(json=SCHEMA)),
    ("response_format-json_schema-strict-description",
     {"response_format": _json_schema(strict=True, description="a person")}, StructuredOutputsParams(json=SCHEMA)),
    ("response_format-json_schema-not-strict", {"response_format": _json_schema(strict=False)},
     StructuredOutputsParams(json=SCHEMA)),
    ("structured_outputs-json-object", {"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
    ("structured_outputs-json-text", {"structured_outputs": {"json": json.dumps(SCHEMA)}},
     StructuredOutputsParams(json=SCHEMA)),
    ("structured_outputs-json_object", {"structured_outputs": {"json_object": True}},
     StructuredOutputsParams(json_object=True)),
    ("structured_outputs-regex", {"structured_outputs": {"regex": "[0-9]{3}"}},
     StructuredOutputsParams(regex="[0-9]{3}")),
    ("structured_outputs-choice", {"structured_outputs": {"choice": ["yes", "no"]}},
     StructuredOutputsParams(choice=("yes", "no"))),
    ("structured_outputs-grammar", {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
     StructuredOutputsParams(grammar='root ::= "a" | "b"')),
    ("structured_outputs-disable_any_whitespace",
     {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
    ("structured_outputs-nulls-are-unset",
     {"structured_outputs": {"json": None, "json_object": None, "regex": "a+", "choice": None, "grammar": None,
                             "disable_any_whitespace": None}}, StructuredOutputsParams(regex="a+")),
    ("text-with-structured_outputs", {"response_format": {"type": "text"}, "structured_outputs": {"regex": "a+"}},
     StructuredOutputsParams(regex="a+")),
]


@pytest.mark.parametrize(("body", "expected"), [m[1:] for m in MAPPING], ids=[m[0] for m in MAPPING])
def test_the_constraint_reaches_the_sampling_params(kind, body, expected):
    got = constraint(kind, **body)
    assert got == expected
    if expected.json is not None:
        assert got is not None and got.json == CANONICAL  # the schema travels as canonical JSON text


@pytest.mark.parametrize("body", [{}, {"response_format": None}, {"structured_outputs": None},
                                  {"response_format": {"type": "text"}},
                                  {"response_format": {"type": "text", "json_schema": None}}],
                         ids=["unset", "response_format-null", "structured_outputs-null", "text", "text-null-schema"])
def test_no_constraint(kind, body):
    s = server()
    (c,) = choices(s, kind, **body)
    (plain,) = choices(s, kind)
    assert c.params.structured_outputs is None
    assert c.params == plain.params  # response_format text asks nothing at all


def test_every_choice_and_prompt_gets_the_constraint():
    s = server()
    req = parse_body(CompletionRequest, {"prompt": [[5, 6], [7, 8]], "n": 2, "seed": 1,
                                         "structured_outputs": {"choice": ["yes", "no"]}})
    cs = s.make_choices(req, "r", [list(p) for p in req.prompts()], req.max_tokens, "max_tokens")
    assert len(cs) == 4
    assert {c.params.structured_outputs for c in cs} == {StructuredOutputsParams(choice=("yes", "no"))}
    assert [c.params.seed for c in cs] == [1, 2, 1, 2]  # the rest of the sampling is untouched


def test_the_constraint_keeps_the_other_sampling_fields(kind):
    (c,) = choices(server(), kind, temperature=0.0, max_tokens=5, stop_token_ids=[9],
                   response_format={"type": "json_object"})
    p = c.params
    assert (p.temperature, p.max_tokens, p.stop_token_ids) == (0.0, 5, (9,))
    assert p.structured_outputs == StructuredOutputsParams(json_object=True)


# -- 2. every malformed constraint is a 400 naming its field --------------------------------------
BOTH = "structured_outputs both constrain the output; send one of them"
BAD: list[tuple[str, dict[str, Any], str, tuple[str, ...]]] = [
    # (id, body fields, param, the message: exactly it when one string, else parts of it)
    ("response_format-unknown-type", {"response_format": {"type": "xml"}}, "response_format.type",
     ("response_format.type: Input should be 'text', 'json_object' or 'json_schema' (got 'xml')",)),
    ("response_format-structural_tag", {"response_format": {"type": "structural_tag", "format": {}}},
     "response_format.type", ("response_format.type", "'text', 'json_object' or 'json_schema'", "structural_tag")),
    ("response_format-no-type", {"response_format": {}}, "response_format.type",
     ("response_format.type is required",)),
    ("response_format-type-int", {"response_format": {"type": 1}}, "response_format.type",
     ("response_format.type", "'text', 'json_object' or 'json_schema'")),
    ("response_format-str", {"response_format": "json_object"}, "response_format",
     ("response_format:", "'json_object'")),
    ("response_format-unknown-key", {"response_format": {"type": "json_object", "schema": SCHEMA}},
     "response_format.schema", ("unknown field 'response_format.schema'",)),
    ("json_schema-missing", {"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     ("response_format.json_schema is required when response_format.type is 'json_schema'",)),
    ("json_schema-null", {"response_format": {"type": "json_schema", "json_schema": None}},
     "response_format.json_schema",
     ("response_format.json_schema is required when response_format.type is 'json_schema'",)),
    ("json_schema-schema-missing", {"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
     "response_format.json_schema.schema", ("response_format.json_schema.schema is required",)),
    ("json_schema-schema-null",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": None}}},
     "response_format.json_schema.schema", ("response_format.json_schema.schema:", "None")),
    ("json_schema-schema-list",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": [SCHEMA]}}},
     "response_format.json_schema.schema", ("response_format.json_schema.schema:", "dictionary")),
    ("json_schema-schema-text",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": json.dumps(SCHEMA)}}},
     "response_format.json_schema.schema", ("response_format.json_schema.schema:", "dictionary")),
    ("json_schema-schema-nan",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"maximum": float("nan")}}}},
     "response_format.json_schema.schema",
     ("invalid response_format.json_schema.schema={'maximum': nan}: not serializable as JSON (", "float")),
    ("json_schema-name-missing", {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name", ("response_format.json_schema.name is required",)),
    ("json_schema-name-int",
     {"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": SCHEMA}}},
     "response_format.json_schema.name", ("response_format.json_schema.name:", "string")),
    ("json_schema-strict-str", {"response_format": _json_schema(strict="yes")},
     "response_format.json_schema.strict", ("response_format.json_schema.strict:", "boolean")),
    ("json_schema-unknown-key", {"response_format": _json_schema(schema_name="x")},
     "response_format.json_schema.schema_name", ("unknown field 'response_format.json_schema.schema_name'",)),
    ("json_schema-with-json_object",
     {"response_format": {"type": "json_object", "json_schema": {"name": "p", "schema": SCHEMA}}},
     "response_format.json_schema",
     ("response_format.json_schema is only read with response_format.type 'json_schema', not 'json_object'",)),
    ("json_schema-with-text", {"response_format": {"type": "text", "json_schema": {"name": "p", "schema": SCHEMA}}},
     "response_format.json_schema",
     ("response_format.json_schema is only read with response_format.type 'json_schema', not 'text'",)),
    ("structured_outputs-str", {"structured_outputs": "a+"}, "structured_outputs", ("structured_outputs:", "'a+'")),
    ("structured_outputs-empty", {"structured_outputs": {}}, "structured_outputs",
     ("structured_outputs must set exactly one of json, json_object, regex, choice, grammar; got none",)),
    ("structured_outputs-json_object-false", {"structured_outputs": {"json_object": False}}, "structured_outputs",
     ("structured_outputs must set exactly one of json, json_object, regex, choice, grammar; got none",)),
    ("structured_outputs-only-options", {"structured_outputs": {"disable_any_whitespace": True}},
     "structured_outputs",
     ("structured_outputs must set exactly one of json, json_object, regex, choice, grammar; got none",)),
    ("structured_outputs-two", {"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs",
     ("structured_outputs must set exactly one of json, json_object, regex, choice, grammar; got regex, choice",)),
    ("structured_outputs-unknown-key", {"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", ("unknown field 'structured_outputs.whitespace_pattern'",)),
    ("structured_outputs-structural_tag", {"structured_outputs": {"structural_tag": "{}"}},
     "structured_outputs.structural_tag", ("unknown field 'structured_outputs.structural_tag'",)),
    ("json-int", {"structured_outputs": {"json": 5}}, "structured_outputs.json", ("structured_outputs.json:", "5")),
    ("json-list", {"structured_outputs": {"json": [SCHEMA]}}, "structured_outputs.json",
     ("structured_outputs.json:", "(got [{")),
    ("json-bad-text", {"structured_outputs": {"json": "{bad"}}, "structured_outputs.json",
     ("invalid structured_outputs.json='{bad': not JSON text (", "line 1")),
    ("json-text-not-a-schema", {"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs.json",
     ("invalid structured_outputs.json='[1, 2]': must be a JSON schema: an object (dict) or a boolean",)),
    ("json-nan", {"structured_outputs": {"json": {"maximum": float("inf")}}}, "structured_outputs.json",
     ("invalid structured_outputs.json={'maximum': inf}: not serializable as JSON (", "float")),
    ("json-nested-too-deeply", {"structured_outputs": {"json": '{"a":' * 100_000 + "1" + "}" * 100_000}},
     "structured_outputs.json", ("structured_outputs.json is nested too deeply",)),
    ("json_object-int", {"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object",
     ("structured_outputs.json_object:", "boolean")),
    ("grammar-empty", {"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar",
     ("invalid structured_outputs.grammar='': must be a non-empty string",)),
    ("regex-int", {"structured_outputs": {"regex": 5}}, "structured_outputs.regex",
     ("structured_outputs.regex:", "string")),
    ("choice-empty", {"structured_outputs": {"choice": []}}, "structured_outputs.choice",
     ("invalid structured_outputs.choice=[]: must be a non-empty list of non-empty strings",)),
    ("choice-str", {"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice",
     ("structured_outputs.choice:", "list")),
    ("choice-int-item", {"structured_outputs": {"choice": ["yes", 1]}}, "structured_outputs.choice[1]",
     ("structured_outputs.choice[1]:", "string")),
    ("choice-empty-item", {"structured_outputs": {"choice": ["yes", ""]}}, "structured_outputs.choice",
     ("invalid structured_outputs.choice=['yes', '']: must be a non-empty list of non-empty strings",)),
    ("grammar-empty", {"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar",
     ("invalid structured_outputs.grammar='': must be a non-empty string",)),
    ("grammar-list", {"structured_outputs": {"grammar": ["root ::= x"]}}, "structured_outputs.grammar",
     ("structured_outputs.grammar:", "string")),
    ("disable_any_whitespace-str", {"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}},
     "structured_outputs.disable_any_whitespace", ("structured_outputs.disable_any_whitespace:", "boolean")),
    ("both-json_object", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
     "response_format", (f"response_format (type 'json_object') and {BOTH}",)),
    ("both-json_schema", {"response_format": _json_schema(), "structured_outputs": {"json": SCHEMA}},
     "response_format", (f"response_format (type 'json_schema') and {BOTH}",)),
    ("both-options-only", {"response_format": _json_schema(), "structured_outputs": {"disable_any_whitespace": True}},
     "response_format", (f"response_format (type 'json_schema') and {BOTH}",)),
]


@pytest.mark.parametrize(("body", "param", "says"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_malformed_constraint_is_a_400_naming_its_field(kind, body, param, says):
    with pytest.raises(APIError) as e:
        parse(kind, body)  # refused while the body is parsed, before any tokenizing
    err = e.value
    assert err.status == 400 and err.param == param, (err.param, err.message)
    if len(says) == 1:
        assert err.message == says[0]
    else:
        assert all(s in err.message for s in says), err.message
    assert param.split(".")[0] in err.message
    assert err.body() == {"error": {"message": err.message, "type": "BadRequestError", "param": param,
                                    "code": 400}}


def test_unsupported_fields_still_refused_next_to_a_constraint(kind):
    with pytest.raises(APIError, match="not supported") as e:
        parse(kind, {"response_format": {"type": "json_object"}, "logit_bias": {"7": 1}})
    assert e.value.param == "logit_bias"


# -- 3. through a live server ---------------------------------------------------------------------
BOUNDED = {"type": "object", "properties": {"name": {"enum": ["Ada", "Bob"]},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 99}},
           "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def structured_server(tmp_path_factory):
    pytest.importorskip("xgrammar")
    pytest.importorskip("transformers")
    from schedkit.structured.testing import byte_level_tokenizer
    from tests.server.conftest import CHAT_TEMPLATE, server_config, start_server, stop_server

    path = tmp_path_factory.mktemp("bpe")
    byte_level_tokenizer(chat_template=CHAT_TEMPLATE).save_pretrained(path)
    cfg = server_config(path, runner={"vocab_size": 320, "eos_token_id": 0},
                        structured_outputs={"backend": "xgrammar", "json_max_whitespace": 2})
    s = start_server(tmp_path_factory.mktemp("serve"), cfg)
    yield s
    stop_server(s)


def _text_of(s, path: str, body: dict[str, Any]) -> tuple[str, str]:
    with s.client() as c:
        r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, choice["finish_reason"]


@pytest.mark.slow
def test_constrained_requests_over_http_parse_and_match(structured_server):
    jsonschema = pytest.importorskip("jsonschema")
    chat = {"messages": [{"role": "user", "content": "a person"}], "max_tokens": 200}
    text, reason = _text_of(structured_server, "/v1/chat/completions", {
        **chat, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": BOUNDED}}})
    jsonschema.validate(json.loads(text), BOUNDED)
    assert reason == "stop"
    text, reason = _text_of(structured_server, "/v1/completions", {
        "prompt": "abc", "max_tokens": 50, "structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}})
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", text) and reason == "stop"
    text, reason = _text_of(structured_server, "/v1/chat/completions", {
        **chat, "structured_outputs": {"choice": ["yes", "no"]}})
    assert text in ("yes", "no") and reason == "stop"


@pytest.mark.slow
def test_a_streamed_constrained_request_matches(structured_server):
    body = {"prompt": "abc", "max_tokens": 50, "stream": True, "structured_outputs": {"regex": "(ab|c){2,4}!"}}
    with structured_server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line[6:])["choices"][0] for line in lines]
    assert re.fullmatch("(ab|c){2,4}!", "".join(ch["text"] for ch in chunks))
    assert chunks[-1]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "regex '(ab' does not compile (xgrammar)"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nonsense"}}}},
     "response_format", "does not compile (xgrammar)"),
    ({"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs", 'Rule "foo" is not defined'),
    ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs", "no output satisfies it"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}},
     "response_format", "schema.uniqueItems is not enforced by the xgrammar backend"),
    ({"structured_outputs": {"json": {"$ref": "file:///etc/passwd"}}}, "structured_outputs",
     "schema.$ref is 'file:///etc/passwd'"),
], ids=["regex", "json_schema", "grammar", "matches-nothing", "unenforced-keyword", "outside-ref"])
@pytest.mark.slow
def test_a_constraint_that_does_not_compile_is_a_400_and_the_server_goes_on(structured_server, stream,
                                                                           body, param, needle):
    with structured_server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 8, "stream": stream, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and needle in err["message"] and "failed:" not in err["message"]
        assert "cmpl-" not in err["message"]  # the engine's request id is no business of the client
    text, reason = _text_of(structured_server, "/v1/completions",
                            {"prompt": "abc", "max_tokens": 8, "structured_outputs": {"choice": ["ok"]}})
    assert (text, reason) == ("ok", "stop")


@pytest.fixture(scope="module")
def tight_budget_server(tmp_path_factory):
    """A server whose per-step grammar budget no matcher meets (1 us)."""
    pytest.importorskip("xgrammar")
    pytest.importorskip("transformers")
    from schedkit.structured.testing import byte_level_tokenizer
    from tests.server.conftest import server_config, start_server, stop_server

    path = tmp_path_factory.mktemp("bpe-budget")
    byte_level_tokenizer().save_pretrained(path)
    cfg = server_config(path, runner={"vocab_size": 320, "eos_token_id": 0},
                        structured_outputs={"backend": "xgrammar", "step_budget_ms": 0.001})
    s = start_server(tmp_path_factory.mktemp("serve-budget"), cfg)
    yield s
    stop_server(s)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_grammar_over_its_step_budget_is_a_400_naming_the_limit(tight_budget_server, stream):
    """A matcher over ``structured_outputs.step_budget_ms`` is what the client's constraint
    costs, not a fault of the server: a 400 naming the field and the key, and the server
    goes on serving."""
    with tight_budget_server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 8, "stream": stream,
                                            "structured_outputs": {"regex": "(ab|c)+"}})
        if stream and r.status_code == 200:
            # The first step's matcher work can fall under even this budget (the overrun then
            # comes with a later step): the stream has begun, and an error event ends it.
            events = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            err = events[-1]["error"]
            assert err["code"] == 400, r.text
        else:
            assert r.status_code == 400, r.text
            err = r.json()["error"]
        assert err["param"] == "structured_outputs", err
        assert "(structured_outputs.step_budget_ms)" in err["message"] and "cmpl-" not in err["message"]
        r = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.slow
def test_a_full_compile_queue_is_a_429_with_retry_after_and_the_server_goes_on(tmp_path_factory):
    """The engine's compile queue (one worker, one compile waiting) refuses a third
    constraint while two are in hand: the engine is saturated, the client did nothing
    wrong, so the answer is retryable (429 + Retry-After), not a 400."""
    pytest.importorskip("xgrammar")
    pytest.importorskip("transformers")
    from concurrent.futures import ThreadPoolExecutor

    from schedkit.structured.testing import byte_level_tokenizer
    from tests.server.conftest import server_config, start_server, stop_server

    path = tmp_path_factory.mktemp("bpe-busy")
    byte_level_tokenizer().save_pretrained(path)
    cfg = server_config(path, runner={"vocab_size": 320, "eos_token_id": 0},
                        structured_outputs={"backend": "xgrammar", "num_workers": 1,
                                            "max_queued_compiles": 1, "max_queued_compiles_per_client": 1})
    s = start_server(tmp_path_factory.mktemp("serve-busy"), cfg)
    try:
        def send(letters: str):
            regex = f"[^{letters[0]}]{{0,20000}}[^{letters[1]}]{{0,20000}}"  # seconds to compile and ship
            with s.client() as c:
                return c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2,
                                                       "structured_outputs": {"regex": regex}})

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(send, ["pP", "qQ", "rR", "sS", "tT", "uU"]))
        busy = [r for r in answers if r.status_code == 429]
        assert busy, [r.status_code for r in answers]
        assert all(r.status_code in (200, 429) for r in answers), [r.text for r in answers]
        err = busy[0].json()["error"]
        assert "compile queue is full" in err["message"] and "max_queued_compiles" in err["message"]
        assert busy[0].headers["Retry-After"].isdigit()
        text, reason = _text_of(s, "/v1/completions",
                                {"prompt": "abc", "max_tokens": 8, "structured_outputs": {"choice": ["ok"]}})
        assert (text, reason) == ("ok", "stop")
    finally:
        stop_server(s)
