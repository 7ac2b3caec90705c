"""Recording a runner's steps: each engine step's features
(:class:`schedkit.runners.cost_model.StepShapes`, the simulator's own) with its measured
duration, phase after phase of requests on one engine."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from schedkit.config import Config
from schedkit.core.request import Request, SamplingParams
from schedkit.errors import RequestError
from schedkit.lab.cost_fit import StepRecord
from schedkit.lab.workloads import WorkloadRequest
from schedkit.runners.cost_model import StepFeatures, StepShapes


@dataclass(slots=True)
class Phase:
    """Requests run together: the workload (arriving at their offsets) or a burst."""

    name: str
    requests: list[WorkloadRequest]
    sampling: dict[str, Any] = field(default_factory=dict)
    """SamplingParams fields of every request (besides ``max_tokens``)."""
    is_timed: bool = False
    """Requests arrive at their ``arrival_time`` (else all at once)."""
    shared_prefix: int = 0
    """The requests' prompts begin with this many tokens in common (a burst that reads
    one cached prefix; repeated with a new common prefix)."""


@dataclass(slots=True)
class PhaseReport:
    name: str
    status: str
    """"ran", "cut" (the budget ran out: the rest was aborted) or "skipped: why"."""
    num_steps: int = 0
    wall_s: float = 0.0
    estimate_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "status": self.status, "num_steps": self.num_steps,
                               "wall_s": round(self.wall_s, 3)}
        if self.estimate_s is not None:
            out["estimate_s"] = round(self.estimate_s, 3)
        return out


class StepRecorder:
    """Wraps a runner: remembers the features of each launched step; :meth:`on_step`
    pairs the oldest with the duration of the engine step that collected it (scheduling
    and output processing included, since the simulator's clock must advance by all of
    it; under async scheduling, the interval between consecutive steps' outputs)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.records: list[StepRecord] = []
        self.shapes = StepShapes()
        self._launched: deque[StepFeatures | None] = deque()
        if hasattr(runner, "execute_async"):
            self.execute_async = self._execute_async

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def initialize(self, num_blocks: int, block_size: int) -> int:
        self.shapes.block_size = block_size
        self.shapes.workers = int(getattr(self.runner, "attention_workers", 0))
        return int(self.runner.initialize(num_blocks, block_size))

    def _note(self, scheduler_output: Any) -> None:
        features = self.shapes.features(scheduler_output)
        self._launched.append(features if scheduler_output.num_scheduled_tokens else None)

    def execute(self, scheduler_output: Any) -> Any:
        self._note(scheduler_output)
        return self.runner.execute(scheduler_output)

    def _execute_async(self, scheduler_output: Any) -> Any:
        self._note(scheduler_output)
        return self.runner.execute_async(scheduler_output)

    def on_step(self, engine: Any) -> None:
        features = self._launched.popleft() if self._launched else None
        if features is not None and engine.last_step_s > 0:
            self.records.append((features, engine.last_step_s))


class Session:
    """One engine on a recording runner; phases run on it one after the other."""

    def __init__(self, config: Config, runner: Any, extra_plugins: Iterable[Any] = ()) -> None:
        from schedkit.engine.core import EngineCore

        self.recorder = StepRecorder(runner)
        self.engine = EngineCore(config, runner=self.recorder, extra_plugins=extra_plugins)

    @property
    def records(self) -> list[StepRecord]:
        return self.recorder.records

    def run(self, phase: Phase, deadline: float = math.inf) -> PhaseReport:
        """Run ``phase`` to completion, or until ``deadline`` (``time.monotonic()``),
        when what is left of it is aborted.

        Raises:
            RequestError: The engine refused the phase's first request (the rest are not
                added).
        """
        engine = self.engine
        t0, n0 = time.monotonic(), len(self.records)
        ids: list[str] = []
        for w in phase.requests:
            params = SamplingParams(max_tokens=w.max_tokens, eos_token_id=engine.config.runner.eos_token_id,
                                    ignore_eos=not phase.sampling.get("structured_outputs"), **phase.sampling)
            req = Request(w.request_id, w.prompt_token_ids, params, arrival_time=engine.now())
            try:
                engine.add_request(req, w.arrival_time if phase.is_timed else None)
            except RequestError:
                if not ids:
                    raise
                continue
            ids.append(w.request_id)
        status = "ran"
        while engine.has_requests():
            if status == "ran" and time.monotonic() > deadline:
                engine.abort_requests(ids)
                status = "cut"
            steps = engine.num_steps
            engine.step()
            if engine.num_steps > steps:
                self.recorder.on_step(engine)
            if not engine.is_virtual and (engine.last_step_empty or not engine.scheduler.has_requests()):
                self._idle(engine)
        return PhaseReport(phase.name, status, len(self.records) - n0, time.monotonic() - t0)

    @staticmethod
    def _idle(engine: Any) -> None:
        """Between steps that ran nothing: wait for the next arrival or grammar, not spin."""
        wait = engine.next_arrival_in()
        if not engine.scheduler.has_requests() and wait is not None:
            time.sleep(min(wait, 0.05))
        elif engine.waiting_for_grammars():
            time.sleep(0.001)

    @property
    def config(self) -> Config:
        """The engine's config with the KV cache the runner gave it (on a GPU, what fit)."""
        config = self.engine.config
        num_blocks = self.engine.scheduler.kv_cache_manager.num_blocks
        if num_blocks == config.cache.num_blocks:
            return config
        cache = config.cache.model_copy(update={"num_blocks": num_blocks})
        return config.model_copy(update={"cache": cache})

    def close(self) -> None:
        self.engine.close()
