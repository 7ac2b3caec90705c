"""When does each scheduling policy help? A fixed set of scenarios on the simulator.

Every scenario is one workload run under several policy profiles with
:func:`schedkit.lab.compare.compare`, once per seed (``workload.seed``), on the simulated
runner (``runner: {kind: simulated}``, the bundled ``h200-qwen2.5-0.5b-handset`` cost
model): the clock is virtual, so the figures are exact and reproducible, and the machine
only affects how long the script takes. The script prints one markdown table per
scenario, each cell the mean over the seeds and, where the seeds disagree, their range
``(min-max)``; docs/policies.md ("What the lab shows") quotes these tables.

    .venv/bin/python scripts/policy_scenarios.py              # all scenarios, seeds 0-4
    .venv/bin/python scripts/policy_scenarios.py --seeds 3 --only a1,b --jobs 2

Scenarios (sizes are chosen to run in minutes; loads are relative to what the cost model
serves with ``max_num_seqs: 16``: about 40-45 requests/s for the lengths of a, b, d and
e, about 73 for f's):

- a1, a2: heavy-tailed outputs (lognormal, median 64, sigma 1.2, up to 2,048 tokens),
  ample KV cache, at about 80% (a1) and 95% (a2) load: fcfs, sjf by prompt, sjf by
  ``max_tokens`` (an oracle: the simulator generates exactly ``max_tokens``), srpt (the
  oracle sjf with ``preemptive: true``), mlfq (preemptive, its default), mlfq with
  ``preemptive: false`` and ``starvation_s: .inf`` (exactly the non-preemptive mlfq of
  before voluntary preemption: the starvation promotion runs at every step's end, with
  or without ``preemptive``), and the oracle sjf under aging. mlfq and srpt use the
  default ``min_run_tokens: 0``. Short/long requests are the lower/upper half by output
  length. The script checks whether non-preemptive mlfq's per-request latencies equal
  fcfs's.
- b: a2's workload with a KV cache of 500 blocks (8,000 tokens), prefix caching on:
  fcfs, mlfq, non-preemptive mlfq (as in a), mlfq + aging, mlfq + least-computed,
  mlfq + cpu-offload (preemption by swap to host memory, default settings:
  ``max_blocks: 4096``, ``save_on_eviction: false``), oracle sjf, srpt; preemptions
  (for KV blocks and voluntary together), recomputed tokens and waits.
- c1, c2, c3: 90% of the prompts start with one of 16 shared 1,024-token prefixes.
  c1: 700 KV blocks, prefix caching on (fcfs, least-computed, least-computed with
  ``count_shared_prefix: false``, lpm); c2: the same with prefix caching off (fcfs,
  least-computed); c3: ample KV, caching on (fcfs, lpm).
- d1, d2: two tenants sending 5:1, burst of 600 requests: fcfs vs vtc. d1 at 200
  requests/s, so the light tenant alone asks for more than half the capacity; d2 at 100
  requests/s, where it asks for less. d3, d4: d1 and d2 with 1,200 requests, to see
  which gaps grow with the length of the run.
- e1, e2: two priority classes (0: a quarter of the requests, TTFT SLO 0.5 s; 1: TTFT
  SLO 2 s, via ``slo.by_priority``) at about 1.15x (e1) and 1.4x (e2) capacity: fcfs,
  priority, priority-preemptive, edf with ``on_miss`` reject, skip and admit. e3: the
  same classes with long outputs (256 to 1,024 tokens; the server completes about 9 of
  these requests/s), class 0's TTFT SLO 0.25 s and class 1's 5 s, 400 requests at
  8.5/s (about 95% load): fcfs, priority, priority-preemptive.
- f: lognormal prompts (median 256, up to 3,000) at about 1.1x capacity: fcfs, sjf,
  sjf + aging (``max_wait_s: 1``), sjf with ``aging_rate: 1000``.

Runtime, default five seeds, on a 2-core AMD EPYC machine: about 5 min 30 s to 6 min of
CPU time in all (5 min 30 s and 5 min 49 s measured), so about that long with
``--jobs 1``; ``--jobs 2`` took 3 min 23 s, and 4 min 36 s to 5 min 46 s while other
processes shared the two cores (CPU time then rises too: 7 min in the 5 min 46 s run;
the output is the same; each (scenario, seed) pair is an independent run). The figures are virtual time and do not depend on the machine.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from schedkit.config import config_from_dict
from schedkit.lab.compare import compare
from schedkit.lab.metrics import RequestMetrics
from schedkit.lab.workloads import generate

# --- building blocks ---------------------------------------------------------------------

SCHEDULER = {"max_num_seqs": 16, "max_num_batched_tokens": 2048, "max_model_len": 4096}
AMPLE_BLOCKS = 8192  # 131,072 tokens: never full in these workloads
HEAVY_TAIL = {"dist": "lognormal", "median": 64, "sigma": 1.2, "min": 4, "max": 2048}
PROMPTS = {"dist": "uniform", "min": 64, "max": 512}
UNIFORM_OUT = {"dist": "uniform", "min": 32, "max": 256}


def plugin(name: str, **settings: Any) -> dict[str, Any]:
    return {"name": name, "settings": settings}


def profile(name: str, policy: str, *plugins: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "policy": policy, "plugins": list(plugins)}


def config(*, workload: dict[str, Any], profiles: list[dict[str, Any]], num_blocks: int,
           prefix_caching: bool = True) -> dict[str, Any]:
    return {
        "runner": {"kind": "simulated"},
        "cache": {"block_size": 16, "num_blocks": num_blocks,
                  "enable_prefix_caching": prefix_caching},
        "scheduler": dict(SCHEDULER),
        "workload": {"kind": "poisson", **workload},
        "compare": {"profiles": profiles},
    }


SJF_ORACLE = plugin("sjf", use_max_tokens=True)
FCFS = profile("fcfs", "fcfs")
MLFQ = profile("mlfq", "mlfq")  # preemptive (the default)
# The mlfq of before voluntary preemption: no voluntary preemption and no starvation
# promotion (which runs at every step's end, with or without ``preemptive``).
MLFQ_NP = profile("mlfq (non-preemptive)", "mlfq",
                  plugin("mlfq", preemptive=False, starvation_s=math.inf))
SRPT = profile("srpt", "sjf", plugin("sjf", use_max_tokens=True, preemptive=True))


@dataclass(slots=True)
class Run:
    """One profile's run for one seed, with what the columns read."""

    summary: dict[str, Any]
    metrics: list[RequestMetrics]
    short_ids: frozenset[str]
    """Requests whose output length (``max_tokens``) is at most the lower median."""


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def e2e_of(run: Run, short: bool) -> float:
    return _mean([m.e2e for m in run.metrics
                  if m.served and m.e2e is not None and (m.request_id in run.short_ids) == short])


