"""Reports: a terminal table, a JSON file and PNG plots (matplotlib, optional).

Without matplotlib the plot functions return False and write nothing; the table and
the JSON are unaffected, and :func:`format_table` ends with a note saying the plots
were skipped. Every plot draws a profile in the same colour (:func:`profile_colours`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from schedkit.config import FairnessConfig
from schedkit.lab.fairness import service_events
from schedkit.lab.metrics import SIZE_BUCKETS, RequestMetrics

ROWS = (
    ("requests", "requests", "{:.0f}"),
    ("rejected", "rejected", "{:.0f}"),
    ("offered load (req/s)", "offered_load_req_s", "{:.2f}"),
    ("throughput (req/s)", "throughput_req_s", "{:.2f}"),
    ("output tok/s", "output_tokens_per_s", "{:.1f}"),
    ("TTFT mean (ms)", ("ttft_s", "mean"), "ms"),
    ("TTFT p50 (ms)", ("ttft_s", "p50"), "ms"),
    ("TTFT p90 (ms)", ("ttft_s", "p90"), "ms"),
    ("TTFT p99 (ms)", ("ttft_s", "p99"), "ms"),
    ("TPOT mean (ms)", ("tpot_s", "mean"), "ms"),
    ("TPOT p50 (ms)", ("tpot_s", "p50"), "ms"),
    ("TPOT p90 (ms)", ("tpot_s", "p90"), "ms"),
    ("TPOT p99 (ms)", ("tpot_s", "p99"), "ms"),
    ("E2E mean (s)", ("e2e_s", "mean"), "{:.2f}"),
    ("E2E p50 (s)", ("e2e_s", "p50"), "{:.2f}"),
    ("E2E p90 (s)", ("e2e_s", "p90"), "{:.2f}"),
    ("E2E p99 (s)", ("e2e_s", "p99"), "{:.2f}"),
    ("max first wait (s)", "max_first_wait_s", "{:.2f}"),
    ("max wait (s)", "max_wait_s", "{:.2f}"),
    ("SLO attainment", "slo_attainment", "{:.1%}"),
    ("goodput (req/s)", "goodput_req_s", "{:.2f}"),
    ("makespan (s)", "makespan_s", "{:.2f}"),
    ("preemptions", "preemptions", "{:.0f}"),
    ("recomputed tokens", "recomputed_tokens", "{:.0f}"),
    ("prefix hit rate", "prefix_hit_rate", "{:.1%}"),
    ("replicas", ("cluster", "num_replicas"), "{:.0f}"),
    ("imbalance, requests", ("cluster", "load_imbalance", "requests"), "{:.2f}"),
    ("imbalance, computed", ("cluster", "load_imbalance", "computed_tokens"), "{:.2f}"),
    ("re-routed", ("cluster", "router", "num_rerouted"), "{:.0f}"),
)
"""The main table's rows (the last ones only for cluster runs, ``replicas.count`` > 1:
load imbalance is max over replicas / mean); the TTFT and E2E percentiles count requests never served as
infinitely late (``inf``), their means are over the served requests. Offered load and
throughput are over the arrival window (first to last arrival), goodput over the
makespan (first arrival to last finish): :func:`schedkit.lab.metrics.summarize`."""
SPECULATION_ROWS = (
    ("draft tokens", "draft_tokens", "{:.0f}"),
    ("draft acceptance", "draft_acceptance", "{:.1%}"),
)
"""Shown when some profile's run verified speculative drafts."""
FAIRNESS_ROWS = (
    ("max service gap", ("fairness", "max_service_gap"), "{:.0f}"),
    ("Jain, backlogged", ("fairness", "jain_backlogged"), "{:.3f}"),
)
"""Shown when a profile's run has more than one tenant (:mod:`schedkit.lab.fairness`)."""
SIZE_ROWS = (
    ("requests", "requests", "{:.0f}"),
    ("TTFT mean (ms)", ("ttft_s", "mean"), "ms"),
    ("TTFT p50 (ms)", ("ttft_s", "p50"), "ms"),
    ("TTFT p90 (ms)", ("ttft_s", "p90"), "ms"),
    ("TTFT p99 (ms)", ("ttft_s", "p99"), "ms"),
    ("E2E mean (s)", ("e2e_s", "mean"), "{:.2f}"),
    ("E2E p90 (s)", ("e2e_s", "p90"), "{:.2f}"),
    ("E2E p99 (s)", ("e2e_s", "p99"), "{:.2f}"),
)
CLASS_ROWS = (
    ("requests", "requests", "{:.0f}"),
    ("rejected", "rejected", "{:.0f}"),
    ("SLO attainment", "slo_attainment", "{:.1%}"),
    ("TTFT mean (ms)", ("ttft_s", "mean"), "ms"),
    ("TTFT p90 (ms)", ("ttft_s", "p90"), "ms"),
    ("TTFT p99 (ms)", ("ttft_s", "p99"), "ms"),
    ("E2E mean (s)", ("e2e_s", "mean"), "{:.2f}"),
    ("E2E p90 (s)", ("e2e_s", "p90"), "{:.2f}"),
    ("E2E p99 (s)", ("e2e_s", "p99"), "{:.2f}"),
)
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
"""matplotlib's tab10 colours, so that colours need no matplotlib to be chosen."""
NO_MATPLOTLIB = "plots skipped: matplotlib is not installed (pip install -e '.[lab]')"
ONE_TENANT = "tenant_service.png skipped: the workload has a single tenant"


