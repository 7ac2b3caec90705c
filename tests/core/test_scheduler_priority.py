"""The priority policy: vLLM's priority tests against our API (docs/scheduler-behaviour.md,
sections "Priority" and "Preemption")."""

from __future__ import annotations

from schedkit.core.request import RequestStatus
from schedkit.plugins.testing import make_request, make_requests, make_scheduler, runner_output


def _sched_order(priorities, arrivals, **kw):
    sched = make_scheduler(policy="priority", **kw)
    for r in make_requests(len(priorities), priorities=priorities, arrival_times=arrivals):
        sched.add_request(r)
    return sched, sched.schedule()


def test_priority_scheduling_basic_ordering():  # docs/scheduler-behaviour.md#priority-order
    _, out = _sched_order([2, 0, 1], [1.0, 2.0, 3.0])
    assert [r.req_id for r in out.scheduled_new_reqs] == ["1", "2", "0"]


def test_priority_scheduling_arrival_time_tiebreaker():  # docs/scheduler-behaviour.md#priority-order
    _, out = _sched_order([1, 1, 1], [3.0, 1.0, 2.0])
    assert [r.req_id for r in out.scheduled_new_reqs] == ["1", "2", "0"]


def test_priority_scheduling_mixed_priority_and_arrival():  # docs/scheduler-behaviour.md#priority-order
    _, out = _sched_order([2, 1, 1, 0], [1.0, 3.0, 2.0, 4.0])
    assert [r.req_id for r in out.scheduled_new_reqs] == ["3", "2", "1", "0"]


def test_priority_scheduling_fcfs_fallback():  # docs/scheduler-behaviour.md#priority-order
    _, out = _sched_order([1, 1, 1, 1], [4.0, 1.0, 3.0, 2.0])
    assert [r.req_id for r in out.scheduled_new_reqs] == ["1", "3", "2", "0"]


def test_priority_waiting_queue_order():  # docs/scheduler-behaviour.md#priority-waiting-order
    for prios, arrivals, first, rest in (
        ([3, 2, 0], [1.0, 2.0, 3.0], "2", ["1", "0"]),
        ([2, 2, 2], [3.0, 1.0, 2.0], "1", ["2", "0"]),
        ([3, 1, 2, 0], [1.0, 2.0, 3.0, 4.0], "3", ["1", "2", "0"]),
    ):
        sched, out = _sched_order(prios, arrivals, max_num_seqs=1)
        assert [r.req_id for r in out.scheduled_new_reqs] == [first]
        assert [r.request_id for r in sched.waiting] == rest


def test_priority_scheduling_with_limited_slots():  # docs/scheduler-behaviour.md#priority-waiting-order
    sched, out = _sched_order([3, 1, 2, 0], [1.0, 2.0, 3.0, 4.0], max_num_seqs=2,
                              max_num_batched_tokens=1000)
    assert {r.req_id for r in out.scheduled_new_reqs} == {"3", "1"}
    assert [r.request_id for r in sched.waiting] == ["2", "0"]


def test_priority_no_preemption_when_space_available():  # docs/scheduler-behaviour.md#priority-no-needless-preemption
    sched = make_scheduler(policy="priority", max_num_seqs=3, max_num_batched_tokens=200)
    for rid, arr in (("lo1", 1.0), ("lo2", 2.0)):
        sched.add_request(make_request(rid, [1] * 30, priority=5, arrival_time=arr))
    out = sched.schedule()
    sched.update_from_output(out, runner_output(out, {"lo1": [100], "lo2": [100]}))
    sched.add_request(make_request("hi1", [2] * 30, priority=0, arrival_time=3.0))
    out = sched.schedule()
    assert len(out.scheduled_new_reqs) == 1
    assert len(sched.running) == 3 and len(sched.waiting) == 0
    assert not out.preempted_req_ids


def test_priority_preemption_and_resumption_when_out_of_kv():  # docs/scheduler-behaviour.md#preempt-recompute
    sched = make_scheduler(policy="priority", max_num_seqs=2, max_num_batched_tokens=200,
                           num_blocks=5)
    low = make_request("0", [0] * 30, priority=1, arrival_time=0.0)
    sched.add_request(low)
    out = sched.schedule()
    assert len(out.scheduled_new_reqs) == 1 and len(sched.running) == 1
    sched.update_from_output(out, runner_output(out, {"0": [100]}))
    high = make_request("1", [1] * 32, priority=0, arrival_time=1.0)
    sched.add_request(high)
    out = sched.schedule()
    assert sched.kv_cache_manager.num_free_blocks == 0
    assert len(out.scheduled_new_reqs) == 1 and out.scheduled_cached_reqs.num_reqs == 1
    assert len(sched.waiting) == 0 and len(sched.running) == 2
    sched.update_from_output(out, runner_output(out, {"0": [100], "1": [100]}))
    out = sched.schedule()
    assert len(out.scheduled_new_reqs) == 0
    assert out.scheduled_cached_reqs.req_ids == ["1"]
    assert low.status is RequestStatus.PREEMPTED
    assert len(sched.waiting) == 1 and len(sched.running) == 1
    sched.update_from_output(out, runner_output(out, {"0": [], "1": [100]}))
    sched.finish_requests("1", RequestStatus.FINISHED_STOPPED)
    out = sched.schedule()
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["0"] and cached.resumed_req_ids == {"0"}
    tokens = cached.resumed_token_ids
    assert list(tokens) == ["0"] and len(tokens["0"]) == 32 and tokens["0"][31] == 100
    assert len(sched.waiting) == 0 and len(sched.running) == 1


def test_priority_victim_ahead_of_current_request():  # docs/scheduler-behaviour.md#preempt-priority-victim
    sched = make_scheduler(policy="priority", num_blocks=4, max_num_batched_tokens=200,
                           max_num_seqs=4)
    sched.add_request(make_request("X", [1] * 16, priority=5, arrival_time=0.0))
    out1 = sched.schedule()
    assert out1.num_scheduled_tokens == {"X": 16}
    sched.add_request(make_request("Y", [2] * 16, priority=0, arrival_time=1.0))
    sched.add_request(make_request("Z", [3] * 8, priority=1, arrival_time=2.0))
    out2 = sched.schedule()
    assert out2.num_scheduled_tokens == {"Y": 16, "Z": 8}
    sched.update_from_output(out2, runner_output(out2, {"Y": [7], "Z": [7]}))
    out3 = sched.schedule()
    assert out3.num_scheduled_tokens == {"Y": 1, "Z": 1}
    assert out3.preempted_req_ids == {"X"}
