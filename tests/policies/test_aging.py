"""AgingWrapper: a hook wrapper that bounds the wait under any ordering policy."""

from __future__ import annotations

import pytest

from schedkit.config import config_from_dict
from schedkit.core.queues import KeyedQueue
from schedkit.core.request import EventType
from schedkit.engine.core import EngineCore
from schedkit.policies.aging import AgingWrapper, MaxWaitQueue
from schedkit.policies.common import LazyKeyedQueue
from schedkit.policies.sjf import ShortestJobFirst
from schedkit.runners.fake import FakeRunner

from ._harness import VirtualClock, req, run

MAX_WAIT = 0.5
SERVICE = 0.02  # one short request: two 10 ms steps, one request at a time


def starving(kind: str, until: float = 2.0) -> list:
    """One request the inner policy ranks last (a long prompt, or priority 1), queued at
    t=0 behind a short one, then a favoured short request every 18 ms."""
    n = int(until / 0.018)
    if kind == "sjf":
        victim = req("victim", 1000, t=0.0, max_tokens=2)
        return [req("s0", 10, max_tokens=2), victim] + [
            req(f"s{i}", 10, t=i * 0.018, max_tokens=2) for i in range(1, n)]
    victim = req("victim", 10, t=0.0, max_tokens=2, priority=1)
    return [req("s0", 10, max_tokens=2), victim] + [
        req(f"s{i}", 10, t=i * 0.018, max_tokens=2) for i in range(1, n)]


def test_composed_with_sjf_the_wrapper_bounds_the_wait():
    res = run(starving("sjf"), [ShortestJobFirst(), AgingWrapper(max_wait_s=MAX_WAIT)],
              max_num_seqs=1, check=True, num_blocks=128)
    assert isinstance(res.sched.waiting.policy_queue, MaxWaitQueue)
    assert isinstance(res.sched.waiting.inner, LazyKeyedQueue)
    assert MAX_WAIT < res.wait("victim") <= MAX_WAIT + SERVICE + 0.01
    assert res.sched.waiting.num_overdue_served >= 1
    alone = run(starving("sjf"), [ShortestJobFirst()], max_num_seqs=1)
    assert alone.admitted[-1] == "victim" and alone.wait("victim") > 2.0


def test_composed_with_priority_the_wrapper_bounds_the_wait():
    clock = VirtualClock()
    res = run(starving("priority"), [AgingWrapper(max_wait_s=MAX_WAIT, clock=clock)],
              clock=clock, policy="priority", max_num_seqs=1, check=True, num_blocks=128)
    assert isinstance(res.sched.waiting.inner, KeyedQueue)
    assert MAX_WAIT < res.wait("victim") <= MAX_WAIT + SERVICE + 0.01
    alone = run(starving("priority"), policy="priority", max_num_seqs=1)
    assert alone.admitted[-1] == "victim" and alone.wait("victim") > 2.0


def test_every_request_s_wait_is_bounded_and_overdue_ones_go_oldest_first():
    # Five long prompts under a stream of shorts: each is served within the bound plus
    # the service of the overdue requests ahead of it, in the order they arrived.
    reqs = starving("sjf") + [req(f"v{i}", 900 + i, t=0.1 * i, max_tokens=2) for i in range(1, 5)]
    res = run(reqs, [ShortestJobFirst(), AgingWrapper(max_wait_s=MAX_WAIT)], max_num_seqs=1)
    longs = ["victim", "v1", "v2", "v3", "v4"]
    assert [r for r in res.admitted if r in longs] == longs
    bound = MAX_WAIT + 2 * SERVICE + 0.01
    assert max(res.wait(r) for r in res.requests) <= bound


def test_the_wrapper_works_in_the_engine_with_its_observed_clock():
    config = config_from_dict({"scheduler": {"max_num_seqs": 1}, "cache": {"num_blocks": 128}})
    wrapper = AgingWrapper(max_wait_s=MAX_WAIT)
    engine = EngineCore(config, runner=FakeRunner(step_time_s=0.01),
                        extra_plugins=[ShortestJobFirst(), wrapper])
    reqs = starving("sjf")
    for r in reqs:
        engine.add_request(r, arrival_offset=r.arrival_time)
    done = {}
    while engine.has_requests():
        for group in engine.step().values():
            for out in group.outputs:
                assert out.error is None
                if out.finished:
                    done[out.request_id] = out.finish_reason
    assert len(done) == len(reqs)
    victim = next(r for r in reqs if r.request_id == "victim")
    wait = victim.first_event_time(EventType.SCHEDULED) - victim.arrival_time
    assert MAX_WAIT < wait <= MAX_WAIT + SERVICE + 0.01


def test_the_facade_calls_the_queue_hook_through_pluggy_when_wrapped():
    res = run([req("a", 8)], [AgingWrapper()], num_blocks=32)
    assert res.sched.hooks._impls["schedkit_create_waiting_queue"] is None
    assert res.admitted == ["a"]


class FlippingQueue(KeyedQueue):
    """An inner queue whose order changes between steps, as vtc's and lpm's do."""

    def __init__(self) -> None:
        self.sign = 1
        super().__init__(lambda r: self.sign * ord(r.request_id))

    def flip(self) -> None:
        self.sign = -1
        reqs = [self.pop() for _ in range(len(self))]
        for r in reqs:
            self.add(r)


def test_the_head_is_asked_again_after_a_step_even_if_the_clock_stood_still():
    clock = VirtualClock(5.0)
    wrapper = AgingWrapper(max_wait_s=MAX_WAIT, clock=clock)
    inner = FlippingQueue()
    gen = wrapper.schedkit_create_waiting_queue(clock=clock)
    next(gen)
    with pytest.raises(StopIteration) as stop:
        gen.send(inner)
    queue = stop.value.value
    a, b = req("a", 8, t=5.0), req("b", 8, t=5.0)
    queue.add(a)
    queue.add(b)
    assert queue.peek() is a
    inner.flip()
    wrapper.schedkit_on_step_end()
    assert queue.peek() is b and queue.pop() is b and list(queue) == [a]


@pytest.mark.parametrize("kwargs, name", [
    ({"max_wait_s": 0}, "max_wait_s"), ({"max_wait_s": -1.0}, "max_wait_s"),
    ({"max_wait_s": float("inf")}, "max_wait_s"), ({"max_wait_s": None}, "max_wait_s"),
    ({"clock": "monotonic"}, "clock"),
])
def test_bad_settings_name_the_setting_and_value(kwargs, name):
    with pytest.raises(ValueError, match=name):
        AgingWrapper(**kwargs)
