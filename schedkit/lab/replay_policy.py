"""The plugins of a counterfactual replay (:mod:`schedkit.lab.replay`).

:class:`ReplayPolicy` is the replay engine's one scheduling plugin. It answers every
scheduling hook with the recorded run's policy (a plugin manager of its own, built from
the recorded config) up to the step the replay changes, and from that step on with the
changed policy, so one engine runs both halves:

* Before the change it holds the run to the recording: where the policy would preempt a
  request the recording did not preempt in that step, it names one the recording did
  (the latest admitted of them); it admits a request the recording admitted in that step
  and rejects one the recording rejected there, whatever the policy says; and where the
  policy would reject a request that waited on in the recording, it passes over it.
  Each correction is counted in ``num_forced``. A run recorded on the same virtual clock needs none (its policy decides
  as it did); a run recorded on a real runner may, where its policy read the wall clock.
* At the changed step, ``victim`` replaces the step's first preemption: the first victim
  chosen for KV blocks, or the first voluntary one; where the recording preempted nobody,
  ``victim`` is preempted voluntarily at the start of the step (it then sits out the
  step's admissions and is queued again in the policy's order).
* A policy change switches the waiting queue at the changed step: the new policy's queue
  gets every waiting request, in the order the old one would have served them; from then
  on the new policy answers every hook and observes every step (its accounting starts
  there).

:class:`ForcedRoutes` does the same for a cluster: it routes the requests of the
decisions before the changed one to their recorded replicas.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import pluggy

from schedkit.core.hooks import AdmissionDecision, Preemption, Rejection
from schedkit.core.request import Request
from schedkit.core.routing import ReplicaState, RouteRequest
from schedkit.errors import ReplayError
from schedkit.hookspecs import hookimpl
from schedkit.lab.recording import StepRecord


class SwitchQueue:
    """The replay's waiting queue: the recorded policy's, then from :meth:`switch` on the
    new policy's. Other attributes read through to the active queue."""

    __slots__ = ("active",)

    def __init__(self, queue: Any) -> None:
        self.active = queue

    def switch(self, queue: Any) -> None:
        """Hand every waiting request to ``queue`` in the current serving order."""
        for req in list(self.active):
            queue.add(req)
        self.active = queue

    def add(self, request: Request) -> None:
        self.active.add(request)

    def peek(self) -> Request:
        return self.active.peek()

    def pop(self) -> Request:
        return self.active.pop()

    def prepend_request(self, request: Request) -> None:
        self.active.prepend_request(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        self.active.prepend_requests(requests)

    def remove_request(self, request: Request) -> None:
        self.active.remove_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        self.active.remove_requests(requests)

    def __len__(self) -> int:
        return len(self.active)

    def __bool__(self) -> bool:
        return bool(self.active)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.active)

    def __getattr__(self, name: str) -> Any:
        if name == "active":  # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.active, name)


class ReplayPolicy:
    """Args:
        before: The recorded run's plugins (its policy and the built-ins).
        after: The plugins deciding from ``from_step`` on (default: ``before``).
        recorded: The recorded steps by number.
        from_step: The step the change applies at.
        victim: The request the step's first preemption takes instead.
    """

    def __init__(self, before: pluggy.PluginManager, after: pluggy.PluginManager | None = None, *,
                 recorded: Mapping[int, StepRecord], from_step: int, victim: str | None = None) -> None:
        self.before = before
        self.after = before if after is None else after
        self.recorded = recorded
        self.from_step = from_step
        self.victim = victim
        self.step = 0
        """The step being scheduled (or last scheduled)."""
        self.queue: SwitchQueue | None = None
        self._queue_args: dict[str, Any] = {}
        self._changed = False
        self.victim_applied = False
        self.num_forced: Counter[str] = Counter()
        """Corrections that held the run to the recording, by kind (victim, admission)."""
        self.error: ReplayError | None = None

    @property
    def _hook(self) -> Any:
        return (self.after if self.step >= self.from_step else self.before).hook

    def check(self) -> None:
        """Raise the error a hook met (hooks cannot raise it: the engine would fail the
        requests instead), or the victim's if its step went by without a preemption."""
        if self.error is None and self.victim is not None and self.step >= self.from_step \
                and not self.victim_applied:
            self.error = ReplayError(
                f"victim {self.victim!r} at step {self.from_step}: nothing was preempted there and "
                "no preemption could be made (a voluntary one needs a waiting request, token budget "
                "left and scheduler.max_voluntary_preemptions > 0); choose a step where the "
                "recording preempted or requests wait", request_id=self.victim)
        if self.error is not None:
            raise self.error

    # -- deciding ------------------------------------------------------------------------
    @hookimpl
    def schedkit_create_waiting_queue(self, scheduler_config: Any, kv_cache_manager: Any,
                                      clock: Callable[[], float]) -> SwitchQueue:
        self._queue_args = {"scheduler_config": scheduler_config, "kv_cache_manager": kv_cache_manager,
                            "clock": clock}
        self.queue = SwitchQueue(self._new_queue(self.before))
        return self.queue

    def _new_queue(self, pm: pluggy.PluginManager) -> Any:
        queue = pm.hook.schedkit_create_waiting_queue(**self._queue_args)
        assert queue is not None, "the built-in fcfs always answers"
        return queue

    @hookimpl
    def schedkit_step_token_budget(self, max_num_batched_tokens: int, running: Sequence[Request],
                                   waiting: Any, kv_cache_usage: float, step: int) -> int | None:
        self.step = step
        if step == self.from_step and not self._changed:
            self._change(running)
        return self._hook.schedkit_step_token_budget(
            max_num_batched_tokens=max_num_batched_tokens, running=running, waiting=waiting,
            kv_cache_usage=kv_cache_usage, step=step)

    def _change(self, running: Sequence[Request]) -> None:
        self._changed = True
        if self.after is not self.before and self.queue is not None:
            self.queue.switch(self._new_queue(self.after))
        if self.victim is not None and self._find(running) is None:
            names = ", ".join(r.request_id for r in running) or "none"
            self.error = ReplayError(f"victim {self.victim!r} is not running at step {self.step} "
                                     f"(running: {names})", request_id=self.victim)

    def _find(self, running: Sequence[Request]) -> Request | None:
        return next((r for r in running if r.request_id == self.victim), None)

    @hookimpl
    def schedkit_select_preemption_victim(self, running: Sequence[Request], request: Request) -> Any:
        answer = self._hook.schedkit_select_preemption_victim(running=running, request=request)
        if self.victim is not None and self.step == self.from_step and not self.victim_applied:
            self.victim_applied = True
            return self._find(running) or answer
        if self.step < self.from_step:
            return self._held(answer, running)
        return answer

    def _held(self, answer: Any, running: Sequence[Request]) -> Any:
        """The policy's victim, or one the recording preempted in this step."""
        rec = self.recorded.get(self.step)
        chosen = answer.request if isinstance(answer, Preemption) else answer
        if rec is None or not rec.preempted or getattr(chosen, "request_id", None) in rec.preempted:
            return answer
        recorded = [r for r in running if r.request_id in rec.preempted]
        if not recorded:
            return answer
        self.num_forced["victim"] += 1
        return recorded[-1]

    @hookimpl
    def schedkit_select_voluntary_preemptions(self, running: Sequence[Request], waiting: Any,
                                              max_num_running: int, kv_cache_usage: float, now: float,
                                              max_preemptions: int) -> Any:
        answer = self._hook.schedkit_select_voluntary_preemptions(
            running=running, waiting=waiting, max_num_running=max_num_running,
            kv_cache_usage=kv_cache_usage, now=now, max_preemptions=max_preemptions)
        if self.victim is None or self.step != self.from_step or self.victim_applied:
            return answer
        chosen = list(answer or ())
        rec = self.recorded.get(self.step)
        if not chosen and rec is not None and rec.preempted:
            return answer  # the step's preemption comes later, for KV blocks
        victim = self._find(running)
        if victim is None:
            return answer
        self.victim_applied = True
        rest = [p for p in chosen[1:] if (p.request if isinstance(p, Preemption) else p) is not victim]
        return [Preemption(victim, "replay"), *rest]

    @hookimpl
    def schedkit_admit_request(self, request: Request, num_running: int, kv_cache_usage: float,
                               now: float) -> Any:
        answer = self._hook.schedkit_admit_request(request=request, num_running=num_running,
                                                   kv_cache_usage=kv_cache_usage, now=now)
        rec = self.recorded.get(self.step) if self.step < self.from_step else None
        if rec is None:
            return answer
        rid = request.request_id
        rejects = answer is AdmissionDecision.REJECT or isinstance(answer, Rejection)
        if rid in rec.admitted:
            held = AdmissionDecision.ADMIT
        elif rid in rec.rejected:
            held = answer if rejects else AdmissionDecision.REJECT
        else:  # it waited on: a rejection becomes a pass (an admission may find no room)
            held = AdmissionDecision.SKIP if rejects else answer
        if held is not answer:
            self.num_forced["admission"] += 1
        return held

    @hookimpl
    def schedkit_prefill_chunk_limit(self, request: Request, num_new_tokens: int, threshold: int) -> Any:
        return self._hook.schedkit_prefill_chunk_limit(request=request, num_new_tokens=num_new_tokens,
                                                       threshold=threshold)

    @hookimpl
    def schedkit_num_speculative_tokens(self, running: Sequence[Request], num_speculative_tokens: int,
                                        step: int) -> Any:
        return self._hook.schedkit_num_speculative_tokens(
            running=running, num_speculative_tokens=num_speculative_tokens, step=step)

    # -- built once, at the start ----------------------------------------------------------
    @hookimpl
    def schedkit_create_kv_connector(self, role: Any, config: Any) -> Any:
        return self.before.hook.schedkit_create_kv_connector(role=role, config=config)

    @hookimpl
    def schedkit_create_structured_output_backend(self, config: Any, tokenizer: Any, vocab_size: int,
                                                  eos_token_ids: Sequence[int]) -> Any:
        return self.before.hook.schedkit_create_structured_output_backend(
            config=config, tokenizer=tokenizer, vocab_size=vocab_size, eos_token_ids=eos_token_ids)

    # -- observing -----------------------------------------------------------------------
    @hookimpl
    def schedkit_on_step_end(self, scheduler_output: Any, outputs: Any, stats: Any, now: float) -> None:
        self._hook.schedkit_on_step_end(scheduler_output=scheduler_output, outputs=outputs,
                                        stats=stats, now=now)

    @hookimpl
    def schedkit_on_request_finished(self, request: Request, now: float) -> None:
        self._hook.schedkit_on_request_finished(request=request, now=now)


class ForcedRoutes:
    """A router plugin that sends each request of ``routes`` (request id -> replica index:
    the decisions before the changed one) to its recorded replica. It filters and picks
    first, so the configured router's filters and scorers see only that replica, and its
    observers every routing event."""

    def __init__(self, routes: Mapping[str, int]) -> None:
        self.routes = dict(routes)

    @hookimpl(tryfirst=True)
    def schedkit_router_filter(self, request: RouteRequest,
                               replicas: Sequence[ReplicaState]) -> list[ReplicaState] | None:
        index = self.routes.get(request.request_id)
        kept = [r for r in replicas if r.index == index]
        return kept or None

    @hookimpl(tryfirst=True)
    def schedkit_router_pick(self, request: RouteRequest,
                             replicas: Sequence[ReplicaState]) -> ReplicaState | None:
        index = self.routes.get(request.request_id)
        return next((r for r in replicas if r.index == index), None)
