"""Run requests through one in-process engine, step by step, keeping every decision.

:class:`EngineRun` is the driver of recordings and replays (:mod:`schedkit.lab.replay`).
It adds each request itself, right before the step it joins, and keeps each step's
decisions through :class:`StepRecorder`, a plugin on ``schedkit_on_step_end``:

* By time (every request of a recording; in a replay, those that joined at or after the
  step it changes): a request is added once the engine clock reaches its arrival, as the
  engine releases the requests it holds (:meth:`EngineCore.add_request` with an arrival
  offset): a virtual clock with nothing to run, or whose last step ran nothing, first
  jumps to the next arrival. A recording therefore equals
  :func:`~schedkit.lab.simulate.run_workload` request for request; on the wall clock (a
  real runner) the driver sleeps until the next arrival when there is nothing to run.
* By step (a replay, before the step it changes): a request joins the step it joined in
  the recording, keeping its recorded arrival time unless the replay's clock is behind it
  (then it arrives now). A virtual clock with nothing to run, or whose last step ran
  nothing, jumps to the earliest arrival of the step's newcomers, as it did when recorded;
  with steps in flight (async scheduling), newcomers wait until as many are in flight as
  when the step was recorded.

From step ``pin_before`` on, the requests left arrive by time, their recorded arrivals
shifted by the difference between the replay's clock and the recording's at that step (0
when the recording ran on the same virtual clock). Steps before ``verify_before`` are
checked against the recording as they end: the first difference raises
:class:`~schedkit.errors.ReplayDivergenceError`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from schedkit.config import Config
from schedkit.core.outputs import EngineCoreOutputs, SchedulerOutput
from schedkit.core.request import Request, SamplingParams
from schedkit.engine.core import EngineCore
from schedkit.errors import ReplayDivergenceError, SchedkitError
from schedkit.hookspecs import hookimpl
from schedkit.lab.metrics import RequestMetrics, refused_metrics, request_metrics
from schedkit.lab.recording import DECISIONS, RequestRecord, StepRecord
from schedkit.lab.simulate import RunResult


class StepRecorder:
    """A plugin that keeps every step's decisions as a :class:`StepRecord` (times relative
    to ``start``); :meth:`take` hands over those kept since the last call."""

    def __init__(self, start: float = 0.0) -> None:
        self.start = start
        self._steps: list[StepRecord] = []

    @hookimpl
    def schedkit_on_step_end(self, scheduler_output: SchedulerOutput,
                             outputs: dict[int, EngineCoreOutputs], now: float) -> None:
        so = scheduler_output
        cached = so.scheduled_cached_reqs
        start = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        new = []
        for nr in so.scheduled_new_reqs:
            start[nr.req_id] = nr.num_computed_tokens
            new.append(nr.req_id)
        finished = [(o.request_id, str(o.finish_reason)) for group in outputs.values()
                    for o in group.outputs if o.finish_reason is not None]
        self._steps.append(StepRecord(
            so.step, [(rid, start[rid], n) for rid, n in so.num_scheduled_tokens.items()], new,
            [rid for rid in cached.req_ids if rid in cached.resumed_req_ids],
            sorted(so.preempted_req_ids), finished, end=now - self.start))

    def take(self) -> list[StepRecord]:
        steps, self._steps = self._steps, []
        return steps


@dataclass(slots=True)
class EngineRunResult(RunResult):
    """A :class:`~schedkit.lab.simulate.RunResult` plus every step's decisions and the
    step each request joined."""

    steps: list[StepRecord] = field(default_factory=list)
    step_of: dict[str, int] = field(default_factory=dict)
    num_blocks: int = 0


class EngineRun:
    """One run of ``requests`` through a new :class:`EngineCore` (module docstring).

    Args:
        config: The engine's config; its workload's SLO gives each request its TTFT target.
        requests: The requests, in arrival order.
        runner: A ready runner (default: built from ``config.runner``).
        extra_plugins: Plugin objects for the engine (a :class:`StepRecorder` is added).
        pin_before: Requests whose recorded ``step`` is below it join that step.
        recorded: The recorded steps by number (a replay): their ``in_flight`` and ``clock``,
            and what the steps before ``verify_before`` must decide.
        verify_before: Steps below it must decide as recorded.
        eos_token_id: The EOS id of every request (default ``config.runner.eos_token_id``).
        after_step: Called after every engine step (a replay's plugin raises its errors).
    """

    def __init__(self, config: Config, requests: Sequence[RequestRecord], *, runner: Any = None,
                 extra_plugins: Iterable[Any] = (), pin_before: int = 1,
                 recorded: Mapping[int, StepRecord] | None = None, verify_before: int = 1,
                 eos_token_id: int | None = None,
                 after_step: Callable[[], None] | None = None) -> None:
        self.wall0 = time.perf_counter()
        self.recorder = StepRecorder()
        self.engine = EngineCore(config, runner=runner, extra_plugins=[*extra_plugins, self.recorder])
        self.start = self.recorder.start = self.engine.start_time
        self.recorded = recorded or {}
        self.pin_before, self.verify_before = pin_before, verify_before
        self.after_step = after_step
        self.eos = config.runner.eos_token_id if eos_token_id is None else eos_token_id
        self.slo = config.workload.slo
        self.pinned: dict[int, list[RequestRecord]] = {}
        timed = []
        for r in requests:
            if r.step is not None and r.step < pin_before:
                self.pinned.setdefault(r.step, []).append(r)
            else:
                timed.append(r)
        self.timed = sorted(timed, key=lambda r: r.arrival_time)[::-1]
        """Requests to add by time, the next one last."""
        self.shift: float | None = None
        self.live: dict[str, Request] = {}
        self.token_times: dict[str, list[float]] = {}
        self.result = EngineRunResult([], num_blocks=self.engine.scheduler.kv_cache_manager.num_blocks,
                                      start_time=self.start)
        self._before: dict[int, tuple[float, int]] = {}
        """Step -> (clock when its turn first came, steps in flight when it was scheduled)."""
        self._first_clock: dict[int, float] = {}
        self._rejected: dict[int, list[str]] = {}

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> EngineRunResult:
        engine, sched = self.engine, self.engine.scheduler
        while self.pinned or self.timed or engine.has_requests():
            step = sched.current_step + 1
            clock = self._first_clock.setdefault(step, engine.now() - self.start)
            in_flight = engine.num_steps_in_flight
            if step < self.pin_before:
                self._add_pinned(step)
            else:
                self._add_timed(step)
            if not engine.has_requests():
                self._idle(step)
                continue
            schedules = sched.has_requests()
            if schedules:
                self._before[step] = (clock, in_flight)
                del self._first_clock[step]
            outputs = engine.step()
            if schedules:  # the rejections its admissions made come out in this call
                self._rejected[step] = [o.request_id for group in outputs.values() for o in group.outputs
                                        if o.stop_reason == "rejected"]
            self._collect(outputs)
            if self.after_step is not None:
                self.after_step()
            self._take_steps()
        return self._result()

    def _idle(self, step: int) -> None:
        """Nothing to run (the requests just added were refused, or the next arrives
        later): wait for the next arrival (on the wall clock, by sleeping)."""
        if step < self.pin_before or not self.timed:
            raise ReplayDivergenceError(
                f"step {step}: the replay has nothing to run, but the recording scheduled step "
                f"{step} (an earlier step ended differently)", step=step, differences={})
        if not self.engine.is_virtual:
            time.sleep(max(self._at(self.timed[-1]) - self.engine.now(), 0.0))

    def _add_pinned(self, step: int) -> None:
        batch = self.pinned.get(step)
        engine, sched = self.engine, self.engine.scheduler
        if not batch:
            return
        recorded = self.recorded.get(step)
        if not sched.has_requests() and recorded is not None and engine.num_steps_in_flight > recorded.in_flight:
            return  # the step in flight ends first, as when recorded
        if engine.is_virtual and (engine.last_step_empty or not sched.has_requests()):
            engine.advance_to(self.start + min(r.arrival_time for r in batch))
        del self.pinned[step]
        now = engine.now()
        for r in batch:
            self._add(r, min(self.start + r.arrival_time, now), step)

    def _add_timed(self, step: int) -> None:
        engine, sched = self.engine, self.engine.scheduler
        if self.shift is None:
            recorded = self.recorded.get(step)
            self.shift = 0.0 if recorded is None else engine.now() - self.start - recorded.clock
        timed = self.timed
        if not timed:
            return
        if engine.is_virtual and (engine.last_step_empty or not sched.has_requests()):
            engine.advance_to(self._at(timed[-1]))
        now = engine.now()
        while timed and self._at(timed[-1]) <= now:
            r = timed.pop()
            self._add(r, self._at(r), step)

    def _at(self, r: RequestRecord) -> float:
        """When a request added by time arrives on this engine's clock."""
        return max(self.start + r.arrival_time + (self.shift or 0.0), self.start)

    def _add(self, r: RequestRecord, at: float, step: int) -> None:
        req = Request(r.request_id, list(r.prompt_token_ids),
                      SamplingParams(max_tokens=r.max_tokens, eos_token_id=self.eos),
                      arrival_time=at, priority=r.priority, tenant=r.tenant,
                      ttft_slo_s=self.slo.class_target("ttft_s", r.tenant, r.priority))
        self.result.step_of[r.request_id] = step
        try:
            self.engine.add_request_at(req, at)
        except SchedkitError as e:
            self.result.failed[r.request_id] = str(e)
            self.result.metrics.append(self._refused(req, str(e)))
            return
        self.live[r.request_id] = req
        self.token_times[r.request_id] = []

    # -- outputs and steps ---------------------------------------------------------------
    def _collect(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        now = self.engine.now()
        result = self.result
        for group in outputs.values():
            for o in group.outputs:
                times = self.token_times.get(o.request_id)
                if times is not None and o.new_token_ids:
                    times.extend([now] * len(o.new_token_ids))
                if o.finish_reason is None:
                    continue
                ended = self.live.pop(o.request_id, None)
                if o.error is not None:
                    result.failed[o.request_id] = o.error
                if ended is None:
                    continue
                if not ended.is_finished:  # refused when it arrived
                    result.metrics.append(self._refused(ended, o.error or "refused"))
                else:
                    result.metrics.append(request_metrics(ended, self.token_times[o.request_id],
                                                          self.start, result.failed.get(o.request_id)))

    def _refused(self, req: Request, error: str) -> RequestMetrics:
        return refused_metrics(req.request_id, req.arrival_time - self.start, req.num_prompt_tokens,
                               error, tenant=req.tenant, priority=req.priority, max_tokens=req.max_tokens)

    def _take_steps(self) -> None:
        for rec in self.recorder.take():
            rec.clock, rec.in_flight = self._before.pop(rec.step, (0.0, 0))
            rec.rejected = self._rejected.pop(rec.step, [])
            if rec.step < self.verify_before:
                self._verify(rec)
            self.result.steps.append(rec)

    def _verify(self, rec: StepRecord) -> None:
        want = self.recorded.get(rec.step)
        if want is None:
            raise ReplayDivergenceError(f"step {rec.step}: the replay ran a step the recording does "
                                        "not have", step=rec.step, differences={})
        ours, theirs = rec.decisions(), want.decisions()
        keys = [k for k in DECISIONS if ours[k] != theirs[k]]
        if keys:
            what = "; ".join(f"{k}: recorded {_brief(theirs[k])}, replayed {_brief(ours[k])}" for k in keys)
            raise ReplayDivergenceError(f"step {rec.step} differs from the recording: {what}", step=rec.step,
                                        differences={k: (theirs[k], ours[k]) for k in keys})

    def _result(self) -> EngineRunResult:
        result = self.result
        result.metrics.sort(key=lambda m: (m.arrival_time, m.request_id))
        result.num_steps = self.engine.num_steps
        result.wall_s = time.perf_counter() - self.wall0
        self.engine.close()
        return result


def _brief(values: list[Any]) -> str:
    shown = ", ".join(str(list(v)) if isinstance(v, tuple) else str(v) for v in values[:6])
    return f"[{shown}{', ...' if len(values) > 6 else ''}]"
