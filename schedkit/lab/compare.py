"""``schedkit compare``: several policy profiles on one workload, and load sweeps."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schedkit.config import Config, ProfileConfig, profile_scheduler
from schedkit.errors import ConfigError, PluginError
from schedkit.lab.metrics import RequestMetrics, summarize
from schedkit.lab.simulate import run_workload
from schedkit.lab.workloads import generate
from schedkit.plugins.manager import get_plugin_manager

SWEEP_KNOBS = ("rate", "time_scale")


def profile_config(config: Config, profile: ProfileConfig) -> Config:
    """The config with the profile's policy, its scheduler overrides and its extra
    plugins switched on."""
    return config.model_copy(update={
        "scheduler": profile_scheduler(config.scheduler, profile),
        "plugins": [*config.plugins, *profile.plugins],
    })


def profiles_of(config: Config) -> list[ProfileConfig]:
    if config.compare is not None:
        return list(config.compare.profiles)
    return [ProfileConfig(name=config.scheduler.policy, policy=config.scheduler.policy)]


def check_profiles(config: Config) -> None:
    """Build every profile's plugins before anything runs, so that a profile naming an
    uninstalled or broken policy fails at once, not after the profiles before it ran.

    Raises:
        ConfigError, PluginError: The first bad profile's error (which names the file
            and line), with the profile's name appended.
    """
    for profile in profiles_of(config):
        try:
            get_plugin_manager(profile_config(config, profile))
        except ConfigError as e:
            raise ConfigError(f"{e} (compare profile {profile.name!r})") from e
        except PluginError as e:
            raise PluginError(f"{e} (compare profile {profile.name!r})", plugin=e.plugin,
                              hook=e.hook, request_id=e.request_id) from e


@dataclass(slots=True)
class CompareResult:
    summaries: dict[str, dict[str, Any]] = field(default_factory=dict)
    metrics: dict[str, list[RequestMetrics]] = field(default_factory=dict)
    failed: dict[str, dict[str, str]] = field(default_factory=dict)
    sweep: dict[str, list[tuple[float, dict[str, Any]]]] = field(default_factory=dict)
    sustained: dict[str, float | None] = field(default_factory=dict)


def compare(config: Config, *, base_dir: str | Path | None = None) -> CompareResult:
    """Run every profile on the same (generated once) workload (every profile is checked
    first: :func:`check_profiles`)."""
    check_profiles(config)
    workload = generate(config.workload, config.runner.vocab_size, base_dir)
    result = CompareResult()
    for profile in profiles_of(config):
        run = run_workload(profile_config(config, profile), workload)
        result.summaries[profile.name] = summarize_run(config, run.metrics)
        result.metrics[profile.name] = run.metrics
        result.failed[profile.name] = run.failed
    return result


def parse_sweep(spec: str) -> tuple[str, list[float]]:
    """'rate=1,2,4' -> ('rate', [1.0, 2.0, 4.0])."""
    knob, _, values = spec.partition("=")
    if knob not in SWEEP_KNOBS or not values:
        raise ConfigError(f"--sweep {spec!r}: expected KNOB=V1,V2,... with KNOB one of {SWEEP_KNOBS}")
    try:
        vals = [float(v) for v in values.split(",")]
    except ValueError as e:
        raise ConfigError(f"--sweep {spec!r}: values must be numbers") from e
    if any(v <= 0 for v in vals):
        raise ConfigError(f"--sweep {spec!r}: values must be positive")
    return knob, sorted(vals)


def sweep(config: Config, knob: str, values: list[float], *, base_dir: str | Path | None = None,
          result: CompareResult | None = None) -> CompareResult:
    """Run every profile at every load; record the highest load meeting the SLO with every
    lower load meeting it too (:func:`sustained_load`).

    ``rate`` scales synthetic (and vidur) arrivals; ``time_scale`` stretches trace
    arrival times (smaller is more load), so the sustained load is reported as its
    inverse. A load is sustained when the SLO attainment reaches ``slo.attainment``.
    """
    check_profiles(config)
    result = result or CompareResult()
    wl = config.workload
    if knob == "time_scale":
        if wl.trace is None:
            raise ConfigError("--sweep time_scale needs a trace workload; use rate for synthetic ones")
        workloads = {v: wl.model_copy(update={"trace": wl.trace.model_copy(update={"time_scale": v})})
                     for v in values}
    else:
        workloads = {v: wl.model_copy(update={"rate": v}) for v in values}
    generated = {v: generate(w, config.runner.vocab_size, base_dir) for v, w in workloads.items()}
    for profile in profiles_of(config):
        cfg = profile_config(config, profile)
        points = []
        for v in values:
            summary = summarize_run(config, run_workload(cfg, generated[v]).metrics)
            points.append((1.0 / v if knob == "time_scale" else v, summary))
        points.sort(key=lambda p: p[0])
        result.sweep[profile.name] = points
        result.sustained[profile.name] = sustained_load(points, wl.slo.attainment)
    return result


def sustained_load(points: list[tuple[float, dict[str, Any]]], attainment: float) -> float | None:
    """The highest load such that it and every lower load meet ``attainment`` (None when
    the lowest fails): a load that passes above one that failed does not count."""
    best = None
    for load, summary in sorted(points, key=lambda p: p[0]):
        if not summary["slo_attainment"] >= attainment:
            break
        best = load
    return best


def summarize_run(config: Config, metrics: list[RequestMetrics]) -> dict[str, Any]:
    """:func:`summarize` with the workload's SLO, fairness weights and tenant shares."""
    wl = config.workload
    return summarize(metrics, wl.slo, fairness=wl.fairness,
                     shares=wl.tenant_shares)
