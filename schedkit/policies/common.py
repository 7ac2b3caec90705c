"""Pieces the research policies share: a clock for queues, wait times, the readmission
rank of preempted requests, setting checks, a lazily keyed heap and an index of waiting
requests by age.

Why a clock of their own: the scheduler calls ``peek``/``pop`` without a time, so a
queue whose order depends on time reads a :class:`PolicyClock`: a clock given in code
(``clock=``), else the scheduler's clock that ``schedkit_create_waiting_queue`` hands over
(:meth:`PolicyClock.bind`), else, for a queue built outside a scheduler, the latest time
it has seen (enqueue times of requests).

Wait times are read from request events, which the scheduler stamps with its own clock
(``arrival_time`` is the client's and may be on another clock). Everything here runs in
the engine-core process and is not thread-safe.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from schedkit.core.hooks import Preemption
from schedkit.core.queues import BaseRequestQueue, iter_heap
from schedkit.core.request import EventType, Request, RequestStatus

_QUEUED = EventType.QUEUED
_PREEMPTED = EventType.PREEMPTED
_WAITING_TO_RESUME = RequestStatus.PREEMPTED


class PolicyClock:
    """The time a policy's queue sees.

    Args:
        source: The scheduler's clock (e.g. ``EngineCore.now``); None means "the latest
            time observed", fed by :meth:`observe`.
    Raises:
        ValueError: ``source`` is neither None nor callable.
    """

    __slots__ = ("_source", "_latest")

    def __init__(self, source: Callable[[], float] | None = None) -> None:
        if source is not None and not callable(source):
            raise ValueError(f"clock must be a callable returning seconds or None, got {source!r}")
        self._source = source
        self._latest = -math.inf

    def bind(self, source: Callable[[], float]) -> None:
        """Use the scheduler's clock (handed to ``schedkit_create_waiting_queue``) unless
        a clock was given in code."""
        if self._source is None:
            self._source = source

    def observe(self, t: float) -> None:
        """Record a time seen in a hook or a request event (ignored with a source)."""
        if t > self._latest:
            self._latest = t

    def __call__(self) -> float:
        return self._source() if self._source is not None else self._latest


def enqueue_time(req: Request) -> float:
    """When the request first entered the waiting queue (scheduler clock).

    Falls back to ``arrival_time`` for a request the scheduler has not stamped yet.
    """
    for kind, t in req.events:
        if kind is _QUEUED:
            return t
    return req.arrival_time


def waiting_since(req: Request) -> float:
    """When the request's current wait began: its enqueue or its latest preemption."""
    for kind, t in reversed(req.events):
        if kind is _QUEUED or kind is _PREEMPTED:
            return t
    return req.arrival_time


def readmission_rank(req: Request) -> int:
    """0 for a request waiting to resume after a preemption, 1 for any other: the key
    component, placed after a policy's class and before its order within the class,
    that readmits a preempted request ahead of every waiting request of its class (the
    newer arrivals in particular), as FCFS puts it back at the head of the queue. A
    preempted request keeps its outputs, and its freed blocks often stay in the prefix
    cache for a while; behind newer arrivals it would wait while they evict them.

    Read when a request enters a queue (or at the queue's next read): it stays 0 while
    the request waits, and the request's next preemption makes it 0 again."""
    return 0 if req.status is _WAITING_TO_RESUME else 1


# ------------------------------------------------------------- voluntary preemption
def progress_since_resumed(req: Request) -> int:
    """Tokens a running request has computed beyond its prompt and beyond everything it
    had computed before its last preemption: its new progress since it (re)started."""
    return req.num_computed_tokens - max(req.num_prompt_tokens, req.num_computed_high)


