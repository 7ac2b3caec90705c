"""``schedkit compare``: several policy profiles on one workload, and load sweeps.

Every run is one *point* (:mod:`schedkit.lab.points`): one profile's config on one
generated workload. A profile runs once per workload seed and repeat (``compare.seeds``,
``compare.repeats``); the runs are submitted interleaved across profiles (A B A B ...),
so on the real runner slow drift of the machine falls on every profile alike. With
several runs a profile's summary is the mean of every figure over its runs, with the
half-width of the 95% t-interval beside it (:mod:`schedkit.lab.stats`).

The points run on a :class:`PointRunner` (serially here by default, or as Ray tasks);
results are put together by profile, seed and repeat whatever order they ran in, so
both runners give the same results, to the byte in ``results.json``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schedkit.config import Config, ProfileConfig, WorkloadConfig, profile_scheduler
from schedkit.config.plugins import first_repeat
from schedkit.errors import ConfigError, PluginError
from schedkit.lab.metrics import RequestMetrics
from schedkit.lab.points import (
    Pending,
    Point,
    PointResult,
    PointRunner,
    RayRunner,
    SerialRunner,
    run_point,
    summarize_run,
)
from schedkit.lab.stats import ci_summary, mean_summary
from schedkit.lab.workloads import WorkloadRequest, generate
from schedkit.plugins.manager import get_plugin_manager, get_router_plugin_manager

__all__ = [
    "SWEEP_KNOBS", "CompareResult", "Point", "PointResult", "PointRunner", "RayRunner", "Sample",
    "SerialRunner", "Submitted", "SweepPoint", "check_profiles", "compare", "parse_seeds",
    "parse_sweep", "profile_config", "profiles_of", "request_records", "run_point", "runs_of",
    "submit", "summarize_run", "sustained_load", "sweep",
]

SWEEP_KNOBS = ("rate", "time_scale")


def profile_config(config: Config, profile: ProfileConfig) -> Config:
    """The config with the profile's policy, its scheduler overrides, its extra plugins
    switched on (a plugin the config lists too takes the profile's settings: one
    instance), and its router and flow control where it sets them."""
    own = {p.name for p in profile.plugins}
    return config.model_copy(update={
        "scheduler": profile_scheduler(config.scheduler, profile),
        "plugins": [*(p for p in config.plugins if p.name not in own), *profile.plugins],
        "router": profile.router if profile.router is not None else config.router,
        "flow_control": profile.flow_control if profile.flow_control is not None else config.flow_control,
    })


def profiles_of(config: Config) -> list[ProfileConfig]:
    if config.compare is not None:
        return list(config.compare.profiles)
    return [ProfileConfig(name=config.scheduler.policy, policy=config.scheduler.policy)]


def runs_of(config: Config, seeds: Sequence[int] | None = None,
            repeats: int | None = None) -> tuple[list[int], int]:
    """The workload seeds and the repeats each profile runs: ``seeds`` and ``repeats``
    when given (the command line), else the ``compare`` section's, else the workload's
    own seed, once.

    Raises:
        ConfigError: ``repeats`` below 1, or a seed given twice.
    """
    cmp = config.compare
    seeds = list(seeds) if seeds else list(cmp.seeds) if cmp is not None and cmp.seeds else [config.workload.seed]
    repeats = repeats if repeats is not None else cmp.repeats if cmp is not None else 1
    if repeats < 1:
        raise ConfigError(f"--repeats {repeats}: must be 1 or more")
    if len(set(seeds)) < len(seeds):
        raise ConfigError(f"--seeds {','.join(map(str, seeds))}: a seed is listed twice")
    return seeds, repeats


def check_profiles(config: Config) -> None:
    """Build every profile's plugins before anything runs, so that a profile naming an
    uninstalled or broken policy fails at once, not after the profiles before it ran.

    Raises:
        ConfigError, PluginError: The first bad profile's error (which names the file
            and line), with the profile's name appended.
    """
    for profile in profiles_of(config):
        try:
            cfg = profile_config(config, profile)
            get_plugin_manager(cfg)
            if cfg.replicas.count > 1:
                get_router_plugin_manager(cfg)
        except ConfigError as e:
            raise ConfigError(f"{e} (compare profile {profile.name!r})") from e
        except PluginError as e:
            raise PluginError(f"{e} (compare profile {profile.name!r})", plugin=e.plugin,
                              hook=e.hook, request_id=e.request_id) from e


# -- results ----------------------------------------------------------------------------------

@dataclass(slots=True)
class Sample:
    """One run of a profile: its workload seed, its repeat (0, 1, ...) and its result."""

    seed: int
    repeat: int
    result: PointResult


@dataclass(slots=True)
class SweepPoint:
    """One profile at one value of the swept knob, over its runs."""

    knob: float
    """The knob's value (a rate, or a trace time_scale)."""
    load: float
    """The offered load, requests per second over the arrival window (mean over runs)."""
    summary: dict[str, Any]
    """The run's summary, or with several runs every figure's mean."""
    ci95: dict[str, Any] | None
    """With several runs: the half-width of each figure's 95% t-interval."""
    samples: list[Sample]


