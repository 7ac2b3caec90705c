"""The pure-Python backend over a hand-made vocabulary (no torch, no tokenizer)."""

from __future__ import annotations

import random
import re
import string

import pytest

pytest.importorskip("regex")

from schedkit.core.grammar import StructuredOutputsParams
from schedkit.core.structured_output import GrammarBitmask, StructuredOutputManager
from schedkit.plugins.testing import make_request
from schedkit.structured.python_backend import PythonBackend, PythonGrammar

MULTI = ["12", "3.", "-1", "yes", "no", "ye", "maybe", "ab", "abc", "\"}", "{\""]
VOCAB: list[str | None] = [None, *string.printable[:95], *MULTI, None, "", "<eos>"]
EOS = len(VOCAB) - 1
SPECIAL = VOCAB.index(None, 1)
EMPTY = VOCAB.index("")


def tid(text: str) -> int:
    return VOCAB.index(text)


def texts(tokens) -> list[str]:
    return [str(VOCAB[t]) for t in tokens]


@pytest.fixture(scope="module")
def backend() -> PythonBackend:
    return PythonBackend(VOCAB, [EOS], vocab_size=len(VOCAB) + 40)


def grammar(backend: PythonBackend, max_rollback: int = 8, **params) -> PythonGrammar:
    return backend.new_grammar(backend.compile(StructuredOutputsParams(**params)), max_rollback)


def allowed(backend: PythonBackend, g: PythonGrammar) -> list[int]:
    bm = GrammarBitmask.allocate(2, backend.vocab_size)
    g.fill_bitmask(backend.bitmask_view(bm), 1)
    assert set(bm.words[:bm.num_words]) == {-1}  # other rows untouched
    return bm.allowed(1)


def test_regex_mask_allows_exactly_the_tokens_that_keep_a_partial_match(backend):
    g = grammar(backend, regex=r"-?\d+(\.\d+)?")
    assert sorted(texts(allowed(backend, g))) == sorted([*"0123456789", "-", "12", "3.", "-1"])
    assert g.accept_tokens("r", [tid("12"), tid("3.")]) and g.text == "123."
    assert sorted(texts(allowed(backend, g))) == sorted([*"0123456789", "12"])  # no EOS yet
    assert g.accept_tokens("r", [tid("5")])
    assert EOS in allowed(backend, g) and tid(".") not in allowed(backend, g)


def test_special_empty_and_padding_tokens_are_never_allowed(backend):
    g = grammar(backend, regex=r"(?s).*")
    ids = allowed(backend, g)
    assert 0 not in ids and SPECIAL not in ids and EMPTY not in ids
    assert max(ids) == EOS  # the ids past the vocabulary (bitmask padding) are off
    assert not g.accept_tokens("r", [SPECIAL]) and not g.accept_tokens("r", [len(VOCAB) + 3])
    assert not g.accept_tokens("r", [-1])


def test_choice_mask_accept_and_termination(backend):
    g = grammar(backend, choice=["yes", "no", "maybe", "a.b"])
    assert sorted(texts(allowed(backend, g))) == sorted(["y", "n", "m", "a", "yes", "no", "ye", "maybe"])
    assert not g.accept_tokens("r", [tid("ab")])  # "a" then "b": not "a.b"
    assert g.text == "" and not g.is_terminated()
    assert not g.accept_tokens("r", [EOS])  # "" is no choice
    assert g.accept_tokens("r", [tid("ye")])
    assert texts(allowed(backend, g)) == ["s"]
    assert g.accept_tokens("r", [tid("s")])
    assert allowed(backend, g) == [EOS]
    assert g.accept_tokens("r", [EOS]) and g.is_terminated()
    assert allowed(backend, g) == []
    assert not g.accept_tokens("r", [tid("s")]) and not g.accept_tokens("r", [EOS])


def test_choice_strings_are_literal_not_patterns(backend):
    g = grammar(backend, choice=["a.b", "(x)"])
    assert not g.accept_tokens("r", [tid("a"), tid("c")])  # "." is escaped
    g.rollback(1)
    assert g.accept_tokens("r", [tid("("), tid("x"), tid(")")])
    g = grammar(backend, choice=["a.b", "(x)"])
    assert g.accept_tokens("r", [tid("a"), tid("."), tid("b"), EOS]) and g.is_terminated()


def test_accept_stops_at_the_first_rejected_token(backend):
    g = grammar(backend, regex=r"[a-c]+")
    assert not g.accept_tokens("r", [tid("a"), tid("b"), tid("z"), tid("c")])
    assert g.text == "ab" and g.num_accepted == 2


def test_validate_tokens_leaves_the_state_alone(backend):
    g = grammar(backend, regex=r"\d{3}")
    g.accept_tokens("r", [tid("1")])
    assert g.validate_tokens([tid("2"), tid("3"), EOS, tid("4")]) == [tid("2"), tid("3"), EOS]
    assert g.validate_tokens([tid("2"), tid("x"), tid("3")]) == [tid("2")]
    assert g.validate_tokens([]) == []
    assert g.text == "1" and not g.is_terminated()


