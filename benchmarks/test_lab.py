"""Policy comparisons and trace replays on the simulator, under pytest-benchmark.

    pytest benchmarks/test_lab.py --benchmark-autosave         # keep a baseline
    pytest benchmarks/test_lab.py --benchmark-compare          # later: flags regressions

Timing = wall time of the whole simulated replay. extra_info["serving"] holds the
serving metrics of the run (TTFT/TPOT/E2E percentiles in seconds of virtual time,
goodput, SLO attainment); with --benchmark-compare a metric that got more than 10%
worse is reported as a regression (benchmarks/conftest.py).
"""

from __future__ import annotations

import pytest

from schedkit.config import config_from_dict
from schedkit.lab.compare import profile_config
from schedkit.lab.metrics import summarize
from schedkit.lab.simulate import run_workload
from schedkit.lab.workloads import generate

AZURE_CONV = {
    "runner": {"kind": "simulated"},
    "cache": {"block_size": 16, "num_blocks": 12000, "enable_prefix_caching": True},
    "scheduler": {"max_num_batched_tokens": 4096, "max_num_seqs": 128, "max_model_len": 16384},
    "workload": {"kind": "trace", "num_requests": 1500, "trace": {
        "format": "azure", "path": "data/azure/AzureLLMInferenceTrace_conv.csv", "time_scale": 0.06},
        "slo": {"ttft_s": 0.5, "tpot_s": 0.05}},
}


def serving_info(summary: dict) -> dict:
    return {
        "serving": {
            "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p99_s": summary["ttft_s"]["p99"],
            "tpot_p50_s": summary["tpot_s"]["p50"], "e2e_p50_s": summary["e2e_s"]["p50"],
            "goodput_req_s": summary["goodput_req_s"], "slo_attainment": summary["slo_attainment"],
        },
        "serving_higher_is_better": ["goodput_req_s", "slo_attainment"],
    }


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_policy_on_azure_conv(benchmark, policy):
    from schedkit.config import ProfileConfig

    config = profile_config(config_from_dict(AZURE_CONV), ProfileConfig(name=policy, policy=policy))
    workload = generate(config.workload)
    result = {}

    def run():
        result["run"] = run_workload(config, workload)

    benchmark.pedantic(run, rounds=1, iterations=1)
    summary = summarize(result["run"].metrics, config.workload.slo)
    benchmark.extra_info.update(policy=policy, steps=result["run"].num_steps, **serving_info(summary))
    assert summary["requests"] == 1500


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
