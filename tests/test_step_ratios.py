"""scripts/step_ratios.py: measured over predicted step time by kind and source."""

import importlib.util
import json
from pathlib import Path

import pytest

from schedkit.lab.cost_fit import write_steps
from schedkit.runners.cost_model import CostModel, StepFeatures

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("step_ratios", ROOT / "scripts" / "step_ratios.py")
step_ratios = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_ratios)

PROFILE = ROOT / "docs" / "accuracy" / "grid-cpu-full-onednn-profile.json"
FULL = StepFeatures(tokens=512, requests=2, context_tokens=768, prefill_attention=200_000.0, is_prefill_step=1)
SMALL = StepFeatures(tokens=64, requests=1, context_tokens=64, prefill_attention=2_048.0, is_prefill_step=1)
ONE = StepFeatures(tokens=1, requests=1, context_tokens=300, prefill_attention=0.0, is_prefill_step=0, sampled_rows=1)
EIGHT = StepFeatures(tokens=8, requests=8, context_tokens=2_400, prefill_attention=0.0, is_prefill_step=0,
                     sampled_rows=8)


@pytest.fixture
def profile(tmp_path):
    data = json.loads(PROFILE.read_text())
    data["calibration"]["phases"] = [{"name": "workload", "status": "ran", "num_steps": 2}]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    return path, CostModel.from_profile(data)


def _cells(out: str) -> dict[str, dict[str, str]]:
    rows = [line.strip("|").split("|") for line in out.strip().splitlines()]
    header = [c.strip() for c in rows[0][1:]]
    return {r[0].strip(): dict(zip(header, (c.strip() for c in r[1:]), strict=True)) for r in rows[2:]}


def test_each_source_and_kind_gets_its_own_ratio(tmp_path, profile, capsys):
    path, model = profile
    steps = tmp_path / "steps"
    steps.mkdir()
    t = model.step_time
    write_steps(steps / "calibration.jsonl",
                [(ONE, 2 * t(ONE)), (FULL, t(FULL)),          # the workload phase
                 (FULL, 1.1 * t(FULL)), (SMALL, t(SMALL))])   # the bursts
    write_steps(steps / "azure-conv_knee_b512_fcfs-0.jsonl", [(FULL, 0.5 * t(FULL)), (ONE, t(ONE))])
    write_steps(steps / "mooncake_knee_b512_fcfs-0.jsonl", [(FULL, 1.5 * t(FULL))])
    write_steps(steps / "azure-conv_knee_b512_fcfs-1.jsonl", [(EIGHT, 1.5 * t(EIGHT))])
    assert step_ratios.main([str(steps), "--profile", str(path)]) == 0
    cells = _cells(capsys.readouterr().out)
    assert cells["decode, one sequence"]["fit's workload phase"] == "2.00x (1)"
    assert cells["full-budget prompt steps"]["fit's workload phase"] == "1.00x (1)"
    assert cells["full-budget prompt steps"]["fit's bursts"] == "1.10x (1)"
    assert cells["smaller prompt steps"]["fit's bursts"] == "1.00x (1)"
    assert cells["full-budget prompt steps"]["grid, pass 1"] == "1.00x (2)"  # time-weighted: 0.5 and 1.5
    assert cells["decode, one sequence"]["grid, pass 1"] == "1.00x (1)"
    assert cells["decode, 5 or more"]["grid, pass 2"] == "1.50x (1)"
    assert cells["decode, 2-4 sequences"]["grid, pass 2"] == "-"


def test_full_budget_starts_at_fifteen_sixteenths():
    assert step_ratios.kind(FULL._replace(tokens=480), 512) == "full-budget prompt steps"
    assert step_ratios.kind(FULL._replace(tokens=479), 512) == "smaller prompt steps"
    assert step_ratios.kind(EIGHT._replace(requests=4), 512) == "decode, 2-4 sequences"


def test_a_directory_without_steps_is_refused(tmp_path, profile, capsys):
    path, _ = profile
    with pytest.raises(SystemExit):
        step_ratios.main([str(tmp_path), "--profile", str(path)])
    assert "no step files" in capsys.readouterr().err
    write_steps(tmp_path / "x-0.jsonl", [])
    with pytest.raises(SystemExit):
        step_ratios.main([str(tmp_path), "--profile", str(path)])
    assert "its step files hold no step" in capsys.readouterr().err


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.pop("coefficients"), "not a cost-model profile"),
    (lambda d: d.update(fitted_on={"sections": None}), "give --budget"),
    (lambda d: d["fitted_on"]["sections"]["scheduler"].update(max_num_batched_tokens="big"), "give --budget"),
    (lambda d: d.update(calibration="oops"), None),
])
def test_a_bad_profile_or_budget_is_refused_by_name(tmp_path, profile, capsys, edit, needle):
    path, _ = profile
    write_steps(tmp_path / "x-0.jsonl", [(FULL, 0.5)])
    write_steps(tmp_path / "calibration.jsonl", [(SMALL, 0.1), (ONE, 0.02)])
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    if needle is None:  # a calibration record it cannot read: the fit's phases are left out
        assert step_ratios.main([str(tmp_path), "--profile", str(path)]) == 0
        out = capsys.readouterr().out
        assert "| fit |" in out and "grid, pass 1" in out
        return
    with pytest.raises(SystemExit) as e:
        step_ratios.main([str(tmp_path), "--profile", str(path)])
    assert e.value.code == 2 and needle in capsys.readouterr().err
    with pytest.raises(SystemExit):
        step_ratios.main([str(tmp_path), "--profile", str(path), "--budget", "0"])
    assert "--budget must be at least 1" in capsys.readouterr().err


def test_a_bundled_profile_is_read_by_name(tmp_path, capsys):
    write_steps(tmp_path / "x-0.jsonl", [(FULL, 0.5), (ONE, 0.02)])
    assert step_ratios.main([str(tmp_path), "--profile", "cpu-smollm2-135m", "--budget", "512"]) == 0
    assert "| grid, pass 1 |" in capsys.readouterr().out
