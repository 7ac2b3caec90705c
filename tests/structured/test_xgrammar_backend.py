"""The xgrammar backend over a small byte-level BPE tokenizer trained in the test."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from schedkit.core.grammar import StructuredOutputsParams
from schedkit.core.structured_output import GrammarBitmask, StructuredOutputManager
from schedkit.plugins.testing import make_request

pytest.importorskip("xgrammar")
torch = pytest.importorskip("torch")

from schedkit.structured.xgrammar_backend import (  # noqa: E402
    XGrammarBackend,
    XGrammarGrammar,
    choice_ebnf,
)

VOCAB_SIZE = 336  # wider than the tokenizer's 320: the model's padded logits

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                 "maxItems": 2},
    },
    "required": ["name", "age", "ok", "kind", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def backend(bpe_tokenizer) -> XGrammarBackend:
    b = XGrammarBackend(bpe_tokenizer, VOCAB_SIZE, max_threads=2)
    yield b
    b.shutdown()


def grammar(backend: XGrammarBackend, max_rollback: int = 4, **params) -> XGrammarGrammar:
    return backend.new_grammar(backend.compile(StructuredOutputsParams(**params)), max_rollback)


def allowed(backend: XGrammarBackend, g: XGrammarGrammar) -> list[int]:
    bm = GrammarBitmask.allocate(1, backend.vocab_size)
    g.fill_bitmask(backend.bitmask_view(bm), 0)
    return bm.allowed(0)


def walk(backend: XGrammarBackend, g: XGrammarGrammar, limit: int = 300, prefer: tuple = ()) -> str:
    """Greedy decoding that takes the first allowed token of ``prefer``, else the lowest
    allowed token, until the stop token."""
    out: list[int] = []
    for _ in range(limit):
        ids = allowed(backend, g)
        assert ids, f"dead end after {backend.tokenizer.decode(out)!r}"
        token = next((t for t in prefer if t in ids), ids[0])
        assert g.accept_tokens("r", [token])
        if g.is_terminated():
            assert token in backend.stop_token_ids
            return backend.tokenizer.decode(out)
        out.append(token)
    raise AssertionError(f"no stop token after {limit} tokens: {backend.tokenizer.decode(out)!r}")


def decoded(backend: XGrammarBackend, ids: list[int]) -> list[str]:
    return [backend.tokenizer.decode([t]) for t in ids]


@pytest.mark.parametrize("compact", [True, False])
def test_json_schema_walk_gives_valid_json(backend, compact):
    jsonschema = pytest.importorskip("jsonschema")
    g = grammar(backend, json=SCHEMA, disable_any_whitespace=compact)
    text = walk(backend, g)
    jsonschema.validate(json.loads(text), SCHEMA)
    if compact:  # no free whitespace: xgrammar's fixed separators ", " and ": "
        assert text == json.dumps(json.loads(text)), text
    else:  # the walk takes the lowest token, never whitespace
        assert text == json.dumps(json.loads(text), separators=(",", ":")), text


def test_json_object_accepts_any_object_and_refuses_other_text(backend, bpe_tokenizer):
    g = grammar(backend, json_object=True)
    first = set(decoded(backend, allowed(backend, g)))
    assert "{" in first and "[" not in first and "1" not in first and '"' not in first
    assert "<eos>" not in first
    ids = bpe_tokenizer.encode('{"a": [1, 2], "b": {"c": null}}', add_special_tokens=False)
    assert g.accept_tokens("r", ids)
    assert g.accept_tokens("r", [bpe_tokenizer.eos_token_id]) and g.is_terminated()
    close = bpe_tokenizer.convert_tokens_to_ids("}")
    text = walk(backend, grammar(backend, json_object=True), prefer=(close,))
    assert json.loads(text) == {}


def test_regex_mask_allows_what_it_should(backend, bpe_tokenizer):
    g = grammar(backend, regex=r"[0-9]{2,3}")
    texts = decoded(backend, allowed(backend, g))
    assert set("0123456789") <= set(texts)
    assert all(re.fullmatch(r"[0-9]{1,3}", t) for t in texts), texts
    assert g.accept_tokens("r", bpe_tokenizer.encode("12", add_special_tokens=False))
    assert bpe_tokenizer.eos_token_id in allowed(backend, g)
    assert not g.accept_tokens("r", bpe_tokenizer.encode("a", add_special_tokens=False))
    assert g.accept_tokens("r", bpe_tokenizer.encode("3", add_special_tokens=False))
    assert allowed(backend, g) == [bpe_tokenizer.eos_token_id]  # three digits: only the end
    assert re.fullmatch(r"[0-9]{2,3}", walk(backend, grammar(backend, regex=r"[0-9]{2,3}")))


def test_special_and_padding_ids_are_never_allowed(backend, bpe_tokenizer):
    g = grammar(backend, regex=r"(.|\n)*")
    ids = allowed(backend, g)
    pad = bpe_tokenizer.pad_token_id
    assert pad not in ids and bpe_tokenizer.eos_token_id in ids  # "" is a complete match
    assert max(ids) < len(bpe_tokenizer)  # neither the logits' padding nor the row's
    assert not g.accept_tokens("r", [pad])
    assert not g.accept_tokens("r", [VOCAB_SIZE - 1]) and not g.accept_tokens("r", [VOCAB_SIZE + 5])


def test_choice_with_characters_that_need_escaping(backend, bpe_tokenizer):
    choices = ['say "hi"', "back\\slash", "two\nlines", "caf\u00e9 \U0001f600"]
    ebnf = choice_ebnf(choices)
    assert ebnf.startswith('root ::= "say \\"hi\\"" | ')
    for choice in choices:
        g = grammar(backend, choice=choices)
        assert g.accept_tokens("r", bpe_tokenizer.encode(choice, add_special_tokens=False)), choice
        assert g.accept_tokens("r", [bpe_tokenizer.eos_token_id]) and g.is_terminated()
    assert walk(backend, grammar(backend, choice=choices)) in choices
    g = grammar(backend, choice=["yes", "no"])
    assert not g.accept_tokens("r", bpe_tokenizer.encode("maybe", add_special_tokens=False))


def test_ebnf_grammar(backend):
    ebnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c]+ | "0"'
    text = walk(backend, grammar(backend, grammar=ebnf))
    assert re.fullmatch(r"\(([a-c]+|0)(,([a-c]+|0))*\)", text), text


def test_accept_stops_at_the_first_rejected_token_and_rollback(backend, bpe_tokenizer):
    g = grammar(backend, regex=r"ab+c")
    a, b, c, x = (bpe_tokenizer.convert_tokens_to_ids(t) for t in "abcx")
    assert not g.accept_tokens("r", [a, b, x, c])
    assert g.num_accepted == 2
    assert g.accept_tokens("r", [c])  # the state was "ab"
    g.rollback(1)
    assert g.accept_tokens("r", [b, c, bpe_tokenizer.eos_token_id]) and g.is_terminated()
    g.rollback(2)
    assert not g.is_terminated() and g.validate_tokens([c, bpe_tokenizer.eos_token_id, a]) == [
        c, bpe_tokenizer.eos_token_id]
    assert g.validate_tokens([x]) == [] and g.accept_tokens("r", [b])  # unchanged by validate


def test_jump_forward_tokens_follow_the_forced_text(backend):
    g = grammar(backend, json=SCHEMA, disable_any_whitespace=True)
    forced = g.jump_forward_tokens()
    first = next(iter(json.loads(StructuredOutputsParams(json=SCHEMA).spec)["properties"]))
    assert backend.tokenizer.decode(forced) in (f'{{"{first}": ', f'{{"{first}": "')  # a string's quote is forced too
    assert g.num_accepted == 0 and g.validate_tokens(forced) == forced  # state unchanged
    g = grammar(backend, choice=["yes"])
    assert backend.tokenizer.decode(g.jump_forward_tokens()) == "yes"
    assert grammar(backend, regex=r"[ab]").jump_forward_tokens() == []


def test_validate_raises_value_error_with_xgrammar_message(backend):
    cases = [
        (StructuredOutputsParams(json={"type": "nonsense"}), 'Unsupported type "nonsense"'),
        (StructuredOutputsParams(json={"$ref": "#/nowhere"}), "nowhere"),
        (StructuredOutputsParams(regex="(ab"), "parenthesis is not closed"),
        (StructuredOutputsParams(regex=r"(a)\1"), "Backreference"),
        (StructuredOutputsParams(grammar="root ::= foo"), 'Rule "foo" is not defined'),
        (StructuredOutputsParams(grammar='root ::= "a'), "string literal"),
    ]
    for params, needle in cases:
        with pytest.raises(ValueError) as exc:
            backend.validate(params)
        assert needle in str(exc.value), (params, str(exc.value))
        assert not str(exc.value).startswith("["), str(exc.value)  # the C++ log prefix is cut
    backend.validate(StructuredOutputsParams(json=SCHEMA))
    backend.validate(StructuredOutputsParams(json_object=True))
    backend.validate(StructuredOutputsParams(choice=['"', "\\"]))


def test_bitmask_view_shares_memory_with_the_words(backend):
    bm = GrammarBitmask.allocate(3, backend.vocab_size)
    view = backend.bitmask_view(bm)
    assert view.dtype == torch.int32 and tuple(view.shape) == (3, bm.num_words)
    view[1, 2] = 5
    assert bm.words[bm.num_words + 2] == 5
    bm.words[0] = 7
    assert int(view[0, 0]) == 7
    grammar(backend, regex=r"[0-9]").fill_bitmask(view, 2)
    assert set(decoded(backend, bm.allowed(2))) == set("0123456789")
    assert bm.allowed(0)[:3] == [0, 1, 2]  # row 0 kept its own words
    empty = backend.bitmask_view(GrammarBitmask.allocate(0, backend.vocab_size))
    assert tuple(empty.shape) == (0, bm.num_words)


def test_compile_from_four_threads_at_once(bpe_tokenizer):
    backend = XGrammarBackend(bpe_tokenizer, VOCAB_SIZE, max_threads=2)
    params = [StructuredOutputsParams(regex=f"[0-9]{{{n}}}x") for n in range(1, 9)]
    params += [StructuredOutputsParams(json={
        "type": "object", "properties": {f"k{n}": {"type": "integer", "minimum": n, "maximum": 9}},
        "required": [f"k{n}"]}) for n in range(1, 9)]
    with ThreadPoolExecutor(4) as pool:
        compiled = list(pool.map(backend.compile, params))
    for n, c in enumerate(compiled[:8], start=1):
        g = backend.new_grammar(c, 0)
        assert g.accept_tokens("r", bpe_tokenizer.encode("7" * n + "x", add_special_tokens=False))
        assert g.accept_tokens("r", [bpe_tokenizer.eos_token_id])
    for n, c in enumerate(compiled[8:], start=1):
        assert json.loads(walk(backend, backend.new_grammar(c, 0))) == {f"k{n}": n}
    backend.shutdown()


def test_through_the_manager_with_drafts(backend, bpe_tokenizer):
    manager = StructuredOutputManager(lambda: backend, max_rollback_tokens=2)
    req = make_request("r", [1], structured_outputs={"regex": "ab+"})
    manager.add_request(req)
    req.structured_output.compiled.result(timeout=30)
    assert manager.check_ready(req)
    a, b = (bpe_tokenizer.convert_tokens_to_ids(t) for t in "ab")
    bm, _ = manager.grammar_bitmask({"r": req}, {"r": 0}, {"r": [a]}, 2)
    assert a in bm.allowed(0) and b not in bm.allowed(0)
    assert b in bm.allowed(1) and bpe_tokenizer.eos_token_id not in bm.allowed(1)
    assert manager.validate_drafts(req, [a, b, b, a]) == [a, b, b]
    bad = make_request("s", [1], structured_outputs={"grammar": "root ::= nope"})
    manager.add_request(bad)  # checked in a compile worker process
    with pytest.raises(ValueError, match="nope"):
        bad.structured_output.compiled.result(timeout=30)
    assert not manager.check_ready(bad) and re.search(r"\(xgrammar\).*nope", bad.structured_output.error)
    manager.shutdown()


@pytest.mark.parametrize("schema,needle", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "schema.uniqueItems"),
    ({"type": "array", "contains": {"const": 1}}, "schema.contains"),
    ({"type": "object", "properties": {"x": {"not": {"type": "string"}}}}, "schema.properties.x.not"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf combines branches of different types"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]},
     "schema.required names 'b'"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "schema.dependentRequired"),
    ({"$ref": "file:///etc/passwd"}, "schema.$ref is 'file:///etc/passwd'"),
    ({"type": "object", "properties": {"a": {"$ref": "http://example.com/s.json"}}},
     "schema.properties.a.$ref is 'http://example.com/s.json'"),
    ({"type": "array", "items": {"$ref": 7}}, "schema.items.$ref is 7"),
])
def test_schemas_xgrammar_would_not_enforce_are_refused(backend, schema, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        backend.validate(StructuredOutputsParams(json=schema))


def test_references_inside_the_schema_are_fine(backend):
    schema = {"$defs": {"n": {"type": "integer"}}, "type": "object",
              "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"]}
    backend.validate(StructuredOutputsParams(json=schema))


def test_property_names_that_look_like_keywords_are_fine(backend):
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "contains": {"type": "integer"}},
              "required": ["not", "contains"], "allOf": [{"type": "object"}, {"type": "object"}]}
    backend.validate(StructuredOutputsParams(json=schema))
