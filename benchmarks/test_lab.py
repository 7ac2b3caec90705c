"""Policy benchmarks on the simulator, under pytest-benchmark (docs/benchmarks.md).

    pytest benchmarks/test_lab.py --benchmark-autosave     # keep a baseline (.benchmarks/)
    pytest benchmarks/test_lab.py --benchmark-compare      # later: fails on a regression
    pytest benchmarks/test_lab.py --lab-config my.yaml     # also benchmark your profiles

Timing = wall time of one whole simulated replay (noisy; compared only with
``--benchmark-compare-fail``). ``extra_info["serving"]`` holds the serving metrics of the
run on the virtual clock (deterministic: TTFT/E2E percentiles, per priority class,
preemptions, recomputed tokens, longest wait, goodput, SLO attainment, worst tenant),
which ``--benchmark-compare`` checks (benchmarks/conftest.py).

``test_bundled_policy`` runs every policy schedkit ships on one workload built to make
policies differ: overload bursts, a KV cache small enough to preempt, two priority
classes, three tenants of unequal weight, shared system prompts with prefix caching, and
heavy-tailed prompt and output lengths. ``test_lab_config`` runs the compare profiles of
each ``--lab-config`` YAML (a third-party policy included) the same way.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.serving import serving_info
from schedkit.config import Config, ProfileConfig, config_from_dict, load_config
from schedkit.errors import ConfigError, PluginError
from schedkit.lab.compare import profile_config, profiles_of
from schedkit.lab.metrics import summarize
from schedkit.lab.simulate import RunResult, run_workload
from schedkit.lab.workloads import WorkloadRequest, generate
from schedkit.plugins.manager import get_plugin_manager

LAB_WORKLOAD = {
    "runner": {"kind": "simulated"},
    # 300 blocks of 16 = 4,800 tokens of KV for at most 16 sequences: in bursts the KV
    # cache runs out and requests are preempted, often enough that the choice of victim
    # shows (recomputed tokens, how often one request is preempted again and again); in
    # between the sequence limit binds, so fewer sequences show too.
    "cache": {"block_size": 16, "num_blocks": 300, "enable_prefix_caching": True},
    "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 16, "max_model_len": 4096},
    "workload": {
        "kind": "poisson", "rate": 150.0, "num_requests": 300, "seed": 7,
        "prompt_len": {"dist": "lognormal", "median": 256, "sigma": 0.8, "min": 16, "max": 2048},
        "output_len": {"dist": "lognormal", "median": 64, "sigma": 1.2, "min": 4, "max": 1024},
        "tenants": [{"name": "a", "weight": 3}, {"name": "b", "weight": 1},
                    {"name": "c", "weight": 1}],
        # priority 0 is the urgent class (smaller first), a quarter of the requests
        "priorities": [{"priority": 0, "weight": 1}, {"priority": 1, "weight": 3}],
        "shared_prefix": {"count": 4, "length": 256, "fraction": 0.5},
        "slo": {"ttft_s": 1.0, "tpot_s": 0.05, "by_priority": {0: {"ttft_s": 0.5}}},
    },
}

BUNDLED_PROFILES = [
    ProfileConfig(name="fcfs", policy="fcfs"),
    ProfileConfig(name="priority", policy="priority"),
    ProfileConfig(name="sjf", policy="sjf", plugins=[{"name": "sjf", "settings": {"aging_rate": 100.0}}]),
    ProfileConfig(name="edf", policy="edf", plugins=[{"name": "edf", "settings": {
        "ttft_slo_s": 1.0, "slo_by_priority": {0: 0.5}, "on_miss": "reject"}}]),
    ProfileConfig(name="vtc", policy="vtc", plugins=[{"name": "vtc", "settings": {
        "tenant_weights": {"a": 2.0}}}]),
    ProfileConfig(name="mlfq", policy="mlfq"),
    # lpm ranks the first max_rank waiting requests by a prefix lookup each step: 32 keeps
    # the case fast with a long queue.
    ProfileConfig(name="lpm", policy="lpm", plugins=[{"name": "lpm", "settings": {"max_rank": 32}}]),
    ProfileConfig(name="least-computed", policy="fcfs", plugins=[{"name": "least-computed"}]),
    ProfileConfig(name="aging", policy="priority", plugins=[{"name": "aging", "settings": {"max_wait_s": 2.0}}]),
]

_runs: dict[str, tuple[Config, RunResult]] = {}
_workload: list[WorkloadRequest] = []


def lab_config(name: str) -> Config:
    """The lab workload's config under the bundled profile ``name``."""
    profile = next(p for p in BUNDLED_PROFILES if p.name == name)
    return profile_config(config_from_dict(LAB_WORKLOAD), profile)


def lab_workload() -> list[WorkloadRequest]:
    """The lab workload's requests (generated once per session)."""
    if not _workload:
        _workload.extend(generate(config_from_dict(LAB_WORKLOAD).workload))
    return _workload


