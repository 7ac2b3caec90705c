"""How far the simulator can be trusted: an accuracy grid against the real runner.

An *experiment* is one cell of the grid: a workload, a policy profile, a load and a
scheduler shape. It runs on the real runner twice (the machine's own run-to-run spread)
and on the simulator once, from the same requests, and each metric of
:data:`METRICS` is compared: the simulator's error is read against the real runner's
spread. Per (workload, load, shape) cell the policies are ranked on each side and the
agreement given as Kendall's tau.

A grid file (YAML) names the real runner's config, the simulator's profile and the
grid's axes::

    base: ../smollm2-cpu.yaml          # the real runner's config (relative to this file)
    profile: cpu-smollm2-135m          # the simulator's cost-model profile
    workloads:                          # name -> a workload section (as in any config)
      azure: {kind: trace, num_requests: 40, trace: {format: azure, path: ...}}
    policies:                           # name -> a compare profile (policy, plugins, scheduler)
      fcfs: {policy: fcfs}
    loads: {light: 0.3, knee: 0.9, overload: 1.6}   # offered load / the simulated capacity
    shapes:                             # name -> scheduler keys
      b512: {max_num_batched_tokens: 512, max_num_seqs: 16}
    full: [{shapes: [b512]}, {shapes: [b256], loads: [knee]}]   # union of parts (default: all)
    reduced: [{workloads: [azure], loads: [knee, overload]}]     # the short grid

Loads are fractions of the capacity the simulator finds for the workload and shape
(every request arriving at once, fcfs), so one grid file fits any machine its profile
was fitted on: the workload's arrival times are scaled to the offered rate, its lengths
and order kept.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from schedkit.config import (
    Config,
    ProfileConfig,
    SimulatedRunnerConfig,
    WorkloadConfig,
    load_config,
    profile_scheduler,
)
from schedkit.config.base import StrictModel
from schedkit.config.scheduler import SchedulerConfig
from schedkit.errors import ConfigError
from schedkit.lab.calibrate import probe_workload
from schedkit.lab.cost_fit import StepRecord
from schedkit.lab.metrics import RequestMetrics, summarize
from schedkit.lab.workloads import WorkloadRequest, generate
from schedkit.runners.cost_model import CostModel
from schedkit.runners.machine import cpu_times, steal_share
from schedkit.runners.simulated import SimulatedRunner

METRICS = ("e2e_mean_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "throughput_tok_s", "preemptions")
"""What each experiment compares (see :func:`run_metrics`)."""
HEADLINE = ("e2e_mean_s", "ttft_p50_s", "ttft_p99_s")
"""The metrics the accuracy targets are stated for."""


class Selection(StrictModel):
    """Part of the grid: the named values of each axis (None: the whole axis)."""

    workloads: list[str] | None = None
    policies: list[str] | None = None
    loads: list[str] | None = None
    shapes: list[str] | None = None


class GridConfig(StrictModel):
    base: str
    """The real runner's config file (model, runner, cache; relative to the grid file)."""
    profile: str
    """The simulator's cost-model profile (a bundled name or a path relative to the grid file)."""
    workloads: dict[str, WorkloadConfig] = Field(min_length=1)
    policies: dict[str, ProfileConfig] = Field(min_length=1)
    loads: dict[str, float] = Field(min_length=1)
    """Offered load as a fraction of the simulated capacity of the workload and shape."""
    shapes: dict[str, dict[str, Any]] = Field(min_length=1)
    """Scheduler keys of each shape (token budget, max_num_seqs, ...)."""
    full: list[Selection] = Field(default_factory=lambda: [Selection()], min_length=1)
    """The full grid: the union of these parts (default: every combination of the axes)."""
    reduced: list[Selection] = Field(default_factory=list)
    """The reduced grid, the same way (default: the full grid)."""
    repeats: int = Field(default=2, ge=1)
    """Real-runner runs of each experiment (their spread is the machine's noise)."""

    @field_validator("policies", mode="before")
    @classmethod
    def _named(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: {"name": k, **v} if isinstance(v, dict) else v for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _known_names(self) -> GridConfig:
        axes: dict[str, list[str]] = {"workloads": list(self.workloads), "policies": list(self.policies),
                                      "loads": list(self.loads), "shapes": list(self.shapes)}
        for which, parts in (("full", self.full), ("reduced", self.reduced)):
            for i, part in enumerate(parts):
                for axis, names in axes.items():
                    for name in getattr(part, axis) or ():
                        if name not in names:
                            raise ValueError(f"{which}[{i}].{axis} names {name!r}, which is not one of "
                                             f"the grid's {axis} ({', '.join(names)})")
        return self

    @field_validator("loads")
    @classmethod
    def _positive(cls, value: dict[str, float]) -> dict[str, float]:
        for name, f in value.items():
            if not 0 < f < math.inf:
                raise ValueError(f"load {name!r} must be a positive, finite fraction of capacity, got {f}")
        return value

    @field_validator("shapes")
    @classmethod
    def _scheduler_keys(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        known = [k for k in SchedulerConfig.model_fields if k != "policy"]
        for name, keys in value.items():
            for key in keys:
                if key == "policy":
                    raise ValueError(f"shape {name!r}: 'policy' is set by the policies axis, not a shape")
                if key not in known:
                    near = difflib.get_close_matches(key, known, n=1)
                    hint = f"did you mean {near[0]!r}?" if near else f"the keys are {', '.join(known)}"
                    raise ValueError(f"shape {name!r}: {key!r} is not a scheduler key ({hint})")
        return value


@dataclasses.dataclass(frozen=True, slots=True)
class Experiment:
    workload: str
    policy: str
    load: str
    shape: str

    @property
    def key(self) -> str:
        return f"{self.workload}/{self.load}/{self.shape}/{self.policy}"

    @property
    def cell(self) -> tuple[str, str, str]:
        """The (workload, load, shape) cell whose policies are ranked together."""
        return self.workload, self.load, self.shape


@dataclasses.dataclass(slots=True)
class Grid:
    """A loaded grid file: its axes, the real config and the simulator's profile."""

    config: GridConfig
    base: Config
    profile: str
    path: Path

    def experiments(self, reduced: bool = False) -> list[Experiment]:
        """The full grid's experiments (or the reduced grid's), each once, in axis order."""
        c = self.config
        axes = [list(c.workloads), list(c.loads), list(c.shapes), list(c.policies)]
        parts = (c.reduced or c.full) if reduced else c.full
        chosen: set[Experiment] = set()
        for part in parts:
            picks = [part.workloads, part.loads, part.shapes, part.policies]
            chosen |= {Experiment(w, p, ld, s) for w, ld, s, p in
                       itertools.product(*(pick or axis for pick, axis in zip(picks, axes, strict=True)))}
        order = {name: i for axis in axes for i, name in enumerate(axis)}
        return sorted(chosen, key=lambda e: (order[e.workload], order[e.load], order[e.shape], order[e.policy]))

    def shape_config(self, shape: str, policy: str | None = None, *, simulated: bool = False) -> Config:
        """The base config with the shape's scheduler keys, the policy profile (if any)
        and, when ``simulated``, the simulator in place of the real runner."""
        base = self.base
        scheduler = base.scheduler.model_copy(update=self.config.shapes[shape])
        update: dict[str, Any] = {"scheduler": type(base.scheduler)(**scheduler.model_dump())}
        if policy is not None:
            profile = self.config.policies[policy]
            update["scheduler"] = profile_scheduler(update["scheduler"], profile)
            update["plugins"] = [*base.plugins, *profile.plugins]
        if simulated:
            update["runner"] = SimulatedRunnerConfig(vocab_size=base.runner.vocab_size,
                                                     eos_token_id=base.runner.eos_token_id,
                                                     profile=self.profile)
        return base.model_copy(update=update)


def load_grid(path: str | Path, profile: str | None = None) -> Grid:
    """Read a grid file (module docstring); ``profile`` replaces the file's profile.

    Raises:
        ConfigError: The file is missing or malformed, or its base config or a profile
            or shape in it is invalid; the message names the file and the key.
    """
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the grid file: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not YAML: {e}") from e
    try:
        cfg = GridConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{path}: not an accuracy grid: {e}") from e
    base = load_config(path.parent / cfg.base)
    if profile is None:
        profile = cfg.profile
    elif Path(profile).is_file():
        profile = str(Path(profile).resolve())
    if (path.parent / profile).is_file():
        profile = str(path.parent / profile)
    grid = Grid(cfg, base, profile, path)
    for shape in cfg.shapes:
        for policy in cfg.policies:
            try:
                grid.shape_config(shape, policy)
            except (ValidationError, ValueError) as e:
                raise ConfigError(f"{path}: shape {shape!r} with policy {policy!r}: {e}") from e
    return grid


# -- workloads at a given load ---------------------------------------------------------------

def offered_rate(workload: Sequence[WorkloadRequest]) -> float:
    """Requests per second over the arrival window (first to last arrival)."""
    if len(workload) < 2:
        return math.inf
    window = workload[-1].arrival_time - workload[0].arrival_time
    return (len(workload) - 1) / window if window > 0 else math.inf


def at_rate(workload: Sequence[WorkloadRequest], rate: float) -> list[WorkloadRequest]:
    """The workload with its arrival times scaled so that it offers ``rate`` requests
    per second (same requests, same order, same relative gaps)."""
    native = offered_rate(workload)
    if not math.isfinite(native):
        raise ConfigError("the workload's requests all arrive at once: it has no rate to scale "
                          "(give it an arrival process or more than one request)")
    scale = native / rate
    t0 = workload[0].arrival_time
    return [dataclasses.replace(w, arrival_time=(w.arrival_time - t0) * scale) for w in workload]


def at_once(workload: Sequence[WorkloadRequest]) -> list[WorkloadRequest]:
    return [dataclasses.replace(w, arrival_time=0.0) for w in workload]


# -- metrics, errors, rankings ---------------------------------------------------------------

def summary_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """The values of :data:`METRICS` in a :func:`~schedkit.lab.metrics.summarize` result
    (throughput: output tokens per second over the arrival window)."""
    return {
        "e2e_mean_s": summary["e2e_s"]["mean"],
        "ttft_p50_s": summary["ttft_s"]["p50"],
        "ttft_p99_s": summary["ttft_s"]["p99"],
        "tpot_p50_s": summary["tpot_s"]["p50"],
        "throughput_tok_s": summary["output_tokens_per_s"],
        "preemptions": float(summary["preemptions"]),
    }


def run_metrics(metrics: Sequence[RequestMetrics]) -> dict[str, float]:
    """The values of :data:`METRICS` for one run's requests."""
    return summary_metrics(summarize(metrics))


def relative_error(value: float, reference: float) -> float:
    """|value - reference| / |reference| (0 when both are 0, inf when only the reference is)."""
    if reference == 0:
        return 0.0 if value == 0 else math.inf
    return abs(value - reference) / abs(reference)


def compare_runs(real: Sequence[Mapping[str, float]], sim: Mapping[str, float],
                 names: Sequence[str] = METRICS) -> dict[str, dict[str, float]]:
    """Per metric: the real runs' mean, their spread (the largest relative deviation of
    one run from that mean, times two: the relative range for two runs), their noise
    floor (:func:`noise_floor`), the simulator's value and its error against the mean."""
    out = {}
    for name in names:
        values = [r[name] for r in real]
        mean = statistics.fmean(values)
        spread = 2 * max(relative_error(v, mean) for v in values) if len(values) > 1 else math.nan
        out[name] = {"real": mean, "spread": spread, "noise_floor": noise_floor(values),
                     "sim": sim[name], "error": relative_error(sim[name], mean)}
    return out


def noise_floor(values: Sequence[float]) -> float:
    """The error an exact simulator is expected to show against the mean of these real
    runs: one that predicts the metric's expected value on this machine exactly still
    misses the mean of ``n`` noisy runs by ``E|mean - expected|``, which is
    ``sigma * sqrt(2 / (pi * n))`` for runs normally spread around it. ``sigma`` is
    estimated without bias from the runs (their standard deviation over ``c4(n)``),
    relative to their mean; for two runs the floor is half their relative range (for
    any noise symmetric about the expected value, not only normal). nan with fewer than
    two runs or a value that is not finite (a percentile of requests never served)."""
    n = len(values)
    if n < 2 or not all(math.isfinite(v) for v in values):
        return math.nan
    mean = statistics.fmean(values)
    sd = statistics.stdev(values)
    if sd == 0:
        return 0.0
    if mean == 0:
        return math.inf
    c4 = math.sqrt(2 / (n - 1)) * math.exp(math.lgamma(n / 2) - math.lgamma((n - 1) / 2))
    return sd / c4 * math.sqrt(2 / (math.pi * n)) / abs(mean)


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b between two scorings of the same items (ties allowed); nan when
    either side ties everything."""
    if len(a) != len(b):
        raise ValueError(f"kendall_tau needs two scorings of the same items, got {len(a)} and {len(b)}")
    concordant = discordant = ties_a = ties_b = 0
    for i, j in itertools.combinations(range(len(a)), 2):
        da, db = a[i] - a[j], b[i] - b[j]
        if da == 0 and db == 0:
            continue
        if da == 0:
            ties_a += 1
        elif db == 0:
            ties_b += 1
        elif (da > 0) == (db > 0):
            concordant += 1
        else:
            discordant += 1
    denom = math.sqrt((concordant + discordant + ties_a) * (concordant + discordant + ties_b))
    return (concordant - discordant) / denom if denom else math.nan


def rankings(results: Mapping[str, Mapping[str, Any]], metric: str = "e2e_mean_s",
             key: str = "compare") -> dict[str, dict[str, Any]]:
    """Per (workload, load, shape) cell with at least two policies: each side's order of
    the policies by ``metric`` (best first) and Kendall's tau between them (the
    simulated side from ``key``: ``compare``, ``compare_anchored``, ...)."""
    cells: dict[str, list[tuple[str, float, float]]] = {}
    for name, r in results.items():
        if key not in r:
            continue
        w, ld, s, p = name.split("/")
        cmp = r[key][metric]
        cells.setdefault(f"{w}/{ld}/{s}", []).append((p, cmp["real"], cmp["sim"]))
    out = {}
    for cell, rows in sorted(cells.items()):
        if len(rows) < 2:
            continue
        out[cell] = {
            "real": [p for p, _, _ in sorted(rows, key=lambda r: r[1])],
            "sim": [p for p, _, _ in sorted(rows, key=lambda r: r[2])],
            "tau": kendall_tau([r[1] for r in rows], [r[2] for r in rows]),
        }
    return out


def _mape(results: Mapping[str, Mapping[str, Any]], key: str = "compare") -> dict[str, float]:
    mape = {}
    for name in METRICS:
        errs = [r[key][name]["error"] for r in results.values()
                if key in r and math.isfinite(r[key][name]["error"])]
        mape[name] = statistics.fmean(errs) if errs else math.nan
    return mape


def mean_noise_floor(results: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """Per metric, the mean over the experiments of the real runs' :func:`noise_floor`:
    the mean absolute percentage error a simulator exact to each experiment's expected
    value is expected to score on this grid, read from ``real_runs`` (so also for
    results stored before the floor was kept)."""
    floors: dict[str, float] = {}
    for name in METRICS:
        each = [noise_floor([run[name] for run in r["real_runs"]]) for r in results.values()]
        each = [x for x in each if math.isfinite(x)]
        floors[name] = statistics.fmean(each) if each else math.nan
    return floors


def _values(results: Mapping[str, Mapping[str, Any]], key: str) -> list[float]:
    return [x for r in results.values() for x in r.get(key, []) if x is not None and math.isfinite(x)]


def overall(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Mean absolute percentage error of each metric over the experiments (also of the
    simulator re-anchored by the speed probe and at the real runs' own speed, where
    recorded), the real runs' noise floor (the error an exact simulator is expected
    to score against them, :func:`noise_floor`), the experiments outside their bound
    (15% or twice the real spread, whichever is larger) on E2E mean and TTFT p50, the
    mean Kendall's tau of the rankings, and the real runs' speed and probe ratios and
    steal shares (min, mean, max)."""
    def mean_tau(key: str) -> float:
        taus = [c["tau"] for c in rankings(results, key=key).values() if math.isfinite(c["tau"])]
        return statistics.fmean(taus) if taus else math.nan

    sim_s = sum(r["sim_wall_s"] for r in results.values())
    real_s = sum(statistics.fmean(r["real_wall_s"]) for r in results.values())
    spans = {}
    for name in ("real_speed_ratio", "real_speed_ratio_decode", "real_speed_ratio_prefill", "real_probe_ratio",
                 "real_probe_ratio_decode", "real_probe_ratio_prefill", "real_steal"):
        values = _values(results, name)
        spans[name] = ({"min": min(values), "mean": statistics.fmean(values), "max": max(values)}
                       if values else None)
    return {"experiments": len(results), "mape": _mape(results), "outside_bound": _outside(results),
            "noise_floor": mean_noise_floor(results),
            "mape_anchored": _mape(results, "compare_anchored"),
            "outside_bound_anchored": _outside(results, "compare_anchored"),
            "mape_at_run_speed": _mape(results, "compare_at_run_speed"),
            "mape_at_kind_speed": _mape(results, "compare_at_kind_speed"),
            "kendall_tau_mean": mean_tau("compare"), "kendall_tau_mean_anchored": mean_tau("compare_anchored"),
            "speedup": real_s / sim_s if sim_s else math.nan,
            "speed_ratio": spans["real_speed_ratio"], "probe_ratio": spans["real_probe_ratio"],
            "speed_ratio_decode": spans["real_speed_ratio_decode"],
            "speed_ratio_prefill": spans["real_speed_ratio_prefill"],
            "probe_ratio_decode": spans["real_probe_ratio_decode"],
            "probe_ratio_prefill": spans["real_probe_ratio_prefill"],
            "steal": spans["real_steal"]}


def _outside(results: Mapping[str, Mapping[str, Any]], key: str = "compare") -> list[str]:
    """The experiments whose E2E mean or TTFT p50 error under ``key`` exceeds their
    bound: 15% or twice the real runs' spread, whichever is larger."""
    outside = []
    for name_key, r in results.items():
        if key not in r:
            continue
        for name in ("e2e_mean_s", "ttft_p50_s"):
            c = r[key][name]
            bound = max(0.15, 2 * c["spread"]) if math.isfinite(c["spread"]) else 0.15
            if not c["error"] <= bound:
                outside.append(f"{name_key} {name}")
    return outside


# -- running ---------------------------------------------------------------------------------

@dataclasses.dataclass(slots=True)
class RunOutcome:
    """One run of an experiment's requests."""

    metrics: list[RequestMetrics]
    wall_s: float
    step_s: float = 0.0
    """The measured durations of the steps that ran tokens, summed (a recorded run)."""
    predicted_s: float = 0.0
    """The profile's prediction of those same steps, summed."""
    steal: float | None = None
    """The machine's steal share over the run (:func:`~schedkit.runners.machine.steal_share`)."""
    prefill_step_s: float = 0.0
    """Of ``step_s``, the steps with a prompt chunk (the others are decode-only)."""
    prefill_predicted_s: float = 0.0
    """Of ``predicted_s``, the prediction of those steps."""
    records: list[StepRecord] = dataclasses.field(default_factory=list)
    """The steps that ran tokens, each with its measured duration (a recorded run)."""

    @property
    def speed_ratio(self) -> float:
        """Measured over predicted step time: how much slower than the profile the
        machine ran these very steps (1: as fitted; nan: not recorded)."""
        return self.step_s / self.predicted_s if self.predicted_s > 0 else math.nan

    @property
    def speed_ratio_by_kind(self) -> dict[str, float]:
        """:attr:`speed_ratio` of the decode-only steps and of those with a prompt chunk
        apart: a drift that slows memory-bound decodes and compute-bound prefills
        differently shows here (nan: no such step)."""
        decode_s, decode_p = self.step_s - self.prefill_step_s, self.predicted_s - self.prefill_predicted_s
        return {"decode": decode_s / decode_p if decode_p > 0 else math.nan,
                "prefill": self.prefill_step_s / self.prefill_predicted_s if self.prefill_predicted_s > 0
                else math.nan}


def run_once(config: Config, workload: list[WorkloadRequest], model: CostModel | None = None,
             runner: Any = None) -> RunOutcome:
    """Run ``workload`` through ``config``'s engine (or on ``runner``); with ``model``,
    pair every step that ran tokens with the model's prediction of it.

    Raises:
        ConfigError: A request failed: an accuracy experiment needs every one served.
    """
    from schedkit.lab.simulate import run_workload
    from schedkit.lab.step_recorder import StepRecorder
    from schedkit.runners import configured_runner_class

    owned = runner is None and model is not None
    if owned:
        runner = configured_runner_class(config).from_config(config)
    recorder = StepRecorder(runner) if model is not None else None
    before = cpu_times()
    try:
        result = run_workload(config, workload, runner=recorder if recorder is not None else runner,
                              on_step=recorder.on_step if recorder is not None else None)
    finally:
        if owned and hasattr(runner, "close"):
            runner.close()
    steal = steal_share(before, cpu_times())
    if result.failed:
        first = next(iter(result.failed.items()))
        raise ConfigError(f"{len(result.failed)} requests failed (first: {first[0]}: {first[1]}); "
                          "an accuracy experiment needs every request served")
    out = RunOutcome(result.metrics, result.wall_s, steal=steal)
    if recorder is not None and model is not None:
        out.records = recorder.records
        for features, seconds in recorder.records:
            predicted = model.step_time(features)
            out.step_s += seconds
            out.predicted_s += predicted
            if features.is_prefill_step:
                out.prefill_step_s += seconds
                out.prefill_predicted_s += predicted
    return out


PROBE_SCHEDULER = {"policy": "fcfs"}
"""The probe's scheduler keys over the config's: its steps are the same work whatever the
experiment's policy (the calibration runs it under the calibration config's own)."""


@dataclasses.dataclass(slots=True, frozen=True)
class ProbeReading:
    """What the speed probe measured against a profile."""

    ratio: float
    """Measured over predicted step time, summed over the probe's runs."""
    step_s: float
    """The probe's measured step time per run (seconds)."""
    steal: float | None
    decode_ratio: float = math.nan
    """:attr:`ratio` of the probe's decode-only steps alone."""
    prefill_ratio: float = math.nan
    """:attr:`ratio` of the probe's steps with a prompt chunk alone."""
    prefill_share: float = math.nan
    """The steps with a prompt chunk's share of the probe's predicted time."""

    def speed(self, model: CostModel) -> float:
        """The machine's speed against the one ``model`` was fitted on (2: twice as
        slow): the ratio read against the probe's ratio during the fit
        (:attr:`CostModel.probe_ratio`), which holds the model's bias on these few steps.
        Where both are read per kind of step, the two kinds' speeds weighed by their
        share of the probe's predicted time (a profile rescaled per kind keeps its
        fit's bias per kind, not over both)."""
        kinds = self._kind_speeds(model)
        if kinds is None:
            return self.ratio / model.probe_ratio
        return (1 - self.prefill_share) * kinds[0] + self.prefill_share * kinds[1]

    def speeds(self, model: CostModel) -> tuple[float, float | None]:
        """:meth:`speed` of the decode-only steps and of those with a prompt chunk apart,
        each against the same kind's probe during the fit: a neighbour slows
        memory-bound decodes and compute-bound prefills by different amounts. The
        second is None where the profile or this reading lacks a kind (then the first
        is :meth:`speed`)."""
        kinds = self._kind_speeds(model)
        return (self.speed(model), None) if kinds is None else kinds

    def _kind_speeds(self, model: CostModel) -> tuple[float, float] | None:
        fit_decode, fit_prefill = model.probe_ratio_decode, model.probe_ratio_prefill
        if (fit_decode is None or fit_prefill is None or not math.isfinite(self.prefill_share)
                or not (math.isfinite(self.decode_ratio) and math.isfinite(self.prefill_ratio))):
            return None
        return self.decode_ratio / fit_decode, self.prefill_ratio / fit_prefill


def speed_probe(config: Config, model: CostModel, runs: int = 1) -> ProbeReading:
    """Run the speed probe (:func:`~schedkit.lab.calibrate.probe_workload`) ``runs``
    times on ``config``'s real runner (fcfs, no plugins) and read its steps against
    ``model``.

    Raises:
        ConfigError: The probe recorded no step (a runner that reports none).
    """
    scheduler = config.scheduler.model_copy(update=PROBE_SCHEDULER)
    probe_config = config.model_copy(update={"scheduler": type(config.scheduler)(**scheduler.model_dump()),
                                             "plugins": []})
    outs = [run_once(probe_config, probe_workload(config.runner.vocab_size), model) for _ in range(runs)]
    step_s, predicted_s = sum(o.step_s for o in outs), sum(o.predicted_s for o in outs)
    if not predicted_s > 0:
        raise ConfigError("the speed probe recorded no step to compare with the profile")
    steals = [o.steal for o in outs if o.steal is not None]
    total = RunOutcome([], 0.0, step_s, predicted_s, prefill_step_s=sum(o.prefill_step_s for o in outs),
                       prefill_predicted_s=sum(o.prefill_predicted_s for o in outs))
    kinds = total.speed_ratio_by_kind  # the runs' predictions, not computed again
    return ProbeReading(total.speed_ratio, step_s / runs, statistics.fmean(steals) if steals else None,
                        kinds["decode"], kinds["prefill"], total.prefill_predicted_s / predicted_s)


def probe_speed(grid: Grid, model: CostModel) -> tuple[float, float, float | None]:
    """Run the speed probe (:func:`speed_probe`) on the grid's real runner: the
    machine's speed against the fit (:meth:`ProbeReading.speed`), then its decode-only
    and prompt-chunk speeds (:meth:`ProbeReading.speeds`).

    The probe is the same few seconds of work whatever the experiment, so its ratio
    follows the machine's speed (a VM's drift over an hour) and nothing of the
    experiment's own steps: a profile scaled by it is re-anchored to the machine as it
    runs now, without borrowing any measurement from the run it predicts."""
    reading = speed_probe(grid.base, model)
    return (reading.speed(model), *reading.speeds(model))


def capacity(grid: Grid, workload: Sequence[WorkloadRequest], shape: str) -> float:
    """Requests per second the simulator serves when the whole workload arrives at
    once (fcfs, the shape's scheduler): the rate loads are fractions of."""
    reqs = at_once(workload)
    metrics = run_once(grid.shape_config(shape, simulated=True), reqs).metrics
    finish = max(m.finish_time for m in metrics if m.finish_time is not None)
    return len(reqs) / finish


def grid_workload(grid: Grid, name: str) -> list[WorkloadRequest]:
    base_dir = grid.path.parent
    wl = grid.config.workloads[name]
    return generate(wl, grid.base.runner.vocab_size, base_dir)




def run_grid(grid: Grid, experiments: Sequence[Experiment], *,
             done: Mapping[str, Mapping[str, Any]] | None = None,
             save: Callable[[dict[str, Any]], None] | None = None,
             progress: Callable[[str], None] | None = None, probe: bool = True,
             save_steps: Callable[[str, int, list[StepRecord]], None] | None = None) -> dict[str, Any]:
    """Run ``experiments``: first every simulated side (and the capacities), then the
    real runs in passes (each pass over every experiment, so slow drift of the machine
    spreads over all of them instead of landing on one). ``done`` holds results of an
    earlier, interrupted run to keep; ``save`` is called with the results after each
    real run, so an interrupted grid can resume.

    Each real run records its steps: the profile's prediction of those very steps gives
    the run's *speed ratio* (measured / predicted), and the machine's steal share is read
    around it. Finally every experiment is simulated again once per real run with the
    profile scaled by that run's speed ratio, and the mean of those simulated runs is
    compared with the mean of the real ones (``sim_at_run_speed``): what the error would
    be had the machine run each time at the speed the profile was fitted at, which
    separates the machine's drift from the model's error; and likewise with each run's
    decode-only steps and those with a prompt chunk scaled by their own ratios
    (``sim_at_kind_speed``), for a drift that slows the two kinds by different amounts.
    Per run, not at the runs' mean ratio: a queue's delay grows faster than linearly as
    the machine slows, so the mean over runs at several speeds is not the run at their
    mean speed.

    With ``probe``, the speed probe (:func:`probe_speed`) runs before the first real run
    and after every one; each run's *probe ratios* (overall, decode-only steps, steps
    with a prompt chunk) are the means of the probes around it, and every experiment is
    simulated per run with the profile's two kinds of step scaled by that run's probe
    ratios too (``sim_anchored``; by the overall ratio where the profile recorded no
    probe per kind): the profile re-anchored to the machine's current speed by a
    measurement independent of the experiment, the figure a user gets by probing before
    simulating (``schedkit calibrate --rescale``).

    ``save_steps`` is called with each real run's experiment key, pass and recorded
    steps (to judge a changed cost model against them later)."""
    say = progress or (lambda _msg: None)
    model = CostModel.load(grid.profile)
    results: dict[str, Any] = {k: dict(v) for k, v in (done or {}).items()}
    requests = experiment_requests(grid, experiments, progress=say)
    for e in experiments:
        r = results.setdefault(e.key, {})
        for k in ("real_runs", "real_wall_s", "real_speed_ratio", "real_speed_ratio_decode",
                  "real_speed_ratio_prefill", "real_steal"):
            r.setdefault(k, [])
        reqs = requests[e.key]
        r["offered_req_s"] = offered_rate(reqs)
        r["requests"] = len(reqs)
        out = run_once(grid.shape_config(e.shape, e.policy, simulated=True), reqs)
        r["sim"], r["sim_wall_s"] = run_metrics(out.metrics), out.wall_s
    repeats = grid.config.repeats
    last_probe: tuple[float, float, float | None] | None = None
    for rep in range(repeats):
        for i, e in enumerate(experiments):
            r = results[e.key]
            if len(r["real_runs"]) > rep:
                continue
            if probe and last_probe is None:
                last_probe = probe_speed(grid, model)
            out = run_once(grid.shape_config(e.shape, e.policy), requests[e.key], model)
            r["real_runs"].append(run_metrics(out.metrics))
            r["real_wall_s"].append(out.wall_s)
            r["real_speed_ratio"].append(out.speed_ratio)
            by_kind = out.speed_ratio_by_kind
            r["real_speed_ratio_decode"].append(by_kind["decode"])
            r["real_speed_ratio_prefill"].append(by_kind["prefill"])
            r["real_steal"].append(out.steal)
            if save_steps is not None:
                save_steps(e.key, rep, out.records)
            note = ""
            if probe and last_probe is not None:
                after = probe_speed(grid, model)
                r.setdefault("real_probe_ratio", []).append(statistics.fmean((last_probe[0], after[0])))
                note = f", probe {r['real_probe_ratio'][-1]:.2f}x"
                probe_decode = probe_prefill = None  # kept aligned with the runs
                if last_probe[2] is not None and after[2] is not None:
                    probe_decode = statistics.fmean((last_probe[1], after[1]))
                    probe_prefill = statistics.fmean((last_probe[2], after[2]))
                    note += f" (decode-only {probe_decode:.2f}x, with a prompt chunk {probe_prefill:.2f}x)"
                r.setdefault("real_probe_ratio_decode", []).append(probe_decode)
                r.setdefault("real_probe_ratio_prefill", []).append(probe_prefill)
                last_probe = after
            steal = "" if out.steal is None else f", steal {100 * out.steal:.1f}%"
            say(f"real pass {rep + 1}/{repeats}, {i + 1}/{len(experiments)} {e.key}: {out.wall_s:.1f} s, "
                f"steps {out.speed_ratio:.2f}x the profile's (decode-only {by_kind['decode']:.2f}x, "
                f"with a prompt chunk {by_kind['prefill']:.2f}x){note}{steal}")
            if save is not None:
                save(results)
    for e in experiments:
        r = results[e.key]
        r["compare"] = compare_runs(r["real_runs"], r["sim"])
        for name, factors in (("anchored", _run_factors(r, "real_probe_ratio", overall_ratio=True)),
                              ("at_kind_speed", _run_factors(r, "real_speed_ratio")),
                              ("at_run_speed", _run_factors(r, "real_speed_ratio", by_kind=False,
                                                            overall_ratio=True))):
            if factors is None:  # left out, not kept from the results resumed
                r.pop(f"sim_{name}", None)
                r.pop(f"compare_{name}", None)
                continue
            runs = [_simulate_scaled(grid, e, requests[e.key], model, *f) for f in factors]
            r[f"sim_{name}"] = {m: statistics.fmean(run[m] for run in runs) for m in runs[0]}
            r[f"compare_{name}"] = compare_runs(r["real_runs"], r[f"sim_{name}"])
    return results


def experiment_requests(grid: Grid, experiments: Sequence[Experiment],
                        progress: Callable[[str], None] | None = None) -> dict[str, list[WorkloadRequest]]:
    """Each experiment's requests by key: its workload (generated once) at its load's
    fraction of the simulator's capacity for its workload and shape. The simulated run
    and every real run of an experiment get this very list."""
    base = {w: grid_workload(grid, w) for w in sorted({e.workload for e in experiments})}
    requests: dict[str, list[WorkloadRequest]] = {}
    for w, s in sorted({(e.workload, e.shape) for e in experiments}):
        cap = capacity(grid, base[w], s)
        if progress is not None:
            progress(f"capacity {w}/{s}: {cap:.3f} req/s (simulated)")
        for e in experiments:
            if (e.workload, e.shape) == (w, s):
                requests[e.key] = at_rate(base[w], grid.config.loads[e.load] * cap)
    return requests


def _run_factors(r: Mapping[str, Any], prefix: str, *, by_kind: bool = True,
                 overall_ratio: bool = False) -> list[tuple[float, float | None]] | None:
    """The factors to scale the profile by for each real run of an experiment: the
    run's decode-only and prompt-chunk ratios under ``prefix`` (with ``by_kind``), else
    its one ratio (with ``overall_ratio``); None where some run lacks them (runs resumed
    from older results, a probe that read one kind of step only, ``--no-probe``): that
    column is then left out for the experiment."""
    decode, prefill = f"{prefix}_decode", f"{prefix}_prefill"
    if not r["real_runs"]:
        return None
    if by_kind and _every_run_has(r, decode) and _every_run_has(r, prefill):
        return list(zip(r[decode], r[prefill], strict=True))
    if overall_ratio and _every_run_has(r, prefix):
        return [(x, None) for x in r[prefix]]
    return None


def _every_run_has(r: Mapping[str, Any], key: str) -> bool:
    """Every real run of the experiment recorded a finite ratio under ``key``."""
    values = r.get(key, ())
    return len(values) == len(r["real_runs"]) and all(x is not None and math.isfinite(x) for x in values)


def _simulate_scaled(grid: Grid, e: Experiment, requests: list[WorkloadRequest], model: CostModel,
                     factor: float, prefill_factor: float | None = None) -> dict[str, float]:
    runner = SimulatedRunner(vocab_size=grid.base.runner.vocab_size, eos_token_id=grid.base.runner.eos_token_id,
                             cost_model=model.scaled(factor, prefill_factor))
    return run_metrics(run_once(grid.shape_config(e.shape, e.policy, simulated=True), requests, runner=runner).metrics)


def summary_rows(results: Mapping[str, Mapping[str, Any]]) -> Iterable[list[str]]:
    """One row per experiment: its key, offered load, then error / real spread for the
    headline metrics and TPOT, throughput and preemptions."""
    for key, r in sorted(results.items()):
        c = r["compare"]
        yield [key, f"{r['offered_req_s']:.2f}",
               *(f"{_pct(c[m]['error'])} / {_pct(c[m]['spread'])}" for m in METRICS[:-1]),
               f"{c['preemptions']['sim']:.0f} vs {c['preemptions']['real']:.1f}"]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if math.isfinite(x) else "n/a"
