#!/usr/bin/env python
"""A tenant sending ten times its share, behind 16 simulated replicas, with and without
flow control at the front door.

Method. ``configs/cluster-tenants.yaml``'s workload (the Azure 2023 conversation trace,
four tenants drawn by weight: ``heavy`` 20, ``a``, ``b``, ``c`` 1 each) is generated
once and tiled to ``--requests`` (:func:`schedkit.lab.workloads.repeat_workload`). The
heavy tenant's requests are then thinned, keeping the requests of a, b and c unchanged:
every 20th (*share*: heavy sends what each other tenant sends; the cluster is below
saturation), every 2nd (10x), all (20x). The share run goes without flow control; at
10x and 20x every profile of the config's ``compare`` section replays the workload
through :func:`schedkit.lab.cluster_sim.run_cluster_workload` (the real FCFS scheduler,
the simulated cost model, the router's least-outstanding policy, and the front door's
:class:`~schedkit.cluster.flow.FlowController` on the same virtual clock where the
profile enables it). Per tenant group: TTFT p50 / p99 of the requests served (from
arrival at the front door, so a wait there counts), requests refused there (429s), SLO
attainment (the config's TTFT and TPOT targets; a refused request misses them). The
engine queue is the longest waiting queue any replica had after a step.

What a bound on the light tenants' TTFT p99 has to show is that it does not grow with
what the heavy tenant sends (VTC's 2U bound is of that kind): with fair flow control a
light request waits at the front door for at most one dispatch per backlogged tenant,
and at its replica behind the few requests the saturation detector lets queue there
(``max_waiting``), whatever the heavy tenant's backlog. The rise over the share run is
reported at 10x and 20x. Deterministic: only wall times vary.

    .venv/bin/python scripts/flow_study.py                       # 20,000 requests
    .venv/bin/python scripts/flow_study.py --requests 4000 --json /tmp/flow.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from schedkit.config import Config, load_config  # noqa: E402
from schedkit.lab.cluster_sim import run_cluster_workload  # noqa: E402
from schedkit.lab.cluster_summary import ClusterRunResult  # noqa: E402
from schedkit.lab.compare import profile_config  # noqa: E402
from schedkit.lab.metrics import RequestMetrics, percentile  # noqa: E402
from schedkit.lab.workloads import WorkloadRequest, generate, repeat_workload  # noqa: E402

CONFIG = ROOT / "configs/cluster-tenants.yaml"
HEAVY = "heavy"


def thinned(workload: list[WorkloadRequest], keep_every: int) -> list[WorkloadRequest]:
    """The workload with only every ``keep_every``-th request of the heavy tenant."""
    kept, n = [], 0
    for w in workload:
        if w.tenant == HEAVY:
            n += 1
            if (n - 1) % keep_every:
                continue
        kept.append(w)
    return kept


def group(metrics: list[RequestMetrics], heavy: bool, config: Config) -> dict[str, Any]:
    ms = [m for m in metrics if (m.tenant == HEAVY) == heavy]
    served = [m for m in ms if m.ttft is not None]
    ttfts = [m.ttft for m in served if m.ttft is not None]
    slo = config.workload.slo
    return {"requests": len(ms), "refused": sum(m.rejected for m in ms),
            "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
            "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
            "slo_attainment": sum(m.meets(slo) for m in ms) / len(ms) if ms else None}


def outcome(config: Config, run: ClusterRunResult, wall_s: float) -> dict[str, Any]:
    served = [m for m in run.metrics if m.ttft is not None]
    window = max(m.arrival_time for m in run.metrics) - min(m.arrival_time for m in run.metrics)
    return {"light": group(run.metrics, False, config), "heavy": group(run.metrics, True, config),
            "served_per_s": len(served) / window if window > 0 else None,
            "max_engine_waiting": max(run.replica_max_waiting), "flow_control": run.flow_stats,
            "num_steps": run.num_steps, "wall_s": wall_s}


def with_replicas(config: Config, replicas: int) -> Config:
    return config.model_copy(update={"replicas": config.replicas.model_copy(update={"count": replicas})})


def _s(x: float | None, scale: float = 1e3, fmt: str = ",.0f") -> str:
    return "—" if x is None else format(x * scale, fmt)


def table(results: dict[str, dict[str, Any]]) -> str:
    share = results["share"]["light"]["ttft_p99_s"]
    lines = ["| heavy sends | front door | light TTFT p50 ms | light TTFT p99 ms | rise over share ms | "
             "light refused | light SLO | heavy TTFT p99 ms | heavy refused | heavy SLO | engine queue max |",
             "|---|---|" + "--:|" * 9]
    for key, r in results.items():
        light, heavy = r["light"], r["heavy"]
        rise = light["ttft_p99_s"] - share if key != "share" else None
        excess, _, name = key.partition(" ")
        lines.append(
            f"| {excess if key != 'share' else '1x'} | {name or 'no-flow-control'} | {_s(light['ttft_p50_s'])} | "
            f"{_s(light['ttft_p99_s'])} | {_s(rise)} | {light['refused']} / {light['requests']} | "
            f"{_s(light['slo_attainment'], 1, '.3f')} | {_s(heavy['ttft_p99_s'])} | "
            f"{heavy['refused']} / {heavy['requests']} | {_s(heavy['slo_attainment'], 1, '.3f')} | "
            f"{r['max_engine_waiting']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    config = load_config(CONFIG)
    assert config.compare is not None
    base = generate(config.workload, config.runner.vocab_size, ROOT)
    workload = repeat_workload(base, args.requests, vocab_size=config.runner.vocab_size)
    runs: list[tuple[str, Config, list[WorkloadRequest]]] = [
        ("share", with_replicas(config, args.replicas), thinned(workload, 20))]
    for excess, keep in (("10x", 2), ("20x", 1)):
        runs += [(f"{excess} {p.name}", with_replicas(profile_config(config, p), args.replicas), thinned(workload, keep))
                 for p in config.compare.profiles]
    results: dict[str, dict[str, Any]] = {}
    for name, cfg, wl in runs:
        t0 = time.perf_counter()
        run = run_cluster_workload(cfg, wl)
        results[name] = outcome(cfg, run, time.perf_counter() - t0)
        print(f"  {name}: {len(wl):,} requests, {results[name]['wall_s']:.0f} s wall", flush=True)
    print(f"\n{args.replicas} replicas, {args.requests:,} requests ({workload[-1].arrival_time:.1f} s of "
          f"arrivals); {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}\n")
    print(table(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"replicas": args.replicas, "requests": args.requests,
                                         "results": results}, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
