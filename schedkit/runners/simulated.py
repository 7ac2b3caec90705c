"""A cost-model simulator: no model, no torch, a virtual clock.

Tokens come from the fake runner's deterministic function (so drafts, stops and outputs
behave exactly as with :class:`FakeRunner`); what the simulator adds is each step's
duration, predicted from the step's shape by a linear cost model loaded from a profile
(``schedkit/runners/profiles/*.json``, fitted to the real runner's measured step times by
``scripts/fit_cost_model.py``)::

    t = base + per_token * tokens + per_request * requests
        + per_context_token * context tokens read + per_prefill_attention * sum(n * (computed + n / 2))

where ``tokens`` is every token computed in the step, ``context tokens read`` sums, over
the scheduled requests, the KV positions their attention reads (computed + n), and the
last term is the quadratic part of prefill attention.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schedkit.core.outputs import ModelRunnerOutput, SchedulerOutput
from schedkit.errors import ConfigError
from schedkit.runners.fake import FakeRunner

PROFILE_DIR = Path(__file__).with_name("profiles")
FEATURES = ("base_s", "per_token_s", "per_request_s", "per_context_token_s", "per_prefill_attention_s")


@dataclass(slots=True, frozen=True)
class CostModel:
    base_s: float
    per_token_s: float
    per_request_s: float
    per_context_token_s: float
    per_prefill_attention_s: float
    name: str = "custom"

    @classmethod
    def load(cls, name_or_path: str) -> CostModel:
        """A profile by name (from the bundled profiles) or by path to a JSON file."""
        path = Path(name_or_path)
        if not path.is_file():
            path = PROFILE_DIR / f"{name_or_path}.json"
        if not path.is_file():
            known = sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
            raise ConfigError(f"runner.profile = {name_or_path!r}: no such profile file or "
                              f"bundled profile (bundled: {known})")
        try:
            data = json.loads(path.read_text())
            coef = data["coefficients"]
            return cls(**{k: float(coef[k]) for k in FEATURES}, name=data.get("name", path.stem))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{path}: not a cost-model profile (needs coefficients "
                              f"{', '.join(FEATURES)}): {e}") from e

    def step_time(self, features: tuple[float, float, float, float]) -> float:
        tokens, requests, context, prefill_attn = features
        return (self.base_s + self.per_token_s * tokens + self.per_request_s * requests
                + self.per_context_token_s * context + self.per_prefill_attention_s * prefill_attn)


def step_features(scheduler_output: SchedulerOutput, computed_before: dict[str, int]) -> tuple[float, float, float, float]:
    """(tokens, requests, context tokens read, prefill attention work) of one step."""
    tokens = context = attn = 0.0
    for rid, n in scheduler_output.num_scheduled_tokens.items():
        c = computed_before[rid]
        tokens += n
        context += c + n
        if n > 1:
            attn += n * (c + n / 2)
    return tokens, float(len(scheduler_output.num_scheduled_tokens)), context, attn


@dataclass
class SimulatedRunner(FakeRunner):
    """FakeRunner tokens, cost-model step durations (virtual clock)."""

    cost_model: CostModel = field(default_factory=lambda: CostModel.load("h200-qwen2.5-0.5b-handset"))
    last_features: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)

    @classmethod
    def from_config(cls, config: Any) -> SimulatedRunner:
        rc = config.runner
        return cls(vocab_size=rc.vocab_size, eos_token_id=rc.eos_token_id,
                   cost_model=CostModel.load(rc.profile))

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        cached = scheduler_output.scheduled_cached_reqs
        before = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for new in scheduler_output.scheduled_new_reqs:
            before[new.req_id] = new.num_computed_tokens
        self.last_features = step_features(scheduler_output, before)
        out = FakeRunner.execute(self, scheduler_output)
        # A step that computes nothing (it only tells workers about finished requests)
        # launches no model work: it takes no time.
        out.step_duration = self.cost_model.step_time(self.last_features) if out.req_ids else 0.0
        return out
