"""Badly typed request fields: the client raises RequestError naming the field and the
request; an engine fed them anyway fails only those requests."""

from __future__ import annotations

import time

import msgspec
import pytest

from schedkit.core.request import SamplingParams
from schedkit.engine.client import wire_request
from schedkit.errors import RequestError

from .conftest import assert_engine_idle, raw_client


def _bad_inputs():
    ok = SamplingParams(max_tokens=2)
    return [
        ({"prompt_token_ids": [1, 2.0]}, r"prompt_token_ids\[1\]"),
        ({"prompt_token_ids": ["7"]}, r"prompt_token_ids\[0\]"),
        ({"prompt_token_ids": [None]}, r"prompt_token_ids\[0\]"),
        ({"prompt_token_ids": [3, True]}, r"prompt_token_ids\[1\].*bool"),
        ({"prompt_token_ids": [2**64]}, r"prompt_token_ids\[0\]"),
        ({"prompt_token_ids": 5}, "prompt_token_ids"),
        ({"priority": "high"}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"priority": 2**70}, "priority"),
        ({"tenant": 7}, "tenant"),
        ({"cache_salt": 3}, "cache_salt"),
        ({"params": {"max_tokens": 2}}, "sampling_params"),
        ({"arrival_offset": float("nan")}, "arrival_offset"),
        ({"arrival_offset": float("inf")}, "arrival_offset"),
        ({"arrival_offset": 1e300}, "arrival_offset"),
        ({"arrival_offset": "1"}, "arrival_offset"),
        ({"arrival_offset": -1.0}, "arrival_offset"),
        ({"params": ok, "request_id": 5}, "request_id"),
    ]


@pytest.mark.parametrize("bad,field", _bad_inputs(), ids=lambda v: repr(v)[:40])
def test_badly_typed_fields_raise_request_error_naming_field_and_request(bad, field):
    kwargs = {k: v for k, v in bad.items() if k not in ("prompt_token_ids", "params", "request_id")}
    rid = bad.get("request_id", "req-1")
    with pytest.raises(RequestError, match=field) as e:
        wire_request(rid, bad.get("prompt_token_ids", [1, 2]), bad.get("params", SamplingParams()),
                     **kwargs)
    assert repr(rid) in str(e.value)
    assert e.value.request_id == (rid if isinstance(rid, str) else None)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", True), ("max_tokens", 2**70), ("temperature", float("inf")),
    ("temperature", float("nan")), ("seed", 2**64), ("stop_token_ids", (True,)), ("ignore_eos", 1),
])
def test_badly_typed_sampling_values_raise_request_error(field, value):
    """SamplingParams refuses them itself; the client relies on that (no second list)."""
    with pytest.raises(RequestError, match=field):
        wire_request("req-1", [1, 2], SamplingParams(**{field: value}))


def test_numpy_prompts_are_named_in_the_error():
    import numpy as np

    with pytest.raises(RequestError, match="prompt_token_ids.*ndarray"):
        wire_request("r", np.array([1, 2]), SamplingParams())
    with pytest.raises(RequestError, match=r"prompt_token_ids\[0\].*numpy.int64"):
        wire_request("r", list(np.array([1, 2])), SamplingParams())


