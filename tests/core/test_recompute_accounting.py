"""Recompute accounting: ``num_recomputed_tokens`` counts exactly the tokens a preemption
made the scheduler compute a second time, so prefix-cache hits on resumption are free.

The invariant checked on every request: tokens scheduled over its life =
(prompt + outputs - 1) - prompt tokens cached at first admission + recomputed tokens.
"""

from __future__ import annotations

import random

import pytest

from schedkit.core.outputs import longest_wait
from schedkit.core.request import EventType
from schedkit.plugins.testing import make_request, make_scheduler, runner_output, step


def _requests(n: int = 12, seed: int = 0):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 30000) for _ in range(64)]
    reqs = []
    for i in range(n):
        body = [rng.randrange(3, 30000) for _ in range(rng.randint(20, 120))]
        reqs.append(make_request(f"r{i}", (shared if i % 2 else []) + body,
                                 max_tokens=rng.randint(30, 90), arrival_time=float(i)))
    return reqs


def _serve(reqs, **kw):
    sched = make_scheduler(block_size=16, max_num_seqs=8, **kw)
    for r in reqs:
        sched.add_request(r)
    scheduled = dict.fromkeys((r.request_id for r in reqs), 0)
    for _ in range(5000):
        if not sched.has_requests():
            break
        res = step(sched, sampled=7)
        for rid, n in res.scheduler_output.num_scheduled_tokens.items():
            scheduled[rid] += n
    assert not sched.has_requests()
    return sched, scheduled


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_recomputed_tokens_are_the_tokens_scheduled_twice(prefix_caching):
    reqs = _requests()
    sched, scheduled = _serve(reqs, num_blocks=30, enable_prefix_caching=prefix_caching)
    assert sched.num_preemptions_total >= 5
    for r in reqs:
        first_time_work = r.num_prompt_tokens + r.num_output_tokens - 1 - r.num_cached_tokens
        assert scheduled[r.request_id] == first_time_work + r.num_recomputed_tokens, r


def test_cached_blocks_kept_over_a_preemption_are_not_counted_as_recomputed():
    """A preempted request whose blocks are still cached when it comes back recomputes
    only the rest: fewer tokens than it had computed (the old count charged them all)."""
    reqs = _requests()
    _serve(reqs, num_blocks=30, enable_prefix_caching=True)
    preempted = [r for r in reqs if r.num_preemptions]
    assert preempted
    assert any(r.num_recomputed_tokens < r.num_computed_high for r in preempted)
    assert sum(r.num_recomputed_tokens for r in reqs) < sum(r.num_computed_high for r in reqs)


def test_longest_wait_covers_the_waits_after_preemptions():
    """With one step per second, a request's longest wait is its longest run of steps
    spent queued (not in the running list) before it finished, read off the scheduler."""
    reqs = _requests()
    clock = [0.0]
    sched = make_scheduler(block_size=16, max_num_seqs=8, num_blocks=30, clock=lambda: clock[0])
    for r in reqs:
        r.arrival_time = 0.0
        sched.add_request(r)
    run = dict.fromkeys((r.request_id for r in reqs), 0)
    longest = dict.fromkeys(run, 0)
    while sched.has_requests():
        so = sched.schedule()
        running = {r.request_id for r in sched.running}
        for r in reqs:
            if r.request_id in running:
                run[r.request_id] = 0
            elif not r.is_finished:
                run[r.request_id] += 1
                longest[r.request_id] = max(longest[r.request_id], run[r.request_id])
        sched.update_from_output(so, runner_output(so, {rid: [7] for rid in so.num_scheduled_tokens}))
        clock[0] += 1.0
    for r in reqs:
        assert longest_wait(r) == longest[r.request_id], r
    late = [r for r in reqs if r.num_preemptions]
    assert late
    # Some request waited longer after a preemption than before its first admission.
    assert any(longest_wait(r) > r.first_event_time(EventType.SCHEDULED) for r in late)
