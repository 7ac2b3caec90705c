"""Metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest

from schedkit.config import SLOConfig, config_from_dict
from schedkit.lab.metrics import RequestMetrics, jain_index, percentile, summarize
from schedkit.lab.simulate import run_workload
from schedkit.lab.workloads import WorkloadRequest


def rm(rid, arrival, sched, tokens, tenant="t", reason="length", prompt=10, cached=0):
    return RequestMetrics(rid, arrival, sched, tokens[0], tokens[-1], prompt, len(tokens), cached,
                          0, 0, reason, tenant, 0, tuple(tokens))


def test_per_request_definitions():
    m = rm("a", 1.0, 1.5, [2.0, 2.5, 2.5, 4.0])
    assert m.ttft == 1.0 and m.queueing_delay == 0.5 and m.e2e == 3.0
    assert m.tpot == pytest.approx(2.0 / 3) and m.itls == [0.5, 0.0, 1.5]
    assert m.normalized_latency == 0.75
    assert m.meets(SLOConfig(ttft_s=1.0, tpot_s=0.7)) and not m.meets(SLOConfig(ttft_s=0.9))
    assert not rm("b", 0, 0, [1.0], reason="abort").meets(SLOConfig())


def test_aggregates():
    ms = [rm("a", 0.0, 0.0, [1.0, 2.0], tenant="x", cached=5),
          rm("b", 1.0, 2.0, [3.0, 3.5, 4.0], tenant="y"),
          rm("c", 2.0, 2.0, [6.0], tenant="y")]
    s = summarize(ms, SLOConfig(ttft_s=2.0))
    assert s["duration_s"] == 6.0 and s["requests"] == 3
    assert s["output_tokens"] == 6 and s["output_tokens_per_s"] == 1.0
    assert s["ttft_s"]["p50"] == 2.0 and s["ttft_s"]["max"] == 4.0
    assert s["slo_attainment"] == pytest.approx(2 / 3) and s["goodput_req_s"] == pytest.approx(2 / 6)
    assert s["max_wait_s"] == 1.0 and s["prefix_hit_rate"] == pytest.approx(5 / 30)
    assert s["tenants"]["y"]["service_tokens"] == 24 and s["tenants"]["x"]["service_tokens"] == 12
    assert s["jain_fairness"] == pytest.approx((12 + 24) ** 2 / (2 * (144 + 576)))
    assert s["itl_s"]["max"] == 1.0


def test_percentile_and_jain():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and math.isnan(percentile([], 50))
    assert jain_index([5, 5, 5]) == 1.0 and jain_index([1, 0, 0]) == pytest.approx(1 / 3)


def test_engine_timeline_by_hand():
    """Fake runner, 10 ms virtual steps: A arrives at 0, B at 15 ms."""
    config = config_from_dict({"runner": {"kind": "fake", "step_time_ms": 10}})
    wl = [WorkloadRequest("A", 0.0, [5, 6, 7, 8], 3), WorkloadRequest("B", 0.015, [9, 9], 2)]
    run = run_workload(config, wl)
    a, b = run.metrics
    assert (a.ttft, a.tpot, a.e2e, a.queueing_delay) == pytest.approx((0.01, 0.01, 0.03, 0.0))
    assert a.token_times == pytest.approx((0.01, 0.02, 0.03))
    # B is released when the clock passes 15 ms (after step 2 ends at 20 ms)
    assert b.queueing_delay == pytest.approx(0.005) and b.ttft == pytest.approx(0.015)
    assert b.token_times == pytest.approx((0.03, 0.04))
    assert run.num_steps == 5  # the last one only flushes finished ids (and takes no time)
