"""The ``workload`` section: the requests ``schedkit run`` and the lab drive through the
engine, their service-level objectives and how fairness is weighed."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from schedkit.config.base import StrictModel


class LengthConfig(StrictModel):
    """A token-length distribution. YAML shorthands: ``128`` (fixed) or ``[lo, hi]`` (uniform)."""

    dist: Literal["fixed", "uniform", "zipf", "lognormal"] = "uniform"
    """fixed: always ``min``; uniform on [min, max]; zipf: P(k) ~ k^-a on [min, max];
    lognormal: median ``median`` and shape ``sigma``, clipped to [min, max]."""
    min: int = Field(default=1, ge=1)
    """Smallest length (the value of a fixed distribution)."""
    max: int = Field(default=512, ge=1)
    """Largest length."""
    a: float = Field(default=1.2, gt=1.0)
    """Zipf exponent."""
    median: float = Field(default=128.0, gt=0)
    """Lognormal median."""
    sigma: float = Field(default=1.0, gt=0)
    """Lognormal shape (standard deviation of the log)."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        if isinstance(v, bool):
            return v
        if isinstance(v, int):
            return {"dist": "fixed", "min": v, "max": v}
        if isinstance(v, (list, tuple)) and len(v) == 2:
            return {"dist": "uniform", "min": v[0], "max": v[1]}
        return v

    @model_validator(mode="after")
    def _check(self) -> LengthConfig:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self


class TenantConfig(StrictModel):
    name: str = Field(min_length=1)
    """Tenant (client) name attached to its requests."""
    weight: float = Field(default=1.0, gt=0)
    """Share of the requests sent by this tenant."""
    share: float = Field(default=1.0, gt=0)
    """The tenant's entitled share of service, by which the lab's fairness metrics divide
    its service (the role of ``vtc``'s ``tenant_weights``)."""
    slo_class: str | None = None
    """The SLO class (a name of the config's ``slo_classes``) its requests carry as their
    hint in the cluster simulation, as a client would send it (``slo_class``); judge the
    class with ``slo.by_tenant``."""
    draft_acceptance: float | None = Field(default=None, ge=0.0, le=1.0)
    """On the fake and simulated runners: the chance that a draft of its requests is
    right (over ``runner.draft_acceptance``), e.g. an agent's repetitive edits against
    chat; None: the runner's."""


class PriorityClassConfig(StrictModel):
    priority: int = 0
    """Priority value (smaller is more important)."""
    weight: float = Field(default=1.0, gt=0)
    """Share of the requests in this class."""


class SharedPrefixConfig(StrictModel):
    count: int = Field(default=4, ge=1)
    """Distinct shared system prompts."""
    length: int = Field(default=256, ge=1)
    """Tokens in each shared prompt (prepended to the request's own prompt)."""
    fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    """Share of the requests that start with one of them."""


class TraceConfig(StrictModel):
    format: Literal["azure", "mooncake", "vidur"]
    """azure: Azure LLM inference 2023 CSV; mooncake: FAST'25 JSONL (hash_ids become shared
    prefixes); vidur: length pairs without timestamps (arrivals generated)."""
    path: str
    """Trace file; relative paths are resolved against the config file, then the repository."""
    time_scale: float = Field(default=1.0, gt=0)
    """Multiplies every arrival time (0.5 replays twice as fast)."""
    start: int = Field(default=0, ge=0)
    """Skip this many requests at the start of the trace."""
    max_prompt_len: int | None = Field(default=None, ge=1)
    """Clip prompts to this many tokens (None: keep, then too-long requests are rejected)."""
    max_output_len: int | None = Field(default=None, ge=1)
    """Clip each request's output length (its max_tokens) to this many tokens."""


class SLOTargets(StrictModel):
    ttft_s: float | None = Field(default=None, gt=0)
    """Time-to-first-token target (seconds)."""
    tpot_s: float | None = Field(default=None, gt=0)
    """Time-per-output-token target (seconds, mean over the request's decode)."""
    e2e_s: float | None = Field(default=None, gt=0)
    """End-to-end latency target (seconds)."""

    def met_by(self, ttft: float | None, tpot: float | None, e2e: float | None) -> bool:
        """Whether a request with these latencies meets every target set (an unset target,
        or a latency the request has none of, such as the TPOT of one token, holds)."""
        checks = ((self.ttft_s, ttft), (self.tpot_s, tpot), (self.e2e_s, e2e))
        return all(target is None or value is None or value <= target for target, value in checks)


SLO_CLASS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
"""An SLO class name: 1-64 letters, digits, ``_ . : -``, starting with a letter or digit
(it becomes a metric label)."""


