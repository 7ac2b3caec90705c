"""Bad input to the engine core fails only its request:
a KV pool smaller than max_model_len caps sequences instead of livelocking, and
arrival offsets must be finite seconds."""

from __future__ import annotations

import logging
import math

import pytest

from schedkit.config import config_from_dict
from schedkit.core.request import MAX_ARRIVAL_OFFSET_S, Request, SamplingParams
from schedkit.engine.core import EngineCore
from schedkit.errors import RequestError
from tests.core.test_queue_errors import drive as _drive


def _engine(**cache) -> EngineCore:
    cfg = config_from_dict({
        "runner": {"kind": "fake"},
        "cache": {"block_size": 4, "num_blocks": 2048, **cache},
        "scheduler": {"max_num_batched_tokens": 64, "max_model_len": 256},
    })
    return EngineCore(cfg)


def _req(rid: str, n: int = 8, max_tokens: int = 4) -> Request:
    return Request(rid, [1 + i % 50 for i in range(n)], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=0.0)


def test_pool_smaller_than_max_model_len_caps_sequences(caplog):
    """9 usable blocks of 4 = 36 tokens < max_model_len 256: a request whose prompt fits
    but prompt + output does not is capped at 36 tokens instead of being preempted
    forever and blocking the queue."""
    with caplog.at_level(logging.WARNING, logger="schedkit.scheduler"):
        engine = _engine(num_blocks=10)
    assert "max_model_len = 256" in caplog.text and "36 tokens" in caplog.text
    assert engine.scheduler.max_model_len == 36
    engine.add_request(_req("long", n=20, max_tokens=100))
    engine.add_request(_req("after", n=6, max_tokens=3))
    res = _drive(engine)
    long_tokens = sum(len(o.new_token_ids) for o in res["long"])
    assert res["long"][-1].finish_reason == "length" and long_tokens == 36 - 20
    assert res["after"][-1].finish_reason == "length"
    with pytest.raises(RequestError, match="shorter than max_model_len \\(36, what the KV cache holds\\)"):
        engine.add_request(_req("too-long", n=36))


@pytest.mark.parametrize("offset", [math.nan, math.inf, -math.inf, 1e300, MAX_ARRIVAL_OFFSET_S * 2, -1.0,
                                    "1", True, None.__class__])
def test_bad_arrival_offsets_are_rejected(offset):
    engine = _engine()
    with pytest.raises(RequestError, match="arrival_offset"):
        engine.add_request(_req("bad"), arrival_offset=offset)
    engine.add_request(_req("ok"), arrival_offset=0.25)
    res = _drive(engine)
    assert list(res) == ["ok"] and res["ok"][-1].finish_reason == "length"
    assert engine.now() < 10.0  # the virtual clock did not jump


def test_large_valid_offset_is_served():
    engine = _engine()
    engine.add_request(_req("late", max_tokens=2), arrival_offset=1e6)
    res = _drive(engine)
    assert res["late"][-1].finish_reason == "length"
    assert engine.now() > 1e6