@dataclass(slots=True)
class CompareResult:
    summaries: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per profile: its run's summary, or with several runs every figure's mean."""
    ci95: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per profile, with several runs: the half-width of each figure's 95% t-interval."""
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    """Per profile: every run, by seed and then repeat."""
    metrics: dict[str, list[RequestMetrics]] = field(default_factory=dict)
    """Per profile: the requests of all its runs, one run after the other."""
    failed: dict[str, dict[str, str]] = field(default_factory=dict)
    sweep: dict[str, list[SweepPoint]] = field(default_factory=dict)
    sustained: dict[str, float | None] = field(default_factory=dict)
    """Per profile: the highest offered load (req/s) it sustains (:func:`sustained_load`)."""
    seeds: list[int] = field(default_factory=list)
    repeats: int = 1

    @property
    def num_runs(self) -> int:
        """Runs of each profile at each load: seeds x repeats."""
        return len(self.seeds) * self.repeats


def _combine(samples: list[Sample]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The summary of one run, or the mean summary and the half-widths of several."""
    summaries = [s.result.summary for s in samples]
    if len(summaries) == 1:
        return summaries[0], None
    return mean_summary(summaries), ci_summary(summaries)


def _tag(samples: list[Sample], rid: str, s: Sample) -> str:
    return rid if len(samples) == 1 else f"{rid} (seed {s.seed}, repeat {s.repeat})"


def request_records(samples: list[Sample]) -> list[dict[str, Any]]:
    """Every request of the runs as ``results.json`` lists it; with several runs each
    record also names its ``seed`` and ``repeat``."""
    if len(samples) == 1:
        return [m.to_dict() for m in samples[0].result.metrics]
    return [{**m.to_dict(), "seed": s.seed, "repeat": s.repeat} for s in samples for m in s.result.metrics]


@dataclass(slots=True)
class Submitted:
    """The single-load comparison and/or the sweep, submitted; :meth:`compared` and
    :meth:`swept` wait for their part and fill in the result."""

    config: Config
    result: CompareResult
    knob: str | None = None
    compare_points: list[tuple[str, int, int, Pending]] = field(default_factory=list)
    """(profile name, seed, repeat, pending result), in the order submitted."""
    sweep_points: list[tuple[str, float, int, int, Pending]] = field(default_factory=list)
    """(profile name, knob value, seed, repeat, pending result), in the order submitted."""

    def compared(self) -> CompareResult:
        runs: dict[str, list[Sample]] = {}
        for name, seed, repeat, pending in self.compare_points:  # serially: they run now, in order
            runs.setdefault(name, []).append(Sample(seed, repeat, pending()))
        for name, samples in runs.items():
            res = self.result
            res.samples[name] = samples
            res.summaries[name], ci = _combine(samples)
            if ci is not None:
                res.ci95[name] = ci
            res.metrics[name] = [m for s in samples for m in s.result.metrics]
            res.failed[name] = {_tag(samples, rid, s): err for s in samples for rid, err in s.result.failed.items()}
        self.compare_points = []
        return self.result

    def swept(self) -> CompareResult:
        runs: dict[str, dict[float, list[Sample]]] = {}
        for name, value, seed, repeat, pending in self.sweep_points:
            runs.setdefault(name, {}).setdefault(value, []).append(Sample(seed, repeat, pending()))
        for name, by_value in runs.items():
            points = []
            for value, samples in by_value.items():
                summary, ci = _combine(samples)
                points.append(SweepPoint(value, summary["offered_load_req_s"], summary, ci, samples))
            points.sort(key=lambda p: -p.knob if self.knob == "time_scale" else p.knob)  # by load
            self.result.sweep[name] = points
            self.result.sustained[name] = sustained_load([(p.load, p.summary) for p in points],
                                                         self.config.workload.slo.attainment)
        self.sweep_points = []
        return self.result

    def done(self) -> CompareResult:
        self.compared()
        return self.swept()


def _seeded(wl: WorkloadConfig, seed: int) -> WorkloadConfig:
    return wl if wl.seed == seed else wl.model_copy(update={"seed": seed})


def _knob_workloads(wl: WorkloadConfig, knob: str, values: Sequence[float]) -> dict[float, WorkloadConfig]:
    if knob not in SWEEP_KNOBS:
        raise ConfigError(f"sweep knob {knob!r}: expected one of {SWEEP_KNOBS}")
    if knob == "rate":
        return {v: wl.model_copy(update={"rate": v}) for v in values}
    if wl.trace is None:
        raise ConfigError("--sweep time_scale needs a trace workload; use rate for synthetic ones")
    trace = wl.trace
    return {v: wl.model_copy(update={"trace": trace.model_copy(update={"time_scale": v})}) for v in values}


def submit(config: Config, *, single: bool = True, knob: str | None = None,
           values: Sequence[float] = (), base_dir: str | Path | None = None,
           runner: PointRunner | None = None, result: CompareResult | None = None,
           seeds: Sequence[int] | None = None, repeats: int | None = None,
           progress: bool = False) -> Submitted:
    """Check every profile (:func:`check_profiles`), generate the workloads, and submit
    the single-load comparison (``single``) and the sweep (``knob`` over ``values``:
    :func:`sweep`) to ``runner`` (default: :class:`SerialRunner`) in one go, every
    profile on every seed's workload ``repeats`` times (:func:`runs_of`), interleaved
    across profiles. Without the single-load comparison the sweep points keep their
    per-request metrics. ``progress``: a progress bar per point on stderr.

    Raises:
        ConfigError, PluginError: A bad profile, a sweep knob the workload cannot take,
            or a workload that cannot be generated; before any point runs.
    """
    check_profiles(config)
    runner = runner or SerialRunner()
    profiles = [(p.name, profile_config(config, p)) for p in profiles_of(config)]
    seeds, repeats = runs_of(config, seeds, repeats)
    runs = [(seed, r) for seed in seeds for r in range(repeats)]
    wl, vocab = config.workload, config.runner.vocab_size
    slots: list[tuple[str, float | None, int, int]] = []
    points: list[Point] = []

    def add(name: str, cfg: Config, work: list[WorkloadRequest], value: float | None, seed: int, r: int) -> None:
        slots.append((name, value, seed, r))
        points.append(Point(cfg, work, keep_metrics=value is None or not single))

    if single:
        for seed in seeds:
            wl_s = _seeded(wl, seed)
            work = generate(wl_s, vocab, base_dir)
            for r in range(repeats):
                for name, cfg in profiles:
                    add(name, cfg.model_copy(update={"workload": wl_s}), work, None, seed, r)
    if knob is not None:
        by_value = _knob_workloads(wl, knob, values)
        generated = {(v, seed): generate(_seeded(w, seed), vocab, base_dir)
                     for v, w in by_value.items() for seed in seeds}
        for v in values:
            for seed, r in runs:
                for name, cfg in profiles:
                    add(name, cfg.model_copy(update={"workload": _seeded(by_value[v], seed)}),
                        generated[(v, seed)], v, seed, r)
    if progress:
        for i, (p, (name, value, seed, r)) in enumerate(zip(points, slots, strict=True)):
            p.progress = _label(i, len(points), name, knob, value, seed if len(seeds) > 1 else None,
                                r if repeats > 1 else None)
    pending = runner.submit(points)
    out = Submitted(config, result if result is not None else CompareResult(), knob)
    out.result.seeds, out.result.repeats = seeds, repeats
    for (name, value, seed, r), result_of in zip(slots, pending, strict=True):
        if value is None:
            out.compare_points.append((name, seed, r, result_of))
        else:
            out.sweep_points.append((name, value, seed, r, result_of))
    return out


def _label(i: int, n: int, name: str, knob: str | None, value: float | None,
           seed: int | None, repeat: int | None) -> str:
    parts = [f"[{i + 1}/{n}] {name}"]
    if value is not None:
        parts.append(f"{knob}={value:g}")
    if seed is not None:
        parts.append(f"seed {seed}")
    if repeat is not None:
        parts.append(f"repeat {repeat + 1}")
    return " ".join(parts)


def compare(config: Config, *, base_dir: str | Path | None = None,
            runner: PointRunner | None = None, seeds: Sequence[int] | None = None,
            repeats: int | None = None) -> CompareResult:
    """Run every profile on the same (generated once per seed) workload (every profile is
    checked first: :func:`check_profiles`), on ``runner`` (default: one after the other
    here)."""
    return submit(config, base_dir=base_dir, runner=runner, seeds=seeds, repeats=repeats).compared()


def parse_sweep(spec: str) -> tuple[str, list[float]]:
    """'rate=1,2,4' -> ('rate', [1.0, 2.0, 4.0])."""
    knob, _, values = spec.partition("=")
    if knob not in SWEEP_KNOBS or not values:
        raise ConfigError(f"--sweep {spec!r}: expected KNOB=V1,V2,... with KNOB one of {SWEEP_KNOBS}")
    try:
        vals = [float(v) for v in values.split(",")]
    except ValueError as e:
        raise ConfigError(f"--sweep {spec!r}: values must be numbers") from e
    if not all(0 < v < math.inf for v in vals):  # NaN fails both comparisons
        raise ConfigError(f"--sweep {spec!r}: values must be positive and finite")
    return knob, sorted(vals)


def parse_seeds(spec: str) -> list[int]:
    """'0,1,2' -> [0, 1, 2].

    Raises:
        ConfigError: Not whole numbers separated by commas.
    """
    try:
        seeds = [int(s) for s in spec.split(",")]
    except ValueError:
        raise ConfigError(f"--seeds {spec!r}: expected whole numbers separated by commas, "
                          "e.g. 0,1,2") from None
    twice = first_repeat(seeds)
    if twice is not None:
        raise ConfigError(f"--seeds {spec!r}: seed {seeds[twice]} is listed twice")
    return seeds


def sweep(config: Config, knob: str, values: list[float], *, base_dir: str | Path | None = None,
          result: CompareResult | None = None, runner: PointRunner | None = None,
          seeds: Sequence[int] | None = None, repeats: int | None = None) -> CompareResult:
    """Run every profile at every load; record the highest offered load meeting the SLO
    with every lower load meeting it too (:func:`sustained_load`).

    ``rate`` scales synthetic (and vidur) arrivals; ``time_scale`` stretches trace
    arrival times (smaller is more load). Either way a point's load is the offered load
    it measured: requests per second over its arrival window. A load is sustained when
    the SLO attainment (the mean over the runs) reaches ``slo.attainment``. The points
    run on ``runner`` (default: one after the other here).
    """
    return submit(config, single=False, knob=knob, values=values, base_dir=base_dir,
                  runner=runner, result=result, seeds=seeds, repeats=repeats).swept()


def sustained_load(points: list[tuple[float, dict[str, Any]]], attainment: float) -> float | None:
    """The highest load such that it and every lower load meet ``attainment`` (None when
    the lowest fails): a load that passes above one that failed does not count."""
    best = None
    for load, summary in sorted(points, key=lambda p: p[0]):
        if not summary["slo_attainment"] >= attainment:
            break
        best = load
    return best
