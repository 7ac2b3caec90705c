"""The serving-metric regression check used by benchmarks/conftest.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location(
    "bench_conftest", Path(__file__).resolve().parents[1] / "benchmarks" / "conftest.py")
bench_conftest = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_conftest)


def test_serving_regressions_flags_worse_metrics_only():
    prev = {"serving": {"ttft_p50_s": 1.0, "goodput_req_s": 10.0, "e2e_p50_s": 2.0}}
    cur = {"serving": {"ttft_p50_s": 1.2, "goodput_req_s": 8.0, "e2e_p50_s": 1.0},
           "serving_higher_is_better": ["goodput_req_s"]}
    msgs = bench_conftest.serving_regressions(cur, prev, 0.10)
    assert len(msgs) == 2
    assert any("ttft_p50_s" in m for m in msgs) and any("goodput_req_s" in m for m in msgs)
    assert bench_conftest.serving_regressions(cur, prev, 0.5) == []
