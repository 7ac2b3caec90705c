"""Async scheduling (output placeholders) and stale outputs of preempted requests
(docs/scheduler-behaviour.md, section "Async scheduling")."""

from __future__ import annotations

from collections import deque

import pytest

from schedkit import Preemption, hookimpl
from schedkit.core.outputs import DRAFT_PLACEHOLDER
from schedkit.core.request import RequestStatus
from schedkit.errors import PluginError
from schedkit.plugins.testing import (
    assert_scheduler_consistent,
    make_request,
    make_requests,
    make_scheduler,
    runner_output,
)


def one_token_each(out, token=0):
    """Every scheduled request whose chunk completes its tokens samples ``token``."""
    return runner_output(out, {r: [token] for r in out.num_scheduled_tokens})


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_stop_by_max_tokens(max_tokens):  # docs/scheduler-behaviour.md#async-max-tokens
    sched = make_scheduler(async_scheduling=True)
    r0, r1 = make_requests(2, max_tokens=max_tokens)
    in_flight = deque()
    sched.add_request(r0)
    in_flight.append(sched.schedule())
    sched.add_request(r1)
    in_flight.append(sched.schedule())
    outputs = {"0": [], "1": []}
    total = sum(o.total_num_scheduled_tokens for o in in_flight)
    while in_flight:
        out = in_flight.popleft()
        for group in sched.update_from_output(out, one_token_each(out)).values():
            for o in group.outputs:
                outputs[o.request_id] += o.new_token_ids
        assert_scheduler_consistent(sched)
        nxt = sched.schedule()
        total += nxt.total_num_scheduled_tokens
        if nxt.num_scheduled_tokens:
            in_flight.append(nxt)
    assert sched.get_num_unfinished_requests() == 0
    assert not sched.requests
    assert [len(outputs["0"]), len(outputs["1"])] == [max_tokens, max_tokens]
    assert total == 2 * (10 + max_tokens - 1)


def test_abort_while_steps_in_flight():  # docs/scheduler-behaviour.md#async-abort
    order = [0, 8, 3, 1, 6, 4, 2, 5, 7, 9]
    sched = make_scheduler(async_scheduling=True)
    reqs = make_requests(10, max_tokens=20)
    for r in reqs:
        sched.add_request(r)
    in_flight = deque([sched.schedule(), sched.schedule()])
    abort = iter(order)
    while in_flight:
        victim = next(abort, None)
        if victim is not None:
            sched.finish_requests(str(victim), RequestStatus.FINISHED_ABORTED)
        out = in_flight.popleft()
        sched.update_from_output(out, one_token_each(out))
        assert_scheduler_consistent(sched)
        nxt = sched.schedule()
        if nxt.num_scheduled_tokens:
            in_flight.append(nxt)
    for i, r in enumerate(reqs):
        assert r.status is RequestStatus.FINISHED_ABORTED
        assert r.num_output_tokens == order.index(i)


def test_placeholders_allow_rescheduling_before_the_update():  # docs/scheduler-behaviour.md#async-placeholders
    sched = make_scheduler(async_scheduling=True)
    (req,) = make_requests(1, num_tokens=8)
    sched.add_request(req)
    out1 = sched.schedule()
    assert out1.num_scheduled_tokens == {"0": 8}
    assert req.num_output_placeholders == 1
    out2 = sched.schedule()  # no update in between
    assert out2.num_scheduled_tokens == {"0": 1}
    assert out2.scheduled_cached_reqs.num_output_tokens == [1]  # its placeholder
    assert req.num_output_placeholders == 2 and req.num_computed_tokens == 9
    sched.update_from_output(out1, one_token_each(out1, 7))
    assert req.output_token_ids == [7] and req.num_output_placeholders == 1
    sched.update_from_output(out2, one_token_each(out2, 8))
    assert req.output_token_ids == [7, 8] and req.num_output_placeholders == 0


