"""Entry-point plugins: the real example package, then fake entry points.

The example package examples/plugins/schedkit-spf is installed into a temporary folder
(``pip install --target``) that is put on ``sys.path``; the shared virtualenv is never
modified. When this environment cannot build a wheel offline (setuptools < 70.1 without
the ``wheel`` package, as in a fresh Python 3.11 venv), the folder is laid out as pip
would: the package's sources plus a ``.dist-info`` whose ``entry_points.txt`` is
written from the package's own pyproject.toml. Either way ``importlib.metadata`` finds
the distribution through ``sys.path``, as it does for any installed package.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
import types
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import schedkit.plugins.manager as manager
from schedkit import ConfigError, PluginError, hookimpl
from schedkit.config import config_from_dict, load_config
from schedkit.core.queues import FCFSQueue
from schedkit.core.scheduler import Scheduler
from schedkit.plugins.facade import HookFacade
from schedkit.plugins.manager import BUNDLED_PLUGINS, discover_plugins, get_plugin_manager
from schedkit.plugins.testing import make_request, make_scheduler, step
from schedkit.runners.fake import FakeRunner

from . import finish_log_plugin

ROOT = Path(__file__).resolve().parents[2]
SPF_DIR = ROOT / "examples" / "plugins" / "schedkit-spf"
PROMPT_LENS = {"long": 30, "short": 10, "mid": 20}  # in arrival order


# ------------------------------------------------------------------ installing the example
def _can_build_wheels_offline() -> bool:
    """setuptools >= 70.1 builds wheels itself; older ones need the `wheel` package."""
    if importlib.util.find_spec("wheel") is not None:
        return True
    try:
        import setuptools
    except ImportError:
        return False
    major, minor = (int(x) for x in re.findall(r"\d+", setuptools.__version__)[:2])
    return (major, minor) >= (70, 1)


def _install_with_pip(src: Path, target: Path) -> None:
    work = target.parent / "src-copy"  # pip builds in the source tree: keep ours clean
    shutil.copytree(src, work, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__", ".pytest_cache"))
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps",
                           "--no-build-isolation", "--no-index", "-q", "--target", str(target),
                           str(work)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"


def _install_by_hand(src: Path, target: Path) -> None:
    """What pip leaves in ``--target``: the packages and a dist-info with entry points."""
    project = tomllib.loads((src / "pyproject.toml").read_text())["project"]
    for pkg in (src / "src").iterdir():
        if (pkg / "__init__.py").exists():
            shutil.copytree(pkg, target / pkg.name, ignore=shutil.ignore_patterns("__pycache__"))
    dist = target / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    lines = []
    for group, eps in project.get("entry-points", {}).items():
        lines += [f"[{group}]"] + [f"{name} = {value}" for name, value in eps.items()] + [""]
    (dist / "entry_points.txt").write_text("\n".join(lines))
    (dist / "INSTALLER").write_text("tests/plugins/test_entry_points.py\n")


@pytest.fixture(scope="module")
def spf_site(tmp_path_factory):
    """A folder on sys.path holding the installed example; removed after the module."""
    target = tmp_path_factory.mktemp("spf") / "site"
    target.mkdir()
    if _can_build_wheels_offline():
        _install_with_pip(SPF_DIR, target)
    else:
        _install_by_hand(SPF_DIR, target)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD", raising=False)
        mp.delenv("SCHEDKIT_DISABLE_PLUGINS", raising=False)
        mp.syspath_prepend(str(target))
        yield target
    for name in [m for m in sys.modules if m == "schedkit_spf" or m.startswith("schedkit_spf.")]:
        del sys.modules[name]


def _add_requests(sched: Scheduler) -> None:
    for rid, n in PROMPT_LENS.items():
        sched.add_request(make_request(rid, [1] * n, max_tokens=2))


def _admission_order(sched: Scheduler) -> list[str]:
    runner, order = FakeRunner(), []
    while sched.has_requests():
        order += [new.req_id for new in step(sched, runner).scheduler_output.scheduled_new_reqs]
    return order


def test_discover_plugins_lists_the_installed_example(spf_site):
    installed = discover_plugins()
    assert "spf" in installed
    ep = installed["spf"]
    assert ep.value == "schedkit_spf:ShortestPromptFirst"
    assert ep.dist is not None and ep.dist.name == "schedkit-spf"
    cls = ep.load()
    assert cls.__name__ == "ShortestPromptFirst"
    assert Path(sys.modules["schedkit_spf"].__file__).is_relative_to(spf_site)


def test_installed_is_not_enabled(spf_site):
    assert "spf" in discover_plugins()
    pm = get_plugin_manager(config_from_dict({}))
    assert pm.get_plugin("spf") is None
    sched = make_scheduler(max_num_seqs=1)
    assert isinstance(sched.waiting.policy_queue, FCFSQueue)
    _add_requests(sched)
    assert _admission_order(sched) == ["long", "short", "mid"]  # FCFS


def test_policy_spf_admits_shortest_first(spf_site):
    sched = make_scheduler(policy="spf", max_num_seqs=1)
    _add_requests(sched)
    assert _admission_order(sched) == ["short", "mid", "long"]


def test_yaml_switches_spf_on_with_settings(spf_site, tmp_path):
    path = tmp_path / "spf.yaml"
    path.write_text(
        "scheduler:\n"
        "  policy: spf\n"
        "  max_num_seqs: 1\n"
        "plugins:\n"
        "  - name: spf\n"
        "    settings: {aging: 0.5}\n")
    config = load_config(path)
    pm = get_plugin_manager(config)
    assert pm.get_plugin("spf").aging == 0.5
    sched = Scheduler(config.scheduler, config.cache, HookFacade(pm))
    _add_requests(sched)
    assert _admission_order(sched) == ["short", "mid", "long"]


@pytest.mark.parametrize("settings", [{"aging": -1}, {"aging": "fast"}, {"speed": 2}])
def test_bad_settings_of_the_example_name_it(spf_site, settings):
    config = config_from_dict({"scheduler": {"policy": "spf"},
                               "plugins": [{"name": "spf", "settings": settings}]})
    with pytest.raises(PluginError, match="plugin 'spf'") as exc:
        get_plugin_manager(config)
    assert exc.value.plugin == "spf"


def test_unknown_plugin_name_is_a_config_error(spf_site):
    config = config_from_dict({"plugins": [{"name": "no-such-plugin"}]})
    with pytest.raises(ConfigError, match="'no-such-plugin' is not installed") as exc:
        get_plugin_manager(config)
    assert "spf" in str(exc.value)  # the message lists what is installed
    with pytest.raises(ConfigError, match="'lottery'"):
        get_plugin_manager(config_from_dict({"scheduler": {"policy": "lottery"}}))
    with pytest.raises(ConfigError, match="built-in policies are fcfs, priority; did you mean 'fcfs'"):
        get_plugin_manager(config_from_dict({"scheduler": {"policy": "fcsf"}}))


def test_example_package_tests_pass_against_the_installed_package(spf_site):
    path = os.pathsep.join(filter(None, [str(spf_site), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, PYTHONDONTWRITEBYTECODE="1")
    env.pop("SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:benchmark", "-o", "pythonpath=", "tests"],
                          cwd=SPF_DIR, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout


# ------------------------------------------------------------------ fake entry points
class Tracer:
    """A class entry point: the config's settings become keyword arguments."""

    made: list[dict] = []

    def __init__(self, level: int = 1) -> None:
        if not isinstance(level, int) or level < 1:
            raise ValueError(f"level must be an int >= 1, got {level!r}")
        self.level = level
        Tracer.made.append({"level": level})

    @hookimpl
    def schedkit_on_step_end(self, scheduler_output):
        pass


