"""A waiting queue re-ranked once per step by a key that needs the prefix cache and
the clock: the structure of ``lpm``, ``hrrn`` and ``residual-sjf``.

Ranking reads each candidate's prefix-cache hit (``get_computed_blocks``, a lookup per
request) and the time, so it cannot be a heap keyed once at ``add``: the key changes
with the cache and with every second waited. The queue re-ranks at most once per step
(the first read after the step counter moved) and looks at no more than the first
``max_rank`` requests in arrival order, the way SGLang bounds its cache-aware policies;
the rest keep arrival order behind them.
"""

from __future__ import annotations

import abc
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from schedkit.core.queues import BaseRequestQueue
from schedkit.core.request import Request
from schedkit.hookspecs import hookimpl
from schedkit.kv.kv_cache_manager import KVCacheManager
from schedkit.policies.common import (
    AgeIndex,
    PolicyClock,
    check_int,
    check_number,
    readmission_rank,
)

__all__ = ["RankKey", "RankedQueue", "StepRankedPolicy"]

RankKey = Callable[[Request, int, float], Any]
"""``key(request, cached_tokens, now)``: smaller ranks first (ties: a preempted request
first, then arrival order); ``cached_tokens`` are the prompt tokens the prefix cache
holds for it (whole blocks)."""


class RankedQueue(BaseRequestQueue):
    """Waiting requests as a ranked head followed by a FIFO tail.

    At the first read of each step (``step()`` moved) the queue re-ranks: overdue
    requests first (oldest wait first, at most ``max_rank``), then the first
    ``max_rank`` requests of the FIFO sorted by ``key``, then the rest of the FIFO.
    Between re-ranks the order only changes by the scheduler's own pops and prepends, so
    ``pop`` always returns what ``peek`` returned. Preempted and skipped requests go to
    the head, as in FCFS, and are re-ranked with the others at the next step: among
    equal keys a preempted request goes first
    (:func:`~schedkit.policies.common.readmission_rank`), then the earliest queued (a
    request keeps the place in arrival order it had when first queued).

    Args:
        kv_cache_manager: Where the prefix-cache hits are looked up.
        clock: The policy's clock (``now`` for the key, and the starvation guard).
        step: The scheduler's step count (the policy's ``schedkit_on_step_end`` counter).
        key: The rank of a candidate (:data:`RankKey`).
        max_rank: Most waiting requests ranked per step.
        max_wait_s: Requests waiting longer go first (``inf``: no guard).
    """

    def __init__(self, kv_cache_manager: KVCacheManager, clock: PolicyClock, step: Callable[[], int],
                 key: RankKey, max_rank: int, max_wait_s: float = math.inf) -> None:
        self._kv = kv_cache_manager
        self._clock = clock
        self._step = step
        self._key = key
        self.max_rank = max_rank
        self.max_wait_s = max_wait_s
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
        seq = self._seq.__getitem__
        fifo = deque(self._fifo)
        fifo.extendleft(reversed(sorted(self._head, key=lambda r: seq(id(r)))))
        now = self._clock()
        overdue: list[Request] = []
        if math.isfinite(self.max_wait_s):
            # At most max_rank per step keeps the work bounded under overload, when
            # almost everything is overdue; they are the oldest, near the front of fifo.
            overdue = self._ages.overdue(now, self.max_wait_s, limit=self.max_rank)
            for req in overdue:
                fifo.remove(req)
        n = min(self.max_rank, len(fifo))
        candidates = [fifo.popleft() for _ in range(n)]
        get, key = self._kv.get_computed_blocks, self._key
        keys = {id(r): key(r, get(r)[1], now) for r in candidates}
        candidates.sort(key=lambda r: (keys[id(r)], readmission_rank(r), seq(id(r))))
        return deque(overdue + candidates), fifo

    def _maybe_rerank(self) -> None:
        step = self._step()
        if self._ranked_at != step:
            self._ranked_at = step
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
        if self._ranked_at != self._step():
            head, fifo = self._ranked()
            return itertools.chain(head, fifo)
        return itertools.chain(list(self._head), list(self._fifo))


class StepRankedPolicy(abc.ABC):
    """The base of a policy whose waiting queue is a :class:`RankedQueue`: re-ranked once
    per step over the first ``max_rank`` waiting requests by :meth:`rank_key` (a key of
    the request, its cached prompt tokens and the time), with the starvation guard
    ``max_wait_s``. Subclasses define ``rank_key``; the hooks are here."""

    def __init__(self, max_rank: int, max_wait_s: float, clock: Callable[[], float] | None) -> None:
        self.max_rank = check_int("max_rank", max_rank, minimum=1)
        self.max_wait_s = check_number("max_wait_s", max_wait_s, strict=True, allow_inf=True)
        self.clock = PolicyClock(clock)
        self.step = 0
        self.queue: RankedQueue | None = None

    @abc.abstractmethod
    def rank_key(self, request: Request, cached_tokens: int, now: float) -> float:
        """Smaller ranks first (:data:`RankKey`)."""

    def uncached(self, request: Request, cached_tokens: int) -> int:
        """Tokens of the request the prefix cache does not hold (its prompt and, after a
        preemption, its outputs so far): what its prefill costs."""
        return max(request.num_tokens - cached_tokens, 0)

    @hookimpl
    def schedkit_create_waiting_queue(self, kv_cache_manager: KVCacheManager,
                                      clock: Callable[[], float]) -> RankedQueue:
        self.step = 0
        self.clock.bind(clock)
        self.queue = RankedQueue(kv_cache_manager, self.clock, lambda: self.step, self.rank_key,
                                 self.max_rank, self.max_wait_s)
        return self.queue

    @hookimpl
    def schedkit_on_step_end(self) -> None:
        self.step += 1

    @hookimpl
    def schedkit_on_request_finished(self, request: Request) -> None:
        if self.queue is not None:
            self.queue.forget(request)
