"""Where a measurement was taken: the machine and the commit, as result files record them."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

from schedkit.runners.machine import this_machine

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    """``CPU model, N cores, Python X.Y.Z``."""
    m = this_machine(probe_gpu=False)
    return f"{m['cpu']}, {m['cpu_count']} cores, Python {platform.python_version()}"


def commit(*, ignore: tuple[str, ...] = ()) -> str:
    """The checkout's short commit, ``+dirty`` when a tracked file differs from it (the
    ``ignore`` paths, e.g. the results file a run writes, left out)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    rev = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", *(f":!{p}" for p in ignore))
    return rev + ("+dirty" if dirty else "")
