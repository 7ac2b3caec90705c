"""Reports: a terminal table, a JSON file and PNG plots (matplotlib, optional)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from schedkit.lab.metrics import RequestMetrics

ROWS = (
    ("requests", "requests", "{:.0f}"),
    ("output tok/s", "output_tokens_per_s", "{:.1f}"),
    ("TTFT p50 (ms)", ("ttft_s", "p50"), "ms"),
    ("TTFT p99 (ms)", ("ttft_s", "p99"), "ms"),
    ("TPOT p50 (ms)", ("tpot_s", "p50"), "ms"),
    ("TPOT p99 (ms)", ("tpot_s", "p99"), "ms"),
    ("E2E p50 (s)", ("e2e_s", "p50"), "{:.2f}"),
    ("max wait (s)", "max_wait_s", "{:.2f}"),
    ("SLO attainment", "slo_attainment", "{:.1%}"),
    ("goodput (req/s)", "goodput_req_s", "{:.2f}"),
    ("preemptions", "preemptions", "{:.0f}"),
    ("prefix hit rate", "prefix_hit_rate", "{:.1%}"),
    ("Jain fairness", "jain_fairness", "{:.3f}"),
)


def _get(summary: Mapping[str, Any], key: Any) -> float:
    if isinstance(key, tuple):
        return summary[key[0]][key[1]]
    return summary[key]


def _fmt(value: float, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value * 1e3:.1f}" if fmt == "ms" else fmt.format(value)


def format_table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """One column per profile, one row per metric."""
    names = list(summaries)
    label_w = max(len(r[0]) for r in ROWS)
    cols = [[_fmt(_get(summaries[n], key), fmt) for _, key, fmt in ROWS] for n in names]
    widths = [max(len(n), *(len(c) for c in col)) for n, col in zip(names, cols, strict=True)]
    lines = [" " * label_w + "  " + "  ".join(n.rjust(w) for n, w in zip(names, widths, strict=True))]
    for i, (label, _, _) in enumerate(ROWS):
        lines.append(label.ljust(label_w) + "  " + "  ".join(
            col[i].rjust(w) for col, w in zip(cols, widths, strict=True)))
    return "\n".join(lines)


def _clean(obj: Any) -> Any:
    if isinstance(obj, float):
        return None if math.isnan(obj) or math.isinf(obj) else obj
    if isinstance(obj, Mapping):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(path: str | Path, payload: Mapping[str, Any]) -> None:
    """Deterministic JSON (sorted keys, NaN as null): same run, same bytes."""
    Path(path).write_text(json.dumps(_clean(payload), indent=1, sort_keys=True) + "\n")


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(ax: Any, xlabel: str, ylabel: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()


def _save(plt: Any, fig: Any, path: str | Path) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_cdfs(runs: Mapping[str, Sequence[RequestMetrics]], path: str | Path) -> bool:
    """TTFT and TPOT CDFs per profile, side by side. False if matplotlib is missing."""
    plt = _plt()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, attr, label in ((axes[0], "ttft", "TTFT (s)"), (axes[1], "tpot", "TPOT (s)")):
        for name, metrics in runs.items():
            xs = sorted(v for v in (getattr(m, attr) for m in metrics) if v is not None)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
        ax.set_xscale("log")
        _label(ax, label, "fraction of requests")
    return _save(plt, fig, path)


def plot_tenant_service(runs: Mapping[str, Sequence[RequestMetrics]], path: str | Path) -> bool:
    """Cumulative output tokens per tenant over time, one panel per profile."""
    plt = _plt()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    for ax, (name, metrics) in zip(axes[0], runs.items(), strict=True):
        by_tenant: dict[str, list[float]] = {}
        for m in metrics:
            by_tenant.setdefault(m.tenant, []).extend(m.token_times)
        for tenant, times in sorted(by_tenant.items()):
            times.sort()
            ax.plot(times, range(1, len(times) + 1), label=tenant)
        ax.set_title(name)
        _label(ax, "time (s)", "output tokens served")
    return _save(plt, fig, path)


def plot_latency_vs_load(sweep: Mapping[str, Sequence[tuple[float, Mapping[str, Any]]]],
                         path: str | Path, knob: str = "rate") -> bool:
    """TTFT p50/p99 against the swept load knob, per profile."""
    plt = _plt()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, points in sweep.items():
        xs = [x for x, _ in points]
        axes[0].plot(xs, [s["ttft_s"]["p50"] for _, s in points], marker="o", label=f"{name} p50")
        axes[0].plot(xs, [s["ttft_s"]["p99"] for _, s in points], marker="x", ls="--", label=f"{name} p99")
        axes[1].plot(xs, [s["slo_attainment"] for _, s in points], marker="o", label=name)
    axes[0].set_yscale("log")
    _label(axes[0], knob, "TTFT (s)")
    _label(axes[1], knob, "SLO attainment")
    return _save(plt, fig, path)
