"""Flow control in the cluster simulation: the front door on the shared virtual clock."""

from __future__ import annotations

import pytest

from schedkit.config import Config, config_from_dict
from schedkit.lab.cluster_sim import run_cluster_workload, summarize_cluster
from schedkit.lab.metrics import percentile
from schedkit.lab.workloads import WorkloadRequest, generate, token_run

HEAVY = "heavy"
LIGHT = ("a", "b", "c")


def tenants_config(*, flow: dict | None, rate: float = 110.0, heavy_weight: float = 10.0, n: int = 1200,
                   count: int = 2, max_num_seqs: int = 8, policy: str = "least-outstanding") -> Config:
    """Two fake replicas (10 ms steps), each running up to ``max_num_seqs`` requests of
    12-20 output tokens: about 80 requests/s together, under a Poisson load of ``rate``
    where tenant ``heavy`` sends ``heavy_weight`` times what each of a, b, c sends."""
    return config_from_dict({
        "runner": {"kind": "fake", "step_time_ms": 10},
        "cache": {"block_size": 16, "num_blocks": 400},
        "scheduler": {"max_num_batched_tokens": 512, "max_num_seqs": max_num_seqs, "max_model_len": 1024},
        "workload": {"kind": "poisson", "rate": rate, "num_requests": n, "prompt_len": [16, 48],
                     "output_len": [12, 20], "seed": 5,
                     "tenants": [{"name": HEAVY, "weight": heavy_weight},
                                 *({"name": t, "weight": 1.0} for t in LIGHT)]},
        "replicas": {"count": count}, "router": {"policy": policy},
        **({"flow_control": flow} if flow is not None else {}),
    })


def ttft_p99(metrics, tenants) -> float:
    return percentile([m.ttft for m in metrics if m.tenant in tenants and m.ttft is not None], 99)


def test_an_unsaturated_front_door_changes_nothing():
    """Below saturation every request goes on at once: the same run, request for request."""
    flow = {"enabled": True, "plugins": [{"name": "queue-depth", "settings": {"max_waiting": 64}}]}
    off = tenants_config(flow=None, rate=30.0, n=300)
    on = tenants_config(flow=flow, rate=30.0, n=300)
    workload = generate(off.workload, off.runner.vocab_size)
    a, b = run_cluster_workload(off, workload), run_cluster_workload(on, workload)
    assert a.metrics == b.metrics and a.replica_of == b.replica_of
    s = summarize_cluster(on, b)["flow_control"]
    assert s["num_held"] == 0 and s["num_dispatched"] == 300 and s["num_refused"] == {}
    assert "flow_control" not in summarize_cluster(off, a)


def test_saturation_holds_the_burst_at_the_door_not_in_the_engines():
    """120 requests at once: with ``max_waiting: 0`` the replicas never queue, the front
    door holds the rest and lets each through as a seat frees; everything is served."""
    flow = {"enabled": True, "queue_timeout_s": 600,
            "plugins": [{"name": "queue-depth", "settings": {"max_waiting": 0}}]}
    workload = [WorkloadRequest(f"r{i}", i * 1e-4, token_run(i, 24, 32000), 16, LIGHT[i % 3]) for i in range(120)]
    off = run_cluster_workload(tenants_config(flow=None), workload)
    config = tenants_config(flow=flow)
    on = run_cluster_workload(config, workload)
    s = summarize_cluster(config, on)
    assert max(off.replica_max_waiting) > 40
    assert s["flow_control"]["max_engine_waiting"] == 0
    assert s["flow_control"]["num_held"] > 100 and s["flow_control"]["num_refused"] == {}
    assert not on.failed and all(m.num_output_tokens == 16 for m in on.metrics)
    # Held requests keep their arrival time: the last ones waited at the door.
    assert max(m.ttft for m in on.metrics) > 0.5
    assert s["overall"]["requests"] == 120 and s["overall"]["rejected"] == 0


