"""The cluster simulation against real replicas on this machine, per router.

    python scripts/cluster_accuracy.py configs/accuracy/cluster-smollm2-cpu.yaml \\
        --profile cpu-smollm2-135m-1t [--routers round-robin,prefix-affinity] [--repeats 2] -o out.json
    python scripts/cluster_accuracy.py configs/accuracy/cluster-groups-smollm2-cpu.yaml \\
        --calibrate configs/calibration/cpu-smollm2-1t.yaml -o out.json    # fit, then check

For each router, the config's workload runs through ``replicas.count`` real engine
processes behind the router (``LLM``, the config's paged runner) ``--repeats`` times,
and once through the cluster simulation (the same config with the simulated runner and
``--profile``: fit it with ``schedkit calibrate`` on a one-replica copy of the config).
Printed per router: TTFT p50/p99, E2E mean and prefix hit rate on both sides with the
simulator's error and the real runs' spread; then the ratio prefix-affinity /
round-robin of each on both sides: does the simulated advantage hold on real replicas?
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from schedkit.cli import main as cli_main
from schedkit.config import RouterConfig, SimulatedRunnerConfig, load_config
from schedkit.core.request import SamplingParams
from schedkit.lab.accuracy import compare_runs, summary_metrics
from schedkit.lab.cluster_sim import run_cluster_workload
from schedkit.lab.metrics import metrics_from_output, summarize
from schedkit.lab.workloads import generate
from schedkit.llm import LLM
from schedkit.runners.machine import cpu_times, steal_share

KEYS = ("ttft_p50_s", "ttft_p99_s", "e2e_mean_s", "prefix_hit_rate")


def figures(metrics: list) -> dict[str, float]:
    summary = summarize(metrics)
    return {**summary_metrics(summary), "prefix_hit_rate": summary["prefix_hit_rate"]}


def real_run(config: Any, workload: list) -> dict[str, float]:
    with LLM(config) as llm:
        outs = llm.generate([w.prompt_token_ids for w in workload],
                            [SamplingParams(max_tokens=w.max_tokens, eos_token_id=None) for w in workload],
                            arrival_offsets=[w.arrival_time for w in workload],
                            priorities=[w.priority for w in workload], tenants=[w.tenant for w in workload],
                            use_tqdm=False)
    failed = [o for o in outs if o.error is not None]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed, first: {failed[0].request_id}: {failed[0].error}")
    origin = min(o.metrics.arrival_time - w.arrival_time for o, w in zip(outs, workload, strict=True))
    return figures([metrics_from_output(o, w, origin) for o, w in zip(outs, workload, strict=True)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--profile", help="the simulator's profile (one replica's, as fitted)")
    ap.add_argument("--calibrate", metavar="CONFIG",
                    help="first fit the profile to CONFIG (a one-replica copy of the config) with "
                         "schedkit calibrate, then run the check on it")
    ap.add_argument("--budget-s", type=float, default=600.0, help="the calibration's budget (seconds)")
    ap.add_argument("--routers", default="round-robin,prefix-affinity")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-o", "--output")
    a = ap.parse_args()
    if bool(a.profile) == bool(a.calibrate):
        ap.error("give --profile PROFILE or --calibrate CONFIG")
    fitted = None
    if a.calibrate:
        a.profile = str(Path(a.output or "cluster-check.json").with_suffix("")) + "-profile.json"
        if cli_main(["calibrate", a.calibrate, "-o", a.profile, "--budget-s", str(a.budget_s)]):
            raise SystemExit("calibration failed")
        data = json.loads(Path(a.profile).read_text())
        fitted = {"config": a.calibrate, "steal_share": data["calibration"].get("steal_share"),
                  "mean_relative_step_error": data.get("mean_relative_step_error")}
    base = load_config(a.config)
    workload = generate(base.workload, base.runner.vocab_size, Path(a.config).parent)
    out: dict[str, Any] = {"config": a.config, "profile": a.profile, "calibrated": fitted,
                           "replicas": base.replicas.count, "requests": len(workload), "routers": {},
                           "steal": {}}
    routers = a.routers.split(",")
    reals: dict[str, list[dict[str, float]]] = {r: [] for r in routers}
    for rep in range(a.repeats):  # routers in turn: A B A B
        for router in routers:
            cfg = base.model_copy(update={"router": RouterConfig(policy=router)})
            t0, cpu0 = time.perf_counter(), cpu_times()
            reals[router].append(real_run(cfg, workload))
            steal = steal_share(cpu0, cpu_times())
            out["steal"].setdefault(router, []).append(steal)
            print(f"real {router} run {rep + 1}: {time.perf_counter() - t0:.1f} s, steal "
                  f"{'n/a' if steal is None else f'{steal:.1%}'}: {reals[router][-1]}", file=sys.stderr, flush=True)
    for router in routers:
        cfg = base.model_copy(update={
            "router": RouterConfig(policy=router),
            "runner": SimulatedRunnerConfig(vocab_size=base.runner.vocab_size, eos_token_id=None,
                                            profile=a.profile)})
        sim = figures(run_cluster_workload(cfg, workload).metrics)
        out["routers"][router] = compare_runs(reals[router], sim, KEYS)
    print(f"{len(workload)} requests, {base.replicas.count} replicas, profile {a.profile}")
    print(f"{'router':<18} {'metric':<16} {'real':>10} {'sim':>10} {'error':>8} {'spread':>8}")
    for router, rows in out["routers"].items():
        for k, r in rows.items():
            print(f"{router:<18} {k:<16} {r['real']:10.4f} {r['sim']:10.4f} {r['error']:8.1%} {r['spread']:8.1%}")
    if len(routers) == 2:
        a_, b_ = (out["routers"][r] for r in routers)
        out["ratio"] = {k: {"real": b_[k]["real"] / a_[k]["real"] if a_[k]["real"] else float("nan"),
                            "sim": b_[k]["sim"] / a_[k]["sim"] if a_[k]["sim"] else float("nan")} for k in KEYS}
        print(f"\n{routers[1]} / {routers[0]}:")
        for k, r in out["ratio"].items():
            print(f"  {k:<16} real {r['real']:.2f}x  sim {r['sim']:.2f}x")
    if a.output:
        Path(a.output).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
