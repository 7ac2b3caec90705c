"""EarliestDeadlineFirst: deadline order, and admission control for hopeless requests."""

from __future__ import annotations

import pytest

from schedkit.core.hooks import Rejection
from schedkit.core.request import EventType, RequestStatus
from schedkit.policies.edf import EarliestDeadlineFirst

from ._harness import req, run

SLO = 0.3
ONE_STEP_PER_16_TOKENS = 0.01 / 16  # the estimate that makes "admitted in time" mean TTFT <= SLO


def test_requests_are_admitted_in_deadline_order():
    edf = EarliestDeadlineFirst(ttft_slo_s=5.0, slo_by_priority={1: 1.0, 2: 3.0}, on_miss="admit")
    reqs = [req("p0", 8, t=0.0, priority=0, max_tokens=1),    # deadline 5.0
            req("p1", 8, t=0.0, priority=1, max_tokens=1),    # deadline 1.0
            req("p2", 8, t=0.0, priority=2, max_tokens=1),    # deadline 3.0
            req("p1-late", 8, t=0.0, priority=1, max_tokens=1)]  # deadline 1.0, queued later
    res = run(reqs, [edf], max_num_seqs=1)
    assert res.admitted == ["p1", "p1-late", "p2", "p0"]
    assert [edf.deadline(res.requests[r]) for r in res.admitted] == [1.0, 1.0, 3.0, 5.0]


def overload() -> list:
    """A request every 30 ms, each taking five 10 ms steps, one at a time: 1.67x overload."""
    return [req(f"r{i}", 16, t=i * 0.03, max_tokens=5) for i in range(100)]


def attainment(res) -> float:
    ok = [r for r in res.requests if res.ttft(r) is not None and res.ttft(r) <= SLO]
    return len(ok) / len(res.requests)


def test_reject_drops_hopeless_requests_and_raises_attainment_over_fcfs():
    edf = EarliestDeadlineFirst(ttft_slo_s=SLO, prefill_s_per_token=ONE_STEP_PER_16_TOKENS)
    res = run(overload(), [edf], max_num_seqs=1, check=True, num_blocks=64)
    fcfs = run(overload(), max_num_seqs=1)
    rejected = res.rejected()
    assert rejected and len(rejected) < len(res.requests)
    for rid, r in res.requests.items():
        if rid in rejected:
            assert r.status is RequestStatus.FINISHED_ABORTED and r.num_output_tokens == 0
            # Rejected only once it could no longer make its deadline.
            assert edf.is_hopeless(r, r.first_event_time(EventType.FINISHED))
        else:
            # Every admitted request was admitted in time to get its first token in time.
            assert r.first_event_time(EventType.SCHEDULED) + 0.01 <= edf.deadline(r) + 1e-9
            assert res.ttft(rid) <= SLO + 1e-9
    assert attainment(res) > 0.55  # capacity (0.6 of the load) goes to on-time requests
    assert attainment(fcfs) < 0.2  # FCFS serves everything, late, and the queue grows


def test_prefill_estimate_rejects_before_the_deadline_passes():
    # Blocker runs 0.0-0.2 s; at 0.2 s "big" has 0.1 s of slack left, but its prefill is
    # estimated at 512 tokens * 1 ms = 0.51 s, so it is rejected before its deadline.
    def reqs():
        return [req("blocker", 8, t=0.0, max_tokens=20), req("big", 512, t=0.0, max_tokens=1)]

    with_estimate = EarliestDeadlineFirst(ttft_slo_s=SLO, prefill_s_per_token=0.001)
    assert run(reqs(), [with_estimate], max_num_seqs=1).rejected() == ["big"]
    assert run(reqs(), [EarliestDeadlineFirst(ttft_slo_s=SLO)], max_num_seqs=1).rejected() == []


def test_skip_serves_late_requests_only_when_no_on_time_request_waits():
    edf = EarliestDeadlineFirst(ttft_slo_s=SLO, on_miss="skip",
                                prefill_s_per_token=ONE_STEP_PER_16_TOKENS)
    res = run(overload(), [edf], max_num_seqs=1, check=True, num_blocks=64)
    fcfs = run(overload(), max_num_seqs=1)
    assert res.rejected() == []
    assert all(r.status is RequestStatus.FINISHED_LENGTH_CAPPED for r in res.requests.values())
    assert attainment(res) > 0.55 > 0.2 > attainment(fcfs)
    # Whenever a late request was admitted, no waiting request could still be on time.
    for rid in res.admitted:
        r = res.requests[rid]
        t = r.first_event_time(EventType.SCHEDULED)
        if not edf.is_hopeless(r, t):
            continue
        for q in res.requests.values():
            waiting = q.arrival_time <= t - 0.01 and q.first_event_time(EventType.SCHEDULED) > t
            assert not (waiting and not edf.is_hopeless(q, t)), (rid, q.request_id, t)


def test_a_preempted_request_is_never_refused():
    edf = EarliestDeadlineFirst(ttft_slo_s=SLO)
    r = req("resumed", 16, t=0.0)
    answer = edf.schedkit_admit_request(request=r, now=10.0)
    assert isinstance(answer, Rejection)
    assert answer.reason == ("its TTFT deadline cannot be met: SLO 0.3 s, waited 10.000 s, "
                             "estimated prefill 0.000 s for 16 prompt tokens")
    r.status = RequestStatus.PREEMPTED
    assert edf.schedkit_admit_request(request=r, now=10.0) is None


def test_on_time_requests_get_no_opinion_so_other_plugins_decide():
    edf = EarliestDeadlineFirst(ttft_slo_s=SLO, on_miss="skip")
    assert edf.schedkit_admit_request(request=req("x", 8, t=0.0), now=0.1) is None
    assert EarliestDeadlineFirst(ttft_slo_s=SLO, on_miss="admit").schedkit_admit_request(
        request=req("y", 8, t=0.0), now=99.0) is None


@pytest.mark.parametrize("kwargs, name", [
    ({"ttft_slo_s": 0}, "ttft_slo_s"), ({"ttft_slo_s": -1.0}, "ttft_slo_s"),
    ({"ttft_slo_s": float("nan")}, "ttft_slo_s"), ({"ttft_slo_s": "1s"}, "ttft_slo_s"),
    ({"slo_by_priority": {"high": 1.0}}, "slo_by_priority"),
    ({"slo_by_priority": {0: 0.0}}, "slo_by_priority"),
    ({"slo_by_priority": [1.0]}, "slo_by_priority"),
    ({"on_miss": "drop"}, "on_miss"), ({"on_miss": "defer"}, "on_miss"),
    ({"prefill_s_per_token": -0.1}, "prefill_s_per_token"),
])
def test_bad_settings_name_the_setting_and_value(kwargs, name):
    with pytest.raises(ValueError, match=name):
        EarliestDeadlineFirst(**kwargs)
