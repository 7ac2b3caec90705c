"""Serving metrics of a lab run, as the benchmarks record them in ``extra_info``.

Everything here is measured on the engine's virtual clock (simulated or fake runner), so
the same config always gives the same figures and any change is the policy's doing, not
noise. ``benchmarks/conftest.py`` compares them with ``--benchmark-compare``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from schedkit.config import SLOConfig
from schedkit.lab.metrics import RequestMetrics, percentile, summarize

HIGHER_IS_BETTER = ("goodput_req_s", "slo_attainment", "jain_backlogged")
"""The serving metrics where a smaller value is the regression; every other is lower-better."""

DISTRIBUTION_STATS = ("mean", "p50", "p90", "p99")
"""Of TTFT, TPOT and E2E: ``ttft_mean_s``, ``ttft_p50_s``, ... (all lower-is-better)."""

MAX_CLASSES = 4
"""Priority classes with their own metrics (the most urgent ones, smallest value first)."""


def _finite(value: Any) -> float | int | None:
    """The value, or None for a missing or NaN one (None is never compared)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return value


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _p99(values: Sequence[float]) -> float | None:
    return percentile(values, 99) if values else None


def class_metrics(metrics: Sequence[RequestMetrics]) -> dict[str, float | None]:
    """TTFT (mean, p99) and mean E2E of each priority class, when there are several.

    Keys are ``prio{p}_ttft_mean_s`` etc., for the ``MAX_CLASSES`` smallest (most urgent)
    priority values. A rejected request has no TTFT and is left out here; the
    ``rejected`` count catches it.
    """
    classes = sorted({m.priority for m in metrics})
    if len(classes) < 2:
        return {}
    out: dict[str, float | None] = {}
    for p in classes[:MAX_CLASSES]:
        ms = [m for m in metrics if m.priority == p]
        ttfts = [m.ttft for m in ms if m.ttft is not None]
        e2es = [m.e2e for m in ms if m.e2e is not None and m.first_token_time is not None]
        out[f"prio{p}_ttft_mean_s"] = _mean(ttfts)
        out[f"prio{p}_ttft_p99_s"] = _p99(ttfts)
        out[f"prio{p}_e2e_mean_s"] = _mean(e2es)
    return out


def worst_tenant_ttft(metrics: Sequence[RequestMetrics]) -> float | None:
    """The largest mean TTFT of any tenant: the worst-served tenant's wait (None with
    fewer than two tenants)."""
    by_tenant: dict[str, list[float]] = {}
    for m in metrics:
        if m.ttft is not None:
            by_tenant.setdefault(m.tenant, []).append(m.ttft)
    if len(by_tenant) < 2:
        return None
    return max(sum(v) / len(v) for v in by_tenant.values())


def serving_summary(metrics: Sequence[RequestMetrics], slo: SLOConfig | None = None) -> dict[str, Any]:
    """The figures a policy regression moves, from :func:`summarize` and the requests.

    Lower is better for all but :data:`HIGHER_IS_BETTER`. Keys that a version of
    ``summarize`` lacks are computed here or left out.
    """
    s = summarize(metrics, slo)
    fairness = s.get("fairness") or {}
    rejected = s.get("rejected")
    if rejected is None:
        rejected = sum(m.first_token_time is None for m in metrics)
    serving: dict[str, Any] = {
        **{f"{name}_{q}_s": s[f"{name}_s"][q] for name in ("ttft", "tpot", "e2e")
           for q in DISTRIBUTION_STATS if q in s[f"{name}_s"]},
        "max_wait_s": s["max_wait_s"],
        "preemptions": s["preemptions"], "recomputed_tokens": s["recomputed_tokens"],
        "max_preemptions_per_request": max((m.num_preemptions for m in metrics), default=None),
        "rejected": rejected,
        "goodput_req_s": s["goodput_req_s"], "slo_attainment": s["slo_attainment"],
        "worst_tenant_ttft_mean_s": worst_tenant_ttft(metrics),
        "max_service_gap": fairness.get("max_service_gap"),
        "jain_backlogged": fairness.get("jain_backlogged"),
        **class_metrics(metrics),
    }
    return {k: _finite(v) for k, v in serving.items() if _finite(v) is not None}


def serving_info(metrics: Sequence[RequestMetrics], slo: SLOConfig | None = None) -> dict[str, Any]:
    """What a benchmark puts in ``extra_info``: ``serving`` and ``serving_higher_is_better``."""
    serving = serving_summary(metrics, slo)
    return {"serving": serving,
            "serving_higher_is_better": [k for k in HIGHER_IS_BETTER if k in serving]}
