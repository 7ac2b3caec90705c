"""Replays vLLM 0.32's recorded decisions (../shared/oracle) through our scheduler.

Each reference log holds vLLM's own step-by-step decisions on a trace; our built-in
FCFS and priority policies must make the same ones (scheduled spans, new, resumed,
preempted, finished) at every step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ORACLE = Path(os.environ.get("SCHEDKIT_SHARED", Path(__file__).resolve().parents[3] / "shared")) / "oracle"
MISSING = None if (ORACLE / "reference").is_dir() else (
    f"../shared/oracle is missing (no {ORACLE / 'reference'}; set SCHEDKIT_SHARED to the folder "
    "that holds oracle/): vLLM's recorded decisions are not beside this checkout")


def in_ci() -> bool:
    """CI sets ``CI`` (.ci/run exports CI=1, as hosted CI services do)."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def require_oracle() -> None:
    """In CI, which always has ../shared, a missing oracle fails; elsewhere it skips."""
    if MISSING is None:
        return
    if in_ci():
        pytest.fail(f"{MISSING}; CI must run the oracle", pytrace=False)
    pytest.skip(MISSING)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"oracle_{name}", ORACLE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _trace(name: str) -> dict:
    if name in ("mixed", "mixed256", "mixed256-priority"):
        base = "mixed" if name == "mixed" else "mixed256"
        text = subprocess.check_output([sys.executable, str(ORACLE / "gen_trace.py"), base])
        trace = json.loads(text)
        if name.endswith("priority"):
            trace["config"]["policy"] = "priority"
        return trace
    return json.loads((ORACLE / "traces" / f"{name}.json").read_text())


# Without the oracle, one item stands for all traces and says why it did not run.
NAMES = sorted(p.name.removesuffix(".jsonl.gz") for p in (ORACLE / "reference").glob("*.jsonl.gz")) \
    if MISSING is None else ["oracle-missing"]


# The 2,000-request traces take seconds each: slow tier.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n.startswith("mixed") else n
                                  for n in NAMES])
def test_same_decisions_as_vllm(name, tmp_path):
    require_oracle()
    drive, compare = _load("drive_schedkit"), _load("compare_logs")
    trace_path = tmp_path / f"{name}.json"
    trace_path.write_text(json.dumps(_trace(name)))
    cfg, reqs = drive.load(str(trace_path))
    log_path = tmp_path / f"{name}.jsonl"
    with open(log_path, "w") as log:
        summary, _ = drive.run(cfg, reqs, log)
        log.write(json.dumps({"type": "summary", **summary}) + "\n")
    verdict = compare.compare(str(ORACLE / "reference" / f"{name}.jsonl.gz"), str(log_path))
    assert verdict["identical"], verdict
    assert summary["unfinished"] == 0
