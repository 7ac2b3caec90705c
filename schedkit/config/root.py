"""The root :class:`Config`: every section, and where its YAML switches plugins on."""

from __future__ import annotations

from typing import Any

from pydantic import Field, PrivateAttr, field_validator, model_validator

from schedkit.config.base import LocatedValueError, StrictModel
from schedkit.config.cache import CacheConfig
from schedkit.config.cluster import ReplicasConfig, RouterConfig
from schedkit.config.compare import CompareConfig, profile_scheduler
from schedkit.config.flow import FlowControlConfig
from schedkit.config.locator import ConfigOrigin, line_of, scalars
from schedkit.config.model import ModelConfig
from schedkit.config.plugins import PluginConfig, check_listed_once
from schedkit.config.runner import FakeRunnerConfig, RunnerConfig
from schedkit.config.scheduler import SchedulerConfig
from schedkit.config.server import ServerConfig
from schedkit.config.structured import StructuredOutputsConfig
from schedkit.config.workload import SLOTargets, WorkloadConfig, check_slo_class_names


class Config(StrictModel):
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The model to serve."""
    runner: RunnerConfig = Field(default_factory=FakeRunnerConfig)
    """The model runner."""
    cache: CacheConfig = Field(default_factory=CacheConfig)
    """The paged KV cache."""
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    """The scheduler and its policy."""
    plugins: list[PluginConfig] = Field(default_factory=list)
    """Extra plugins to switch on (installed is not enabled)."""
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig)
    """The workload that ``schedkit run`` drives through the engine."""
    compare: CompareConfig | None = None
    """Policy profiles for ``schedkit compare`` (default: just this config's policy)."""
    server: ServerConfig = Field(default_factory=ServerConfig)
    """The HTTP server of ``schedkit serve``."""
    replicas: ReplicasConfig = Field(default_factory=ReplicasConfig)
    """Data-parallel replicas (one engine unless ``count`` is more)."""
    router: RouterConfig = Field(default_factory=RouterConfig)
    """The router in front of the replicas."""
    structured_outputs: StructuredOutputsConfig = Field(default_factory=StructuredOutputsConfig)
    """Grammar-constrained decoding: the backend, its compile threads and cache."""
    slo_classes: dict[str, SLOTargets] = Field(default_factory=dict)
    """Named service classes a request may ask for (``slo_class``: an OpenAI body field, the
    ``x-schedkit-slo-class`` header, ``AsyncLLM.generate(hints=...)``), each with its
    TTFT, TPOT and end-to-end targets; a request of a class gets the class's targets
    where it set none, and a class not named here is refused."""
    flow_control: FlowControlConfig = Field(default_factory=FlowControlConfig)
    """Queues at the front door while the engines are saturated (off by default)."""

    _origin: ConfigOrigin | None = PrivateAttr(default=None)

    def where_switched_on(self, name: str) -> str | None:
        """``file:line`` where the YAML switches plugin (or policy) ``name`` on: the first
        ``scheduler.policy``, ``plugins[i].name``, ``compare.profiles[k].policy`` or
        ``compare.profiles[k].plugins[j].name`` that names it; else the file alone (None for
        a config not read from a file)."""
        if self._origin is None:
            return None
        for loc, node in scalars(self._origin.root):
            if node.value == name and _switches_on(loc):
                return f"{self._origin.source}:{node.start_mark.line + 1}"
        return self._origin.source

    def where(self, *loc: int | str) -> str | None:
        """``file:line`` of the key at ``loc`` (e.g. ``"runner", "kind"``) in the YAML this
        config was read from; the line of its nearest written parent when the key is left
        out; None for a config not read from a file."""
        if self._origin is None:
            return None
        line = line_of(self._origin.root, loc)
        return self._origin.source if line is None else f"{self._origin.source}:{line}"

    @field_validator("slo_classes")
    @classmethod
    def _slo_class_names(cls, value: dict[str, SLOTargets]) -> dict[str, SLOTargets]:
        return check_slo_class_names(value)

    @model_validator(mode="after")
    def _check_tenant_slo_classes(self) -> Config:
        for i, tenant in enumerate(self.workload.tenants):
            if tenant.slo_class is not None and tenant.slo_class not in self.slo_classes:
                known = ", ".join(sorted(self.slo_classes)) or "none: the config names no slo_classes"
                raise LocatedValueError(f"tenant {tenant.name!r}: slo_class {tenant.slo_class!r} is not one of "
                                        f"the config's slo_classes ({known})",
                                        ("workload", "tenants", i, "slo_class"), tenant.slo_class)
        return self

    @model_validator(mode="after")
    def _check_async_drafting(self) -> Config:
        schedulers: list[tuple[tuple[str | int, ...], SchedulerConfig]] = [(("scheduler",), self.scheduler)]
        for k, profile in enumerate(self.compare.profiles if self.compare is not None else ()):
            try:
                schedulers.append((("compare", "profiles", k, "scheduler"), profile_scheduler(self.scheduler, profile)))
            except LocatedValueError:  # a bad override: _check_plugins_unique names it where it is
                continue
        for loc, sc in schedulers:
            if sc.async_scheduling and sc.num_speculative_tokens:
                why = drafts_in_step_refusal(self.runner)
                if why is not None:
                    raise LocatedValueError(f"async_scheduling with num_speculative_tokens: {why}",
                                            (*loc, "async_scheduling"), True)
        return self

    @model_validator(mode="after")
    def _check_plugins_unique(self) -> Config:
        check_listed_once(self.plugins, "plugin")
        for k, profile in enumerate(self.compare.profiles if self.compare is not None else ()):
            try:
                profile_scheduler(self.scheduler, profile)
            except LocatedValueError as e:  # re-anchored at the profile's key
                raise LocatedValueError(str(e), ("compare", "profiles", k, *e.loc), e.value) from None
        return self


def drafts_in_step_refusal(runner: Any) -> str | None:
    """Why ``runner`` cannot draft inside a step, as asynchronous scheduling with
    speculation needs (None: it can): the fake and simulated runners and the paged
    runner's drafting models can. n-gram and suffix decoding often find no draft, and
    under asynchronous scheduling a step's draft slots are planned before the proposer
    runs, so each slot it leaves empty would be computed for nothing: as vLLM's n-gram,
    they run with synchronous scheduling. A plugin runner says itself, at start-up
    (``drafts_in_step``)."""
    if runner.kind in ("fake", "simulated"):
        return None
    if runner.kind == "paged":
        if runner.speculative_method in ("draft_model", "eagle"):
            return None
        return (f"speculative_method {runner.speculative_method!r} often finds no draft, and the step's draft "
                "slots are planned before it runs (each empty one computed for nothing); use draft_model or "
                "eagle, or turn async_scheduling off")
    return None


def _switches_on(loc: tuple[int | str, ...]) -> bool:
    """Whether the YAML value at ``loc`` names a policy or plugin to switch on."""
    if loc in (("scheduler", "policy"), ("router", "policy")):
        return True
    if len(loc) == 3 and loc[0] == "plugins" and loc[2] == "name":
        return True
    if len(loc) == 4 and loc[:2] == ("router", "plugins") and loc[3] == "name":
        return True
    if loc in (("flow_control", "fairness"), ("flow_control", "saturation")):
        return True
    if len(loc) == 4 and loc[:2] == ("flow_control", "plugins") and loc[3] == "name":
        return True
    if loc[:2] == ("compare", "profiles"):
        return (len(loc) == 4 and loc[3] == "policy"
                or len(loc) == 6 and loc[3] == "plugins" and loc[5] == "name"
                or len(loc) == 5 and loc[3:] == ("router", "policy")
                or len(loc) == 7 and loc[3:5] == ("router", "plugins") and loc[6] == "name")
    return False