class Typo:
    """Misspells a hook name (``selct``) and names a real one."""

    @hookimpl
    def schedkit_selct_preemption_victim(self, running):
        return running[0]

    @hookimpl
    def schedkit_on_step_end(self, scheduler_output):
        pass


def make_budget_plugin(max_tokens: int) -> object:
    """A factory entry point: any callable returning a plugin object."""

    class Budget:
        @hookimpl
        def schedkit_step_token_budget(self, max_num_batched_tokens):
            return min(max_tokens, max_num_batched_tokens)

    return Budget()


@pytest.fixture
def fake_installed(monkeypatch):
    """Installs fake entry points: classes, a factory, a module, a broken one."""
    monkeypatch.setattr(finish_log_plugin, "finished", [])
    host = types.ModuleType("fake_plugin_host")
    host.Tracer = Tracer
    host.Typo = Typo
    host.make_budget_plugin = make_budget_plugin
    monkeypatch.setitem(sys.modules, "fake_module_plugin", finish_log_plugin)
    monkeypatch.setitem(sys.modules, "fake_plugin_host", host)
    eps = [EntryPoint(name, value, "schedkit") for name, value in [
        ("tracer", "fake_plugin_host:Tracer"),
        ("budget", "fake_plugin_host:make_budget_plugin"),
        ("finish-log", "fake_module_plugin"),
        ("broken", "fake_plugin_host:DoesNotExist"),
        ("typo", "fake_plugin_host:Typo"),
    ]]
    calls = []

    def entry_points(*, group):
        calls.append(group)
        return [ep for ep in eps if ep.group == group]

    monkeypatch.setattr(manager, "entry_points", entry_points)
    monkeypatch.delenv("SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    Tracer.made = []
    return types.SimpleNamespace(calls=calls, module=finish_log_plugin)


def test_fake_installed_plugins_are_not_enabled(fake_installed):
    third_party = set(discover_plugins()) - set(BUNDLED_PLUGINS)
    assert sorted(third_party) == ["broken", "budget", "finish-log", "tracer", "typo"]
    fake_installed.calls.clear()
    pm = get_plugin_manager(config_from_dict({}))
    assert [name for name, _ in pm.list_name_plugin()] == ["defaults", "fcfs", "structured-outputs"]
    assert Tracer.made == [] and fake_installed.calls == []  # not even looked up


def test_settings_are_passed_to_a_class_or_factory(fake_installed):
    config = config_from_dict({"plugins": [{"name": "tracer", "settings": {"level": 3}},
                                           {"name": "budget", "settings": {"max_tokens": 5}}]})
    pm = get_plugin_manager(config)
    assert Tracer.made == [{"level": 3}]
    assert pm.get_plugin("tracer").level == 3
    facade = HookFacade(pm)
    sched = Scheduler(config.scheduler, config.cache, facade)
    sched.add_request(make_request("r", [1] * 20))
    assert sched.schedule().total_num_scheduled_tokens == 5  # budget plugin is on


def test_plugin_settings_argument_switches_plugins_on(fake_installed):
    sched = make_scheduler(plugin_settings={"finish-log": {}, "tracer": {}})
    assert Tracer.made == [{"level": 1}]
    sched.add_request(make_request("r", [1] * 4, max_tokens=1))
    step(sched, FakeRunner())
    assert fake_installed.module.finished == ["r"]


@pytest.mark.parametrize("settings, why", [
    ({"level": 0}, "level must be an int >= 1"),  # the plugin's own validation
    ({"levle": 2}, "unexpected keyword argument 'levle'"),  # unknown setting
])
def test_bad_settings_raise_plugin_error_naming_the_plugin(fake_installed, settings, why):
    config = config_from_dict({"plugins": [{"name": "tracer", "settings": settings}]})
    with pytest.raises(PluginError, match=why) as exc:
        get_plugin_manager(config)
    assert exc.value.plugin == "tracer" and "plugin 'tracer'" in str(exc.value)
    assert exc.value.hook is None


def test_module_entry_point_takes_no_settings(fake_installed):
    get_plugin_manager(config_from_dict({"plugins": [{"name": "finish-log"}]}))
    config = config_from_dict({"plugins": [{"name": "finish-log", "settings": {"x": 1}}]})
    with pytest.raises(PluginError, match="is a module and takes no settings") as exc:
        get_plugin_manager(config)
    assert exc.value.plugin == "finish-log"


def test_entry_point_that_fails_to_load_names_the_plugin(fake_installed):
    with pytest.raises(PluginError, match="'broken' failed to load") as exc:
        get_plugin_manager(config_from_dict({"plugins": [{"name": "broken"}]}))
    assert exc.value.plugin == "broken"


def test_unknown_or_builtin_names_are_config_errors(fake_installed):
    with pytest.raises(ConfigError, match="'nope' is not installed.*'tracer'"):
        get_plugin_manager(config_from_dict({"plugins": [{"name": "nope"}]}))
    with pytest.raises(ConfigError, match="'fifo' is not installed"):
        get_plugin_manager(config_from_dict({"scheduler": {"policy": "fifo"}}))
    with pytest.raises(ConfigError, match="built-in policy"):
        get_plugin_manager(config_from_dict({"plugins": [{"name": "priority"}]}))


def test_autoload_switch_hides_installed_plugins(fake_installed, monkeypatch):
    monkeypatch.setenv("SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert set(discover_plugins()) == set(BUNDLED_PLUGINS)  # schedkit's own stay available
    with pytest.raises(ConfigError, match="'tracer' is not installed"):
        get_plugin_manager(config_from_dict({"plugins": [{"name": "tracer"}]}))


def test_blocked_plugin_is_not_called(fake_installed, monkeypatch):
    """Blocking still applies to plugin objects passed in code (nothing a config asked for)."""
    quiet = types.ModuleType("quiet")
    quiet.schedkit_on_step_end = lambda scheduler_output: None
    monkeypatch.setenv("SCHEDKIT_DISABLE_PLUGINS", "quiet")
    pm = get_plugin_manager(config_from_dict({}), extra_plugins=[quiet])
    assert pm.get_plugin("quiet") is None
    assert [name for name, p in pm.list_name_plugin() if p is not None] == ["defaults", "fcfs", "structured-outputs"]


def test_blocked_plugin_the_config_switches_on_is_refused(fake_installed, monkeypatch, tmp_path):
    monkeypatch.setenv("SCHEDKIT_DISABLE_PLUGINS", "tracer,budget")
    path = tmp_path / "c.yaml"
    path.write_text("scheduler: {max_num_seqs: 4}\nplugins:\n  - name: tracer\n"
                    "  - name: budget\n    settings: {max_tokens: 5}\n")
    with pytest.raises(ConfigError) as exc:
        get_plugin_manager(load_config(path))
    msg = str(exc.value)
    assert msg.startswith(f"{path}:3: plugins: 'tracer' is switched on here but disabled by "
                          "SCHEDKIT_DISABLE_PLUGINS=tracer,budget"), msg
    assert Tracer.made == []  # refused before anything loads
    with pytest.raises(ConfigError, match="'budget' is switched on here.*SCHEDKIT_DISABLE_PLUGINS"):
        get_plugin_manager(config_from_dict({"plugins": [{"name": "budget",
                                                          "settings": {"max_tokens": 5}}]}))


@pytest.mark.parametrize("policy", ["tracer", "priority", "fcfs"])
def test_blocked_policy_is_refused_not_replaced_by_fcfs(fake_installed, monkeypatch, tmp_path, policy):
    monkeypatch.setenv("SCHEDKIT_DISABLE_PLUGINS", policy)
    path = tmp_path / "c.yaml"
    path.write_text(f"cache: {{num_blocks: 64}}\nscheduler:\n  policy: {policy}\n")
    with pytest.raises(ConfigError) as exc:
        get_plugin_manager(load_config(path))
    assert str(exc.value).startswith(
        f"{path}:3: scheduler.policy = {policy!r} is disabled by SCHEDKIT_DISABLE_PLUGINS={policy}")


@pytest.mark.parametrize("builtin", ["defaults", "fcfs"])
def test_blocking_a_builtin_every_scheduler_needs_is_refused(monkeypatch, builtin):
    monkeypatch.setenv("SCHEDKIT_DISABLE_PLUGINS", builtin)
    with pytest.raises(ConfigError, match=f"SCHEDKIT_DISABLE_PLUGINS={builtin} disables the "
                                          f"built-in '{builtin}'"):
        get_plugin_manager(config_from_dict({"scheduler": {"policy": "priority"}}))


def test_unknown_hook_names_the_yaml_line_and_the_closest_hook(fake_installed, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("scheduler:\n  policy: fcfs\nplugins:\n  - name: tracer\n  - name: typo\n")
    with pytest.raises(PluginError) as exc:
        get_plugin_manager(load_config(path))
    msg = str(exc.value)
    assert msg == (f"{path}:5: plugin 'typo' implements unknown hook "
                   "'schedkit_selct_preemption_victim' (did you mean "
                   "'schedkit_select_preemption_victim'?)"), msg
    assert exc.value.plugin == "typo" and exc.value.hook == "schedkit_selct_preemption_victim"


def test_unknown_hook_from_a_compare_profile_names_the_profile_line(fake_installed, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("compare:\n  profiles:\n    - name: a\n    - name: b\n      plugins:\n"
                    "        - name: typo\n")
    from schedkit.lab.compare import profile_config, profiles_of

    config = load_config(path)
    with pytest.raises(PluginError, match=f"^{re.escape(str(path))}:6: plugin 'typo' implements"):
        get_plugin_manager(profile_config(config, profiles_of(config)[1]))


def test_unknown_hook_without_a_close_name_lists_the_hooks():
    class Odd:
        def schedkit_zzz(self):
            pass

    with pytest.raises(PluginError) as exc:
        get_plugin_manager(extra_plugins=[Odd()])
    msg = str(exc.value)
    assert msg.startswith("plugin 'Odd-0' implements unknown hook 'schedkit_zzz'; the hooks are ")
    assert "schedkit_admit_request" in msg and " object at 0x" not in msg
