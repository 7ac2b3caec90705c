"""Fairness across tenants, measured the way VTC (Sheng et al., OSDI'24) bounds it.

A tenant's service is ``input_weight`` x its prompt tokens + ``output_weight`` x its output
tokens, divided by its share (``workload.tenants[].share``; 1 when unlisted); prompt
tokens count at the request's first token, output tokens when generated. A tenant is
backlogged while it has a request queued (waiting, or preempted and waiting again: the
request's ``queued_spans``), as in VTC's guarantee: a tenant whose requests are all
running is limited by its own demand, not by the scheduler. Three figures, all of
weighted service:

- ``service``: per tenant, in total and per window of ``window_s`` (the service over time).
- ``max_service_gap``: the largest difference of service any two tenants received over an
  interval during which both were backlogged: for tenants i and j and times t1 < t2 in one
  such interval, ``|(S_i(t2) - S_i(t1)) - (S_j(t2) - S_j(t1))|``. VTC keeps it bounded
  by a constant; FCFS lets it grow with the imbalance of demand.
- ``jain_backlogged``: Jain's index of the service of the tenants backlogged throughout a
  window, averaged over the windows with at least two of them (NaN when there is none).
  Over a whole run, Jain's index of totals measures demand as much as fairness; inside a
  window where every tenant wanted more, it measures the scheduler.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from schedkit.config import FairnessConfig


class _Req(Protocol):
    """What the fairness metrics read of a request (``RequestMetrics`` has it)."""

    @property
    def tenant(self) -> str: ...
    @property
    def arrival_time(self) -> float: ...
    @property
    def finish_time(self) -> float | None: ...
    @property
    def first_token_time(self) -> float | None: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def token_times(self) -> tuple[float, ...]: ...
    @property
    def queued_spans(self) -> tuple[tuple[float, float], ...]: ...
    @property
    def first_scheduled_time(self) -> float | None: ...


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 is perfectly even, 1/n worst."""
    if not values:
        return math.nan
    sq = sum(v * v for v in values)
    return (sum(values) ** 2) / (len(values) * sq) if sq else 1.0


def service_events(metrics: Sequence[_Req], cfg: FairnessConfig,
                   shares: Mapping[str, float]) -> dict[str, tuple[list[float], list[float]]]:
    """Per tenant: the times at which it was served and its cumulative weighted service
    at each (one entry per distinct time)."""
    amounts: dict[str, dict[float, float]] = {}
    for m in metrics:
        share = shares.get(m.tenant, 1.0)
        per_time = amounts.setdefault(m.tenant, {})
        if m.first_token_time is not None:
            t = m.first_token_time
            per_time[t] = per_time.get(t, 0.0) + cfg.input_weight * m.num_prompt_tokens / share
        for t in m.token_times:
            per_time[t] = per_time.get(t, 0.0) + cfg.output_weight / share
    out = {}
    for tenant, per_time in amounts.items():
        times = sorted(per_time)
        total, cum = 0.0, []
        for t in times:
            total += per_time[t]
            cum.append(total)
        out[tenant] = (times, cum)
    return out


def backlogged_intervals(metrics: Sequence[_Req]) -> dict[str, list[tuple[float, float]]]:
    """Per tenant: the maximal intervals during which it had a request queued (a record
    without ``queued_spans`` counts from arrival to its first scheduling, or its end)."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for m in metrics:
        own = spans.setdefault(m.tenant, [])
        if m.queued_spans:
            own.extend(m.queued_spans)
        else:
            end = next((t for t in (m.first_scheduled_time, m.finish_time) if t is not None),
                       m.arrival_time)
            own.append((m.arrival_time, end))
    merged: dict[str, list[tuple[float, float]]] = {}
    for tenant, ivs in spans.items():
        ivs.sort()
        out: list[tuple[float, float]] = []
        for a, b in ivs:
            if out and a <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], b))
            else:
                out.append((a, b))
        merged[tenant] = out
    return merged


def _cum_at(series: tuple[list[float], list[float]], t: float) -> float:
    """Cumulative service at time ``t`` (events at ``t`` included)."""
    times, cum = series
    i = bisect.bisect_right(times, t)
    return cum[i - 1] if i else 0.0


def _times_in(series: tuple[list[float], list[float]], lo: float, hi: float) -> list[float]:
    """Event times in (lo, hi]."""
    times = series[0]
    return times[bisect.bisect_right(times, lo):bisect.bisect_right(times, hi)]


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def max_service_gap(events: Mapping[str, tuple[list[float], list[float]]],
                    backlog: Mapping[str, list[tuple[float, float]]]) -> float:
    """The largest service difference of two tenants over an interval where both were
    backlogged (module docstring); 0 with fewer than two tenants."""
    empty: tuple[list[float], list[float]] = ([], [])
    tenants = sorted(backlog)
    gap = 0.0
    for x, i in enumerate(tenants):
        for j in tenants[x + 1:]:
            si, sj = events.get(i, empty), events.get(j, empty)
            for lo, hi in _intersect(backlog[i], backlog[j]):
                # D(t) = S_i(t) - S_j(t) changes only at event times: its range on
                # [lo, hi] is the largest difference over sub-intervals.
                points = [lo, *_times_in(si, lo, hi), *_times_in(sj, lo, hi)]
                ds = [_cum_at(si, t) - _cum_at(sj, t) for t in points]
                gap = max(gap, max(ds) - min(ds))
    return gap


def fairness_summary(metrics: Sequence[_Req], cfg: FairnessConfig | None = None,
                     shares: Mapping[str, float] | None = None) -> dict[str, Any]:
    """``service`` (total and per window), ``max_service_gap``, ``jain_backlogged`` and
    ``window_s`` of ``metrics`` (module docstring)."""
    cfg = cfg or FairnessConfig()
    shares = shares or {}
    events = service_events(metrics, cfg, shares)
    backlog = backlogged_intervals(metrics)
    tenants = sorted(backlog)
    ends = [m.finish_time for m in metrics if m.finish_time is not None]
    start = min((m.arrival_time for m in metrics), default=0.0)
    end = max(ends, default=start)
    window = cfg.window_s or ((end - start) / 20 or 1.0)
    num_windows = max(1, math.ceil((end - start) / window))
    empty: tuple[list[float], list[float]] = ([], [])
    per_window: dict[str, list[float]] = {}
    for t in tenants:
        s = events.get(t, empty)
        edges = [_cum_at(s, start + k * window) if k else 0.0 for k in range(num_windows + 1)]
        if num_windows:
            edges[-1] = s[1][-1] if s[1] else 0.0
        per_window[t] = [b - a for a, b in zip(edges, edges[1:], strict=False)]
    jains = []
    for k in range(num_windows):
        lo, hi = start + k * window, start + (k + 1) * window
        busy = [t for t in tenants if any(a <= lo and hi <= b for a, b in backlog[t])]
        if len(busy) >= 2:
            jains.append(jain_index([per_window[t][k] for t in busy]))
    return {
        "window_s": window,
        "service": {t: {"total": events[t][1][-1] if t in events and events[t][1] else 0.0,
                        "per_window": per_window[t]} for t in tenants},
        "max_service_gap": max_service_gap(events, backlog),
        "jain_backlogged": sum(jains) / len(jains) if jains else math.nan,
        "backlogged_windows": len(jains),
    }
