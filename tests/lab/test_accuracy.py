"""The accuracy grid's method: loads as fractions of capacity, errors against the real
runs' spread, rankings, and the grid file's checks."""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path

import pytest

from schedkit.errors import ConfigError
from schedkit.lab.accuracy import (
    Experiment,
    at_rate,
    compare_runs,
    experiment_requests,
    kendall_tau,
    load_grid,
    noise_floor,
    offered_rate,
    overall,
    rankings,
    relative_error,
    run_grid,
    run_metrics,
)
from schedkit.lab.cost_fit import read_steps
from schedkit.lab.metrics import RequestMetrics
from schedkit.lab.workloads import WorkloadRequest

BASE = """
runner: {kind: simulated, profile: cpu-tiny-llama, vocab_size: 1000}
cache: {block_size: 16, num_blocks: 1024, enable_prefix_caching: true}
scheduler: {policy: fcfs, max_num_batched_tokens: 256, max_num_seqs: 8, max_model_len: 1024}
"""

GRID = """
base: base.yaml
profile: {profile}
repeats: 2
workloads:
  small:
    kind: poisson
    num_requests: 12
    prompt_len: [16, 200]
    output_len: [4, 24]
    tenants: [{{name: a}}, {{name: b}}]
policies:
  fcfs: {{policy: fcfs}}
  sjf: {{policy: sjf}}
  vtc: {{policy: vtc}}
loads: {{light: 0.3, overload: 2.0}}
shapes:
  wide: {{max_num_batched_tokens: 256, max_num_seqs: 8}}
  narrow: {{max_num_batched_tokens: 64, max_num_seqs: 2}}
full:
  - {{shapes: [wide]}}
  - {{shapes: [narrow], loads: [overload]}}
reduced:
  - {{loads: [overload], shapes: [wide], policies: [fcfs, sjf]}}
"""


def write_grid(tmp_path: Path, profile: str = "cpu-tiny-llama", grid: str = GRID) -> Path:
    (tmp_path / "base.yaml").write_text(BASE)
    path = tmp_path / "grid.yaml"
    path.write_text(grid.format(profile=profile))
    return path


def req(i: int, t: float) -> WorkloadRequest:
    return WorkloadRequest(f"r{i}", t, [1, 2, 3], 4)


def test_the_full_grid_is_the_union_of_its_parts_and_the_reduced_grid_a_subset(tmp_path):
    grid = load_grid(write_grid(tmp_path))
    full = grid.experiments()
    assert len(full) == len(set(full)) == 2 * 3 + 3  # wide: 2 loads x 3 policies; narrow: overload x 3
    assert Experiment("small", "fcfs", "light", "narrow") not in full
    assert grid.experiments(reduced=True) == [Experiment("small", "fcfs", "overload", "wide"),
                                              Experiment("small", "sjf", "overload", "wide")]


def test_scaling_a_workload_to_a_rate_keeps_its_requests_and_gaps():
    w = [req(0, 5.0), req(1, 6.0), req(2, 8.0), req(3, 11.0)]
    assert offered_rate(w) == pytest.approx(0.5)
    scaled = at_rate(w, 2.0)
    assert offered_rate(scaled) == pytest.approx(2.0)
    assert [r.arrival_time for r in scaled] == pytest.approx([0.0, 0.25, 0.75, 1.5])
    assert [r.request_id for r in scaled] == ["r0", "r1", "r2", "r3"]
    with pytest.raises(ConfigError, match="all arrive at once"):
        at_rate([req(0, 1.0), req(1, 1.0)], 2.0)


def metric(i: int, arrival: float, tokens: tuple[float, ...], preemptions: int = 0) -> RequestMetrics:
    return RequestMetrics(f"r{i}", arrival, arrival, tokens[0], tokens[-1], 8, len(tokens), 0, preemptions, 0,
                          "length", token_times=tokens)


def test_throughput_counts_only_the_tokens_of_the_arrival_window():
    ms = [metric(0, 0.0, (0.5, 1.0, 1.5)), metric(1, 2.0, (2.5, 3.0, 9.0))]
    m = run_metrics(ms)
    assert m["throughput_tok_s"] == pytest.approx(3 / 2.0)  # 1.0 and 1.5; the drain (2.5...) not
    assert m["ttft_p50_s"] == pytest.approx(0.5)
    assert m["e2e_mean_s"] == pytest.approx((1.5 + 7.0) / 2)
    assert m["preemptions"] == 0


