"""Randomized invariants of the scheduler output at scale (vLLM's
test_priority_scheduling_blast, docs/scheduler-behaviour.md#blast), also with two steps in flight and placeholders."""

from __future__ import annotations

import random

import pytest

from schedkit.core.outputs import ModelRunnerOutput
from schedkit.plugins.testing import assert_scheduler_consistent, make_request, make_scheduler

PROFILES = {  # (prompt length, max tokens, max_num_seqs, num_blocks); 600 steps, not 20,000
    "long-prompts": (5000, 500, 256, 10000),
    "long-outputs": (500, 5000, 1024, 1000),
}


@pytest.mark.parametrize("profile", list(PROFILES))
@pytest.mark.parametrize("policy,caching,k,async_scheduling", [
    ("priority", True, 0, False), ("priority", False, 1, False), ("priority", True, 5, False),
    ("fcfs", True, 0, True), ("priority", False, 0, True)])
def test_blast(profile, policy, caching, k, async_scheduling):
    prompt_len, max_tokens, max_seqs, num_blocks = PROFILES[profile]
    rng = random.Random(f"{profile}-{policy}-{caching}-{k}-{async_scheduling}")
    sched = make_scheduler(policy=policy, max_num_seqs=max_seqs, num_blocks=num_blocks,
                           max_num_batched_tokens=8192, max_model_len=prompt_len + max_tokens + 16,
                           enable_prefix_caching=caching, num_speculative_tokens=k,
                           async_scheduling=async_scheduling)
    seen: set[str] = set()
    in_flight = []
    next_id = 0
    for step in range(600):
        for _ in range(rng.randint(0, 3)):
            n = rng.randint(1, prompt_len)
            sched.add_request(make_request(
                f"r{next_id}", [rng.randint(0, 99) for _ in range(n)], max_tokens=rng.randint(1, max_tokens),
                priority=rng.randint(0, 4), eos_token_id=None))
            next_id += 1
        out = sched.schedule()
        new_ids = [r.req_id for r in out.scheduled_new_reqs]
        cached_ids = out.scheduled_cached_reqs.req_ids
        assert not set(new_ids) & seen, "a new request id was scheduled before"
        assert set(cached_ids) <= seen, "a cached request id was never scheduled"
        assert set(out.num_scheduled_tokens) == set(new_ids) | set(cached_ids)
        assert len(out.num_scheduled_tokens) == len(new_ids) + len(cached_ids)
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        assert set(out.scheduled_spec_decode_tokens) <= set(out.num_scheduled_tokens)
        assert out.finished_req_ids <= seen | set(sched.requests)
        seen.update(new_ids)
        chunks = {r for r in out.num_scheduled_tokens if sched.requests[r].is_prefill_chunk}
        in_flight.append((out, chunks))
        if len(in_flight) < (2 if async_scheduling else 1):
            continue
        done, chunks = in_flight.pop(0)
        ids = list(done.num_scheduled_tokens)
        rng.shuffle(ids)  # the runner's order is not the scheduler's
        spec = done.scheduled_spec_decode_tokens
        sampled = [[] if r in chunks else
                   [rng.randint(100, 199) for _ in range(rng.randint(1, 1 + len(spec.get(r, ()))))]
                   for r in ids]
        sched.update_from_output(done, ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled))
        if k:
            sched.update_draft_token_ids({r.request_id: [rng.randint(100, 199) for _ in range(k)]
                                          for r in sched.running})
        if step % 100 == 0:
            assert_scheduler_consistent(sched)
    assert_scheduler_consistent(sched)
    assert len(seen) > 50
