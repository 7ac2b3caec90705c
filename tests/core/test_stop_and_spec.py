"""Stop conditions and speculative-decoding bookkeeping (docs/scheduler-behaviour.md#stop-order,
docs/scheduler-behaviour.md#spec-stats, docs/scheduler-behaviour.md#spec-padding)."""

from __future__ import annotations

import pytest

from schedkit.core.outputs import CachedRequestData, SchedulerOutput
from schedkit.core.request import FinishReason, RequestStatus
from schedkit.core.stop import check_stop
from schedkit.plugins.testing import make_request, make_requests, make_scheduler, runner_output

EOS = 50256


def _running_pair(k, **req_kw):
    """Two 10-token requests, prefilled, ready to decode (computed == num_tokens)."""
    sched = make_scheduler(num_speculative_tokens=k)
    reqs = make_requests(2, max_tokens=req_kw.pop("max_tokens", 10))
    for r in reqs:
        for key, val in req_kw.items():
            setattr(r, key, val)
        sched.add_request(r)
    sched.schedule()
    assert all(r.num_computed_tokens == r.num_tokens for r in reqs)
    return sched, reqs


def _hand_output(num_scheduled, spec):
    return SchedulerOutput(
        scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens=num_scheduled, total_num_scheduled_tokens=sum(num_scheduled.values()),
        scheduled_spec_decode_tokens=spec, num_common_prefix_blocks=[0],
        preempted_req_ids=set(), finished_req_ids=set())


def _finish_reasons(outs):
    return {o.request_id: o.finish_reason for o in outs[0].outputs}


def test_stop_via_update_from_output_eos():  # docs/scheduler-behaviour.md#stop-order
    sched, (r0, r1) = _running_pair(1)
    so = _hand_output({"0": 1, "1": 2}, {"1": [10]})
    outs = sched.update_from_output(so, runner_output(so, {"0": [EOS], "1": [10, 11]}))
    assert sched.running == [r1]
    assert r0.status is RequestStatus.FINISHED_STOPPED and "0" in sched.finished_req_ids
    assert r0.output_token_ids == [EOS] and r1.output_token_ids == [10, 11]
    assert _finish_reasons(outs) == {"0": FinishReason.STOP, "1": None}


def test_stop_via_update_from_output_stop_token():  # docs/scheduler-behaviour.md#stop-order
    sched, (r0, r1) = _running_pair(2, stop_token_ids=frozenset({42, 43}))
    so = _hand_output({"0": 3, "1": 2}, {"0": [10, 42], "1": [13]})
    sched.update_from_output(so, runner_output(so, {"0": [10, 42, 12], "1": [13, 14]}))
    assert r0.status is RequestStatus.FINISHED_STOPPED and r0.stop_reason == 42
    assert r0.output_token_ids == [10, 42]
    assert r1.output_token_ids == [13, 14] and sched.running == [r1]


def test_stop_via_update_from_output_max_tokens():  # docs/scheduler-behaviour.md#stop-order
    sched, (r0, r1) = _running_pair(2, max_tokens=2)
    so = _hand_output({"0": 3, "1": 1}, {"0": [10, 11]})
    outs = sched.update_from_output(so, runner_output(so, {"0": [10, 11, 12], "1": [13]}))
    assert r0.status is RequestStatus.FINISHED_LENGTH_CAPPED and r0.output_token_ids == [10, 11]
    assert r1.output_token_ids == [13] and sched.running == [r1]
    assert _finish_reasons(outs)["0"] == "length"


def test_stop_via_update_from_output_ignore_eos():  # docs/scheduler-behaviour.md#stop-order
    sched, (r0, _) = _running_pair(2, eos_token_id=None)
    so = _hand_output({"0": 3}, {"0": [EOS, 10]})
    sched.update_from_output(so, runner_output(so, {"0": [EOS, 10, 11]}))
    assert not r0.is_finished and r0.output_token_ids == [EOS, 10, 11]


@pytest.mark.parametrize("min_tokens,stop_ids,outputs,stopped,status,reason", [
    (5, (), [10, 11, EOS], True, RequestStatus.FINISHED_STOPPED, None),
    (0, (), [10, EOS], True, RequestStatus.FINISHED_STOPPED, None),
    (5, (42,), [10, 11, 42], True, RequestStatus.FINISHED_STOPPED, 42),
    (5, (), [10, 11, 12], False, RequestStatus.WAITING, None),
])
def test_check_stop_min_tokens(min_tokens, stop_ids, outputs, stopped, status, reason):  # docs/scheduler-behaviour.md#stop-min-tokens
    req = make_request("r", [0, 1, 2], max_tokens=20, min_tokens=min_tokens, stop_token_ids=stop_ids)
    result = False
    for tok in outputs:
        req.append_output_token_ids(tok)
        result = check_stop(req, max_model_len=100)
    assert result is stopped and req.status is status and req.stop_reason == reason


