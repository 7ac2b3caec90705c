"""The ``compare`` section: the policy profiles ``schedkit compare`` runs."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, field_validator

from schedkit.config.base import LocatedValueError, StrictModel
from schedkit.config.cluster import RouterConfig
from schedkit.config.flow import FlowControlConfig
from schedkit.config.plugins import PluginConfig, first_repeat
from schedkit.config.scheduler import SchedulerConfig


class ProfileConfig(StrictModel):
    name: str = Field(min_length=1)
    """Label of this policy profile in tables, JSON and plots."""
    policy: str = "fcfs"
    """scheduler.policy for this profile."""
    plugins: list[PluginConfig] = Field(default_factory=list)
    """Plugins switched on in addition to the config's own."""
    scheduler: dict[str, Any] = Field(default_factory=dict)
    """scheduler keys this profile changes, e.g. ``{async_scheduling: true}`` or
    ``{long_prefill_token_threshold: 256}`` (the policy is set with ``policy``)."""
    router: RouterConfig | None = None
    """The router this profile uses instead of the config's (with ``replicas.count`` >
    1, routing policies are compared like engine policies)."""
    flow_control: FlowControlConfig | None = None
    """The front door's flow control this profile uses instead of the config's (in the
    cluster simulation: fairness and saturation settings compared on a trace)."""


class CompareConfig(StrictModel):
    profiles: list[ProfileConfig] = Field(default_factory=list, min_length=1)
    """The policy profiles ``schedkit compare`` runs on the same workload."""
    seeds: list[int] = Field(default_factory=list)
    """Workload seeds: every profile runs the workload generated with each (empty: the
    workload's own ``seed``). With more than one run per profile the report shows means
    with 95% confidence intervals."""
    repeats: int = Field(default=1, ge=1, le=1000)
    """Runs of every profile on each seed's workload (wall-clock noise on the real
    runner; on a virtual clock the repeats are identical). Runs are interleaved across
    profiles (A B A B ...), so slow drift of the machine affects every profile alike."""

    @field_validator("seeds")
    @classmethod
    def _seeds_unique(cls, seeds: list[int]) -> list[int]:
        k = first_repeat(seeds)
        if k is not None:
            raise LocatedValueError(f"seed {seeds[k]} is listed twice: each seed gives one workload",
                                    (k,), seeds[k])
        return seeds

    @field_validator("profiles")
    @classmethod
    def _names_unique(cls, profiles: list[ProfileConfig]) -> list[ProfileConfig]:
        k = first_repeat([p.name for p in profiles])
        if k is not None:  # results are keyed by name: one would silently replace the other
            raise LocatedValueError(f"the name {profiles[k].name!r} is taken by an earlier profile: each "
                                    "profile needs its own (results are keyed by it)", (k, "name"), profiles[k].name)
        return profiles


def profile_scheduler(base: SchedulerConfig, profile: ProfileConfig) -> SchedulerConfig:
    """``base`` with a compare profile's policy and scheduler overrides.

    Raises:
        ValueError: An override that SchedulerConfig rejects (named with the profile).
    """
    if "policy" in profile.scheduler:
        raise LocatedValueError(f"compare profile {profile.name!r}: set the policy with its "
                                "'policy' key, not under 'scheduler'", ("scheduler", "policy"),
                                profile.scheduler["policy"])
    try:
        return SchedulerConfig.model_validate(
            {**base.model_dump(), **profile.scheduler, "policy": profile.policy})
    except ValidationError as e:
        why = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'scheduler'}: {err['msg']}"
                        for err in e.errors())
        err = e.errors()[0]
        loc = tuple(err["loc"])
        value = err.get("input") if loc else profile.scheduler
        raise LocatedValueError(f"compare profile {profile.name!r}: bad scheduler override: {why}",
                                ("scheduler", *loc), value) from None
