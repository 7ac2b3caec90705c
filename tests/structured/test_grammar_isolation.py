"""One structured request's grammar work must not stall the others (xgrammar backend,
compiles in worker processes; the engine in-process with the fake runner over a small
byte-level tokenizer, or a word-level one of SmolLM2's vocabulary size where compile
costs matter): a deeply nested schema is refused at once; slow compiles are
stopped at their timeout, or as soon as their requests are aborted, and the workers
serve the next constraint; an ambiguous grammar whose matcher grows with its output
fails on its per-step budget while its neighbour is served."""

from __future__ import annotations

import time

import pytest

from schedkit.config import config_from_dict
from schedkit.core.request import Request, SamplingParams
from schedkit.engine.core import EngineCore
from schedkit.errors import RequestError
from schedkit.structured.testing import word_level_tokenizer

pytest.importorskip("xgrammar")

SLOW_REGEX = "[^{0}]{{0,20000}}[^{1}]{{0,20000}}"
"""6 to 20 s to compile over a 49,152-token vocabulary (xgrammar 0.2.9, 2 cores).
Different letters: different constraints, no cache hit."""
BIG_VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, bpe_tokenizer):
    path = tmp_path_factory.mktemp("tok")
    bpe_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def big_tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bigtok")
    word_level_tokenizer(BIG_VOCAB).save_pretrained(path)
    return path


def engine(tokenizer_dir, **structured) -> EngineCore:
    vocab = BIG_VOCAB if "bigtok" in str(tokenizer_dir) else 336
    return EngineCore(config_from_dict({
        "model": {"tokenizer": str(tokenizer_dir)},
        "runner": {"vocab_size": vocab, "eos_token_id": 0},
        "structured_outputs": {"backend": "xgrammar", **structured}}))


def request(rid: str, max_tokens: int = 20, **so) -> Request:
    return Request(rid, [50, 60, 70], SamplingParams(max_tokens=max_tokens, eos_token_id=0,
                                                  structured_outputs=so or None), 0.0)


def serve(eng: EngineCore, limit_s: float, abort_after: tuple[float, list[str]] | None = None) -> dict:
    """Step until idle; returns request id -> (finish reason, error, seconds)."""
    finished = {}
    t0 = time.monotonic()
    while eng.has_requests():
        now = time.monotonic() - t0
        assert now < limit_s, f"not done in {limit_s} s: {eng.stats()}"
        if abort_after is not None and now >= abort_after[0]:
            for r in eng.abort_requests(abort_after[1]):
                finished[r.request_id] = ("abort", "", now)
            abort_after = None
        for group in eng.step().values():
            for o in group.outputs:
                if o.finish_reason:
                    finished[o.request_id] = (o.finish_reason, o.error or "", time.monotonic() - t0)
        if eng.last_step_empty:
            time.sleep(0.002)
    return finished


def test_a_600_level_schema_is_refused_at_once_and_the_engine_goes_on(tokenizer_dir):
    schema: dict = {"type": "integer"}
    for _ in range(600):
        schema = {"type": "array", "items": schema}
    eng = engine(tokenizer_dir)
    t0 = time.monotonic()
    with pytest.raises(RequestError, match=r"structured_outputs.max_json_schema_depth"):
        eng.add_request(request("deep", json=schema))
    assert time.monotonic() - t0 < 1.0  # compiling it would take tens of seconds
    eng.add_request(request("yes", choice=["yes"]))
    assert serve(eng, 60)["yes"][0] == "stop"
    assert eng.stats()["grammar_refusals"] == 1
    eng.close()


def test_aborted_slow_compiles_are_stopped_and_the_next_constraint_compiles_at_once(big_tokenizer_dir):
    eng = engine(big_tokenizer_dir, num_workers=2)
    eng.add_request(request("warm", choice=["ok"]))  # the workers' start (their imports) is not timed
    serve(eng, 60)
    slow = [f"slow{i}" for i in range(4)]
    for i, rid in enumerate(slow):
        eng.add_request(request(rid, regex=SLOW_REGEX.format("pqrs"[i], "PQRS"[i])))
    finished = serve(eng, 10, abort_after=(0.5, slow))  # the clients disconnect
    assert all(finished[rid][0] == "abort" for rid in slow)
    eng.add_request(request("yes", choice=["yes"]))
    t0 = time.monotonic()
    assert serve(eng, 10)["yes"][0] == "stop"
    assert time.monotonic() - t0 < 2.0  # not behind 20 s compiles
    stats = eng.stats()
    assert stats["grammar_compiles_cancelled"] == 4 and stats["grammar_compile_failures"] == 0
    eng.close()


def test_a_slow_compile_is_stopped_at_its_timeout_and_fails_its_request_alone(big_tokenizer_dir):
    eng = engine(big_tokenizer_dir, compile_timeout_s=1.0, num_workers=1)
    eng.add_request(request("warm", choice=["ok"]))
    serve(eng, 60)
    eng.add_request(request("slow", regex=SLOW_REGEX.format("p", "P")))
    eng.add_request(request("plain"))
    finished = serve(eng, 10)
    reason, error, after = finished["slow"]
    assert reason == "error" and "structured_outputs.compile_timeout_s" in error and after < 5.0
    assert finished["plain"][0] == "length"
    eng.add_request(request("yes", choice=["yes"]))  # the worker was replaced
    assert serve(eng, 5)["yes"][0] == "stop"
    assert eng.stats()["grammar_compile_timeouts"] == 1
    eng.close()


AMBIGUOUS = ('root ::= s "w500"\ns ::= s s s | s s | t | ""\nt ::= '
             + " | ".join(f'"w{i}"' for i in range(300)))
"""Every split of the output into words is a parse: the matcher's work grows with it."""


def test_an_ambiguous_grammar_fails_on_its_step_budget_and_its_neighbour_is_served(tokenizer_dir):
    eng = engine(tokenizer_dir, step_budget_ms=2)
    eng.add_request(request("ambiguous", max_tokens=400, grammar=AMBIGUOUS))
    eng.add_request(request("plain", max_tokens=400))
    finished = serve(eng, 120)
    reason, error, _ = finished["ambiguous"]
    assert reason == "error" and "over its budget of 2 ms (structured_outputs.step_budget_ms)" in error
    assert finished["plain"][0] == "length"
    assert eng.stats()["grammar_step_budget_failures"] == 1
    eng.close()
