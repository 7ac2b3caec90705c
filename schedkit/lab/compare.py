"""``schedkit compare``: several policy profiles on one workload, and load sweeps.

Every run is one *point*: one profile's config on one generated workload
(:func:`run_point`). A :class:`PointRunner` runs the points: :class:`SerialRunner` one
after the other in this process (the default), :class:`RayRunner` all at once as Ray
tasks. Each point builds its own engine from its config and workload alone (with the fake
or simulated runner, on a virtual clock), and the results are put together in the same
order either way, so both give the same results, to the byte in ``results.json``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from schedkit.config import Config, ProfileConfig, profile_scheduler
from schedkit.errors import ConfigError, PluginError, SchedkitError
from schedkit.lab.cluster_sim import run_cluster_workload, summarize_cluster
from schedkit.lab.metrics import RequestMetrics, summarize
from schedkit.lab.simulate import run_workload
from schedkit.lab.workloads import WorkloadRequest, generate
from schedkit.plugins.manager import get_plugin_manager, get_router_plugin_manager

SWEEP_KNOBS = ("rate", "time_scale")


def profile_config(config: Config, profile: ProfileConfig) -> Config:
    """The config with the profile's policy, its scheduler overrides and its extra
    plugins switched on."""
    return config.model_copy(update={
        "scheduler": profile_scheduler(config.scheduler, profile),
        "plugins": [*config.plugins, *profile.plugins],
        "router": profile.router if profile.router is not None else config.router,
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
            cfg = profile_config(config, profile)
            get_plugin_manager(cfg)
            if cfg.replicas.count > 1:
                get_router_plugin_manager(cfg)
        except ConfigError as e:
            raise ConfigError(f"{e} (compare profile {profile.name!r})") from e
        except PluginError as e:
            raise PluginError(f"{e} (compare profile {profile.name!r})", plugin=e.plugin,
                              hook=e.hook, request_id=e.request_id) from e


# -- points and the runners that run them ---------------------------------------------------

@dataclass(slots=True)
class PointResult:
    """What one point gives back: its summary (under the workload's SLO, fairness weights
    and tenant shares), per-request metrics and failed requests (request_id -> error)."""

    summary: dict[str, Any]
    metrics: list[RequestMetrics]
    failed: dict[str, str]


def run_point(config: Config, workload: list[WorkloadRequest]) -> PointResult:
    """Run one point: ``workload`` through an engine built from ``config`` (a profile's
    config, its ``workload`` section the point's). The one function the serial and the
    Ray runner both call; nothing in its result depends on wall time or on which process
    ran it."""
    if config.replicas.count > 1:  # the replicas on one virtual clock, under the router
        crun = run_cluster_workload(config, workload)
        cluster = summarize_cluster(config, crun)
        summary = cluster.pop("overall")
        summary["cluster"] = cluster
        return PointResult(summary, crun.metrics, crun.failed)
    run = run_workload(config, workload)
    return PointResult(summarize_run(config, run.metrics), run.metrics, run.failed)


@dataclass(slots=True)
class Point:
    """One unit of work: a profile's config on a workload."""

    config: Config
    workload: list[WorkloadRequest]
    keep_metrics: bool = True
    """False when only the summary is wanted (sweep points): the per-request metrics are
    dropped where the point ran instead of shipped back."""


Pending = Callable[[], PointResult]
"""A submitted point: call it for its result (it blocks, or runs the point, until done)."""


class PointRunner(Protocol):
    def submit(self, points: Sequence[Point]) -> list[Pending]:
        """Start ``points`` (or get ready to); one pending result each, in their order."""
        ...


def _point_task(config: Config, workload: list[WorkloadRequest], keep_metrics: bool) -> PointResult:
    result = run_point(config, workload)
    if not keep_metrics:
        result.metrics = []
    return result


class SerialRunner:
    """Each point in this process when its result is asked for (so in order, the
    single-load comparison before the sweep)."""

    def submit(self, points: Sequence[Point]) -> list[Pending]:
        return [_lazy(p) for p in points]


def _lazy(p: Point) -> Pending:
    return lambda: _point_task(p.config, p.workload, p.keep_metrics)


_FORWARDED_ENV = ("SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD", "SCHEDKIT_DISABLE_PLUGINS", "PYTHONHASHSEED")


class RayRunner:
    """Every point as a Ray task, all submitted at once; each distinct workload goes into
    the object store once (``ray.put``), shared by the profiles that run it.

    Args:
        address: The Ray cluster (:func:`schedkit.cluster.ray_util.init_ray`); None
            starts a local one when the first points are submitted, stopped by
            :meth:`close`.

    Raises:
        ConfigError: Ray is not installed (at once, before any point runs).
    """

    def __init__(self, address: str | None = None) -> None:
        from schedkit.cluster.ray_util import require_ray

        self._ray = require_ray("schedkit compare --ray")
        self.address = address
        self._started: bool | None = None
        self._task: Any = None

    def _connect(self) -> None:
        if self._started is None:
            from schedkit.cluster.ray_util import init_ray

            self._started = init_ray(self.address)
        if self._task is None:
            # What else a point's result depends on: the plugin switches of this process's
            # environment. A local cluster started here inherits it; any other one is told
            # (which costs fresh worker processes, about 1.5 s).
            inherited = self._started and self.address is None
            env = {k: v for k, v in os.environ.items() if k in _FORWARDED_ENV}
            options = {"runtime_env": {"env_vars": env}} if env and not inherited else {}
            self._task = self._ray.remote(**options)(_point_task) if options else self._ray.remote(_point_task)

    def submit(self, points: Sequence[Point]) -> list[Pending]:
        self._connect()
        ray = self._ray
        stored: dict[int, Any] = {}  # id(workload) -> its object ref
        for p in points:
            if id(p.workload) not in stored:
                stored[id(p.workload)] = ray.put(p.workload)
        refs = [self._task.remote(p.config, stored[id(p.workload)], p.keep_metrics) for p in points]
        return [self._pending(ref) for ref in refs]

    def _pending(self, ref: Any) -> Pending:
        def get() -> PointResult:
            try:
                result: PointResult = self._ray.get(ref)
            except self._ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None)
                if isinstance(cause, SchedkitError):  # a config or plugin error, as it was raised
                    raise cause from None
                raise
            return result
        return get

    def close(self) -> None:
        """Disconnect, if this runner connected (stopping the local cluster it started)."""
        if self._started:
            self._ray.shutdown()
        self._started = None
        self._task = None

    def __enter__(self) -> RayRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- compare and sweep ----------------------------------------------------------------------