def _get(summary: Mapping[str, Any], key: Any) -> float:
    value: Any = summary
    for part in key if isinstance(key, tuple) else (key,):
        value = value[part]
    return value  # type: ignore[no-any-return]


def _fmt(value: float, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value * 1e3:.1f}" if fmt == "ms" else fmt.format(value)


Intervals = Mapping[str, Mapping[str, Any]]
"""Per profile: the half-widths of its figures' confidence intervals, shaped like its
summary (:func:`schedkit.lab.stats.ci_summary`)."""


def _cell(summary: Mapping[str, Any], key: Any, fmt: str, ci: Mapping[str, Any] | None = None) -> str:
    """A figure of ``summary``, with ``± half-width`` when ``ci`` has a finite one for it
    that is not 0 (a figure equal in every run shows none)."""
    text = _fmt(_get(summary, key), fmt)
    if ci is None or text in ("-", "inf") or not _has(ci, key):
        return text
    half = _get(ci, key)
    if not isinstance(half, (int, float)) or not math.isfinite(half) or half == 0:
        return text
    return f"{text} ± {_fmt(half, fmt)}"


def _sub(ci: Mapping[str, Any] | None, *path: Any) -> Mapping[str, Any] | None:
    """``ci[path...]`` when it is there."""
    for part in path:
        if not isinstance(ci, Mapping) or part not in ci:
            return None
        ci = ci[part]
    return ci