def test_drafts_planned_as_placeholders_are_rolled_back_by_the_update():  # docs/scheduler-behaviour.md#async-drafts
    """Asynchronous scheduling with speculation: the next step's drafts are placeholders
    the runner fills; the step is scheduled before the one in flight is known, and its
    update takes back the drafts rejected from the computed tokens and the placeholders."""
    sched = make_scheduler(async_scheduling=True, num_speculative_tokens=2)
    (req,) = make_requests(1, num_tokens=8, max_tokens=20)
    sched.add_request(req)
    out1 = sched.schedule()
    sched.plan_draft_placeholders()
    assert req.spec_token_ids == [DRAFT_PLACEHOLDER] * 2
    out2 = sched.schedule()  # before out1's update: the sampled token and two drafts
    sched.plan_draft_placeholders()
    assert out2.num_scheduled_tokens == {"0": 3}
    assert out2.scheduled_spec_decode_tokens == {"0": [DRAFT_PLACEHOLDER] * 2}
    assert req.num_output_placeholders == 1 + 3 and req.num_computed_tokens == 8 + 3
    sched.update_from_output(out1, one_token_each(out1, 7))
    assert req.output_token_ids == [7] and req.num_output_placeholders == 3
    out3 = sched.schedule()  # out2 in flight: its drafts still count
    assert out3.num_scheduled_tokens == {"0": 3} and out3.scheduled_cached_reqs.num_computed_tokens == [11]
    sched.update_from_output(out2, runner_output(out2, {"0": [8, 9]}))  # one of two drafts accepted
    assert req.output_token_ids == [7, 8, 9]
    assert req.num_computed_tokens == 8 + 3 + 3 - 1 and req.num_output_placeholders == 3
    assert req.num_draft_tokens == 2 and req.num_accepted_tokens == 1
    sched.update_from_output(out3, runner_output(out3, {"0": [10]}))  # both rejected
    assert req.output_token_ids == [7, 8, 9, 10] and req.num_output_placeholders == 0
    assert req.num_computed_tokens == 8 + 4 - 1  # the newest token's KV is the next step's
    assert_scheduler_consistent(sched)


def test_a_preempted_request_does_not_count_its_rejected_drafts_as_lost_work():
    """Preempted while a step with two drafts is in flight, the request's mark of work
    done counts the drafts' positions; when the stale output shows both rejected, the
    mark drops to what was computed, and resuming recomputes only that."""

    class PreemptWhenArmed:
        armed = False

        @hookimpl
        def schedkit_select_voluntary_preemptions(self, running, max_preemptions):
            if not self.armed:
                return None
            self.armed = False
            return [Preemption(running[0], "test")]

    plugin = PreemptWhenArmed()
    sched = make_scheduler(async_scheduling=True, num_speculative_tokens=2, max_num_seqs=1, plugins=[plugin])
    a = make_request("a", list(range(10, 18)), max_tokens=20)
    sched.add_request(a)
    out1 = sched.schedule()  # the prompt: 8 positions
    sched.plan_draft_placeholders()
    out2 = sched.schedule()  # the sampled token and two drafts, positions 8-10
    sched.update_from_output(out1, runner_output(out1, {"a": [7]}))
    sched.add_request(make_request("b", list(range(30, 38)), max_tokens=1))
    plugin.armed = True
    sched.plan_draft_placeholders()
    out3 = sched.schedule()
    assert out3.preempted_req_ids == {"a"} and out3.num_scheduled_tokens == {"b": 8}
    assert a.num_computed_high == 11 and a.num_unconfirmed_high == 3  # out2's positions
    sched.update_from_output(out2, runner_output(out2, {"a": [8]}))  # both drafts rejected
    assert a.output_token_ids == [7, 8]
    assert a.num_computed_high == 9  # the prompt and token 7's position
    sched.update_from_output(out3, runner_output(out3, {"b": [5]}))
    out4 = sched.schedule()
    assert out4.num_scheduled_tokens == {"a": 10}  # resumed: prompt and both outputs
    assert a.num_recomputed_tokens == 9
    assert_scheduler_consistent(sched)