@dataclass(slots=True)
class CompareResult:
    summaries: dict[str, dict[str, Any]] = field(default_factory=dict)
    metrics: dict[str, list[RequestMetrics]] = field(default_factory=dict)
    failed: dict[str, dict[str, str]] = field(default_factory=dict)
    sweep: dict[str, list[tuple[float, dict[str, Any]]]] = field(default_factory=dict)
    sustained: dict[str, float | None] = field(default_factory=dict)


@dataclass(slots=True)
class Submitted:
    """The single-load comparison and/or the sweep, submitted; :meth:`compared` and
    :meth:`swept` wait for their part and fill in the result."""

    config: Config
    result: CompareResult
    compare_points: list[tuple[str, Pending]] = field(default_factory=list)
    """(profile name, pending result), in profile order."""
    sweep_points: list[tuple[str, list[tuple[float, Pending]]]] = field(default_factory=list)
    """(profile name, [(load, pending result)] in the order of the values), in profile order."""

    def compared(self) -> CompareResult:
        for name, pending in self.compare_points:
            point = pending()
            self.result.summaries[name] = point.summary
            self.result.metrics[name] = point.metrics
            self.result.failed[name] = point.failed
        self.compare_points = []
        return self.result

    def swept(self) -> CompareResult:
        for name, loads in self.sweep_points:
            points = sorted(((load, pending().summary) for load, pending in loads),
                            key=lambda p: p[0])
            self.result.sweep[name] = points
            self.result.sustained[name] = sustained_load(points, self.config.workload.slo.attainment)
        self.sweep_points = []
        return self.result

    def done(self) -> CompareResult:
        self.compared()
        return self.swept()


