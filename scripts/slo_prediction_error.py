#!/usr/bin/env python
"""How far the router's TTFT prediction is from the TTFT a request then gets.

Method. An open-loop Poisson workload (``configs/calibration/cpu-smollm2.yaml``'s:
lognormal prompts of median 200 tokens, 8-64 output tokens, at ``--rates``) is served by
one engine in this process, in the order a replica behind the router sees it: after
every step the engine's load report (:func:`schedkit.engine.load.load_figures`) goes
to a one-replica :class:`~schedkit.cluster.router.Router` (its ``router.latency_profile``:
``--profile``, the cost model fitted to that engine); each request arriving while a
step ran is then routed at its arrival time, on the report sent before it, and the
predicted TTFT recorded (:meth:`Router.route` asks the hooks; a recorder plugin reads
``latency.estimate`` for the replica chosen), then added to the engine with its true
arrival time. Its actual TTFT is its first token's step end minus its arrival.

* ``paged``: the real paged runner on CPU (SmolLM2-135M-Instruct, float32, two threads;
  ``configs/smollm2.yaml`` says where the weights come from), on the wall clock, after
  a warm-up (six prompts of 60-400 tokens at once, 16 tokens each, run twice). A
  second row gives the predictions of the same profile with every duration scaled by
  the warm-up's second run's measured step time over the profile's (how much slower
  this machine runs now than when the profile was fitted), made on the same states:
  what is left is the predictor's own error.
* ``simulated``: the same engine settings on the simulator with the same profile, on a
  virtual clock: the predictor replays the cost model the simulator charges, so what
  differs is only what the predictor does not model (module docstring of
  :mod:`schedkit.cluster.latency`).
* ``cluster`` (``--cluster CONFIG``): the cluster simulation of CONFIG (default
  ``configs/cluster-slo.yaml``, its own router) with the recorder plugin: the prediction
  for the replica chosen against the TTFT the simulation gives.

Reported per run: requests, the measured step time over the cost model's (summed over the
steps that computed something: how far the profile is from this machine now), mean actual
TTFT, mean absolute error, mean signed error
(predicted - actual), and the median and p90 of the relative error |predicted - actual|
/ actual.

    .venv/bin/python scripts/slo_prediction_error.py                    # paged + simulated + cluster
    .venv/bin/python scripts/slo_prediction_error.py --runs simulated,cluster --requests 400
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from schedkit import hookimpl  # noqa: E402
from schedkit.cluster.latency import LatencyPredictor, RouterLatency  # noqa: E402
from schedkit.cluster.router import Router  # noqa: E402
from schedkit.config import Config, load_config  # noqa: E402
from schedkit.core.outputs import SchedulerOutput  # noqa: E402
from schedkit.core.request import Request, SamplingParams  # noqa: E402
from schedkit.core.routing import (  # noqa: E402
    LatencyEstimate,
    ReplicaState,
    RouteEvent,
    RouteEventKind,
    RouteLatency,
    RouteRequest,
)
from schedkit.engine.core import EngineCore  # noqa: E402
from schedkit.engine.load import load_figures  # noqa: E402
from schedkit.lab.cluster_sim import run_cluster_workload  # noqa: E402
from schedkit.lab.workloads import WorkloadRequest, generate  # noqa: E402
from schedkit.runners.cost_model import CostModel, StepShapes  # noqa: E402

ENGINE_CONFIG = ROOT / "configs" / "calibration" / "cpu-smollm2.yaml"
CLUSTER_CONFIG = ROOT / "configs" / "cluster-slo.yaml"


class StepCost:
    """An engine plugin that prices every step with the cost model (the same features
    the simulator charges), to set each measured step duration against."""

    def __init__(self, cost_model: CostModel, block_size: int) -> None:
        self.cost_model = cost_model
        self.shapes = StepShapes(block_size)
        self.predicted: list[float] = []

    @hookimpl
    def schedkit_on_step_end(self, scheduler_output: SchedulerOutput) -> None:
        f = self.shapes.features(scheduler_output)
        self.predicted.append(self.cost_model.step_time(f) if scheduler_output.total_num_scheduled_tokens else 0.0)


class Recorder:
    """A router plugin that records, for each request routed, the prediction for the
    replica it went to (it asks for every candidate's; it scores nothing); with
    ``rescaled``, also that predictor's, on the same state."""

    def __init__(self, rescaled: LatencyPredictor | None = None) -> None:
        self.rescaled = rescaled
        self.seen: dict[int, tuple[LatencyEstimate, LatencyEstimate | None]] = {}
        self.chosen: dict[str, tuple[LatencyEstimate, LatencyEstimate | None]] = {}

    @hookimpl
    def schedkit_router_score(self, request: RouteRequest, replicas: Sequence[ReplicaState],
                              latency: RouteLatency) -> None:
        assert isinstance(latency, RouterLatency)
        again = self.rescaled
        self.seen = {r.index: (latency.estimate(request, r), None if again is None else again.predict(
            r, request.num_prompt_tokens, 0, latency.now, latency.unreported(r))) for r in replicas}

    @hookimpl
    def schedkit_on_route_event(self, event: RouteEvent) -> None:
        if event.kind is RouteEventKind.ROUTED:
            self.chosen[event.request.request_id] = self.seen[event.replica.index]


WARM_UP = (300, 120, 200, 60, 400, 150)
"""Prompt lengths of the real runner's warm-up requests (all at once, 16 tokens each)."""


def warm_up(engine: EngineCore, pricing: StepCost) -> float:
    """Run the warm-up twice (the first steps of a real runner are slow); returns the
    second run's measured step time over the cost model's."""
    measured = 0.0
    for rep in range(2):
        for i, n in enumerate(WARM_UP):
            engine.add_request(Request(f"warm-{rep}-{i}", [7 + i + 10 * rep] * n, SamplingParams(max_tokens=16),
                                       arrival_time=engine.now()))
        skip = len(pricing.predicted)
        measured = 0.0
        while engine.has_requests():
            t0 = engine.now()
            engine.step()
            measured += engine.now() - t0
        engine.scheduler.reset_prefix_cache()
    return measured / sum(pricing.predicted[skip:])


def with_(config: Config, **sections: dict[str, Any]) -> Config:
    data = config.model_dump(mode="json", exclude_none=True)
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    return Config.model_validate(data)


def serve_one_engine(config: Config, workload: list[WorkloadRequest]) -> dict[str, Any]:
    """Serve ``workload`` through one engine behind a one-replica router (module
    docstring). Returns the (predicted, actual) TTFT of each request, the measured step
    time over the cost model's (summed over the steps that computed something), and
    with a real runner the ratio its warm-up measured and the predictions of the
    profile scaled by it."""
    fitted = LatencyPredictor.from_config(config)
    assert fitted is not None
    pricing = StepCost(fitted.cost_model, config.cache.block_size)
    engine = EngineCore(config, extra_plugins=[pricing])
    rescaled = None
    if not engine.is_virtual:
        factor = warm_up(engine, pricing)
        rescaled = LatencyPredictor(fitted.cost_model.scaled(factor), config.scheduler)
    recorder = Recorder(rescaled)
    router = Router(config, 1, extra_plugins=[recorder])
    measured: list[float] = []
    skip = len(pricing.predicted)
    start = engine.now()
    todo = deque(sorted(workload, key=lambda w: w.arrival_time))
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    eos = config.runner.eos_token_id

    def report(now: float) -> None:
        router.update_load(0, **load_figures(engine.scheduler)._asdict(), now=now)

    def arrive(upto: float) -> None:
        while todo and start + todo[0].arrival_time <= upto:
            w = todo.popleft()
            t = start + w.arrival_time
            router.route(router.make_request(w.request_id, w.prompt_token_ids, max_tokens=w.max_tokens), now=t)
            arrival[w.request_id] = t
            engine.add_request_at(Request(w.request_id, w.prompt_token_ids,
                                          SamplingParams(max_tokens=w.max_tokens, eos_token_id=eos),
                                          arrival_time=t), t)

    report(start)
    while todo or engine.has_requests():
        if not engine.has_requests():
            t = start + todo[0].arrival_time
            if engine.is_virtual:
                engine.advance_to(t)
            else:
                time.sleep(max(t - engine.now(), 0.0))
            arrive(max(engine.now(), t))
            continue
        before, steps = engine.now(), engine.num_steps
        outputs = engine.step()
        now = engine.now()
        if engine.num_steps > steps:
            measured.append(now - before)
        arrive(now)  # they arrived while the step ran: routed on the report before it
        for group in outputs.values():
            for o in group.outputs:
                if o.new_token_ids and o.request_id not in first:
                    first[o.request_id] = now
                if o.finish_reason is not None:
                    router.finished(o.request_id)
        report(now)
    priced = pricing.predicted[skip:]
    busy = [(m, p) for m, p in zip(measured, priced, strict=True) if p > 0]
    served = [rid for rid in arrival if rid in first]
    out: dict[str, Any] = {
        "pairs": [(recorder.chosen[rid][0].ttft_s, first[rid] - arrival[rid]) for rid in served],
        "step_ratio": sum(m for m, _ in busy) / sum(p for _, p in busy)}
    if rescaled is not None:
        out["scale"] = factor
        out["rescaled_pairs"] = [(recorder.chosen[rid][1].ttft_s, first[rid] - arrival[rid])  # type: ignore[union-attr]
                                 for rid in served]
    return out


def serve_cluster(config: Config) -> list[tuple[float, float]]:
    recorder = Recorder()
    run = run_cluster_workload(config, router_extra_plugins=[recorder], base_dir=ROOT)
    return [(recorder.chosen[m.request_id][0].ttft_s, m.ttft) for m in run.metrics
            if m.ttft is not None and m.request_id in recorder.chosen]


def errors(pairs: list[tuple[float, float]], step_ratio: float) -> dict[str, float]:
    rel = sorted(abs(p - a) / a for p, a in pairs if a > 0)
    return {"requests": len(pairs), "step_ratio": step_ratio, "mean_ttft_s": statistics.fmean(a for _, a in pairs),
            "mae_s": statistics.fmean(abs(p - a) for p, a in pairs),
            "bias_s": statistics.fmean(p - a for p, a in pairs),
            "rel_p50": rel[len(rel) // 2], "rel_p90": rel[min(int(len(rel) * 0.9), len(rel) - 1)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="paged,simulated,cluster", help="comma-separated: paged, simulated, cluster")
    ap.add_argument("--rates", default="1,2", help="requests per second of the one-engine runs")
    ap.add_argument("--requests", type=int, default=80, help="requests per one-engine run")
    ap.add_argument("--profile", default="cpu-smollm2-135m", help="the cost-model profile the router predicts with")
    ap.add_argument("--cluster", type=Path, default=CLUSTER_CONFIG, help="the cluster run's config")
    ap.add_argument("--router", default="least-outstanding", help="the cluster run's router policy")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)

    base = load_config(ENGINE_CONFIG)
    rows: list[tuple[str, dict[str, float]]] = []
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    for kind in ("paged", "simulated"):
        if kind not in runs:
            continue
        for rate in (float(r) for r in args.rates.split(",")):
            cfg = with_(base, router={"latency_profile": args.profile},
                        workload={"rate": rate, "num_requests": args.requests})
            if kind == "simulated":
                data = cfg.model_dump(mode="json", exclude_none=True)
                data["runner"] = {"kind": "simulated", "profile": args.profile,
                                  "vocab_size": base.runner.vocab_size, "eos_token_id": base.runner.eos_token_id}
                cfg = Config.model_validate(data)
            workload = generate(cfg.workload, cfg.runner.vocab_size, ROOT)
            t0 = time.perf_counter()
            run = serve_one_engine(cfg, workload)
            rows.append((f"{kind}, 1 engine, {rate:g} req/s", errors(run["pairs"], run["step_ratio"])))
            if "rescaled_pairs" in run:
                rows.append((f"{kind}, 1 engine, {rate:g} req/s, profile x{run['scale']:.2f} (warm-up)",
                             errors(run["rescaled_pairs"], run["step_ratio"] / run["scale"])))
            print(f"{rows[-1][0]}: {time.perf_counter() - t0:.0f} s", flush=True)
    if "cluster" in runs:
        cfg = load_config(args.cluster)
        cfg = cfg.model_copy(update={"router": cfg.router.model_copy(update={"policy": args.router})})
        t0 = time.perf_counter()
        rows.append((f"cluster sim, {cfg.replicas.count} replicas, {args.router}", errors(serve_cluster(cfg), 1.0)))
        print(f"{rows[-1][0]}: {time.perf_counter() - t0:.0f} s", flush=True)

    print(f"\n{platform.machine()}, Python {platform.python_version()}, profile {args.profile}\n")
    print("| run | requests | step time / cost model | mean TTFT ms | MAE ms | bias ms | rel. error p50 | "
          "rel. error p90 |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for name, e in rows:
        print(f"| {name} | {e['requests']} | {e['step_ratio']:.2f} | {e['mean_ttft_s'] * 1e3:.0f} | "
              f"{e['mae_s'] * 1e3:.1f} | {e['bias_s'] * 1e3:+.1f} | {e['rel_p50']:.3f} | {e['rel_p90']:.3f} |")
    if args.json is not None:
        args.json.write_text(json.dumps(dict(rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
