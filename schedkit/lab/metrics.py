"""Serving metrics: per request (TTFT, TPOT, inter-token gaps, E2E, queueing delay, ...)
and aggregates (throughput, percentiles, goodput and SLO attainment, per-tenant service,
Jain's fairness index, maximum wait).

All times are seconds relative to the start of the run (the engine clock at start).
Definitions: TTFT = first token - arrival; TPOT = (last token - first token) /
(outputs - 1); ITL = every gap between consecutive tokens (tokens of one step share a
time); E2E = finish - arrival; normalized latency = E2E / outputs; queueing delay =
first admission - arrival.

Breakdown by request size (``summarize(...)["by_prompt_size"]``): the requests are split
into three buckets by prompt length at its tertiles. With ``n`` requests and their prompt
lengths sorted as ``x[0] <= ... <= x[n-1]``, the cut points are ``lo = x[ceil(n/3) - 1]``
and ``hi = x[ceil(2n/3) - 1]``; ``short`` is ``length <= lo``, ``medium`` is
``lo < length <= hi`` and ``long`` is ``length > hi``. Equal lengths always share a bucket,
so buckets are about a third each for varied lengths and may be empty when many prompts
have the same length (all of one length: everything is ``short``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from schedkit.config import SLOConfig
from schedkit.core.outputs import RequestMetricsData
from schedkit.core.request import Request


@dataclass(slots=True, frozen=True)
class RequestMetrics:
    request_id: str
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    num_recomputed_tokens: int
    finish_reason: str | None
    tenant: str = "default"
    priority: int = 0
    token_times: tuple[float, ...] = field(default=(), repr=False)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.first_token_time is None or self.num_output_tokens < 2:
            return None
        last = self.token_times[-1] if self.token_times else self.finish_time
        if last is None:
            return None
        return (last - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def normalized_latency(self) -> float | None:
        e2e = self.e2e
        return None if e2e is None or not self.num_output_tokens else e2e / self.num_output_tokens

    @property
    def queueing_delay(self) -> float | None:
        t = self.first_scheduled_time
        return None if t is None else t - self.arrival_time

    def meets(self, slo: SLOConfig) -> bool:
        """Whether every target set in ``slo`` holds (an unset target always holds)."""
        if self.finish_reason not in ("stop", "length"):
            return False
        checks = ((slo.ttft_s, self.ttft), (slo.tpot_s, self.tpot), (slo.e2e_s, self.e2e))
        return all(target is None or value is None or value <= target for target, value in checks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id, "tenant": self.tenant, "priority": self.priority,
            "arrival_time": self.arrival_time, "first_scheduled_time": self.first_scheduled_time,
            "first_token_time": self.first_token_time, "finish_time": self.finish_time,
            "num_prompt_tokens": self.num_prompt_tokens, "num_output_tokens": self.num_output_tokens,
            "num_cached_tokens": self.num_cached_tokens, "num_preemptions": self.num_preemptions,
            "num_recomputed_tokens": self.num_recomputed_tokens, "finish_reason": self.finish_reason,
            "ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e,
            "queueing_delay": self.queueing_delay, "normalized_latency": self.normalized_latency,
        }


def _rel(t: float | None, start: float) -> float | None:
    return None if t is None else t - start


def metrics_from_data(request_id: str, m: RequestMetricsData, finish_reason: str | None, *,
                      tenant: str = "default", priority: int = 0,
                      token_times: Sequence[float] = (), start: float = 0.0) -> RequestMetrics:
    """RequestMetrics from the engine's per-request record (times made relative to ``start``):
    the one conversion behind both :func:`request_metrics` and :func:`metrics_from_output`."""
    return RequestMetrics(
        request_id=request_id, arrival_time=m.arrival_time - start,
        first_scheduled_time=_rel(m.first_scheduled_time, start),
        first_token_time=_rel(m.first_token_time, start), finish_time=_rel(m.finish_time, start),
        num_prompt_tokens=m.num_prompt_tokens, num_output_tokens=m.num_output_tokens,
        num_cached_tokens=m.num_cached_tokens, num_preemptions=m.num_preemptions,
        num_recomputed_tokens=m.num_recomputed_tokens, finish_reason=finish_reason,
        tenant=tenant, priority=priority, token_times=tuple(t - start for t in token_times))


def request_metrics(req: Request, token_times: Sequence[float] = (), start: float = 0.0) -> RequestMetrics:
    """Metrics of a finished request from its events (times made relative to ``start``)."""
    reason = req.get_finished_reason()
    return metrics_from_data(req.request_id, RequestMetricsData.of(req),
                             None if reason is None else reason.value, tenant=req.tenant,
                             priority=req.priority, token_times=token_times, start=start)


def metrics_from_output(out: Any) -> RequestMetrics:
    """RequestMetrics of a finished client-side RequestOutput (metrics from the engine)."""
    return metrics_from_data(out.request_id, out.metrics, out.finish_reason)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 is perfectly even, 1/n worst."""
    if not values:
        return math.nan
    sq = sum(v * v for v in values)
    return (sum(values) ** 2) / (len(values) * sq) if sq else 1.0


