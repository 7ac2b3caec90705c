"""Priority scheduling (vLLM's ``priority``): smaller ``priority`` first, then earlier
arrival, then request id. The victim is the running request with the largest
``(priority, arrival_time)``; a preempted request re-enters the heap by its key, as in
vLLM: it keeps its ``arrival_time``, so it is readmitted before the requests of its
priority that arrived after it by that clock, but after those of its priority with an
earlier one, which can include requests that reached the engine after it
(``priority-preemptive`` with ``readmit_first`` puts it first in its class)."""

from __future__ import annotations

from collections.abc import Sequence

from schedkit.core.queues import KeyedQueue
from schedkit.core.request import Request
from schedkit.hookspecs import hookimpl


def priority_key(req: Request) -> tuple[int, float, str]:
    return (req.priority, req.arrival_time, req.request_id)


@hookimpl(trylast=True)
def schedkit_create_waiting_queue() -> KeyedQueue:
    return KeyedQueue(priority_key)


@hookimpl(trylast=True)
def schedkit_select_preemption_victim(running: Sequence[Request]) -> Request:
    # max() keeps the first of equal keys, as vLLM does; request_id is not a tie-breaker.
    return max(running, key=lambda r: (r.priority, r.arrival_time))
