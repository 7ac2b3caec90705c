"""Admission limits and pause states of vLLM 0.32 (docs/scheduler-behaviour.md#active-limit,
docs/scheduler-behaviour.md#pause-all, docs/scheduler-behaviour.md#pause-new)."""

from __future__ import annotations

import pytest

from schedkit.config import SchedulerConfig
from schedkit.core.outputs import KVConnectorOutput
from schedkit.core.scheduler import PauseState
from schedkit.plugins.testing import (
    make_request,
    make_requests,
    make_scheduler,
    step,
)


def test_adaptive_long_prefill_threshold():  # docs/scheduler-behaviour.md#threshold-needs-company
    sched = make_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=100)
    sched.scheduler_config = sched.scheduler_config.model_copy(
        update={"long_prefill_token_threshold_adaptive": True})
    for i in range(3):
        sched.add_request(make_request(str(i), [i + 1] * 800))
    assert sched.schedule().num_scheduled_tokens == {"0": 341, "1": 341, "2": 341}


def test_max_num_active_seqs_limits_admission_only():
    sched = make_scheduler(max_num_seqs=4)
    sched.max_num_active_seqs = 2
    for r in make_requests(3, max_tokens=4):
        sched.add_request(r)
    out = step(sched, sampled=7).scheduler_output
    assert list(out.num_scheduled_tokens) == ["0", "1"] and len(sched.waiting) == 1
    for _ in range(10):
        out = step(sched, sampled=7).scheduler_output
        assert len(sched.running) <= 2
        if "2" in out.num_scheduled_tokens:
            break  # admitted once one of the two finished
    assert "2" in out.num_scheduled_tokens and not sched.waiting


def test_max_num_active_seqs_is_validated():
    with pytest.raises(ValueError, match="max_num_active_seqs"):
        SchedulerConfig(max_num_seqs=4, max_num_active_seqs=5)


def test_paused_all_schedules_nothing_and_keeps_state():
    sched = make_scheduler()
    for r in make_requests(2, max_tokens=5):
        sched.add_request(r)
    step(sched, sampled=7)
    sched.set_pause_state(PauseState.PAUSED_ALL)
    assert not sched.has_requests() and sched.get_num_unfinished_requests() == 0
    out = step(sched, sampled=7).scheduler_output
    assert not out.num_scheduled_tokens
    assert [r.num_output_tokens for r in sched.running] == [1, 1]
    sched.set_pause_state(PauseState.UNPAUSED)
    assert sched.has_requests()
    assert step(sched, sampled=7).scheduler_output.num_scheduled_tokens == {"0": 1, "1": 1}


def test_paused_new_runs_running_requests_and_admits_only_loaded_ones():
    from tests.core.test_async_kv_loads import h4, prompt

    sched, _ = h4()
    sched.add_request(make_request("local-0", prompt(1, 10)))
    sched.add_request(make_request("remote-1", prompt(2, 40)))  # its load starts
    step(sched, sampled=7)
    sched.set_pause_state(PauseState.PAUSED_NEW)
    sched.add_request(make_request("local-2", prompt(3, 10)))
    assert sched.get_num_unfinished_requests() == 2  # running + loading, not the new one
    step(sched, sampled=7, kv_connector_output=KVConnectorOutput(finished_recving={"remote-1"}))
    out = step(sched, sampled=7).scheduler_output
    assert set(out.num_scheduled_tokens) == {"local-0", "remote-1"}  # the loaded one is admitted
    assert [r.request_id for r in sched.waiting] == ["local-2"]
    sched.set_pause_state(PauseState.UNPAUSED)
    assert "local-2" in step(sched, sampled=7).scheduler_output.num_scheduled_tokens


def test_engine_pause_state_in_process_and_through_the_utility_call():
    from schedkit.config import config_from_dict
    from schedkit.core.request import Request, SamplingParams
    from schedkit.engine.core import EngineCore
    from schedkit.errors import ConfigError, SchedkitError
    from schedkit.llm import LLM

    config = config_from_dict({"runner": {"kind": "fake", "vocab_size": 100}})
    engine = EngineCore(config)
    engine.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=4), 0.0))
    engine.step()
    engine.set_pause_state("paused_all")
    assert engine.stats()["pause_state"] == "paused_all"
    steps = engine.num_steps
    assert not engine.has_requests() and engine.step() == {} and engine.num_steps == steps
    with pytest.raises(ConfigError, match="paused_new"):
        engine.set_pause_state("sleep")
    engine.set_pause_state("unpaused")
    while engine.has_requests():
        engine.step()
    assert engine.scheduler.requests == {}
    with LLM(config) as llm:
        assert llm.call_utility("set_pause_state", "paused_new") == "paused_new"
        with pytest.raises(SchedkitError, match="pause state must be one of"):
            llm.call_utility("set_pause_state", "later")
        assert llm.call_utility("set_pause_state", "unpaused") == "unpaused"
        out = llm.generate([[1, 2, 3]], [SamplingParams(max_tokens=2)], use_tqdm=False)
        assert len(out[0].output_token_ids) == 2
