"""Longest prefix match first (SGLang's LPM), with a starvation guard."""

from __future__ import annotations

from collections.abc import Callable

from schedkit.core.request import Request
from schedkit.policies.ranked import StepRankedPolicy

__all__ = ["LongestPrefixMatch"]


class LongestPrefixMatch(StepRankedPolicy):
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

    A preempted request keeps its place in arrival order and is re-ranked at the next
    step, usually first: its own blocks stay in the prefix cache until they are evicted.
    Among equal hits it goes first (then arrival order), and the guard counts its wait
    from its preemption.

    Defining property: requests that share a cached prefix are served back to back,
    while the prefix is still cached, which raises the prefix-cache hit rate and
    throughput over FCFS; the guard bounds how long a non-matching request can be passed
    over: it is admitted at the first step after ``max_wait_s`` once it reaches the head.

    The guard reads ``clock`` when given in code, else the scheduler's clock handed to
    ``schedkit_create_waiting_queue``.

    Hooks: ``schedkit_create_waiting_queue`` (a :class:`~schedkit.policies.ranked.RankedQueue`
    keyed by the hit, most first),
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
        super().__init__(max_rank, max_wait_s, clock)

    def rank_key(self, request: Request, cached_tokens: int, now: float) -> float:
        return -cached_tokens