@pytest.mark.parametrize("drafts,sampled,expected", [
    ([[1, 2, 3]], [[1, 2, 3, 4]], (1, 3, 3, [1, 1, 1])),
    ([[1, 2, 3]], [[1, 5]], (1, 3, 1, [1, 0, 0])),
    ([[1, 2], [3]], [[1, 2, 5], [3, 4]], (2, 3, 3, [2, 1])),
    ([[1]], [[1, 2]], (1, 1, 1, [1])),
    ([[]], [[5]], None),
    ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7], [4, 8]], (2, 6, 3, [2, 1, 0])),
])
def test_schedule_spec_decoding_stats(drafts, sampled, expected):  # docs/scheduler-behaviour.md#spec-stats
    k = max(1, max(len(d) for d in drafts))
    sched = make_scheduler(num_speculative_tokens=k)
    reqs = make_requests(len(drafts), num_tokens=1)
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert len(out.scheduled_new_reqs) == len(reqs) and out.total_num_scheduled_tokens == len(reqs)
    assert not out.scheduled_spec_decode_tokens
    outs = sched.update_from_output(out, runner_output(out, {r.request_id: [0] for r in reqs}))
    assert outs[0].scheduler_stats.spec_decoding_stats is None
    sched.update_draft_token_ids({r.request_id: d for r, d in zip(reqs, drafts, strict=True)})
    for r, d in zip(reqs, drafts, strict=True):
        assert r.num_computed_tokens == 1 and r.num_tokens == 2
        assert r.num_tokens_with_spec == 2 + len(d)
    out = sched.schedule()
    assert len(out.scheduled_new_reqs) == 0
    assert out.total_num_scheduled_tokens == len(reqs) + sum(len(d) for d in drafts)
    assert [out.num_scheduled_tokens[r.request_id] for r in reqs] == [1 + len(d) for d in drafts]
    assert out.scheduled_spec_decode_tokens == {r.request_id: d for r, d in zip(reqs, drafts, strict=True) if d}
    outs = sched.update_from_output(out, runner_output(out, {r.request_id: s for r, s in zip(reqs, sampled, strict=True)}))
    stats = outs[0].scheduler_stats.spec_decoding_stats
    if expected is None:
        assert stats is None
    else:
        got = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
               stats.num_accepted_tokens_per_pos)
        assert got == expected


def test_spec_decoding_stats_empty_output():  # docs/scheduler-behaviour.md#spec-stats
    sched = make_scheduler(num_speculative_tokens=3)
    req = make_requests(1, num_tokens=1)[0]
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, runner_output(out, {"0": [0]}))
    sched.update_draft_token_ids({"0": [1, 2, 3]})
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {"0": [1, 2, 3]}
    outs = sched.update_from_output(out, runner_output(out, {"0": []}))
    assert outs[0].scheduler_stats.spec_decoding_stats is None
    assert req.num_computed_tokens == 5  # nothing rolled back for an empty output


def test_no_spec_tokens_scheduled_for_prefill_chunks():  # docs/scheduler-behaviour.md#spec-prefill
    sched = make_scheduler(num_speculative_tokens=3, max_num_batched_tokens=50)
    req = make_request("0", [5] * 80)
    sched.add_request(req)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 50}
    sched.update_from_output(out, runner_output(out, {"0": []}))
    sched.update_draft_token_ids({"0": [1, 2, 3]})
    assert req.spec_token_ids == []
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 30} and not out.scheduled_spec_decode_tokens
    sched.update_from_output(out, runner_output(out, {"0": [42]}))
    sched.update_draft_token_ids({"0": [1, 2, 3]})
    assert req.spec_token_ids == [1, 2, 3]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 4}
    assert out.scheduled_spec_decode_tokens == {"0": [1, 2, 3]}


def test_spec_decode_padding_of_admissions():  # docs/scheduler-behaviour.md#spec-padding
    sched = make_scheduler(num_speculative_tokens=3)
    a = make_request("a", [1] * 5)
    sched.add_request(a)
    out = sched.schedule()
    sched.update_from_output(out, runner_output(out, {"a": [9]}))
    sched.update_draft_token_ids({"a": [1, 2, 3]})
    b = make_request("b", [2])
    sched.add_request(b)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4, "b": 4}
    assert out.scheduled_spec_decode_tokens == {"a": [1, 2, 3], "b": [-1, -1, -1]}
    sched.update_from_output(out, runner_output(out, {"a": [1, 2], "b": [5]}))
    assert b.num_computed_tokens == 1 and b.output_token_ids == [5]
    assert a.num_computed_tokens == 7 and a.num_tokens == 8

    sched = make_scheduler(num_speculative_tokens=2, enable_prefix_caching=True)
    first = make_request("p", list(range(17)), max_tokens=1)
    sched.add_request(first)
    out = sched.schedule()
    sched.update_from_output(out, runner_output(out, {"p": [3]}))
    sched.schedule()  # flush the finished request
    again = make_request("q", list(range(17)))
    sched.add_request(again)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"q": 3}
    assert out.scheduled_spec_decode_tokens == {"q": [-1, -1]}
