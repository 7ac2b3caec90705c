"""Tenant isolation behind real replicas: one tenant sends ten times its share, with flow
control off and on.

Method: ``AsyncLLM`` starts the replicas of ``--config`` (configs/tenant-isolation.yaml:
two local engine processes, the fake runner pacing every step at 20 ms on the wall
clock, 8 requests running per replica; configs/tenant-isolation-paged.yaml: the
random-weight tiny-llama on the CPU, 4 per replica). Four tenants send open-loop Poisson
arrivals for ``--duration`` seconds: the well-behaved ``a``, ``b`` and ``c`` at
``--rate`` requests/s each, ``heavy`` at ten times that (and, for the baseline, at
``--rate`` too: its share). Each tenant's arrivals come from a generator of its own, so
the well-behaved tenants send the same requests in every run. Every request has a
``--prompt-len`` random prompt and asks for ``--max-tokens`` tokens (EOS ignored). Its
TTFT runs from its scheduled arrival to its first token, as its client sees it; a
request the front door refuses (``EngineBusyError``, HTTP's 429) is counted, not timed.
A watcher reads ``stats()`` every 50 ms for the longest engine queue (requests waiting
in the replicas' schedulers, summed, and the most in one replica).

Runs: flow control off, ``tenant-round-robin`` and ``tenant-weighted`` (equal weights),
each with heavy at 10x and at 1x. Reported per run and tenant: requests, served, 429s,
TTFT p50 / p99; per run the longest engine queue; per mode the ratio of the
well-behaved tenants' TTFT p99 with heavy at 10x to that with heavy at 1x.

    python scripts/tenant_isolation.py -o docs/flow-control/tenant-isolation.json
    python scripts/tenant_isolation.py --config configs/tenant-isolation-paged.yaml \\
        --rate 1 --max-tokens 64 -o docs/flow-control/tenant-isolation-paged.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

from schedkit.config import Config, load_config
from schedkit.core.request import SamplingParams
from schedkit.errors import EngineBusyError
from schedkit.lab.metrics import percentile
from schedkit.llm import AsyncLLM

ROOT = Path(__file__).resolve().parents[1]
HEAVY = "heavy"
GOOD = ("a", "b", "c")
MODES = ("off", "tenant-round-robin", "tenant-weighted")
LOADS = {"10x": 10.0, "1x": 1.0}


def variant(base: Config, mode: str, max_waiting: int | None = None) -> Config:
    """``base`` with flow control off (``mode`` "off") or on with ``mode`` as its fairness
    plugin, and ``max_waiting`` as queue-depth's setting when given."""
    data = base.model_dump(mode="json")
    flow = data["flow_control"]
    flow["enabled"] = mode != "off"
    if mode != "off":
        flow["fairness"] = mode
    if max_waiting is not None:
        others = [p for p in flow["plugins"] if p["name"] != "queue-depth"]
        old = next((p["settings"] for p in flow["plugins"] if p["name"] == "queue-depth"), {})
        flow["plugins"] = [*others, {"name": "queue-depth", "settings": {**old, "max_waiting": max_waiting}}]
    return Config.model_validate(data)


def arrivals(rate: float, heavy_factor: float, duration: float, seed: int) -> list[tuple[float, str]]:
    """``(seconds after the start, tenant)`` of every request, in time order: Poisson at
    ``rate`` per well-behaved tenant and ``rate * heavy_factor`` for heavy."""
    out = []
    for tenant, r in [(HEAVY, rate * heavy_factor), *((t, rate) for t in GOOD)]:
        rng = random.Random(f"{seed}-{tenant}")
        t = rng.expovariate(r)
        while t < duration:
            out.append((t, tenant))
            t += rng.expovariate(r)
    return sorted(out)


