"""Serving metrics: per request (TTFT, TPOT, inter-token gaps, E2E, queueing delay, ...)
and aggregates (throughput, percentiles, goodput and SLO attainment, per-tenant service,
Jain's fairness index, maximum wait).

All times are seconds relative to the start of the run (the engine clock at start).
Definitions: TTFT = first token - arrival; TPOT = (last token - first token) /
(outputs - 1); ITL = every gap between consecutive tokens (tokens of one step share a
time); E2E = finish - arrival; normalized latency = E2E / outputs; queueing delay (the
first wait) = first admission - arrival; longest wait = the longest stretch queued, from
arrival or from a preemption to being scheduled again (or to the end, if it ended
queued). Recomputed tokens are those a preemption made the engine compute again (tokens
whose KV stayed in the prefix cache are not).

Rejected requests (an admission plugin said no, stop reason ``rejected``, or the engine
refused them at arrival, stop reason ``refused``) count in ``requests`` and in
``rejected``; they miss every SLO, and in the TTFT, E2E and normalized-latency
distributions they count as infinitely late: percentiles (and the maximum) are taken over
every request, so a percentile that reaches into the unserved ones is infinite (``inf``
in the table, the string ``"inf"`` in JSON), while the ``mean`` is over the served
requests only. Their prompts count in no token total (throughput, prefix hit rate,
tenants' service): they were never computed. Queueing delay and TPOT are
over the requests that got that far.

SLOs are per class: a request is judged by ``slo.for_class(tenant, priority)``
(:class:`schedkit.config.SLOConfig`); ``by_priority`` and ``by_tenant`` report
attainment, goodput and latency per class. Fairness metrics are in
:mod:`schedkit.lab.fairness`.

Breakdown by request size (``summarize(...)["by_prompt_size"]``): the requests are split
into three buckets by prompt length at its tertiles. With ``n`` requests and their prompt
lengths sorted as ``x[0] <= ... <= x[n-1]``, the cut points are ``lo = x[ceil(n/3) - 1]``
and ``hi = x[ceil(2n/3) - 1]``; ``short`` is ``length <= lo``, ``medium`` is
``lo < length <= hi`` and ``long`` is ``length > hi``. Equal lengths always share a bucket,
so buckets are about a third each for varied lengths and may be empty when many prompts
have the same length (all of one length: everything is ``short``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from schedkit.config import FairnessConfig, SLOConfig
from schedkit.core.outputs import RequestMetricsData
from schedkit.core.request import Request
from schedkit.lab.fairness import fairness_summary, jain_index


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
    longest_wait: float | None = None
    """Seconds of the longest stretch queued (module docstring); None if unknown."""
    stop_reason: int | str | None = None
    """The engine's stop reason: a stop token or string, ``rejected`` (by ``rejected_by``)
    or ``refused`` (the engine refused the request at arrival: ``error`` says why)."""
    rejected_by: str | None = None
    error: str | None = None
    max_tokens: int | None = None
    """The output length asked for (None when unknown, e.g. from a RequestOutput)."""
    queued_spans: tuple[tuple[float, float], ...] = field(default=(), repr=False)
    """Every stretch spent queued (waiting or preempted): ``(start, end)`` in order."""
    num_draft_tokens: int = 0
    """Speculative draft tokens verified for it."""
    num_accepted_tokens: int = 0
    """Of those, the ones accepted."""

    @property
    def output_size(self) -> int:
        """The job's output length: ``max_tokens`` when known, else the tokens generated."""
        return self.max_tokens if self.max_tokens is not None else self.num_output_tokens

    @property
    def rejected(self) -> bool:
        """Dropped without service: rejected by an admission plugin or refused at arrival."""
        return self.stop_reason in ("rejected", "refused", "busy")

    @property
    def served(self) -> bool:
        """Finished normally (``stop`` or ``length``)."""
        return self.finish_reason in ("stop", "length")

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
        """Whether every target of the request's class in ``slo`` holds (an unset target
        always holds; a request not served misses)."""
        if not self.served:
            return False
        return slo.for_class(self.tenant, self.priority).met_by(self.ttft, self.tpot, self.e2e)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id, "tenant": self.tenant, "priority": self.priority,
            "arrival_time": self.arrival_time, "first_scheduled_time": self.first_scheduled_time,
            "first_token_time": self.first_token_time, "finish_time": self.finish_time,
            "num_prompt_tokens": self.num_prompt_tokens, "num_output_tokens": self.num_output_tokens,
            "num_cached_tokens": self.num_cached_tokens, "num_preemptions": self.num_preemptions,
            "num_recomputed_tokens": self.num_recomputed_tokens, "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason, "rejected": self.rejected,
            "rejected_by": self.rejected_by, "error": self.error,
            "ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e,
            "queueing_delay": self.queueing_delay, "longest_wait": self.longest_wait,
            "normalized_latency": self.normalized_latency,
            "num_draft_tokens": self.num_draft_tokens, "num_accepted_tokens": self.num_accepted_tokens,
        }