def test_a_cache_reset_drops_a_stale_drafted_step_and_its_rejected_drafts_from_the_mark():
    """The same when the preemption is a prefix-cache reset's, whose stale outputs are
    dropped: the drafts the output shows rejected still leave the mark."""
    sched = make_scheduler(async_scheduling=True, num_speculative_tokens=2, enable_prefix_caching=True)
    a = make_request("a", list(range(10, 18)), max_tokens=20)
    sched.add_request(a)
    out1 = sched.schedule()
    sched.plan_draft_placeholders()
    out2 = sched.schedule()
    sched.update_from_output(out1, runner_output(out1, {"a": [7]}))
    assert sched.reset_prefix_cache(reset_running_requests=True)
    assert a.status is RequestStatus.PREEMPTED and a.num_computed_high == 11
    sched.update_from_output(out2, runner_output(out2, {"a": [8]}))  # dropped; both drafts rejected
    assert a.output_token_ids == [7] and a.num_computed_high == 9
    out3 = sched.schedule()
    assert out3.num_scheduled_tokens == {"a": 9} and a.num_recomputed_tokens == 9
    assert_scheduler_consistent(sched)


def test_a_plan_replaces_the_placeholders_of_the_last_one():
    """A request the last plan gave drafts but no step scheduled since (here: none was)
    gets what the new plan says: none when the policy now answers 0 or raises."""
    answers = iter([2, RuntimeError("speculation policy down"), 2, 0])

    class Plan:
        @hookimpl
        def schedkit_num_speculative_tokens(self, running, num_speculative_tokens, step):
            answer = next(answers)
            if isinstance(answer, Exception):
                raise answer
            return {r.request_id: answer for r in running}

    sched = make_scheduler(async_scheduling=True, num_speculative_tokens=2, plugins=[Plan()])
    (req,) = make_requests(1, num_tokens=8, max_tokens=20)
    sched.add_request(req)
    sched.schedule()
    sched.plan_draft_placeholders()
    assert req.spec_token_ids == [DRAFT_PLACEHOLDER] * 2
    with pytest.raises(PluginError, match="speculation policy down"):
        sched.plan_draft_placeholders()
    assert req.spec_token_ids == []
    sched.plan_draft_placeholders()
    assert req.spec_token_ids == [DRAFT_PLACEHOLDER] * 2
    sched.plan_draft_placeholders()
    assert req.spec_token_ids == []
    assert sched.schedule().num_scheduled_tokens == {"0": 1}  # its sampled token alone


def test_sync_scheduler_never_adds_placeholders():
    sched = make_scheduler()
    (req,) = make_requests(1, num_tokens=8)
    sched.add_request(req)
    sched.schedule()
    assert req.num_output_placeholders == 0
    assert not sched.schedule().num_scheduled_tokens  # waits for the sampled token


def test_async_reset_drops_stale_outputs():  # docs/scheduler-behaviour.md#stale-drop
    sched = make_scheduler(async_scheduling=True, enable_prefix_caching=True)
    reqs = make_requests(2, max_tokens=20)
    for r in reqs:
        sched.add_request(r)
    out0 = sched.schedule()
    out1 = sched.schedule()
    sched.update_from_output(out0, one_token_each(out0))
    out2 = sched.schedule()
    for r in reqs:
        assert r.num_output_tokens == 1 and r.num_output_placeholders == 2
    assert sched.reset_prefix_cache(reset_running_requests=True)
    for r in reqs:
        assert r.status is RequestStatus.PREEMPTED
        assert r.num_stale_output_tokens == 2 and r.stale_drop
    out3 = sched.schedule()
    assert out3.num_scheduled_tokens == {"0": 11, "1": 11}
    assert out3.scheduled_cached_reqs.resumed_req_ids == {"0", "1"}
    assert out3.preempted_req_ids == {"0", "1"}
    for out in (out1, out2):  # the two stale in-flight outputs: discarded
        outs = sched.update_from_output(out, one_token_each(out, 9))
        assert all(not group.outputs for group in outs.values())
    for r in reqs:
        assert r.output_token_ids == [0] and r.num_stale_output_tokens == 0
    assert r.num_in_flight_tokens == 11
    sched.update_from_output(out3, one_token_each(out3, 5))
    for r in reqs:
        assert r.output_token_ids == [0, 5]
    assert_scheduler_consistent(sched)