def preempt_for_waiting(running: Sequence[Request], waiting: Iterable[Request],
                        max_num_running: int, max_preemptions: int,
                        rank: Callable[[Request], Any], reason: str,
                        min_run_tokens: int = 0) -> list[Preemption] | None:
    """The common answer of a preemptive policy to ``schedkit_select_voluntary_preemptions``:
    the waiting requests at the head of the queue that find no free seat take the places
    of the running requests ranked worst, one for one, while the waiting one ranks
    strictly better (smaller ``rank``). Running requests are taken worst first, ties to
    the latest admitted; at most ``max_preemptions``. Nobody is preempted while
    requests with a finished KV load still wait for seats (``max_num_running`` below
    ``len(running)``): they would take the seats freed. The heads are taken in the queue's
    serving order and the pairing stops at the first head that beats no one left (the
    seat would go to it first). A running request that has made fewer than
    ``min_run_tokens`` tokens of new progress (:func:`progress_since_resumed`: still
    computing its prompt, or recomputing after a preemption, counts as none) is not
    taken, so that no request pays a prefill or a recompute only to be preempted again.
    Reads only as much of ``waiting`` as it can use. None when nobody is to be
    preempted."""
    free = max_num_running - len(running)
    if free < 0:  # requests with a finished KV load take the next seats: wait for them
        return None
    heads = []
    for req in waiting:
        if free > 0:  # gets a seat without a preemption
            free -= 1
            continue
        heads.append(rank(req))
        if len(heads) >= max_preemptions:
            break
    if not heads:
        return None
    ranks = [rank(r) for r in running]
    pool = sorted((i for i, r in enumerate(running)
                   if min_run_tokens <= 0 or progress_since_resumed(r) >= min_run_tokens),
                  key=lambda i: (ranks[i], i), reverse=True)
    out = []
    for head, i in zip(heads, pool, strict=False):
        if not head < ranks[i]:
            break
        out.append(Preemption(running[i], reason))
    return out or None


