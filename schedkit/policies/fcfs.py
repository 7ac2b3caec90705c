"""First come, first served (vLLM's ``fcfs``): FIFO admission, the newest running
request is preempted first and goes back to the head of the queue, so it is readmitted
before every waiting request."""

from __future__ import annotations

from collections.abc import Sequence

from schedkit.core.queues import FCFSQueue
from schedkit.core.request import Request
from schedkit.hookspecs import hookimpl


@hookimpl(trylast=True)
def schedkit_create_waiting_queue() -> FCFSQueue:
    return FCFSQueue()


@hookimpl(trylast=True)
def schedkit_select_preemption_victim(running: Sequence[Request]) -> Request:
    return running[-1]
