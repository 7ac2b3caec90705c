"""Drive a real Scheduler on a virtual clock, as EngineCore does, and read the results.

The loop mirrors ``EngineCore.step``: release the requests whose arrival time has come
(jumping over idle gaps), schedule, run the FakeRunner, advance the clock by the step
time, then ``update_from_output``. Requests stop at ``max_tokens`` (the fake runner's
tokens never hit EOS), so every request's work is known in advance.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from schedkit.core.outputs import EngineCoreOutputs, SchedulerOutput
from schedkit.core.request import EventType, Request
from schedkit.core.scheduler import Scheduler
from schedkit.plugins.testing import assert_scheduler_consistent, make_request, make_scheduler
from schedkit.runners.fake import FakeRunner

STEP_S = 0.01


class VirtualClock:
    """A settable clock; ``make_scheduler(clock=...)`` and policies' ``clock=`` share it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def req(rid: str, prompt_len: int, *, t: float = 0.0, max_tokens: int = 4, tenant: str = "default",
        priority: int = 0, prefix: Sequence[int] = ()) -> Request:
    """A request arriving at ``t``; its prompt is ``prefix`` then tokens unique to ``rid``."""
    base = 1000 + zlib.crc32(rid.encode()) % 20000
    body = [base + i for i in range(prompt_len - len(prefix))]
    return make_request(rid, list(prefix) + body, max_tokens=max_tokens, arrival_time=t,
                        tenant=tenant, priority=priority)


@dataclass
class Run:
    sched: Scheduler
    clock: VirtualClock
    requests: dict[str, Request]
    admitted: list[str] = field(default_factory=list)
    """Request ids in order of first admission."""
    num_steps: int = 0

    def first(self, rid: str, kind: EventType) -> float | None:
        return self.requests[rid].first_event_time(kind)

    def ttft(self, rid: str) -> float | None:
        t = self.first(rid, EventType.FIRST_TOKEN)
        return None if t is None else t - self.requests[rid].arrival_time

    def wait(self, rid: str) -> float | None:
        """Arrival to first admission."""
        t = self.first(rid, EventType.SCHEDULED)
        return None if t is None else t - self.requests[rid].arrival_time

    def mean_ttft(self, ids: Iterable[str] | None = None) -> float:
        vals = [self.ttft(r) for r in (self.requests if ids is None else ids)]
        assert all(v is not None for v in vals)
        return sum(vals) / len(vals)  # type: ignore[arg-type]

    def rejected(self) -> list[str]:
        return [r.request_id for r in self.requests.values() if r.stop_reason == "rejected"]


StepHook = Callable[[Run, SchedulerOutput, dict[int, EngineCoreOutputs]], None]


def run(requests: Iterable[Request], plugins: Sequence[Any] = (), *, step_s: float = STEP_S,
        clock: VirtualClock | None = None, check: bool = False, on_step: StepHook | None = None,
        before_step: Callable[[Run], None] | None = None, max_steps: int = 50_000,
        runner: FakeRunner | None = None, **sched_kwargs: Any) -> Run:
    """Serve ``requests`` (each arriving at its ``arrival_time``) until all are done."""
    clock = clock if clock is not None else VirtualClock()
    sched_kwargs.setdefault("num_blocks", 1000)
    sched = make_scheduler(plugins=plugins, clock=clock, **sched_kwargs)
    runner = runner if runner is not None else FakeRunner(step_time_s=step_s)
    pending = sorted(requests, key=lambda r: r.arrival_time)
    res = Run(sched, clock, {r.request_id: r for r in pending})
    i = 0
    for _ in range(max_steps):
        while i < len(pending) and pending[i].arrival_time <= clock.now + 1e-9:
            sched.add_request(pending[i])
            i += 1
        if not sched.has_requests():
            if i == len(pending):
                return res
            clock.now = pending[i].arrival_time
            continue
        if before_step is not None:
            before_step(res)
        out = sched.schedule()
        res.admitted += [n.req_id for n in out.scheduled_new_reqs]
        runner_out = runner.execute(out)
        clock.now += step_s
        outputs = sched.update_from_output(out, runner_out)
        res.num_steps += 1
        if check:
            assert_scheduler_consistent(sched)
        if on_step is not None:
            on_step(res, out, outputs)
    raise AssertionError(f"not drained after {max_steps} steps")
