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
pytestmark = pytest.mark.skipif(not (ORACLE / "reference").is_dir(),
                                reason="../shared/oracle is not beside this checkout")


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


NAMES = sorted(p.name.removesuffix(".jsonl.gz") for p in (ORACLE / "reference").glob("*.jsonl.gz")) \
    if (ORACLE / "reference").is_dir() else []


@pytest.mark.parametrize("name", NAMES)
def test_same_decisions_as_vllm(name, tmp_path):
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
