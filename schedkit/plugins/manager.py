"""Build the PluginManager: in a function, in a fixed order, with no import-time effects.

Order: hookspecs -> blocked names (``SCHEDKIT_DISABLE_PLUGINS``) -> built-in defaults,
policies and structured-output backends (``trylast``) -> the plugins the config switches
on, loaded from the ``schedkit`` entry-point group (installed is not enabled) -> plugin
objects passed in code -> ``check_pending`` (a misspelt hook name fails here, naming the
plugin, the closest hook name and the config line that switched the plugin on).
A blocked name that the config needs (its policy, a plugin it lists, the built-ins every
scheduler needs) is a ConfigError, never a silent fallback to FCFS; blocking only ever
applies to plugin objects passed in code.
The engine-core process calls the same function, so loading is idempotent per process.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
import os
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy

from schedkit import hookspecs
from schedkit.config import Config, SchedulerConfig
from schedkit.errors import ConfigError, PluginError

ENTRY_POINT_GROUP = "schedkit"
DISABLE_ENV = "SCHEDKIT_DISABLE_PLUGINS"
log = logging.getLogger("schedkit.plugins")
DEFAULTS_PLUGIN = ("defaults", "schedkit.policies.defaults")
STRUCTURED_OUTPUTS_PLUGIN = ("structured-outputs", "schedkit.structured.plugin")
"""The built-in structured-output backends (``auto``, ``xgrammar``, ``python``), ``trylast``."""
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
    "hrrn": "schedkit.policies.hrrn:HighestResponseRatio",
    "residual-sjf": "schedkit.policies.hrrn:ResidualShortestJobFirst",
    "least-computed": "schedkit.policies.victims:LeastComputedFirst",
    "aging": "schedkit.policies.aging:AgingWrapper",
    "priority-preemptive": "schedkit.policies.priority_preemptive:PreemptivePriority",
    "partial-prefill-cap": "schedkit.policies.partial_prefill:PartialPrefillCap",
    "speculate-by-batch": "schedkit.policies.speculation:SpeculateByBatch",
    "speculate-by-acceptance": "schedkit.policies.speculation:SpeculateByAcceptance",
}
BUNDLED_PLUGINS: Mapping[str, str] = {
    **BUNDLED_POLICIES,
    "kv-storage": "schedkit.runners.paged.kv_storage:KVStorage",
    "cpu-offload": "schedkit.runners.paged.kv_offload:CPUOffload",
    "kv-transfer": "schedkit.runners.paged.kv_transfer:KVTransfer",
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


def _instantiate(name: str, obj: Any, settings: Mapping[str, Any], where: str | None = None) -> Any:
    """A module is the plugin itself; a class or factory is called with the settings."""
    at = _at(where)
    if isinstance(obj, types.ModuleType):
        if settings:
            raise PluginError(f"{at}plugin {name!r} is a module and takes no settings, got "
                              f"{sorted(settings)}", plugin=name)
        return obj
    if callable(obj):
        try:
            return obj(**settings)
        except (TypeError, ValueError) as e:
            raise PluginError(f"{at}plugin {name!r}: invalid settings {dict(settings)!r}: {e}",
                              plugin=name) from e
        except Exception as e:  # its constructor is plugin code: whatever it raises
            raise PluginError(f"{at}plugin {name!r}: its constructor raised (settings "
                              f"{dict(settings)!r}): {type(e).__name__}: {e}",
                              plugin=name) from e
    raise PluginError(f"{at}plugin {name!r}: entry point must name a module, class or factory, "
                      f"got {type(obj).__name__}", plugin=name)


def _load_installed(installed: Mapping[str, EntryPoint], name: str, at: str, *,
                    what: str = "plugin", builtins: str = "") -> Any:
    """The object entry point ``name`` names, loaded.

    Raises:
        ConfigError: It is not installed.
        PluginError: Loading it raised.
    """
    ep = installed.get(name)
    if ep is None:
        off = ("; third-party plugins are not loaded while SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD=1"
               if os.environ.get("SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD") == "1" else "")
        raise ConfigError(f"{at}{what} {name!r} is not installed (entry-point group "
                          f"'{ENTRY_POINT_GROUP}'){builtins}; installed: {sorted(installed) or 'none'}{off}")
    try:
        return ep.load()
    except Exception as e:
        raise PluginError(f"{at}{what} {name!r} failed to load from {ep.value}: {e}", plugin=name) from e


def _at(where: str | None) -> str:
    """``"file:line: "`` to start a message with, or nothing for a config from code."""
    return f"{where}: " if where else ""


def _register(pm: pluggy.PluginManager, plugin: Any, name: str, where: str | None = None) -> None:
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as e:
        raise PluginError(f"{_at(where)}plugin {name!r} is invalid: {e}{_argument_hints(plugin)}",
                          plugin=name) from e
    except ValueError as e:  # already registered under this name
        raise PluginError(f"{_at(where)}plugin {name!r}: {e}", plugin=name) from e


def _argument_hints(plugin: Any) -> str:
    """For each hook of ``plugin`` taking an argument its spec does not have: the
    arguments the spec offers, and the closest one to each unknown name."""
    hints = []
    for attr in dir(plugin):
        spec = getattr(hookspecs, attr, None) if attr in hookspecs.ALL_HOOK_NAMES else None
        fn = getattr(plugin, attr, None)
        if spec is None or not callable(fn):
            continue
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            continue
        allowed = list(inspect.signature(spec).parameters)
        unknown = [p for p in params if p not in allowed and p != "self"]
        if not unknown:
            continue
        guesses = []
        for arg in unknown:
            close = difflib.get_close_matches(arg, allowed, n=1)
            guesses.append(f"{arg!r}: did you mean {close[0]!r}?" if close else f"{arg!r}: no such argument")
        hints.append(f"{attr} takes {', '.join(allowed)} ({'; '.join(guesses)})")
    return "".join(f"\n  {h}" for h in hints)


def _blocked() -> list[str]:
    """The names in ``SCHEDKIT_DISABLE_PLUGINS`` (comma-separated)."""
    return [n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()]


def _check_not_blocked(blocked: list[str], policy: str, wanted: Iterable[str],
                       where: Callable[[str], str | None]) -> None:
    """A config never runs without what it switches on: refuse instead of falling back."""
    env = f"{DISABLE_ENV}={os.environ.get(DISABLE_ENV, '')}"
    if policy in blocked:
        raise ConfigError(f"{_at(where(policy))}scheduler.policy = {policy!r} is disabled by "
                          f"{env}; it would run without its policy: unset the variable or "
                          "choose another policy")
    for name in wanted:
        if name in blocked and name != policy:
            raise ConfigError(f"{_at(where(name))}plugins: {name!r} is switched on here but "
                              f"disabled by {env}: remove it from the config or unset the variable")
    for name in (DEFAULTS_PLUGIN[0], "fcfs", STRUCTURED_OUTPUTS_PLUGIN[0]):
        if name in blocked:
            raise ConfigError(f"{env} disables the built-in {name!r}, which every scheduler "
                              "needs (it answers what other plugins leave open)")


def _unknown_hook_error(pm: pluggy.PluginManager, err: pluggy.PluginValidationError,
                        where: Callable[[str], str | None]) -> PluginError:
    """The misspelt hook names of a plugin, each with the closest real hook name."""
    plugin = err.plugin
    name = pm.get_name(plugin) if plugin is not None else None
    unknown = sorted(h.name for h in pm.get_hookcallers(plugin) or () if not h.has_spec())
    if name is None or not unknown:
        return PluginError(f"plugin {name!r}: {err}", plugin=name)
    what = []
    for hook in unknown:
        close = difflib.get_close_matches(hook, hookspecs.ALL_HOOK_NAMES, n=1)
        what.append(f"{hook!r} (did you mean {close[0]!r}?)" if close else repr(hook))
    hint = "" if all("did you mean" in w for w in what) else (
        f"; the hooks are {', '.join(hookspecs.ALL_HOOK_NAMES)}")
    return PluginError(f"{_at(where(name))}plugin {name!r} implements unknown "
                       f"hook{'s' if len(what) > 1 else ''} {', '.join(what)}{hint}",
                       plugin=name, hook=unknown[0])


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
        ConfigError: The policy or a listed plugin is not installed, or is blocked by
            ``SCHEDKIT_DISABLE_PLUGINS`` (as are the built-ins ``defaults``, ``fcfs`` and
            ``structured-outputs``).
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

    def where(name: str) -> str | None:
        return config.where_switched_on(name) if config is not None else None

    blocked = _blocked()
    _check_not_blocked(blocked, policy, wanted, where)
    pm = SchedkitPluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in blocked:  # what is left to block: plugin objects passed in code
        pm.set_blocked(name)
    _register(pm, importlib.import_module(DEFAULTS_PLUGIN[1]), DEFAULTS_PLUGIN[0])
    # Among trylast impls pluggy calls the EARLIEST registered first, so the selected
    # built-in policy goes in before fcfs, which stays as the fallback for what it lacks.
    if policy in BUILTIN_POLICIES and policy != "fcfs":
        _register(pm, importlib.import_module(BUILTIN_POLICIES[policy]), policy)
    _register(pm, importlib.import_module(BUILTIN_POLICIES["fcfs"]), "fcfs")
    _register(pm, importlib.import_module(STRUCTURED_OUTPUTS_PLUGIN[1]), STRUCTURED_OUTPUTS_PLUGIN[0])

    if wanted:
        installed = discover_plugins()
        for name, settings in wanted.items():
            at = _at(where(name))
            if name in BUILTIN_POLICIES:
                listed = [i for i, p in enumerate(config.plugins) if p.name == name] if config is not None else []
                if config is not None and listed:  # the plugins entry, not scheduler.policy's line
                    at = _at(config.where("plugins", listed[0], "name"))
                raise ConfigError(f"{at}plugin {name!r} is a built-in policy; select it with "
                                  f"scheduler.policy instead of listing it under plugins")
            if name == STRUCTURED_OUTPUTS_PLUGIN[0]:
                raise ConfigError(f"{at}plugin {name!r} is built in and always on; choose its "
                                  "backend with structured_outputs.backend instead of listing it "
                                  "under plugins")
            is_policy = name == policy
            close = difflib.get_close_matches(name, [*installed, *(BUILTIN_POLICIES if is_policy else ())], n=1)
            hint = ((f"; the built-in policies are {', '.join(BUILTIN_POLICIES)}" if is_policy else "")
                    + (f"; did you mean {close[0]!r}?" if close else ""))
            obj = _load_installed(installed, name, at, builtins=hint)
            _register(pm, _instantiate(name, obj, settings, where(name)), name, where(name))

    built = _finish(pm, extra_plugins, where)
    if not sched_cfg.num_speculative_tokens:
        _warn_idle_speculation(built, wanted, where)
    return built


_warned_idle: set[tuple[str, str | None]] = set()
"""Plugins already reported by :func:`_warn_idle_speculation` (each once per process)."""


def _warn_idle_speculation(pm: pluggy.PluginManager, wanted: Iterable[str],
                           where: Callable[[str], str | None]) -> None:
    """Log once that a plugin the config switches on implements
    ``schedkit_num_speculative_tokens`` while speculation is off (it is never called);
    plugins passed in code (a replay's own) are left alone."""
    named = set(wanted)
    for impl in pm.hook.schedkit_num_speculative_tokens.get_hookimpls():
        key = (impl.plugin_name, where(impl.plugin_name))
        if impl.plugin_name in named and key not in _warned_idle:
            _warned_idle.add(key)
            log.warning("%s%r implements schedkit_num_speculative_tokens, but "
                        "scheduler.num_speculative_tokens is 0: speculation is off and the hook "
                        "is never called", _at(key[1]), impl.plugin_name)


BUILTIN_ROUTERS: Mapping[str, str] = {
    "round-robin": "schedkit.policies.routers:RoundRobin",
    "least-outstanding": "schedkit.policies.routers:LeastOutstanding",
    "kv-usage": "schedkit.policies.routers:KVUsage",
    "prefix-affinity": "schedkit.policies.routers:PrefixAffinity",
    "session-affinity": "schedkit.policies.routers:SessionAffinity",
    "weighted": "schedkit.policies.routers:Weighted",
    "selective-pd": "schedkit.policies.routers:SelectivePD",
    "rebalance": "schedkit.policies.routers:Rebalance",
    "drain": "schedkit.policies.routers:Drain",
    "slo-headroom": "schedkit.policies.routers:SLOHeadroom",
}
"""The built-in router plugins, by the name ``router.policy`` / ``router.plugins`` use."""
ROUTER_DEFAULT = ("best-score", "schedkit.policies.routers:BestScore")
"""The default picker every router has (``trylast``)."""
DISAGGREGATION_DEFAULT = "selective-pd"
"""The router plugin that decides disaggregation when no other does (``trylast``): on
whenever ``replicas.roles`` is set, with its ``router.plugins`` settings if listed."""


def _load_object(value: str) -> Any:
    module, _, attr = value.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


def get_router_plugin_manager(config: Config, *, extra_plugins: Iterable[Any] = ()) -> pluggy.PluginManager:
    """Build a validated PluginManager for the router of ``config``: the default picker,
    ``router.policy`` and ``router.plugins`` (built-in router names first, then installed
    entry points, group ``schedkit``), then plugin objects passed in code.

    Raises:
        ConfigError: A router plugin that is not installed.
        PluginError: One that fails to load, takes bad settings, implements an unknown
            hook, or implements no router hook at all (an engine policy named as router).
    """
    router = config.router
    wanted: dict[str, Mapping[str, Any]] = {router.policy: {}}
    wanted.update({p.name: p.settings for p in router.plugins})

    def where(name: str) -> str | None:
        return config.where_switched_on(name)

    if config.replicas.roles is not None:
        wanted.setdefault(DISAGGREGATION_DEFAULT, {})
    elif DISAGGREGATION_DEFAULT in wanted:
        raise ConfigError(f"{_at(where(DISAGGREGATION_DEFAULT))}router plugin {DISAGGREGATION_DEFAULT!r} "
                          "decides which requests are disaggregated, which needs replicas.roles "
                          "(e.g. {prefill: 1, decode: 3})")

    blocked = _blocked()
    env = f"{DISABLE_ENV}={os.environ.get(DISABLE_ENV, '')}"
    for name in wanted:
        if name in blocked:
            key = "router.policy" if name == router.policy else "router.plugins"
            raise ConfigError(f"{_at(where(name))}{key}: {name!r} is switched on here but disabled by "
                              f"{env}: remove it from the config or unset the variable")
    if ROUTER_DEFAULT[0] in blocked:
        raise ConfigError(f"{env} disables the built-in router picker {ROUTER_DEFAULT[0]!r}, which "
                          "every router needs")
    pm = SchedkitPluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in blocked:  # what is left to block: plugin objects passed in code
        pm.set_blocked(name)
    _register(pm, _load_object(ROUTER_DEFAULT[1])(), ROUTER_DEFAULT[0])
    _register_front_plugins(pm, wanted, where, BUILTIN_ROUTERS, hookspecs.ROUTER_HOOK_NAMES,
                            what="router plugin", builtins="the built-in routers",
                            no_hook="router hook", hint="; is it an engine policy? Engine policies go "
                                                        "in scheduler.policy or plugins")
    return _finish(pm, extra_plugins, where)


def _register_front_plugins(pm: pluggy.PluginManager, wanted: Mapping[str, Mapping[str, Any]],
                            where: Callable[[str], str | None], builtin: Mapping[str, str],
                            hook_names: Sequence[str], *, what: str, builtins: str, no_hook: str,
                            hint: str = "") -> None:
    """Load, build and register each ``wanted`` plugin of the router's or the flow
    controller's: a built-in by name, else an installed entry point; each must implement
    one of ``hook_names``.

    Raises:
        ConfigError: One that is not installed.
        PluginError: One that fails to load, takes bad settings or implements none of
            ``hook_names``.
    """
    installed: dict[str, EntryPoint] | None = None
    for name, settings in wanted.items():
        at = _at(where(name))
        if name in builtin:
            obj = _load_object(builtin[name])
        else:
            installed = discover_plugins() if installed is None else installed
            obj = _load_installed(installed, name, at, what=what, builtins=f"; {builtins} are {', '.join(builtin)}")
        plugin = _instantiate(name, obj, settings, where(name))
        _register(pm, plugin, name, where(name))
        if not any(h.name in hook_names for h in pm.get_hookcallers(plugin) or ()):
            raise PluginError(f"{at}plugin {name!r} implements no {no_hook} ({', '.join(hook_names)}){hint}",
                              plugin=name)


BUILTIN_FLOW: Mapping[str, str] = {
    "tenant-round-robin": "schedkit.policies.flow:TenantRoundRobin",
    "tenant-weighted": "schedkit.policies.flow:TenantWeighted",
    "queue-depth": "schedkit.policies.flow:QueueDepth",
}
"""The built-in flow-control plugins, by the name ``flow_control`` uses."""
FLOW_DEFAULTS = ("tenant-round-robin", "queue-depth")
"""The fairness plugin and the detector every flow controller has (``trylast``)."""


def get_flow_plugin_manager(config: Config, *, extra_plugins: Iterable[Any] = ()) -> pluggy.PluginManager:
    """Build a validated PluginManager for the flow controller of ``config``: the built-in
    ``tenant-round-robin`` and ``queue-depth`` (``trylast``), ``flow_control.fairness``,
    ``flow_control.saturation`` and ``flow_control.plugins`` (built-in names first, then
    installed entry points), then plugin objects passed in code.

    Raises:
        ConfigError: A flow plugin that is not installed.
        PluginError: One that fails to load, takes bad settings, implements an unknown
            hook, or implements no flow hook.
    """
    flow = config.flow_control
    settings = {p.name: p.settings for p in flow.plugins}
    wanted: dict[str, Mapping[str, Any]] = {name: settings.get(name, {}) for name in FLOW_DEFAULTS}
    wanted.update({flow.fairness: settings.get(flow.fairness, {}), flow.saturation: settings.get(flow.saturation, {})})
    wanted.update(settings)

    def where(name: str) -> str | None:
        return config.where_switched_on(name)

    blocked = _blocked()
    pm = SchedkitPluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in blocked:
        pm.set_blocked(name)
    _register_front_plugins(pm, wanted, where, BUILTIN_FLOW, hookspecs.FLOW_HOOK_NAMES, what="flow plugin",
                            builtins="the built-in flow plugins", no_hook="flow-control hook")
    return _finish(pm, extra_plugins, where)


def _finish(pm: pluggy.PluginManager, extra_plugins: Iterable[Any],
            where: Callable[[str], str | None]) -> pluggy.PluginManager:
    """Register the plugin objects passed in code (last, so they win), then check every
    hook name (a misspelt one fails here, naming the plugin)."""
    for i, plugin in enumerate(extra_plugins):
        name = getattr(plugin, "__name__", None) or f"{type(plugin).__name__}-{i}"
        _register(pm, plugin, name)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as e:
        raise _unknown_hook_error(pm, e, where) from e
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
