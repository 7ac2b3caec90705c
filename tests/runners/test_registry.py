"""Runners are found by name in the ``schedkit.runners`` entry-point group, schedkit's
own as another package's; an unknown, doubly declared or broken one is a typed error
naming the kind (and its YAML line)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from schedkit.config import config_from_dict, load_config
from schedkit.errors import ConfigError, PluginError
from schedkit.runners import configured_runner_class, find_runner, installed_runners, runner_class
from schedkit.runners.fake import FakeRunner

ROOT = Path(__file__).resolve().parents[2]
BUILTIN = {"fake", "simulated", "paged"}


@pytest.fixture
def install(tmp_path, monkeypatch):
    """``install(dist, {name: "module:Object"}, {module: source})``: a package declaring
    runners in a folder on sys.path, with other packages' runners no longer hidden."""

    def install(dist: str, runners: dict[str, str], modules: dict[str, str] | None = None) -> None:
        site = tmp_path / dist
        site.mkdir()
        for module, source in (modules or {}).items():
            (site / f"{module}.py").write_text(source)
        info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        lines = "".join(f"{name} = {target}\n" for name, target in runners.items())
        (info / "entry_points.txt").write_text(f"[schedkit.runners]\n{lines}")
        monkeypatch.syspath_prepend(str(site))
        monkeypatch.delenv("SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD", raising=False)

    return install


def test_schedkits_runners_are_the_ones_its_pyproject_declares():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    runners = declared["schedkit.runners"]
    assert set(runners) == BUILTIN
    assert {name: ep.value for name, ep in installed_runners().items()} == runners
    assert runner_class("fake") is FakeRunner


def test_finding_a_runner_imports_nothing_and_only_the_chosen_one_loads():
    code = ("import sys; from schedkit.runners import find_runner, runner_class; "
            "find_runner('paged'); runner_class('simulated'); "
            "bad = [m for m in ('torch', 'schedkit.runners.paged') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_unknown_kind_names_its_yaml_line_and_the_installed_runners(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("scheduler: {policy: fcfs}\nrunner:\n  kind: gpu\n")
    config = load_config(path)  # any name is a valid kind until the engine looks it up
    with pytest.raises(ConfigError) as exc:
        configured_runner_class(config)
    assert str(exc.value).startswith(
        f"{path}:3: runner.kind = 'gpu': no installed runner has that name (entry-point group "
        "'schedkit.runners'); installed: ['fake', 'paged', 'simulated']")
    with pytest.raises(ConfigError, match=r"^runner.kind = 'gpu': no installed runner"):
        configured_runner_class(config_from_dict({"runner": {"kind": "gpu"}}))  # no file: no line


def test_other_packages_runners_are_hidden_while_autoload_is_off(install, monkeypatch):
    install("acme-runner", {"acme": "acme_runner:AcmeRunner"},
            {"acme_runner": "class AcmeRunner:\n    @classmethod\n    def from_config(cls, config):\n"
                            "        return cls()\n"})
    assert runner_class("acme").__name__ == "AcmeRunner"
    monkeypatch.setenv("SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert set(installed_runners()) == BUILTIN
    with pytest.raises(ConfigError, match="not loaded while SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD=1"):
        find_runner("acme")


def test_a_package_put_on_the_path_later_is_found(install):
    with pytest.raises(ConfigError, match="'late'"):
        find_runner("late")
    install("late-runner", {"late": "late_runner:Late"})
    assert find_runner("late").value == "late_runner:Late"


def test_a_name_two_packages_declare_is_refused_naming_both(install):
    install("rogue-runner", {"fake": "rogue:Fake"})
    with pytest.raises(ConfigError) as exc:
        find_runner("fake")
    assert str(exc.value) == (
        "runner.kind = 'fake': declared by more than one package: schedkit "
        "(schedkit.runners.fake:FakeRunner), rogue-runner (rogue:Fake); uninstall one of them")
    assert runner_class("simulated").__name__ == "SimulatedRunner"  # the others still resolve


@pytest.mark.parametrize("module, source, message", [
    ("raising_runner", "raise RuntimeError('no licence')",
     "runner 'broken' failed to load from raising_runner:Runner: RuntimeError: no licence"),
    ("empty_runner", "", "runner 'broken' failed to load from empty_runner:Runner: AttributeError"),
    ("classless_runner", "class Runner:\n    pass\n",
     "runner 'broken': classless_runner:Runner has no from_config"),
])
def test_a_runner_that_cannot_be_built_is_a_plugin_error_naming_it(install, module, source, message):
    install("broken-runner", {"broken": f"{module}:Runner"}, {module: source})
    try:
        with pytest.raises(PluginError, match=message) as exc:
            runner_class("broken")
    finally:
        sys.modules.pop(module, None)
    assert exc.value.plugin == "broken"
