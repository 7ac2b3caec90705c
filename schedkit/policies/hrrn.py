"""Size-based orders that see the prefix cache: highest response ratio next (SGLang's
HRRN) and residual shortest job first with aging."""

from __future__ import annotations

from collections.abc import Callable

from schedkit.core.request import Request
from schedkit.policies.common import check_number, enqueue_time
from schedkit.policies.ranked import StepRankedPolicy

__all__ = ["HighestResponseRatio", "ResidualShortestJobFirst", "expected_output"]


def expected_output(request: Request) -> int:
    """The output tokens a request is expected to still produce: its client's
    ``hints.expected_output_tokens`` when given (capped by ``max_tokens``), else
    ``max_tokens``, less what it generated."""
    hint = request.hints.expected_output_tokens
    total = request.max_tokens if hint is None else min(hint, request.max_tokens)
    return max(total - request.num_output_tokens, 0)


class HighestResponseRatio(StepRankedPolicy):
    """Admit first the waiting request with the highest response ratio ``(W + S) / S``,
    ``W`` the time it has waited since it was first queued and ``S`` its service: its
    uncached prompt tokens (the prefill it still needs), plus ``output_weight`` times its
    expected remaining output (:func:`expected_output`; 0 by default, as SGLang's HRRN
    counts the uncached input alone).

    ``(W + S) / S = 1 + W / S`` and ``S`` is in tokens for every request, so the order is
    that of ``W / S`` whatever a token costs in seconds: no rate to calibrate.
    Defining property: like SJF it serves short (and well-cached) prompts first, but a
    long request's ratio grows with its wait until it passes every newer one, so nothing
    starves; a preempted request keeps its first queueing time, so it returns ahead of
    the requests that arrived after it with the same service (its blocks that are still
    in the prefix cache do not count in it; its outputs so far do), and goes first among
    equal ratios. The guard ``max_wait_s`` counts the current wait, which a preemption
    restarts. SGLang reports mean TTFT -69% and p90 -81%
    against FCFS on production traffic.

    The queue re-ranks once per step over the first ``max_rank`` waiting requests in
    arrival order (SGLang's bound is 128), one prefix-cache lookup each; the rest wait
    in arrival order. Requests waiting over ``max_wait_s`` go first (off by default: the
    ratio ages by itself).

    Hooks: ``schedkit_create_waiting_queue``, ``schedkit_on_step_end``,
    ``schedkit_on_request_finished``.

    Args:
        output_weight: Weight of the expected remaining output in ``S`` (>= 0, default 0).
        max_rank: Most waiting requests ranked per step (>= 1, default 128).
        max_wait_s: Starvation guard in seconds (> 0; default ``.inf``, off).
        clock: The scheduler's clock (code only; default None, the scheduler's).

    Raises:
        ValueError: A setting is out of range; the message names it and its value.
    """

    def __init__(self, output_weight: float = 0.0, max_rank: int = 128, max_wait_s: float = float("inf"),
                 clock: Callable[[], float] | None = None) -> None:
        super().__init__(max_rank, max_wait_s, clock)
        self.output_weight = check_number("output_weight", output_weight)

    def service(self, request: Request, cached_tokens: int) -> float:
        """``S``: uncached tokens plus weighted expected output, at least 1."""
        return max(self.uncached(request, cached_tokens) + self.output_weight * expected_output(request), 1.0)

    def rank_key(self, request: Request, cached_tokens: int, now: float) -> float:
        wait = max(now - enqueue_time(request), 0.0)
        return -wait / self.service(request, cached_tokens)


class ResidualShortestJobFirst(StepRankedPolicy):
    """Admit first the waiting request with the least work left, less an aging credit:
    its uncached tokens (the prefix cache's hits do not count) plus ``output_weight``
    times its expected remaining output (:func:`expected_output`: the client's
    ``expected_output_tokens`` hint, else ``max_tokens``), minus ``aging_rate`` tokens
    per second it has waited since it was first queued.

    Defining property: a request whose prompt is mostly cached ranks by what is left to
    compute, not by its length (plain ``sjf`` ranks by the whole prompt), and a
    preempted request ranks by what remains (its aging credit counts from when it was
    first queued; among equal ranks it goes first); with ``aging_rate > 0`` a long request's
    rank falls with its wait, and past ``max_wait_s`` it goes first anyway.

    Hooks and ranking bound as :class:`HighestResponseRatio`.

    Args:
        output_weight: Weight of the expected remaining output (>= 0, default 1).
        aging_rate: Tokens of credit per second waited (>= 0, default 0).
        max_rank: Most waiting requests ranked per step (>= 1, default 128).
        max_wait_s: Starvation guard in seconds (> 0; default 10.0; ``.inf`` turns it off).
        clock: The scheduler's clock (code only; default None, the scheduler's).

    Raises:
        ValueError: A setting is out of range; the message names it and its value.
    """

    def __init__(self, output_weight: float = 1.0, aging_rate: float = 0.0, max_rank: int = 128,
                 max_wait_s: float = 10.0, clock: Callable[[], float] | None = None) -> None:
        super().__init__(max_rank, max_wait_s, clock)
        self.output_weight = check_number("output_weight", output_weight)
        self.aging_rate = check_number("aging_rate", aging_rate)

    def rank_key(self, request: Request, cached_tokens: int, now: float) -> float:
        size = self.uncached(request, cached_tokens) + self.output_weight * expected_output(request)
        return size - self.aging_rate * max(now - enqueue_time(request), 0.0)
