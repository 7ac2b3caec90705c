"""Prefill/decode disaggregation in the cluster simulation: prefill replicas hand their
KV to decode replicas, at the cost model's transfer time."""

from __future__ import annotations

import json

import pytest

from schedkit import ConfigError, hookimpl
from schedkit.cluster.transfer import transfer_connector
from schedkit.config import Config, config_from_dict
from schedkit.kv.connector import KVConnectorRole, NoOpConnector
from schedkit.lab.cluster_sim import _ClusterRun, run_cluster_workload, summarize_cluster
from schedkit.lab.workloads import WorkloadRequest, generate
from schedkit.runners.cost_model import CostModel

BS = 16
HANDSET = {"base_s": 0.0025, "per_token_s": 3.5e-06, "per_request_s": 2.0e-06,
           "per_context_token_s": 2.6e-09, "per_prefill_attention_s": 1.0e-11}


def disagg_config(*, count: int = 3, roles: dict | None = None, threshold: float = 64,
                  policy: str = "round-robin", runner: dict | None = None, num_blocks: int = 400,
                  n: int = 120) -> Config:
    router: dict = {"policy": policy}
    replicas: dict = {"count": count}
    if roles is not None:
        replicas["roles"] = roles
        router["plugins"] = [{"name": "selective-pd", "settings": {"threshold": threshold}}]
    return config_from_dict({
        "runner": runner or {"kind": "fake", "step_time_ms": 10, "vocab_size": 1000},
        "cache": {"block_size": BS, "num_blocks": num_blocks},
        "scheduler": {"max_num_batched_tokens": 512, "max_num_seqs": 16, "max_model_len": 2048},
        "workload": {"kind": "poisson", "rate": 40, "num_requests": n, "prompt_len": [8, 400],
                     "output_len": [4, 32], "seed": 5,
                     "shared_prefix": {"count": 4, "length": 128, "fraction": 0.5}},
        "replicas": replicas, "router": router,
    })


def profile(tmp_path, name: str, **kv_transfer) -> dict:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"name": name, "coefficients": HANDSET, "kv_transfer": kv_transfer}))
    return {"kind": "simulated", "profile": str(path), "vocab_size": 1000}


def replay(config: Config, workload=None, **kw) -> _ClusterRun:
    run = _ClusterRun(config, workload if workload is not None else generate(config.workload, 1000), ())
    run.result = run.run()  # type: ignore[attr-defined]
    return run


def test_every_request_ends_once_and_every_block_is_freed():
    # 60 blocks of 16 tokens per replica: the decode replicas are short of KV, so
    # handed-off requests wait there like any other
    config = disagg_config(count=4, roles={"prefill": 2, "decode": 2}, num_blocks=60)
    workload = generate(config.workload, 1000)
    run = replay(config, workload)
    result = run.result
    assert sorted(m.request_id for m in result.metrics) == sorted(w.request_id for w in workload)
    assert not result.failed
    wanted = {w.request_id: w for w in workload}
    assert all(m.num_output_tokens == wanted[m.request_id].max_tokens for m in result.metrics)
    assert 0 < len(result.prefill_of) < len(workload)  # selective: short prompts stay whole
    assert set(result.prefill_of.values()) == {0, 1} and set(result.replica_of.values()) == {2, 3}
    for e in run.engines:
        kv = e.scheduler.kv_cache_manager
        assert kv.usage == 0.0 and kv.num_tracked_requests == 0
    assert run.handoffs is not None
    assert all(c.num_held_blocks == 0 for c in run.handoffs.connectors)
    assert not run.handoffs.in_flight and not run.handoffs.prefilling
    assert all(r["num_outstanding"] == 0 for r in result.router_stats["replicas"])
    for h in result.handoffs:  # every full prompt block is either held or sent
        assert h.num_blocks + h.num_blocks_held == len(wanted[h.request_id].prompt_token_ids) // BS
    summary = summarize_cluster(config, result)
    assert summary["disaggregation"]["roles"]["decode"]["queue_depth_mean"] > 0


def test_only_the_blocks_the_decode_replica_lacks_are_sent():
    config = disagg_config(count=2, roles={"prefill": 1, "decode": 1}, threshold=0)
    a = list(range(1, 164))  # 10 full blocks and 3 tokens
    b = a[:6 * BS] + list(range(500, 570))  # A's first 6 blocks, then 70 new tokens
    run = replay(config, [WorkloadRequest("a", 0.0, a, 4), WorkloadRequest("b", 5.0, b, 4)])
    first, second = run.result.handoffs
    assert (first.request_id, first.num_blocks_held, first.num_blocks) == ("a", 0, 10)
    assert (second.request_id, second.num_blocks_held, second.num_blocks) == ("b", 6, 4)
    assert second.num_tokens == 4 * BS
    assert run.handoffs is not None
    # the decode replica computed only what it neither held nor received
    assert run.handoffs.connectors[1].num_tokens_received == 10 * BS + 4 * BS
    by_id = {m.request_id: m for m in run.result.metrics}
    assert by_id["b"].num_cached_tokens == 6 * BS  # the prefill replica's own prefix hit
    assert by_id["a"].num_cached_tokens == 0


