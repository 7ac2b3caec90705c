"""Plugins whose answers are valid but never let anything run must not spin the engine
forever: after STALL_STEPS empty steps and STALL_S seconds
the waiting requests fail with a message saying why."""

from __future__ import annotations

import pytest

from schedkit import AdmissionDecision, hookimpl
from schedkit.config import config_from_dict
from schedkit.core.request import Request, SamplingParams
from schedkit.engine import core
from schedkit.engine.core import EngineCore
from tests.core.test_queue_errors import drive


class ZeroBudget:
    @hookimpl
    def schedkit_step_token_budget(self):
        return 0


class AlwaysSkip:
    @hookimpl
    def schedkit_admit_request(self):
        return AdmissionDecision.SKIP


@pytest.mark.parametrize("plugin", [ZeroBudget(), AlwaysSkip()], ids=["budget0", "skip"])
def test_a_policy_that_never_schedules_fails_its_requests_instead_of_spinning(plugin, monkeypatch):
    monkeypatch.setattr(core, "STALL_STEPS", 50)
    monkeypatch.setattr(core, "STALL_S", 0.05)
    engine = EngineCore(config_from_dict({"runner": {"kind": "fake"}}), extra_plugins=[plugin])
    for i in range(3):
        engine.add_request(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=0.0))
    res = drive(engine, max_steps=100_000)
    assert sorted(res) == ["r0", "r1", "r2"]
    for outs in res.values():
        assert outs[-1].finish_reason == "error" and "no progress" in outs[-1].error
    assert not engine.has_requests()


def test_a_healthy_engine_never_trips_the_stall_guard(monkeypatch):
    monkeypatch.setattr(core, "STALL_STEPS", 1)
    monkeypatch.setattr(core, "STALL_S", 0.0)
    engine = EngineCore(config_from_dict({"runner": {"kind": "fake"}}))
    for i in range(3):
        engine.add_request(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=0.0),
                           arrival_offset=0.1 * i)
    res = drive(engine)
    assert all(outs[-1].finish_reason == "length" for outs in res.values())


def test_a_stalled_virtual_clock_still_reaches_later_arrivals(monkeypatch):
    """Empty steps do not move a virtual clock: the engine jumps to the next arrival, so
    a request held for later arrives, and the stall rule then fails them all."""
    monkeypatch.setattr(core, "STALL_STEPS", 50)
    monkeypatch.setattr(core, "STALL_S", 0.05)
    engine = EngineCore(config_from_dict({"runner": {"kind": "fake"}}), extra_plugins=[AlwaysSkip()])
    engine.add_request(Request("now", [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=0.0))
    engine.add_request(Request("later", [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=0.0),
                       arrival_offset=1.0)
    res = drive(engine, max_steps=100_000)
    assert {rid: outs[-1].finish_reason for rid, outs in res.items()} == {"now": "error", "later": "error"}
    assert engine.now() >= 1.0
