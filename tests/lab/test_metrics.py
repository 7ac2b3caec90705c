"""Metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest

from schedkit.config import SLOConfig, config_from_dict
from schedkit.lab.metrics import RequestMetrics, jain_index, percentile, summarize, work_done_by
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
    assert s["makespan_s"] == 6.0 and s["arrival_window_s"] == 2.0 and s["requests"] == 3
    assert s["offered_load_req_s"] == 1.0  # 2 inter-arrival gaps in 2 s
    # Within the arrival window (0 to 2 s) only a finished: 2 tokens and its prompt.
    assert s["output_tokens"] == 6 and s["output_tokens_per_s"] == 1.0
    assert s["throughput_req_s"] == 0.5 and s["total_tokens_per_s"] == 6.0
    assert s["ttft_s"]["p50"] == 2.0 and s["ttft_s"]["max"] == 4.0
    assert s["slo_attainment"] == pytest.approx(2 / 3) and s["goodput_req_s"] == pytest.approx(2 / 6)
    assert s["max_wait_s"] == 1.0 and s["prefix_hit_rate"] == pytest.approx(5 / 30)
    assert s["tenants"]["y"]["service_tokens"] == 24 and s["tenants"]["x"]["service_tokens"] == 12
    assert s["jain_fairness"] == pytest.approx((12 + 24) ** 2 / (2 * (144 + 576)))
    assert s["itl_s"]["max"] == 1.0


def test_throughput_is_over_the_arrival_window_not_the_drain():
    """A long request still decoding after the last arrival stretches the makespan, not
    the throughput: both runs did the same work while requests arrived."""
    steady = [rm(str(i), float(i), float(i), [i + 0.5, i + 1.0]) for i in range(5)]
    tail = [*steady[:-1], rm("4", 4.0, 4.0, [4.5, *(5.0 + k for k in range(100))])]
    a, b = summarize(steady), summarize(tail)
    assert b["makespan_s"] > 100 > a["makespan_s"] == 5.0
    for key in ("offered_load_req_s", "throughput_req_s", "output_tokens_per_s", "total_tokens_per_s"):
        assert a[key] == b[key], key
    assert a["throughput_req_s"] == 4 / 4 and a["output_tokens_per_s"] == 8 / 4
    # All at once (an offline batch): no window, so over the makespan.
    batch = summarize([rm(str(i), 0.0, 0.0, [1.0, 2.0]) for i in range(4)])
    assert math.isnan(batch["offered_load_req_s"]) and batch["output_tokens_per_s"] == 8 / 2


def test_work_done_by_spreads_tokens_without_token_times():
    """Client-side metrics carry first token and finish only: tokens in between count
    as evenly spread."""
    m = RequestMetrics("a", 0.0, 0.0, 1.0, 5.0, 10, 5, 0, 0, 0, "length")
    assert work_done_by([m], 3.0) == (0, 3.0, 10)  # tokens at 1, 2, 3 (of 1..5)
    assert work_done_by([m], 0.5) == (0, 0.0, 0) and work_done_by([m], 5.0) == (1, 5, 10)


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
