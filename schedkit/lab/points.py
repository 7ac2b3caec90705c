"""The points of ``schedkit compare`` and the runners that run them.

Every run is one *point*: one profile's config on one generated workload
(:func:`run_point`). A :class:`PointRunner` runs the points: :class:`SerialRunner` one
after the other in this process (the default), :class:`RayRunner` all at once as Ray
tasks. Each point builds its own engine from its config and workload alone (with the fake
or simulated runner, on a virtual clock), so nothing in its result depends on which
process ran it or when.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from schedkit.config import Config
from schedkit.errors import SchedkitError
from schedkit.lab.cluster_sim import run_cluster_workload, summarize_cluster
from schedkit.lab.metrics import RequestMetrics, summarize
from schedkit.lab.simulate import run_workload
from schedkit.lab.workloads import WorkloadRequest


@dataclass(slots=True)
class PointResult:
    """What one point gives back: its summary (under the workload's SLO, fairness weights
    and tenant shares), per-request metrics and failed requests (request_id -> error)."""

    summary: dict[str, Any]
    metrics: list[RequestMetrics]
    failed: dict[str, str]


def summarize_run(config: Config, metrics: list[RequestMetrics]) -> dict[str, Any]:
    """:func:`summarize` with the workload's SLO, fairness weights and tenant shares."""
    wl = config.workload
    return summarize(metrics, wl.slo, fairness=wl.fairness, shares=wl.tenant_shares)


def run_point(config: Config, workload: list[WorkloadRequest], *,
              progress: str | None = None) -> PointResult:
    """Run one point: ``workload`` through an engine built from ``config`` (a profile's
    config, its ``workload`` section the point's). The one function the serial and the
    Ray runner both call; nothing in its result depends on wall time or on which process
    ran it. ``progress``: a label for a progress bar on stderr (one engine only)."""
    if config.replicas.count > 1:  # the replicas on one virtual clock, under the router
        crun = run_cluster_workload(config, workload)
        cluster = summarize_cluster(config, crun)
        summary = cluster.pop("overall")
        summary["cluster"] = cluster
        return PointResult(summary, crun.metrics, crun.failed)
    run = run_workload(config, workload, progress=progress)
    return PointResult(summarize_run(config, run.metrics), run.metrics, run.failed)


@dataclass(slots=True)
class Point:
    """One unit of work: a profile's config on a workload."""

    config: Config
    workload: list[WorkloadRequest]
    keep_metrics: bool = True
    """False when only the summary is wanted (sweep points): the per-request metrics are
    dropped where the point ran instead of shipped back."""
    progress: str | None = None
    """A label: show a progress bar for this point on stderr (where the runner can)."""


Pending = Callable[[], PointResult]
"""A submitted point: call it for its result (it blocks, or runs the point, until done)."""


class PointRunner(Protocol):
    def submit(self, points: Sequence[Point]) -> list[Pending]:
        """Start ``points`` (or get ready to); one pending result each, in their order."""
        ...


def _point_task(config: Config, workload: list[WorkloadRequest], keep_metrics: bool,
                progress: str | None = None) -> PointResult:
    result = run_point(config, workload, progress=progress)
    if not keep_metrics:
        result.metrics = []
    return result


class SerialRunner:
    """Each point in this process when its result is asked for (so in the order the
    results are asked for), with its progress bar."""

    def submit(self, points: Sequence[Point]) -> list[Pending]:
        return [_lazy(p) for p in points]


def _lazy(p: Point) -> Pending:
    return lambda: _point_task(p.config, p.workload, p.keep_metrics, p.progress)


_FORWARDED_ENV = ("SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD", "SCHEDKIT_DISABLE_PLUGINS", "PYTHONHASHSEED")


class RayRunner:
    """Every point as a Ray task, all submitted at once; each distinct workload goes into
    the object store once (``ray.put``), shared by the profiles that run it. No progress
    bars (the tasks have no terminal).

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
