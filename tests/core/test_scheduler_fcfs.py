"""Admission, ordering and chunking under FCFS: vLLM's scheduler tests against our API
(docs/scheduler-behaviour.md, sections "Admission and budget" and "Chunked prefill")."""

from __future__ import annotations

from schedkit.core.request import RequestStatus
from schedkit.plugins.testing import make_request, make_requests, make_scheduler, runner_output


def test_add_requests():  # docs/scheduler-behaviour.md#add-and-finish
    sched = make_scheduler()
    for i, req in enumerate(make_requests(10)):
        sched.add_request(req)
        assert req.request_id in sched.requests
        assert len(sched.waiting) == i + 1


def test_finish_request():  # docs/scheduler-behaviour.md#add-and-finish
    sched = make_scheduler()
    reqs = make_requests(10)
    for r in reqs:
        sched.add_request(r)
    for i, r in enumerate(reqs):
        sched.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
        assert r.request_id not in sched.requests
        assert len(sched.waiting) == 9 - i


def test_get_num_unfinished_requests():  # docs/scheduler-behaviour.md#add-and-finish
    sched = make_scheduler()
    reqs = make_requests(10)
    for r in reqs:
        sched.add_request(r)
    for i, r in enumerate(reqs):
        sched.finish_requests(r.request_id, RequestStatus.FINISHED_STOPPED)
        assert sched.get_num_unfinished_requests() == 10 - i - 1


def test_schedule_all_new():  # docs/scheduler-behaviour.md#admission-order
    for caching in (False, True):
        sched = make_scheduler(enable_prefix_caching=caching)
        reqs = make_requests(10)
        for r in reqs:
            sched.add_request(r)
        out = sched.schedule()
        assert len(out.scheduled_new_reqs) == 10
        assert out.scheduled_cached_reqs.num_reqs == 0
        assert not out.finished_req_ids
        assert all(n == 10 for n in out.num_scheduled_tokens.values())
        assert len(sched.waiting) == 0
        assert all(sched.running[i] is reqs[i] for i in range(10))


def test_schedule_concurrent_partial_requests():  # docs/scheduler-behaviour.md#chunk-threshold
    for caching in (False, True):
        sched = make_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400,
                               enable_prefix_caching=caching)
        reqs = make_requests(3, num_tokens=800)
        for r in reqs:
            sched.add_request(r)
        out = sched.schedule()
        assert len(out.scheduled_new_reqs) == 3
        assert [out.num_scheduled_tokens[r.request_id] for r in reqs] == [400, 400, 224]
        sched.update_from_output(out, runner_output(out, {}))
        out = sched.schedule()
        assert len(out.scheduled_new_reqs) == 0 and out.scheduled_cached_reqs.num_reqs == 3
        assert len(sched.running) == 3
        assert [out.num_scheduled_tokens[r.request_id] for r in reqs] == [400, 400, 224]
        sched.update_from_output(out, runner_output(out, {"0": [0], "1": [0]}))
        out = sched.schedule()
        assert out.scheduled_cached_reqs.num_reqs == 3
        assert [out.num_scheduled_tokens[r.request_id] for r in reqs] == [1, 1, 352]


def test_schedule_concurrent_batches():  # docs/scheduler-behaviour.md#zero-token-skip
    sched = make_scheduler(max_num_batched_tokens=1024, max_num_seqs=2)
    r0, r1 = make_requests(2, num_tokens=512)
    sched.add_request(r0)
    out0 = sched.schedule()
    assert len(out0.scheduled_new_reqs) == 1 and out0.num_scheduled_tokens["0"] == 512
    sched.add_request(r1)
    out1 = sched.schedule()
    assert len(out1.scheduled_new_reqs) == 1 and out1.num_scheduled_tokens == {"1": 512}
    sched.update_from_output(out0, runner_output(out0, {"0": [0]}))
    out2 = sched.schedule()
    assert out2.num_scheduled_tokens["0"] == 1
    sched.update_from_output(out1, runner_output(out1, {"1": [0]}))


