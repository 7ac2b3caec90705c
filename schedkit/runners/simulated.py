"""A cost-model simulator: no model, no torch, a virtual clock.

Tokens come from the fake runner's deterministic function (so drafts, stops and outputs
behave exactly as with :class:`FakeRunner`); what the simulator adds is each step's
duration, predicted from the step's shape by a linear cost model loaded from a profile
(``schedkit/runners/profiles/*.json``, fitted to the real runner's measured step times by
``scripts/fit_cost_model.py``)::

    t = base + per_token * tokens + per_request * requests
        + per_context_token * context tokens read + per_prefill_attention * sum(n * (computed + n / 2))
        + per_prefill_step * [the step computes any multi-token chunk]
        + decode_batch_residual(requests)   (decode-only steps)

where ``tokens`` is every token computed in the step, ``context tokens read`` sums, over
the scheduled requests, the KV positions their attention reads (computed + n), the fifth
term is the quadratic part of prefill attention, and the last is the fixed extra cost of
a step that is not decode-only (on CUDA such a step runs eagerly, while decode-only
steps replay a captured CUDA graph). The optional residual table corrects decode-only
steps by batch size (linear between the sizes it lists, its end values beyond them):
what a line cannot express, such as CUDA-graph batch buckets or a CPU matmul that is
slower at 3 rows than at 4.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schedkit.core.outputs import ModelRunnerOutput, SchedulerOutput
from schedkit.errors import ConfigError
from schedkit.runners.fake import FakeRunner

PROFILE_DIR = Path(__file__).with_name("profiles")
FEATURES = ("base_s", "per_token_s", "per_request_s", "per_context_token_s", "per_prefill_attention_s",
            "per_prefill_step_s")
"""Coefficient names, in the order of :func:`step_features` (after the constant)."""
OPTIONAL_FEATURES = ("per_prefill_step_s",)
"""Coefficients a profile may leave out (they then count 0)."""

StepFeatures = tuple[float, float, float, float, float]
"""(tokens, requests, context tokens read, prefill attention work, is a prefill step)."""


@dataclass(slots=True, frozen=True)
class CostModel:
    base_s: float
    per_token_s: float
    per_request_s: float
    per_context_token_s: float
    per_prefill_attention_s: float
    per_prefill_step_s: float = 0.0
    decode_batch_residual_s: tuple[tuple[int, float], ...] = ()
    """(batch size, seconds) pairs, sorted by batch size."""
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
            table = tuple(sorted((int(b), float(t)) for b, t in data.get("decode_batch_residual_s", {}).items()))
            return cls(**{k: float(coef[k]) for k in FEATURES if k in coef or k not in OPTIONAL_FEATURES},
                       decode_batch_residual_s=table, name=data.get("name", path.stem))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{path}: not a cost-model profile (needs coefficients "
                              f"{', '.join(FEATURES)}, and optionally decode_batch_residual_s "
                              f"mapping batch sizes to seconds): {e}") from e

    @classmethod
    def from_coefficients(cls, coefficients: dict[str, float],
                          decode_batch_residual_s: dict[int, float] | None = None) -> CostModel:
        c = {k: coefficients.get(k, 0.0) for k in FEATURES}
        return cls(c["base_s"], c["per_token_s"], c["per_request_s"], c["per_context_token_s"],
                   c["per_prefill_attention_s"], c["per_prefill_step_s"],
                   tuple(sorted((decode_batch_residual_s or {}).items())))

    def step_time(self, features: StepFeatures) -> float:
        tokens, requests, context, prefill_attn, prefill_step = features
        t = (self.base_s + self.per_token_s * tokens + self.per_request_s * requests
             + self.per_context_token_s * context + self.per_prefill_attention_s * prefill_attn
             + self.per_prefill_step_s * prefill_step)
        if self.decode_batch_residual_s and not prefill_step:
            t += self.decode_residual(requests)
        return max(t, 0.0)

    def decode_residual(self, batch_size: float) -> float:
        """The residual table at ``batch_size`` (interpolated; 0 without a table)."""
        table = self.decode_batch_residual_s
        if not table:
            return 0.0
        i = bisect.bisect_left(table, (batch_size, float("-inf")))
        if i == 0:
            return table[0][1]
        if i == len(table):
            return table[-1][1]
        (b0, t0), (b1, t1) = table[i - 1], table[i]
        return t0 + (t1 - t0) * (batch_size - b0) / (b1 - b0)


def step_features(scheduler_output: SchedulerOutput, computed_before: dict[str, int]) -> StepFeatures:
    """The cost model's inputs for one step (see :data:`StepFeatures`)."""
    tokens = context = attn = 0.0
    prefill = 0.0
    for rid, n in scheduler_output.num_scheduled_tokens.items():
        c = computed_before[rid]
        tokens += n
        context += c + n
        if n > 1:
            attn += n * (c + n / 2)
            prefill = 1.0
    return tokens, float(len(scheduler_output.num_scheduled_tokens)), context, attn, prefill


@dataclass
class SimulatedRunner(FakeRunner):
    """FakeRunner tokens, cost-model step durations (virtual clock)."""

    cost_model: CostModel = field(default_factory=lambda: CostModel.load("h200-qwen2.5-0.5b-handset"))
    last_features: StepFeatures = (0.0, 0.0, 0.0, 0.0, 0.0)

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
