"""Where schedkit keeps files between runs."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where schedkit keeps files between runs (converted and built-in models, stored
    KV): ``$SCHEDKIT_CACHE_DIR`` or ``$XDG_CACHE_HOME/schedkit`` (default
    ``~/.cache/schedkit``)."""
    env = os.environ.get("SCHEDKIT_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "schedkit"