def check_slo_class_names(classes: dict[str, Any]) -> dict[str, Any]:
    """``classes`` unchanged when every name is an :data:`SLO_CLASS_NAME`.

    Raises:
        ValueError: Naming the first bad name.
    """
    for name in classes:
        if not (isinstance(name, str) and SLO_CLASS_NAME.fullmatch(name)):
            raise ValueError(f"SLO class name {name!r} must be 1-64 letters, digits, '_', '.', ':' or '-', "
                             "starting with a letter or digit")
    return classes


class SLOConfig(SLOTargets):
    attainment: float = Field(default=0.9, gt=0, le=1)
    """Share of requests that must meet every target for a rate to count as sustained."""
    by_priority: dict[int, SLOTargets] = Field(default_factory=dict)
    """Targets of a priority class (``Request.priority``), each overriding the targets above."""
    by_tenant: dict[str, SLOTargets] = Field(default_factory=dict)
    """Targets of a tenant, each overriding its priority class's and the targets above."""

    @field_validator("by_priority", mode="before")
    @classmethod
    def _int_keys(cls, value: Any) -> Any:
        """JSON (and a dumped config) writes the priorities as strings: read them back."""
        if isinstance(value, dict):
            return {int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k: v
                    for k, v in value.items()}
        return value

    def class_target(self, name: str, tenant: str, priority: int) -> float | None:
        """The value of target ``name`` set for the class itself: the tenant's entry
        first, then the priority class's; None when neither sets it."""
        for entry in (self.by_tenant.get(tenant), self.by_priority.get(priority)):
            if entry is not None and (value := getattr(entry, name)) is not None:
                return value
        return None

    def for_class(self, tenant: str, priority: int) -> SLOTargets:
        """The targets a request of ``tenant`` and ``priority`` is judged by: each target
        from the tenant's entry if set there, else the priority class's, else the base."""
        if tenant not in self.by_tenant and priority not in self.by_priority:
            return self
        values = {}
        for name in SLOTargets.model_fields:
            value = self.class_target(name, tenant, priority)
            values[name] = getattr(self, name) if value is None else value
        return SLOTargets(**values)


class FairnessConfig(StrictModel):
    input_weight: float = Field(default=1.0, ge=0)
    """Cost of one prompt token in a tenant's service (VTC's w_p)."""
    output_weight: float = Field(default=2.0, ge=0)
    """Cost of one output token in a tenant's service (VTC's w_q)."""
    window_s: float | None = Field(default=None, gt=0)
    """Length of the intervals over which Jain's index of backlogged tenants is taken
    (null: a twentieth of the run)."""


class WorkloadConfig(StrictModel):
    kind: Literal["poisson", "gamma", "fixed", "trace"] = "poisson"
    """Arrival process of a synthetic workload, or ``trace`` to replay ``trace``."""
    rate: float = Field(default=4.0, gt=0)
    """Mean arrivals per second (synthetic, and vidur traces)."""
    burstiness: float = Field(default=1.0, gt=0)
    """Coefficient of variation of gamma inter-arrival times (1 = Poisson, > 1 burstier)."""
    num_requests: int = Field(default=200, ge=1)
    """Requests to generate, or the most to take from a trace."""
    prompt_len: LengthConfig = Field(default_factory=lambda: LengthConfig(min=32, max=512))
    """Prompt-length distribution (synthetic)."""
    output_len: LengthConfig = Field(default_factory=lambda: LengthConfig(min=16, max=256))
    """Output-length distribution (synthetic, and every request's max_tokens)."""
    tenants: list[TenantConfig] = Field(default_factory=list)
    """Tenants with weights; requests are assigned at random by weight."""
    priorities: list[PriorityClassConfig] = Field(default_factory=list)
    """Priority classes with weights."""
    shared_prefix: SharedPrefixConfig | None = None
    """Shared system prompts (synthetic)."""
    trace: TraceConfig | None = None
    """The trace to replay when kind is ``trace``."""
    slo: SLOConfig = Field(default_factory=SLOConfig)
    """Service-level objectives used by goodput, attainment and rate sweeps."""
    fairness: FairnessConfig = Field(default_factory=FairnessConfig)
    """How the lab weighs tenants' service in its fairness metrics."""
    prompts: list[str] = Field(default_factory=list)
    """Text prompts (synthetic kinds), cycled over num_requests; they need a model with a
    tokenizer and are sent through its chat template when it has one."""
    seed: int = 0
    """Seed: the same config always gives the same requests."""

    @property
    def tenant_shares(self) -> dict[str, float]:
        """``tenant -> share`` of the listed tenants (the fairness metrics' weights)."""
        return {t.name: t.share for t in self.tenants}

    @model_validator(mode="after")
    def _check_trace(self) -> WorkloadConfig:
        if self.kind == "trace" and self.trace is None:
            raise ValueError("kind 'trace' needs a trace section (format, path)")
        if self.kind != "trace" and self.trace is not None:
            raise ValueError(f"a trace section needs kind 'trace', not {self.kind!r}")
        return self