def s(*path: Any) -> Callable[[Run], float]:
    """A column read from the summary at ``path``."""
    def get(run: Run) -> float:
        v: Any = run.summary
        for k in path:
            v = v[k]
        return float(v)
    return get


@dataclass(frozen=True, slots=True)
class Column:
    label: str
    get: Callable[[Run], float]
    fmt: str = ".3f"


@dataclass(frozen=True, slots=True)
class Scenario:
    key: str
    title: str
    config: dict[str, Any]
    columns: tuple[Column, ...]
    same_as: tuple[tuple[str, str], ...] = ()
    """Profile pairs checked for identical per-request TTFT, E2E and longest wait."""


SHORT_E2E = Column("short E2E mean (s)", lambda r: e2e_of(r, True))
LONG_E2E = Column("long E2E mean (s)", lambda r: e2e_of(r, False))
E2E = Column("E2E mean (s)", s("e2e_s", "mean"))
TTFT = Column("TTFT mean (s)", s("ttft_s", "mean"))
TTFT_P99 = Column("TTFT p99 (s)", s("ttft_s", "p99"))
MAX_FIRST_WAIT = Column("max first wait (s)", s("max_first_wait_s"), ".2f")
MAX_WAIT = Column("max wait (s)", s("max_wait_s"), ".2f")
PREEMPTIONS = Column("preemptions", s("preemptions"), ".0f")
RECOMPUTED = Column("recomputed tokens", s("recomputed_tokens"), ".0f")
HIT_RATE = Column("prefix hit rate", s("prefix_hit_rate"))
MAKESPAN = Column("makespan (s)", s("makespan_s"), ".1f")


def heavy_tailed(rate: float) -> dict[str, Any]:
    return {"rate": rate, "num_requests": 800, "prompt_len": PROMPTS, "output_len": HEAVY_TAIL}


A_PROFILES = [
    FCFS,
    profile("sjf (prompt)", "sjf"),
    profile("sjf (oracle)", "sjf", SJF_ORACLE),
    SRPT,
    MLFQ,
    MLFQ_NP,
    profile("sjf (oracle) + aging 2s", "sjf", SJF_ORACLE, plugin("aging", max_wait_s=2.0)),
]
A_COLUMNS = (SHORT_E2E, LONG_E2E, E2E, TTFT_P99, MAX_WAIT, PREEMPTIONS, RECOMPUTED)

