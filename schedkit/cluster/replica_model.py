"""A replica as the latency predictor replays it (:mod:`schedkit.cluster.latency`): its
queued prompts in the order its scheduler takes them, the sequence slots they hold, and
its decoding requests with the step each will end after.

The queue holds *runs* of requests alike (a request the load report lists is a run of
one; the requests past the list, a run of their mean size). A request takes one of
``max_num_seqs`` slots when it reaches the front of the runs with one free, and becomes
an *active* member: only active members compute prompt tokens, each at most a chunk per
step, in order. A member that computes its prompt's last token makes its first output
and decodes from the next step, holding its slot until its last output token.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

__all__ = ["Member", "ReplicaModel", "Run"]


@dataclass(slots=True)
class Member:
    """One queued request holding a slot."""

    left: float
    """Prompt tokens it has still to compute."""
    done: float
    """Prompt tokens computed (or found in the prefix cache)."""
    outputs: float
    """Output tokens it will make (0: not known)."""


@dataclass(slots=True)
class Run:
    """``count`` queued requests alike, waiting for a slot, in order."""

    count: int
    left: float
    """Prompt tokens each has still to compute."""
    done: float
    """Prompt tokens each has computed."""
    outputs: float
    """Output tokens each will make (0: not known)."""


@dataclass(slots=True)
class ReplicaModel:
    """The replayed replica. Counts may be fractional where a report's aggregates are."""

    context: float
    """KV positions the decoding requests hold."""
    ends: list[int] = field(default_factory=list)
    """A heap: the step after which each decoding request of known length ends."""
    endless: float = 0.0
    """Decoding requests of unknown length (they never end, and hold no slot)."""
    step_no: int = 0
    """Steps replayed so far."""
    active: list[Member] = field(default_factory=list)
    """Queued requests holding a slot, in order."""
    runs: list[Run] = field(default_factory=list)
    """Queued requests waiting for a slot, in order (``runs[first_run:]``)."""
    first_run: int = 0
    active_tokens: float = 0.0
    """Prompt tokens the active members have still to compute."""
    num_waiting: int = 0
    """Requests in the runs."""

    @property
    def decoding(self) -> float:
        return len(self.ends) + self.endless

    @property
    def num_queued(self) -> int:
        return len(self.active) + self.num_waiting

    def enqueue(self, run: Run) -> None:
        """Queue ``run`` behind everything queued."""
        if run.count > 0 and run.left > 0:
            self.runs.append(run)
            self.num_waiting += run.count

    def activate(self, member: Member) -> None:
        """A queued request that holds a slot already (running, in its prompt)."""
        self.active.append(member)
        self.active_tokens += member.left

    def admit(self, max_seqs: int) -> None:
        """Give free slots to the requests at the front of the runs."""
        free = max_seqs - len(self.ends) - len(self.active)
        runs = self.runs
        while free > 0 and self.first_run < len(runs):
            run = runs[self.first_run]
            take = min(run.count, int(free))
            if take <= 0:
                break
            for _ in range(take):
                self.activate(Member(run.left, run.done, run.outputs))
            run.count -= take
            self.num_waiting -= take
            free -= take
            if run.count == 0:
                self.first_run += 1

    def take(self, budget: float, chunk: float) -> tuple[float, int, float, float, list[Member]]:
        """One step's prompt computation: the active members in order, each at most
        ``chunk`` tokens, up to ``budget`` in all. Returns the tokens computed, the
        members touched, their attention work, the KV positions their chunks read and
        the members that finished their prompt (taken out of the queue)."""
        taken = attention = context = 0.0
        touched = 0
        finished: list[Member] = []
        active = self.active
        i = 0
        while i < len(active) and budget - taken >= 1:
            m = active[i]
            n = min(m.left, chunk, budget - taken)
            touched += 1
            attention += n * (m.done + n / 2)
            context += m.done + n
            taken += n
            m.left -= n
            m.done += n
            if m.left <= 1e-9:
                finished.append(m)
            i += 1
        if finished:
            self.active = [m for m in active if m.left > 1e-9]
        self.active_tokens = max(self.active_tokens - taken, 0.0)
        return taken, touched, attention, context, finished

    def decoded(self, num_steps: int, rows: float) -> None:
        """``num_steps`` steps of ``rows`` decodes ended: each decoding request made a
        token; those that made their last leave."""
        self.step_no += num_steps
        self.context += num_steps * rows
        ends = self.ends
        while ends and ends[0] <= self.step_no:
            self.context -= self.context / self.decoding
            heapq.heappop(ends)

    def join(self, member: Member) -> None:
        """``member`` made its first token this step: it decodes from the next."""
        if member.outputs <= 0:
            self.endless += 1
            self.context += member.done
        elif member.outputs > 1:
            heapq.heappush(self.ends, self.step_no + round(member.outputs) - 1)
            self.context += member.done