def test_queue_timeout_and_max_queued_refuse_with_the_reason():
    flow = {"enabled": True, "queue_timeout_s": 0.3, "max_queued": 60,
            "plugins": [{"name": "queue-depth", "settings": {"max_waiting": 0}}]}
    workload = [WorkloadRequest(f"r{i}", i * 1e-4, token_run(i, 24, 32000), 16) for i in range(120)]
    config = tenants_config(flow=flow)
    run = run_cluster_workload(config, workload)
    s = summarize_cluster(config, run)
    refused = s["flow_control"]["num_refused"]
    assert refused["full"] == 120 - 16 - 60  # 16 seats, 60 held, the rest turned away at once
    assert refused["timeout"] > 0
    assert len(run.failed) == refused["full"] + refused["timeout"]
    reasons = list(run.failed.values())
    assert sum("flow_control.max_queued" in r for r in reasons) == refused["full"]
    assert sum("flow_control.queue_timeout_s" in r for r in reasons) == refused["timeout"]
    served = [m for m in run.metrics if m.request_id not in run.failed]
    assert all(m.num_output_tokens == 16 for m in served)
    assert len(run.metrics) == 120 and s["overall"]["rejected_by"] == {"front-door": len(run.failed)}
    # A refused request is in the overall figures but on no replica.
    assert sum(r["requests"] for r in s["replicas"]) == 120 - len(run.failed)


@pytest.mark.parametrize("max_waiting", [0, 8])
@pytest.mark.parametrize("fairness", ["tenant-round-robin", "tenant-weighted"])
def test_a_tenant_sending_ten_times_its_share_does_not_hold_the_others_back(fairness, max_waiting):
    """Overload (110 requests/s for ~100 of capacity), ``heavy`` sending 10x what each
    other tenant sends. Without flow control the replicas' FCFS queues fill with its
    backlog and everyone waits behind it; with fair flow control another tenant's request
    waits at most for one dispatch per backlogged tenant at the door and for the
    ``max_waiting`` queued ahead of it at its replica: its TTFT p99 stays within
    ``k / mu + (max_waiting + 1) / mu_r`` (plus two steps) of what it is when ``heavy``
    sends only its share (k tenants; mu, mu_r: requests finishing per second in the
    cluster and per replica)."""
    flow = {"enabled": True, "fairness": fairness, "queue_timeout_s": 600, "max_queued": 100_000,
            "plugins": [{"name": "queue-depth", "settings": {"max_waiting": max_waiting}}]}
    fair_share = tenants_config(flow=None, heavy_weight=1.0, rate=33.0, n=360)
    base = ttft_p99(run_cluster_workload(fair_share).metrics, LIGHT)
    off = run_cluster_workload(tenants_config(flow=None))
    on = run_cluster_workload(tenants_config(flow=flow))
    off_light, on_light = ttft_p99(off.metrics, LIGHT), ttft_p99(on.metrics, LIGHT)
    step, seats, mean_output = 0.010, 8, 16
    mu_r = seats / (mean_output * step)
    bound = 4 / (2 * mu_r) + (max_waiting + 1) / mu_r + 2 * step
    assert off_light > base + 3 * bound  # stuck behind the heavy tenant's backlog
    assert on_light < base + bound
    assert ttft_p99(on.metrics, (HEAVY,)) > off_light  # the heavy tenant pays for its own backlog
    assert max(on.replica_max_waiting) <= max_waiting
    assert not on.failed and len(on.metrics) == 1200


def test_deterministic_with_flow_control():
    flow = {"enabled": True, "fairness": "tenant-weighted", "queue_timeout_s": 2.0,
            "plugins": [{"name": "tenant-weighted", "settings": {"weights": {"a": 3}}}]}
    config = tenants_config(flow=flow, n=400)
    a, b = run_cluster_workload(config), run_cluster_workload(config)
    assert a.metrics == b.metrics and a.failed == b.failed and a.replica_of == b.replica_of
    assert summarize_cluster(config, a) == summarize_cluster(config, b)


def test_a_compare_profile_sets_its_own_flow_control():
    from schedkit.config import ProfileConfig
    from schedkit.lab.compare import profile_config

    config = tenants_config(flow={"enabled": True, "queue_timeout_s": 5})
    own = profile_config(config, ProfileConfig(name="own", flow_control={"enabled": True,
                                                                         "fairness": "tenant-weighted"}))
    kept = profile_config(config, ProfileConfig(name="kept"))
    assert own.flow_control.fairness == "tenant-weighted" and own.flow_control.queue_timeout_s == 30
    assert kept.flow_control == config.flow_control
    with pytest.raises(ValueError, match="queue_timeout_s"):
        ProfileConfig(name="bad", flow_control={"enabled": True, "queue_timeout_s": -1})
