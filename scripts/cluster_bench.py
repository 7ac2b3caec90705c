#!/usr/bin/env python
"""Routing policies compared on traces: N simulated replicas behind the router.

Method. For each trace (``configs/cluster-mooncake.yaml``: the Mooncake conversation
trace, whose hash ids are shared 512-token prefixes; ``configs/cluster-azure-conv.yaml``:
the Azure 2023 conversation trace, no shared prefixes) the config's workload is generated
once, then tiled to ``--requests`` with :func:`schedkit.lab.workloads.repeat_workload`
when the trace is shorter (copy k starts one mean arrival gap after copy k-1 ends, at the
same rate; its prompts go through a token permutation, so copies are new conversations
with the same prefix structure, sharing nothing with the copies before). Every router
profile of the config's ``compare`` section (``--routers`` picks some) then replays that
same workload through :func:`schedkit.lab.cluster_sim.run_cluster_workload`:
``--replicas`` engines with the real scheduler (FCFS) and the simulated cost model, on
one shared virtual clock, each request routed at its arrival on what the replicas had
reported by then. Metrics come from :func:`schedkit.lab.cluster_sim.summarize_cluster`:
prefix hit rate = prefix-cache hit tokens / prompt tokens over every request; TTFT and
TPOT percentiles over every request; load imbalance = max over replicas / mean of the
prompt + output tokens each served (and of the requests each got); goodput = requests per
second meeting the config's SLO (TTFT and TPOT). Ratios are against round-robin on the
same trace. Wall time is each simulation alone (engines, router and event loop; workload
generation is timed once per trace and printed apart). The results are deterministic;
only the wall times vary from run to run.

    .venv/bin/python scripts/cluster_bench.py                       # 16 x 20,000, both traces
    .venv/bin/python scripts/cluster_bench.py --requests 2000 --traces mooncake --jobs 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from schedkit.config import Config, ProfileConfig, load_config  # noqa: E402
from schedkit.lab.cluster_sim import run_cluster_workload, summarize_cluster  # noqa: E402
from schedkit.lab.compare import profile_config  # noqa: E402
from schedkit.lab.workloads import WorkloadRequest, generate, repeat_workload  # noqa: E402

TRACES = {"mooncake": "configs/cluster-mooncake.yaml", "azure": "configs/cluster-azure-conv.yaml"}
BASELINE = "round-robin"

_WORKLOADS: dict[str, list[WorkloadRequest]] = {}
"""Generated in the parent; forked workers read them from here."""


def router_config(config: Config, profile: ProfileConfig, replicas: int) -> Config:
    """The config with the profile's router (and policy, plugins, scheduler keys) and
    ``replicas`` engines."""
    config = profile_config(config, profile)
    return config.model_copy(update={"replicas": config.replicas.model_copy(update={"count": replicas})})


def _run(trace: str, config: Config) -> dict[str, Any]:
    run = run_cluster_workload(config, _WORKLOADS[trace])
    return {"summary": summarize_cluster(config, run), "wall_s": run.wall_s,
            "max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}


def _row_values(s: dict[str, Any]) -> dict[str, float]:
    o = s["overall"]
    return {"hit": s["prefix_hit_rate"], "ttft50": o["ttft_s"]["p50"], "ttft99": o["ttft_s"]["p99"],
            "tpot50": o["tpot_s"]["p50"], "imb_tok": s["load_imbalance"]["tokens"],
            "imb_req": s["load_imbalance"]["requests"], "goodput": o["goodput_req_s"],
            "attain": o["slo_attainment"]}


def _ratio(x: float, base: float) -> str:
    if not (math.isfinite(x) and math.isfinite(base)) or base == 0:
        return "—"
    return f"{x / base:.2f}x"


def _ms(x: float) -> str:
    return f"{x * 1e3:,.0f}" if math.isfinite(x) else "inf"


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    head = ("| trace | router | prefix hit | ×RR | TTFT p50 ms | ×RR | TTFT p99 ms | ×RR | "
            "TPOT p50 ms | imbalance tokens | imbalance requests | goodput req/s | ×RR | "
            "SLO attained | wall s |")
    lines = [head, "|" + "---|" * 2 + "--:|" * (head.count("|") - 3)]
    for trace, runs in results.items():
        base = _row_values(runs[BASELINE]["summary"]) if BASELINE in runs else None
        for name, r in runs.items():
            v = _row_values(r["summary"])
            b = base or v
            lines.append(
                f"| {trace} | {name} | {v['hit']:.3f} | {_ratio(v['hit'], b['hit'])} | "
                f"{_ms(v['ttft50'])} | {_ratio(v['ttft50'], b['ttft50'])} | {_ms(v['ttft99'])} | "
                f"{_ratio(v['ttft99'], b['ttft99'])} | {v['tpot50'] * 1e3:.2f} | {v['imb_tok']:.2f} | "
                f"{v['imb_req']:.2f} | {v['goodput']:.1f} | {_ratio(v['goodput'], b['goodput'])} | "
                f"{v['attain']:.3f} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def _progress(trace: str, name: str, r: dict[str, Any]) -> None:
    s = r["summary"]
    print(f"  {trace} / {name}: {r['wall_s']:.1f} s wall, {s['num_steps']:,} steps, "
          f"peak RSS {r['max_rss_gib']:.1f} GiB", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20_000, help="requests per trace (tiled if the trace is shorter)")
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--jobs", type=int, default=1, help="simulations at once (processes)")
    ap.add_argument("--traces", default=",".join(TRACES), help=f"comma-separated: {', '.join(TRACES)}")
    ap.add_argument("--routers", default=None, help="comma-separated profile names (default: all)")
    ap.add_argument("--time-scale", type=float, default=None, help="override the traces' time_scale")
    ap.add_argument("--json", type=Path, default=None, help="write every summary here")
    args = ap.parse_args(argv)

    wanted = [t.strip() for t in args.traces.split(",") if t.strip()]
    configs: dict[str, tuple[Config, list[ProfileConfig]]] = {}
    for trace in wanted:
        if trace not in TRACES:
            ap.error(f"unknown trace {trace!r} (choose from {', '.join(TRACES)})")
        config = load_config(ROOT / TRACES[trace])
        if args.time_scale is not None:
            assert config.workload.trace is not None
            wl = config.workload.model_copy(update={"trace": config.workload.trace.model_copy(
                update={"time_scale": args.time_scale})})
            config = config.model_copy(update={"workload": wl})
        assert config.compare is not None
        profiles = list(config.compare.profiles)
        if args.routers:
            names = [n.strip() for n in args.routers.split(",")]
            profiles = [p for p in profiles if p.name in names]
        t0 = time.perf_counter()
        base = generate(config.workload, config.runner.vocab_size, ROOT)
        _WORKLOADS[trace] = repeat_workload(base, args.requests, vocab_size=config.runner.vocab_size)
        wl_reqs = _WORKLOADS[trace]
        print(f"{trace}: {len(wl_reqs):,} requests ({len(base):,} in the trace, "
              f"{math.ceil(len(wl_reqs) / len(base))} cop{'y' if len(wl_reqs) <= len(base) else 'ies'}), "
              f"arrivals over {wl_reqs[-1].arrival_time:.1f} s, "
              f"{sum(len(w.prompt_token_ids) for w in wl_reqs) / len(wl_reqs):,.0f} prompt tokens per request; "
              f"generated in {time.perf_counter() - t0:.1f} s", flush=True)
        configs[trace] = (config, profiles)

    tasks = [(trace, p.name, router_config(config, p, args.replicas))
             for trace, (config, profiles) in configs.items() for p in profiles]
    results: dict[str, dict[str, dict[str, Any]]] = {t: {} for t in configs}
    t0 = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, mp_context=get_context("fork")) as pool:
            futures = [(trace, name, pool.submit(_run, trace, cfg)) for trace, name, cfg in tasks]
            for trace, name, fut in futures:
                results[trace][name] = fut.result()
                _progress(trace, name, results[trace][name])
    else:
        for trace, name, cfg in tasks:
            results[trace][name] = _run(trace, cfg)
            _progress(trace, name, results[trace][name])
    total = time.perf_counter() - t0
    print()
    print(f"{args.replicas} replicas, {args.requests:,} requests per trace; {platform.machine()}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, --jobs {args.jobs}; "
          f"all simulations: {total:.0f} s")
    print()
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps({"replicas": args.replicas, "requests": args.requests,
                                         "results": results}, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
