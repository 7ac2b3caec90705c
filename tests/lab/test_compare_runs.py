"""``schedkit compare`` over several runs per profile (seeds, repeats): means with 95%
t-intervals, runs interleaved across profiles; sweeps on the offered load; the sweep's
requests with ``--sweep-only``; progress bars."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import yaml

from schedkit.cli import main
from schedkit.config import config_from_dict
from schedkit.errors import ConfigError
from schedkit.lab import simulate
from schedkit.lab.compare import SerialRunner, compare, run_point, submit
from schedkit.lab.stats import ci_summary, mean_ci, mean_summary, t975
from schedkit.lab.workloads import WorkloadRequest

FAKE = {"runner": {"kind": "fake"},
        "workload": {"num_requests": 12, "rate": 20.0, "prompt_len": [8, 64], "output_len": [2, 12]},
        "compare": {"profiles": [{"name": "a", "policy": "fcfs"}, {"name": "b", "policy": "sjf"}]}}
# Loaded enough that the seeds differ: 40 requests on a small simulated engine.
SIM = {"runner": {"kind": "simulated"},
       "cache": {"num_blocks": 400, "block_size": 16},
       "scheduler": {"max_num_batched_tokens": 512, "max_num_seqs": 8, "max_model_len": 2048},
       "workload": {"kind": "poisson", "rate": 40.0, "num_requests": 40, "prompt_len": [16, 600],
                    "output_len": [4, 32], "slo": {"ttft_s": 0.5}},
       "compare": {"profiles": [{"name": "fcfs", "policy": "fcfs"}, {"name": "sjf", "policy": "sjf"}]}}


def write(tmp_path, cfg) -> str:
    path = tmp_path / "cmp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


# ------------------------------------------------------------------------------- statistics
def test_t_quantiles_and_the_interval_by_hand():
    assert t975(1) == 12.706 and t975(30) == 2.042
    assert t975(40) == pytest.approx(2.021, abs=1e-3) and t975(1000) == pytest.approx(1.962, abs=1e-3)
    xs = [1.0, 2.0, 4.0]
    mean, half = mean_ci(xs)
    assert mean == pytest.approx(7 / 3)
    assert half == pytest.approx(4.303 * statistics.stdev(xs) / math.sqrt(3))
    assert mean_ci([0.1, 0.1, 0.1]) == (0.1, 0.0)  # identical runs: that value, exactly
    assert mean_ci([5.0])[0] == 5.0 and math.isnan(mean_ci([5.0])[1])
    assert mean_ci([1.0, math.inf])[0] == math.inf and math.isnan(mean_ci([1.0, math.inf])[1])
    assert mean_ci([1.0, math.nan, 3.0])[0] == 2.0  # an undefined figure is left out


def test_summaries_combine_leaf_by_leaf():
    runs = [{"requests": 10, "ttft_s": {"p50": 1.0}, "by_priority": {0: {"n": 1.0}}, "name": "x"},
            {"requests": 10, "ttft_s": {"p50": 3.0}, "by_priority": {0: {"n": 3.0}, 1: {"n": 5.0}}, "name": "y"}]
    mean = mean_summary(runs)
    assert mean == {"requests": 10, "ttft_s": {"p50": 2.0}, "by_priority": {0: {"n": 2.0}, 1: {"n": 5.0}},
                    "name": "x"}
    ci = ci_summary(runs)
    assert ci["requests"] == 0.0 and ci["ttft_s"]["p50"] == pytest.approx(12.706 * 1.0)
    assert math.isnan(ci["by_priority"][1]["n"]) and "name" not in ci  # one run has class 1


# ----------------------------------------------------------------------------- seeds, repeats
def test_runs_are_interleaved_across_profiles(monkeypatch):
    import schedkit.lab.points as points

    ran = []

    def spy(config, workload, **kw):
        ran.append((config.scheduler.policy, config.workload.seed))
        return run_point(config, workload, **kw)

    monkeypatch.setattr(points, "run_point", spy)
    result = submit(config_from_dict(FAKE), seeds=[3, 4], repeats=2, runner=SerialRunner()).compared()
    assert ran == [("fcfs", 3), ("sjf", 3)] * 2 + [("fcfs", 4), ("sjf", 4)] * 2  # A B A B
    assert [(s.seed, s.repeat) for s in result.samples["a"]] == [(3, 0), (3, 1), (4, 0), (4, 1)]
    assert result.num_runs == 4 and len(result.metrics["a"]) == 4 * 12


def test_several_seeds_give_means_and_intervals():
    cfg = config_from_dict({**SIM, "compare": {**SIM["compare"], "seeds": [1, 2, 3]}})
    result = compare(cfg)
    for name in ("fcfs", "sjf"):
        p50s = [s.result.summary["ttft_s"]["p50"] for s in result.samples[name]]
        assert len(set(p50s)) == 3  # the seeds' workloads differ
        assert result.summaries[name]["ttft_s"]["p50"] == pytest.approx(statistics.mean(p50s))
        assert result.ci95[name]["ttft_s"]["p50"] == pytest.approx(4.303 * statistics.stdev(p50s) / math.sqrt(3))
    single = compare(config_from_dict({**SIM, "workload": {**SIM["workload"], "seed": 2}}))
    assert result.samples["sjf"][1].result.summary == single.summaries["sjf"]  # seed 2's run
    assert not single.ci95 and single.num_runs == 1


def test_compare_cli_with_seeds_and_repeats(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["compare", write(tmp_path, SIM), "-o", str(out), "--seeds", "5,6", "--repeats", "2"]) == 0
    printed, err = capsys.readouterr()
    assert "over 4 runs per profile (seeds 5, 6; 2 repeats each)" in printed
    assert " ± " in printed and "TTFT p90 (ms)" in printed
    assert "virtual clock" in err  # repeats of a simulation are identical, and it says so
    data = json.loads((out / "results.json").read_text())
    assert data["seeds"] == [5, 6] and data["repeats"] == 2
    assert [(r["seed"], r["repeat"]) for r in data["samples"]["fcfs"]] == [(5, 0), (5, 1), (6, 0), (6, 1)]
    runs = data["samples"]["fcfs"]
    assert runs[0]["summary"] == runs[1]["summary"]  # the repeats of one seed
    assert data["ci95"]["fcfs"]["ttft_s"]["p50"] >= 0
    assert len(data["requests"]["fcfs"]) == 4 * 40
    assert {(r["seed"], r["repeat"]) for r in data["requests"]["fcfs"]} == {(5, 0), (5, 1), (6, 0), (6, 1)}


def test_bad_seeds_and_repeats_are_refused(tmp_path, capsys):
    path = write(tmp_path, SIM)
    assert main(["compare", path, "-o", str(tmp_path / "o"), "--seeds", "1,x"]) == 2
    assert "--seeds '1,x'" in capsys.readouterr().err
    assert main(["compare", path, "-o", str(tmp_path / "o"), "--seeds", "1,1"]) == 2
    assert "listed twice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["compare", path, "--repeats", "0"])
    assert e.value.code == 2 and "must be 1 or more" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"compare\.seeds\.1.*listed twice"):
        config_from_dict({**SIM, "compare": {**SIM["compare"], "seeds": [1, 1]}})
    with pytest.raises(ConfigError, match="repeats"):
        config_from_dict({**SIM, "compare": {**SIM["compare"], "repeats": 0}})
    assert not (tmp_path / "o" / "results.json").exists()


# ------------------------------------------------------------------------------------- sweeps
TRACE = {**SIM, "workload": {"kind": "trace", "num_requests": 60, "slo": {"ttft_s": 0.5},
                             "trace": {"format": "azure", "path": "data/azure/AzureLLMInferenceTrace_conv.csv"}}}


def test_a_time_scale_sweep_reports_the_offered_load_in_requests_per_second():
    cfg = config_from_dict(TRACE)
    result = submit(cfg, single=False, knob="time_scale", values=[0.05, 0.2]).swept()
    points = result.sweep["fcfs"]
    assert [p.knob for p in points] == [0.2, 0.05]  # in load order: a smaller scale is more load
    assert points[1].load == pytest.approx(4 * points[0].load)
    for p in points:
        s = p.summary
        assert p.load == s["offered_load_req_s"] == pytest.approx(59 / s["arrival_window_s"])
    assert result.sustained["fcfs"] in (None, *(p.load for p in points))


def test_sweep_only_keeps_the_requests(tmp_path):
    path = write(tmp_path, SIM)
    for extra, has_requests in (([], False), (["--sweep-only"], True)):
        out = tmp_path / f"out{len(extra)}"
        assert main(["compare", path, "-o", str(out), "--sweep", "rate=20,80", *extra]) == 0
        data = json.loads((out / "results.json").read_text())
        for p in data["sweep"]["fcfs"]:
            assert p["rate"] in (20, 80) and p["load"] > 0
            assert ("requests" in p) is has_requests
            if has_requests:
                assert len(p["requests"]) == 40 and {"ttft", "e2e", "arrival_time"} <= set(p["requests"][0])
        assert bool(data["requests"]) is not has_requests


# ----------------------------------------------------------------------------------- progress
def test_a_run_shows_its_progress_on_stderr(monkeypatch, capsys):
    monkeypatch.setattr(simulate, "PROGRESS_DELAY_S", 0.0)
    monkeypatch.setattr(simulate, "PROGRESS_INTERVAL_S", 0.0)
    cfg = config_from_dict({"runner": {"kind": "fake"}})
    work = [WorkloadRequest(f"r{i}", 0.01 * i, [1, 2, 3], 2) for i in range(6)]
    simulate.run_workload(cfg, work, progress="fcfs seed 1")
    out, err = capsys.readouterr()
    assert out == "" and "fcfs seed 1" in err and "6/6" in err


def test_compare_shows_progress_only_on_a_terminal(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setattr(simulate, "PROGRESS_DELAY_S", 0.0)
    path = write(tmp_path, FAKE)
    assert main(["compare", path, "-o", str(tmp_path / "a")]) == 0
    assert "[1/2] a" not in capsys.readouterr().err  # not a terminal
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["compare", path, "-o", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert "[1/2] a" in err and "[2/2] b" in err
    assert main(["compare", path, "-o", str(tmp_path / "c"), "--no-progress"]) == 0
    assert "[1/2] a" not in capsys.readouterr().err
    a, b = ((tmp_path / d / "results.json").read_bytes() for d in "ab")
    assert a == b  # a progress bar changes nothing else


def test_a_plugin_in_the_config_and_a_profile_runs_once_with_the_profiles_settings(tmp_path):
    from schedkit.config import load_config
    from schedkit.lab.compare import profile_config, profiles_of
    from schedkit.plugins.manager import get_plugin_manager

    path = tmp_path / "c.yaml"
    path.write_text("runner: {kind: fake, draft_acceptance: 0.5}\n"
                    "scheduler: {num_speculative_tokens: 4}\n"
                    "plugins: [{name: speculate-by-batch, settings: {max_batch: 2}}]\n"
                    "compare:\n  profiles:\n    - {name: base}\n"
                    "    - {name: wide, plugins: [{name: speculate-by-batch, settings: {max_batch: 8}}]}\n")
    config = load_config(path)
    base, wide = (profile_config(config, p) for p in profiles_of(config))
    assert [(p.name, p.settings) for p in base.plugins] == [("speculate-by-batch", {"max_batch": 2})]
    assert [(p.name, p.settings) for p in wide.plugins] == [("speculate-by-batch", {"max_batch": 8})]
    plugin = get_plugin_manager(wide).get_plugin("speculate-by-batch")
    assert plugin.max_batch == 8


def test_seeds_on_the_command_line_are_whole_and_distinct(capsys):
    from schedkit.lab.compare import parse_seeds

    assert parse_seeds("0,1,2") == [0, 1, 2]
    for spec, needle in (("0,x", "whole numbers"), ("3,1,3", "seed 3 is listed twice")):
        with pytest.raises(ConfigError, match=needle):
            parse_seeds(spec)
    with pytest.raises(SystemExit):
        main(["compare", "configs/quickstart.yaml", "--repeats", "-1"])
    assert "must be 1 or more, got -1" in capsys.readouterr().err
