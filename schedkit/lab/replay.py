"""Counterfactual replay: what would a run have been with one decision changed?

:func:`record_run` runs a workload and keeps every scheduling decision
(:mod:`schedkit.lab.recording`): each engine step's scheduled requests and token counts,
admissions, preemptions and finishes, or, for a cluster (``replicas.count`` > 1), each
routing decision. :func:`replay` runs the recording again on a virtual clock, holding it
to the recorded decisions up to step ``from_step`` (:class:`~schedkit.lab.replay_policy.ReplayPolicy`,
:class:`~schedkit.lab.engine_run.EngineRun`), and from that step changes one thing:

* ``victim``: the request the step's first preemption takes instead (where the recording
  preempted nobody there, that request is preempted voluntarily);
* ``policy``: the engine policy that decides from that step on (a policy name, or a
  config whose ``scheduler.policy`` and ``plugins`` are used);
* ``router``: for a cluster recording, the router from routing decision ``from_step`` on
  (a router name, or a config whose ``router`` section is used).

It compares two replays that differ only in that change: the *baseline* (the recorded
decisions up to ``from_step``, then the recorded policy's own) and the *changed* one, per
request (TTFT, E2E, recomputed tokens, preemptions) and in aggregate
(:mod:`schedkit.lab.replay_report`).

Without a change (and ``from_step``), the replay reproduces the recording: every step
decides as recorded (checked step by step; the first difference raises
:class:`~schedkit.errors.ReplayDivergenceError`). A run recorded on the fake or simulated
runner replays on the same runner, so its times are reproduced too, to the last bit
(``reproduces_recording``). A run recorded on a real runner (the wall clock) replays on the
simulator (or the ``config`` given): the decisions are the recorded ones, the times the
cost model's; the requests that ended at EOS end there again, with the same number of
output tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schedkit.config import Config, RouterConfig, SimulatedRunnerConfig
from schedkit.errors import ConfigError, ReplayDivergenceError, ReplayError
from schedkit.lab.cluster_sim import run_cluster_workload
from schedkit.lab.engine_run import EngineRun
from schedkit.lab.metrics import RequestMetrics
from schedkit.lab.recording import (
    Recording,
    RequestRecord,
    metrics_record,
    read_recording,
)
from schedkit.lab.replay_policy import ForcedRoutes, ReplayPolicy
from schedkit.lab.replay_report import ReplayDiff, diff_runs, recorded_metrics
from schedkit.lab.simulate import RunResult
from schedkit.lab.workloads import WorkloadRequest, generate
from schedkit.plugins.manager import get_plugin_manager
from schedkit.runners import configured_runner_class

__all__ = ["ReplayResult", "read_recording", "record_run", "replay", "replay_config"]


def record_run(config: Config, workload: list[WorkloadRequest] | None = None, *,
               base_dir: str | Path | None = None, runner: Any = None) -> tuple[Recording, RunResult]:
    """Run ``workload`` (default: the config's own) and record every decision: through one
    in-process engine (any runner, a real one included; ``runner``: a ready one instead of
    the config's), or through the cluster simulation when ``replicas.count`` > 1. Returns
    the recording and the run's result (with the fake or simulated runner, the same
    metrics as :func:`~schedkit.lab.simulate.run_workload` or
    :func:`~schedkit.lab.cluster_sim.run_cluster_workload`)."""
    if workload is None:
        workload = generate(config.workload, config.runner.vocab_size, base_dir)
    requests = [RequestRecord(w.request_id, w.arrival_time, list(w.prompt_token_ids), w.max_tokens,
                              w.priority, w.tenant) for w in workload]
    if config.replicas.count > 1:
        cluster = run_cluster_workload(config, workload)
        refused = [w.request_id for w in workload if w.request_id not in cluster.replica_of]
        if refused:
            raise ReplayError(f"{len(refused)} requests were never routed (e.g. {refused[0]!r}: "
                              f"{cluster.failed.get(refused[0])}); a recording needs every request routed: "
                              "record without the router's admission plugin (schedkit_router_admit) and "
                              "without flow control", request_id=refused[0])
        routes = list(cluster.replica_of.items())  # in the order they were routed
        rec = Recording("cluster", config, config.cache.num_blocks, True, requests, routes=routes,
                        run_steps=cluster.num_steps)
        _keep_outcomes(rec, cluster.metrics)
        return rec, cluster
    run = EngineRun(config, requests, runner=runner)
    result = run.run()
    for r in requests:
        r.step = result.step_of.get(r.request_id)
    rec = Recording("engine", config, result.num_blocks, run.engine.is_virtual, requests,
                    steps=result.steps, run_steps=result.num_steps)
    _keep_outcomes(rec, result.metrics)
    return rec, result


def _keep_outcomes(rec: Recording, metrics: Sequence[RequestMetrics]) -> None:
    by_id = {m.request_id: m for m in metrics}
    for r in rec.requests:
        m = by_id.get(r.request_id)
        if m is not None:
            r.num_output_tokens, r.finish_reason, r.metrics = m.num_output_tokens, m.finish_reason, metrics_record(m)


@dataclass(slots=True)
class ReplayResult:
    """A replay: the baseline, the changed run (None without a change) and their difference."""

    recording: Recording
    from_step: int
    """The step (cluster: routing decision) the change applies at; past the last one
    when nothing changes."""
    change: dict[str, str]
    """``{"victim" | "policy" | "router": what}``, empty without a change."""
    baseline: RunResult
    changed: RunResult | None
    reproduces_recording: bool
    """Whether the baseline's per-request figures (times, cached and recomputed tokens,
    preemptions, outputs) equal the recorded ones: the replay of a run recorded on the
    same virtual clock, unchanged up to where the recording ends."""
    recorded_preempted: list[str] = field(default_factory=list)
    """What the recording preempted at ``from_step`` (engine recordings)."""
    num_forced: dict[str, int] = field(default_factory=dict)
    """Corrections that held the baseline to the recorded decisions (ReplayPolicy)."""

    def diff(self) -> ReplayDiff:
        """Changed against baseline; without a change, the replay against the recording."""
        slo = self.recording.config.workload.slo
        if self.changed is None:
            return diff_runs(recorded_metrics(self.recording), self.baseline.metrics, slo,
                             num_steps=(self.recording.run_steps, self.baseline.num_steps))
        return diff_runs(self.baseline.metrics, self.changed.metrics, slo,
                         num_steps=(self.baseline.num_steps, self.changed.num_steps))

    def describe(self) -> str:
        """One line: what was replayed and what changed."""
        rec = self.recording
        unit = "steps" if rec.kind == "engine" else "routing decisions"
        head = (f"replay of {rec.path or 'a recording'} ({rec.kind}, {rec.num_steps} {unit}, "
                f"{'virtual' if rec.virtual_clock else 'wall'} clock)")
        if not self.change:
            if self.from_step > rec.num_steps:
                figures = "the recorded figures" if self.reproduces_recording else "the replay runner's times"
                return f"{head}: every step as recorded, with {figures}"
            return f"{head}: as recorded before {self.from_step}, then unchanged"
        (kind, what), = self.change.items()
        was = f" (recorded: {', '.join(self.recorded_preempted) or 'none'})" if kind == "victim" else ""
        return f"{head}: as recorded before {self.from_step}, then {kind} {what} at {self.from_step}{was}"

    def to_dict(self) -> dict[str, Any]:
        rec = self.recording
        return {"recording": rec.path, "kind": rec.kind, "num_steps": rec.num_steps,
                "from_step": self.from_step, "change": self.change,
                "recorded_preempted": self.recorded_preempted,
                "reproduces_recording": self.reproduces_recording, "num_forced": self.num_forced,
                "compared": "recording -> replay" if self.changed is None else "baseline -> changed",
                **self.diff().to_dict()}


def replay(recording: Recording, *, config: Config | None = None, from_step: int | None = None,
           policy: str | Config | None = None, victim: str | None = None,
           router: str | Config | None = None) -> ReplayResult:
    """Replay ``recording``, changing at most one decision from ``from_step`` on (module
    docstring).

    Args:
        recording: What to replay (:func:`record_run`, :func:`read_recording`).
        config: The config to replay under (default: the recording's own; a run recorded
            on the wall clock then replays on the simulator). Its runner must have a
            virtual clock; the KV blocks are the recording's.
        from_step: The step (cluster: routing decision, from 1) the change applies at.
        policy, victim, router: The change (one at most).

    Raises:
        ReplayError: Two changes, a change without ``from_step``, a step outside the
            recording, a change that does not fit the recording's kind, a victim that is
            not running at ``from_step`` (the error names it) or whose step preempts
            nobody and cannot.
        ReplayDivergenceError: A step before ``from_step`` decided otherwise than recorded.
        ConfigError: ``config``'s runner has no virtual clock.
    """
    changes = {k: v for k, v in (("policy", policy), ("victim", victim), ("router", router)) if v is not None}
    if len(changes) > 1:
        raise ReplayError(f"one change at a time, got {', '.join(changes)}")
    n = recording.num_steps
    if from_step is None:
        if changes:
            raise ReplayError(f"a {next(iter(changes))} change needs the step it applies at "
                              "(from_step; --from-step on the command line)")
        from_step = n + 1
    elif not 1 <= from_step <= n:
        unit = "steps" if recording.kind == "engine" else "routing decisions"
        raise ReplayError(f"from_step (--from-step) {from_step}: the recording has {unit} 1 to {n}")
    change = {k: v if isinstance(v, str) else _config_name(v, k) for k, v in changes.items()}
    cfg = replay_config(recording, config)
    if recording.kind == "cluster":
        if policy is not None or victim is not None:
            raise ReplayError("a cluster recording replays a router change; policy and victim "
                              "changes replay the recording of one engine")
        return _replay_cluster(recording, cfg, from_step, router, change)
    if router is not None:
        raise ReplayError("a router change needs a cluster recording (replicas.count > 1); this "
                          "one is of one engine")
    base, plugin = _run_engine(recording, cfg, from_step)
    result = ReplayResult(recording, from_step, change, base, None, _reproduces(recording, base),
                          num_forced=dict(plugin.num_forced))
    if from_step <= n:
        result.recorded_preempted = list(recording.step(from_step).preempted)
    if changes:
        after = None if policy is None else get_plugin_manager(_policy_config(cfg, policy))
        result.changed, _ = _run_engine(recording, cfg, from_step, after=after, victim=victim)
    return result


def replay_config(recording: Recording, config: Config | None = None) -> Config:
    """The config a replay runs under (:func:`replay`'s ``config``)."""
    cfg = config if config is not None else recording.config
    runner = cfg.runner
    virtual = runner.kind == "simulated" or (runner.kind == "fake" and getattr(runner, "clock", "") == "virtual")
    if not virtual:
        if config is not None:
            raise ConfigError(f"{config.where('runner', 'kind') or 'config'}: a replay runs on a virtual "
                              f"clock (runner.kind simulated, or fake with clock virtual), not {runner.kind!r}")
        cfg = cfg.model_copy(update={"runner": SimulatedRunnerConfig(
            vocab_size=runner.vocab_size, eos_token_id=runner.eos_token_id)})
    if recording.kind == "cluster":
        return cfg
    return cfg.model_copy(update={"cache": cfg.cache.model_copy(update={"num_blocks": recording.num_blocks})})


def _config_name(config: Config, kind: str) -> str:
    """A policy or router change given as a config, as the report names it."""
    if kind == "router":
        return "+".join([config.router.policy, *(p.name for p in config.router.plugins)])
    return "+".join([config.scheduler.policy, *(p.name for p in config.plugins)])


def _policy_config(cfg: Config, policy: str | Config) -> Config:
    """``cfg`` with the new policy: a name alone, or another config's policy and plugins."""
    if isinstance(policy, str):
        return cfg.model_copy(update={"scheduler": cfg.scheduler.model_copy(update={"policy": policy}),
                                      "plugins": []})
    return cfg.model_copy(update={
        "scheduler": cfg.scheduler.model_copy(update={"policy": policy.scheduler.policy}),
        "plugins": list(policy.plugins)})


def _run_engine(recording: Recording, cfg: Config, from_step: int, *, after: Any = None,
                victim: str | None = None) -> tuple[RunResult, ReplayPolicy]:
    steps = {s.step: s for s in recording.steps}
    plugin = ReplayPolicy(get_plugin_manager(cfg), after, recorded=steps, from_step=from_step,
                          victim=victim)
    runner, eos = _runner(cfg, recording)
    # The engine's own plugin set is the built-ins alone: ReplayPolicy answers for the
    # recorded policy and the changed one.
    engine_cfg = cfg.model_copy(update={"scheduler": cfg.scheduler.model_copy(update={"policy": "fcfs"}),
                                        "plugins": []})
    run = EngineRun(engine_cfg, recording.requests, runner=runner, extra_plugins=[plugin],
                    pin_before=from_step, recorded=steps, verify_before=from_step,
                    eos_token_id=eos, after_step=plugin.check)
    return run.run(), plugin


def _runner(cfg: Config, recording: Recording) -> tuple[Any, int | None]:
    """The replay's runner, ending each request that stopped (EOS) after as many output
    tokens as it had; and the EOS id the requests carry."""
    runner = configured_runner_class(cfg).from_config(cfg)
    eos = cfg.runner.eos_token_id
    stops = {r.request_id: r.num_output_tokens - 1 for r in recording.requests
             if r.finish_reason == "stop" and r.num_output_tokens}
    if stops and hasattr(runner, "output_len"):
        runner.output_len = stops.get
        if runner.eos_token_id is None:
            runner.eos_token_id = cfg.runner.vocab_size - 1
        eos = runner.eos_token_id
    return runner, eos


def _reproduces(recording: Recording, run: RunResult) -> bool:
    by_id = {m.request_id: m for m in run.metrics}
    for r in recording.requests:
        m = by_id.get(r.request_id)
        if m is None or r.metrics is None or metrics_record(m) != r.metrics \
                or (m.num_output_tokens, m.finish_reason) != (r.num_output_tokens, r.finish_reason):
            return False
    return True


def _replay_cluster(recording: Recording, cfg: Config, from_step: int, router: str | Config | None,
                    change: dict[str, str]) -> ReplayResult:
    workload = [r.workload_request() for r in recording.requests]
    forced = dict(recording.routes[:from_step - 1])

    def run(config: Config) -> RunResult:
        result = run_cluster_workload(config, workload, router_extra_plugins=[ForcedRoutes(forced)])
        where = getattr(result, "replica_of", {})
        for i, (rid, replica) in enumerate(recording.routes[:from_step - 1], 1):
            if where.get(rid) != replica:
                raise ReplayDivergenceError(
                    f"routing decision {i}: request {rid!r} went to replica {where.get(rid)}, "
                    f"recorded {replica}", step=i, differences={"replica": (replica, where.get(rid))})
        return result

    base = run(cfg)
    result = ReplayResult(recording, from_step, change, base, None, _reproduces(recording, base))
    if router is not None:
        section = RouterConfig(policy=router) if isinstance(router, str) else router.router
        result.changed = run(cfg.model_copy(update={"router": section}))
    return result
