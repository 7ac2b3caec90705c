"""HRRN and residual SJF: cache-aware sizes, the response ratio's aging, the client's
expected-output hint, and bounded ranking work."""

from __future__ import annotations

import pytest

from schedkit.core.hints import RequestHints
from schedkit.plugins.testing import make_request
from schedkit.policies.hrrn import HighestResponseRatio, ResidualShortestJobFirst, expected_output

from ._harness import req, run

PREFIX = [7] * 64  # four 16-token blocks, cached by the warm-up request
KW = dict(enable_prefix_caching=True, block_size=16, max_num_seqs=1)


def warm() -> list:
    return [req("warm", 80, t=0.0, max_tokens=1, prefix=PREFIX)]


@pytest.mark.parametrize("policy", [HighestResponseRatio, ResidualShortestJobFirst])
def test_a_mostly_cached_long_prompt_ranks_by_what_is_left_to_compute(policy):
    """``cached`` is 80 tokens long but 64 are cached: 16 left, against ``short``'s 40."""
    def reqs():
        return warm() + [req("blocker", 8, t=0.005, max_tokens=20), req("short", 40, t=0.05, max_tokens=2),
                         req("cached", 80, t=0.05, max_tokens=2, prefix=PREFIX)]

    kw = {"output_weight": 0.0} if policy is ResidualShortestJobFirst else {}
    res = run(reqs(), [policy(**kw)], **KW)
    assert res.admitted == ["warm", "blocker", "cached", "short"]
    assert run(reqs(), **KW).admitted == ["warm", "blocker", "short", "cached"]  # fcfs


def stream_with_a_long_one() -> list:
    """Two short prompts every 40 ms (each takes two 10 ms steps, so one is always
    waiting) for 2 s, and one long prompt 1 ms in."""
    shorts = [req(f"s{i}", 20, t=0.04 * (i // 2), max_tokens=2) for i in range(100)]
    return shorts + [req("long", 600, t=0.001, max_tokens=1)]


def test_hrrn_serves_short_requests_first_but_the_long_one_does_not_starve():
    kw = dict(max_num_seqs=1, num_blocks=2000)
    hrrn = run(stream_with_a_long_one(), [HighestResponseRatio()], **kw)
    sjf = run(stream_with_a_long_one(), [ResidualShortestJobFirst(max_wait_s=float("inf"))], **kw)
    # Pure residual SJF: a short request is always waiting, so the long one waits for
    # the whole stream.
    assert sjf.admitted[-1] == "long" and sjf.wait("long") > 1.9
    # HRRN: the short one that waited 20 ms (ratio 1 + 0.02/20) goes before the long one
    # (1 + 0.019/600); at the next decision the waiting shorts are fresh (ratio 1) and
    # the long one goes.
    assert hrrn.admitted[:3] == ["s0", "s1", "long"]


def test_residual_sjf_aging_bounds_the_wait():
    kw = dict(max_num_seqs=1, num_blocks=2000)
    aged = run(stream_with_a_long_one(), [ResidualShortestJobFirst(aging_rate=2000.0, max_wait_s=float("inf"))],
               **kw)
    guard = run(stream_with_a_long_one(), [ResidualShortestJobFirst(max_wait_s=0.3)], **kw)
    # Aging: it passes a short one once it waited (601 - 22) / 2000 = 0.29 s longer.
    assert 0.29 <= aged.wait("long") <= 0.29 + 0.05
    assert 0.3 - 1e-9 < guard.wait("long") <= 0.3 + 0.05


def test_the_expected_output_hint_sizes_the_job():
    """Equal prompts; ``a`` asks for 200 tokens but its client expects 5; ``b`` asks for 50."""
    def reqs():
        return [req("running", 8, t=0.0, max_tokens=5),
                req("b", 20, t=0.01, max_tokens=50),
                make_request("a", [9] * 20, max_tokens=200, arrival_time=0.01,
                             hints=RequestHints(expected_output_tokens=5))]

    res = run(reqs(), [ResidualShortestJobFirst()], max_num_seqs=1)
    assert res.admitted == ["running", "a", "b"]
    a = res.requests["a"]
    assert a.num_output_tokens == 200  # a hint, not a limit
    assert expected_output(a) == 0
    fresh = make_request("x", [1], max_tokens=10, hints=RequestHints(expected_output_tokens=50))
    assert expected_output(fresh) == 10  # capped by max_tokens


def test_ranking_looks_at_most_max_rank_requests_per_step():
    calls = []
    policy = HighestResponseRatio(max_rank=3)
    real = policy.rank_key
    policy.rank_key = lambda r, c, now: calls.append(r.request_id) or real(r, c, now)  # type: ignore[method-assign]
    res = run([req(f"r{i}", 20, t=0.0, max_tokens=2) for i in range(12)], [policy], max_num_seqs=1)
    assert len(res.admitted) == 12
    assert policy.queue is not None and len(calls) <= 3 * policy.queue.num_rankings


@pytest.mark.parametrize(("policy", "kwargs", "name"), [
    (HighestResponseRatio, {"output_weight": -1}, "output_weight"),
    (HighestResponseRatio, {"max_rank": 0}, "max_rank"),
    (HighestResponseRatio, {"max_wait_s": 0}, "max_wait_s"),
    (ResidualShortestJobFirst, {"aging_rate": -1.0}, "aging_rate"),
    (ResidualShortestJobFirst, {"output_weight": "1"}, "output_weight"),
])
def test_bad_settings_name_themselves(policy, kwargs, name):
    with pytest.raises(ValueError, match=name):
        policy(**kwargs)
