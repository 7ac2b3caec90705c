"""Build the PluginManager: in a function, in a fixed order, with no import-time effects.

Order: hookspecs -> blocked names (``SCHEDKIT_DISABLE_PLUGINS``) -> built-in defaults and
policies (``trylast``) -> the plugins the config switches on, loaded from the
``schedkit`` entry-point group (installed is not enabled) -> plugin objects passed in
code -> ``check_pending`` (a misspelt hook name fails here, naming the plugin).
The engine-core process calls the same function, so loading is idempotent per process.
"""

from __future__ import annotations

import importlib
import os
import types
from collections.abc import Iterable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy

from schedkit import hookspecs
from schedkit.config import Config, SchedulerConfig
from schedkit.errors import ConfigError, PluginError

ENTRY_POINT_GROUP = "schedkit"
DEFAULTS_PLUGIN = ("defaults", "schedkit.policies.defaults")
BUILTIN_POLICIES: Mapping[str, str] = {
    "fcfs": "schedkit.policies.fcfs",
    "priority": "schedkit.policies.priority",
}


class SchedkitPluginManager(pluggy.PluginManager):
    """Treats every callable named ``schedkit_*`` as a hook implementation, decorated or
    not (as pytest does for ``pytest_*``), so a misspelt hook name cannot go unnoticed."""

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith(f"{hookspecs.PROJECT}_"):
            method = getattr(plugin, name, None)
            if callable(method):
                return {}
        return opts


BUNDLED_POLICIES: Mapping[str, str] = {
    "sjf": "schedkit.policies.sjf:ShortestJobFirst",
    "edf": "schedkit.policies.edf:EarliestDeadlineFirst",
    "vtc": "schedkit.policies.vtc:VirtualTokenCounter",
    "mlfq": "schedkit.policies.mlfq:MultiLevelFeedbackQueue",
    "lpm": "schedkit.policies.lpm:LongestPrefixMatch",
    "least-computed": "schedkit.policies.victims:LeastComputedFirst",
    "aging": "schedkit.policies.aging:AgingWrapper",
}
BUNDLED_PLUGINS: Mapping[str, str] = {
    **BUNDLED_POLICIES,
    "kv-storage": "schedkit.runners.paged.kv_storage:KVStorage",
}
"""schedkit's own research policies and its KV storage connector: declared as entry points in pyproject.toml, and
known here too so that a source tree that was never pip-installed (a GPU box running
from PYTHONPATH) finds them."""


def discover_plugins() -> dict[str, EntryPoint]:
    """Plugins by entry-point name: schedkit's bundled research policies plus the
    installed ones (third-party autoload is off with SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD=1)."""
    found = {n: EntryPoint(name=n, value=v, group=ENTRY_POINT_GROUP) for n, v in BUNDLED_PLUGINS.items()}
    if os.environ.get("SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD") != "1":
        found.update((ep.name, ep) for ep in entry_points(group=ENTRY_POINT_GROUP))
    return found


def _instantiate(name: str, obj: Any, settings: Mapping[str, Any]) -> Any:
    """A module is the plugin itself; a class or factory is called with the settings."""
    if isinstance(obj, types.ModuleType):
        if settings:
            raise PluginError(f"plugin {name!r} is a module and takes no settings, got "
                              f"{sorted(settings)}", plugin=name)
        return obj
    if callable(obj):
        try:
            return obj(**settings)
        except (TypeError, ValueError) as e:
            raise PluginError(f"plugin {name!r}: invalid settings {dict(settings)!r}: {e}",
                              plugin=name) from e
    raise PluginError(f"plugin {name!r}: entry point must name a module, class or factory, "
                      f"got {type(obj).__name__}", plugin=name)


def _register(pm: pluggy.PluginManager, plugin: Any, name: str) -> None:
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as e:
        raise PluginError(f"plugin {name!r} is invalid: {e}", plugin=name) from e
    except ValueError as e:  # already registered under this name
        raise PluginError(f"plugin {name!r}: {e}", plugin=name) from e


def get_plugin_manager(
    config: Config | None = None,
    *,
    scheduler_config: SchedulerConfig | None = None,
    plugin_settings: Mapping[str, Mapping[str, Any]] | None = None,
    extra_plugins: Iterable[Any] = (),
) -> pluggy.PluginManager:
    """Build a validated PluginManager for one Scheduler.

    Args:
        config: The whole config; its ``scheduler.policy`` and ``plugins`` are used.
        scheduler_config: Used instead of ``config.scheduler`` when no config is given.
        plugin_settings: Extra ``name -> settings`` of entry-point plugins to switch on
            (used when ``config`` is None).
        extra_plugins: Plugin objects (modules or instances) registered after everything
            else, so they win; used by tests and embedding code.

    Raises:
        ConfigError: The policy or a listed plugin is not installed.
        PluginError: A plugin fails to load, takes bad settings or implements an unknown
            hook (the message names the plugin).
    """
    sched_cfg = config.scheduler if config is not None else (scheduler_config or SchedulerConfig())
    wanted: dict[str, Mapping[str, Any]] = {}
    if config is not None:
        wanted.update({p.name: p.settings for p in config.plugins})
    if plugin_settings:
        wanted.update(plugin_settings)
    policy = sched_cfg.policy
    if policy not in BUILTIN_POLICIES:
        wanted.setdefault(policy, {})

    pm = SchedkitPluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in filter(None, os.environ.get("SCHEDKIT_DISABLE_PLUGINS", "").split(",")):
        pm.set_blocked(name.strip())
    _register(pm, importlib.import_module(DEFAULTS_PLUGIN[1]), DEFAULTS_PLUGIN[0])
    # Among trylast impls pluggy calls the EARLIEST registered first, so the selected
    # built-in policy goes in before fcfs, which stays as the fallback for what it lacks.
    if policy in BUILTIN_POLICIES and policy != "fcfs":
        _register(pm, importlib.import_module(BUILTIN_POLICIES[policy]), policy)
    _register(pm, importlib.import_module(BUILTIN_POLICIES["fcfs"]), "fcfs")

    if wanted:
        installed = discover_plugins()
        for name, settings in wanted.items():
            if name in BUILTIN_POLICIES:
                raise ConfigError(f"plugin {name!r} is a built-in policy; select it with "
                                  f"scheduler.policy instead of listing it under plugins")
            ep = installed.get(name)
            if ep is None:
                raise ConfigError(f"plugin {name!r} is not installed (entry-point group "
                                  f"'{ENTRY_POINT_GROUP}'); installed: {sorted(installed) or 'none'}")
            try:
                obj = ep.load()
            except Exception as e:
                raise PluginError(f"plugin {name!r} failed to load from {ep.value}: {e}",
                                  plugin=name) from e
            _register(pm, _instantiate(name, obj, settings), name)

    for i, plugin in enumerate(extra_plugins):
        name = getattr(plugin, "__name__", None) or f"{type(plugin).__name__}-{i}"
        _register(pm, plugin, name)

    try:
        pm.check_pending()
    except pluggy.PluginValidationError as e:
        bad = pm.get_name(e.plugin) if e.plugin is not None else None
        raise PluginError(f"plugin {bad!r}: {e}", plugin=bad) from e
    return pm


def describe_plugins(pm: pluggy.PluginManager) -> list[tuple[str, list[str]]]:
    """Registered plugins with the hooks each implements, in registration order."""
    rows = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:
            continue
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or ())
        rows.append((name, hooks))
    return rows
