"""Voluntary preemption (``schedkit_select_voluntary_preemptions``): same recompute
semantics and accounting as KV-pressure preemption, the victims back in the waiting
queue by the policy's order and not re-admitted in the same step, admissions still
made, a per-step bound, and nothing called when no plugin implements it."""

from __future__ import annotations

import random

import pytest

from schedkit import Preemption, hookimpl
from schedkit.core.request import RequestStatus
from schedkit.errors import PluginError
from schedkit.plugins.testing import assert_scheduler_consistent, make_request, make_scheduler, step


class PreemptAtRandom:
    """Preempts up to ``k`` random running requests whenever someone waits."""

    def __init__(self, seed: int, k: int = 2, rate: float = 0.3) -> None:
        self.rng, self.k, self.rate = random.Random(seed), k, rate
        self.calls = 0

    @hookimpl
    def schedkit_select_voluntary_preemptions(self, running, max_preemptions):
        self.calls += 1
        if self.rng.random() >= self.rate:
            return None
        n = min(len(running), self.k, max_preemptions)
        return [Preemption(r, "random") for r in self.rng.sample(list(running), n)]


def _requests(n=14, seed=0):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 30000) for _ in range(48)]
    return [make_request(f"r{i}", (shared if i % 2 else []) + [rng.randrange(3, 30000)
                                                              for _ in range(rng.randint(10, 90))],
                         max_tokens=rng.randint(5, 60), arrival_time=float(i)) for i in range(n)]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_recompute_accounting_holds_under_voluntary_preemption(async_scheduling, prefix_caching):
    plugin = PreemptAtRandom(seed=3)
    sched = make_scheduler(plugins=[plugin], max_num_seqs=4, num_blocks=400,
                           enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling)
    reqs = _requests()
    for r in reqs:
        sched.add_request(r)
    scheduled = dict.fromkeys((r.request_id for r in reqs), 0)
    tokens = dict.fromkeys(scheduled, 0)
    for _ in range(3000):
        if not sched.has_requests():
            break
        res = step(sched, sampled=7)
        for rid, n in res.scheduler_output.num_scheduled_tokens.items():
            scheduled[rid] += n
        for o in res.outputs:
            tokens[o.request_id] += len(o.new_token_ids)
    assert not sched.has_requests()
    assert sum(sched.voluntary_preemptions.values()) >= 10
    assert sched.num_preemptions_total == sum(sched.voluntary_preemptions.values())  # no KV pressure
    for r in reqs:
        assert tokens[r.request_id] == r.max_tokens == r.num_output_tokens  # none lost or doubled
        if not async_scheduling:  # async schedules placeholder positions of the last step too
            first_time = r.num_prompt_tokens + r.num_output_tokens - 1 - r.num_cached_tokens
            assert scheduled[r.request_id] == first_time + r.num_recomputed_tokens, r
    assert_scheduler_consistent(sched, reqs)


class PreemptTheOldest:
    """Preempts running[0] every time someone waits, and records what it sees."""

    def __init__(self) -> None:
        self.seen = []

    @hookimpl
    def schedkit_select_voluntary_preemptions(self, running, waiting, max_num_running):
        self.seen.append(([r.request_id for r in running], [r.request_id for r in waiting],
                          max_num_running))
        return [running[0]]


def test_victims_join_the_queue_by_its_order_and_sit_out_the_step():
    plugin = PreemptTheOldest()
    sched = make_scheduler(plugins=[plugin], max_num_seqs=2)
    a, b, c, d = (make_request(x, [i + 1] * 8, max_tokens=20, arrival_time=float(i))
                  for i, x in enumerate("abcd"))
    for r in (a, b, c, d):
        sched.add_request(r)
    step(sched, sampled=7)  # a and b run; c, d wait
    out = step(sched, sampled=7).scheduler_output
    assert plugin.seen[0] == (["a", "b"], ["c", "d"], 2)
    assert out.preempted_req_ids == {"a"} and a.status is RequestStatus.PREEMPTED
    # FCFS queue: "a" goes to the tail with add (not back to the head), and the freed seat
    # goes to "c" in the same step: admissions are not stopped by a voluntary preemption.
    assert [r.req_id for r in out.scheduled_new_reqs] == ["c"]
    assert [r.request_id for r in sched.waiting] == ["d", "a"]
    assert a.num_preemptions == 1 and sched.voluntary_preemptions == {"PreemptTheOldest-0": 1}


