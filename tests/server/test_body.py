"""Request bodies to JSON values (schedkit.server.body), and the text bound and tokenizer
threads of the Server, without a server.

The lone-surrogate scan is checked against Python itself (decode the JSON string, try to
encode it) on random strings of escapes, escaped backslashes and text.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import sys
import threading
from typing import Any

import pytest

pytest.importorskip("prometheus_client")

from schedkit.config import config_from_dict  # noqa: E402
from schedkit.server import body as body_module  # noqa: E402
from schedkit.server.body import MAX_WALK_VALUES, decode_json, has_lone_surrogate_escape  # noqa: E402
from schedkit.server.metrics import ServerMetrics  # noqa: E402
from schedkit.server.protocol import APIError  # noqa: E402
from schedkit.server.serving import (  # noqa: E402
    ASCII_WHITESPACE,
    OTHER_WHITESPACE,
    SHORT_TEXT_CHARS,
    Server,
    TextBound,
)

PIECES = ["\\ud800", "\\uDBFF", "\\udc00", "\\uDFFF", "\\ud83d\\ude00", "\\\\", "\\\\ud800", "\\\\\\ud800",
          "\\u00e9", "\\n", "\\\"", "a", "u", "d800", "\\ud83d", "\\ude00", "\\\\u", "\u00e9"]


def _python_says_lone(escaped: str) -> bool:
    try:
        json.loads(f'"{escaped}"').encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def test_the_surrogate_scan_agrees_with_python():
    rng = random.Random(0)
    for _ in range(5000):
        s = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 8)))
        assert has_lone_surrogate_escape(f'"{s}"') == _python_says_lone(s), s


@pytest.mark.parametrize(("raw", "param"), [
    (b'{"prompt": "w7 \\ud800"}', "prompt"),
    (b'{"prompt": ["w7", "\\udfff w8"]}', "prompt[1]"),
    (b'{"messages": [{"role": "user", "content": "\\uDC00"}]}', "messages[0].content"),
    (b'{"structured_outputs": {"choice": ["a", "b\\ud83d"]}}', "structured_outputs.choice[1]"),
    (b'{"structured_outputs": {"\\ud800": 1}}', "structured_outputs"),
    (b'{"prompt": "w7", "\\ud800": 1}', None),
    (b'{"prompt": "w7 \xed\xa0\x80"}', "prompt"),  # UTF-8 that encodes a surrogate
    (b'{"stop": ["w9", "\xed\xa0\xbd\xed\xb8\x80"]}', "stop[1]"),  # CESU-8: a pair, encoded apart
], ids=["escaped", "batch", "chat", "choice", "nested-key", "key", "raw", "raw-pair"])
def test_a_lone_surrogate_is_a_400_naming_its_field(raw, param):
    with pytest.raises(APIError) as e:
        decode_json(raw)
    assert e.value.status == 400 and e.value.param == param
    assert "surrogate" in e.value.message and (param is None or e.value.message.startswith(param))


@pytest.mark.parametrize("raw", [
    b'{"prompt": "\\ud83d\\ude00 \\\\ud800 \\u00e9"}',
    '{"prompt": "caf\u00e9 \U0001f600"}'.encode(),
    '{"prompt": "w7"}'.encode("utf-16"),  # JSON's other encodings, detected as json does
    b'\xef\xbb\xbf{"prompt": "w7"}',
])
def test_valid_text_decodes(raw):
    assert isinstance(decode_json(raw), dict)


@pytest.mark.parametrize("raw", [b'{"prompt": "\xff\xfe"}', b'{"prompt": "\xed\xa0"}', b'{"prompt": '])
def test_bytes_that_are_not_json_text_are_a_400(raw):
    with pytest.raises(APIError, match="not valid JSON") as e:
        decode_json(raw)
    assert e.value.status == 400


def test_valid_pairs_alone_are_never_walked(monkeypatch):
    """Only a body the scan finds a lone surrogate in is walked to name its field."""
    def walked(*_: Any) -> None:
        raise AssertionError("walked")

    monkeypatch.setattr(body_module, "_unencodable_path", walked)
    raw = b'{"stop": [' + b",".join([b'"\\ud83d\\ude00\\\\ud800"'] * 10_000) + b"]}"
    assert len(decode_json(raw)["stop"]) == 10_000


def test_naming_the_field_is_bounded():
    """Past MAX_WALK_VALUES values the 400 names no field, instead of walking on."""
    late = b'{"stop": [' + b",".join([b'""'] * MAX_WALK_VALUES) + b', "\\ud800"]}'
    with pytest.raises(APIError, match="not valid Unicode") as e:
        decode_json(late)
    assert e.value.param is None
    early = b'{"stop": ["\\ud800", ' + b",".join([b'""'] * MAX_WALK_VALUES) + b"]}"
    with pytest.raises(APIError) as e:
        decode_json(early)
    assert e.value.param == "stop[0]"


@pytest.mark.parametrize("raw", [
    b'{"stop": ["a", "\\ud800"]}',  # the field found
    b'{"stop": [' + b",".join([b'""'] * MAX_WALK_VALUES) + b', "\\ud800"]}',  # the walk cut short
])
def test_naming_the_field_leaves_nothing_for_the_garbage_collector(raw):
    """The walk that names the field builds no reference cycle: what it allocated is freed
    when it returns, not at the next full collection, which a server whose start-up
    objects are frozen runs rarely (in a loop of 5 MB bodies, each cycle left behind kept
    about a megabyte until then)."""
    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            with pytest.raises(APIError, match="not valid Unicode"):
                decode_json(raw)
        assert gc.collect() == 0
    finally:
        gc.enable()


# -- the text bound ---------------------------------------------------------------------------
def test_whitespace_kinds_are_what_python_calls_whitespace():
    every = {chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace()}
    assert set(ASCII_WHITESPACE + OTHER_WHITESPACE) == every


class WordTokenizer:
    """Whitespace-split words; each known word (``w0``..) one token, and a slow mode:
    ``encode`` of a text over SHORT_TEXT_CHARS waits until ``release`` is set."""

    chat_template = None
    eos_token_id = 2

    def __init__(self) -> None:
        self.release = threading.Event()
        self.running_long = 0
        self.most_long_at_once = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return 64

    def get_vocab(self) -> dict[str, int]:
        return {f"w{i}": i for i in range(64)} | {"<|assistant|>": 64}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > SHORT_TEXT_CHARS:
            with self._lock:
                self.running_long += 1
                self.most_long_at_once = max(self.most_long_at_once, self.running_long)
            try:
                assert self.release.wait(30)
            finally:
                with self._lock:
                    self.running_long -= 1
        return [int(w[1:]) % 64 for w in text.split()]


def _server(tokenizer: Any, max_model_len: int = 2048) -> Server:
    cfg = config_from_dict({"runner": {"kind": "fake", "vocab_size": 64, "eos_token_id": 2},
                            "scheduler": {"max_model_len": max_model_len}})
    return Server(cfg, None, tokenizer, ServerMetrics("m", "fcfs", []), "m")


def test_the_bound_comes_from_the_longest_token():
    s = _server(WordTokenizer(), max_model_len=10)
    bound = s.text_bound
    assert bound == TextBound(10, len("<|assistant|>"), skips_whitespace=True)
    s.check_text_fits(["w1" * 65], "prompt")  # 130 characters: fits
    s.check_text_fits(["w1" + " \n" * 5000], "prompt")  # whitespace is not counted for this tokenizer
    with pytest.raises(APIError) as e:
        s.check_text_fits(["w1" * 65 + "x"], "prompt")
    assert e.value.param == "prompt" and "131 characters besides whitespace" in e.value.message
    assert "scheduler.max_model_len" in e.value.message
    with pytest.raises(APIError) as e:
        s.check_text_fits(["w1" * 40, "w2" * 40], "messages")  # a chat's contents together
    assert e.value.param == "messages"


def test_whitespace_counts_for_a_tokenizer_that_keeps_it():
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(["the cat  sat\n\n on   the mat"] * 20,
                            tokenizers.trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet))

    class Wrapped:  # the transformers call shape
        def get_vocab(self) -> dict[str, int]:
            return tok.get_vocab()

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return tok.encode(text, add_special_tokens=add_special_tokens).ids

    bound = TextBound.of(Wrapped(), 10)
    assert bound is not None and not bound.skips_whitespace
    with pytest.raises(APIError, match="characters cannot fit"):
        bound.check([" " * (bound.max_chars + 1)], "prompt")


def test_short_texts_do_not_wait_behind_long_ones():
    tok = WordTokenizer()
    s = _server(tok)

    async def scenario() -> list[int]:
        long = [asyncio.ensure_future(s.encode("w1 " * 2000)) for _ in range(2)]
        try:
            # both long ones run at once (server.tokenizer_threads), the short one beside them
            short = await asyncio.wait_for(s.encode("w5 w6"), 10)
            for _ in range(200):
                if tok.most_long_at_once == 2:
                    break
                await asyncio.sleep(0.01)
            assert tok.most_long_at_once == 2
        finally:
            tok.release.set()
        assert [len(ids) for ids in await asyncio.gather(*long)] == [2000, 2000]
        return short

    try:
        assert asyncio.run(scenario()) == [5, 6]
    finally:
        tok.release.set()
        s.close()
