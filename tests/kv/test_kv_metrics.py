"""Prefix-cache statistics (docs/scheduler-behaviour.md#prefix-stats)."""

from __future__ import annotations

import pytest

from schedkit.kv import CachingMetrics, PrefixCacheStats


def stats(requests: int, queries: int, hits: int, reset: bool = False) -> PrefixCacheStats:
    return PrefixCacheStats(requests=requests, queries=queries, hits=hits, reset=reset)


def window(m: CachingMetrics) -> tuple[int, int, int]:
    return m.aggregated_requests, m.aggregated_query_total, m.aggregated_query_hit


def test_metrics_sliding_window():
    m = CachingMetrics(max_recent_requests=5)
    assert m.empty and m.hit_rate == 0.0
    m.observe(stats(1, 20, 9))
    assert m.hit_rate == pytest.approx(0.45)
    m.observe(stats(4, 80, 16))
    assert m.hit_rate == pytest.approx(0.25)
    m.observe(stats(1, 10, 2))  # 6 requests > 5: the oldest entry is dropped
    assert window(m) == (5, 90, 18)
    assert m.hit_rate == pytest.approx(0.2)
    m.reset()
    assert window(m) == (0, 0, 0) and m.empty and m.hit_rate == 0.0


def test_metrics_empty_stats():
    m = CachingMetrics(max_recent_requests=5)
    m.observe(stats(0, 0, 0))
    assert m.empty
    m.observe(stats(1, 20, 9))
    m.observe(stats(0, 0, 0))
    assert window(m) == (1, 20, 9) and m.num_entries == 1
    m.observe(stats(11, 20, 10))  # alone exceeds the window but is kept
    assert window(m) == (11, 20, 10) and m.num_entries == 1
    assert m.hit_rate == pytest.approx(0.5)
    m.observe(stats(0, 0, 0))
    m.observe(stats(22, 40, 30))
    assert window(m) == (22, 40, 30)
    assert m.hit_rate == pytest.approx(0.75)


def test_metrics_reset_flag_clears_first():
    m = CachingMetrics(max_recent_requests=100)
    m.observe(stats(3, 30, 30))
    m.observe(stats(1, 10, 0, reset=True))
    assert window(m) == (1, 10, 0)
    m.observe(stats(0, 0, 0, reset=True))
    assert m.empty


def test_prefix_cache_stats_record_and_add():
    s = PrefixCacheStats()
    s.record(10, 4, preempted=False)
    s.record(20, 8, preempted=True)
    s.record(30, 0, preempted=False)
    assert (s.requests, s.queries, s.hits) == (2, 40, 4)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 20, 8)
    assert s.hit_rate == pytest.approx(12 / 60)
    total = PrefixCacheStats()
    total.add(s)
    total.add(PrefixCacheStats(reset=True))
    assert total.requests == 2 and total.reset
    assert PrefixCacheStats().hit_rate == 0.0