def test_an_error_is_read_against_the_real_runs_spread():
    real = [dict.fromkeys(("e2e_mean_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "throughput_tok_s",
                           "preemptions"), v) for v in (0.9, 1.1)]
    sim = dict.fromkeys(real[0], 1.2)
    c = compare_runs(real, sim)["e2e_mean_s"]
    assert c["real"] == pytest.approx(1.0)
    assert c["spread"] == pytest.approx(0.2)
    assert c["error"] == pytest.approx(0.2)
    assert c["noise_floor"] == pytest.approx(0.1)  # two runs: half their relative range


@pytest.mark.parametrize("n", [2, 3, 5])
def test_the_noise_floor_is_the_error_of_a_simulator_exact_to_the_expected_value(n):
    """Runs scattered around 10: a simulator that predicts exactly 10 misses the mean of
    ``n`` runs by the floor's estimate on average (without the bias correction of the
    runs' standard deviation, two runs would read 20% low)."""
    rng = random.Random(n)
    floors, errors = [], []
    for _ in range(20000):
        runs = [rng.gauss(10.0, 1.0) for _ in range(n)]
        floors.append(noise_floor(runs))
        errors.append(relative_error(10.0, statistics.fmean(runs)))
    assert statistics.fmean(floors) == pytest.approx(statistics.fmean(errors), rel=0.03)


def test_the_noise_floor_needs_two_runs():
    assert math.isnan(noise_floor([1.0]))
    assert noise_floor([2.0, 2.0]) == 0.0
    assert noise_floor([-1.0, 1.0]) == math.inf
    assert math.isnan(noise_floor([1.0, math.inf]))  # a percentile of requests never served
    assert math.isnan(noise_floor([math.nan, math.nan]))


def test_kendall_tau():
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    assert math.isnan(kendall_tau([1, 1], [2, 3]))
    with pytest.raises(ValueError):
        kendall_tau([1, 2], [1])


def test_a_simulator_equal_to_the_real_side_has_no_error_and_ranks_alike(tmp_path):
    """The 'real' side here is the simulator with the same profile: every error must be
    exactly zero, every ranking identical."""
    grid = load_grid(write_grid(tmp_path))
    saves, steps = [], {}
    results = run_grid(grid, grid.experiments(), save=lambda r: saves.append(len(r)),
                       save_steps=lambda key, rep, records: steps.setdefault((key, rep), records))
    assert len(results) == 9 and len(saves) == 9 * 2
    assert set(steps) == {(key, rep) for key in results for rep in (0, 1)}
    assert all(records for records in steps.values())
    for r in results.values():
        assert len(r["real_runs"]) == 2
        for name, c in r["compare"].items():
            assert c["error"] == 0 and c["spread"] == 0, name
        # The profile predicts the 'real' steps exactly: the speed ratio is 1 and the
        # simulator at the runs' own speed is the simulator.
        assert r["real_speed_ratio"] == [pytest.approx(1.0), pytest.approx(1.0)]
        assert r["real_speed_ratio_decode"] == [pytest.approx(1.0)] * 2
        assert r["real_speed_ratio_prefill"] == [pytest.approx(1.0)] * 2
        assert r["sim_at_run_speed"] == pytest.approx(r["sim"])
        assert r["sim_at_kind_speed"] == pytest.approx(r["sim"])
        # So does the speed probe's: re-anchoring changes nothing.
        assert r["real_probe_ratio"] == [pytest.approx(1.0), pytest.approx(1.0)]
        assert r["sim_anchored"] == pytest.approx(r["sim"])
    o = overall(results)
    assert o["mape"]["e2e_mean_s"] == 0 and o["outside_bound"] == []
    assert o["noise_floor"]["e2e_mean_s"] == 0  # the two 'real' runs agree exactly
    assert o["mape_at_run_speed"]["e2e_mean_s"] == pytest.approx(0, abs=1e-9)
    assert o["mape_anchored"]["e2e_mean_s"] == pytest.approx(0, abs=1e-9) and o["outside_bound_anchored"] == []
    assert o["kendall_tau_mean_anchored"] == o["kendall_tau_mean"]
    assert o["speed_ratio"]["min"] == pytest.approx(1.0) == o["speed_ratio"]["max"]
    cells = rankings(results)
    assert set(cells) == {"small/light/wide", "small/overload/wide", "small/overload/narrow"}
    assert all(c["real"] == c["sim"] for c in cells.values())
    # The loads differ by their fraction of capacity.
    assert results["small/overload/wide/fcfs"]["offered_req_s"] == pytest.approx(
        results["small/light/wide/fcfs"]["offered_req_s"] * 2.0 / 0.3)


