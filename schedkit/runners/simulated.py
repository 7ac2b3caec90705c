"""A cost-model simulator: no model, no torch, a virtual clock.

Tokens come from the fake runner's deterministic function (so drafts, stops and outputs
behave exactly as with :class:`FakeRunner`); what the simulator adds is each step's
duration, predicted from the step's shape by the linear cost model of
:mod:`schedkit.runners.cost_model`, loaded from a profile
(``schedkit/runners/profiles/*.json``, fitted to the real runner's measured step times
by ``schedkit calibrate``).

Under ``scheduler.async_scheduling`` the engine keeps two steps in flight and advances
its clock by each step's duration when it collects the step's output; calibration under
async scheduling fits the interval between consecutive outputs, so the overlap of host
and device work is in the fitted durations. A profile fitted in the other mode
overstates (sync fit, async run) or understates (async fit, sync run) the step time:
the simulator warns when the two differ.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from schedkit.core.outputs import ModelRunnerOutput, SchedulerOutput
from schedkit.errors import ConfigError
from schedkit.runners.cost_model import (
    FEATURES,
    PROFILE_DIR,
    REQUIRED_FEATURES,
    CostModel,
    StepFeatures,
    StepShapes,
    step_features,
)
from schedkit.runners.fake import FakeRunner, draft_acceptance_of, tenant_acceptance

__all__ = ["FEATURES", "PROFILE_DIR", "REQUIRED_FEATURES", "CostModel", "SimulatedRunner",
           "StepFeatures", "StepShapes", "step_features"]

log = logging.getLogger("schedkit.runners.simulated")


@dataclass
class SimulatedRunner(FakeRunner):
    """FakeRunner tokens, cost-model step durations (virtual clock)."""

    cost_model: CostModel = field(default_factory=lambda: CostModel.load("h200-qwen2.5-0.5b-handset"))
    last_features: StepFeatures = StepFeatures(0.0, 0.0, 0.0, 0.0, 0.0)
    shapes: StepShapes = field(default_factory=StepShapes)

    @property
    def attention_workers(self) -> int:
        """The profile's attention workers (a recorder of this runner reads the same
        features the profile charges)."""
        return self.cost_model.attention_workers

    @classmethod
    def from_config(cls, config: Any) -> SimulatedRunner:
        rc = config.runner
        try:
            model = CostModel.load(rc.profile)
        except ConfigError as e:  # named where the YAML sets it
            where = config.where("runner", "profile") if hasattr(config, "where") else None
            raise ConfigError(f"{where}: {e}" if where else str(e)) from e
        is_async = config.scheduler.async_scheduling
        if model.fitted_async_scheduling is not None and model.fitted_async_scheduling != is_async:
            log.warning("cost-model profile %r was fitted with scheduler.async_scheduling = %s, this "
                        "engine runs with %s: its step times %s", model.name,
                        model.fitted_async_scheduling, is_async,
                        "include host work that async scheduling hides" if is_async
                        else "leave out host work that async scheduling hid")
        if rc.draft_token_s is not None:
            model = replace(model, per_draft_token_s=rc.draft_token_s)
        return cls(vocab_size=rc.vocab_size, eos_token_id=rc.eos_token_id, cost_model=model,
                   draft_acceptance=draft_acceptance_of(rc), acceptance_by_tenant=tenant_acceptance(config))

    def initialize(self, num_blocks: int, block_size: int) -> int:
        self.shapes.block_size = block_size
        self.shapes.workers = self.cost_model.attention_workers
        return super().initialize(num_blocks, block_size)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.last_features = features = self.shapes.features(scheduler_output)
        out = FakeRunner.execute(self, scheduler_output)
        # A step that computes nothing (it only tells workers about finished requests)
        # launches no model work: it takes only the KV blocks it moves, if any.
        out.step_duration = (self.cost_model.step_time(features) if out.req_ids
                             else self.cost_model.transfer_time(features))
        return out