def _grid(title: str, names: Sequence[str], rows: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
    """Right-aligned columns under the profile names, labels on the left."""
    label_w = max(len(title), *(len(label) for label, _ in rows))
    widths = [max(len(n), *(len(cells[j]) for _, cells in rows)) for j, n in enumerate(names)]
    lines = [title.ljust(label_w) + "  " + "  ".join(n.rjust(w) for n, w in zip(names, widths, strict=True))]
    for label, cells in rows:
        lines.append(label.ljust(label_w) + "  " + "  ".join(
            c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    return lines


def _size_range(bucket: Mapping[str, Any], what: str) -> str:
    lo, hi = bucket[f"min_{what}_tokens"], bucket[f"max_{what}_tokens"]
    if not bucket["requests"] or lo is None or hi is None:
        return "-"
    return f"{lo:.0f}-{hi:.0f}"


def format_size_table(summaries: Mapping[str, Mapping[str, Any]], what: str = "prompt",
                      intervals: Intervals | None = None) -> str:
    """TTFT and E2E per tertile (short / medium / long) of the prompt length (``what``
    ``prompt``) or of the output length asked for (``output``), one column per profile
    (with ``intervals``: ``mean ± half-width``).

    The tertiles are those of each profile's requests (see :mod:`schedkit.lab.metrics`);
    the ``prompt tokens`` / ``output tokens`` rows show each bucket's range. Output
    buckets are labelled ``short-output`` and so on.
    """
    names = list(summaries)
    intervals = intervals or {}
    rows: list[tuple[str, list[str]]] = []
    for bucket in SIZE_BUCKETS:
        cells = [summaries[n][f"by_{what}_size"][bucket] for n in names]
        cis = [_sub(intervals.get(n), f"by_{what}_size", bucket) for n in names]
        tag = bucket if what == "prompt" else f"{bucket}-output"
        rows.append((f"{tag} {what} tokens", [_size_range(c, what) for c in cells]))
        rows += [(f"{tag} {label}", [_cell(c, key, fmt, ci) for c, ci in zip(cells, cis, strict=True)])
                 for label, key, fmt in SIZE_ROWS]
    title = "by prompt length (tertiles)" if what == "prompt" else "by output length asked (tertiles)"
    return "\n".join(_grid(title, names, rows))


def format_class_table(summaries: Mapping[str, Mapping[str, Any]], key: str, title: str,
                       intervals: Intervals | None = None) -> str:
    """Attainment and latency per class (``key``: ``by_priority`` or ``by_tenant``), one
    column per profile (with ``intervals``: ``mean ± half-width``); a class a profile did
    not see shows ``-``."""
    names = list(summaries)
    intervals = intervals or {}
    classes = sorted({c for n in names for c in summaries[n].get(key, {})},
                     key=lambda c: (not isinstance(c, int), c if isinstance(c, int) else 0, str(c)))
    rows: list[tuple[str, list[str]]] = []
    for c in classes:
        cells = [summaries[n].get(key, {}).get(c) for n in names]
        cis = [_sub(intervals.get(n), key, c) for n in names]
        rows += [(f"{c} {label}", [_cell(x, k, fmt, ci) if x is not None else "-"
                                   for x, ci in zip(cells, cis, strict=True)])
                 for label, k, fmt in CLASS_ROWS]
    return "\n".join(_grid(title, names, rows))


def plot_notes(summaries: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Why plots of a report with these summaries are not drawn (empty when all are)."""
    if not has_matplotlib():
        return [NO_MATPLOTLIB]
    return [ONE_TENANT] if len(_classes(summaries, "tenants")) <= 1 else []


def _classes(summaries: Mapping[str, Mapping[str, Any]], key: str) -> set[Any]:
    return {c for s in summaries.values() for c in s.get(key, ())}


def format_table(summaries: Mapping[str, Mapping[str, Any]], *, notes: bool = True,
                 intervals: Intervals | None = None) -> str:
    """One column per profile, one row per metric (with fairness rows when there are
    several tenants); then the breakdowns by prompt and output length (:func:`format_size_table`),
    by priority class and by tenant when there are several (:func:`format_class_table`),
    and, with ``notes``, the plots that will be skipped. With ``intervals`` (several runs
    per profile: ``summaries`` are means) a figure reads ``mean ± half-width``."""
    names = list(summaries)
    intervals = intervals or {}
    several_tenants = len(_classes(summaries, "tenants")) > 1
    drafted = any(summaries[n].get("draft_tokens") for n in names)
    rows = [(label, [_cell(summaries[n], key, fmt, intervals.get(n)) for n in names])
            for label, key, fmt in ROWS + (SPECULATION_ROWS if drafted else ())
            + (FAIRNESS_ROWS if several_tenants else ())
            if all(_has(summaries[n], key) for n in names)]
    parts = ["\n".join(_grid("", names, rows))]
    for what in ("prompt", "output"):
        if names and all(f"by_{what}_size" in summaries[n] for n in names):
            parts.append(format_size_table(summaries, what, intervals))
    if len(_classes(summaries, "by_priority")) > 1:
        parts.append(format_class_table(summaries, "by_priority", "by priority class", intervals))
    if several_tenants:
        parts.append(format_class_table(summaries, "by_tenant", "by tenant", intervals))
    if notes:
        parts += plot_notes(summaries)
    return "\n\n".join(parts)


def _has(summary: Mapping[str, Any], key: Any) -> bool:
    value: Any = summary
    for part in key if isinstance(key, tuple) else (key,):
        if not isinstance(value, Mapping) or part not in value:
            return False
        value = value[part]
    return True


def profile_colours(names: Sequence[str]) -> dict[str, str]:
    """One colour per profile name, by position in ``names`` (the palette repeats after 10).

    Every plot function takes the same map (by default built from the profiles it is
    given, in order), so a profile keeps its colour in every line and every plot.
    """
    return {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(dict.fromkeys(names))}


def _clean(obj: Any) -> Any:
    if isinstance(obj, float):
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return None if math.isnan(obj) else obj
    if isinstance(obj, Mapping):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(path: str | Path, payload: Mapping[str, Any]) -> None:
    """Deterministic JSON (sorted keys, NaN as null, infinity as the string ``"inf"``):
    same run, same bytes."""
    Path(path).write_text(json.dumps(_clean(payload), indent=1, sort_keys=True) + "\n")


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _plt() -> Any:
    if not has_matplotlib():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(ax: Any, xlabel: str, ylabel: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()


def _save(plt: Any, fig: Any, path: str | Path) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def cdf_figure(plt: Any, runs: Mapping[str, Sequence[RequestMetrics]],
               colours: Mapping[str, str] | None = None) -> Any:
    """The figure of :func:`plot_cdfs` (unsaved)."""
    colours = colours or profile_colours(list(runs))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, attr, label, of in ((axes[0], "ttft", "TTFT (s)", "fraction of all requests"),
                                (axes[1], "tpot", "TPOT (s)", "fraction of requests with 2+ tokens")):
        drawn = 0
        for name, metrics in runs.items():
            xs = sorted(v for v in (getattr(m, attr) for m in metrics) if v is not None)
            # TTFT: out of every request, so a curve stops short of 1 by the share
            # never served (rejected, refused); TPOT exists only for decoded requests.
            n = len(metrics) if attr == "ttft" else len(xs)
            if xs and xs[-1] > 0:
                ax.plot(xs, [(i + 1) / n for i in range(len(xs))], label=name, color=colours[name])
                drawn += 1
        if drawn:
            ax.set_xscale("log")
        else:
            # Every request rejected or refused (or none decoded two tokens): say so in
            # the panel rather than leave an empty frame that reads as a plotting bug.
            ax.text(0.5, 0.5, "no request served" if attr == "ttft" else "no request decoded 2+ tokens",
                    ha="center", va="center", transform=ax.transAxes)
        ax.set_ylim(0, 1.02)
        _label(ax, label, of)
    return fig


def plot_cdfs(runs: Mapping[str, Sequence[RequestMetrics]], path: str | Path,
              colours: Mapping[str, str] | None = None) -> bool:
    """TTFT and TPOT CDFs per profile, side by side. False if matplotlib is missing."""
    plt = _plt()
    if plt is None:
        return False
    return _save(plt, cdf_figure(plt, runs, colours), path)


def plot_tenant_service(runs: Mapping[str, Sequence[RequestMetrics]], path: str | Path,
                        fairness: FairnessConfig | None = None,
                        shares: Mapping[str, float] | None = None) -> bool:
    """Cumulative weighted service per tenant over time, one panel per profile (service
    as :mod:`schedkit.lab.fairness` counts it, with ``fairness`` and ``shares``).

    False, with nothing written, when matplotlib is missing or the runs have a single
    tenant (each panel would be one line: the profile's whole output).
    """
    if len({m.tenant for metrics in runs.values() for m in metrics}) <= 1:
        return False
    plt = _plt()
    if plt is None:
        return False
    cfg = fairness or FairnessConfig()
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), squeeze=False)
    for ax, (name, metrics) in zip(axes[0], runs.items(), strict=True):
        for tenant, (times, cum) in sorted(service_events(metrics, cfg, shares or {}).items()):
            ax.step(times, cum, where="post", label=tenant)
        ax.set_title(name)
        _label(ax, "time (s)", "weighted service (tokens / share)")
    return _save(plt, fig, path)


STATS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("mean", {"marker": "s", "ls": ":"}), ("p50", {"marker": "o"}),
    ("p90", {"marker": "d", "ls": "-."}), ("p99", {"marker": "x", "ls": "--"}))
"""The TTFT statistics the load plot draws, each in its own line style."""
SweepCurves = Mapping[str, Sequence[tuple[float, Mapping[str, Any]]]]
"""Per profile: ``(offered load, summary)`` at each load, in load order."""


def latency_vs_load_figure(plt: Any, sweep: SweepCurves, knob: str = "offered load (req/s)",
                           colours: Mapping[str, str] | None = None,
                           intervals: Mapping[str, Sequence[Mapping[str, Any] | None]] | None = None) -> Any:
    """The figure of :func:`plot_latency_vs_load` (unsaved): TTFT mean, p50, p90 and p99
    (one line style each, one colour per profile), SLO attainment, and throughput against
    the offered load (the diagonal: everything offered is served). With ``intervals``
    (the half-widths at each load, several runs per point) the TTFT lines get error
    bars and the others a shaded band: their 95% intervals. An infinite percentile (requests never served) is drawn as a
    triangle on the top edge of the TTFT panel, above the largest finite value."""
    from matplotlib.lines import Line2D

    colours = colours or profile_colours(list(sweep))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    stats = [(q, style) for q, style in STATS
             if all(q in s["ttft_s"] for pts in sweep.values() for _, s in pts)]
    finite = [s["ttft_s"][q] for pts in sweep.values() for _, s in pts for q, _ in stats
              if math.isfinite(s["ttft_s"][q])]
    top = 2 * max(finite, default=1.0)
    for name, points in sweep.items():
        xs = [x for x, _ in points]
        cis = list(intervals.get(name, ())) if intervals else []
        c = colours[name]
        for q, style in stats:
            ys = [s["ttft_s"][q] for _, s in points]
            axes[0].plot(xs, ys, color=c, label=f"{name} {q}", **style)
            _bars(axes[0], xs, ys, [_sub(ci, "ttft_s", q) for ci in cis], c)
            unserved = [x for x, y in zip(xs, ys, strict=True) if math.isinf(y)]
            if unserved:
                axes[0].plot(unserved, [top] * len(unserved), marker="^", ls="none", color=c,
                             label=f"{name} {q} = inf (requests never served)")
        for ax, key in ((axes[1], "slo_attainment"), (axes[2], "throughput_req_s")):
            if all(key in s for _, s in points):
                ys = [s[key] for _, s in points]
                ax.plot(xs, ys, marker="o", color=c, label=name)
                _band(ax, xs, ys, cis, c, key)
    axes[0].set_yscale("log")
    _label(axes[0], knob, "TTFT (s)")
    axes[0].legend(handles=[Line2D([], [], color="black", label=q, **style) for q, style in stats])
    _label(axes[1], knob, "SLO attainment")
    loads = [x for pts in sweep.values() for x, _ in pts if math.isfinite(x)]
    if loads:
        axes[2].plot([0, max(loads)], [0, max(loads)], color="grey", ls=":", label="served = offered")
    _label(axes[2], knob, "throughput (req/s, arrival window)")
    return fig


def _widths(ys: Sequence[float], halves: Sequence[Any]) -> list[float] | None:
    """The half-widths, when every point has a finite value and a finite half-width."""
    widths = [float(h) for h in halves if isinstance(h, (int, float)) and math.isfinite(h)]
    if len(widths) != len(ys) or not all(math.isfinite(y) for y in ys):
        return None
    return widths


def _band(ax: Any, xs: Sequence[float], ys: Sequence[float], cis: Sequence[Any], colour: str,
          key: Any) -> None:
    """Shade ``y ± half-width`` (``cis[i][key]``) where every point has a finite one."""
    widths = _widths(ys, [_sub(ci, key) for ci in cis])
    if widths is not None:
        ax.fill_between(xs, [y - h for y, h in zip(ys, widths, strict=True)],
                        [y + h for y, h in zip(ys, widths, strict=True)], color=colour, alpha=0.15, lw=0)


def _bars(ax: Any, xs: Sequence[float], ys: Sequence[float], halves: Sequence[Any], colour: str) -> None:
    """Error bars ``y ± half-width`` where every point has a finite one (on a log axis a
    bar reaching 0 or below runs off the bottom)."""
    widths = _widths(ys, halves)
    if widths is not None:
        ax.errorbar(xs, ys, yerr=widths, fmt="none", ecolor=colour, capsize=3, alpha=0.7)


def plot_latency_vs_load(sweep: SweepCurves, path: str | Path, knob: str = "offered load (req/s)",
                         colours: Mapping[str, str] | None = None,
                         intervals: Mapping[str, Sequence[Mapping[str, Any] | None]] | None = None) -> bool:
    """TTFT mean/p50/p90/p99, SLO attainment and throughput against the offered load,
    per profile (:func:`latency_vs_load_figure`). False if matplotlib is missing."""
    plt = _plt()
    if plt is None:
        return False
    return _save(plt, latency_vs_load_figure(plt, sweep, knob, colours, intervals), path)
