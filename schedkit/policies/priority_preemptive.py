"""Priority scheduling with preemption: a more important request does not wait for a
less important one to finish."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from schedkit.core.hooks import Preemption
from schedkit.core.queues import KeyedQueue
from schedkit.core.request import Request
from schedkit.hookspecs import hookimpl
from schedkit.policies.common import check_bool, preempt_for_waiting, readmission_rank
from schedkit.policies.priority import priority_key

__all__ = ["PreemptivePriority"]


def readmit_first_key(req: Request) -> tuple[int, int, float, str]:
    """``(priority, readmission rank, arrival_time, request_id)``: a preempted request
    goes first among its priority class."""
    return (req.priority, readmission_rank(req), req.arrival_time, req.request_id)


class PreemptivePriority:
    """vLLM's ``priority`` order (smaller ``priority`` first, then earlier arrival, then
    request id) and victim (the largest ``(priority, arrival_time)``), plus voluntary
    preemption: at the start of each step, a waiting request that finds no free seat
    takes the place of the least important running request when its ``priority`` is
    strictly smaller (at most ``scheduler.max_voluntary_preemptions`` per step, the most
    important waiting requests first).

    Readmission: with ``readmit_first`` (the default) a preempted request, for KV
    blocks or voluntarily, waits ahead of every waiting request of its priority
    (:func:`~schedkit.policies.common.readmission_rank`), as FCFS puts it back at the
    head of the queue; under vLLM's key it would wait behind the requests of its
    priority with an earlier ``arrival_time``, which includes requests that reached the
    engine after it (``arrival_time`` is the client's clock) and were never run, while
    they evict the blocks it left in the prefix cache. ``readmit_first: false`` keeps
    vLLM's key for preempted requests too.

    Defining property: a burst of urgent requests arriving while every seat is taken by
    less urgent ones is scheduled at the next step (as far as the step's token budget,
    the KV cache and ``max_voluntary_preemptions`` allow), instead of waiting for the
    running requests to finish, which under ``priority`` alone can take their whole
    output length. Equal priorities never preempt each other, so with a single class it
    schedules exactly as ``priority`` as long as the KV cache preempts nobody (and with
    ``readmit_first: false``, always).

    Hooks: ``schedkit_create_waiting_queue``, ``schedkit_select_voluntary_preemptions``,
    ``schedkit_select_preemption_victim``.

    Args:
        readmit_first: A preempted request goes first among its priority class
            (default true); false keeps vLLM's key for it.

    Raises:
        ValueError: ``readmit_first`` is not a bool; the message names it and its value.
    """

    def __init__(self, readmit_first: bool = True) -> None:
        self.readmit_first = check_bool("readmit_first", readmit_first)

    @hookimpl
    def schedkit_create_waiting_queue(self) -> KeyedQueue:
        return KeyedQueue(readmit_first_key if self.readmit_first else priority_key)

    @hookimpl
    def schedkit_select_preemption_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=lambda r: (r.priority, r.arrival_time))

    @hookimpl
    def schedkit_select_voluntary_preemptions(self, running: Sequence[Request],
                                              waiting: Iterable[Request], max_num_running: int,
                                              max_preemptions: int) -> list[Preemption] | None:
        return preempt_for_waiting(running, waiting, max_num_running, max_preemptions,
                                   lambda r: r.priority, "priority: a more important request waits")
