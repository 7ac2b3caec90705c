"""A third-party runner installs and is chosen like schedkit's own: the example package
examples/plugins/schedkit-echo-runner, installed into a temporary folder as
tests/plugins/test_entry_points.py installs the policy example, then run from YAML alone
(``runner.kind: echo``) in an engine process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from schedkit import LLM, ConfigError, SamplingParams
from schedkit.cli import main
from schedkit.runners import installed_runners

from .test_entry_points import _can_build_wheels_offline, _install_by_hand, _install_with_pip

ROOT = Path(__file__).resolve().parents[2]
ECHO_DIR = ROOT / "examples" / "plugins" / "schedkit-echo-runner"


@pytest.fixture(scope="module")
def echo_site(tmp_path_factory):
    """The example installed in a folder on sys.path and on the PYTHONPATH of the engine
    processes started here, with other packages' runners not hidden."""
    target = tmp_path_factory.mktemp("echo-runner") / "site"
    target.mkdir()
    if _can_build_wheels_offline():
        _install_with_pip(ECHO_DIR, target)
    else:
        _install_by_hand(ECHO_DIR, target)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD", raising=False)
        mp.syspath_prepend(str(target))
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")])))
        yield target
    for name in [m for m in sys.modules if m.startswith("schedkit_echo_runner")]:
        del sys.modules[name]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "echo.yaml"
    path.write_text(text)
    return path


def test_the_installed_runner_is_registered_beside_schedkits_own(echo_site):
    runners = installed_runners()
    assert {"fake", "simulated", "paged", "echo"} <= set(runners)
    assert runners["echo"].value == "schedkit_echo_runner:EchoRunner"
    assert runners["echo"].dist is not None and runners["echo"].dist.name == "schedkit-echo-runner"


def test_an_engine_runs_the_installed_runner_from_yaml_alone(echo_site, tmp_path):
    path = write(tmp_path, "runner:\n  kind: echo\n  vocab_size: 100\n  settings: {shift: 1}\n")
    prompts = [[5, 6, 7], [98, 99]]
    with LLM(path) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=5), use_tqdm=False)
    assert [o.error for o in outs] == [None, None]
    assert [o.output_token_ids for o in outs] == [[6, 7, 8, 6, 7], [99, 0, 99, 0, 99]]


def test_schedkit_run_drives_the_workload_through_it(echo_site, tmp_path, capsys):
    path = write(tmp_path, "runner: {kind: echo, settings: {step_time_ms: 2}}\n"
                           "workload: {num_requests: 6, prompt_len: 8, output_len: 4}\n")
    out = tmp_path / "results.json"
    assert main(["run", str(path), "-o", str(out), "--samples", "0"]) == 0
    requests = json.loads(out.read_text())["requests"]
    assert len(requests) == 6 and all(r["num_output_tokens"] == 4 for r in requests)
    assert "echo" in capsys.readouterr().out


def test_an_unknown_kind_names_its_line_and_lists_the_installed_runners(echo_site, tmp_path):
    path = write(tmp_path, "cache: {num_blocks: 64}\nrunner:\n  kind: ecko\n")
    with pytest.raises(ConfigError) as exc:
        LLM(path)
    assert str(exc.value) == (
        f"{path}:3: runner.kind = 'ecko': no installed runner has that name (entry-point group "
        "'schedkit.runners'); installed: ['echo', 'fake', 'paged', 'simulated']")


def test_bad_settings_of_the_installed_runner_are_its_config_error(echo_site, tmp_path):
    path = write(tmp_path, "runner:\n  kind: echo\n  settings: {shift: -1}\n")
    with pytest.raises(ConfigError, match=r"runner.settings.shift = -1: must be an integer >= 0"):
        LLM(path)


def test_example_package_tests_pass_against_the_installed_package(echo_site):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:benchmark", "-o", "pythonpath=", "tests"],
                          cwd=ECHO_DIR, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout
