"""Model runners, found by name in the ``schedkit.runners`` entry-point group (schedkit's
own ``fake``, ``simulated`` and ``paged`` too) and imported only when chosen, so that
``import schedkit`` needs no torch."""

from schedkit.runners.registry import (
    ENTRY_POINT_GROUP,
    configured_runner_class,
    find_runner,
    installed_runners,
    runner_class,
)

__all__ = ["ENTRY_POINT_GROUP", "configured_runner_class", "find_runner", "installed_runners",
           "runner_class"]
