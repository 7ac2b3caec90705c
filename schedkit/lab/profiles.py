"""The cost-model profile a calibration writes: the coefficients the simulator loads
(:meth:`schedkit.runners.cost_model.CostModel.load`), and what they were fitted on: the
machine, the versions, the config, the phases run and the fit's residuals."""

from __future__ import annotations

import json
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from schedkit.config import Config
from schedkit.lab.calibrate import Calibration
from schedkit.runners.cost_model import CostModel, profile_path
from schedkit.runners.machine import this_machine

_REPO = Path(__file__).resolve().parents[2]
CONFIG_SECTIONS = {"model", "runner", "cache", "scheduler", "plugins", "workload"}
"""The config sections a profile records."""


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    """``git describe`` of the schedkit checkout, where it is one."""
    if not (_REPO / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(_REPO), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def versions() -> dict[str, str | None]:
    """schedkit (and its git commit, from a checkout), torch (None without it), Python."""
    return {"schedkit": _version("schedkit"), "schedkit_commit": _commit(), "torch": _version("torch"),
            "python": platform.python_version()}


def machine(device_name: str | None = None) -> dict[str, Any]:
    """This machine's fingerprint, with the runner's accelerator where the driver's
    files did not name one."""
    m = this_machine()
    if m["gpu"] is None and device_name:
        m["gpu"] = device_name
    return m


def profile_payload(name: str, calibration: Calibration, config: Config, config_path: str,
                    description: str | None = None) -> dict[str, Any]:
    """The profile's JSON object."""
    model = calibration.model
    rc = config.runner
    where = getattr(rc, "device", rc.kind)
    overall = calibration.residuals.get("overall", {})
    if description is None:
        description = (f"Fitted by schedkit calibrate to {len(calibration.records)} steps of {config_path} "
                       f"({config.model.name}, {config.model.dtype}, {where}) in {calibration.wall_s:.0f} s.")
    return {
        "name": name, "description": description, "fitted": True,
        "hardware": machine(calibration.device_name), "versions": versions(),
        "fitted_on": {"config": config_path, "async_scheduling": config.scheduler.async_scheduling,
                      "sections": config.model_dump(mode="json", include=CONFIG_SECTIONS)},
        "calibration": {"wall_s": round(calibration.wall_s, 1), "budget_s": calibration.budget_s,
                        "steal_share": calibration.steal,
                        "phases": [p.to_dict() for p in calibration.phases]},
        "num_steps": len(calibration.records),
        "mean_relative_step_error": overall.get("mean"),
        "residuals": calibration.residuals,
        "coefficients": model.coefficients,
        "decode_batch_residual_s": {str(b): t for b, t in model.decode_batch_residual_s},
        **_workers(model),
        **({"speed_probe": {"ratio": calibration.probe_ratio, "runs": calibration.num_probes,
                            **{k: v for k, v in (("decode", calibration.probe_ratio_decode),
                                                 ("prefill", calibration.probe_ratio_prefill)) if v is not None}}}
           if calibration.probe_ratio is not None else {}),
    }


def minimal_payload(name: str, model: CostModel, description: str) -> dict[str, Any]:
    """A profile with coefficients only (hand-set, or fitted outside a calibration)."""
    return {"name": name, "description": description, "coefficients": model.coefficients,
            "decode_batch_residual_s": {str(b): t for b, t in model.decode_batch_residual_s},
            **_workers(model), **_prefill_scale(model)}


def _prefill_scale(model: CostModel) -> dict[str, float]:
    return {"prefill_scale": model.prefill_scale} if model.prefill_scale != 1.0 else {}


def _workers(model: CostModel) -> dict[str, int]:
    return {"attention_workers": model.attention_workers} if model.attention_workers else {}


def rescaled_payload(source: str, ratio: float, probe_s: float, config_path: str,
                     steal: float | None = None, prefill_ratio: float | None = None) -> dict[str, Any]:
    """Profile ``source`` (a name or a path) with every duration multiplied by ``ratio``
    (the speed probe's measured over predicted step time), the steps with a prompt
    chunk by ``prefill_ratio`` where given (the profile's ``prefill_scale``), recording
    the rescale: the same shape, re-anchored to the machine's speed now."""
    path = profile_path(source)
    data = json.loads(path.read_text())
    model = CostModel.from_profile(data, default_name=path.stem).scaled(ratio, prefill_ratio)
    data["coefficients"] = model.coefficients
    data.pop("prefill_scale", None)
    data.update(_prefill_scale(model))
    data["decode_batch_residual_s"] = {str(b): t for b, t in model.decode_batch_residual_s}
    if data.get("kv_transfer"):
        scaled = {"latency_s": model.kv_transfer_latency_s, "per_block_s": model.per_block_transfer_s}
        data["kv_transfer"] = {**data["kv_transfer"], **{k: v for k, v in scaled.items() if v is not None}}
    data["rescaled"] = {"from": str(source), "ratio": ratio, **({} if prefill_ratio is None else
                                                                {"prefill_ratio": prefill_ratio}),
                        "probe_step_s": probe_s, "config": config_path,
                        "date": time.strftime("%Y-%m-%d %H:%M"), "steal_share": steal}
    return data


def write_profile(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")
