"""The compare report: its tables, its notes, its plots, and what it does without matplotlib."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from schedkit.cli import main
from schedkit.config import SLOConfig
from schedkit.lab import report
from schedkit.lab.metrics import (
    RequestMetrics,
    by_prompt_size,
    prompt_size_edges,
    size_bucket,
    summarize,
)

# 40 synthetic requests on the simulator, two tenants: a compare run takes well under a second.
TINY = {
    "runner": {"kind": "simulated"},
    "cache": {"num_blocks": 400, "block_size": 16},
    "scheduler": {"max_num_batched_tokens": 512, "max_num_seqs": 8, "max_model_len": 2048},
    "workload": {"kind": "poisson", "rate": 40.0, "num_requests": 40, "prompt_len": [16, 600],
                 "output_len": [4, 32], "tenants": [{"name": "a"}, {"name": "b"}],
                 "slo": {"ttft_s": 0.5}},
    "compare": {"profiles": [{"name": "fcfs", "policy": "fcfs"}, {"name": "sjf", "policy": "sjf"}]},
}


def rm(rid, prompt, ttft, e2e, tenant="t"):
    """A finished request that arrived at 0 with two output tokens."""
    return RequestMetrics(rid, 0.0, 0.0, ttft, e2e, prompt, 2, 0, 0, 0, "length", tenant, 0,
                          (ttft, e2e))


def write_config(tmp_path, cfg):
    path = tmp_path / "cmp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


# ------------------------------------------------------------------ mean TTFT, size buckets
def test_prompt_size_tertiles():
    assert prompt_size_edges([90, 10, 20, 30, 40, 50, 60, 70, 80]) == (30, 60)
    assert prompt_size_edges([1, 2, 3, 4]) == (2, 3)  # ceil(4/3) = 2, ceil(8/3) = 3
    assert prompt_size_edges([]) == (0, 0)
    assert [size_bucket(n, (30, 60)) for n in (1, 30, 31, 60, 61)] == [
        "short", "short", "medium", "medium", "long"]
    same = by_prompt_size([rm(str(i), 64, 0.1, 0.2) for i in range(5)])  # equal lengths: one bucket
    assert [same[b]["requests"] for b in ("short", "medium", "long")] == [5, 0, 0]


def test_by_prompt_size_by_hand():
    ms = [rm("a", 10, 0.1, 1.0), rm("b", 20, 0.3, 2.0), rm("c", 100, 1.0, 3.0),
          rm("d", 200, 2.0, 5.0), rm("e", 1000, 4.0, 8.0), rm("f", 2000, 6.0, 10.0)]
    s = summarize(ms, SLOConfig())
    assert s["ttft_s"]["mean"] == pytest.approx(13.4 / 6)
    short, medium, long = (s["by_prompt_size"][b] for b in ("short", "medium", "long"))
    assert (short["requests"], short["min_prompt_tokens"], short["max_prompt_tokens"]) == (2, 10, 20)
    assert short["ttft_s"]["mean"] == pytest.approx(0.2) and short["e2e_s"]["mean"] == 1.5
    assert medium["ttft_s"]["mean"] == pytest.approx(1.5) and medium["e2e_s"]["p99"] == pytest.approx(4.98)
    assert long["ttft_s"]["mean"] == 5.0 and long["max_prompt_tokens"] == 2000


def test_table_shows_mean_ttft_and_the_size_breakdown():
    fast = [rm("a", 10, 0.1, 1.0), rm("b", 100, 0.2, 1.0), rm("c", 1000, 0.3, 1.0)]
    slow = [rm("a", 10, 0.3, 1.0), rm("b", 100, 0.6, 1.0), rm("c", 1000, 2.1, 1.0)]
    table = report.format_table({"fast": summarize(fast), "slow": summarize(slow)}, notes=False)
    lines = {line.rsplit(None, 2)[0]: line.split()[-2:] for line in table.splitlines() if line.strip()}
    assert lines["TTFT mean (ms)"] == ["200.0", "1000.0"]
    assert lines["short TTFT mean (ms)"] == ["100.0", "300.0"]
    assert lines["long TTFT mean (ms)"] == ["300.0", "2100.0"]
    assert lines["medium prompt tokens"] == ["100-100", "100-100"]
    assert lines["long requests"] == ["1", "1"]
    assert "by prompt length (tertiles)" in table
    assert lines["short-output requests"] == ["3", "3"]  # every output asked is 2 tokens here


def test_size_breakdown_of_an_empty_bucket_prints_dashes():
    s = summarize([rm(str(i), 64, 0.1, 0.2) for i in range(3)])
    table = report.format_size_table({"p": s})
    assert "short requests" in table and [ln.split()[-1] for ln in table.splitlines()
                                          if ln.startswith("long ")] == ["-", "0", *["-"] * (len(report.SIZE_ROWS) - 1)]


def test_compare_results_json_has_the_size_breakdown(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["compare", write_config(tmp_path, TINY), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "TTFT mean (ms)" in printed and "long TTFT p99 (ms)" in printed
    summary = json.loads((out / "results.json").read_text())["summaries"]["fcfs"]
    assert sum(summary["by_prompt_size"][b]["requests"] for b in ("short", "medium", "long")) == 40


# ------------------------------------------------------------------------------- colours
def test_profile_colours_are_one_per_name():
    colours = report.profile_colours(["fcfs", "sjf", "fcfs", "edf"])
    assert list(colours) == ["fcfs", "sjf", "edf"] and len(set(colours.values())) == 3
    assert report.profile_colours(["fcfs", "sjf", "edf"]) == colours


def _sweep_point(p50, p99, attainment, throughput=1.0):
    return {"ttft_s": {"mean": p50 * 1.2, "p50": p50, "p90": (p50 + p99) / 2, "p99": p99},
            "slo_attainment": attainment, "throughput_req_s": throughput}


def test_latency_vs_load_draws_one_colour_per_profile():
    pytest.importorskip("matplotlib")
    plt = report._plt()
    sweep = {name: [(1.0, _sweep_point(0.1, 0.5, 1.0)), (2.0, _sweep_point(0.2, 0.9, 0.8))]
             for name in ("fcfs", "sjf", "edf")}
    colours = report.profile_colours(list(sweep))
    fig = report.latency_vs_load_figure(plt, sweep, colours=colours)
    seen: dict[str, set[str]] = {}
    stats: set[str] = set()
    for ax in fig.axes:
        for line in ax.get_lines():
            name, *what = line.get_label().split()
            if name in sweep:
                seen.setdefault(name, set()).add(line.get_color())
                stats.update(what)
    assert seen == {name: {colours[name]} for name in sweep}  # every statistic alike
    assert stats == {"mean", "p50", "p90", "p99"}
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["mean", "p50", "p90", "p99"]
    assert fig.axes[2].get_xlabel() == "offered load (req/s)" and fig.axes[2].get_lines()
    plt.close(fig)
    # With several runs per point, each line has its interval shaded.
    intervals = {name: [{"ttft_s": {"mean": 0.01, "p50": 0.01, "p90": 0.02, "p99": 0.1},
                         "slo_attainment": 0.05, "throughput_req_s": 0.1}] * 2 for name in sweep}
    fig = report.latency_vs_load_figure(plt, sweep, colours=colours, intervals=intervals)
    assert [len(ax.collections) for ax in fig.axes] == [4 * 3, 3, 3]
    plt.close(fig)
    runs = {name: [rm("a", 10, 0.1, 1.0)] for name in sweep}
    fig = report.cdf_figure(plt, runs)
    assert {ln.get_label(): ln.get_color() for ln in fig.axes[0].get_lines()} == colours
    plt.close(fig)


def test_cdf_panels_say_so_when_no_request_was_served(tmp_path):
    pytest.importorskip("matplotlib")
    plt = report._plt()
    rejected = RequestMetrics("r", 0.0, None, None, 0.0, 10, 0, 0, 0, 0, "abort",
                              stop_reason="rejected", rejected_by="admission")
    fig = report.cdf_figure(plt, {"fcfs": [rejected], "edf": [rejected]})
    for ax, text in zip(fig.axes, ("no request served", "no request decoded 2+ tokens"), strict=True):
        assert ax.get_lines() == [] and [t.get_text() for t in ax.texts] == [text]
        assert ax.get_xscale() == "linear"
    plt.close(fig)
    # One profile served: its curves drawn on log axes, no note.
    fig = report.cdf_figure(plt, {"fcfs": [rejected], "edf": [rm("a", 10, 0.1, 1.0)]})
    assert all(len(ax.get_lines()) == 1 and not ax.texts and ax.get_xscale() == "log" for ax in fig.axes)
    plt.close(fig)
    assert report.plot_cdfs({"fcfs": [rejected]}, tmp_path / "cdf.png") and (tmp_path / "cdf.png").stat().st_size


# ------------------------------------------------------------------------------- tenants
def test_single_tenant_skips_the_tenant_plot(tmp_path, monkeypatch):
    runs = {"fcfs": [rm("a", 10, 0.1, 1.0), rm("b", 20, 0.2, 1.0)], "sjf": [rm("a", 10, 0.1, 1.0)]}
    path = tmp_path / "tenant_service.png"
    assert report.plot_tenant_service(runs, path) is False and not path.exists()
    monkeypatch.setattr(report, "has_matplotlib", lambda: True)
    summaries = {n: summarize(ms) for n, ms in runs.items()}
    assert report.plot_notes(summaries) == [report.ONE_TENANT]
    assert report.format_table(summaries).endswith(report.ONE_TENANT)
    two = {"fcfs": [rm("a", 10, 0.1, 1.0, tenant="x"), rm("b", 20, 0.2, 1.0, tenant="y")]}
    assert report.plot_notes({"fcfs": summarize(two["fcfs"])}) == []


def test_two_tenants_draw_the_tenant_plot(tmp_path):
    pytest.importorskip("matplotlib")
    runs = {"fcfs": [rm("a", 10, 0.1, 1.0, tenant="x"), rm("b", 20, 0.2, 1.0, tenant="y")]}
    path = tmp_path / "tenant_service.png"
    assert report.plot_tenant_service(runs, path) and path.stat().st_size > 1000


def test_compare_single_tenant_says_the_tenant_plot_is_skipped(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    cfg = {**TINY, "workload": {k: v for k, v in TINY["workload"].items() if k != "tenants"}}
    out = tmp_path / "out"
    assert main(["compare", write_config(tmp_path, cfg), "-o", str(out)]) == 0
    assert report.ONE_TENANT in capsys.readouterr().out
    assert (out / "latency_cdf.png").is_file() and not (out / "tenant_service.png").exists()


# ---------------------------------------------------------------------- without matplotlib
def test_compare_writes_every_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    assert main(["compare", write_config(tmp_path, TINY), "-o", str(out), "--sweep", "rate=20,80"]) == 0
    for name in ("latency_cdf.png", "tenant_service.png", "latency_vs_load.png"):
        assert (out / name).stat().st_size > 1000, name


def test_report_without_matplotlib(tmp_path, capsys, monkeypatch):
    """With ``import matplotlib`` failing, the tables and results.json come out, no plot
    is written, and the report says the plots were skipped."""
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert not report.has_matplotlib() and report._plt() is None
    out = tmp_path / "out"
    assert main(["compare", write_config(tmp_path, TINY), "-o", str(out), "--sweep", "rate=20,80"]) == 0
    printed = capsys.readouterr().out
    assert "TTFT mean (ms)" in printed and "short TTFT p50 (ms)" in printed
    assert report.NO_MATPLOTLIB in printed and report.ONE_TENANT not in printed
    assert "wrote results.json to" in printed
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]
    data = json.loads((out / "results.json").read_text())
    assert set(data["summaries"]) == {"fcfs", "sjf"} and set(data["sweep"]) == {"fcfs", "sjf"}
    runs = {"fcfs": [rm("a", 10, 0.1, 1.0, tenant="x"), rm("b", 20, 0.2, 1.0, tenant="y")]}
    assert report.plot_cdfs(runs, tmp_path / "cdf.png") is False
    assert report.plot_tenant_service(runs, tmp_path / "t.png") is False
    assert report.plot_latency_vs_load({}, tmp_path / "l.png") is False
    assert not list(tmp_path.glob("*.png"))