def test_scheduler_reset_prefix_cache():  # docs/scheduler-behaviour.md#reset-prefix-cache
    sched = make_scheduler(enable_prefix_caching=True)
    reqs = make_requests(10)
    for r in reqs:
        sched.add_request(r)
    sched.schedule()
    assert len(sched.running) == 10
    assert sched.reset_prefix_cache() is False
    assert sched.reset_prefix_cache(reset_running_requests=True) is True
    assert sched.running == []
    assert list(sched.waiting) == reqs
    out = sched.schedule()
    assert out.preempted_req_ids == {r.request_id for r in reqs}
    assert out.scheduled_cached_reqs.resumed_req_ids == {r.request_id for r in reqs}


def test_memory_leak():  # docs/scheduler-behaviour.md#no-leak
    sched = make_scheduler(enable_prefix_caching=True)
    for r in make_requests(5, max_tokens=10):
        sched.add_request(r)
        out = sched.schedule()
        sched.update_from_output(out, runner_output(out, {x.request_id: [1000] for x in sched.running}))
    while True:
        out = sched.schedule()
        if not sched.running:
            break
        sched.update_from_output(out, runner_output(out, {x.request_id: [1000] for x in sched.running}))
    assert not sched.requests and not sched.waiting and not sched.running
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == 10000 - 1
    assert all(kv.block_pool.ref_cnt(b) == 0 for b in range(1, 10000))


def test_full_prompt_must_fit_in_cache_gate():  # docs/scheduler-behaviour.md#full-sequence-gate (too-big prompts are rejected at add)
    sched = make_scheduler(num_blocks=11, max_num_batched_tokens=64, enable_prefix_caching=True)
    # 150 tokens = 10 blocks: fits the cache; a running 40-token request holds 3 blocks.
    sched.add_request(make_request("a", list(range(40)), max_tokens=50))
    out = sched.schedule()
    sched.update_from_output(out, runner_output(out, {"a": [5]}))
    sched.add_request(make_request("b", list(range(1000, 1150))))
    out = sched.schedule()
    # "a" decodes; "b" needs 10 free blocks, only 7 are: not admitted, though budget remains.
    assert list(out.num_scheduled_tokens) == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b"]


def test_free_queue_order_at_scheduler_level():  # docs/scheduler-behaviour.md#free-queue-order
    for caching, expected in ((False, [2, 1, 3]), (True, [2, 3, 4])):
        sched = make_scheduler(num_blocks=11, max_num_batched_tokens=100,
                               enable_prefix_caching=caching)
        sched.add_request(make_request("r0", list(range(20)), max_tokens=1))
        out = sched.schedule()
        assert out.scheduled_new_reqs[0].block_ids == [1, 2]
        sched.update_from_output(out, runner_output(out, {"r0": [5]}))
        sched.add_request(make_request("r1", list(range(500, 540))))
        out = sched.schedule()
        assert out.scheduled_new_reqs[0].block_ids == expected


def test_threshold_only_with_company():  # docs/scheduler-behaviour.md#threshold-needs-company
    sched = make_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    sched.add_request(make_request("alone", [1] * 800))
    assert sched.schedule().num_scheduled_tokens == {"alone": 800}
    sched = make_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    sched.add_request(make_request("a", [1] * 800))
    sched.add_request(make_request("b", [2] * 800))
    assert sched.schedule().num_scheduled_tokens == {"a": 400, "b": 400}
    sched = make_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    sched.add_request(make_request("a", [1] * 800))
    sched.schedule()
    sched.add_request(make_request("b", [2] * 800))
    assert sched.schedule().num_scheduled_tokens == {"b": 400}


def test_no_admission_in_a_step_that_preempted():
    # 4 usable blocks of 16; two requests fill them, the first needs a new block.
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=200, max_num_seqs=4)
    sched.add_request(make_request("a", [1] * 32, max_tokens=40))
    sched.add_request(make_request("b", [2] * 31, max_tokens=40))
    out = sched.schedule()
    sched.update_from_output(out, runner_output(out, {"a": [3], "b": [3]}))
    sched.add_request(make_request("c", [4] * 4))
    out = sched.schedule()
    # a (33 tokens) needs a 3rd block: the FCFS victim is the tail, b; c must not be admitted.
    assert out.preempted_req_ids == {"b"}
    assert list(out.num_scheduled_tokens) == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert sched.requests["b"].status is RequestStatus.PREEMPTED
    assert sched.requests["b"].num_computed_tokens == 0
    assert sched.requests["b"].output_token_ids == [3]
