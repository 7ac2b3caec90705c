"""A max-wait guard that composes with any ordering policy (a pluggy hook wrapper)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

from schedkit.core.queues import BaseRequestQueue, RequestQueue
from schedkit.core.request import Request
from schedkit.hookspecs import hookimpl
from schedkit.policies.common import AgeIndex, PolicyClock, check_number

__all__ = ["AgingWrapper", "MaxWaitQueue"]


class MaxWaitQueue(BaseRequestQueue):
    """Wraps another waiting queue: a request whose current wait exceeds ``max_wait_s``
    is served before everything else (oldest wait first), otherwise the inner order.

    ``peek`` remembers its answer, and ``pop`` returns it unless the queue changed in
    between, so the pair stays consistent even on a wall clock that moves between them.
    An overdue request is taken out of the inner queue with ``remove_request``.
    """

    def __init__(self, inner: RequestQueue, clock: PolicyClock, max_wait_s: float) -> None:
        self.inner = inner
        self._clock = clock
        self._max_wait_s = max_wait_s
        self._ages = AgeIndex(clock)
        self._version = 0
        self._head: Request | None = None
        self._head_overdue = False
        self._head_version = -1
        self._head_time = 0.0
        self.num_overdue_served = 0
        """Requests served ahead of the inner order because they waited too long."""

    def _changed(self) -> None:
        self._version += 1

    def invalidate(self) -> None:
        """Forget the remembered head: the inner order may have changed (a step ended)."""
        self._changed()

    def _compute_head(self) -> None:
        now = self._clock()
        overdue = self._ages.overdue(now, self._max_wait_s, limit=1)
        if overdue:
            self._head, self._head_overdue = overdue[0], True
        else:
            self._head, self._head_overdue = self.inner.peek(), False
        self._head_version, self._head_time = self._version, now

    def add(self, request: Request) -> None:
        self.inner.add(request)
        self._ages.push(request)
        self._changed()

    def peek(self) -> Request:
        if self._head_version != self._version or self._head_time != self._clock():
            self._compute_head()
        assert self._head is not None
        return self._head

    def pop(self) -> Request:
        if self._head_version != self._version:
            self._compute_head()
        req = self._head
        assert req is not None
        if self._head_overdue:
            self.inner.remove_request(req)
            self.num_overdue_served += 1
        else:
            popped = self.inner.pop()
            assert popped is req, (popped, req)
        self._ages.discard(req)
        self._changed()
        return req

    def prepend_request(self, request: Request) -> None:
        self.inner.prepend_request(request)
        self._ages.push(request)
        self._changed()

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        requests = list(requests)
        self.inner.prepend_requests(requests)
        for req in requests:
            self._ages.push(req)
        self._changed()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        requests = list(requests)
        self.inner.remove_requests(requests)
        for req in requests:
            self._ages.discard(req)
        self._changed()

    def __len__(self) -> int:
        return len(self.inner)

    def __bool__(self) -> bool:
        return len(self.inner) > 0

    def __iter__(self) -> Iterator[Request]:
        overdue = self._ages.overdue(self._clock(), self._max_wait_s)
        first = {id(r) for r in overdue}
        return itertools.chain(overdue, (r for r in self.inner if id(r) not in first))


class AgingWrapper:
    """Bound the wait of every request, whatever policy orders the queue.

    A new-style pluggy hook wrapper around ``schedkit_create_waiting_queue``: it lets the
    ordering policy (``fcfs``, ``priority``, ``sjf``, ``vtc``, any plugin) build its queue,
    then wraps it in a :class:`MaxWaitQueue`. A request whose current wait (since it was
    queued or last preempted) exceeds ``max_wait_s`` is served before everything else,
    oldest first; otherwise the inner policy's order stands. schedkit's facade calls a
    hook through pluggy as soon as one implementation is a wrapper, so this works with
    any inner policy.

    A preempted request is placed by the inner policy (see its readmission rule), and
    its current wait starts at its preemption: a request of its class that arrived after
    it but is overdue goes before it. The overdue requests are the guard's own class,
    served ahead of every inner one; counting a victim's wait from its arrival would
    make every victim older than ``max_wait_s`` overdue at once, ahead of the requests
    the inner policy ranks first (under ``priority``, those whose growth preempted it).

    Defining property: no request waits much longer than ``max_wait_s`` before it reaches
    the head of the queue, even under a policy that would starve it (SJF without aging,
    strict priority). Admission stays head-of-line, so an overdue request still waits for
    running slots and KV blocks, and requests overdue together are served in wait order:
    the bound is ``max_wait_s`` plus the time to serve those.

    The guard reads ``clock`` when given in code, else the scheduler's clock handed to
    ``schedkit_create_waiting_queue``.

    Hooks: ``schedkit_create_waiting_queue`` (``wrapper=True``) and
    ``schedkit_on_step_end`` (makes the queue ask the inner queue for its head again).

    Args:
        max_wait_s: The longest wait, in seconds, before a request jumps the queue
            (> 0, default 30.0).
        clock: The scheduler's clock, a callable returning seconds (code only; default
            None, the scheduler's clock).

    Raises:
        ValueError: A setting is out of range; the message names it and its value.
    """

    def __init__(self, max_wait_s: float = 30.0, clock: Callable[[], float] | None = None) -> None:
        self.max_wait_s = check_number("max_wait_s", max_wait_s, strict=True)
        self.clock = PolicyClock(clock)
        self.queue: MaxWaitQueue | None = None

    @hookimpl(wrapper=True)
    def schedkit_create_waiting_queue(self, clock: Callable[[], float]) -> Generator[None, Any, Any]:
        inner = yield
        if inner is None:
            return None
        self.clock.bind(clock)
        self.queue = MaxWaitQueue(inner, self.clock, self.max_wait_s)
        return self.queue

    @hookimpl
    def schedkit_on_step_end(self) -> None:
        if self.queue is not None:
            self.queue.invalidate()  # inner queues may re-rank between steps (vtc, lpm)
