"""scripts/tenant_isolation.py at a small scale: behind a real engine process, a tenant
sending ten times its share past the engine's capacity makes the others wait behind its
backlog without flow control, and not with it (the heavy tenant's excess is refused at
the door instead)."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from schedkit.config import config_from_dict

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]  # two runs of a few seconds, real time

_spec = importlib.util.spec_from_file_location(
    "tenant_isolation", Path(__file__).resolve().parents[2] / "scripts" / "tenant_isolation.py")
assert _spec is not None and _spec.loader is not None
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


def test_the_door_keeps_a_flooding_tenant_from_the_others_latency():
    # One engine running 2 requests of 8 tokens at 10 ms a step: about 20 requests/s.
    # The three well-behaved tenants send 3.5/s each, heavy 35/s: over twice what it serves.
    base = config_from_dict({
        "runner": {"kind": "fake", "clock": "wall", "step_time_ms": 10},
        "scheduler": {"max_num_seqs": 2},
        "flow_control": {"enabled": True, "queue_timeout_s": 1.0,
                         "plugins": [{"name": "queue-depth", "settings": {"max_waiting": 0}}]}})
    schedule = study.arrivals(3.5, 10.0, 3.0, seed=1)

    def run(mode: str) -> dict:
        return asyncio.run(study.run_case(study.variant(base, mode), schedule, prompt_len=8, max_tokens=8))

    off, on = run("off"), run("tenant-round-robin")
    # Off: heavy's backlog grows by ~25 requests a second; the late well-behaved requests
    # wait behind it (about two seconds by the end). On: a few turns of the door at most.
    assert on["good_ttft_p99_s"] < off["good_ttft_p99_s"] / 2, (on, off)
    assert off["max_engine_waiting"] > 10 and on["max_engine_waiting"] <= 2, (on, off)
    assert sum(t["refused_429"] for t in off["tenants"].values()) == 0
    assert all(on["tenants"][t]["refused_429"] == 0 for t in study.GOOD), on
    assert on["tenants"][study.HEAVY]["refused_429"] > 0, on
