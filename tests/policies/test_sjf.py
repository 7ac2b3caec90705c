"""ShortestJobFirst: shorter jobs first lowers mean TTFT; aging bounds the wait of long jobs."""

from __future__ import annotations

import random

import pytest

from schedkit.policies.sjf import ShortestJobFirst

from ._harness import req, run


def mixed_burst(seed: int = 0) -> list:
    rng = random.Random(seed)
    return [req(f"r{i}", rng.choice([32, 256, 1536]), max_tokens=2) for i in range(24)]


def test_sjf_lowers_mean_ttft_against_fcfs_on_a_mixed_length_burst():
    # Prefill-bound: 24 prompts of 32/256/1536 tokens share a 256-token step budget.
    kw = dict(max_num_seqs=8, max_num_batched_tokens=256)
    fcfs = run(mixed_burst(), **kw)
    sjf = run(mixed_burst(), [ShortestJobFirst()], **kw)
    assert sjf.mean_ttft() < 0.7 * fcfs.mean_ttft()  # measured: 0.14 s vs 0.24 s
    # Pure SJF admits in prompt-length order, arrival order within a length.
    lens = [sjf.requests[r].num_prompt_tokens for r in sjf.admitted]
    assert lens == sorted(lens)


def short_stream_with_one_long(long_len: int = 1000, until: float = 3.0) -> list:
    """A long prompt at t=0 behind a short one, then a short prompt every 18 ms; each short
    takes two 10 ms steps and one request runs at a time, so shorts are always waiting."""
    reqs = [req("s0", 10, t=0.0, max_tokens=2), req("long", long_len, t=0.0, max_tokens=2)]
    n = int(until / 0.018)
    reqs += [req(f"s{i}", 10, t=i * 0.018, max_tokens=2) for i in range(1, n)]
    return reqs


def test_without_aging_a_long_prompt_starves_under_a_stream_of_short_ones():
    res = run(short_stream_with_one_long(), [ShortestJobFirst()], max_num_seqs=1)
    assert res.admitted[-1] == "long"
    assert res.wait("long") > 3.0


def test_aging_bounds_the_wait_of_a_long_prompt():
    rate = 1000.0  # tokens of credit per second
    res = run(short_stream_with_one_long(), [ShortestJobFirst(aging_rate=rate)], max_num_seqs=1)
    # After (1000 - 10) / 1000 = 0.99 s no later short overtakes the long prompt; only
    # shorts queued before that (the backlog, ~6 of them at 20 ms each) are still ahead.
    catch_up = (1000 - 10) / rate
    overtook = [r for r in res.admitted[: res.admitted.index("long")]
                if res.requests[r].arrival_time > catch_up + 1e-9]
    assert overtook == []
    assert catch_up <= res.wait("long") <= catch_up + 0.2


def test_use_max_tokens_orders_by_predicted_output_length():
    def reqs():
        return [req("a", 50, max_tokens=30), req("b", 10, max_tokens=20), req("c", 30, max_tokens=5)]

    assert run(reqs(), [ShortestJobFirst(use_max_tokens=True)], max_num_seqs=1).admitted == ["c", "b", "a"]
    assert run(reqs(), [ShortestJobFirst()], max_num_seqs=1).admitted == ["b", "c", "a"]


def test_aging_credit_counts_from_the_enqueue_time_on_the_scheduler_clock():
    # A blocker runs until t=1.5 s; "long" is queued at 0 and "short" at 1.0. With 200
    # tokens/s of aging, long ranks 200 + 200 * 0 < short 10 + 200 * 1.0. Its client-side
    # arrival_time (set to a far-off clock once queued) must not matter.
    reqs = [req("blocker", 8, t=0.0, max_tokens=150), req("long", 200, t=0.0, max_tokens=1),
            req("short", 10, t=1.0, max_tokens=1)]

    def foreign_arrival_time(res):
        res.requests["long"].arrival_time = 1e6

    res = run(reqs, [ShortestJobFirst(aging_rate=200.0)], max_num_seqs=1,
              before_step=foreign_arrival_time)
    assert res.admitted == ["blocker", "long", "short"]


def test_sort_key_and_equal_sizes_keep_enqueue_order():
    reqs = [req(r, 8, t=0.0, max_tokens=1) for r in ["b", "a", "c"]]
    assert run(reqs, [ShortestJobFirst(aging_rate=5.0)], max_num_seqs=1).admitted == ["b", "a", "c"]


@pytest.mark.parametrize("kwargs, name", [
    ({"aging_rate": -1}, "aging_rate"), ({"aging_rate": float("inf")}, "aging_rate"),
    ({"aging_rate": "fast"}, "aging_rate"), ({"aging_rate": True}, "aging_rate"),
    ({"use_max_tokens": "yes"}, "use_max_tokens"), ({"use_max_tokens": 1}, "use_max_tokens"),
])
def test_bad_settings_name_the_setting_and_value(kwargs, name):
    with pytest.raises(ValueError, match=name) as exc:
        ShortestJobFirst(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(exc.value)
