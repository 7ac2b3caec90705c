"""Priority scheduling with preemption: a more important request does not wait for a
less important one to finish."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from schedkit.core.hooks import Preemption
from schedkit.core.queues import KeyedQueue
from schedkit.core.request import Request
from schedkit.hookspecs import hookimpl
from schedkit.policies.common import preempt_for_waiting
from schedkit.policies.priority import priority_key

__all__ = ["PreemptivePriority"]


class PreemptivePriority:
    """vLLM's ``priority`` order (smaller ``priority`` first, then earlier arrival, then
    request id) and victim (the largest ``(priority, arrival_time)``), plus voluntary
    preemption: at the start of each step, a waiting request that finds no free seat
    takes the place of the least important running request when its ``priority`` is
    strictly smaller (at most ``scheduler.max_voluntary_preemptions`` per step, the most
    important waiting requests first). The preempted request waits by its key.

    Defining property: a burst of urgent requests arriving while every seat is taken by
    less urgent ones is scheduled at the next step (as far as the step's token budget,
    the KV cache and ``max_voluntary_preemptions`` allow), instead of waiting for the
    running requests to finish, which under ``priority`` alone can take their whole
    output length. Equal priorities never preempt each other, so with a single class it
    schedules exactly as ``priority``.

    Hooks: ``schedkit_create_waiting_queue``, ``schedkit_select_voluntary_preemptions``,
    ``schedkit_select_preemption_victim``. Takes no settings.
    """

    @hookimpl
    def schedkit_create_waiting_queue(self) -> KeyedQueue:
        return KeyedQueue(priority_key)

    @hookimpl
    def schedkit_select_preemption_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=lambda r: (r.priority, r.arrival_time))

    @hookimpl
    def schedkit_select_voluntary_preemptions(self, running: Sequence[Request],
                                              waiting: Iterable[Request], max_num_running: int,
                                              max_preemptions: int) -> list[Preemption] | None:
        return preempt_for_waiting(running, waiting, max_num_running, max_preemptions,
                                   lambda r: r.priority, "priority: a more important request waits")