# ---------------------------------------------------------------------- setting checks
def check_number(name: str, value: Any, *, minimum: float = 0.0, strict: bool = False,
                 allow_inf: bool = False) -> float:
    """A real number >= minimum (> with ``strict``), finite unless ``allow_inf``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if math.isinf(value) and not (allow_inf and value > 0):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if value < minimum or (strict and value == minimum):
        op = ">" if strict else ">="
        raise ValueError(f"{name} must be {op} {minimum}, got {value!r}")
    return float(value)


def check_int(name: str, value: Any, *, minimum: int) -> int:
    """An integer >= minimum (bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def check_positive_map(name: str, value: Any, key_type: type) -> dict[Any, float]:
    """A mapping of ``key_type`` keys to finite numbers > 0 (None means empty)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a mapping, got {value!r}")
    out: dict[Any, float] = {}
    for k, v in value.items():
        if isinstance(k, bool) or not isinstance(k, key_type):
            raise ValueError(f"{name} keys must be {key_type.__name__}, got {k!r}")
        out[k] = check_number(f"{name}[{k!r}]", v, strict=True)
    return out


# ---------------------------------------------------------------------- queues
class LazyKeyedQueue(BaseRequestQueue):
    """A min-heap on ``key(request)`` whose key is computed at the first read after an
    insert, not at the insert itself.

    The scheduler records a request's QUEUED event right *after* ``add``, so a key that
    uses the enqueue time can only be computed later. Apart from that this behaves as
    :class:`schedkit.core.queues.KeyedQueue`: "prepend" re-inserts by key, ties go to
    insertion order, iteration is in serving order and changes nothing. Removal is lazy
    (O(1); dead entries are skipped at the top and compacted away), because a wrapping
    queue such as :class:`schedkit.policies.aging.MaxWaitQueue` removes from the middle.
    """

    __slots__ = ("_heap", "_pending", "_key", "_counter", "_live")

    def __init__(self, key: Callable[[Request], Any]) -> None:
        self._heap: list[tuple[Any, int, Request]] = []
        self._pending: list[tuple[int, Request]] = []
        self._key = key
        self._counter = itertools.count()
        self._live: dict[int, int] = {}  # id(request) -> seq of its live entry

    def _flush(self) -> None:
        if self._pending:
            key, heap, live = self._key, self._heap, self._live
            for seq, req in self._pending:
                if live.get(id(req)) == seq:
                    heapq.heappush(heap, (key(req), seq, req))
            self._pending.clear()

    def _top(self) -> tuple[Any, int, Request]:
        self._flush()
        heap, live = self._heap, self._live
        while live.get(id(heap[0][2])) != heap[0][1]:
            heapq.heappop(heap)
        return heap[0]

    def add(self, request: Request) -> None:
        seq = next(self._counter)
        self._live[id(request)] = seq
        self._pending.append((seq, request))

    def prepend_request(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._top()[2]

    def pop(self) -> Request:
        req = self._top()[2]
        heapq.heappop(self._heap)
        del self._live[id(req)]
        return req

    def remove_requests(self, requests: Iterable[Request]) -> None:
        for req in requests:
            self._live.pop(id(req), None)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._flush()
            live = self._live
            self._heap = [e for e in self._heap if live.get(id(e[2])) == e[1]]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._live)


    def __iter__(self) -> Iterator[Request]:
        """Serving order, lazily: the heap walked in order, merged with the keys of the
        requests added since the last read (computed, not stored)."""
        live = self._live
        pending = sorted((self._key(r), s, r) for s, r in self._pending if live.get(id(r)) == s)
        ordered = heapq.merge(iter_heap(self._heap), pending, key=lambda e: (e[0], e[1]))
        return (e[2] for e in ordered if live.get(id(e[2])) == e[1])


class AgeIndex:
    """Waiting requests by :func:`waiting_since`, to find the overdue ones in
    O(k log n) for k overdue requests instead of scanning the whole queue.

    A heap with lazy deletion: each push gets a token, and an entry is live while its
    token is the request's current one. The wait start is read at the first query after
    a push (the QUEUED event does not exist yet at ``add`` time) and reported to the
    clock, so an observed clock never lags behind an enqueue it has seen.
    """

    __slots__ = ("_heap", "_pending", "_live", "_tokens", "_clock")

    def __init__(self, clock: PolicyClock) -> None:
        self._heap: list[tuple[float, int, Request]] = []
        self._pending: list[tuple[int, Request]] = []
        self._live: dict[int, int] = {}
        self._tokens = itertools.count()
        self._clock = clock

    def push(self, req: Request) -> None:
        tok = next(self._tokens)
        self._live[id(req)] = tok
        self._pending.append((tok, req))

    def discard(self, req: Request) -> None:
        self._live.pop(id(req), None)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._compact()

    def _compact(self) -> None:
        self._flush()
        live = self._live
        self._heap = [e for e in self._heap if live.get(id(e[2])) == e[1]]
        heapq.heapify(self._heap)

    def _flush(self) -> None:
        if self._pending:
            live, heap, observe = self._live, self._heap, self._clock.observe
            for tok, req in self._pending:
                if live.get(id(req)) == tok:
                    since = waiting_since(req)
                    observe(since)
                    heapq.heappush(heap, (since, tok, req))
            self._pending.clear()

    def overdue(self, now: float, max_wait_s: float, limit: int | None = None) -> list[Request]:
        """Live requests with ``now - since > max_wait_s``, oldest first (at most ``limit``).

        Walks the heap in order through a frontier heap of indices; only dead entries at
        the top are popped.
        """
        self._flush()
        heap, live = self._heap, self._live
        # Served requests are the oldest, so dead entries gather at the top: drop them.
        while heap and live.get(id(heap[0][2])) != heap[0][1]:
            heapq.heappop(heap)
        out: list[Request] = []
        if not heap:
            return out
        cutoff = now - max_wait_s
        frontier = [(heap[0], 0)]
        while frontier and (limit is None or len(out) < limit):
            entry, i = heapq.heappop(frontier)
            if not entry[0] < cutoff:
                break
            if live.get(id(entry[2])) == entry[1]:
                out.append(entry[2])
            for c in (2 * i + 1, 2 * i + 2):
                if c < len(heap):
                    heapq.heappush(frontier, (heap[c], c))
        return out
