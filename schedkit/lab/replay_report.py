"""What a counterfactual replay changed, per request and in aggregate.

:func:`diff_runs` pairs the requests of two runs by id. Per request: TTFT, E2E (seconds;
None for a request that got no token or did not finish), recomputed tokens and
preemptions, before and after. In aggregate, from :func:`~schedkit.lab.metrics.summarize`
under the workload's SLO: TTFT mean, p50 and p99, E2E mean and p99 (a request never
served counts as infinitely late in the percentiles), recomputed tokens, preemptions,
SLO attainment, the duration (first arrival to last finish) and the steps run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from schedkit.config import SLOConfig
from schedkit.lab.metrics import RequestMetrics, summarize

if TYPE_CHECKING:
    from schedkit.lab.recording import Recording

AGGREGATES: tuple[tuple[str, str, str | None, float], ...] = (
    ("TTFT mean (ms)", "ttft_s", "mean", 1e3),
    ("TTFT p50 (ms)", "ttft_s", "p50", 1e3),
    ("TTFT p99 (ms)", "ttft_s", "p99", 1e3),
    ("E2E mean (ms)", "e2e_s", "mean", 1e3),
    ("E2E p99 (ms)", "e2e_s", "p99", 1e3),
    ("recomputed tokens", "recomputed_tokens", None, 1.0),
    ("preemptions", "preemptions", None, 1.0),
    ("SLO attainment (%)", "slo_attainment", None, 100.0),
    ("makespan (ms)", "makespan_s", None, 1e3),
)
"""(row name, summarize key, sub-key, scale) of each aggregate row."""


def _delta(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return b - a


@dataclass(slots=True, frozen=True)
class RequestDiff:
    """One request in both runs."""

    before: RequestMetrics
    after: RequestMetrics

    @property
    def request_id(self) -> str:
        return self.before.request_id

    def figures(self) -> dict[str, tuple[Any, Any]]:
        b, a = self.before, self.after
        return {"ttft_s": (b.ttft, a.ttft), "e2e_s": (b.e2e, a.e2e),
                "recomputed_tokens": (b.num_recomputed_tokens, a.num_recomputed_tokens),
                "preemptions": (b.num_preemptions, a.num_preemptions),
                "finish_reason": (b.finish_reason, a.finish_reason)}

    @property
    def is_changed(self) -> bool:
        return any(x != y for x, y in self.figures().values())

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"request_id": self.request_id}
        for name, (x, y) in self.figures().items():
            numeric = name != "finish_reason"
            out[name] = {"before": x, "after": y, **({"delta": _delta(x, y)} if numeric else {})}
        return out


@dataclass(slots=True)
class ReplayDiff:
    """Two runs of the same requests, compared."""

    requests: list[RequestDiff]
    before: dict[str, Any]
    """:func:`~schedkit.lab.metrics.summarize` of the first run (plus ``steps``)."""
    after: dict[str, Any]

    @property
    def changed(self) -> list[RequestDiff]:
        """The requests whose figures differ, the largest E2E change first."""
        def size(d: RequestDiff) -> float:
            x, y = d.before.e2e, d.after.e2e
            return -abs(y - x) if x is not None and y is not None else -math.inf
        return sorted((d for d in self.requests if d.is_changed), key=lambda d: (size(d), d.request_id))

    def aggregate(self) -> dict[str, dict[str, float]]:
        rows: dict[str, dict[str, float]] = {}
        for name, key, sub, scale in (*AGGREGATES, ("steps", "steps", None, 1.0)):
            x, y = (s[key] if sub is None else s[key][sub] for s in (self.before, self.after))
            if scale != 1.0:
                x, y = x * scale, y * scale
            rows[name] = {"before": x, "after": y, "delta": y - x}
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {"aggregate": self.aggregate(), "num_changed": len(self.changed),
                "requests": [d.to_dict() for d in self.requests]}

    def format_table(self, labels: tuple[str, str] = ("baseline", "changed"), top: int = 10) -> str:
        """The aggregate table, then the ``top`` requests whose E2E changed most."""
        lines = [f"{'':<20}{labels[0]:>12}{labels[1]:>12}{'delta':>12}"]
        for name, row in self.aggregate().items():
            lines.append(f"{name:<20}{_num(row['before']):>12}{_num(row['after']):>12}"
                         f"{_num(row['delta'], signed=True):>12}")
        changed = self.changed
        lines.append(f"requests changed: {len(changed)} of {len(self.requests)}")
        if changed and top:
            lines.append("")
            lines.append(f"{'request':<12}{'TTFT ms':>20}{'E2E ms':>20}{'recomputed':>14}{'preempted':>11}")
            for d in changed[:top]:
                f = d.figures()
                lines.append(f"{d.request_id:<12}{_pair(*f['ttft_s'], 1e3):>20}{_pair(*f['e2e_s'], 1e3):>20}"
                             f"{_pair(*f['recomputed_tokens']):>14}{_pair(*f['preemptions']):>11}")
            if len(changed) > top:
                lines.append(f"... {len(changed) - top} more (all of them in the JSON output)")
        return "\n".join(lines)


def _num(x: float, signed: bool = False) -> str:
    """Counts as they are, times and rates with one decimal."""
    if math.isnan(x):
        return "n/a"
    if math.isinf(x):
        return "inf" if x > 0 or not signed else "-inf"
    if isinstance(x, int):
        return f"{x:+d}" if signed else str(x)
    return f"{x:+.1f}" if signed else f"{x:.1f}"


def _pair(x: float | None, y: float | None, scale: float = 1.0) -> str:
    def one(v: float | None) -> str:
        return "-" if v is None else _num(v * scale if scale != 1.0 else v)
    return f"{one(x)} -> {one(y)}"


def diff_runs(before: Sequence[RequestMetrics], after: Sequence[RequestMetrics], slo: SLOConfig,
              num_steps: tuple[int, int] = (0, 0)) -> ReplayDiff:
    """Compare two runs of the same requests (paired by id; a request missing from one
    run is left out)."""
    by_id = {m.request_id: m for m in after}
    pairs = [RequestDiff(m, by_id[m.request_id]) for m in before if m.request_id in by_id]
    sums = []
    for metrics, steps in ((before, num_steps[0]), (after, num_steps[1])):
        s = summarize(metrics, slo)
        s["steps"] = steps
        sums.append(s)
    return ReplayDiff(pairs, sums[0], sums[1])


def recorded_metrics(recording: Recording) -> list[RequestMetrics]:
    """The recorded run's per-request figures, as metrics (no token times)."""
    out = []
    for r in recording.requests:
        m = r.metrics or {}
        out.append(RequestMetrics(
            r.request_id, m.get("arrival_time", r.arrival_time), m.get("first_scheduled_time"),
            m.get("first_token_time"), m.get("finish_time"), len(r.prompt_token_ids),
            r.num_output_tokens or 0, m.get("num_cached_tokens") or 0, m.get("num_preemptions") or 0,
            m.get("num_recomputed_tokens") or 0, r.finish_reason, r.tenant, r.priority,
            max_tokens=r.max_tokens))
    return out
