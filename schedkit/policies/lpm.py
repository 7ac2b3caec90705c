"""Longest prefix match first (SGLang's LPM), with a starvation guard."""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from schedkit.core.queues import BaseRequestQueue
from schedkit.core.request import Request
from schedkit.hookspecs import hookimpl
from schedkit.kv.kv_cache_manager import KVCacheManager
from schedkit.policies.common import AgeIndex, PolicyClock, check_int, check_number

__all__ = ["LongestPrefixMatch", "LPMQueue"]


class LPMQueue(BaseRequestQueue):
    """Waiting requests as a ranked head followed by a FIFO tail.

    At the first read of each step the queue re-ranks: overdue requests first (oldest
    wait first, at most ``max_rank``), then the first ``max_rank`` requests of the FIFO sorted by prefix-cache
    hit tokens (most first, ties in arrival order), then the rest of the FIFO. Between
    re-ranks the order only changes by the scheduler's own pops and prepends, so ``pop``
    always returns what ``peek`` returned. Preempted and skipped requests go to the head,
    as in FCFS, and are re-ranked with the others at the next step.
    """

    def __init__(self, policy: LongestPrefixMatch, kv_cache_manager: KVCacheManager,
                 clock: PolicyClock) -> None:
        self._policy = policy
        self._kv = kv_cache_manager
        self._clock = clock
        self._ages = AgeIndex(clock)
        self._head: deque[Request] = deque()
        self._fifo: deque[Request] = deque()
        self._seq: dict[int, int] = {}
        self._counter = itertools.count()
        self._ranked_at = -1
        self.num_rankings = 0
        """How many times the queue re-ranked (at most once per step)."""

    # -- ranking ---------------------------------------------------------------------------
    def _ranked(self) -> tuple[deque[Request], deque[Request]]:
        """The next (head, fifo), computed without changing the queue."""
        p = self._policy
        seq = self._seq.__getitem__
        fifo = deque(self._fifo)
        fifo.extendleft(reversed(sorted(self._head, key=lambda r: seq(id(r)))))
        overdue: list[Request] = []
        if math.isfinite(p.max_wait_s):
            # At most max_rank per step keeps the work bounded under overload, when
            # almost everything is overdue; they are the oldest, near the front of fifo.
            overdue = self._ages.overdue(self._clock(), p.max_wait_s, limit=p.max_rank)
            for req in overdue:
                fifo.remove(req)
        n = min(p.max_rank, len(fifo))
        candidates = [fifo.popleft() for _ in range(n)]
        hits = {id(r): self._kv.get_computed_blocks(r)[1] for r in candidates}
        candidates.sort(key=lambda r: (-hits[id(r)], seq(id(r))))
        return deque(overdue + candidates), fifo

    def _maybe_rerank(self) -> None:
        if self._ranked_at != self._policy.step:
            self._ranked_at = self._policy.step
            self._head, self._fifo = self._ranked()
            self.num_rankings += 1

    # -- queue -------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self._seq[id(request)] = next(self._counter)
        self._fifo.append(request)
        self._ages.push(request)

    def peek(self) -> Request:
        self._maybe_rerank()
        return self._head[0] if self._head else self._fifo[0]

    def pop(self) -> Request:
        self._maybe_rerank()
        req = self._head.popleft() if self._head else self._fifo.popleft()
        self._ages.discard(req)
        return req

    def prepend_request(self, request: Request) -> None:
        self._seq.setdefault(id(request), next(self._counter))
        self._head.appendleft(request)
        self._ages.push(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r): r for r in requests}
        if not drop:
            return
        self._head = deque(r for r in self._head if id(r) not in drop)
        self._fifo = deque(r for r in self._fifo if id(r) not in drop)
        for req in drop.values():
            self._ages.discard(req)
            self._seq.pop(id(req), None)

    def forget(self, request: Request) -> None:
        """Drop the bookkeeping of a finished request."""
        self._seq.pop(id(request), None)

    def __len__(self) -> int:
        return len(self._head) + len(self._fifo)

    def __bool__(self) -> bool:
        return bool(self._head) or bool(self._fifo)

    def __iter__(self) -> Iterator[Request]:
        if self._ranked_at != self._policy.step:
            head, fifo = self._ranked()
            return itertools.chain(head, fifo)
        return itertools.chain(list(self._head), list(self._fifo))


class LongestPrefixMatch:
    """Admit first the waiting requests with the most prompt tokens already in the prefix
    cache (SGLang's longest-prefix-match policy), with a starvation guard.

    The hit length is ``kv_cache_manager.get_computed_blocks(request)[1]`` (whole cached
    blocks; it has no side effects). Ranking costs one lookup per candidate, so the queue
    re-ranks at most once per step (at the first ``peek`` after a step ended) and looks
    at no more than the first ``max_rank`` waiting requests in arrival order; the others
    stay in arrival order behind them. Requests whose current wait (since they were
    queued or last preempted) exceeds ``max_wait_s`` go before everything else, oldest
    first (at most ``max_rank`` of them are moved up per step). Needs
    ``cache.enable_prefix_caching: true`` to do anything but FCFS.

    Defining property: requests that share a cached prefix are served back to back,
    while the prefix is still cached, which raises the prefix-cache hit rate and
    throughput over FCFS; the guard bounds how long a non-matching request can be passed
    over: it is admitted at the first step after ``max_wait_s`` once it reaches the head.

    The guard reads ``clock`` when given in code, else the scheduler's clock handed to
    ``schedkit_create_waiting_queue``.

    Hooks: ``schedkit_create_waiting_queue`` (an :class:`LPMQueue`),
    ``schedkit_on_step_end`` (starts a new ranking round),
    ``schedkit_on_request_finished`` (cleanup). One plugin object serves one scheduler.

    Args:
        max_rank: Most waiting requests ranked per step (>= 1, default 128).
        max_wait_s: Starvation guard in seconds (> 0; default 10.0; ``.inf`` turns it off).
        clock: The scheduler's clock, a callable returning seconds (code only; default
            None, the scheduler's clock).

    Raises:
        ValueError: A setting is out of range; the message names it and its value.
    """

    def __init__(self, max_rank: int = 128, max_wait_s: float = 10.0,
                 clock: Callable[[], float] | None = None) -> None:
        self.max_rank = check_int("max_rank", max_rank, minimum=1)
        self.max_wait_s = check_number("max_wait_s", max_wait_s, strict=True, allow_inf=True)
        self.clock = PolicyClock(clock)
        self.step = 0
        self.queue: LPMQueue | None = None

    @hookimpl
    def schedkit_create_waiting_queue(self, kv_cache_manager: KVCacheManager,
                                      clock: Callable[[], float]) -> LPMQueue:
        self.step = 0
        self.clock.bind(clock)
        self.queue = LPMQueue(self, kv_cache_manager, self.clock)
        return self.queue

    @hookimpl
    def schedkit_on_step_end(self) -> None:
        self.step += 1

    @hookimpl
    def schedkit_on_request_finished(self, request: Request) -> None:
        if self.queue is not None:
            self.queue.forget(request)
