"""The research policies as entry-point plugins, and docs/policies.md.

The entry points are simulated (``discover_plugins`` is monkeypatched) with exactly the
lines pyproject.toml's ``[project.entry-points.schedkit]`` declares for them, so these
tests cover loading by name, YAML settings and the documented configs before and after
the package is reinstalled.
"""

from __future__ import annotations

import importlib
import inspect
import re
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import yaml

import schedkit.plugins.manager as manager
from schedkit import PluginError
from schedkit.config import config_from_dict
from schedkit.core.request import RequestStatus
from schedkit.core.scheduler import Scheduler
from schedkit.plugins.facade import HookFacade
from schedkit.plugins.manager import get_plugin_manager
from schedkit.plugins.testing import make_request
from schedkit.policies.aging import MaxWaitQueue
from schedkit.policies.mlfq import LevelQueue

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "policies.md"
ENTRY_POINTS = dict(manager.BUNDLED_POLICIES)  # pyproject.toml must declare these (below)
CODE_ONLY = {"clock"}  # constructor arguments that are not YAML settings


@pytest.fixture
def installed(monkeypatch):
    eps = {n: EntryPoint(name=n, value=v, group="schedkit") for n, v in ENTRY_POINTS.items()}
    monkeypatch.setattr(manager, "discover_plugins", lambda: dict(eps))


def build(config) -> Scheduler:
    pm = get_plugin_manager(config)
    return Scheduler(config.scheduler, config.cache, HookFacade(pm))


def load(name: str):
    module, attr = ENTRY_POINTS[name].split(":")
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_each_policy_loads_by_name_with_default_settings(installed, name):
    sched = build(config_from_dict({"scheduler": {"policy": name}}))
    assert isinstance(sched.hooks.pm.get_plugin(name), load(name))


def test_bad_yaml_settings_fail_at_start_up_naming_plugin_setting_and_value(installed):
    config = config_from_dict({"scheduler": {"policy": "sjf"},
                               "plugins": [{"name": "sjf", "settings": {"aging_rate": -3}}]})
    with pytest.raises(PluginError, match=r"sjf.*aging_rate.*-3") as exc:
        build(config)
    assert exc.value.plugin == "sjf"
    config = config_from_dict({"plugins": [{"name": "vtc", "settings": {"speed": 1}}]})
    with pytest.raises(PluginError, match="speed"):
        build(config)


def _sections() -> dict[str, str]:
    parts = re.split(r"^## +(.+?) *$", DOC.read_text(), flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def _yaml_blocks(text: str) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", text, flags=re.S)


def test_every_policy_has_a_doc_section_listing_each_setting_and_a_yaml_example():
    sections = _sections()
    for name in ENTRY_POINTS:
        assert name in sections, f"docs/policies.md has no '## {name}' section"
        body = sections[name]
        settings = set(inspect.signature(load(name)).parameters) - CODE_ONLY
        missing = [s for s in settings if f"`{s}`" not in body]
        assert not missing, f"{name}: settings not documented: {missing}"
        assert _yaml_blocks(body), f"{name}: no YAML example"


@pytest.mark.parametrize("block", _yaml_blocks(DOC.read_text()))
def test_doc_yaml_examples_build_a_scheduler(installed, block):
    sched = build(config_from_dict(yaml.safe_load(block), source="docs/policies.md"))
    if "name: aging" in block:
        assert isinstance(sched.waiting.policy_queue, MaxWaitQueue)


def test_the_plugin_listed_last_answers_the_victim_hook(installed):
    config = config_from_dict({"plugins": [{"name": "mlfq"}, {"name": "least-computed"}]})
    sched = build(config)
    assert isinstance(sched.waiting.policy_queue, LevelQueue)  # mlfq still orders the queue
    a, b = make_request("a", [1] * 8), make_request("b", [2] * 8)
    a.num_computed_tokens, b.num_computed_tokens = 5, 50
    for r in (a, b):
        r.status = RequestStatus.RUNNING
    assert sched.hooks.select_preemption_victim(running=[a, b], request=b) is a  # not running[-1]


def test_pyproject_declares_these_entry_points():
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("entry-points", {})
    declared = groups.get("schedkit")
    if not declared:
        pytest.skip("pyproject.toml has no [project.entry-points.schedkit] group yet")
    assert {n: declared.get(n) for n in ENTRY_POINTS} == ENTRY_POINTS


def test_bundled_policies_match_pyproject_and_load_without_install(monkeypatch):
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["schedkit"]
    assert dict(manager.BUNDLED_PLUGINS) == declared
    assert ENTRY_POINTS.items() <= declared.items()
    monkeypatch.setenv("SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD", "1")  # as in a bare source tree
    assert set(ENTRY_POINTS) <= set(manager.discover_plugins())
    get_plugin_manager(config_from_dict({"scheduler": {"policy": "sjf"}}))


def test_a_plugin_missing_while_autoload_is_off_names_the_variable(monkeypatch):
    from schedkit.errors import ConfigError

    monkeypatch.setenv("SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD", "1")
    with pytest.raises(ConfigError, match="not loaded while SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD=1"):
        get_plugin_manager(config_from_dict({"scheduler": {"policy": "somebodys-policy"}}))
    monkeypatch.setenv("SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD", "0")
    with pytest.raises(ConfigError, match="is not installed") as e:
        get_plugin_manager(config_from_dict({"scheduler": {"policy": "somebodys-policy"}}))
    assert "AUTOLOAD" not in str(e.value)