def submit(config: Config, *, single: bool = True, knob: str | None = None,
           values: Sequence[float] = (), base_dir: str | Path | None = None,
           runner: PointRunner | None = None, result: CompareResult | None = None) -> Submitted:
    """Check every profile (:func:`check_profiles`), generate the workloads, and submit
    the single-load comparison (``single``) and the sweep (``knob`` over ``values``:
    :func:`sweep`) to ``runner`` (default: :class:`SerialRunner`) in one go.

    Raises:
        ConfigError, PluginError: A bad profile, a sweep knob the workload cannot take,
            or a workload that cannot be generated; before any point runs.
    """
    check_profiles(config)
    runner = runner or SerialRunner()
    profiles = profiles_of(config)
    wl = config.workload
    points: list[Point] = []
    compare_names: list[str] = []
    sweep_slots: list[tuple[str, float]] = []
    if single:
        workload = generate(wl, config.runner.vocab_size, base_dir)
        for profile in profiles:
            points.append(Point(profile_config(config, profile), workload))
            compare_names.append(profile.name)
    if knob is not None:
        if knob not in SWEEP_KNOBS:
            raise ConfigError(f"sweep knob {knob!r}: expected one of {SWEEP_KNOBS}")
        if knob == "time_scale":
            if wl.trace is None:
                raise ConfigError("--sweep time_scale needs a trace workload; use rate for synthetic ones")
            trace = wl.trace
            workloads = {v: wl.model_copy(update={"trace": trace.model_copy(update={"time_scale": v})})
                         for v in values}
        else:
            workloads = {v: wl.model_copy(update={"rate": v}) for v in values}
        generated = {v: generate(w, config.runner.vocab_size, base_dir) for v, w in workloads.items()}
        for profile in profiles:
            cfg = profile_config(config, profile)
            for v in values:
                points.append(Point(cfg.model_copy(update={"workload": workloads[v]}), generated[v],
                                    keep_metrics=False))
                sweep_slots.append((profile.name, 1.0 / v if knob == "time_scale" else v))
    pending = runner.submit(points)
    out = Submitted(config, result if result is not None else CompareResult())
    out.compare_points = list(zip(compare_names, pending[:len(compare_names)], strict=True))
    by_profile: dict[str, list[tuple[float, Pending]]] = {}
    for (name, load), p in zip(sweep_slots, pending[len(compare_names):], strict=True):
        by_profile.setdefault(name, []).append((load, p))
    out.sweep_points = list(by_profile.items())
    return out


def compare(config: Config, *, base_dir: str | Path | None = None,
            runner: PointRunner | None = None) -> CompareResult:
    """Run every profile on the same (generated once) workload (every profile is checked
    first: :func:`check_profiles`), on ``runner`` (default: one after the other here)."""
    return submit(config, base_dir=base_dir, runner=runner).compared()


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


def sweep(config: Config, knob: str, values: list[float], *, base_dir: str | Path | None = None,
          result: CompareResult | None = None, runner: PointRunner | None = None) -> CompareResult:
    """Run every profile at every load; record the highest load meeting the SLO with every
    lower load meeting it too (:func:`sustained_load`).

    ``rate`` scales synthetic (and vidur) arrivals; ``time_scale`` stretches trace
    arrival times (smaller is more load), so the sustained load is reported as its
    inverse. A load is sustained when the SLO attainment reaches ``slo.attainment``.
    The points run on ``runner`` (default: one after the other here).
    """
    return submit(config, single=False, knob=knob, values=values, base_dir=base_dir,
                  runner=runner, result=result).swept()


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
