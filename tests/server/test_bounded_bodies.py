"""Large and malformed bodies over HTTP: refused by their size before the work they would
cost, and every kind of bad text a 400 naming its field.

A list longer than its limit is refused by its length, before its elements are validated
(a bad element at its end is never reached); a text that cannot fit ``max_model_len`` is
refused by its characters, before it is tokenized; a lone surrogate, escaped or encoded
in the UTF-8, is a 400 naming the field; and a body with one costs about what decoding
it does, not a walk over every value.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.server.conftest import LiveServer, server_config, start_server, stop_server

httpx = pytest.importorskip("httpx")

MAX_MODEL_LEN = 64
LONGEST_TOKEN = len("<|assistant|>")  # the word tokenizer's longest token


@pytest.fixture(scope="module")
def live(tmp_path_factory, word_tokenizer) -> Iterator[LiveServer]:
    s = start_server(tmp_path_factory.mktemp("bodies"),
                     server_config(word_tokenizer, scheduler={"max_model_len": MAX_MODEL_LEN}))
    yield s
    stop_server(s)


@pytest.fixture
def client(live) -> Iterator[httpx.Client]:
    with live.client() as c:
        yield c


def _post(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=data, headers={"Content-Type": "application/json"})


def _assert_400(r: httpx.Response, param: str | None, *says: str) -> dict:
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["param"] == param, err
    for s in says:
        assert s in err["message"], err
    return err


def _assert_serves(client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "w7", "max_tokens": 1})
    assert r.status_code == 200, r.text


_MSG = {"role": "user", "content": "w7"}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", b'{"prompt": "w7 \xed\xa0\x80", "max_tokens": 1}', "prompt"),
    ("/v1/completions", b'{"prompt": ["w7", "\xed\xb0\x80 w8"], "max_tokens": 1}', "prompt[1]"),
    ("/v1/completions", b'{"prompt": "w7", "stop": ["\xed\xa0\x80"]}', "stop[0]"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "w7 \xed\xa0\x80"}]}',
     "messages[0].content"),
    ("/tokenize", b'{"prompt": "w7 \xed\xa0\x80"}', "prompt"),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', "messages[0].content"),
    ("/v1/completions", b'{"prompt": "w7", "structured_outputs": {"regex": "a\xed\xa0\x80"}}',
     "structured_outputs.regex"),
    ("/v1/completions", b'{"prompt": "w7", "structured_outputs": {"choice": ["a", "\xed\xa0\x80"]}}',
     "structured_outputs.choice[1]"),
    ("/v1/completions", b'{"prompt": "w7", "structured_outputs": {"grammar": "root ::= \\"\xed\xa0\x80\\""}}',
     "structured_outputs.grammar"),
], ids=["prompt", "batch", "stop", "chat", "tokenize", "tokenize-chat", "regex", "choice", "grammar"])
def test_a_utf8_encoded_surrogate_is_a_400_naming_the_field(live, client, path, body, param):
    _assert_400(_post(client, path, body), param, param, "not valid Unicode", "surrogate")
    _assert_serves(client)
    assert "Traceback" not in live.log()


@pytest.mark.parametrize(("path", "body", "param", "says"), [
    ("/v1/completions", {"prompt": [7] * 5000 + ["x"]}, "prompt",
     ("5001 tokens", "scheduler.max_model_len")),
    ("/v1/completions", {"prompt": [[7], [7] * 100 + [-1]]}, "prompt[1]", ("101 tokens", "scheduler.max_model_len")),
    ("/v1/completions", {"prompt": [7], "stop_token_ids": [3] * 2000 + ["x"]}, "stop_token_ids",
     ("at most 1024 ids, got 2001",)),
    ("/v1/completions", {"prompt": [7], "stop": ["w9"] * 100 + [7]}, "stop", ("at most 32 stop strings",)),
    ("/v1/chat/completions", {"messages": [_MSG] * MAX_MODEL_LEN + [{"role": "robot"}]}, "messages",
     (f"{MAX_MODEL_LEN + 1} messages", "scheduler.max_model_len")),
    ("/tokenize", {"messages": [_MSG] * MAX_MODEL_LEN + [{"role": "robot"}]}, "messages",
     ("scheduler.max_model_len",)),
    ("/detokenize", {"tokens": [7] * MAX_MODEL_LEN + [-1]}, "tokens",
     (f"{MAX_MODEL_LEN + 1} ids", f"at most {MAX_MODEL_LEN}", "scheduler.max_model_len")),
], ids=["prompt", "batch-prompt", "stop_token_ids", "stop", "messages", "tokenize-messages", "detokenize"])
def test_a_list_over_its_limit_is_refused_by_its_length(client, path, body, param, says):
    """The bad element at the end is never looked at: the length alone refuses it."""
    _assert_400(_post(client, path, body), param, *says)
    _assert_serves(client)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "w7 " * 500, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": ["w7", "w7 " * 500], "max_tokens": 1}, "prompt[1]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w7 " * 250}] * 2}, "messages"),
    ("/tokenize", {"prompt": "w7 " * 500}, "prompt"),
], ids=["prompt", "batch", "chat", "tokenize"])
def test_a_text_that_cannot_fit_is_refused_before_tokenizing(client, path, body, param):
    """1,000 characters besides whitespace cannot be 64 tokens when no token has more than
    13: refused by counting them (the message says characters, not tokens)."""
    assert 1000 > MAX_MODEL_LEN * LONGEST_TOKEN
    _assert_400(_post(client, path, body), param, "1000 characters besides whitespace",
                f"context of {MAX_MODEL_LEN} tokens", "scheduler.max_model_len")
    _assert_serves(client)


def test_a_long_text_that_fits_is_served(client):
    """Whitespace does not count for a tokenizer that drops it: the bound refuses only
    what cannot fit."""
    text = "w7" + " \n" * 5000 + "w8"
    r = client.post("/v1/completions", json={"prompt": text, "max_tokens": 1, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["prompt_token_ids"] == [7, 8]


def _best_of_3(client: httpx.Client, body: bytes) -> float:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        r = _post(client, "/v1/completions", body)
        times.append(time.perf_counter() - t0)
        assert r.status_code == 400, r.text
    return min(times)


def test_a_lone_surrogate_costs_about_what_decoding_does(client):
    """A 7 MB batch of 2.3 million prompts with a lone surrogate in the last: found by a
    scan of the text and named within a bounded walk, it costs about what the same body
    without it does (both are refused at once), not a walk over every value."""
    strings = b",".join([b'""'] * 2_300_000)
    plain = b'{"prompt": [' + strings + b"]}"
    lone = b'{"prompt": [' + strings + b', "\\ud800"]}'
    plain_s, lone_s = _best_of_3(client, plain), _best_of_3(client, lone)
    assert lone_s < 2 * plain_s + 0.15, f"{lone_s:.2f} s with the surrogate, {plain_s:.2f} s without"
    _assert_serves(client)