def _rel(t: float | None, start: float) -> float | None:
    return None if t is None else t - start


def metrics_from_data(request_id: str, m: RequestMetricsData, finish_reason: str | None, *,
                      tenant: str = "default", priority: int = 0,
                      token_times: Sequence[float] = (), start: float = 0.0,
                      stop_reason: int | str | None = None, rejected_by: str | None = None,
                      error: str | None = None, max_tokens: int | None = None) -> RequestMetrics:
    """RequestMetrics from the engine's per-request record (times made relative to ``start``):
    the one conversion behind both :func:`request_metrics` and :func:`metrics_from_output`."""
    return RequestMetrics(
        request_id=request_id, arrival_time=m.arrival_time - start,
        first_scheduled_time=_rel(m.first_scheduled_time, start),
        first_token_time=_rel(m.first_token_time, start), finish_time=_rel(m.finish_time, start),
        num_prompt_tokens=m.num_prompt_tokens, num_output_tokens=m.num_output_tokens,
        num_cached_tokens=m.num_cached_tokens, num_preemptions=m.num_preemptions,
        num_recomputed_tokens=m.num_recomputed_tokens, finish_reason=finish_reason,
        tenant=tenant, priority=priority, token_times=tuple(t - start for t in token_times),
        longest_wait=m.longest_wait_s, stop_reason=stop_reason, rejected_by=rejected_by,
        error=error, max_tokens=max_tokens,
        queued_spans=tuple((a - start, b - start) for a, b in m.queued_spans),
        num_draft_tokens=m.num_draft_tokens, num_accepted_tokens=m.num_accepted_tokens)


def request_metrics(req: Request, token_times: Sequence[float] = (), start: float = 0.0,
                    error: str | None = None) -> RequestMetrics:
    """Metrics of a finished request from its events (times made relative to ``start``;
    ``error``: the message of a request that failed)."""
    reason = req.get_finished_reason()
    return metrics_from_data(req.request_id, RequestMetricsData.of(req),
                             None if reason is None else reason.value, tenant=req.tenant,
                             priority=req.priority, token_times=token_times, start=start,
                             stop_reason=req.stop_reason, rejected_by=req.rejected_by, error=error,
                             max_tokens=req.max_tokens)


def refused_metrics(request_id: str, arrival_time: float, num_prompt_tokens: int, error: str, *,
                    tenant: str = "default", priority: int = 0,
                    max_tokens: int | None = None) -> RequestMetrics:
    """The record of a request the engine refused when it arrived (``stop_reason``
    ``refused``, ``error`` the engine's message): it counts as rejected."""
    return RequestMetrics(request_id, arrival_time, None, None, None, num_prompt_tokens, 0, 0, 0,
                          0, "abort", tenant, priority, longest_wait=0.0, stop_reason="refused",
                          error=error, max_tokens=max_tokens)