def test_a_different_cost_model_shows_as_error(tmp_path):
    grid = load_grid(write_grid(tmp_path, profile="h200-qwen2.5-0.5b-handset"))
    results = run_grid(grid, grid.experiments(reduced=True))
    o = overall(results)
    assert o["mape"]["e2e_mean_s"] > 0.5  # an H200 is far faster than the CPU profile
    # The 'real' (CPU-profile) steps take many times what the H200 profile predicts;
    # scaled by that ratio, the H200 model comes far closer (its shape still differs).
    assert o["speed_ratio"]["min"] > 5
    # Decodes and prefills are slower by different factors: one ratio cannot hold both.
    assert o["speed_ratio_decode"]["min"] > 3 and o["speed_ratio_prefill"]["min"] > 3
    assert abs(o["speed_ratio_decode"]["mean"] / o["speed_ratio_prefill"]["mean"] - 1) > 0.1
    assert o["mape_at_run_speed"]["e2e_mean_s"] < o["mape"]["e2e_mean_s"] / 2
    # Scaled by each kind's own ratio, the prompt-chunk steps (TTFT) come closer still.
    assert o["mape_at_kind_speed"]["ttft_p50_s"] < o["mape_at_run_speed"]["ttft_p50_s"]
    # The speed probe sees the same slowdown without looking at the experiments' own
    # steps, and re-anchored by it the H200 model comes far closer too.
    assert o["probe_ratio"]["min"] > 5
    assert o["mape_anchored"]["e2e_mean_s"] < o["mape"]["e2e_mean_s"] / 2


def test_the_probe_reanchors_decodes_and_prefills_each_by_its_own_ratio(tmp_path):
    # A profile that predicts decode-only steps twice and prompt chunks four times as
    # fast as the 'real' runner (the simulator on cpu-tiny-llama) runs them, and whose
    # probe read 1.00x of each kind during its fit: the probe reads the two kinds apart,
    # and re-anchored by both the profile is the real runner's own.
    from schedkit.lab.profiles import minimal_payload, write_profile
    from schedkit.runners.cost_model import CostModel

    truth = CostModel.load("cpu-tiny-llama")
    fast = tmp_path / "fast.json"
    write_profile(fast, {**minimal_payload("fast", truth.scaled(0.5, 0.25), "test"),
                         "speed_probe": {"ratio": 1.0, "decode": 1.0, "prefill": 1.0}})
    model = CostModel.load(str(fast))
    assert (model.probe_ratio_decode, model.probe_ratio_prefill, model.prefill_scale) == (1.0, 1.0, 0.5)
    grid = load_grid(write_grid(tmp_path, profile=str(fast)))
    results = run_grid(grid, grid.experiments(reduced=True))
    for r in results.values():
        assert r["real_probe_ratio_decode"] == [pytest.approx(2.0)] * 2
        assert r["real_probe_ratio_prefill"] == [pytest.approx(4.0)] * 2
        assert r["real_speed_ratio_decode"] == [pytest.approx(2.0)] * 2
        assert r["sim_anchored"] == pytest.approx(r["sim_at_kind_speed"])
        assert all(c["error"] == pytest.approx(0, abs=1e-9) for c in r["compare_anchored"].values())
        assert r["compare"]["ttft_p50_s"]["error"] > 0.3
        # One ratio over both kinds of step cannot hold both.
        assert r["compare_at_run_speed"]["ttft_p50_s"]["error"] > 0.01
    o = overall(results)
    assert o["probe_ratio_prefill"]["min"] == pytest.approx(4.0)
    # Results resumed from a run whose probe read one ratio: that ratio, not a mix.
    older = {k: {**v, "real_probe_ratio_decode": [], "real_probe_ratio_prefill": []} for k, v in results.items()}
    again = run_grid(grid, grid.experiments(reduced=True), done=older)
    for k, r in again.items():
        assert r["real_probe_ratio_decode"] == [] and r["sim_anchored"] != pytest.approx(results[k]["sim_anchored"])


def test_each_run_is_simulated_at_its_own_speed(tmp_path):
    """Two 'real' runs whose decode-only steps take 0.7x and then 1.5x the profile's
    prediction and whose prompt chunks take 1.5x and then 0.7x, each read so by its steps
    and by the probe: simulated once per run at that run's ratios, the simulator matches
    the mean of the two exactly; simulated once at their mean ratios it would not, a
    queue's delay not being linear in the speed."""
    from schedkit.lab.accuracy import _simulate_scaled
    from schedkit.runners.cost_model import CostModel

    grid = load_grid(write_grid(tmp_path))
    exps = grid.experiments()
    model = CostModel.load(grid.profile)
    requests = experiment_requests(grid, exps)
    decode, prefill = [0.7, 1.5], [1.5, 0.7]

    def simulate(e, d, p):
        return _simulate_scaled(grid, e, requests[e.key], model, d, p)

    ratios = {f"real_{kind}_ratio{part}": values for kind in ("speed", "probe")
              for part, values in (("", [1.1, 1.1]), ("_decode", decode), ("_prefill", prefill))}
    done = {e.key: {"real_runs": [simulate(e, d, p) for d, p in zip(decode, prefill, strict=True)],
                    "real_wall_s": [1.0, 1.0], "real_steal": [None] * 2, **ratios} for e in exps}
    results = run_grid(grid, exps, done=done)
    for r in results.values():
        for name in ("anchored", "at_kind_speed"):
            assert all(c["error"] == pytest.approx(0, abs=1e-9) for c in r[f"compare_{name}"].values()), name
    at_mean = [relative_error(simulate(e, 1.1, 1.1)["ttft_p50_s"], results[e.key]["compare"]["ttft_p50_s"]["real"])
               for e in exps]
    assert max(at_mean) > 0.05
    # A run that read no ratio of a kind: that column is left out, not kept from before.
    gap = {k: {**v, "real_probe_ratio_decode": [0.7, math.nan], "real_speed_ratio": [1.1, math.nan]}
           for k, v in results.items()}
    again = run_grid(grid, exps, done=gap)
    for k, r in again.items():
        assert r["sim_anchored"] != pytest.approx(results[k]["sim_anchored"])  # the overall probe ratio, per run
        assert "sim_at_run_speed" not in r and "compare_at_run_speed" not in r
        assert r["compare_at_kind_speed"] == results[k]["compare_at_kind_speed"]


def test_resuming_keeps_the_finished_real_runs(tmp_path):
    grid = load_grid(write_grid(tmp_path))
    exps = grid.experiments(reduced=True)
    first = run_grid(grid, exps)
    marked = {k: {**v, "real_runs": [{**v["real_runs"][0], "e2e_mean_s": 123.0}, v["real_runs"][1]]}
              for k, v in first.items()}
    again = run_grid(grid, exps, done=marked)
    assert all(r["real_runs"][0]["e2e_mean_s"] == 123.0 for r in again.values())


@pytest.mark.parametrize("edit, message", [
    (lambda g: g.replace("policies: [fcfs, sjf]", "policies: [fcfs, lifo]"), "reduced\\[0\\].policies names 'lifo'"),
    (lambda g: g.replace("light: 0.3", "light: -1"), "load 'light' must be a positive, finite fraction"),
    (lambda g: g.replace("light: 0.3", "light: .inf"), "load 'light' must be a positive, finite fraction"),
    (lambda g: g.replace("narrow: {{max_num_batched_tokens: 64, max_num_seqs: 2}}",
                         "narrow: {{max_num_batched_tokens: 64, max_num_seq: 2}}"),
     "shape 'narrow': 'max_num_seq' is not a scheduler key \\(did you mean 'max_num_seqs'\\?\\)"),
    (lambda g: g.replace("narrow: {{max_num_batched_tokens: 64, max_num_seqs: 2}}",
                         "narrow: {{max_num_batched_tokens: 1, max_num_seqs: 2}}"), "shape 'narrow'"),
    (lambda g: g.replace("profile: {profile}", "profile: {profile}\nspeed: 3"), "speed"),
])
def test_a_bad_grid_file_is_a_config_error_naming_what_is_wrong(tmp_path, edit, message):
    with pytest.raises(ConfigError, match=message):
        load_grid(write_grid(tmp_path, grid=edit(GRID)))


def test_a_missing_grid_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the grid file"):
        load_grid(tmp_path / "nope.yaml")


