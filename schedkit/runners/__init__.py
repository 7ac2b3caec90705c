"""Model runners, imported lazily by name so that ``import schedkit`` needs no torch."""

from __future__ import annotations

import importlib
from typing import Any

from schedkit.errors import ConfigError

RUNNERS: dict[str, tuple[str, str]] = {
    "fake": ("schedkit.runners.fake", "FakeRunner"),
    "simulated": ("schedkit.runners.simulated", "SimulatedRunner"),
    "paged": ("schedkit.runners.paged.model_runner", "PagedModelRunner"),
}


def runner_class(kind: str) -> Any:
    """The runner class registered under ``kind`` (imported on first use)."""
    try:
        module, name = RUNNERS[kind]
    except KeyError:
        raise ConfigError(f"runner.kind = {kind!r}: not available in this version "
                          f"(available: {sorted(RUNNERS)})") from None
    return getattr(importlib.import_module(module), name)