async def run_case(config: Config, schedule: list[tuple[float, str]], *, prompt_len: int, max_tokens: int,
                   seed: int = 0) -> dict[str, Any]:
    """Send ``schedule`` through an AsyncLLM on ``config``; the per-tenant TTFTs (seconds,
    served requests only), 429s, and the longest engine queues seen."""
    rng = random.Random(seed)
    vocab = config.runner.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in schedule]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tenants = sorted({t for _, t in schedule})
    ttft: dict[str, list[float]] = {t: [] for t in tenants}
    refused: Counter[str] = Counter()
    queue = {"max_engine_waiting": 0, "max_replica_waiting": 0}
    async with await AsyncLLM.create(config) as llm:
        async for _ in llm.generate([3, 4, 5], SamplingParams(max_tokens=2)):  # warm up the path
            pass
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                st = await llm.call_utility("stats")
                queue["max_engine_waiting"] = max(queue["max_engine_waiting"], st.get("num_waiting", 0))
                per = [r.get("num_waiting", 0) for r in st.get("replicas", [st]) if r.get("healthy", True)]
                queue["max_replica_waiting"] = max(queue["max_replica_waiting"], *per, 0)
                try:
                    await asyncio.wait_for(stop.wait(), 0.05)
                except TimeoutError:
                    pass

        async def one(i: int, at: float, tenant: str) -> None:
            arrival = start + at
            await asyncio.sleep(max(0.0, arrival - loop.time()))
            first = None
            try:
                async for out in llm.generate(prompts[i], params, request_id=f"{tenant}-{i}", tenant=tenant):
                    if first is None and out.output_token_ids:
                        first = loop.time() - arrival
            except EngineBusyError:
                refused[tenant] += 1
                return
            assert first is not None, f"request {i} of {tenant} produced no token"
            ttft[tenant].append(first)

        watcher = asyncio.create_task(watch())
        start = loop.time()
        await asyncio.gather(*(one(i, at, tenant) for i, (at, tenant) in enumerate(schedule)))
        wall = loop.time() - start
        stop.set()
        await watcher
        stats = await llm.call_utility("stats")
    sent = Counter(t for _, t in schedule)
    per_tenant = {t: {"requests": sent[t], "served": len(ttft[t]), "refused_429": refused[t],
                      "ttft_p50_s": percentile(ttft[t], 50), "ttft_p99_s": percentile(ttft[t], 99)}
                  for t in tenants}
    good = [x for t in GOOD if t in ttft for x in ttft[t]]
    flow = stats.get("flow_control")
    return {"wall_s": wall, "tenants": per_tenant, **queue,
            "good_ttft_p50_s": percentile(good, 50), "good_ttft_p99_s": percentile(good, 99),
            "flow_control": None if flow is None else {k: flow[k] for k in ("num_dispatched", "num_held",
                                                                              "num_refused")}}


def study(config: Config, modes: list[str], *, rate: float, duration: float, prompt_len: int, max_tokens: int,
          seed: int, max_waiting: int | None = None) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    for mode in modes:
        cfg = variant(config, mode, max_waiting)
        runs[mode] = {}
        for load, factor in LOADS.items():
            schedule = arrivals(rate, factor, duration, seed)
            t0 = time.perf_counter()
            result = asyncio.run(run_case(cfg, schedule, prompt_len=prompt_len, max_tokens=max_tokens, seed=seed))
            runs[mode][load] = result
            print(f"{mode:>20} heavy {load:>3}: {len(schedule)} requests, good TTFT p99 "
                  f"{result['good_ttft_p99_s']:.3f} s, heavy 429s {result['tenants'][HEAVY]['refused_429']}, "
                  f"longest engine queue {result['max_engine_waiting']} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
        runs[mode]["good_ttft_p99_ratio_10x_over_1x"] = (runs[mode]["10x"]["good_ttft_p99_s"]
                                                         / runs[mode]["1x"]["good_ttft_p99_s"])
    return runs


def table(runs: dict[str, Any]) -> str:
    rows = ["| flow control | heavy | tenant | requests | 429s | TTFT p50 | TTFT p99 | longest engine queue |",
            "|---|---|---|---:|---:|---:|---:|---:|"]
    for mode, by_load in runs.items():
        for load in LOADS:
            r = by_load[load]
            for tenant, t in r["tenants"].items():
                rows.append(f"| {mode} | {load} | {tenant} | {t['requests']} | {t['refused_429']} | "
                            f"{t['ttft_p50_s']:.3f} s | {t['ttft_p99_s']:.3f} s | {r['max_engine_waiting']} |")
    rows += ["", "| flow control | good tenants' TTFT p99, heavy 10x | heavy 1x | ratio |", "|---|---:|---:|---:|"]
    for mode, by_load in runs.items():
        rows.append(f"| {mode} | {by_load['10x']['good_ttft_p99_s']:.3f} s | {by_load['1x']['good_ttft_p99_s']:.3f} s"
                    f" | {by_load['good_ttft_p99_ratio_10x_over_1x']:.2f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "tenant-isolation.yaml"))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--rate", type=float, default=3.5, help="requests/s of each well-behaved tenant")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-waiting", type=int, help="queue-depth's max_waiting (default: the config's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--output", help="write the results as JSON here")
    args = ap.parse_args()
    config = load_config(args.config)
    load_before = os.getloadavg()[0]
    runs = study(config, args.modes, rate=args.rate, duration=args.duration, prompt_len=args.prompt_len,
                 max_tokens=args.max_tokens, seed=args.seed, max_waiting=args.max_waiting)
    print(table(runs))
    if args.output:
        out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {_cpus()} CPUs",
               "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
               "config": str(Path(args.config).resolve().relative_to(ROOT)) if Path(args.config).resolve()
               .is_relative_to(ROOT) else args.config,
               "settings": {k: v for k, v in vars(args).items() if k not in ("output", "config")},
               "runs": runs}
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(out, indent=1) + "\n")


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    main()