def test_rollback_restores_text_and_termination(backend):
    g = grammar(backend, regex=r"\d+")
    assert g.accept_tokens("r", [tid("12"), tid("3"), EOS]) and g.is_terminated()
    g.rollback(1)
    assert not g.is_terminated() and g.text == "123"
    g.rollback(2)
    assert g.text == "" and g.num_accepted == 0
    assert g.accept_tokens("r", [tid("4")]) and g.text == "4"
    g.rollback(0)
    with pytest.raises(ValueError, match="roll back 2"):
        g.rollback(2)


def test_validate_refuses_bad_patterns_and_other_kinds(backend):
    with pytest.raises(ValueError, match="invalid regular expression"):
        backend.validate(StructuredOutputsParams(regex="(ab"))
    for params in (StructuredOutputsParams(json={"type": "object"}),
                   StructuredOutputsParams(json_object=True),
                   StructuredOutputsParams(grammar='root ::= "a"')):
        with pytest.raises(ValueError, match="python backend supports regex and choice; use xgrammar"):
            backend.validate(params)
    backend.validate(StructuredOutputsParams(choice=["(", "[x"]))  # escaped: fine


def test_manager_refuses_an_unsupported_kind_naming_the_backend(backend):
    manager = StructuredOutputManager(lambda: backend)
    req = make_request("r", [1, 2], structured_outputs={"json_object": True})
    manager.add_request(req)  # checked on a compile worker
    with pytest.raises(ValueError):
        req.structured_output.compiled.result(timeout=5)
    assert not manager.check_ready(req)
    assert re.search(r"\(python\).*supports regex and choice", req.structured_output.error)
    ok = make_request("s", [1, 2], structured_outputs={"regex": "a+"})
    manager.add_request(ok)
    ok.structured_output.compiled.result(timeout=5)
    assert manager.check_ready(ok) and isinstance(ok.structured_output.grammar, PythonGrammar)
    manager.shutdown()


def test_jump_forward_returns_forced_tokens_without_moving(backend):
    g = grammar(backend, regex=r"abc(d|e)")
    # "a" and "ab" and "abc" are all allowed: a real choice, no jump
    assert g.jump_forward_tokens() == []
    g = grammar(backend, regex=r"x=\{\"[0-9]")
    assert texts(g.jump_forward_tokens()) == ["x", "="]  # then '{' and '{"' compete
    assert g.text == ""
    g = grammar(backend, choice=["maybe"])
    assert g.accept_tokens("r", [tid("m")])
    assert texts(g.jump_forward_tokens()) == list("aybe")  # stops before EOS
    g.accept_tokens("r", g.jump_forward_tokens())
    assert g.jump_forward_tokens() == [] and allowed(backend, g) == [EOS]


def test_rows_are_cached_per_state_and_bounded():
    b = PythonBackend(VOCAB, [EOS], cache_size=3)
    g = grammar(b, regex=r"[a-z]*")
    for ch in "abcdef":
        allowed(b, g)
        g.accept_tokens("r", [tid(ch)])
    assert len(b._rows) == 3
    first = b.row(g.compiled, g.text)
    assert b.row(g.compiled, g.text) is first


def test_many_rows_and_drafts_through_the_manager(backend):
    """The manager's bitmask rows for a draft: row 1 is the state after the draft."""
    manager = StructuredOutputManager(lambda: backend, max_rollback_tokens=2)
    req = make_request("r", [1], structured_outputs={"choice": ["yes", "no"]})
    manager.add_request(req)
    req.structured_output.compiled.result(timeout=5)
    assert manager.check_ready(req)
    bm, _ = manager.grammar_bitmask({"r": req}, {"r": 0}, {"r": [tid("ye")]}, 2)
    assert sorted(texts(bm.allowed(0))) == sorted(["y", "n", "yes", "no", "ye"])
    assert texts(bm.allowed(1)) == ["s"]
    assert req.structured_output.grammar.text == ""  # rolled back
    assert manager.validate_drafts(req, [tid("no"), EOS, tid("x")]) == [tid("no"), EOS]
    manager.shutdown()


@pytest.mark.parametrize("pattern", [
    r"-?(0|[1-9]\d{0,3})(\.\d{1,2})?",
    r"(yes|no|maybe)!?",
    r"[a-c]{2,5}@[0-9]{1,3}",
    r"\{\"k\": (true|false|null)\}",
])
def test_random_walk_over_allowed_tokens_ends_in_a_full_match(backend, pattern):
    import regex

    rng = random.Random(7)
    for _ in range(30):
        g = grammar(backend, regex=pattern)
        for _step in range(50):
            ids = allowed(backend, g)
            assert ids, f"dead end after {g.text!r}"
            token = rng.choice(ids)
            assert g.accept_tokens("r", [token])
            if g.is_terminated():
                break
        assert g.is_terminated(), g.text
        assert regex.fullmatch(pattern, g.text), g.text


def test_vocabulary_checks():
    with pytest.raises(ValueError, match="smaller than the vocabulary"):
        PythonBackend(["a", "b"], [1], vocab_size=1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        PythonBackend(["a", "b"], [5])
    b = PythonBackend(["a", "<eos>"], [1])
    assert b.vocab_size == 2 and b.name == "python" and b.stop_token_ids == (1,)
    with pytest.raises(TypeError, match="python backend"):
        b.new_grammar(object(), 0)
