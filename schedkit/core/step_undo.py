"""Undoing a scheduler step that failed part-way (a plugin raised inside ``schedule()``).

``schedule()`` runs as a transaction: the KV cache manager journals every block change,
and a :class:`StepUndo` records the scheduler's own changes before they happen (each
touched request's counters, the running list, the deferred set, finished loads taken).
``rollback`` restores all of it, so the scheduler and the KV cache (references, free
queue, prefix-cache hashes and statistics) are exactly as before the step; requests go
back to their queues in their original order. What a plugin did to its own state, or a
connector to its own, cannot be undone: plugins see the calls of the failed step.

A request that cannot be put back because its queue raises again is *lost*: rollback
returns it so the caller fails it instead of leaving it nowhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from schedkit.core.request import Request
from schedkit.errors import PluginError
from schedkit.kv.metrics import PrefixCacheStats

if TYPE_CHECKING:
    from schedkit.core.scheduler import Scheduler, StepState

log = logging.getLogger("schedkit.scheduler")

_FIELDS = ("status", "num_computed_tokens", "num_preemptions", "num_cached_tokens",
           "num_recomputed_tokens", "num_output_placeholders", "num_stale_output_tokens",
           "stale_drop", "spec_token_ids")


@dataclass(slots=True)
class StepUndo:
    """The scheduler-side journal of one ``schedule()`` call."""

    running: list[Request]
    current_step: int
    num_preemptions_total: int
    saved: dict[int, tuple[Request, tuple, int]] = field(default_factory=dict)
    """id(request) -> (request, its fields before the step, its number of events)."""
    preempted_before: set[str] | None = None
    undeferred: list[str] = field(default_factory=list)
    newly_deferred: list[str] = field(default_factory=list)
    promoted: list[tuple[str, bool, bool]] = field(default_factory=list)
    """Loads promoted: (id, was in finished_recving_ids, was in failed_recving_ids)."""
    connector_stats: PrefixCacheStats | None = None
    """The connector's lookup statistics before their first change in this step."""

    def save(self, req: Request) -> None:
        """Remember ``req``'s scheduling fields before its first change in this step."""
        key = id(req)
        if key not in self.saved:
            self.saved[key] = (req, tuple(getattr(req, f) for f in _FIELDS), len(req.events))

    def rollback(self, sched: Scheduler, st: StepState) -> list[Request]:
        """Restore the scheduler to its state before the step; returns the lost requests."""
        lost: list[Request] = []
        if st.returned:
            lost += _try(sched.kv_holding.remove_requests, st.returned)
            lost += _try(sched.waiting.remove_requests, st.returned)
        if st.preempted:
            lost += _try(sched.waiting.remove_requests, st.preempted)
        sched.kv_cache_manager.rollback()
        for req, values, num_events in self.saved.values():
            for name, value in zip(_FIELDS, values, strict=True):
                setattr(req, name, value)
            del req.events[num_events:]
        sched.running = self.running
        sched.current_step = self.current_step
        sched.num_preemptions_total = self.num_preemptions_total
        if self.preempted_before is not None:
            sched._preempted_ids = self.preempted_before
        sched.deferred_ids.update(self.undeferred)
        sched.deferred_ids.difference_update(self.newly_deferred)
        for rid, in_finished, in_failed in self.promoted:
            sched.kv_loads.restore(rid, in_finished, in_failed)
        if self.connector_stats is not None:
            sched._connector_stats = self.connector_stats
        lost = list({id(r): r for r in lost}.values())
        gone = {id(r) for r in lost}
        for req in reversed(st.popped):
            if id(req) in gone:
                continue
            try:
                sched._enqueue(req, front=True)
            except PluginError as e:
                log.error("%s; request %r cannot be put back and fails", e, req.request_id)
                lost.append(req)
                gone.add(id(req))
        return lost


def _try(method: Callable[[list[Request]], None], arg: list[Request]) -> list[Request]:
    """Call a queue method; if it raises, the requests it was given are lost."""
    try:
        method(arg)
    except PluginError as e:
        log.error("%s; its requests fail", e)
        return list(arg)
    return []
