"""The waiting-queue contract (docs/hooks.md, "Waiting queues"), shown on a queue whose
order moves with the clock: highest response ratio next (HRRN).

``pop`` must return what the last ``peek`` answered, however far the clock moved in
between; a queue that re-ranks in ``pop`` is corrected by the scheduler's guard, with a
logged error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

from schedkit import hookimpl
from schedkit.core.queues import BaseRequestQueue
from schedkit.core.request import Request
from schedkit.plugins.testing import make_request, make_scheduler
from schedkit.policies.common import waiting_since


class HRRNQueue(BaseRequestQueue):
    """Highest response ratio next: serve the request whose (wait + service) / service
    is highest, its service estimated from its prompt and ``max_tokens``.

    The ratio grows with the wait, so the order changes with the clock: ``peek`` ranks
    at the current time and remembers its answer, and ``pop`` returns that answer however
    far the clock moved in between. Any change to the queue forgets it.
    """

    def __init__(self, clock: Callable[[], float], tokens_per_s: float = 1000.0) -> None:
        self._clock = clock
        self._tokens_per_s = tokens_per_s
        self._reqs: list[Request] = []
        self._head: Request | None = None

    def ratio(self, req: Request, now: float) -> float:
        service_s = (req.num_prompt_tokens + req.max_tokens) / self._tokens_per_s
        return (now - waiting_since(req) + service_s) / service_s

    def add(self, request: Request) -> None:
        self._reqs.append(request)
        self._head = None

    def prepend_request(self, request: Request) -> None:
        self.add(request)  # ranked by its ratio like any other (a preemption restarts its wait)

    def peek(self) -> Request:
        now = self._clock()
        self._head = max(self._reqs, key=lambda r: self.ratio(r, now))  # ties: the first added
        return self._head

    def pop(self) -> Request:
        req = self._head if self._head is not None else self.peek()
        self._reqs = [r for r in self._reqs if r is not req]
        self._head = None
        return req

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}  # may name requests it does not hold
        self._reqs = [r for r in self._reqs if id(r) not in drop]
        self._head = None

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Request]:
        now = self._clock()
        return iter(sorted(self._reqs, key=lambda r: -self.ratio(r, now)))


class HRRN:
    @hookimpl
    def schedkit_create_waiting_queue(self, clock):
        return HRRNQueue(clock, tokens_per_s=2.0)


class RerankingPop(HRRNQueue):
    """Breaks the contract: ``pop`` ranks again, at a later time than ``peek`` did."""

    def pop(self) -> Request:
        self._head = None
        return super().pop()


class RerankingHRRN:
    @hookimpl
    def schedkit_create_waiting_queue(self, clock):
        return RerankingPop(clock, tokens_per_s=2.0)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class SlowAdmission:
    """An admission hook that takes half a second (the clock moves between the
    scheduler's ``peek`` and its ``pop``); it leaves the decision to the built-in."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    @hookimpl
    def schedkit_admit_request(self, request):
        self.clock.t += 0.5


def two_waiting(queue_plugin: object, clock: Clock, *extra: object):
    """``a`` (10 s of service) queued at 0, ``b`` (1 s) queued at 5: at 5.5 ``a`` has the
    higher ratio (1.55 against 1.5), from 5.56 on ``b`` has."""
    sched = make_scheduler(plugins=[queue_plugin, *extra], clock=clock, max_num_seqs=1)
    sched.add_request(make_request("a", [1] * 16, max_tokens=4, arrival_time=0.0))
    clock.t = 5.0
    sched.add_request(make_request("b", [2], max_tokens=1, arrival_time=5.0))
    clock.t = 5.5
    return sched


def test_hrrn_order_follows_the_clock():
    clock = Clock()
    queue = two_waiting(HRRN(), clock).waiting.policy_queue
    assert [r.request_id for r in queue] == ["a", "b"]
    clock.t = 6.0
    assert [r.request_id for r in queue] == ["b", "a"] and queue.peek().request_id == "b"


def test_pop_returns_what_peek_answered_when_the_clock_moved():
    clock = Clock()
    queue = two_waiting(HRRN(), clock).waiting.policy_queue
    assert queue.peek().request_id == "a"
    clock.t = 6.0  # b now ranks first
    assert queue.pop().request_id == "a"
    assert queue.peek().request_id == "b"


def test_the_scheduler_admits_the_peeked_head_on_a_moving_clock(caplog):
    for queue_plugin, corrected in ((HRRN(), False), (RerankingHRRN(), True)):
        clock = Clock()
        sched = two_waiting(queue_plugin, clock, SlowAdmission(clock))
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="schedkit.scheduler"):
            out = sched.schedule()
        assert [r.req_id for r in out.scheduled_new_reqs] == ["a"]
        assert ("after peeking" in caplog.text) is corrected

