"""Property tests: random traces under heavy KV pressure keep every invariant each step."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schedkit import hookimpl
from schedkit.core.outputs import KVConnectorOutput
from schedkit.core.request import RequestStatus
from schedkit.errors import RequestError
from schedkit.kv.connector import KVConnectorBase
from schedkit.plugins.testing import (
    assert_scheduler_consistent,
    make_request,
    make_scheduler,
)
from schedkit.runners.fake import FakeRunner, _ReqState, request_seed

EOS = 2


class AsyncLoads(KVConnectorBase):
    """Loads the rest of the prompt of the "remote" requests asynchronously, once; each
    load ends (or fails) a drawn number of steps after it starts."""

    def __init__(self, role, config, loads):
        super().__init__(role, config)
        self.loads = loads  # rid -> (delay in steps, fails)
        self.loaded: set[str] = set()
        self.started: dict[str, int] = {}
        self.step = 0

    def get_num_new_matched_tokens(self, request, num_local_hit_tokens):
        rid = request.request_id
        if rid not in self.loads or rid in self.loaded:
            return 0, False
        n = request.num_prompt_tokens - num_local_hit_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if num_external_tokens:
            self.loaded.add(request.request_id)
            self.started[request.request_id] = self.step

    def transfers_done(self) -> KVConnectorOutput:
        out = KVConnectorOutput()
        for rid, start in list(self.started.items()):
            delay, fails = self.loads[rid]
            if self.step - start >= delay:
                del self.started[rid]
                (out.failed_recving if fails else out.finished_recving).add(rid)
        return out


class AsyncLoadsPlugin:
    def __init__(self, loads):
        self.loads = loads
        self.connector = None

    @hookimpl
    def schedkit_create_kv_connector(self, role, config):
        self.connector = AsyncLoads(role, config, self.loads)
        return self.connector


@st.composite
def traces(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_blocks = draw(st.integers(3, 40))
    capacity = (num_blocks - 1) * block_size
    # As vLLM checks at start-up, the cache holds at least one max_model_len sequence;
    # below that a lone request with drafts can livelock (vLLM refuses such configs).
    max_model_len = min(draw(st.integers(8, 96)), capacity)
    budget = draw(st.integers(8, 64))
    cfg = dict(
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        block_size=block_size, num_blocks=num_blocks,
        max_num_batched_tokens=budget, max_num_seqs=draw(st.integers(1, min(8, budget))),
        max_model_len=max_model_len,
        enable_prefix_caching=draw(st.booleans()),
        long_prefill_token_threshold=min(draw(st.sampled_from([0, 0, 3, 8])), max_model_len),
        num_speculative_tokens=draw(st.sampled_from([0, 0, 1, 3])),
        scheduler_reserve_full_isl=draw(st.booleans()),
        kv_load_failure_policy=draw(st.sampled_from(["recompute", "fail"])),
    )
    if cfg["num_speculative_tokens"] == 0:
        # Steps in flight: 2 pipelines schedule() ahead of update_from_output(), with
        # output placeholders (async scheduling) or without (as with pipeline parallelism).
        cfg["async_scheduling"] = draw(st.booleans())
        cfg["depth"] = 2 if cfg["async_scheduling"] else draw(st.sampled_from([1, 2]))
    limit = min(capacity, max_model_len)
    k = cfg["num_speculative_tokens"]
    reqs = []
    for i in range(draw(st.integers(1, 14))):
        # prompt + max_tokens always fits the cache and max_model_len, so nothing stalls
        prompt_len = draw(st.integers(1, max(1, min(limit - 1, 40))))
        max_tokens = draw(st.integers(1, max(1, min(limit - prompt_len, 24))))
        shared = draw(st.booleans())
        prompt = ([7] * prompt_len) if shared else [100 + i] * prompt_len
        reqs.append(dict(
            id=f"r{i}", prompt=prompt, max_tokens=max_tokens,
            priority=draw(st.integers(0, 3)), arrival_step=draw(st.integers(0, 12)),
            eos_at=draw(st.one_of(st.none(), st.integers(0, max_tokens))),
            abort_step=draw(st.one_of(st.none(), st.none(), st.integers(0, 30))),
            stop=draw(st.sampled_from([(), (5,)])),
            # an asynchronous load must fit beside the one speculative step it reserves
            # (docs/scheduler-behaviour.md#load-reservation), or it can never start (as in vLLM)
            load=draw(st.one_of(st.none(), st.none(), st.tuples(st.integers(0, 4), st.booleans())))
            if -(-prompt_len // block_size) + -(-(1 + k) // block_size) <= num_blocks - 1 else None,
        ))
    return cfg, reqs


def run_trace(cfg, reqs, max_steps=3000):
    plugin = AsyncLoadsPlugin({r["id"]: r["load"] for r in reqs if r.get("load") is not None})
    cfg = dict(cfg)
    depth = cfg.pop("depth", 1)
    sched = make_scheduler(plugins=[plugin], **cfg)
    k = cfg["num_speculative_tokens"]
    eos_at = {r["id"]: r["eos_at"] for r in reqs}
    runner = FakeRunner(vocab_size=50, eos_token_id=EOS, output_len=eos_at.get)
    added, finished = {}, {}
    step = 0
    last_arrival = max(r["arrival_step"] for r in reqs)
    in_flight: deque = deque()
    while step < max_steps:
        for r in reqs:
            if r["arrival_step"] == step:
                req = make_request(r["id"], r["prompt"], max_tokens=r["max_tokens"],
                                   priority=r["priority"], arrival_time=float(step),
                                   eos_token_id=EOS, stop_token_ids=r["stop"])
                sched.add_request(req)
                added[r["id"]] = req
            if r["abort_step"] == step and r["id"] in sched.requests:
                sched.finish_requests(r["id"], RequestStatus.FINISHED_ABORTED)
                finished[r["id"]] = "abort"
        if step > last_arrival and not sched.has_requests() and not in_flight:
            break
        plugin.connector.step = step
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= cfg["max_num_batched_tokens"]
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        assert len(out.num_scheduled_tokens) <= cfg["max_num_seqs"]
        assert set(out.scheduled_spec_decode_tokens) <= set(out.num_scheduled_tokens)
        assert_scheduler_consistent(sched)
        in_flight.append((out, runner.execute(out)))
        if len(in_flight) < depth and out.num_scheduled_tokens:
            step += 1
            continue
        out, result = in_flight.popleft()
        result.kv_connector_output = plugin.connector.transfers_done()
        outs = sched.update_from_output(out, result)
        for group in outs.values():
            for o in group.outputs:
                if o.finish_reason is not None:
                    assert o.request_id not in finished
                    finished[o.request_id] = str(o.finish_reason)
        if k:
            sched.update_draft_token_ids(runner.propose_draft_token_ids(sched.plan_speculation()))
        assert_scheduler_consistent(sched)
        step += 1
    return sched, added, finished, step


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_random_traces_keep_invariants(trace):
    cfg, reqs = trace
    # With the full-sequence admission gate off, vLLM's rules can livelock two requests
    # that each fit alone but not together under PRIORITY (the victim may be the one
    # making progress; docs/scheduler-behaviour.md#full-sequence-gate). FCFS never preempts running[0], so it always drains.
    must_drain = cfg["scheduler_reserve_full_isl"] or cfg["policy"] == "fcfs"
    sched, added, finished, steps = run_trace(cfg, reqs, 3000 if must_drain else 300)
    eos_at = {r["id"]: r["eos_at"] for r in reqs}
    model = FakeRunner(vocab_size=50, eos_token_id=EOS)
    for rid, req in added.items():  # no token lost, duplicated or reordered
        state = _ReqState(request_seed(rid), 0, [], 0, eos_at[rid])
        assert req.output_token_ids == [model.token_at(state, i) for i in range(req.num_output_tokens)]
    if not must_drain and sched.has_requests():
        return
    assert not sched.has_requests(), f"did not drain in {steps} steps"
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == cfg["num_blocks"] - 1
    assert all(kv.block_pool.ref_cnt(b) == 0 for b in range(1, cfg["num_blocks"]))
    assert set(finished) == set(added)
    for rid, req in added.items():
        assert req.is_finished
        if finished[rid] == "length":
            assert (req.num_output_tokens == req.max_tokens
                    or req.num_tokens >= cfg["max_model_len"])
        elif finished[rid] == "stop":
            assert req.output_token_ids[-1] in (EOS, 5)
        elif finished[rid] == "error":
            load = next(r["load"] for r in reqs if r["id"] == rid)
            assert load is not None and load[1] and cfg["kv_load_failure_policy"] == "fail"
        else:
            assert finished[rid] == "abort"
        assert req.num_output_tokens <= req.max_tokens


@pytest.mark.parametrize("prompt_len,num_blocks,max_model_len", [(65, 5, 2048), (40, 100, 40)])
def test_prompts_that_can_never_run_are_rejected(prompt_len, num_blocks, max_model_len):
    sched = make_scheduler(num_blocks=num_blocks, max_model_len=max_model_len)
    with pytest.raises(RequestError) as e:
        sched.add_request(make_request("big", [1] * prompt_len))
    assert "big" in str(e.value) and e.value.request_id == "big"
    assert not sched.requests and not sched.waiting
