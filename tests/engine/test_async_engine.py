"""The engine with async scheduling: two steps in flight, same tokens as synchronous."""

from __future__ import annotations

import pytest

from schedkit import hookimpl
from schedkit.core.request import Request, RequestStatus
from schedkit.engine.core import EngineCore
from schedkit.errors import SchedkitError
from schedkit.llm import LLM
from schedkit.plugins.testing import drive_engine
from tests.engine.test_engine_proc import prompts_and_params, run_in_process


class InFlightWatcher:
    """Records, per step, which scheduled requests still had output placeholders."""

    def __init__(self):
        self.engine = None
        self.max_in_flight = 0
        self.rescheduled_before_update = 0

    @hookimpl
    def schedkit_on_step_end(self, scheduler_output):
        sched = self.engine.scheduler
        self.max_in_flight = max(self.max_in_flight, self.engine.num_steps_in_flight)
        self.rescheduled_before_update += sum(
            1 for rid in scheduler_output.num_scheduled_tokens
            if rid in sched.requests and sched.requests[rid].num_output_placeholders)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_async_engine_gives_the_same_tokens_as_sync(small_config, policy):
    prompts, params = prompts_and_params()
    priorities = [i % 3 for i in range(len(prompts))]
    expected = run_in_process(small_config(policy), prompts, params, priorities)
    watcher = InFlightWatcher()
    engine = EngineCore(small_config(policy, async_scheduling=True), extra_plugins=[watcher])
    watcher.engine = engine
    reqs = [Request(f"0-{i}", p, sp, arrival_time=engine.now(), priority=priorities[i])
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    for r in reqs:
        engine.add_request(r)
    while engine.has_requests():
        engine.step()
    for got, want in zip(reqs, expected, strict=True):
        assert got.output_token_ids == want.output_token_ids
        assert got.status is want.status
    assert sum(r.num_preemptions for r in reqs) > 0, "the workload must preempt"
    assert watcher.max_in_flight == 1  # the other step is in flight while one is processed
    assert watcher.rescheduled_before_update > 100
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1


def test_aborts_while_two_steps_are_in_flight(small_config):
    prompts, params = prompts_and_params()
    engine = EngineCore(small_config(async_scheduling=True))
    reqs = [Request(f"r{i}", p, sp, arrival_time=engine.now()) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    for r in reqs:
        engine.add_request(r)
    aborted = set()
    step = 0
    while engine.has_requests():
        engine.step()
        step += 1
        if step % 7 == 0:
            victim = reqs[(step // 7) % len(reqs)]
            if not victim.is_finished:
                assert engine.abort_requests([victim.request_id])
                aborted.add(victim.request_id)
                assert engine.num_steps_in_flight in (0, 1)
    assert aborted
    for r in reqs:
        assert r.is_finished
        if r.request_id in aborted:
            assert r.status is RequestStatus.FINISHED_ABORTED
        assert r.num_output_tokens <= r.max_tokens
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1


def test_engine_process_with_async_scheduling(small_config):
    config = small_config(async_scheduling=True)
    prompts, params = prompts_and_params(12)
    expected = run_in_process(config, prompts, params, [0] * len(prompts))
    with LLM(config) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == [r.output_token_ids for r in expected]


def test_reset_prefix_cache_utility_takes_reset_running_requests(small_config):
    with LLM(small_config(async_scheduling=True)) as llm:
        prompts, params = prompts_and_params(4)
        llm.generate(prompts, params, use_tqdm=False)
        assert llm.call_utility("reset_prefix_cache") is True
        assert llm.call_utility("reset_prefix_cache", True) is True
        with pytest.raises(SchedkitError, match="one optional bool"):
            llm.call_utility("reset_prefix_cache", "yes")
        assert llm.call_utility("stats")["num_running"] == 0  # still serving


class FailingLaunches:
    """A fake runner whose ``fail_at``-th step fails when its tokens are collected."""

    is_virtual_clock = True

    def __init__(self, fail_at):
        from schedkit.runners.fake import FakeRunner

        self.inner = FakeRunner(vocab_size=1000)
        self.fail_at, self.launched = fail_at, 0

    def initialize(self, num_blocks, block_size):
        return num_blocks

    def execute(self, so):
        raise AssertionError("the engine must launch asynchronously")

    def execute_async(self, so):
        self.launched += 1
        out = self.inner.execute(so)
        failing = self.launched == self.fail_at

        class Handle:
            def result(self):
                if failing:
                    raise RuntimeError("device fault")
                return out

        return Handle()

    def propose_draft_token_ids(self, k):
        return {}


def test_a_step_failing_while_another_is_in_flight_fails_only_its_requests(small_config):
    config = small_config(async_scheduling=True)
    engine = EngineCore(config, runner=FailingLaunches(fail_at=3))
    prompts, params = prompts_and_params(8)
    reqs = [Request(f"r{i}", p, sp, arrival_time=engine.now()) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    _, errors = drive_engine(engine, reqs)
    assert errors and all("device fault" in e for e in errors.values())
    for r in reqs:
        assert r.is_finished
        if r.request_id in errors:
            assert r.status is RequestStatus.FINISHED_ERROR
        else:
            assert r.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
    assert len(errors) < len(reqs)  # the others were served
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1
