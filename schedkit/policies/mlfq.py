"""Multi-level feedback queue with skip-join (FastServe, Wu et al. 2023)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

from schedkit.core.hooks import Preemption
from schedkit.core.outputs import EngineCoreOutputs
from schedkit.core.queues import BaseRequestQueue
from schedkit.core.request import Request
from schedkit.hookspecs import hookimpl
from schedkit.policies.common import (
    AgeIndex,
    PolicyClock,
    check_int,
    check_number,
    preempt_for_waiting,
)

__all__ = ["MultiLevelFeedbackQueue", "LevelQueue"]


class LevelQueue(BaseRequestQueue):
    """One FIFO per level; ``peek``/``pop`` serve the highest (lowest-numbered) non-empty
    level. A request is queued at the tail of its current level; one preempted for KV
    blocks goes to the head of that level, as FCFS does. ``ages`` indexes the waiting
    requests by the start of their current wait, for the starvation bound."""

    def __init__(self, policy: MultiLevelFeedbackQueue) -> None:
        self._policy = policy
        self._levels: list[deque[Request]] = [deque() for _ in range(policy.num_levels)]
        self._len = 0
        self.ages = AgeIndex(PolicyClock())

    def _top(self) -> deque[Request]:
        for q in self._levels:
            if q:
                return q
        raise IndexError("peek from an empty queue")

    def add(self, request: Request) -> None:
        level = self._policy.admit_level(request)
        self._levels[level].append(request)
        self._len += 1
        if level:  # only a request below level 0 can be promoted
            self.ages.push(request)

    def peek(self) -> Request:
        return self._top()[0]

    def pop(self) -> Request:
        req = self._top().popleft()
        self._len -= 1
        self.ages.discard(req)
        return req

    def prepend_request(self, request: Request) -> None:
        level = self._policy.level_of(request)
        self._levels[level].appendleft(request)
        self._len += 1
        if level:
            self.ages.push(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        for i, q in enumerate(self._levels):
            if any(id(r) in drop for r in q):
                kept = deque(r for r in q if id(r) not in drop)
                self._len -= len(q) - len(kept)
                self._levels[i] = kept
        for r in requests:
            self.ages.discard(r)

    def promote(self, request: Request) -> None:
        """Move a waiting request to the head of level 0 (its level is already 0)."""
        self.ages.discard(request)
        for i, q in enumerate(self._levels):
            if i and request in q:
                q.remove(request)
                self._levels[0].appendleft(request)
                return

    def __len__(self) -> int:
        return self._len


    def __iter__(self) -> Iterator[Request]:
        return (r for q in self._levels for r in q)


class MultiLevelFeedbackQueue:
    """FastServe's skip-join multi-level feedback queue, counted in output tokens.

    Level ``i`` (0 is served first) has a quantum of ``base_quantum * quantum_growth**i``
    output tokens. Skip-join: a new request joins the highest level whose quantum covers
    its prefill, counted as ``ceil(num_prompt_tokens / prefill_tokens_per_step)`` decode
    steps, so a long prompt skips the top levels instead of being demoted through them.
    A request that has generated its level's quantum of output tokens since joining the
    level is demoted one level (accounting in ``schedkit_on_step_end``); the last level
    keeps it. The waiting queue serves the highest non-empty level, FCFS within a level.
    A request preempted for KV blocks goes back to the head of its level, so it is
    readmitted before every later arrival of its level; one preempted voluntarily (for
    a request in a higher level) is queued with ``add`` and joins the tail of its level,
    behind the requests of its level that waited while it ran.

    Preemptive, as FastServe: at the start of each step
    (``schedkit_select_voluntary_preemptions``), when the seats are taken, each waiting
    request at the head of the queue (beyond the seats free anyway) that sits in a
    higher level than the most demoted running request takes its place: that running
    request is preempted (recompute, or a load of its KV if a connector keeps it) and
    waits at its level. At most ``scheduler.max_voluntary_preemptions`` per step. The
    KV-pressure victim is the running request in the lowest level, ties to the latest
    admitted.

    Starvation bound: a request waiting longer than ``starvation_s`` (since it was
    queued or last preempted) is promoted to the head of level 0 with a fresh quantum,
    as in FastServe, so it gets the next seat that frees up and, being in the top level,
    cannot be preempted before it has used that quantum. Promotion runs at every step's
    end (``schedkit_on_step_end``), with or without ``preemptive`` and whatever
    ``max_voluntary_preemptions`` is; a request already in level 0 is never promoted
    (it is served in arrival order among level 0). ``starvation_s: .inf`` turns it off:
    with ``preemptive: false`` too, mlfq is then the non-preemptive policy it was.

    Defining property: with room in the KV cache, a short job arriving behind long ones
    starts at once and finishes within its quanta, while long jobs sink to low levels and
    yield to it; without ``preemptive`` (or with ``max_voluntary_preemptions: 0``) the
    policy acts only through the order of waiting requests and the KV-pressure victim,
    and with an ample KV cache it then schedules exactly as FCFS.

    Hooks: ``schedkit_create_waiting_queue`` (a :class:`LevelQueue`),
    ``schedkit_select_voluntary_preemptions`` (preemption and starvation promotion),
    ``schedkit_select_preemption_victim``, ``schedkit_on_step_end`` (demotion),
    ``schedkit_on_request_finished`` (cleanup). One plugin object serves one scheduler.

    Args:
        num_levels: Number of levels (>= 1, default 4).
        base_quantum: Output tokens of level 0's quantum (>= 1, default 16).
        quantum_growth: Ratio between consecutive quanta (>= 1, default 2.0).
        prefill_tokens_per_step: Prompt tokens that cost about one decode step, for
            skip-join (>= 1, default 256).
        preemptive: Preempt running requests for higher-level waiting ones (default true).
        min_run_tokens: New tokens a request must have computed since it (re)started
            (beyond its prompt, and beyond what it recomputes after a preemption) before
            it may be preempted voluntarily (>= 0, default 0): with one seat, a long job
            would otherwise pay a recompute for every token; with many seats sparing it
            moves the preemption to another request, which the lab measured as no
            better (docs/policies.md).
        starvation_s: Seconds of waiting after which a request is promoted to level 0
            (> 0, default 10.0; ``.inf`` turns the bound off).

    Raises:
        ValueError: A setting is out of range; the message names it and its value.
    """

    def __init__(self, num_levels: int = 4, base_quantum: int = 16, quantum_growth: float = 2.0,
                 prefill_tokens_per_step: int = 256, preemptive: bool = True,
                 starvation_s: float = 10.0, min_run_tokens: int = 0) -> None:
        self.num_levels = check_int("num_levels", num_levels, minimum=1)
        self.base_quantum = check_int("base_quantum", base_quantum, minimum=1)
        self.quantum_growth = check_number("quantum_growth", quantum_growth, minimum=1.0)
        self.prefill_tokens_per_step = check_int("prefill_tokens_per_step",
                                                 prefill_tokens_per_step, minimum=1)
        if not isinstance(preemptive, bool):
            raise ValueError(f"preemptive must be true or false, got {preemptive!r}")
        self.preemptive = preemptive
        self.min_run_tokens = check_int("min_run_tokens", min_run_tokens, minimum=0)
        self.starvation_s = check_number("starvation_s", starvation_s, strict=True, allow_inf=True)
        self.quanta = [max(1, round(self.base_quantum * self.quantum_growth ** i))
                       for i in range(self.num_levels)]
        """Output tokens a request may generate at each level before it is demoted."""
        self._level: dict[str, int] = {}
        self._used: dict[str, int] = {}
        self._reqs: dict[str, Request] = {}
        self._finished: list[Request] = []
        self.queue: LevelQueue | None = None

    def skip_join_level(self, num_prompt_tokens: int) -> int:
        """The highest level whose quantum covers the prompt's prefill steps."""
        steps = math.ceil(num_prompt_tokens / self.prefill_tokens_per_step)
        for i, q in enumerate(self.quanta):
            if steps <= q:
                return i
        return self.num_levels - 1

    def admit_level(self, request: Request) -> int:
        """Level of a request entering the queue: skip-join for one never seen."""
        rid = request.request_id
        if self._reqs.get(rid) is not request:
            self._reqs[rid] = request
            self._level[rid] = self.skip_join_level(request.num_prompt_tokens)
            self._used[rid] = 0
        return self._level[rid]

    def level_of(self, request: Request) -> int:
        """The request's current level (skip-join level if it has not been queued)."""
        return self.admit_level(request)

    @hookimpl
    def schedkit_create_waiting_queue(self) -> LevelQueue:
        self._level, self._used, self._reqs, self._finished = {}, {}, {}, []
        self.queue = LevelQueue(self)
        return self.queue

    def promote_starved(self, now: float) -> None:
        """Requests waiting longer than ``starvation_s`` go to the head of level 0 with an
        unused quantum, the longest waiting first."""
        if self.queue is None or not math.isfinite(self.starvation_s):
            return
        for req in reversed(self.queue.ages.overdue(now, self.starvation_s)):  # oldest ends first
            rid = req.request_id
            if self._level.get(rid, 0):
                self._level[rid], self._used[rid] = 0, 0
                self.queue.promote(req)

    @hookimpl
    def schedkit_select_voluntary_preemptions(self, running: Sequence[Request],
                                              waiting: Iterable[Request], max_num_running: int,
                                              max_preemptions: int) -> list[Preemption] | None:
        if not self.preemptive:
            return None
        return preempt_for_waiting(running, waiting, max_num_running, max_preemptions,
                                   self.level_of, "mlfq: a higher level waits", self.min_run_tokens)

    @hookimpl
    def schedkit_select_preemption_victim(self, running: Sequence[Request]) -> Request:
        victim, worst = running[-1], -1
        for req in reversed(running):  # latest admitted first, so ties go to it
            lvl = self.level_of(req)
            if lvl > worst:
                victim, worst = req, lvl
        return victim

    @hookimpl
    def schedkit_on_step_end(self, outputs: dict[int, EngineCoreOutputs], now: float) -> None:
        self.promote_starved(now)
        level, used, last = self._level, self._used, self.num_levels - 1
        for group in outputs.values():
            for out in group.outputs:
                rid = out.request_id
                if not out.new_token_ids or rid not in level:
                    continue
                u = used[rid] + len(out.new_token_ids)
                lvl = level[rid]
                while lvl < last and u >= self.quanta[lvl]:
                    u -= self.quanta[lvl]
                    lvl += 1
                level[rid], used[rid] = lvl, u
        for req in self._finished:
            rid = req.request_id
            if self._reqs.get(rid) is req:
                del self._reqs[rid], self._level[rid], self._used[rid]
        self._finished.clear()

    @hookimpl
    def schedkit_on_request_finished(self, request: Request) -> None:
        self._finished.append(request)
