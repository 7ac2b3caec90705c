"""Shortest job first, with linear aging so that long jobs cannot starve."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from schedkit.core.hooks import Preemption
from schedkit.core.request import Request
from schedkit.hookspecs import hookimpl
from schedkit.policies.common import (
    LazyKeyedQueue,
    check_bool,
    check_int,
    check_number,
    enqueue_time,
    preempt_for_waiting,
    readmission_rank,
)

__all__ = ["ShortestJobFirst"]


class ShortestJobFirst:
    """Admit the waiting request with the smallest job size, less an aging credit.

    The job size is the prompt length (``num_prompt_tokens``) or, with ``use_max_tokens``,
    the predicted output length, for which the request's ``sampling_params.max_tokens``
    is used (requests carry no other prediction). A request that has waited ``w``
    seconds since it entered the queue ranks as if its job were ``aging_rate * w``
    tokens smaller. A preempted request keeps its size and its credit (its wait counts
    from when it was first queued), and among requests of equal rank it goes first
    (:func:`~schedkit.policies.common.readmission_rank`): it is readmitted before every
    later arrival of its size, and before the earlier ones still waiting.

    Defining property: among requests waiting together, smaller jobs are admitted first,
    which lowers mean TTFT against FCFS when lengths are mixed. With ``aging_rate > 0``
    nothing starves: once a request of size ``s`` has waited ``(s - s_min) / aging_rate``
    seconds, no request that arrives later (size >= ``s_min``) is admitted before it.
    With ``aging_rate = 0`` a long prompt starves under a steady stream of short ones.

    Why the queue is a heap although ranks change over time: the rank
    ``size - aging_rate * (now - t_enqueue)`` differs from ``size + aging_rate *
    t_enqueue`` by the same ``aging_rate * now`` for every request, so the order never
    changes while requests wait; only the enqueue time must be known. That time is the
    request's QUEUED event (scheduler clock), which exists only after ``add``, so keys are
    computed lazily at the next ``peek``/``pop`` (:class:`LazyKeyedQueue`). Ties go to a
    preempted request, then to the earlier enqueue, then to insertion order.

    Preemptive (``preemptive: true``, shortest remaining processing time, SRPT): the size
    is what is left of the job, ``max_tokens`` less the tokens generated with
    ``use_max_tokens`` (an oracle of output lengths, exact in the simulator), and at the
    start of each step a waiting request that finds no free seat preempts the running
    request with the largest remaining size when its own is smaller (at most
    ``scheduler.max_voluntary_preemptions`` per step); a preempted request waits by its
    remaining size. Without ``use_max_tokens`` the size is the prompt length, which a
    running request does not shrink. A request is not preempted before it made
    ``min_run_tokens`` of new progress since it (re)started. The waiting heads are taken
    in the queue's order, aging credit included, and the pairing stops at the first head
    smaller than no running job.

    Hooks: ``schedkit_create_waiting_queue``, and with ``preemptive``
    ``schedkit_select_voluntary_preemptions``; victim choice and the rest fall back to
    the built-ins (``fcfs``: the latest admitted request is preempted).

    Args:
        aging_rate: Tokens of credit per second waited (finite, >= 0; default 0 = pure
            SJF).
        use_max_tokens: Order by ``sampling_params.max_tokens`` instead of prompt length
            (default false).
        preemptive: Preempt running requests with a larger remaining size (SRPT,
            default false).
        min_run_tokens: With ``preemptive``: new tokens a running request must have
            computed since it (re)started before it may be preempted (>= 0, default 0):
            with few seats it stops a long job being preempted after every recompute;
            with many, the lab measured more preemptions with it (docs/policies.md).

    Raises:
        ValueError: A setting is out of range; the message names it and its value.
    """

    def __init__(self, aging_rate: float = 0.0, use_max_tokens: bool = False,
                 preemptive: bool = False, min_run_tokens: int = 0) -> None:
        self.aging_rate = check_number("aging_rate", aging_rate)
        self.use_max_tokens = check_bool("use_max_tokens", use_max_tokens)
        self.preemptive = check_bool("preemptive", preemptive)
        self.min_run_tokens = check_int("min_run_tokens", min_run_tokens, minimum=0)
        self._t0: float | None = None

    def job_size(self, request: Request) -> int:
        """Prompt tokens, or the output-length prediction with ``use_max_tokens`` (less
        the tokens generated when ``preemptive``)."""
        if self.use_max_tokens:
            size = request.sampling_params.max_tokens
            return size - request.num_output_tokens if self.preemptive else size
        return request.num_prompt_tokens

    def sort_key(self, request: Request) -> tuple[float, int, float]:
        """``(size + aging_rate * (t_enqueue - t0), readmission rank, t_enqueue)``; t0
        keeps floats small."""
        t = enqueue_time(request)
        if self._t0 is None or not math.isfinite(self._t0):
            self._t0 = t
        return (self.job_size(request) + self.aging_rate * (t - self._t0), readmission_rank(request), t)

    @hookimpl
    def schedkit_create_waiting_queue(self) -> LazyKeyedQueue:
        self._t0 = None
        return LazyKeyedQueue(self.sort_key)

    @hookimpl
    def schedkit_select_voluntary_preemptions(self, running: Sequence[Request],
                                              waiting: Iterable[Request], max_num_running: int,
                                              max_preemptions: int) -> list[Preemption] | None:
        if not self.preemptive:
            return None
        return preempt_for_waiting(running, waiting, max_num_running, max_preemptions,
                                   self.job_size, "srpt: a shorter job waits", self.min_run_tokens)
