"""User mistakes raise typed errors naming what was wrong; the scheduler keeps serving."""

from __future__ import annotations

import pytest

from schedkit.core.request import Request, RequestStatus, SamplingParams
from schedkit.errors import RequestError
from schedkit.plugins.testing import (
    assert_scheduler_consistent,
    make_request,
    make_scheduler,
    runner_output,
)


def test_prompt_at_or_over_max_model_len_is_rejected():
    sched = make_scheduler(max_model_len=64)
    with pytest.raises(RequestError, match="max_model_len"):
        sched.add_request(make_request("long", [1] * 64))
    sched.add_request(make_request("ok", [1] * 63))
    assert list(sched.requests) == ["ok"]


def test_empty_prompt_is_an_error():
    with pytest.raises(RequestError, match="non-empty"):
        make_request("empty", [])


@pytest.mark.parametrize("bad", [[1, -2], [1, 2.5], "abc", [None], [1, True], ["7"], [2**64],
                                 [2**63], (i for i in [1, 2])])
def test_bad_token_ids_are_errors(bad):
    with pytest.raises(RequestError):
        Request("r", bad, SamplingParams(), arrival_time=0.0)


def test_duplicate_request_id_is_an_error_and_keeps_the_first():
    sched = make_scheduler()
    first = make_request("same", [1, 2, 3])
    sched.add_request(first)
    with pytest.raises(RequestError, match="duplicate") as e:
        sched.add_request(make_request("same", [4, 5]))
    assert e.value.request_id == "same"
    assert sched.requests["same"] is first and len(sched.waiting) == 1


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("min_tokens", -1), ("min_tokens", 99), ("temperature", -0.1),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("stop_token_ids", (-1,)),
    ("eos_token_id", -5), ("seed", 1.5),
    ("max_tokens", True), ("max_tokens", 2**64), ("max_tokens", 16.0), ("temperature", float("inf")),
    ("temperature", float("nan")), ("temperature", True), ("top_p", float("nan")), ("top_k", True),
    ("seed", 2**70), ("stop_token_ids", "ab"), ("stop_token_ids", (True,)), ("ignore_eos", "no"),
])
def test_invalid_sampling_values(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{"max_tokens": 16, field: value})


def test_stop_token_ids_none_means_none_as_in_vllm():
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_finishing_an_unknown_or_finished_id_is_a_no_op():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=1))
    assert sched.finish_requests("nope", RequestStatus.FINISHED_ABORTED) == []
    out = sched.schedule()
    sched.update_from_output(out, runner_output(out, {"a": [9]}))
    assert sched.finish_requests(["a", "nope"], RequestStatus.FINISHED_ABORTED) == []
    assert_scheduler_consistent(sched)


def test_engine_keeps_serving_after_a_rejected_request():
    sched = make_scheduler(num_blocks=5)
    sched.add_request(make_request("ok", [1] * 20, max_tokens=2))
    with pytest.raises(RequestError):
        sched.add_request(make_request("huge", [2] * 100))
    for _ in range(4):
        out = sched.schedule()
        sched.update_from_output(out, runner_output(out, {r: [7] for r in out.num_scheduled_tokens}))
    assert not sched.requests and sched.kv_cache_manager.num_free_blocks == 4


@pytest.mark.parametrize("field,value", [
    ("priority", "high"), ("priority", 1.5), ("priority", True), ("priority", 2**64), ("tenant", 3),
    ("client_index", -1), ("cache_salt", 5), ("arrival_time", float("nan")),
    ("sampling_params", {"max_tokens": 3}), ("skip_reading_prefix_cache", 1),
])
def test_badly_typed_request_fields_are_errors(field, value):
    """Refused in process too, with the field named, not only at the engine-process
    boundary (where one of them would fail the whole message)."""
    kwargs = {"request_id": "r", "prompt_token_ids": [1, 2], "sampling_params": SamplingParams(),
              "arrival_time": 0.0, field: value}
    with pytest.raises(RequestError, match=f"'r': {field} must be") as e:
        Request(**kwargs)
    assert e.value.request_id == "r"


def test_numpy_prompts_are_errors():
    np = pytest.importorskip("numpy")
    for bad in (np.array([1, 2, 3]), [np.int64(1), np.int64(2)]):
        with pytest.raises(RequestError, match="prompt"):
            Request("r", bad, SamplingParams(), arrival_time=0.0)
