"""One ``schedule()`` call's working state (:class:`StepState`) and its undo journal
(:class:`StepUndo`), for a step that fails part-way (a plugin raised inside it).

``schedule()`` runs as a transaction: the KV cache manager journals every block change,
and a :class:`StepUndo` records the scheduler's own changes before they happen (each
touched request's counters, the running list, the skipped set, finished loads taken).
``Scheduler._rollback`` restores all of it, so the scheduler and the KV cache (references, free
queue, prefix-cache hashes and statistics) are exactly as before the step; requests go
back to their queues in their original order. What a plugin did to its own state, or a
connector to its own, cannot be undone: plugins see the calls of the failed step.

A request that cannot be put back because its queue raises again is *lost*: the rollback
returns it so the caller fails it instead of leaving it nowhere.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from schedkit.core.request import Request
from schedkit.kv.metrics import PrefixCacheStats

UNDO_FIELDS = ("status", "num_computed_tokens", "num_preemptions", "num_cached_tokens",
               "num_recomputed_tokens", "num_computed_high", "num_unconfirmed_high",
               "num_output_placeholders", "num_stale_output_tokens", "stale_drop", "spec_token_ids")
"""The request fields ``schedule()`` may change (a failed step restores them)."""


@dataclass(slots=True)
class StepUndo:
    """The scheduler-side journal of one ``schedule()`` call."""

    num_running: int
    """Length of the running list at ``begin``: admissions only append to it."""
    current_step: int
    num_preemptions_total: int
    running: list[Request] | None = None
    """The running list before the step's first preemption removed from it."""
    voluntary: Counter[str] | None = None
    """The scheduler's voluntary-preemption counts before the step's first one."""
    saved: dict[int, tuple[Request, tuple, int]] = field(default_factory=dict)
    """id(request) -> (request, its fields before the step, its number of events)."""
    preempted_before: set[str] | None = None
    unskipped: list[str] = field(default_factory=list)
    newly_skipped: list[str] = field(default_factory=list)
    promoted: list[tuple[str, bool, bool]] = field(default_factory=list)
    """Loads promoted: (id, was in finished_recving_ids, was in failed_recving_ids)."""
    connector_stats: PrefixCacheStats | None = None
    """The connector's lookup statistics before their first change in this step."""

    def save(self, req: Request) -> None:
        """Remember ``req``'s scheduling fields before its first change in this step."""
        key = id(req)
        if key not in self.saved:
            self.saved[key] = (req, tuple(getattr(req, f) for f in UNDO_FIELDS), len(req.events))


@dataclass(slots=True)
class StepState:
    """Everything one schedule() call decides, before it becomes a SchedulerOutput."""

    budget: int
    threshold: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    running_reqs: list[Request] = field(default_factory=list)
    running_new_blocks: list[list[int]] = field(default_factory=list)
    new_reqs: list[Request] = field(default_factory=list)
    resumed_reqs: list[Request] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    """Preempted for KV blocks this step (no admissions then, as in vLLM)."""
    preempted_on_purpose: list[Request] = field(default_factory=list)
    """Preempted by ``schedkit_select_voluntary_preemptions`` at the start of the step."""
    popped: list[Request] = field(default_factory=list)
    returned: list[Request] = field(default_factory=list)
    """Skipped requests already put back in the queue at the end of the waiting phase."""
    loads_started: list[Request] = field(default_factory=list)
    """Requests whose asynchronous KV load began this step (they hold blocks now)."""
    rejected: list[Request] = field(default_factory=list)
    has_running_prefill: bool = False
    undo: StepUndo = field(default_factory=lambda: StepUndo(0, 0, 0))
    """What rollback needs to restore."""
