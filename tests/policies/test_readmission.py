"""A request preempted for KV blocks is readmitted before the later arrivals of its class,
under every queue-ordering policy (docs/policies.md, "Readmission after a preemption").

Real scheduler, fake runner, a KV cache of four usable blocks: ``old`` and ``a`` fill
it, ``old``'s first output token needs a fifth block and the victim is ``a`` (the latest
admitted, or the largest ``(priority, arrival_time)``), then ``b`` of ``a``'s class
arrives. The clock stands still, so every request is queued at the same instant: an order
that breaks ties by when a request was last inserted would put ``a`` behind ``b``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from schedkit.core.request import Request, RequestStatus
from schedkit.core.scheduler import Scheduler
from schedkit.plugins.testing import make_request, make_scheduler, step
from schedkit.policies.aging import AgingWrapper
from schedkit.policies.common import readmission_rank
from schedkit.policies.edf import EarliestDeadlineFirst
from schedkit.policies.hrrn import HighestResponseRatio, ResidualShortestJobFirst
from schedkit.policies.lpm import LongestPrefixMatch
from schedkit.policies.mlfq import MultiLevelFeedbackQueue
from schedkit.policies.priority_preemptive import PreemptivePriority
from schedkit.policies.sjf import ShortestJobFirst
from schedkit.policies.vtc import VirtualTokenCounter
from schedkit.runners.fake import FakeRunner

from ._harness import VirtualClock

POLICIES: dict[str, tuple[str, Callable[[], list[Any]]]] = {
    "fcfs": ("fcfs", list),
    "priority": ("priority", list),
    "priority-preemptive": ("fcfs", lambda: [PreemptivePriority()]),
    "sjf": ("fcfs", lambda: [ShortestJobFirst()]),
    "sjf-aged": ("fcfs", lambda: [ShortestJobFirst(aging_rate=50.0)]),
    "sjf-max-tokens": ("fcfs", lambda: [ShortestJobFirst(use_max_tokens=True)]),
    "edf": ("fcfs", lambda: [EarliestDeadlineFirst(ttft_slo_s=5.0)]),
    "vtc": ("fcfs", lambda: [VirtualTokenCounter()]),
    "mlfq": ("fcfs", lambda: [MultiLevelFeedbackQueue()]),
    "lpm": ("fcfs", lambda: [LongestPrefixMatch()]),
    "hrrn": ("fcfs", lambda: [HighestResponseRatio()]),
    "residual-sjf": ("fcfs", lambda: [ResidualShortestJobFirst()]),
    "aging+fcfs": ("fcfs", lambda: [AgingWrapper(max_wait_s=1.0)]),
    "aging+sjf": ("fcfs", lambda: [ShortestJobFirst(), AgingWrapper(max_wait_s=1.0)]),
    "aging+priority": ("priority", lambda: [AgingWrapper(max_wait_s=1.0)]),
}


def scheduler(policy: str, plugins: list[Any], clock: VirtualClock) -> Scheduler:
    return make_scheduler(policy=policy, plugins=plugins, block_size=16, num_blocks=5, max_model_len=64,
                          clock=clock)


def preempt_a(sched: Scheduler, runner: FakeRunner, b: Request) -> Request:
    """Run ``old`` and ``a`` until ``a`` is preempted for KV blocks, then add ``b``."""
    old = make_request("old", [1] * 32, max_tokens=3, arrival_time=0.0)
    a = make_request("a", [2] * 32, max_tokens=8, arrival_time=1.0)
    sched.add_request(old)
    sched.add_request(a)
    first = step(sched, runner).scheduler_output
    assert sorted(n.req_id for n in first.scheduled_new_reqs) == ["a", "old"]
    sched.add_request(b)
    second = step(sched, runner).scheduler_output
    assert second.preempted_req_ids == {"a"}
    assert a.status is RequestStatus.PREEMPTED and b.status is RequestStatus.WAITING
    return a


def admission_order(sched: Scheduler, runner: FakeRunner, ids: set[str]) -> list[str]:
    """Step to the end; the order in which ``ids`` were (re)admitted."""
    order: list[str] = []
    while sched.has_requests():
        step(sched, runner)
        order += [r.request_id for r in sched.running if r.request_id in ids and r.request_id not in order]
    return order


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_preempted_request_is_readmitted_before_a_later_arrival_of_its_class(name):
    policy, make = POLICIES[name]
    clock = VirtualClock()
    sched, runner = scheduler(policy, make(), clock), FakeRunner()
    b = make_request("b", [3] * 32, max_tokens=8, arrival_time=2.0)
    a = preempt_a(sched, runner, b)
    assert admission_order(sched, runner, {"a", "b"}) == ["a", "b"]
    assert a.num_preemptions == 1
    assert all(r.status is RequestStatus.FINISHED_LENGTH_CAPPED for r in (a, b))


def vllm_scenario(plugins: list[Any], policy: str = "fcfs") -> list[str]:
    """``b`` reaches the engine after ``a`` was preempted but carries an earlier
    ``arrival_time`` (the client's clock), the case vLLM's key gets wrong."""
    clock = VirtualClock()
    sched, runner = scheduler(policy, plugins, clock), FakeRunner()
    b = make_request("b", [3] * 32, max_tokens=8, arrival_time=0.5)
    preempt_a(sched, runner, b)
    return admission_order(sched, runner, {"a", "b"})


def test_priority_preemptive_readmits_first_in_its_class_by_default():
    assert vllm_scenario([PreemptivePriority()]) == ["a", "b"]
    assert vllm_scenario([PreemptivePriority(readmit_first=False)]) == ["b", "a"]
    assert vllm_scenario([], "priority") == ["b", "a"]  # the built-in keeps vLLM's key


def test_a_preempted_request_does_not_pass_a_more_important_class():
    clock = VirtualClock()
    sched, runner = scheduler("fcfs", [PreemptivePriority()], clock), FakeRunner()
    urgent = make_request("b", [3] * 32, max_tokens=8, arrival_time=2.0, priority=-1)
    preempt_a(sched, runner, urgent)
    assert admission_order(sched, runner, {"a", "b"}) == ["b", "a"]


def test_sjf_readmits_before_earlier_waiting_requests_of_equal_size_only():
    # Among equal sizes the preempted request goes first; a shorter job still goes first.
    clock = VirtualClock()
    sched, runner = scheduler("fcfs", [ShortestJobFirst()], clock), FakeRunner()
    shorter = make_request("b", [3] * 16, max_tokens=8, arrival_time=2.0)
    preempt_a(sched, runner, shorter)
    assert admission_order(sched, runner, {"a", "b"}) == ["b", "a"]


def test_the_readmission_rank_reads_the_status():
    a = make_request("a", [1] * 8)
    assert readmission_rank(a) == 1
    a.status = RequestStatus.PREEMPTED
    assert readmission_rank(a) == 0
    a.status = RequestStatus.RUNNING
    assert readmission_rank(a) == 1


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_readmit_first_must_be_a_bool(value):
    with pytest.raises(ValueError, match=rf"readmit_first.*{value!r}"):
        PreemptivePriority(readmit_first=value)
