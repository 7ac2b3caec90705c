"""Benchmark-suite plumbing: serving metrics take part in ``--benchmark-compare``.

A benchmark may put ``extra_info["serving"] = {metric: value}`` (lower is better) and
``extra_info["serving_higher_is_better"] = [metric, ...]``. With ``--benchmark-compare``
each metric is checked against the compared run and a change for the worse beyond
``--serving-tolerance`` (default 10%) is reported by pytest-benchmark as a performance
regression, which fails the run.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD", "")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--serving-tolerance", type=float, default=0.10,
                     help="relative worsening of a serving metric that counts as a regression")


def serving_regressions(current: dict, previous: dict, tolerance: float) -> list[str]:
    """Messages for every serving metric of ``current`` worse than in ``previous``."""
    now, before = current.get("serving", {}), previous.get("serving", {})
    higher = set(current.get("serving_higher_is_better", ()))
    found = []
    for key, value in now.items():
        old = before.get(key)
        if old is None or value is None or old == 0:
            continue
        change = (value - old) / abs(old)
        if (change < -tolerance) if key in higher else (change > tolerance):
            found.append(f"serving metric {key}: {old:.6g} -> {value:.6g} ({change:+.1%})")
    return found


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    bs = getattr(session.config, "_benchmarksession", None)
    if bs is None or not getattr(bs, "compared_mapping", None):
        return
    tolerance = session.config.getoption("--serving-tolerance")
    for bench in bs.benchmarks:
        for mapping in bs.compared_mapping.values():
            previous = mapping.get(bench.fullname)
            if previous is None:
                continue
            for msg in serving_regressions(bench.extra_info, previous.get("extra_info", {}), tolerance):
                bs.performance_regressions.append((bench.fullname, msg))
