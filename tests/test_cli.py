"""The console script on real files (in-process main())."""

from __future__ import annotations

import json
import re

import pytest

from schedkit import cli
from schedkit.cli import main


def test_run_quickstart_writes_results(tmp_path, capsys):
    cfg = tmp_path / "q.yaml"
    cfg.write_text("workload: {num_requests: 20, rate: 50, prompt_len: [8, 64], output_len: [4, 16]}\n"
                   "cache: {num_blocks: 128}\n")
    out = tmp_path / "res.json"
    assert main(["run", str(cfg), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "TTFT mean / p50 / p90 / p99" in text and "requests" in text
    data = json.loads(out.read_text())
    assert data["summary"]["requests"] == 20
    assert all(r["finish_reason"] == "length" for r in data["requests"])
    assert sum(r["num_output_tokens"] for r in data["requests"]) == data["summary"]["output_tokens"]


def test_check_rejects_unknown_policy_and_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduler: {policy: no-such-policy}\n")
    assert main(["check", str(bad)]) == 2
    assert "no-such-policy" in capsys.readouterr().err
    bad.write_text("schedulr: {}\n")
    assert main(["check", str(bad)]) == 2
    assert "unknown key 'schedulr'" in capsys.readouterr().err


def test_plugins_lists_builtins(capsys):
    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert "fcfs" in text and "schedkit_select_preemption_victim" in text


def test_disabled_policy_is_refused_by_check_and_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SCHEDKIT_DISABLE_PLUGINS", "sjf")
    cfg = tmp_path / "sjf.yaml"
    cfg.write_text("workload: {num_requests: 4}\nscheduler:\n  policy: sjf\n")
    for command in ("check", "run"):
        assert main([command, str(cfg)]) == 2
        out, err = capsys.readouterr()
        assert f"{cfg}:3: scheduler.policy = 'sjf' is disabled by SCHEDKIT_DISABLE_PLUGINS=sjf" in err
        assert "ok" not in out and "policy" not in out  # nothing ran, no summary printed


COMPARE_WITH_A_MISSING_POLICY = """\
workload: {num_requests: 8, rate: 50, prompt_len: [8, 32], output_len: [2, 8]}
cache: {num_blocks: 128}
compare:
  profiles:
    - name: first
      policy: fcfs
    - name: second
      policy: no-such-policy
"""


def test_check_validates_every_compare_profile(tmp_path, capsys):
    cfg = tmp_path / "cmp.yaml"
    cfg.write_text(COMPARE_WITH_A_MISSING_POLICY)
    assert main(["check", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"{cfg}:8: plugin 'no-such-policy' is not installed" in err
    assert "(compare profile 'second')" in err


def test_compare_fails_before_running_any_profile(tmp_path, capsys, monkeypatch):
    import schedkit.lab.points as points
    from schedkit.lab.simulate import RunResult

    ran = []

    def run_workload(cfg, *args, **kwargs):
        ran.append(cfg.scheduler.policy)
        return RunResult([])

    monkeypatch.setattr(points, "run_workload", run_workload)
    cfg = tmp_path / "cmp.yaml"
    cfg.write_text(COMPARE_WITH_A_MISSING_POLICY)
    for extra in ([], ["--sweep", "rate=10,20", "--sweep-only"]):
        assert main(["compare", str(cfg), "-o", str(tmp_path / "out"), *extra]) == 2
        assert "'no-such-policy' is not installed" in capsys.readouterr().err
    assert ran == []
    assert not (tmp_path / "out" / "results.json").exists()


def test_help_names_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    description = text.split("\n\n")[1]  # after the usage line, before the argument list
    for command in ("run", "compare", "calibrate", "check", "plugins"):
        assert command in description, description
    assert "compare" in (cli.__doc__ or "")


def test_run_output_has_queueing_delay_like_compare(tmp_path):
    cfg = tmp_path / "q.yaml"
    cfg.write_text("workload: {num_requests: 20, rate: 200, prompt_len: [8, 64], output_len: [4, 16]}\n"
                   "cache: {num_blocks: 128}\nscheduler: {max_num_seqs: 4, max_num_batched_tokens: 64}\n")
    out = tmp_path / "res.json"
    assert main(["run", str(cfg), "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    for r in data["requests"]:
        assert r["first_scheduled_time"] is not None and r["queueing_delay"] is not None, r
        assert r["arrival_time"] <= r["first_scheduled_time"] <= r["first_token_time"]
        assert abs(r["queueing_delay"] - (r["first_scheduled_time"] - r["arrival_time"])) < 1e-9
    assert max(r["queueing_delay"] for r in data["requests"]) > 0  # 4 seats for 20 requests
    assert data["summary"]["max_wait_s"] == max(r["queueing_delay"] for r in data["requests"])


def test_check_builds_the_scheduler_so_build_hook_answers_are_checked(tmp_path, capsys, install_plugin):
    """A create_waiting_queue answer that is no queue fails `check` already, not only
    the engine's start: `check` builds the scheduler."""
    install_plugin("badqueue_plugin", "from schedkit import hookimpl\n\n"
                   "class BadQueue:\n"
                   "    @hookimpl\n"
                   "    def schedkit_create_waiting_queue(self):\n"
                   "        return 5\n", {"badqueue": "badqueue_plugin:BadQueue"})
    cfg = tmp_path / "c.yaml"
    cfg.write_text("plugins: [{name: badqueue}]\n")
    assert main(["check", str(cfg)]) != 0
    err = capsys.readouterr().err
    assert "'badqueue'" in err and "schedkit_create_waiting_queue" in err and "not a waiting queue" in err, err


def test_run_refuses_an_unwritable_output_before_running(tmp_path, capsys):
    cfg = tmp_path / "q.yaml"
    cfg.write_text("workload: {num_requests: 2}\n")
    assert main(["run", str(cfg), "-o", str(tmp_path / "no" / "such" / "x.json")]) != 0
    out, err = capsys.readouterr()
    assert "--output" in err and "per-request" not in out


def test_compare_refuses_an_unusable_output_dir_before_running(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("workload: {num_requests: 4}\ncompare:\n  profiles:\n    - {name: a, policy: fcfs}\n")
    assert main(["compare", str(cfg), "-o", str(afile)]) != 0
    assert "--output-dir" in capsys.readouterr().err


@pytest.mark.parametrize("values", ["nan", "1,inf", "0", "-1", "x"])
def test_compare_refuses_a_sweep_value_that_is_no_load(tmp_path, capsys, values):
    assert main(["compare", "configs/quickstart.yaml", "--sweep", f"rate={values}",
                 "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"--sweep 'rate={values}'" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "results.json").exists()


def test_run_refuses_a_negative_sample_count(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "configs/quickstart.yaml", "--samples", "-5"])
    assert e.value.code == 2 and "must be 0 or more" in capsys.readouterr().err


def test_run_where_no_request_fits_prints_no_nonsense(tmp_path, capsys):
    cfg = tmp_path / "small.yaml"
    cfg.write_text("cache: {block_size: 16, num_blocks: 4}\nscheduler: {max_model_len: 2048}\n"
                   "workload: {kind: poisson, rate: 5, num_requests: 6, prompt_len: [100, 200], output_len: 10}\n")
    assert main(["run", str(cfg), "--samples", "0"]) == 1  # every request failed
    out, err = capsys.readouterr()
    assert re.search(r"^TTFT mean / p50 / p90 / p99 \(ms\) +n/a / n/a / n/a / n/a$", out, re.M)
    assert re.search(r"^rejected +6$", out, re.M) and re.search(r"^makespan \(virtual s\) +0.00$", out, re.M)
    assert "nan" not in out and "inf" not in out
    assert "must be shorter than max_model_len" in err


@pytest.mark.parametrize(("workload", "needle"), [
    ("{kind: poisson, rate: 1.0e-300, num_requests: 3}", "workload.rate: the requests would arrive over"),
    ("{kind: trace, trace: {format: azure, path: DIR}}", "is a directory, not a trace file"),
    ("{kind: trace, trace: {format: azure, path: DIR/missing.csv}}", "file not found"),
])
def test_check_reads_the_workload_as_run_would(tmp_path, capsys, workload, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"workload: {workload.replace('DIR', str(tmp_path))}\n")
    assert main(["check", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


SPECULATION = """runner: {kind: fake, draft_acceptance: 0.5}
scheduler: {num_speculative_tokens: 3, max_num_seqs: 8, max_num_batched_tokens: 256}
workload:
  num_requests: 30
  rate: 50
  prompt_len: [8, 64]
  output_len: [8, 32]
  tenants: [{name: agent, weight: 1%s}, {name: chat, weight: 1%s}]
compare: {profiles: [{name: same, policy: fcfs}]}
"""


def test_run_record_and_compare_simulate_the_same_speculation(tmp_path, capsys):
    """The tenants' draft acceptance and the requests' names reach the runner alike
    whether the engine runs in its own process (run), in this one (record) or under
    compare: one config, one outcome per request."""
    def e2e_by_id(cmd: str, text: str) -> dict[str, float]:
        cfg = tmp_path / f"{cmd}.yaml"
        cfg.write_text(text)
        out = tmp_path / cmd
        assert main([cmd, str(cfg), "-o", str(out)]) == 0
        if cmd == "run":
            return {r["request_id"]: r["e2e"] for r in json.loads(out.read_text())["requests"]}
        if cmd == "compare":
            return {r["request_id"]: r["e2e"] for r in json.loads((out / "results.json").read_text())["requests"]["same"]}
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        return {r["id"]: r["metrics"]["finish_time"] - r["metrics"]["arrival_time"] for r in lines
                if r["type"] == "request"}

    tenants = SPECULATION % (", draft_acceptance: 0.95", ", draft_acceptance: 0.05")
    run = e2e_by_id("run", tenants)
    assert len(run) == 30 and all(rid.startswith("req-") for rid in run)
    assert "draft tokens (accepted)" in capsys.readouterr().out
    drafts = sum(r["num_draft_tokens"] for r in json.loads((tmp_path / "run").read_text())["requests"])
    for cmd in ("record", "compare"):
        other = e2e_by_id(cmd, tenants)
        assert other.keys() == run.keys()
        assert all(other[k] == pytest.approx(run[k], abs=1e-9) for k in run), cmd
    assert e2e_by_id("run", SPECULATION % ("", "")) != run  # the tenants' figures are used
    compared = json.loads((tmp_path / "compare" / "results.json").read_text())["summaries"]["same"]
    assert compared["draft_tokens"] == drafts > 0 and 0 < compared["draft_acceptance"] < 1


def test_a_profile_path_is_read_next_to_the_config_and_checked(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "docs" / "accuracy" / "grid-cpu-reduced-profile.json"
    (tmp_path / "prof.json").write_text(src.read_text())
    (tmp_path / "use.yaml").write_text("runner: {kind: simulated, profile: prof.json}\nworkload: {num_requests: 4}\n")
    (tmp_path / "bad.yaml").write_text("workload: {num_requests: 4}\nrunner: {kind: simulated, profile: nosuch.json}\n")
    elsewhere = tmp_path / "sub"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["check", "../use.yaml"]) == 0
    assert main(["run", "../use.yaml"]) == 0
    capsys.readouterr()
    assert main(["check", "../bad.yaml"]) == 2
    assert "bad.yaml:2: runner.profile = 'nosuch.json': no such profile file" in capsys.readouterr().err


def test_a_builtin_policy_listed_as_a_plugin_is_named_at_its_plugins_line(tmp_path, capsys):
    cfg = tmp_path / "bp.yaml"
    cfg.write_text("scheduler: {policy: fcfs}\nworkload: {num_requests: 2}\nplugins:\n  - {name: fcfs}\n")
    assert main(["check", str(cfg)]) == 2
    assert f"{cfg}:4: plugin 'fcfs' is a built-in policy" in capsys.readouterr().err
