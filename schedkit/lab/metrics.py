"""Per-request serving metrics from request events, and their aggregates."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from schedkit.core.request import EventType, Request


@dataclass(slots=True, frozen=True)
class RequestMetrics:
    request_id: str
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    finish_reason: str | None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.first_token_time is None or self.finish_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "ttft": self.ttft, "tpot": self.tpot}


def request_metrics(req: Request) -> RequestMetrics:
    reason = req.get_finished_reason()
    return RequestMetrics(
        request_id=req.request_id, arrival_time=req.arrival_time,
        first_token_time=req.first_event_time(EventType.FIRST_TOKEN),
        finish_time=req.first_event_time(EventType.FINISHED),
        num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
        num_cached_tokens=max(req.num_cached_tokens, 0), num_preemptions=req.num_preemptions,
        finish_reason=None if reason is None else reason.value)


def metrics_from_output(out: Any) -> RequestMetrics:
    """RequestMetrics of a finished client-side RequestOutput (metrics from the engine)."""
    m = out.metrics
    return RequestMetrics(
        request_id=out.request_id, arrival_time=m.arrival_time,
        first_token_time=m.first_token_time, finish_time=m.finish_time,
        num_prompt_tokens=m.num_prompt_tokens, num_output_tokens=m.num_output_tokens,
        num_cached_tokens=m.num_cached_tokens, num_preemptions=m.num_preemptions,
        finish_reason=out.finish_reason)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(metrics: Sequence[RequestMetrics], duration: float) -> dict[str, float]:
    ttft = [m.ttft for m in metrics if m.ttft is not None]
    tpot = [m.tpot for m in metrics if m.tpot is not None]
    out_tokens = sum(m.num_output_tokens for m in metrics)
    prompt_tokens = sum(m.num_prompt_tokens for m in metrics)
    cached = sum(m.num_cached_tokens for m in metrics)
    return {
        "requests": len(metrics),
        "duration_s": duration,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else math.nan,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        "preemptions": sum(m.num_preemptions for m in metrics),
        "prefix_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
    }