def test_transfer_time_is_in_ttft(tmp_path):
    prompt = list(range(1, 164))  # 10 full blocks
    ttft = {}
    for name, kv in {"free": {"latency_s": 0.0, "per_block_s": 0.0},
                     "slow": {"latency_s": 0.2, "per_block_s": 0.01}}.items():
        config = disagg_config(count=2, roles={"prefill": 1}, threshold=0, runner=profile(tmp_path, name, **kv))
        result = run_cluster_workload(config, [WorkloadRequest("r", 1.0, prompt, 8)])
        (m,) = result.metrics
        ttft[name] = m.ttft
        (h,) = result.handoffs
        assert h.seconds == pytest.approx(kv["latency_s"] + 10 * kv["per_block_s"])
        assert summarize_cluster(config, result)["disaggregation"]["transfer_s_total"] == pytest.approx(h.seconds)
    assert ttft["slow"] - ttft["free"] == pytest.approx(0.2 + 10 * 0.01)
    assert ttft["free"] > 0  # the prefill step, then the decode replica's first step


@pytest.mark.parametrize("policy", ["round-robin", "weighted"])
def test_an_infinite_threshold_is_the_colocated_run_on_the_decode_replicas(policy):
    split = disagg_config(count=4, roles={"prefill": 1, "decode": 2}, threshold=float("inf"), policy=policy)
    colocated = disagg_config(count=3, policy=policy)
    workload = generate(split.workload, 1000)
    a = run_cluster_workload(split, workload)
    b = run_cluster_workload(colocated, workload)
    assert a.metrics == b.metrics and a.failed == b.failed
    assert a.num_steps == b.num_steps and a.replica_steps[0] == 0
    assert {k: v - 1 for k, v in a.replica_of.items()} == b.replica_of
    assert not a.handoffs and not a.prefill_of


def test_deterministic_and_summarized():
    config = disagg_config(count=3, roles={"prefill": 1, "decode": 1}, policy="weighted")
    workload = generate(config.workload, 1000)
    first = summarize_cluster(config, run_cluster_workload(config, workload))
    result = run_cluster_workload(config, workload)
    second = summarize_cluster(config, result)
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)
    d = second["disaggregation"]
    assert d["num_disaggregated"] == d["num_handoffs"] == len(result.prefill_of) > 0
    assert d["num_blocks_transferred"] == sum(h.num_blocks for h in result.handoffs)
    assert d["num_tokens_transferred"] == BS * d["num_blocks_transferred"]
    assert second["router"]["num_disaggregated"] == d["num_disaggregated"]
    roles = d["roles"]
    assert roles["prefill"]["requests"] == 0 and roles["decode"]["prefills"] == 0
    assert roles["prefill"]["prefills"] + roles["both"]["prefills"] == d["num_disaggregated"]
    assert roles["decode"]["requests"] + roles["both"]["requests"] == len(workload)
    assert [r["role"] for r in second["replicas"]] == ["prefill", "decode", "both"]
    assert "disaggregation" not in summarize_cluster(disagg_config(), run_cluster_workload(disagg_config(), workload))


class RaisingDecider:
    @hookimpl(tryfirst=True)
    def schedkit_router_disaggregate(self, request):
        raise RuntimeError("decision bug")


def test_a_raising_decision_plugin_loses_no_request():
    config = disagg_config(count=3, roles={"prefill": 1, "decode": 2}, n=40)
    result = run_cluster_workload(config, router_extra_plugins=[RaisingDecider()])
    assert len(result.metrics) == 40 and not result.failed
    assert result.prefill_of  # selective-pd decided
    errors = summarize_cluster(config, result)["router"]["num_hook_errors"]
    assert errors == [["RaisingDecider-0", "schedkit_router_disaggregate", 40]]


def test_a_replica_with_another_connector_is_refused():
    with pytest.raises(ConfigError, match="replica 2 runs the KV connector 'NoOpConnector'"):
        transfer_connector(NoOpConnector(KVConnectorRole.SCHEDULER), 2)


def test_kv_transfer_time_from_the_profile():
    own = CostModel.from_profile({"coefficients": HANDSET, "kv_transfer": {"latency_s": 0.001, "per_block_s": 2e-5}})
    assert own.kv_transfer_time(0) == pytest.approx(0.001)
    assert own.kv_transfer_time(10) == pytest.approx(0.001 + 10 * 2e-5)
    swap = CostModel.from_profile({"coefficients": {**HANDSET, "per_block_store_s": 3e-4, "per_block_load_s": 1e-4}})
    assert swap.kv_transfer_time(10) == pytest.approx(10 * 4e-4)  # a swap out and in per block
    assert CostModel.from_profile({"coefficients": HANDSET}).kv_transfer_time(10) == 0.0
    with pytest.raises(ValueError, match=r"unknown keys \['per_token_s'\]"):
        CostModel.from_profile({"coefficients": HANDSET, "kv_transfer": {"per_token_s": 1.0}})
    with pytest.raises(ValueError, match="kv_transfer.latency_s must be a finite number"):
        CostModel.from_profile({"coefficients": HANDSET, "kv_transfer": {"latency_s": -1}})
    assert CostModel.load("h200-qwen2.5-0.5b-handset").kv_transfer_time(1) == pytest.approx(0.0005 + 2e-5)