SHARED = {"rate": 45.0, "num_requests": 600, "prompt_len": {"dist": "uniform", "min": 32, "max": 256},
          "output_len": {"dist": "lognormal", "median": 64, "sigma": 1.0, "min": 4, "max": 1024},
          "shared_prefix": {"count": 16, "length": 1024, "fraction": 0.9}}
C_COLUMNS = (HIT_RATE, RECOMPUTED, PREEMPTIONS, TTFT, TTFT_P99, E2E, MAKESPAN)
LEAST_COMPUTED = profile("least-computed", "fcfs", plugin("least-computed"))
LEAST_COMPUTED_ALL = profile("least-computed (all computed)", "fcfs",
                             plugin("least-computed", count_shared_prefix=False))


def tenants(rate: float, num_requests: int = 600) -> dict[str, Any]:
    return {"rate": rate, "num_requests": num_requests, "prompt_len": PROMPTS, "output_len": UNIFORM_OUT,
            "tenants": [{"name": "heavy", "weight": 5}, {"name": "light", "weight": 1}]}


D_COLUMNS = (
    Column("max service gap", s("fairness", "max_service_gap"), ".0f"),
    Column("Jain (backlogged)", s("fairness", "jain_backlogged")),
    Column("windows", s("fairness", "backlogged_windows"), ".1f"),
    Column("heavy TTFT mean (s)", s("by_tenant", "heavy", "ttft_s", "mean")),
    Column("light TTFT mean (s)", s("by_tenant", "light", "ttft_s", "mean")),
    MAKESPAN,
)


def priorities(rate: float) -> dict[str, Any]:
    return {"rate": rate, "num_requests": 600, "prompt_len": PROMPTS, "output_len": UNIFORM_OUT,
            "priorities": [{"priority": 0, "weight": 1}, {"priority": 1, "weight": 3}],
            "slo": {"ttft_s": 2.0, "by_priority": {0: {"ttft_s": 0.5}}}}


# e3: long outputs, so a seat frees up only every ~0.1 s: strict priority still makes a
# class-0 request wait for one, priority-preemptive gives it one at the next step.
LONG_PRIORITIES = {"rate": 8.5, "num_requests": 400, "prompt_len": PROMPTS,
                   "output_len": {"dist": "uniform", "min": 256, "max": 1024},
                   "priorities": [{"priority": 0, "weight": 1}, {"priority": 1, "weight": 3}],
                   "slo": {"ttft_s": 5.0, "by_priority": {0: {"ttft_s": 0.25}}}}


def edf(on_miss: str) -> dict[str, Any]:
    # Class 0 carries its 0.5 s target as Request.ttft_slo_s; ttft_slo_s is class 1's.
    return profile(f"edf {on_miss}", "edf", plugin("edf", ttft_slo_s=2.0, on_miss=on_miss))


E_COLUMNS = (
    Column("attainment", s("slo_attainment")),
    Column("class 0 attainment", s("by_priority", 0, "slo_attainment")),
    Column("class 1 attainment", s("by_priority", 1, "slo_attainment")),
    Column("rejected", s("rejected"), ".1f"),
    Column("goodput (req/s)", s("goodput_req_s"), ".1f"),
    Column("class 0 TTFT mean (s)", s("by_priority", 0, "ttft_s", "mean")),
    Column("class 1 TTFT mean (s)", s("by_priority", 1, "ttft_s", "mean")),
    PREEMPTIONS,
)
E3_COLUMNS = (
    Column("attainment", s("slo_attainment")),
    Column("class 0 attainment", s("by_priority", 0, "slo_attainment")),
    Column("class 1 attainment", s("by_priority", 1, "slo_attainment")),
    Column("class 0 TTFT mean (s)", s("by_priority", 0, "ttft_s", "mean")),
    Column("class 0 TTFT p99 (s)", s("by_priority", 0, "ttft_s", "p99")),
    Column("class 1 TTFT mean (s)", s("by_priority", 1, "ttft_s", "mean")),
    E2E, PREEMPTIONS, RECOMPUTED,
)

F_COLUMNS = (
    MAX_WAIT, TTFT, TTFT_P99,
    Column("short-prompt TTFT mean (s)", s("by_prompt_size", "short", "ttft_s", "mean")),
    Column("long-prompt TTFT mean (s)", s("by_prompt_size", "long", "ttft_s", "mean")),
)

