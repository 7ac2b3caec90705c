"""A plugin switched on by the config (``plugins``, ``router.plugins``, a profile's
``plugins``), with its settings."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from pydantic import Field

from schedkit.config.base import LocatedValueError, StrictModel


class PluginConfig(StrictModel):
    name: str = Field(min_length=1)
    """Entry-point name of an installed plugin (group ``schedkit``)."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """Settings handed to the plugin's factory; the plugin validates them itself."""


def first_repeat(names: Sequence[Hashable]) -> int | None:
    """The index of the first name that an earlier entry already has, or None."""
    seen: set[Hashable] = set()
    for i, name in enumerate(names):
        if name in seen:
            return i
        seen.add(name)
    return None


def check_listed_once(plugins: list[PluginConfig], what: str) -> None:
    """Raises LocatedValueError at the second entry of a plugin listed twice."""
    i = first_repeat([p.name for p in plugins])
    if i is not None:
        raise LocatedValueError(f"{what} {plugins[i].name!r} is listed twice", ("plugins", i, "name"),
                                plugins[i].name)
