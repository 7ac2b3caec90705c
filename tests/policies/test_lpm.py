"""LongestPrefixMatch: cached-prefix requests first, a starvation guard, bounded work."""

from __future__ import annotations

import pytest

from schedkit.kv.kv_cache_manager import KVCacheManager
from schedkit.policies.lpm import LongestPrefixMatch

from ._harness import VirtualClock, req, run

PREFIX = [7] * 64  # four 16-token blocks, cached by the warm-up request
KW = dict(enable_prefix_caching=True, block_size=16, max_num_seqs=1)


def warm() -> list:
    return [req("warm", 80, t=0.0, max_tokens=1, prefix=PREFIX)]


def test_requests_sharing_the_cached_prefix_are_admitted_first():
    def reqs():
        return warm() + [req("other", 80, t=0.5, max_tokens=2)] + [
            req(f"m{i}", 80, t=0.5, max_tokens=2, prefix=PREFIX) for i in range(4)]

    lpm = run(reqs(), [LongestPrefixMatch()], **KW)
    fcfs = run(reqs(), **KW)
    assert lpm.admitted == ["warm", "m0", "m1", "m2", "m3", "other"]
    assert fcfs.admitted == ["warm", "other", "m0", "m1", "m2", "m3"]
    for res in (lpm, fcfs):
        assert all(res.requests[f"m{i}"].num_cached_tokens == 64 for i in range(4))


def stream_behind_an_old_request(until: float = 3.0) -> list:
    """One non-matching request at 0.5 s, then a prefix-sharing one every 15 ms (each takes
    two 10 ms steps), so a matching request is always waiting."""
    n = int((until - 0.5) / 0.015)
    return warm() + [req("old", 80, t=0.5, max_tokens=2)] + [
        req(f"m{i}", 80, t=0.5 + i * 0.015, max_tokens=2, prefix=PREFIX) for i in range(n)]


@pytest.mark.parametrize("give_clock", [False, True], ids=["observed-clock", "scheduler-clock"])
def test_the_guard_admits_an_old_non_matching_request_after_max_wait(give_clock):
    clock = VirtualClock()
    lpm = LongestPrefixMatch(max_wait_s=0.5, clock=clock if give_clock else None)
    res = run(stream_behind_an_old_request(), [lpm], clock=clock, **KW)
    # Overdue from the first ranking after 0.5 s; then it waits for the running request.
    assert 0.5 - 1e-9 < res.wait("old") <= 0.5 + 0.03
    assert res.admitted.index("old") < len(res.admitted) - 50


def test_without_the_guard_the_old_request_starves():
    res = run(stream_behind_an_old_request(), [LongestPrefixMatch(max_wait_s=float("inf"))], **KW)
    assert res.admitted[-1] == "old"
    assert res.wait("old") > 2.4


def test_only_the_first_max_rank_waiting_requests_are_ranked():
    def reqs():
        return warm() + [req(f"n{i}", 80, t=0.5, max_tokens=1) for i in range(1, 5)] + [
            req("m", 80, t=0.5, max_tokens=1, prefix=PREFIX)]

    assert run(reqs(), [LongestPrefixMatch(max_rank=2)], **KW).admitted == [
        "warm", "n1", "n2", "n3", "m", "n4"]
    assert run(reqs(), [LongestPrefixMatch()], **KW).admitted == [
        "warm", "m", "n1", "n2", "n3", "n4"]


def test_ranking_work_is_capped_per_step(monkeypatch):
    calls = [0]
    original = KVCacheManager.get_computed_blocks

    def counting(self, request):
        calls[0] += 1
        return original(self, request)

    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", counting)
    lpm = LongestPrefixMatch(max_rank=8)
    reqs = warm() + [req(f"r{i}", 80, t=0.5, max_tokens=3, prefix=PREFIX[: 16 * (i % 5)])
                     for i in range(200)]
    res = run(reqs, [lpm], **{**KW, "max_num_seqs": 4})
    assert lpm.queue.num_rankings <= res.num_steps
    # At most max_rank lookups per ranking, plus the scheduler's own one per admission.
    assert calls[0] <= 8 * lpm.queue.num_rankings + len(res.admitted)


@pytest.mark.parametrize("kwargs, name", [
    ({"max_rank": 0}, "max_rank"), ({"max_rank": 1.5}, "max_rank"),
    ({"max_wait_s": 0}, "max_wait_s"), ({"max_wait_s": -2}, "max_wait_s"),
    ({"max_wait_s": "10s"}, "max_wait_s"), ({"clock": 3.0}, "clock"),
])
def test_bad_settings_name_the_setting_and_value(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LongestPrefixMatch(**kwargs)