SCENARIOS: tuple[Scenario, ...] = (
    Scenario("a1", "Heavy-tailed outputs, ample KV, ~80% load (36 req/s)",
             config(workload=heavy_tailed(36.0), profiles=A_PROFILES, num_blocks=AMPLE_BLOCKS),
             A_COLUMNS, same_as=(("mlfq (non-preemptive)", "fcfs"),)),
    Scenario("a2", "Heavy-tailed outputs, ample KV, ~95% load (44 req/s)",
             config(workload=heavy_tailed(44.0), profiles=A_PROFILES, num_blocks=AMPLE_BLOCKS),
             A_COLUMNS, same_as=(("mlfq (non-preemptive)", "fcfs"),)),
    Scenario("b", "Heavy-tailed outputs under KV pressure (500 blocks), 44 req/s",
             config(workload=heavy_tailed(44.0), num_blocks=500, profiles=[
                 FCFS, MLFQ, MLFQ_NP,
                 profile("mlfq + aging 2s", "mlfq", plugin("aging", max_wait_s=2.0)),
                 profile("mlfq + least-computed", "mlfq", plugin("mlfq"), plugin("least-computed")),
                 profile("mlfq + cpu-offload", "mlfq", {"name": "cpu-offload"}),
                 profile("sjf (oracle)", "sjf", SJF_ORACLE), SRPT]),
             (SHORT_E2E, LONG_E2E, E2E, TTFT, MAX_FIRST_WAIT, MAX_WAIT, PREEMPTIONS, RECOMPUTED)),
    Scenario("c1", "Shared prefixes, KV pressure (700 blocks), prefix caching on",
             config(workload=SHARED, num_blocks=700,
                    profiles=[FCFS, LEAST_COMPUTED, LEAST_COMPUTED_ALL, profile("lpm", "lpm")]),
             C_COLUMNS),
    Scenario("c2", "Shared prefixes, KV pressure (700 blocks), prefix caching off",
             config(workload=SHARED, num_blocks=700, prefix_caching=False,
                    profiles=[FCFS, LEAST_COMPUTED]),
             C_COLUMNS),
    Scenario("c3", "Shared prefixes, ample KV, prefix caching on",
             config(workload=SHARED, num_blocks=AMPLE_BLOCKS, profiles=[FCFS, profile("lpm", "lpm")]),
             C_COLUMNS),
    Scenario("d1", "Two tenants 5:1, 200 req/s burst (light tenant above its half)",
             config(workload=tenants(200.0), num_blocks=AMPLE_BLOCKS,
                    profiles=[FCFS, profile("vtc", "vtc")]),
             D_COLUMNS),
    Scenario("d2", "Two tenants 5:1, 100 req/s burst (light tenant below its half)",
             config(workload=tenants(100.0), num_blocks=AMPLE_BLOCKS,
                    profiles=[FCFS, profile("vtc", "vtc")]),
             D_COLUMNS),
    Scenario("d3", "As d1 with twice the requests (1,200)",
             config(workload=tenants(200.0, 1200), num_blocks=AMPLE_BLOCKS,
                    profiles=[FCFS, profile("vtc", "vtc")]),
             D_COLUMNS),
    Scenario("d4", "As d2 with twice the requests (1,200)",
             config(workload=tenants(100.0, 1200), num_blocks=AMPLE_BLOCKS,
                    profiles=[FCFS, profile("vtc", "vtc")]),
             D_COLUMNS),
    Scenario("e1", "Two priority classes, per-class TTFT SLO, ~1.15x load (45 req/s)",
             config(workload=priorities(45.0), num_blocks=AMPLE_BLOCKS, profiles=[
                 FCFS, profile("priority", "priority"),
                 profile("priority-preemptive", "priority-preemptive"),
                 edf("reject"), edf("skip"), edf("admit")]),
             E_COLUMNS),
    Scenario("e2", "Two priority classes, per-class TTFT SLO, ~1.4x load (55 req/s)",
             config(workload=priorities(55.0), num_blocks=AMPLE_BLOCKS, profiles=[
                 FCFS, profile("priority", "priority"),
                 profile("priority-preemptive", "priority-preemptive"),
                 edf("reject"), edf("skip"), edf("admit")]),
             E_COLUMNS),
    Scenario("e3", "Two priority classes, long outputs, class 0 TTFT SLO 0.25 s, ~0.95x load (8.5 req/s)",
             config(workload=LONG_PRIORITIES, num_blocks=AMPLE_BLOCKS, profiles=[
                 FCFS, profile("priority", "priority"),
                 profile("priority-preemptive", "priority-preemptive")]),
             E3_COLUMNS),
    Scenario("f", "Starvation: lognormal prompts, ~1.1x load (80 req/s)",
             config(workload={"rate": 80.0, "num_requests": 600,
                              "prompt_len": {"dist": "lognormal", "median": 256, "sigma": 1.0,
                                             "min": 16, "max": 3000},
                              "output_len": {"dist": "uniform", "min": 16, "max": 128}},
                    num_blocks=AMPLE_BLOCKS, profiles=[
                        FCFS, profile("sjf", "sjf"),
                        profile("sjf + aging 1s", "sjf", plugin("aging", max_wait_s=1.0)),
                        profile("sjf aging_rate 1000", "sjf", plugin("sjf", aging_rate=1000.0))]),
             F_COLUMNS),
)
BY_KEY = {sc.key: sc for sc in SCENARIOS}


