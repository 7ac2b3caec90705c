"""What machine this is: the fingerprint a cost-model profile records where it was
fitted, and that loading it compares (no torch: the GPU is read from the driver)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

_NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _gpus(probe: bool) -> list[str]:
    """NVIDIA GPU names from the driver's /proc files; with ``probe``, from ``nvidia-smi``
    where those are not visible (a container)."""
    names = []
    try:
        for info in sorted(_NVIDIA_PROC.glob("*/information")):
            for line in info.read_text().splitlines():
                if line.startswith("Model:"):
                    names.append(line.split(":", 1)[1].strip())
    except OSError:
        pass
    if names or not probe or shutil.which("nvidia-smi") is None:
        return names
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def this_machine(probe_gpu: bool = True, gpu: str | None = None) -> dict[str, Any]:
    """This machine: ``{"cpu": model name, "cpu_count": logical CPUs, "gpu": name or
    None}`` (several GPUs: ``"N x name"``; ``gpu`` overrides what is found)."""
    if gpu is None:
        names = _gpus(probe_gpu)
        if names:
            gpu = names[0] if len(names) == 1 else f"{len(names)} x {names[0]}"
    return {"cpu": _cpu_model(), "cpu_count": os.cpu_count() or 0, "gpu": gpu}


def same_machine(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same CPU model, CPU count and GPU."""
    return all(a.get(k) == b.get(k) for k in ("cpu", "cpu_count", "gpu"))


def describe_machine(m: dict[str, Any]) -> str:
    return f"{m.get('cpu', 'unknown CPU')}, {m.get('cpu_count', '?')} CPUs, {m.get('gpu') or 'no GPU'}"


def cpu_times() -> tuple[int, ...] | None:
    """The machine's CPU time counters (the ``cpu`` line of /proc/stat, in clock ticks:
    user, nice, system, idle, iowait, irq, softirq, steal, ...), or None where there is
    no such file."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    return tuple(int(x) for x in fields[1:])


def steal_share(before: tuple[int, ...] | None, after: tuple[int, ...] | None) -> float | None:
    """The share of CPU time the hypervisor gave to other guests between two
    :func:`cpu_times` readings (0 on a machine of its own; a VM whose cores are shared
    runs slower by about this much), or None when either reading is missing or no time
    passed."""
    if before is None or after is None:
        return None
    delta = [a - b for a, b in zip(after, before, strict=False)]
    total = sum(delta[:8])
    return delta[7] / total if total > 0 else None
