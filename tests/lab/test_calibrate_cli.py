"""``schedkit calibrate``: the profile it writes, and the errors it gives."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import yaml

from schedkit.cli import main
from schedkit.config import config_from_dict
from schedkit.lab.cost_fit import fit, read_steps, write_steps
from schedkit.lab.simulate import run_workload
from schedkit.runners.cost_model import FEATURES, CostModel

REPO = Path(__file__).resolve().parents[2]
SMALL = {
    "cache": {"num_blocks": 2000, "block_size": 16, "enable_prefix_caching": True},
    "scheduler": {"max_num_batched_tokens": 1024, "max_num_seqs": 16, "max_model_len": 2048},
    "workload": {"rate": 20, "num_requests": 60, "prompt_len": [16, 600], "output_len": [4, 48]},
}


def _config(tmp_path: Path, runner: dict) -> Path:
    path = tmp_path / "calib.yaml"
    path.write_text(yaml.safe_dump({"runner": runner, **SMALL}))
    return path


def test_calibrate_writes_a_profile_the_simulator_loads(tmp_path, capsys):
    # The simulator stands in for the real runner (no torch here): calibrating it must
    # give its own profile back, and write every recorded field.
    cfg = _config(tmp_path, {"kind": "simulated", "profile": "h200-qwen2.5-0.5b-handset"})
    out, steps = tmp_path / "fitted.json", tmp_path / "steps.jsonl"
    assert main(["calibrate", str(cfg), "-o", str(out), "--budget-s", "120", "--steps", str(steps)]) == 0
    printed = capsys.readouterr().out
    assert "relative step error" in printed and str(out) in printed
    data = json.loads(out.read_text())
    assert data["name"] == "fitted" and data["fitted"] is True
    assert set(data["hardware"]) == {"cpu", "cpu_count", "gpu"}
    assert set(data["versions"]) >= {"schedkit", "torch", "python"}
    assert data["fitted_on"]["config"] == str(cfg) and data["fitted_on"]["async_scheduling"] is False
    assert data["fitted_on"]["sections"]["runner"]["kind"] == "simulated"
    res = data["residuals"]
    assert set(res) == {"overall", "prefill", "decode", "mixed"}
    assert all(set(r) == {"num_steps", "mean", "median", "p90"} for r in res.values())
    assert res["overall"]["num_steps"] == data["num_steps"] > 100
    assert res["overall"]["p90"] < 1e-6
    steal = data["calibration"]["steal_share"]  # read from /proc/stat on Linux
    assert steal is None or 0 <= steal <= 1
    phases = {p["name"]: p for p in data["calibration"]["phases"]}
    assert phases["workload"]["status"] == "ran" and phases["swap-0"]["num_steps"] > 0
    assert phases["grammar-b1"]["status"].startswith("skipped: no structured-output backend (")
    later = [p["status"] for n, p in phases.items() if n.startswith("grammar-") and n != "grammar-b1"]
    assert later and all(s == "skipped: no structured-output backend (above)" for s in later)
    assert set(data["coefficients"]) == set(FEATURES)
    # The probe during the fit: the simulator runs just as its fitted profile says.
    assert data["speed_probe"]["ratio"] == pytest.approx(1.0, rel=1e-3) and data["speed_probe"]["runs"] >= 1
    assert data["speed_probe"]["decode"] == pytest.approx(1.0, rel=1e-3)
    assert data["speed_probe"]["prefill"] == pytest.approx(1.0, rel=1e-3)
    assert phases["probe-0"]["status"] == "ran"

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fitted on this machine: no warning
        model = CostModel.load(str(out))
    truth = CostModel.load("h200-qwen2.5-0.5b-handset")
    for k in ("base_s", "per_token_s", "per_request_s", "per_context_token_s"):
        assert getattr(model, k) == pytest.approx(getattr(truth, k), rel=1e-3), k
    sim = config_from_dict({"runner": {"kind": "simulated", "profile": str(out)}, **SMALL})
    assert len(run_workload(sim).metrics) == SMALL["workload"]["num_requests"]
    # Every step the fit saw is kept, and refitted from the file gives the same model.
    records = read_steps(steps)
    assert len(records) == data["num_steps"]
    assert all(s == pytest.approx(truth.step_time(f)) for f, s in records)
    assert fit(records).coefficients == pytest.approx(model.coefficients, rel=1e-6, abs=1e-12)


def test_a_steps_file_that_is_not_one_is_named_with_its_line(tmp_path):
    path = tmp_path / "steps.jsonl"
    write_steps(path, [])
    assert read_steps(path) == []
    path.write_text('{"seconds": 0.1, "features": {"tokens": 1, "requests": 1, "context_tokens": 1, '
                    '"prefill_attention": 0, "is_prefill_step": 0}}\n{"seconds": 1}\n')
    with pytest.raises(ValueError, match=r"steps.jsonl:2: not a step record"):
        read_steps(path)
    good = '{"seconds": %s, "features": {"tokens": %s, "requests": 1, "context_tokens": 1, ' \
           '"prefill_attention": 0, "is_prefill_step": 0}}\n'
    for seconds, tokens in (("NaN", "1"), ("-0.5", "1"), ("0.1", "Infinity"), ("0.1", '"many"')):
        path.write_text(good % ("0.1", "1") + good % (seconds, tokens))
        with pytest.raises(ValueError, match=r"steps.jsonl:2: not a step record"):
            read_steps(path)
    path.write_text(good % ("0.1", '"2"'))
    assert read_steps(path)[0][0].tokens == 2.0  # a number written as a string still reads


def test_bad_config_output_and_runner_name_what_is_wrong(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert main(["calibrate", str(missing), "-o", str(tmp_path / "p.json")]) == 2
    assert str(missing) in capsys.readouterr().err
    cfg = _config(tmp_path, {"kind": "simulated"})
    assert main(["calibrate", str(cfg), "-o", str(tmp_path / "no" / "such" / "p.json")]) == 2
    assert "--output" in capsys.readouterr().err
    fake = _config(tmp_path, {"kind": "fake"})
    assert main(["calibrate", str(fake), "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "runner.kind = 'fake'" in err and str(fake) in err
    with pytest.raises(SystemExit):
        main(["calibrate", str(cfg), "-o", str(tmp_path / "p.json"), "--budget-s", "0"])
    assert "positive number of seconds" in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_the_paged_runner_on_a_tiny_random_model(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "tiny.json"
    cfg = REPO / "configs" / "calibration" / "cpu-tiny-llama.yaml"
    assert main(["calibrate", str(cfg), "-o", str(out), "--budget-s", "45"]) == 0
    data = json.loads(out.read_text())
    assert data["calibration"]["budget_s"] == 45  # the time box is recorded; its speed is a benchmark's
    phases = {p["name"]: p for p in data["calibration"]["phases"]}
    assert phases["swap-0"]["num_steps"] > 0
    assert data["residuals"]["overall"]["median"] < 0.5
    model = CostModel.load(str(out))
    assert model.base_s > 0 and model.fitted_async_scheduling is False


def test_rescale_reanchors_a_profile_by_the_speed_probe(tmp_path, capsys):
    # On the simulator the "machine" runs exactly as its own profile says: a profile
    # that predicts every step twice as fast is scaled by 2, the machine's own by 1.
    from schedkit.lab.profiles import minimal_payload, write_profile

    cfg = _config(tmp_path, {"kind": "simulated", "profile": "h200-qwen2.5-0.5b-handset"})
    truth = CostModel.load("h200-qwen2.5-0.5b-handset")
    fast = tmp_path / "fast.json"
    write_profile(fast, minimal_payload("fast", truth.scaled(0.5), "test"))
    out = tmp_path / "rescaled.json"
    assert main(["calibrate", str(cfg), "--rescale", str(fast), "-o", str(out)]) == 0
    assert "2.000x" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["rescaled"]["ratio"] == pytest.approx(2.0, rel=1e-9) and data["rescaled"]["from"] == str(fast)
    model = CostModel.load(str(out))
    for k, v in truth.coefficients.items():
        assert getattr(model, k) == pytest.approx(v, rel=1e-9, abs=1e-15), k
    same = tmp_path / "same.json"
    assert main(["calibrate", str(cfg), "--rescale", "h200-qwen2.5-0.5b-handset", "-o", str(same)]) == 0
    assert json.loads(same.read_text())["rescaled"]["ratio"] == pytest.approx(1.0, rel=1e-9)
    assert main(["calibrate", str(cfg), "--rescale", "no-such-profile", "-o", str(same)]) == 2
    assert "no-such-profile" in capsys.readouterr().err


def test_rescale_reads_the_probe_against_the_one_after_the_fit(tmp_path, capsys):
    # A profile whose probe read 1.25x during its fit (its bias on the probe's
    # steps) is rescaled by what the machine moved since, not by the raw ratio.
    from schedkit.lab.profiles import minimal_payload, write_profile

    cfg = _config(tmp_path, {"kind": "simulated", "profile": "h200-qwen2.5-0.5b-handset"})
    truth = CostModel.load("h200-qwen2.5-0.5b-handset")
    fast = tmp_path / "fast.json"
    write_profile(fast, {**minimal_payload("fast", truth.scaled(0.5), "test"), "speed_probe": {"ratio": 1.25}})
    assert CostModel.load(str(fast)).probe_ratio == 1.25
    out = tmp_path / "rescaled.json"
    assert main(["calibrate", str(cfg), "--rescale", str(fast), "-o", str(out)]) == 0
    assert "read 1.250x during the fit" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["rescaled"]["ratio"] == pytest.approx(1.6, rel=1e-9)
    # The rescaled profile keeps the reference: the machine has not moved since.
    model = CostModel.load(str(out))
    assert model.probe_ratio == 1.25 and model.per_token_s == pytest.approx(0.8 * truth.per_token_s, rel=1e-9)
    bad = tmp_path / "bad.json"
    write_profile(bad, {**minimal_payload("bad", truth, "test"), "speed_probe": {"ratio": 0}})
    assert main(["calibrate", str(cfg), "--rescale", str(bad), "-o", str(out)]) == 2
    assert "speed_probe.ratio" in capsys.readouterr().err


def test_rescale_reads_decodes_and_prefills_apart(tmp_path, capsys):
    # A profile twice as fast as the machine on every step, whose probe read its
    # prompt-chunk steps 2.00x during the fit (its bias there) and its decodes 1.00x:
    # now the probe reads 2x on both, so decodes moved by 2 and prefills not at all.
    from schedkit.lab.profiles import minimal_payload, write_profile

    cfg = _config(tmp_path, {"kind": "simulated", "profile": "h200-qwen2.5-0.5b-handset"})
    truth = CostModel.load("h200-qwen2.5-0.5b-handset")
    fast = tmp_path / "fast.json"
    write_profile(fast, {**minimal_payload("fast", truth.scaled(0.5), "test"),
                         "speed_probe": {"ratio": 1.5, "decode": 1.0, "prefill": 2.0}})
    out = tmp_path / "rescaled.json"
    assert main(["calibrate", str(cfg), "--rescale", str(fast), "-o", str(out)]) == 0
    assert "decode-only steps scaled by 2.000, those with a prompt chunk by 1.000" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["rescaled"]["ratio"] == pytest.approx(2.0) and data["rescaled"]["prefill_ratio"] == pytest.approx(1.0)
    model = CostModel.load(str(out))
    assert model.per_token_s == pytest.approx(truth.per_token_s, rel=1e-9)
    assert model.prefill_scale == pytest.approx(0.5) == data["prefill_scale"]
    for bad in ({"speed_probe": {"ratio": 1.0, "prefill": -1}}, {"prefill_scale": "fast"}):
        path = tmp_path / "bad.json"
        write_profile(path, {**minimal_payload("bad", truth, "test"), **bad})
        assert main(["calibrate", str(cfg), "--rescale", str(path), "-o", str(out)]) == 2
        assert next(iter(bad)) in capsys.readouterr().err


def test_calibrate_refuses_an_unwritable_steps_path_before_running(tmp_path, capsys):
    cfg = tmp_path / "sim.yaml"
    cfg.write_text("runner: {kind: simulated, profile: cpu-tiny-llama}\nworkload: {num_requests: 4}\n")
    assert main(["calibrate", str(cfg), "-o", str(tmp_path / "p.json"), "--steps", str(tmp_path)]) == 2
    assert f"--steps {tmp_path}: cannot write there" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()