# --- running -----------------------------------------------------------------------------

def _latencies(ms: list[RequestMetrics]) -> list[tuple[str, float | None, float | None, float | None]]:
    return [(m.request_id, m.ttft, m.e2e, m.longest_wait) for m in ms]


def run_one(key: str, seed: int) -> tuple[dict[str, dict[str, float]], dict[str, bool]]:
    """Figures per profile and the ``same_as`` checks of scenario ``key`` at ``seed``."""
    sc = BY_KEY[key]
    data = {**sc.config, "workload": {**sc.config["workload"], "seed": seed}}
    cfg = config_from_dict(data, source=f"scenario {key}")
    work = generate(cfg.workload, cfg.runner.vocab_size)
    lengths = sorted(w.max_tokens for w in work)
    cut = lengths[(len(lengths) - 1) // 2]
    short = frozenset(w.request_id for w in work if w.max_tokens <= cut)
    result = compare(cfg)
    figures = {}
    for name, summary in result.summaries.items():
        run = Run(summary, result.metrics[name], short)
        figures[name] = {c.label: c.get(run) for c in sc.columns}
    same = {f"{a} == {b}": _latencies(result.metrics[a]) == _latencies(result.metrics[b])
            for a, b in sc.same_as}
    return figures, same


def cell(values: Sequence[float], fmt: str) -> str:
    """Mean and range over the seeds; a figure undefined in some seeds (NaN: e.g. Jain's
    index with no window of two backlogged tenants) is over the others, with their count."""
    defined = [v for v in values if not math.isnan(v)]
    if not defined:
        return "n/a"
    lo, hi = min(defined), max(defined)
    text = format(statistics.fmean(defined), fmt)
    notes = [f"{lo:{fmt}}-{hi:{fmt}}"] if format(lo, fmt) != format(hi, fmt) else []
    if len(defined) < len(values):
        notes.append(f"{len(defined)} of {len(values)} seeds")
    return text + (f" ({'; '.join(notes)})" if notes else "")


def table(sc: Scenario, per_seed: list[dict[str, dict[str, float]]]) -> str:
    names = list(per_seed[0])
    head = ["profile", *(c.label for c in sc.columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        row = [name] + [cell([f[name][c.label] for f in per_seed], c.fmt) for c in sc.columns]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 (default 5)")
    ap.add_argument("--only", default="", help="comma-separated scenario keys (default: all)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    args = ap.parse_args(argv)
    keys = [k for k in args.only.split(",") if k] or [sc.key for sc in SCENARIOS]
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown or args.seeds < 1 or args.jobs < 1:
        ap.error(f"unknown scenario {unknown}" if unknown else "--seeds and --jobs must be >= 1")
    seeds = list(range(args.seeds))
    t0 = time.perf_counter()
    tasks = [(k, seed) for k in keys for seed in seeds]
    if args.jobs == 1:
        results = [run_one(k, seed) for k, seed in tasks]
    else:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(run_one, *zip(*tasks, strict=True)))
    done = dict(zip(tasks, results, strict=True))
    which = f"Seed {seeds[0]}" if len(seeds) == 1 else f"Seeds {seeds[0]}-{seeds[-1]}"
    print(f"{which}; cells: mean over the seeds (min-max where they differ).")
    for k in keys:
        sc = BY_KEY[k]
        per_seed = [done[(k, seed)][0] for seed in seeds]
        print(f"\n### {sc.key}: {sc.title}\n")
        print(table(sc, per_seed))
        for check in done[(k, seeds[0])][1]:
            ok = all(done[(k, seed)][1][check] for seed in seeds)
            print(f"\nPer-request TTFT, E2E and longest wait identical, {check}: "
                  f"{'yes, every seed' if ok else 'no'}")
    print(f"\n(runtime {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