def metrics_from_output(out: Any, sent: Any = None, start: float = 0.0) -> RequestMetrics:
    """RequestMetrics of a finished client-side RequestOutput (metrics from the engine).

    ``sent``: the request as sent (a ``WorkloadRequest``: its tenant, priority,
    ``max_tokens`` and arrival offset, which the output does not carry); ``start``: the
    engine clock at offset 0, taken off every time. A request the engine refused (stop
    reason ``refused``) comes back without metrics; its record needs ``sent``.
    """
    tenant = getattr(sent, "tenant", "default")
    priority = getattr(sent, "priority", 0)
    max_tokens = getattr(sent, "max_tokens", None)
    if out.metrics is None:
        if sent is None:
            raise ValueError(f"request {out.request_id!r} has no metrics: pass the request sent")
        return refused_metrics(out.request_id, sent.arrival_time, len(sent.prompt_token_ids),
                               out.error or "refused", tenant=tenant, priority=priority,
                               max_tokens=max_tokens)
    return metrics_from_data(out.request_id, out.metrics, out.finish_reason, tenant=tenant,
                             priority=priority, stop_reason=out.stop_reason,
                             rejected_by=out.rejected_by, error=out.error, max_tokens=max_tokens,
                             start=start)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values. Infinite values
    (requests never served) rank last: a percentile whose position falls past the last
    finite value (interpolating towards an infinite one) is infinite."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    if lo == hi or xs[lo] == xs[hi]:
        return xs[lo]
    if math.isinf(xs[hi]):
        return math.inf
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _dist(values: Sequence[float], unserved: int = 0) -> dict[str, float]:
    """Mean of ``values``; p50/p90/p99/max of ``values`` and ``unserved`` infinite ones."""
    xs = [*values, *([math.inf] * unserved)]
    return {"mean": sum(values) / len(values) if values else math.nan,
            "p50": percentile(xs, 50), "p90": percentile(xs, 90),
            "p99": percentile(xs, 99), "max": max(xs) if xs else math.nan}


def _latency(metrics: Sequence[RequestMetrics], attr: str) -> dict[str, float]:
    """The distribution of a latency, a request without one counting as infinite: TTFT
    needs a first token, E2E and normalized latency a normal finish."""
    values: list[float] = []
    unserved = 0
    for m in metrics:
        v = getattr(m, attr)
        if v is None or (attr != "ttft" and not m.served):
            unserved += 1
        else:
            values.append(v)
    return _dist(values, unserved)


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


def _by_size(metrics: Sequence[RequestMetrics], size: Any, what: str) -> dict[str, dict[str, Any]]:
    """Requests, size range, TTFT and E2E distributions per tertile of ``size(m)``."""
    edges = prompt_size_edges([size(m) for m in metrics])
    groups: dict[str, list[RequestMetrics]] = {b: [] for b in SIZE_BUCKETS}
    for m in metrics:
        groups[size_bucket(size(m), edges)].append(m)
    out: dict[str, dict[str, Any]] = {}
    for bucket, ms in groups.items():
        lengths = [size(m) for m in ms]
        out[bucket] = {
            "requests": len(ms),
            f"min_{what}_tokens": min(lengths, default=math.nan),
            f"max_{what}_tokens": max(lengths, default=math.nan),
            "ttft_s": _latency(ms, "ttft"),
            "e2e_s": _latency(ms, "e2e"),
        }
    return out


def by_prompt_size(metrics: Sequence[RequestMetrics]) -> dict[str, dict[str, Any]]:
    """Requests, prompt-length range, TTFT and E2E distributions per prompt-length tertile."""
    return _by_size(metrics, lambda m: m.num_prompt_tokens, "prompt")