def lab_run(name: str) -> tuple[Config, RunResult]:
    """The bundled profile ``name`` on the lab workload: the benchmark's own run when it
    ran in this session, else a fresh one."""
    if name not in _runs:
        config = lab_config(name)
        _runs[name] = config, run_workload(config, lab_workload())
    return _runs[name]


def bench_run(benchmark, config: Config, workload: list[WorkloadRequest]) -> RunResult:
    """One timed replay, its serving metrics put in ``extra_info``."""
    result = {}

    def run():
        result["run"] = run_workload(config, workload)

    benchmark.pedantic(run, rounds=1, iterations=1)
    run_result = result["run"]
    benchmark.extra_info.update(policy=config.scheduler.policy, steps=run_result.num_steps,
                                **serving_info(run_result.metrics, config.workload.slo))
    return run_result


@pytest.mark.parametrize("profile", [p.name for p in BUNDLED_PROFILES])
def test_bundled_policy(benchmark, profile):
    config = lab_config(profile)
    run = bench_run(benchmark, config, lab_workload())
    _runs[profile] = config, run
    # The workload must exercise what policies decide, whatever the policy.
    summary = summarize(run.metrics, config.workload.slo)
    assert summary["requests"] == 300 and not run.failed
    assert summary["preemptions"] > 0, "the lab workload no longer preempts"
    assert summary["prefix_hit_rate"] > 0.05, "the lab workload no longer shares prefixes"
    assert len({m.priority for m in run.metrics}) == 2 and len(summary["tenants"]) == 3


def _mean_ttft(run: RunResult, priority: int) -> float:
    ttfts = [m.ttft for m in run.metrics if m.priority == priority and m.ttft is not None]
    return sum(ttfts) / len(ttfts)


def test_priority_classes_matter():
    """Not a benchmark: on the lab workload priority serves its urgent class much sooner
    than FCFS does, and FCFS treats both classes alike (so a priority order that stopped
    working, or an FCFS that started to rank, cannot pass as unchanged)."""
    _, fcfs = lab_run("fcfs")
    _, prio = lab_run("priority")
    assert _mean_ttft(prio, 0) < 0.5 * _mean_ttft(fcfs, 0)
    assert _mean_ttft(prio, 0) < 0.5 * _mean_ttft(prio, 1)
    assert 0.5 < _mean_ttft(fcfs, 0) / _mean_ttft(fcfs, 1) < 2.0


def test_lab_config(benchmark, lab_case):
    """One compare profile of a ``--lab-config`` YAML (parametrized by conftest.py)."""
    path, profile_name = lab_case
    config = load_config(path)
    profile = next(p for p in profiles_of(config) if p.name == profile_name)
    config = profile_config(config, profile)
    error = None
    try:  # a plugin that is missing or broken fails here, named, and only its profile
        get_plugin_manager(config)
    except (ConfigError, PluginError) as e:
        error = f"{e} (compare profile {profile_name!r})"
    if error is not None:
        pytest.fail(error, pytrace=False)
    workload = generate(config.workload, config.runner.vocab_size, Path(path).parent)
    run = bench_run(benchmark, config, workload)
    benchmark.extra_info.update(lab_config=str(path), profile=profile_name)
    assert run.metrics, f"{path}: profile {profile_name!r} finished no request"


AZURE_CONV = {
    "runner": {"kind": "simulated"},
    "cache": {"block_size": 16, "num_blocks": 12000, "enable_prefix_caching": True},
    "scheduler": {"max_num_batched_tokens": 4096, "max_num_seqs": 128, "max_model_len": 16384},
    "workload": {"kind": "trace", "num_requests": 1500, "trace": {
        "format": "azure", "path": "data/azure/AzureLLMInferenceTrace_conv.csv", "time_scale": 0.06},
        "slo": {"ttft_s": 0.5, "tpot_s": 0.05}},
}


def test_policy_on_azure_conv(benchmark):
    """FCFS on 1,500 requests of the Azure conversation trace (a real length mix; the
    trace has no priority classes or tenants, so only FCFS is run on it)."""
    config = config_from_dict(AZURE_CONV)
    run = bench_run(benchmark, config, generate(config.workload))
    assert len(run.metrics) == 1500


def test_replay_10k_azure_conv(benchmark):
    """A 10,000-request trace replay (real arrival times) on the simulator."""
    config = config_from_dict({**AZURE_CONV, "workload": {
        "kind": "trace", "num_requests": 10000,
        "trace": {"format": "azure", "path": "data/azure/AzureLLMInferenceTrace_conv.csv"}}})
    workload = generate(config.workload)
    result = {}

    def run():
        result["run"] = run_workload(config, workload)

    benchmark.pedantic(run, rounds=1, iterations=1)
    benchmark.extra_info.update(steps=result["run"].num_steps, requests=len(result["run"].metrics))
    assert len(result["run"].metrics) == 10000