def test_stale_output_is_delivered_before_resumption():  # docs/scheduler-behaviour.md#stale-deliver
    sched = make_scheduler(max_num_batched_tokens=100, num_blocks=11)
    r0, r1 = make_requests(2, num_tokens=80)
    sched.add_request(r0)
    out0 = sched.schedule()
    assert out0.num_scheduled_tokens == {"0": 80}
    sched.add_request(r1)
    out1 = sched.schedule()
    assert out1.num_scheduled_tokens == {"1": 80}
    sched.update_from_output(out0, runner_output(out0, {"0": [0]}))
    out2 = sched.schedule()
    assert out2.preempted_req_ids == {"1"}
    assert r1.status is RequestStatus.PREEMPTED
    assert r1.num_stale_output_tokens == 80 and not r1.stale_drop
    sched.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.num_free_blocks == 10
    out3 = sched.schedule()
    assert not out3.num_scheduled_tokens  # r1 waits for its stale output
    assert r1.status is RequestStatus.PREEMPTED
    outs = sched.update_from_output(out1, runner_output(out1, {"1": [42]}))
    assert [o.new_token_ids for o in outs[0].outputs] == [[42]]
    assert r1.output_token_ids == [42] and r1.num_stale_output_tokens == 0
    out4 = sched.schedule()
    assert out4.num_scheduled_tokens == {"1": 81}
    assert out4.scheduled_cached_reqs.resumed_req_ids == {"1"}
    assert_scheduler_consistent(sched)


def test_bad_kv_under_async_drops_the_outputs_in_flight_and_recomputes():
    """Bad KV blocks (docs/scheduler-behaviour.md#async-bad-kv) with two steps in flight: the outputs of both were computed on the bad
    block, so both are dropped; the request recomputes from that block, keeps no phantom
    placeholder, and ends with the model's own tokens."""
    from schedkit.core.outputs import KVConnectorOutput
    from schedkit.runners.fake import FakeRunner, _ReqState, request_seed

    sched = make_scheduler(async_scheduling=True, kv_load_failure_policy="recompute")
    (req,) = make_requests(1, num_tokens=40, max_tokens=12, eos_token_id=None)
    sched.add_request(req)
    runner = FakeRunner(vocab_size=1000)
    in_flight = deque([sched.schedule()])
    steps = 0
    while in_flight:
        out = sched.schedule()
        if out.num_scheduled_tokens:
            in_flight.append(out)
        done = in_flight.popleft()
        ro = runner.execute(done)
        steps += 1
        if steps == 5:  # block 1 (tokens 16-31) went bad; two steps were in flight
            ro.kv_connector_output = KVConnectorOutput(
                invalid_block_ids={sched.kv_cache_manager.get_block_ids("0")[1]})
            had = req.num_output_tokens
        sched.update_from_output(done, ro)
        if steps == 5:
            assert req.num_output_tokens == had  # that output was dropped
            assert req.num_computed_tokens == 16 and req.num_output_placeholders == 0
        assert_scheduler_consistent(sched)
        assert req.num_computed_tokens <= req.num_tokens + req.num_output_placeholders
    state = _ReqState(request_seed("0"), 0, [], 0)
    assert req.output_token_ids == [runner.token_at(state, i) for i in range(12)]
    assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED
