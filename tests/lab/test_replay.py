"""Counterfactual replay: recordings of runs, replays that reproduce them, and replays
with one decision changed from a step on."""

from __future__ import annotations

import json

import pytest
import yaml

from schedkit.cli import main
from schedkit.config import config_from_dict
from schedkit.errors import RecordingError, ReplayDivergenceError, ReplayError
from schedkit.lab.cluster_sim import run_cluster_workload
from schedkit.lab.recording import Recording, read_recording
from schedkit.lab.replay import record_run, replay
from schedkit.lab.simulate import run_workload
from schedkit.runners.fake import FakeRunner

# A small cache under a busy load: requests are preempted for KV blocks.
PRESSURE = {
    "runner": {"kind": "simulated"},
    "cache": {"block_size": 16, "num_blocks": 64},
    "scheduler": {"max_num_batched_tokens": 512, "max_num_seqs": 8, "max_model_len": 1000},
    "workload": {"kind": "poisson", "rate": 50, "num_requests": 24, "prompt_len": [64, 200],
                 "output_len": [32, 128], "seed": 1},
}


def pressure(**scheduler) -> dict:
    return {**PRESSURE, "scheduler": {**PRESSURE["scheduler"], **scheduler}}


def decisions(steps) -> list[dict]:
    return [s.decisions() for s in steps]


def figures(metrics) -> list[dict]:
    return [m.to_dict() for m in metrics]


def first_preemption(rec: Recording) -> int:
    return next(s.step for s in rec.steps if s.preempted)


def other_running(rec: Recording, step: int) -> str:
    """A request running at ``step`` (scheduled there, neither admitted nor preempted)
    that the recording did not preempt."""
    s = rec.step(step)
    return next(rid for rid, _, _ in s.scheduled if rid not in s.admitted and rid not in s.preempted)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_recorded_run_is_the_run_workload_run(async_scheduling):
    cfg = config_from_dict(pressure(async_scheduling=async_scheduling))
    rec, result = record_run(cfg)
    assert figures(result.metrics) == figures(run_workload(cfg).metrics)
    assert rec.num_steps == result.num_steps and rec.steps[0].step == 1
    assert sum(len(s.preempted) for s in rec.steps) > 0
    assert all(r.step is not None and r.metrics is not None for r in rec.requests)


@pytest.mark.parametrize("extra", [{}, {"async_scheduling": True}, {"policy": "priority"}])
def test_an_unchanged_replay_reproduces_the_recording(tmp_path, extra):
    cfg = config_from_dict(pressure(**extra))
    recorded, result = record_run(cfg)
    recorded.write(tmp_path / "run.jsonl.gz")
    rec = read_recording(tmp_path / "run.jsonl.gz")
    out = replay(rec)
    assert out.changed is None and out.reproduces_recording and not out.num_forced
    assert decisions(out.baseline.steps) == decisions(recorded.steps)
    assert figures(out.baseline.metrics) == figures(result.metrics)
    assert out.diff().changed == []


def test_a_victim_change_keeps_the_steps_before_it_and_changes_what_follows():
    cfg = config_from_dict(PRESSURE)
    rec, result = record_run(cfg)
    k = first_preemption(rec)
    victim = other_running(rec, k)
    out = replay(rec, from_step=k, victim=victim)
    assert figures(out.baseline.metrics) == figures(result.metrics)  # the baseline is the recording
    assert out.recorded_preempted == rec.step(k).preempted and victim not in out.recorded_preempted
    changed = out.changed.steps
    assert decisions(changed[:k - 1]) == decisions(rec.steps[:k - 1])
    assert victim in changed[k - 1].preempted
    assert changed[k - 1].decisions() != rec.step(k).decisions()
    diff = out.diff()
    assert victim in {d.request_id for d in diff.changed}
    assert diff.aggregate()["preemptions"]["after"] >= 1
    assert out.describe().endswith(f"victim {victim} at {k} (recorded: {', '.join(rec.step(k).preempted)})")


def test_a_victim_that_is_not_running_is_named():
    rec, _ = record_run(config_from_dict(PRESSURE))
    k = first_preemption(rec)
    finished_before = [rid for s in rec.steps[:k - 1] for rid, _ in s.finished]
    arriving_after = [r.request_id for r in rec.requests if r.step > k]
    for name in ((finished_before or arriving_after)[0], "nobody"):
        with pytest.raises(ReplayError, match=f"victim '{name}' is not running at step {k}") as err:
            replay(rec, from_step=k, victim=name)
        assert err.value.request_id == name


def test_a_policy_change_applies_from_its_step():
    rec, _ = record_run(config_from_dict(PRESSURE))
    k = first_preemption(rec)
    out = replay(rec, from_step=k, policy="sjf")
    assert decisions(out.changed.steps[:k - 1]) == decisions(rec.steps[:k - 1])
    assert decisions(out.changed.steps) != decisions(rec.steps)
    assert out.diff().changed
    assert out.change == {"policy": "sjf"}


def test_a_policy_that_reads_the_clock_is_held_to_the_recording_on_another_clock():
    """EDF rejects requests that waited past their TTFT SLO: replayed on a runner ten
    times slower, it would reject others; the replay holds it to the recorded admissions
    and rejections and counts its corrections."""
    cfg = config_from_dict({**pressure(policy="edf"), "plugins": [{"name": "edf", "settings": {"ttft_slo_s": 0.05}}]})
    rec, result = record_run(cfg)
    assert any(s.rejected for s in rec.steps) and sum(m.rejected for m in result.metrics) > 0
    slow = config_from_dict({**cfg.model_dump(mode="json"), "runner": {"kind": "fake", "step_time_ms": 30}})
    out = replay(rec, config=slow)
    assert out.num_forced["admission"] > 0 and not out.reproduces_recording
    assert decisions(out.baseline.steps) == decisions(rec.steps)
    same = replay(rec)
    assert same.reproduces_recording and not same.num_forced


def test_a_replay_that_leaves_the_recording_says_where():
    rec, _ = record_run(config_from_dict(PRESSURE))
    first = next(s.step for s in rec.steps if len(s.scheduled) > 2)
    other = config_from_dict(pressure(max_num_seqs=2))
    with pytest.raises(ReplayDivergenceError, match=f"step {first} differs from the recording") as err:
        replay(rec, config=other)
    assert err.value.step == first and "scheduled" in err.value.differences


def test_bad_replay_requests_are_typed_errors():
    rec, _ = record_run(config_from_dict(PRESSURE))
    with pytest.raises(ReplayError, match="one change at a time"):
        replay(rec, from_step=2, victim="req-0", policy="sjf")
    with pytest.raises(ReplayError, match=f"the recording has steps 1 to {rec.num_steps}"):
        replay(rec, from_step=rec.num_steps + 1, victim="req-0")
    with pytest.raises(ReplayError, match="needs the step it applies at .*--from-step"):
        replay(rec, victim="req-0")
    with pytest.raises(ReplayError, match="needs a cluster recording"):
        replay(rec, from_step=2, router="round-robin")


def test_a_malformed_recording_names_file_and_line(tmp_path):
    rec, _ = record_run(config_from_dict({**PRESSURE, "workload": {**PRESSURE["workload"], "num_requests": 3}}))
    path = tmp_path / "run.jsonl"
    rec.write(path)
    lines = path.read_text().splitlines()
    first_step = next(i for i, line in enumerate(lines) if '"type":"step"' in line)

    made: list[str] = []

    def broken(i: int, text: str) -> str:
        bad = tmp_path / f"bad{len(made)}.jsonl"
        made.append(str(bad))
        bad.write_text("\n".join([*lines[:i], text, *lines[i + 1:]]) + "\n")
        return str(bad)

    cases = [
        (broken(first_step, "{not json"), first_step + 1, "not JSON"),
        (broken(first_step, json.dumps({"type": "step", "step": 1})), first_step + 1, "missing 'scheduled'"),
        (broken(first_step, json.dumps({"type": "step", "step": 2, "scheduled": [], "new": [],
                                        "resumed": [], "preempted": [], "finished": []})),
         first_step + 1, "step 2 where step 1 should come"),
        (broken(first_step, json.dumps({"type": "step", "step": 1, "scheduled": [["ghost", 0, 5]],
                                        "new": [], "resumed": [], "preempted": [], "finished": []})),
         first_step + 1, "ghost"),
        (broken(1, json.dumps({"type": "request", "id": "x", "arrival_time": 0, "max_tokens": 0,
                               "prompt_token_ids": [1]})), 2, "max_tokens >= 1"),
        (broken(1, json.dumps({"type": "request", "id": "x", "arrival_time": float("nan"), "max_tokens": 2,
                               "prompt_token_ids": [1]})), 2, "arrival_time must be finite"),
        (broken(0, json.dumps({"type": "header", "format": "other"})), 1, "not a schedkit recording"),
        (broken(first_step, json.dumps({"type": "mystery"})), first_step + 1, "unknown line type"),
    ]
    for bad, line, what in cases:
        with pytest.raises(RecordingError, match=what) as err:
            read_recording(bad)
        assert str(err.value).startswith(f"{bad}:{line}: ") and err.value.line == line
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(RecordingError, match="empty"):
        read_recording(empty)


def test_a_recording_cut_short_is_refused(tmp_path):
    import gzip

    rec, _ = record_run(config_from_dict({**PRESSURE, "workload": {**PRESSURE["workload"], "num_requests": 6}}))
    path = tmp_path / "run.jsonl"
    rec.write(path)
    lines = path.read_text().splitlines()
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[: len(lines) // 2]) + "\n")
    with pytest.raises(RecordingError, match="cut short"):
        read_recording(cut)
    cut.write_text(lines[0] + "\n")
    with pytest.raises(RecordingError, match="holds no request line"):
        read_recording(cut)
    packed = gzip.compress(path.read_bytes())
    gz = tmp_path / "cut.jsonl.gz"
    gz.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(RecordingError, match="cut short|cannot read it"):
        read_recording(gz)
    assert read_recording(path).num_steps == rec.num_steps  # the whole one still reads


def test_a_wall_clock_recording_replays_its_decisions_in_the_simulator():
    """A stand-in for a real runner: the fake runner on the wall clock, some requests
    ending at EOS. The replay runs on the simulator and makes the recorded decisions."""
    cfg = config_from_dict({
        "runner": {"kind": "fake", "clock": "wall", "step_time_ms": 1, "eos_token_id": 2},
        "cache": {"block_size": 16, "num_blocks": 24},
        "scheduler": {"max_num_batched_tokens": 256, "max_num_seqs": 4, "max_model_len": 512},
        "workload": {"kind": "poisson", "rate": 500, "num_requests": 8, "prompt_len": [32, 96],
                     "output_len": [8, 24], "seed": 2}})
    runner = FakeRunner(eos_token_id=2, step_time_s=0.001, is_virtual_clock=False,
                        output_len=lambda rid: 3 if rid in ("req-1", "req-4") else None)
    rec, result = record_run(cfg, runner=runner)
    assert not rec.virtual_clock
    stopped = {m.request_id: m.num_output_tokens for m in result.metrics if m.finish_reason == "stop"}
    assert stopped == {"req-1": 4, "req-4": 4}
    out = replay(rec)
    assert decisions(out.baseline.steps) == decisions(rec.steps)
    assert {m.request_id: m.num_output_tokens for m in out.baseline.metrics if m.finish_reason == "stop"} == stopped
    assert "replay runner's times" in out.describe()


def cluster_config(**router) -> dict:
    return {
        "runner": {"kind": "fake", "step_time_ms": 10},
        "cache": {"block_size": 16, "num_blocks": 200},
        "scheduler": {"max_num_batched_tokens": 1024, "max_num_seqs": 8, "max_model_len": 2048},
        "workload": {"kind": "poisson", "rate": 40, "num_requests": 40, "prompt_len": [16, 64],
                     "output_len": [4, 32], "seed": 3,
                     "shared_prefix": {"count": 4, "length": 256, "fraction": 1.0}},
        "replicas": {"count": 3}, "router": {"policy": "round-robin", **router},
    }


def test_a_router_change_replays_the_cluster_from_a_decision():
    cfg = config_from_dict(cluster_config())
    rec, result = record_run(cfg)
    assert rec.kind == "cluster" and rec.num_steps == 40
    assert figures(result.metrics) == figures(run_cluster_workload(cfg).metrics)
    same = replay(rec)
    assert same.reproduces_recording and figures(same.baseline.metrics) == figures(result.metrics)
    k = 11
    out = replay(rec, from_step=k, router="prefix-affinity")
    routed = out.changed.replica_of
    assert [routed[rid] for rid, _ in rec.routes[:k - 1]] == [j for _, j in rec.routes[:k - 1]]
    assert [routed[rid] for rid, _ in rec.routes] != [j for _, j in rec.routes]
    assert out.diff().changed
    with pytest.raises(ReplayError, match="cluster recording replays a router change"):
        replay(rec, from_step=2, victim="req-0")


def test_the_cli_records_and_replays(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(PRESSURE))
    recording = tmp_path / "run.jsonl"
    assert main(["record", str(config), "-o", str(recording)]) == 0
    assert "recorded 24 requests" in capsys.readouterr().out
    rec = read_recording(recording)
    k = first_preemption(rec)
    victim = other_running(rec, k)
    out = tmp_path / "out.json"
    assert main(["replay", str(recording), "--from-step", str(k), "--victim", victim, "-o", str(out)]) == 0
    table = capsys.readouterr().out
    assert "recomputed tokens" in table and "requests changed:" in table
    res = json.loads(out.read_text())
    assert res["change"] == {"victim": victim} and res["from_step"] == k
    assert res["compared"] == "baseline -> changed" and res["num_changed"] > 0
    assert {r["request_id"] for r in res["requests"]} == {r.request_id for r in rec.requests}
    assert main(["replay", str(recording), "--from-step", str(k), "--victim", "nobody"]) == 1
    assert "victim 'nobody' is not running" in capsys.readouterr().err
