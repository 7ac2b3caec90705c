"""Disaggregation and live migration in the cluster simulation, at 16 replicas.

Method: each deployment replays the same requests (the trace tiled to ``--requests``
as ``scripts/cluster_bench.py`` tiles it) through 16 simulated replicas (the
trace configs' profile, cache and scheduler; the H200 hand-set profile unless
``--profile``), once; its requests' metrics are then summarised under a tight and a
loose TPOT target (the TTFT target the same), so the two SLOs compare the same runs.

1. Disaggregation, on the Mooncake and Azure conversation traces: colocated (16
   replicas, the trace config's router), disaggregated (``--prefill`` replicas prefill,
   the others decode, every request with an uncached token split) and selective (the
   same roles, split when more than ``--threshold`` prompt tokens are uncached).
   Reported: goodput (requests per second meeting both targets), attainment, output
   tokens per second, and each deployment's ratio to colocated.
2. Migration, on a heavy-tailed synthetic workload (lognormal prompts, Zipf outputs,
   bursty arrivals) over 16 colocated replicas behind ``round-robin``: without and with
   the ``rebalance`` plugin. Reported: E2E p50 / p99, TTFT p99, preemptions, moves.

    python scripts/disagg_study.py --requests 20000 -o docs/cluster/disagg-study.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from schedkit.config import Config, load_config
from schedkit.lab.cluster_sim import run_cluster_workload, summarize_cluster
from schedkit.lab.metrics import summarize
from schedkit.lab.workloads import generate, repeat_workload

ROOT = Path(__file__).resolve().parents[1]
TRACES = {"mooncake": "configs/cluster-mooncake.yaml", "azure": "configs/cluster-azure-conv.yaml"}


def with_(config: Config, **sections: dict[str, Any]) -> Config:
    data = config.model_dump(mode="json")
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values} if values is not None else None
    return Config.model_validate(data)


def figures(summary: dict[str, Any]) -> dict[str, Any]:
    out = {k: summary.get(k) for k in ("goodput_req_s", "slo_attainment", "output_tokens_per_s", "throughput_req_s")}
    for name in ("ttft", "tpot", "e2e"):
        dist = summary.get(f"{name}_s") or {}
        out |= {f"{name}_p50": dist.get("p50"), f"{name}_p99": dist.get("p99")}
    return out


def disaggregation(trace: str, n: int, prefill: int, threshold: float, tight: float, loose: float,
                   ttft: float, profile: str | None, slower: float = 1.0) -> dict[str, Any]:
    base = load_config(ROOT / TRACES[trace])
    if profile:
        base = with_(base, runner={"profile": profile})
    assert base.workload.trace is not None
    scale = base.workload.trace.time_scale * slower
    base = with_(base, workload={"trace": {**base.workload.trace.model_dump(mode="json"), "time_scale": scale}})
    workload = repeat_workload(generate(base.workload, base.runner.vocab_size, ROOT), n,
                               vocab_size=base.runner.vocab_size)
    roles = {"prefill": prefill, "decode": base.replicas.count - prefill}
    split = {"policy": base.router.policy}
    deployments = {
        "colocated": base,
        "disaggregated": with_(base, replicas={"roles": roles}, router={
            **split, "plugins": [{"name": "selective-pd", "settings": {"threshold": 0}}]}),
        f"selective-{threshold:g}": with_(base, replicas={"roles": roles}, router={
            **split, "plugins": [{"name": "selective-pd", "settings": {"threshold": threshold}}]}),
    }
    out: dict[str, Any] = {"trace": trace, "requests": len(workload), "roles": roles, "time_scale": scale,
                           "ttft_s": ttft, "tpot_tight_s": tight, "tpot_loose_s": loose, "runs": {}}
    for name, cfg in deployments.items():
        t0 = time.perf_counter()
        run = run_cluster_workload(cfg, workload)
        wall = time.perf_counter() - t0
        summary = summarize_cluster(cfg, run)
        entry: dict[str, Any] = {"wall_s": wall, "num_steps": run.num_steps}
        for label, tpot in (("tight", tight), ("loose", loose)):
            slo = cfg.workload.slo.model_copy(update={"ttft_s": ttft, "tpot_s": tpot})
            entry[label] = figures(summarize(run.metrics, slo))
        if "disaggregation" in summary:
            d = summary["disaggregation"]
            entry["disaggregation"] = {k: d[k] for k in ("num_disaggregated", "num_blocks_transferred",
                                                         "transfer_s_mean")}
            entry["busy_s_mean_by_role"] = {r: v["busy_s_mean"] for r, v in d["roles"].items()}
        out["runs"][name] = entry
        print(f"{trace} {name}: {wall:.0f} s wall, {run.num_steps} steps; goodput tight "
              f"{entry['tight']['goodput_req_s']:.2f} loose {entry['loose']['goodput_req_s']:.2f} req/s, "
              f"{entry['loose']['output_tokens_per_s']:.0f} tok/s", flush=True)
    colo = out["runs"]["colocated"]
    out["ratios_to_colocated"] = {
        name: {"goodput_tight": _ratio(r["tight"]["goodput_req_s"], colo["tight"]["goodput_req_s"]),
               "goodput_loose": _ratio(r["loose"]["goodput_req_s"], colo["loose"]["goodput_req_s"]),
               "output_tokens_per_s": _ratio(r["loose"]["output_tokens_per_s"], colo["loose"]["output_tokens_per_s"])}
        for name, r in out["runs"].items() if name != "colocated"}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def migration(n: int, profile: str | None, min_gap: float, rate: float, num_blocks: int) -> dict[str, Any]:
    base = load_config(ROOT / TRACES["azure"])
    if profile:
        base = with_(base, runner={"profile": profile})
    base = with_(base, router={"policy": "round-robin", "plugins": []}, workload={
        "kind": "gamma", "burstiness": 2.0, "rate": rate, "num_requests": n, "trace": None,
        "prompt_len": {"dist": "lognormal", "median": 600, "sigma": 1.0, "min": 16, "max": 8192},
        "output_len": {"dist": "zipf", "a": 1.2, "min": 8, "max": 4096}, "seed": 3},
        cache={"num_blocks": num_blocks}, scheduler={"max_model_len": (num_blocks - 1) * 16})
    workload = generate(base.workload, base.runner.vocab_size, ROOT)
    runs = {"off": base, "rebalance": with_(base, router={"policy": "round-robin", "migration_interval_s": 0.5,
                                                          "plugins": [{"name": "rebalance", "settings": {
                                                              "min_gap": min_gap, "max_moves": 2}}]})}
    out: dict[str, Any] = {"workload": "heavy-tail", "requests": len(workload), "rate": rate,
                           "num_blocks": num_blocks, "min_gap": min_gap, "runs": {}}
    for name, cfg in runs.items():
        t0 = time.perf_counter()
        run = run_cluster_workload(cfg, workload)
        wall = time.perf_counter() - t0
        s = summarize_cluster(cfg, run)
        o = figures(s["overall"])
        out["runs"][name] = {"wall_s": wall, "e2e_p50": o["e2e_p50"], "e2e_p99": o["e2e_p99"],
                             "ttft_p99": o["ttft_p99"], "preemptions": sum(r["preemptions"] for r in s["replicas"]),
                             "moves": s.get("migration", {}).get("num_migrated", 0),
                             "kv_imbalance_busy_s": s["load_imbalance"]["busy_s"]}
        print(f"migration {name}: {out['runs'][name]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--traces", default="mooncake,azure")
    ap.add_argument("--prefill", type=int, default=4, help="prefill replicas of the 16")
    ap.add_argument("--threshold", type=float, default=1024)
    ap.add_argument("--ttft", type=float, default=2.0)
    ap.add_argument("--tight", type=float, default=0.01, help="tight TPOT target, seconds")
    ap.add_argument("--loose", type=float, default=0.1, help="loose TPOT target, seconds")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--slower", type=float, default=1.0, help="stretch the trace's arrivals by this factor "
                    "(2: half the configs' request rate)")
    ap.add_argument("--migration-requests", type=int, default=5000)
    ap.add_argument("--min-gap", type=float, default=0.2)
    ap.add_argument("--migration-rate", type=float, default=60.0)
    ap.add_argument("--migration-blocks", type=int, default=1200, help="KV blocks (16 tokens) per replica")
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    result: dict[str, Any] = {"disaggregation": [], "command": "python scripts/disagg_study.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "output")}
    for trace in args.traces.split(","):
        result["disaggregation"].append(disaggregation(trace, args.requests, args.prefill, args.threshold,
                                                       args.tight, args.loose, args.ttft, args.profile,
                                                       args.slower))
    if args.migration_requests:
        result["migration"] = migration(args.migration_requests, args.profile, args.min_gap, args.migration_rate,
                                        args.migration_blocks)
    print(json.dumps({"ratios": [d["ratios_to_colocated"] for d in result["disaggregation"]]}, indent=1))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