def _dist(values: Sequence[float]) -> dict[str, float]:
    return {"mean": sum(values) / len(values) if values else math.nan,
            "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "max": max(values) if values else math.nan}


SIZE_BUCKETS = ("short", "medium", "long")


def prompt_size_edges(lengths: Sequence[int]) -> tuple[int, int]:
    """The tertile cut points ``(lo, hi)`` of prompt lengths (module docstring); (0, 0) for none."""
    if not lengths:
        return 0, 0
    xs = sorted(lengths)
    n = len(xs)
    return xs[math.ceil(n / 3) - 1], xs[math.ceil(2 * n / 3) - 1]


def size_bucket(num_prompt_tokens: int, edges: tuple[int, int]) -> str:
    lo, hi = edges
    return "short" if num_prompt_tokens <= lo else "medium" if num_prompt_tokens <= hi else "long"


def by_prompt_size(metrics: Sequence[RequestMetrics]) -> dict[str, dict[str, Any]]:
    """Requests, prompt-length range, TTFT and E2E distributions per size bucket."""
    edges = prompt_size_edges([m.num_prompt_tokens for m in metrics])
    groups: dict[str, list[RequestMetrics]] = {b: [] for b in SIZE_BUCKETS}
    for m in metrics:
        groups[size_bucket(m.num_prompt_tokens, edges)].append(m)
    out: dict[str, dict[str, Any]] = {}
    for bucket, ms in groups.items():
        lengths = [m.num_prompt_tokens for m in ms]
        out[bucket] = {
            "requests": len(ms),
            "min_prompt_tokens": min(lengths, default=math.nan),
            "max_prompt_tokens": max(lengths, default=math.nan),
            "ttft_s": _dist([m.ttft for m in ms if m.ttft is not None]),
            "e2e_s": _dist([m.e2e for m in ms if m.e2e is not None]),
        }
    return out


def summarize(metrics: Sequence[RequestMetrics], slo: SLOConfig | None = None,
              duration: float | None = None) -> dict[str, Any]:
    """Aggregate metrics of finished requests.

    ``duration`` defaults to first arrival -> last finish. Goodput counts requests that
    meet every SLO target, per second; attainment is their share. ``by_prompt_size``
    holds :func:`by_prompt_size` (TTFT and E2E per prompt-length tertile).
    """
    slo = slo or SLOConfig()
    if duration is None:
        finishes = [m.finish_time for m in metrics if m.finish_time is not None]
        duration = (max(finishes) - min(m.arrival_time for m in metrics)) if finishes else 0.0

    def vals(attr: str) -> list[float]:
        return [v for v in (getattr(m, attr) for m in metrics) if v is not None]

    itls = [g for m in metrics for g in m.itls]
    out_tokens = sum(m.num_output_tokens for m in metrics)
    prompt_tokens = sum(m.num_prompt_tokens for m in metrics)
    good = sum(m.meets(slo) for m in metrics)
    per_sec = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    tenants: dict[str, dict[str, float]] = {}
    for m in metrics:
        t = tenants.setdefault(m.tenant, {"requests": 0, "prompt_tokens": 0, "output_tokens": 0})
        t["requests"] += 1
        t["prompt_tokens"] += m.num_prompt_tokens
        t["output_tokens"] += m.num_output_tokens
    for t in tenants.values():
        t["service_tokens"] = t["prompt_tokens"] + t["output_tokens"]
    return {
        "requests": len(metrics),
        "duration_s": duration,
        "throughput_req_s": per_sec(len(metrics)),
        "output_tokens": out_tokens,
        "output_tokens_per_s": per_sec(out_tokens),
        "total_tokens_per_s": per_sec(out_tokens + prompt_tokens),
        "ttft_s": _dist(vals("ttft")), "tpot_s": _dist(vals("tpot")), "itl_s": _dist(itls),
        "e2e_s": _dist(vals("e2e")), "normalized_latency_s": _dist(vals("normalized_latency")),
        "queueing_delay_s": _dist(vals("queueing_delay")),
        "max_wait_s": max(vals("queueing_delay"), default=math.nan),
        "preemptions": sum(m.num_preemptions for m in metrics),
        "recomputed_tokens": sum(m.num_recomputed_tokens for m in metrics),
        "prefix_hit_rate": sum(m.num_cached_tokens for m in metrics) / prompt_tokens if prompt_tokens else 0.0,
        "slo_attainment": good / len(metrics) if metrics else math.nan,
        "goodput_req_s": per_sec(good),
        "tenants": tenants,
        "jain_fairness": jain_index([t["service_tokens"] for t in tenants.values()]),
        "by_prompt_size": by_prompt_size(metrics),
    }