def by_output_size(metrics: Sequence[RequestMetrics]) -> dict[str, dict[str, Any]]:
    """The same per tertile of the output length asked for (``max_tokens``; the tokens
    generated when unknown): short jobs against long ones."""
    return _by_size(metrics, lambda m: m.output_size, "output")


def _per_sec(duration: float) -> Any:
    return (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)


def work_done_by(metrics: Sequence[RequestMetrics], end: float) -> tuple[int, float, int]:
    """``(requests served, output tokens, prompt tokens)`` done by time ``end``: requests
    that finished normally by then, output tokens produced by then (from each request's
    token times; without them, spread evenly from its first token to its finish), and
    the prompts of requests whose first token came by then. Rejected requests did no work."""
    served = 0
    outputs = 0.0
    prompts = 0
    for m in metrics:
        if m.rejected:
            continue
        served += m.served and m.finish_time is not None and m.finish_time <= end
        first = m.first_token_time
        if first is None or first > end:
            continue
        prompts += m.num_prompt_tokens
        if m.token_times:
            outputs += bisect.bisect_right(m.token_times, end)
        elif m.finish_time is None or m.finish_time <= end or m.num_output_tokens < 2:
            outputs += m.num_output_tokens
        else:  # part of the way from the first token to the last
            outputs += 1 + (m.num_output_tokens - 1) * (end - first) / (m.finish_time - first)
    return served, outputs, prompts


def class_summary(metrics: Sequence[RequestMetrics], slo: SLOConfig,
                  duration: float) -> dict[str, Any]:
    """Requests, rejections, SLO attainment, goodput and latencies of one class."""
    good = sum(m.meets(slo) for m in metrics)
    return {
        "requests": len(metrics), "rejected": sum(m.rejected for m in metrics),
        "slo_attainment": good / len(metrics) if metrics else math.nan,
        "goodput_req_s": _per_sec(duration)(good),
        "ttft_s": _latency(metrics, "ttft"),
        "tpot_s": _dist([v for m in metrics if (v := m.tpot) is not None]),
        "e2e_s": _latency(metrics, "e2e"),
    }


def _by(metrics: Sequence[RequestMetrics], key: Any, slo: SLOConfig,
        duration: float) -> dict[Any, dict[str, Any]]:
    groups: dict[Any, list[RequestMetrics]] = {}
    for m in metrics:
        groups.setdefault(key(m), []).append(m)
    return {k: class_summary(groups[k], slo, duration) for k in sorted(groups)}


