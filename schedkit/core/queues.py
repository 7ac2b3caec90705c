"""Waiting queues. The policy plugin chooses one through ``schedkit_create_waiting_queue``.

Contract (:class:`RequestQueue`): ``add`` enqueues a new or skipped-for-good request,
``peek``/``pop`` serve the head, ``prepend_request`` puts back a preempted request, and
``prepend_requests`` puts back the requests the scheduler skipped this step so that they
come first again *in the order given*. Iteration is in serving order and does not mutate.
"""

from __future__ import annotations

import abc
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

from schedkit.core.request import Request


@runtime_checkable
class RequestQueue(Protocol):
    """What the scheduler needs from a waiting queue (engine-core process only)."""

    def add(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def prepend_request(self, request: Request) -> None: ...
    def prepend_requests(self, requests: Iterable[Request]) -> None: ...
    def remove_request(self, request: Request) -> None: ...
    def remove_requests(self, requests: Iterable[Request]) -> None: ...
    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...
    def __iter__(self) -> Iterator[Request]: ...


class BaseRequestQueue(abc.ABC):
    """A RequestQueue from its single-request operations: subclasses implement ``add``,
    ``peek``, ``pop``, ``prepend_request``, ``remove_requests``, ``__len__`` and
    ``__iter__``; the list forms and ``__bool__`` follow from them."""

    __slots__ = ()

    @abc.abstractmethod
    def add(self, request: Request) -> None: ...

    @abc.abstractmethod
    def peek(self) -> Request: ...

    @abc.abstractmethod
    def pop(self) -> Request: ...

    @abc.abstractmethod
    def prepend_request(self, request: Request) -> None: ...

    @abc.abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Put ``requests`` back so that they come first again in the order given."""
        for req in reversed(list(requests)):
            self.prepend_request(req)

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSQueue:
    """First come, first served: a deque; preempted and skipped requests go to the head."""

    __slots__ = ("_q",)

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def prepend_request(self, request: Request) -> None:
        self._q.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        self._q.extendleft(reversed(list(requests)))

    def remove_request(self, request: Request) -> None:
        self._q.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        if drop:
            self._q = deque(r for r in self._q if id(r) not in drop)

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


def iter_heap(heap: list[tuple[Any, int, Request]]) -> Iterator[tuple[Any, int, Request]]:
    """The entries of a binary min-heap of ``(key, seq, request)`` in order, lazily: the
    first k cost O(k log k) whatever the heap's size (a frontier of candidate nodes).
    The heap must not change while it is iterated."""
    if not heap:
        return
    frontier = [(heap[0][0], heap[0][1], 0)]
    n = len(heap)
    while frontier:
        _, _, i = heapq.heappop(frontier)
        yield heap[i]
        for c in (2 * i + 1, 2 * i + 2):
            if c < n:
                heapq.heappush(frontier, (heap[c][0], heap[c][1], c))


class KeyedQueue(BaseRequestQueue):
    """A binary min-heap on ``key(request)``; ``prepend`` means re-insert by key.

    Ties beyond the key are broken by insertion order, so the queue is deterministic.
    The built-in priority policy uses ``(priority, arrival_time, request_id)``.
    """

    __slots__ = ("_heap", "_key", "_counter")

    def __init__(self, key: Callable[[Request], Any]) -> None:
        self._heap: list[tuple[Any, int, Request]] = []
        self._key = key
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        entry = (self._key(request), next(self._counter), request)
        try:
            heapq.heappush(self._heap, entry)
        except BaseException:  # a key that does not compare with the others: undo the push
            self._heap = [e for e in self._heap if e is not entry]
            heapq.heapify(self._heap)
            raise

    def peek(self) -> Request:
        return self._heap[0][2]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def prepend_request(self, request: Request) -> None:
        self.add(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        if drop:
            self._heap = [e for e in self._heap if id(e[2]) not in drop]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """Serving order, lazily (reading the head costs O(1), not a sort)."""
        return (e[2] for e in iter_heap(self._heap))