def test_a_victim_is_not_admitted_again_in_the_same_step():
    plugin = PreemptTheOldest()
    sched = make_scheduler(plugins=[plugin], max_num_seqs=2)
    a, b, c = (make_request(x, [i + 1] * 8, max_tokens=20, arrival_time=float(i))
               for i, x in enumerate("abc"))
    for r in (a, b, c):
        sched.add_request(r)
    step(sched, sampled=7)
    sched.max_num_active_seqs = 3  # a seat is free: c is admitted; a must still sit out
    out = step(sched, sampled=7).scheduler_output
    assert "a" in out.preempted_req_ids and [r.req_id for r in out.scheduled_new_reqs] == ["c"]
    assert "a" not in out.num_scheduled_tokens
    assert_scheduler_consistent(sched, [a, b, c])


class Greedy:
    def __init__(self, answer) -> None:
        self.answer = answer
        self.calls = 0

    @hookimpl
    def schedkit_select_voluntary_preemptions(self, running):
        self.calls += 1
        return self.answer(running)


@pytest.mark.parametrize("answer,why", [
    (lambda running: list(running), "at most 1"),
    (lambda running: [running[0]] * 2, "twice"),
    (lambda running: "r0", "sequence of running requests"),
    (lambda running: [make_request("x", [1, 2])], "one of the running requests"),
    (lambda running: [Preemption(running[0], 7)], "reason must be a string"),
    (lambda running: [Preemption(running[0], "r", save_kv="yes")], "save_kv must be"),
])
def test_impossible_answers_fail_the_step_and_undo_it(answer, why):
    sched = make_scheduler(plugins=[Greedy(answer)], max_num_seqs=2,
                           max_voluntary_preemptions=2 if why == "twice" else 1)
    reqs = [make_request(f"r{i}", [i + 1] * 8, max_tokens=5, arrival_time=float(i)) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    step(sched, sampled=7)
    before = [(r.status, r.num_computed_tokens) for r in reqs]
    with pytest.raises(PluginError, match=why) as err:
        sched.schedule()
    # a step-wide answer: no request named in it is blamed (the engine would fail it)
    assert err.value.request_id is None and not err.value.request_ids
    assert [(r.status, r.num_computed_tokens) for r in reqs] == before
    assert sched.voluntary_preemptions == {}
    assert_scheduler_consistent(sched, reqs)


def test_not_called_without_waiting_requests_or_with_the_bound_at_zero():
    plugin = Greedy(lambda running: None)
    sched = make_scheduler(plugins=[plugin], max_num_seqs=4)
    for i in range(2):
        sched.add_request(make_request(f"r{i}", [i + 1] * 8, max_tokens=5))
    while sched.has_requests():
        step(sched, sampled=7)
    assert plugin.calls == 0  # nobody ever waited behind a running request

    off = Greedy(lambda running: [running[0]])
    sched = make_scheduler(plugins=[off], max_num_seqs=1, max_voluntary_preemptions=0)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", [i + 1] * 8, max_tokens=3))
    while sched.has_requests():
        step(sched, sampled=7)
    assert off.calls == 0 and sched.num_preemptions_total == 0


def test_seats_taken_by_finished_kv_loads_are_not_the_waiting_requests_to_take():
    """A request whose KV load finished is admitted before the waiting queue, so it would
    take the seat freed: the policy is told (max_num_running counts it) and waits, rather
    than preempting low1 for a seat that remote-1 then takes, only to preempt remote-1 at
    the next step and throw its loaded KV away."""
    from schedkit.core.outputs import KVConnectorOutput
    from schedkit.policies.priority_preemptive import PreemptivePriority
    from tests.core.test_async_kv_loads import h4

    sched, _ = h4(PreemptivePriority(), max_num_seqs=2, max_num_batched_tokens=256)
    sched.add_request(make_request("low0", [5] * 16, max_tokens=100, priority=5, arrival_time=0.0))
    step(sched, sampled=7)
    sched.add_request(make_request("remote-1", [9] * 32, max_tokens=100, priority=9, arrival_time=1.0))
    step(sched, sampled=7)
    assert [r.request_id for r in sched.kv_holding] == ["remote-1"]  # its load is under way
    sched.add_request(make_request("low1", [6] * 16, max_tokens=100, priority=5, arrival_time=2.0))
    step(sched, sampled=7, kv_connector_output=KVConnectorOutput(finished_recving={"remote-1"}))
    sched.add_request(make_request("hot", [8] * 16, max_tokens=4, priority=0, arrival_time=3.0))
    for _ in range(3):
        out = step(sched, sampled=7).scheduler_output
        assert not out.preempted_req_ids and not out.scheduled_new_reqs
    assert [r.request_id for r in sched.kv_holding] == ["remote-1"]
    assert sched.requests["remote-1"].num_preemptions == 0
    while sched.has_requests():
        step(sched, sampled=7)
    assert_scheduler_consistent(sched)


def test_a_failed_step_gives_back_the_voluntary_preemption_counts():
    class FailAdmission:
        armed = True

        @hookimpl
        def schedkit_admit_request(self, request):
            if self.armed:
                raise RuntimeError("admission down")
            return None

    sched = make_scheduler(plugins=[PreemptTheOldest()], max_num_seqs=1)
    reqs = [make_request(f"r{i}", [i + 1] * 8, max_tokens=6, arrival_time=float(i)) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    step(sched, sampled=7)
    failing = FailAdmission()
    sched.hooks = type(sched.hooks)(sched.hooks.pm)  # rebuilt below with the failing plugin
    sched.hooks.pm.register(failing, name="fail-admission")
    sched.hooks = type(sched.hooks)(sched.hooks.pm)
    with pytest.raises(PluginError, match="admission down"):
        sched.schedule()
    assert sched.voluntary_preemptions == {} and reqs[0].status is RequestStatus.RUNNING
    assert_scheduler_consistent(sched, reqs)
    failing.armed = False
    while sched.has_requests():
        step(sched, sampled=7)
    assert sum(sched.voluntary_preemptions.values()) >= 1


def test_not_called_while_waiting_requests_are_not_served():
    from schedkit.core.scheduler import PauseState

    plugin = Greedy(lambda running: [running[0]])
    sched = make_scheduler(plugins=[plugin], max_num_seqs=1)
    for i in range(2):
        sched.add_request(make_request(f"r{i}", [i + 1] * 8, max_tokens=5, arrival_time=float(i)))
    step(sched, sampled=7)
    sched.set_pause_state(PauseState.PAUSED_NEW)
    for _ in range(3):
        step(sched, sampled=7)
    assert plugin.calls == 0
    sched.set_pause_state(PauseState.UNPAUSED)
    step(sched, sampled=7)
    assert plugin.calls == 1


def test_voluntary_victims_with_tokens_in_flight_lose_no_token():
    """Async scheduling through EngineCore: steps really are in flight when the hook
    preempts (the scheduler-level test above updates each step at once)."""
    from schedkit.config import config_from_dict
    from schedkit.core.request import Request, SamplingParams
    from schedkit.engine.core import EngineCore

    class InFlight(PreemptAtRandom):
        in_flight = 0

        @hookimpl
        def schedkit_select_voluntary_preemptions(self, running, max_preemptions):
            chosen = super().schedkit_select_voluntary_preemptions(running, max_preemptions)
            self.in_flight += sum(p.request.num_in_flight_tokens > 0 for p in chosen or ())
            return chosen

    plugin = InFlight(seed=5)
    engine = EngineCore(config_from_dict({
        "runner": {"kind": "fake"}, "cache": {"enable_prefix_caching": True},
        "scheduler": {"async_scheduling": True, "max_num_seqs": 4}}), extra_plugins=[plugin])
    reqs = _requests(seed=4)
    tokens = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(Request(r.request_id, r.prompt_token_ids,
                                   SamplingParams(max_tokens=r.max_tokens, ignore_eos=True),
                                   arrival_time=0.0))
    while engine.has_requests():
        for group in engine.step().values():
            for o in group.outputs:
                tokens[o.request_id] += o.new_token_ids
    assert plugin.in_flight >= 5
    assert all(len(tokens[r.request_id]) == r.max_tokens for r in reqs)
