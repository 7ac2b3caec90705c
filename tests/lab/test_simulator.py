"""The cost-model simulator and the determinism of replays and comparisons."""

from __future__ import annotations

import json

import pytest

from schedkit.cli import main
from schedkit.config import config_from_dict
from schedkit.errors import ConfigError
from schedkit.lab.simulate import run_workload
from schedkit.plugins.testing import make_request, make_scheduler
from schedkit.runners.simulated import CostModel, SimulatedRunner, step_features


def test_step_duration_follows_the_cost_model():
    model = CostModel(base_s=1e-3, per_token_s=1e-5, per_request_s=1e-4, per_context_token_s=1e-7,
                      per_prefill_attention_s=1e-9, per_prefill_step_s=2e-3)
    runner = SimulatedRunner(cost_model=model)
    sched = make_scheduler(max_num_batched_tokens=100)
    sched.add_request(make_request("a", [1] * 30))
    sched.add_request(make_request("b", [2] * 100))
    so = sched.schedule()  # a: 30 tokens, b: 70 tokens, both from 0
    out = runner.execute(so)
    tokens, reqs, ctx, attn = 100, 2, 100, 30 * 15 + 70 * 35
    assert step_features(so, {"a": 0, "b": 0})[:6] == (tokens, reqs, ctx, attn, 1.0, 0.0)
    assert out.step_duration == pytest.approx(1e-3 + 1e-5 * 100 + 1e-4 * 2 + 1e-7 * 100 + 1e-9 * attn + 2e-3)
    sched.update_from_output(so, out)
    so = sched.schedule()  # a decodes (1 token over 30), b finishes its prompt (30 over 70)
    assert step_features(so, {"a": 30, "b": 70})[:6] == (31, 2, 31 + 100, 30 * 85, 1.0, 1.0)  # mixed
    sched.update_from_output(so, runner.execute(so))
    so = sched.schedule()  # decode-only: no prefill-step cost
    assert step_features(so, {"a": 31, "b": 100})[:6] == (2, 2, 32 + 101, 0.0, 0.0, 0.0)
    assert runner.execute(so).step_duration == pytest.approx(1e-3 + 2e-5 + 2e-4 + 1e-7 * 133)


def test_bundled_profile_and_bad_profiles(tmp_path):
    assert CostModel.load("h200-qwen2.5-0.5b-handset").base_s > 0
    with pytest.raises(ConfigError, match="no such profile"):
        CostModel.load("nope")
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"coefficients": {"base_s": 1}}))
    with pytest.raises(ConfigError, match="per_token_s"):
        CostModel.load(str(bad))


SMALL = {
    "runner": {"kind": "simulated"},
    "cache": {"num_blocks": 300, "block_size": 16},
    "scheduler": {"max_num_batched_tokens": 512, "max_num_seqs": 16, "max_model_len": 4096},
    "workload": {"kind": "trace", "num_requests": 120, "trace": {
        "format": "azure", "path": "data/azure/AzureLLMInferenceTrace_conv.csv", "time_scale": 0.05},
        "tenants": [{"name": "a"}, {"name": "b"}], "slo": {"ttft_s": 1.0}},
    "compare": {"profiles": [{"name": "fcfs", "policy": "fcfs"}, {"name": "prio", "policy": "priority"}]},
}


def test_replay_is_deterministic_and_preempts_under_pressure():
    cfg = config_from_dict(SMALL)
    a, b = run_workload(cfg), run_workload(cfg)
    assert [m.to_dict() for m in a.metrics] == [m.to_dict() for m in b.metrics]
    assert len(a.metrics) == 120  # refused requests too, as rejected
    assert sum(m.num_preemptions for m in a.metrics) > 0


def test_async_scheduling_replay_is_deterministic_and_loses_no_token():
    sync = run_workload(config_from_dict(SMALL))
    cfg = config_from_dict({**SMALL, "scheduler": {**SMALL["scheduler"], "async_scheduling": True}})
    a, b = run_workload(cfg), run_workload(cfg)
    assert [m.to_dict() for m in a.metrics] == [m.to_dict() for m in b.metrics]
    assert sum(m.num_preemptions for m in a.metrics) > 0
    assert sorted((m.request_id, m.num_output_tokens) for m in a.metrics) == sorted(
        (m.request_id, m.num_output_tokens) for m in sync.metrics)


@pytest.mark.slow
def test_compare_writes_byte_identical_results(tmp_path):
    import yaml

    cfg = tmp_path / "cmp.yaml"  # the trace path is found relative to the repository
    cfg.write_text(yaml.safe_dump(SMALL))
    outs = []
    for i in range(2):
        out = tmp_path / f"out{i}"
        assert main(["compare", str(cfg), "-o", str(out), "--sweep", "time_scale=0.2,0.05"]) == 0
        outs.append((out / "results.json").read_bytes())
    assert outs[0] == outs[1]
    data = json.loads(outs[0])
    assert set(data["summaries"]) == {"fcfs", "prio"} and set(data["sustained"]) == {"fcfs", "prio"}
    # the plots need matplotlib: tests/lab/test_report.py::test_compare_writes_every_plot


def test_compare_profiles_with_scheduler_overrides():
    from schedkit.lab.compare import compare

    cfg = config_from_dict({**SMALL, "compare": {"profiles": [
        {"name": "fcfs", "policy": "fcfs"},
        {"name": "fcfs-chunk64", "policy": "fcfs", "scheduler": {"long_prefill_token_threshold": 64}},
        {"name": "fcfs-async", "policy": "fcfs", "scheduler": {"async_scheduling": True}}]}})
    result = compare(cfg)
    assert set(result.summaries) == {"fcfs", "fcfs-chunk64", "fcfs-async"}
    ttft = {name: s["ttft_s"]["p50"] for name, s in result.summaries.items()}
    assert ttft["fcfs-chunk64"] != ttft["fcfs"]  # the override took effect


@pytest.mark.parametrize("override,needle", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_seqs": 9999}, "max_num_batched_tokens"),
    ({"no_such_key": 1}, "no_such_key"),
    ({"policy": "priority"}, "'policy' key"),
])
def test_bad_profile_overrides_name_the_profile(override, needle):
    bad = {**SMALL, "compare": {"profiles": [{"name": "mine", "scheduler": override}]}}
    with pytest.raises(ConfigError, match="mine") as e:
        config_from_dict(bad)
    assert needle in str(e.value)
