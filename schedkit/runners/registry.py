"""Model runners by name: the ``schedkit.runners`` entry-point group.

Every runner registers the same way, schedkit's own included: a line under
``[project.entry-points."schedkit.runners"]`` in its package's pyproject.toml, naming
the class that ``runner.kind`` chooses. A runner's module is imported only when a config
chooses it, so ``import schedkit`` needs no torch (the paged runner's).

schedkit's own declarations are read from its installed metadata or, when schedkit runs
from a source checkout (on ``PYTHONPATH``, or an editable install made before the
declarations changed), from that checkout's pyproject.toml. Other packages' runners are
left out while ``SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD=1``, as their policy plugins are.
"""

from __future__ import annotations

import functools
import os
import sys
import tomllib
from importlib.metadata import EntryPoint, PackageNotFoundError, distribution, entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schedkit.errors import ConfigError, PluginError

if TYPE_CHECKING:
    from schedkit.config import Config

ENTRY_POINT_GROUP = "schedkit.runners"
AUTOLOAD_ENV = "SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD"
_SCHEDKIT = "schedkit"


def installed_runners() -> dict[str, EntryPoint]:
    """Runners by name: schedkit's own, then other packages' (unless autoload is off).
    A name declared twice keeps its first declaration here; choosing it is an error."""
    found: dict[str, EntryPoint] = {}
    for name, eps in _declared(tuple(sys.path), _is_autoload_off()).items():
        found[name] = eps[0]
    return found


def find_runner(kind: str, where: str | None = None) -> EntryPoint:
    """The entry point that registers runner ``kind`` (nothing is imported).

    Args:
        kind: ``runner.kind``.
        where: ``file:line`` of ``runner.kind`` in the YAML, to start messages with.

    Raises:
        ConfigError: No installed package registers ``kind``, or two do.
    """
    at = f"{where}: " if where else ""
    declared = _declared(tuple(sys.path), _is_autoload_off())
    eps = declared.get(kind)
    if not eps:
        off = (f"; runners of other packages are not loaded while {AUTOLOAD_ENV}=1"
               if _is_autoload_off() else "")
        raise ConfigError(f"{at}runner.kind = {kind!r}: no installed runner has that name (entry-point "
                          f"group '{ENTRY_POINT_GROUP}'); installed: {sorted(declared)}{off}")
    if len(eps) > 1:
        owners = ", ".join(f"{_owner(ep)} ({ep.value})" for ep in eps)
        raise ConfigError(f"{at}runner.kind = {kind!r}: declared by more than one package: {owners}; "
                          "uninstall one of them")
    return eps[0]


def runner_class(kind: str, where: str | None = None) -> Any:
    """The runner class registered as ``kind``, imported on first use.

    Raises:
        ConfigError: ``kind`` is not registered (see :func:`find_runner`), or its module
            says what it needs (the paged runner without torch).
        PluginError: Importing it failed otherwise, or it names no runner class (one
            with ``from_config``).
    """
    ep = find_runner(kind, where)
    at = f"{where}: " if where else ""
    try:
        cls = ep.load()
    except ConfigError:
        raise
    except Exception as e:
        raise PluginError(f"{at}runner {kind!r} failed to load from {ep.value}: "
                          f"{type(e).__name__}: {e}", plugin=kind) from e
    if not callable(getattr(cls, "from_config", None)):
        raise PluginError(f"{at}runner {kind!r}: {ep.value} has no from_config(config); a runner "
                          "class builds itself from the config (docs/writing-plugins.md)", plugin=kind)
    return cls


def configured_runner_class(config: Config) -> Any:
    """The class of the runner ``config.runner.kind`` names; errors name the YAML's line."""
    return runner_class(config.runner.kind, config.where("runner", "kind"))


def _is_autoload_off() -> bool:
    return os.environ.get(AUTOLOAD_ENV) == "1"


@functools.lru_cache(maxsize=8)
def _declared(path: tuple[str, ...], autoload_off: bool) -> dict[str, list[EntryPoint]]:
    """Every declaration of each runner name, schedkit's first. Cached per ``sys.path``
    (a package put on it later is found) and autoload switch."""
    declared: dict[str, list[EntryPoint]] = {}
    for ep in _own_entry_points():
        declared.setdefault(ep.name, []).append(ep)
    if not autoload_off:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if _owner(ep) != _SCHEDKIT:
                declared.setdefault(ep.name, []).append(ep)
    return declared


@functools.cache
def _own_entry_points() -> tuple[EntryPoint, ...]:
    """schedkit's own runners: its checkout's pyproject.toml when it runs from one, else
    its installed metadata."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.is_file():
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
        if project.get("name") == _SCHEDKIT:
            table = project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
            return tuple(EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in table.items())
    try:
        eps = distribution(_SCHEDKIT).entry_points
    except PackageNotFoundError:
        return ()
    return tuple(ep for ep in eps if ep.group == ENTRY_POINT_GROUP)


def _owner(ep: EntryPoint) -> str:
    """The distribution that declares ``ep`` (schedkit for its own checkout's)."""
    dist = ep.dist
    return _SCHEDKIT if dist is None else dist.name.lower().replace("_", "-")
