"""Prefix-cache statistics (docs/scheduler-behaviour.md#prefix-stats)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups recorded during one scheduler step.

    Recorded once per successful admission (or async-load start) of a request that did
    a prefix lookup; never for failed admissions.

    Attributes:
        requests: Requests never preempted before this admission.
        queries: Their tokens looked up (all tokens of the request).
        hits: Their tokens found in the prefix cache.
        preempted_requests: Re-admissions of preempted requests.
        preempted_queries: Their tokens looked up.
        preempted_hits: Their tokens found.
        reset: True when the prefix cache was reset during the step.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    reset: bool = False

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Add one request's lookup to the preempted or the regular counters."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    def add(self, other: PrefixCacheStats) -> None:
        """Accumulate ``other``'s counters (the reset flag is OR-ed)."""
        self.requests += other.requests
        self.queries += other.queries
        self.hits += other.hits
        self.preempted_requests += other.preempted_requests
        self.preempted_queries += other.preempted_queries
        self.preempted_hits += other.preempted_hits
        self.reset = self.reset or other.reset

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` over regular and preempted requests (0 without queries)."""
        queries = self.queries + self.preempted_queries
        return (self.hits + self.preempted_hits) / queries if queries else 0.0


class CachingMetrics:
    """Hit rate over a sliding window of the most recent requests (front-end side).

    Each observed step's (requests, queries, hits) is one window entry. Updates with 0
    requests are ignored; a ``reset`` flag clears the window first; the oldest entries
    are dropped while the window holds more than ``max_recent_requests`` requests, but
    the newest entry is always kept.
    """

    __slots__ = (
        "max_recent_requests",
        "aggregated_requests",
        "aggregated_query_total",
        "aggregated_query_hit",
        "_queue",
    )

    def __init__(self, max_recent_requests: int = 1000) -> None:
        """Create an empty window holding about ``max_recent_requests`` requests."""
        self.max_recent_requests = max_recent_requests
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0
        self._queue: deque[tuple[int, int, int]] = deque()

    def observe(self, stats: PrefixCacheStats) -> None:
        """Add one step's regular (non-preempted) counters to the window."""
        if stats.reset:
            self.reset()
        if stats.requests == 0:
            return
        self._queue.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_query_total += stats.queries
        self.aggregated_query_hit += stats.hits
        while len(self._queue) > 1 and self.aggregated_requests > self.max_recent_requests:
            requests, queries, hits = self._queue.popleft()
            self.aggregated_requests -= requests
            self.aggregated_query_total -= queries
            self.aggregated_query_hit -= hits

    def reset(self) -> None:
        """Empty the window."""
        self._queue.clear()
        self.aggregated_requests = 0
        self.aggregated_query_total = 0
        self.aggregated_query_hit = 0

    @property
    def empty(self) -> bool:
        """True when no request is in the window."""
        return not self._queue

    @property
    def num_entries(self) -> int:
        """Number of observed steps in the window."""
        return len(self._queue)

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` over the window (0 without queries)."""
        if self.aggregated_query_total == 0:
            return 0.0
        return self.aggregated_query_hit / self.aggregated_query_total