def test_a_bad_prompt_fails_generate_at_once_and_the_engine_keeps_serving(llm):
    with pytest.raises(RequestError, match=r"prompts\[1\].*prompt_token_ids\[0\]"):
        llm.generate([[1, 2], [2.5]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(RequestError, match=r"prompts\[0\].*priority"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2), priorities=["high"], use_tqdm=False)
    with pytest.raises(RequestError, match=r"prompts\[1\].*arrival_offset"):
        llm.generate([[1], [2]], SamplingParams(max_tokens=2), arrival_offsets=[0.0, float("nan")],
                     use_tqdm=False)
    with pytest.raises(RequestError, match=r"prompts\[0\].*sampling_params"):
        llm.generate([[1]], [{"max_tokens": 2}], use_tqdm=False)
    outs = llm.generate([[1, 2], [3]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert_engine_idle(llm)


def test_generate_names_requests_by_the_ids_given_and_refuses_bad_ones(llm):
    sp = SamplingParams(max_tokens=2)
    for ids, match in ((["a", "a"], "'a' is given twice"), (["a", 3], r"request_ids\[1\].*3"),
                       (["a", ""], r"request_ids\[1\]"), (["a"], "2 prompts but 1 request ids")):
        with pytest.raises(RequestError, match=match):
            llm.generate([[1, 2], [3]], sp, request_ids=ids, use_tqdm=False)
    outs = llm.generate([[1, 2], [3]], sp, request_ids=["req-7", "req-3"], use_tqdm=False)
    assert [o.request_id for o in outs] == ["req-7", "req-3"]
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert_engine_idle(llm)


def test_engine_fails_only_the_badly_typed_requests_of_a_message(llm):
    """A client that skips validation: each bad request gets an error output, the valid
    requests of the same message are served."""
    def req(rid, prompt=(1, 2, 3), **extra):
        return {"request_id": rid, "prompt_token_ids": list(prompt),
                "sampling_params": {"max_tokens": 2}, **extra}

    bad = {
        "float-token": req("float-token", [1, 2.5]),
        "str-token": req("str-token", ["x"]),
        "none-token": req("none-token", [None]),
        "bool-token": req("bool-token", [True]),
        "uint64-token": req("uint64-token", [2**64 - 1]),
        "str-priority": req("str-priority", priority="high"),
        "float-priority": req("float-priority", priority=1.5),
        "int-tenant": req("int-tenant", tenant=3),
        "bool-max-tokens": {**req("bool-max-tokens"), "sampling_params": {"max_tokens": True}},
        "inf-temperature": {**req("inf-temperature"), "sampling_params": {"temperature": float("inf")}},
        "nan-offset": req("nan-offset", arrival_offset=float("nan")),
        "huge-offset": req("huge-offset", arrival_offset=1e300),
        "list-hints": req("list-hints", hints=[1]),
        "unknown-hint": req("unknown-hint", hints={"urgency": 9}),
        "negative-deadline": req("negative-deadline", hints={"deadline_s": -1.0}),
        "float-expected": req("float-expected", hints={"expected_output_tokens": 2.5}),
        "unknown-class": req("unknown-class", hints={"slo_class": "gold"}),
    }
    message = {"type": "add", "requests": [req("good-1"), *bad.values(), 17, req("good-2", [4])]}
    malformed_before = llm.call_utility("stats")["num_malformed_messages"]
    finished = {}
    with raw_client(llm) as client:
        client.in_sock.send(msgspec.msgpack.encode(message))
        deadline = time.monotonic() + 10
        while len(finished) < len(bad) + 2 and time.monotonic() < deadline:
            batch = client.recv(timeout=1)
            for o in batch.outputs if batch is not None else ():
                if o.finish_reason is not None:
                    finished[o.request_id] = o
    assert set(finished) == set(bad) | {"good-1", "good-2"}
    assert finished["good-1"].finish_reason == finished["good-2"].finish_reason == "length"
    for rid in bad:
        assert finished[rid].finish_reason == "error" and rid in finished[rid].error, rid
    assert "priority" in finished["str-priority"].error
    assert "tenant" in finished["int-tenant"].error
    assert "max_tokens" in finished["bool-max-tokens"].error
    assert "temperature" in finished["inf-temperature"].error
    assert "arrival_offset" in finished["huge-offset"].error
    assert "urgency" in finished["unknown-hint"].error and "deadline_s" in finished["negative-deadline"].error
    assert "expected_output_tokens" in finished["float-expected"].error
    assert "slo_class 'gold'" in finished["unknown-class"].error  # the config names no classes
    # the request without a readable id (17) has nobody to answer: counted as malformed
    assert llm.call_utility("stats")["num_malformed_messages"] == malformed_before + 1
    assert_engine_idle(llm)