def load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("accuracy_grid", Path(__file__).parents[2] / "scripts" / "accuracy_grid.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_a_finished_grid_takes_more_passes_keeping_its_runs(tmp_path, monkeypatch, capsys):
    """``--resume --repeats 3`` adds a third real run to every experiment of a finished
    two-run grid and keeps the first two (planted values here: a pass run again would
    overwrite them) and the first run's commit and date; fewer repeats than stored
    and another profile are refused."""
    import json
    import sys

    script, grid_path, out = load_script(), write_grid(tmp_path), tmp_path / "out.json"

    def run(*args: str) -> None:
        monkeypatch.setattr(sys, "argv", ["accuracy_grid.py", str(grid_path), "--reduced", "--no-probe",
                                          "-o", str(out), *args])
        script.main()

    run()
    first = json.loads(out.read_text())
    assert first["repeats"] == 2 and len(first["profile_sha256"]) == 64
    first.update(date="2026-01-01", commit="abc1234")
    for r in first["results"].values():
        for i, runs in enumerate(r["real_runs"]):
            runs["e2e_mean_s"] = 1000.0 + i
    out.write_text(json.dumps(first))
    run("--resume", "--repeats", "3")
    after = json.loads(out.read_text())
    assert after["repeats"] == 3 and after["date"].startswith("2026-01-01 to ")
    assert after["commit"].startswith("abc1234 to ")
    assert set(after["results"]) == set(first["results"])
    for key, r in after["results"].items():
        assert len(r["real_runs"]) == 3 and r["real_runs"][:2] == first["results"][key]["real_runs"]
        assert r["real_runs"][2]["e2e_mean_s"] < 1000
    for args, message in ((["--repeats", "0"], "at least 1"), (["--resume", "--repeats", "2"], "at least the 3"),
                          (["--resume", "--profile", "cpu-smollm2-135m"], "another profile")):
        with pytest.raises(SystemExit) as e:
            run(*args)
        assert e.value.code == 2 and message in capsys.readouterr().err
    run("--resume")  # nothing left to run: the stored runs and their count stay
    assert json.loads(out.read_text())["repeats"] == 3


def test_the_script_renders_a_run_and_writes_it_between_the_page_markers(tmp_path):
    script = load_script()
    grid = load_grid(write_grid(tmp_path))
    results = run_grid(grid, grid.experiments(reduced=True), save_steps=script._steps_writer(tmp_path / "steps"))
    saved = sorted(p.name for p in (tmp_path / "steps").iterdir())
    assert saved == sorted(f"{key.replace('/', '_')}-{rep}.jsonl" for key in results for rep in (0, 1))
    assert read_steps(tmp_path / "steps" / saved[0])  # each run's steps, readable again
    data = {"grid": "grid.yaml", "reduced": True, "profile": grid.profile, "repeats": 2, "commit": "abc",
            "date": "2026-01-01", "machine": "test", "wall_s": 60.0, "results": results, "overall": overall(results)}
    text = script.render(data)
    assert "| e2e_mean_s | 0.0% |" in text and "small/overload/wide/sjf" in text
    assert "at each step kind's own speed" in text
    assert "decode-only steps 1.00-1.00x, mean 1.00x; steps with a prompt chunk 1.00-1.00x" in text
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- accuracy_grid:reduced -->\nold\n<!-- /accuracy_grid:reduced -->\nend\n")
    script.write_doc(text, page)
    assert page.read_text() == f"intro\n<!-- accuracy_grid:reduced -->\n{text}<!-- /accuracy_grid:reduced -->\nend\n"


def test_the_script_refuses_bad_input_before_running_anything(tmp_path, monkeypatch, capsys):
    """Exit status 2 and one line naming the problem, never a traceback; a grid whose
    files changed is not resumed into the old one's results."""
    import json
    import sys

    script, grid_path, out = load_script(), write_grid(tmp_path), tmp_path / "out.json"

    def run(*args: str) -> str:
        monkeypatch.setattr(sys, "argv", ["accuracy_grid.py", *args])
        with pytest.raises(SystemExit) as e:
            script.main()
        assert e.value.code == 2
        return capsys.readouterr().err

    garbage = tmp_path / "garbage.json"
    for text in ("{not json", "[1, 2]", "{}", '{"results": {"x": 3}}'):
        garbage.write_text(text)
        assert "--render" in run("--render", str(garbage))
    assert "cannot read it" in run("--render", str(tmp_path / "missing.json"))
    assert "cannot write there" in run(str(grid_path), "--reduced", "-o", str(tmp_path / "no" / "x.json"))
    bad = tmp_path / "bad-profile.json"
    coefficients = {k: 1e-3 for k in ("base_s", "per_token_s", "per_request_s", "per_context_token_s",
                                       "per_prefill_attention_s")}
    bad.write_text(json.dumps({"coefficients": {**coefficients, "base_s": float("nan")}}))
    assert "coefficients.base_s must be a number of seconds" in run(str(grid_path), "--reduced", "--profile", str(bad), "-o", str(out))
    assert not out.exists()
    monkeypatch.setattr(sys, "argv", ["accuracy_grid.py", str(grid_path), "--reduced", "--no-probe", "-o", str(out)])
    script.main()
    capsys.readouterr()
    grid_path.write_text(grid_path.read_text().replace("num_requests: 12", "num_requests: 14"))
    assert "another grid" in run(str(grid_path), "--reduced", "--no-probe", "--resume", "-o", str(out))