def summarize(metrics: Sequence[RequestMetrics], slo: SLOConfig | None = None, *,
              fairness: FairnessConfig | None = None,
              shares: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Aggregate metrics of a run's requests (rejected ones included: module docstring).

    Two spans of time: the *arrival window*, first arrival -> last arrival, and the
    *makespan*, first arrival -> last finish. ``offered_load_req_s`` is the arrival rate
    over the window; the throughputs (``throughput_req_s``, ``output_tokens_per_s``,
    ``total_tokens_per_s``) count the work done within the window, per second of it, so
    the drain after the last arrival does not dilute them (when every request arrives at
    once the window is empty and they are over the makespan). Goodput counts requests
    that meet their class's SLO targets, per second of makespan; attainment is their
    share of all requests. ``by_prompt_size`` holds :func:`by_prompt_size` (TTFT and E2E
    per prompt-length tertile), ``by_priority`` and ``by_tenant`` :func:`class_summary`
    per class, ``fairness`` :func:`schedkit.lab.fairness.fairness_summary` with
    ``fairness`` and the tenants' ``shares``.
    """
    slo = slo or SLOConfig()
    arrivals = [m.arrival_time for m in metrics]
    finishes = [m.finish_time for m in metrics if m.finish_time is not None]
    first = min(arrivals, default=0.0)
    duration = (max(finishes) - first) if finishes else 0.0
    window = max(arrivals, default=0.0) - first

    def vals(attr: str) -> list[float]:
        return [v for v in (getattr(m, attr) for m in metrics) if v is not None]

    itls = [g for m in metrics for g in m.itls]
    out_tokens = sum(m.num_output_tokens for m in metrics)
    # A rejected request's prompt was never computed: it is no work and no cache query.
    prompt_tokens = sum(m.num_prompt_tokens for m in metrics if not m.rejected)
    completed = sum(m.served for m in metrics)
    good = sum(m.meets(slo) for m in metrics)
    per_sec = _per_sec(duration)
    if window > 0:
        in_window = work_done_by(metrics, first + window)
        per_window_sec = _per_sec(window)
    else:  # everything arrived at once: no arrival window, the whole run counts
        in_window = (completed, out_tokens, prompt_tokens)
        per_window_sec = per_sec
    fair = fairness_summary(metrics, fairness, shares)
    tenants: dict[str, dict[str, float]] = {}
    for m in metrics:
        t = tenants.setdefault(m.tenant, {"requests": 0, "rejected": 0, "prompt_tokens": 0,
                                          "output_tokens": 0})
        t["requests"] += 1
        t["rejected"] += m.rejected
        t["prompt_tokens"] += 0 if m.rejected else m.num_prompt_tokens
        t["output_tokens"] += m.num_output_tokens
    for name, t in tenants.items():
        t["service_tokens"] = t["prompt_tokens"] + t["output_tokens"]
        t["weighted_service"] = fair["service"][name]["total"]
    waits = [w for m in metrics
             if (w := m.longest_wait if m.longest_wait is not None else m.queueing_delay) is not None]
    rejected_by: dict[str, int] = {}
    for m in metrics:
        if m.rejected:
            who = m.rejected_by or ("engine" if m.stop_reason in ("refused", "busy") else "unknown")
            rejected_by[who] = rejected_by.get(who, 0) + 1
    return {
        "requests": len(metrics),
        "completed": completed,
        "rejected": sum(rejected_by.values()),
        "rejected_by": dict(sorted(rejected_by.items())),
        "makespan_s": duration,
        "arrival_window_s": window,
        "offered_load_req_s": (len(metrics) - 1) / window if window > 0 else math.nan,
        "throughput_req_s": per_window_sec(in_window[0]),
        "output_tokens": out_tokens,
        "output_tokens_per_s": per_window_sec(in_window[1]),
        "total_tokens_per_s": per_window_sec(in_window[1] + in_window[2]),
        "ttft_s": _latency(metrics, "ttft"), "tpot_s": _dist(vals("tpot")), "itl_s": _dist(itls),
        "e2e_s": _latency(metrics, "e2e"),
        "normalized_latency_s": _latency(metrics, "normalized_latency"),
        "queueing_delay_s": _dist(vals("queueing_delay")),
        "max_first_wait_s": max(vals("queueing_delay"), default=math.nan),
        "max_wait_s": max(waits, default=math.nan),
        "preemptions": sum(m.num_preemptions for m in metrics),
        "draft_tokens": (drafts := sum(m.num_draft_tokens for m in metrics)),
        "draft_acceptance": sum(m.num_accepted_tokens for m in metrics) / drafts if drafts else math.nan,
        "recomputed_tokens": sum(m.num_recomputed_tokens for m in metrics),
        "prefix_hit_rate": sum(m.num_cached_tokens for m in metrics) / prompt_tokens if prompt_tokens else 0.0,
        "slo_attainment": good / len(metrics) if metrics else math.nan,
        "goodput_req_s": per_sec(good),
        "tenants": tenants,
        "jain_fairness": jain_index([t["service_tokens"] for t in tenants.values()]),
        "fairness": fair,
        "by_prompt_size": by_prompt_size(metrics),
        "by_output_size": by_output_size(metrics),
        "by_priority": _by(metrics, lambda m: m.priority, slo, duration),
        "by_tenant": _by(metrics, lambda m: m.tenant, slo, duration),
    }
