"""MultiLevelFeedbackQueue: skip-join, demotion, short late jobs overtake demoted long ones."""

from __future__ import annotations

import pytest

from schedkit.core.outputs import EngineCoreOutput, EngineCoreOutputs
from schedkit.core.request import EventType
from schedkit.policies.mlfq import MultiLevelFeedbackQueue

from ._harness import req, run

LONGS = ("L0", "L1", "L2")


def longs_then_shorts() -> list:
    """Three 300-token jobs start at once in a KV cache too small for all of them at full
    length (two are preempted); a short job arrives every 100 ms from t=0.5."""
    reqs = [req(name, 16, t=0.0, max_tokens=300) for name in LONGS]
    reqs += [req(f"s{i}", 16, t=0.5 + i * 0.1, max_tokens=8) for i in range(30)]
    return reqs


def overtakes(res) -> list[tuple[str, str]]:
    """(long, short) pairs where the short arrived after the long was preempted and was
    admitted before the long resumed."""
    pairs = []
    for name in LONGS:
        events = res.requests[name].events
        for i, (kind, t_pre) in enumerate(events):
            if kind is not EventType.PREEMPTED:
                continue
            t_resume = next(t for k, t in events[i + 1:] if k is EventType.SCHEDULED)
            pairs += [(name, s) for s, r in res.requests.items() if s.startswith("s")
                      and t_pre < r.arrival_time and r.first_event_time(EventType.SCHEDULED) < t_resume]
    return pairs


def test_demoted_long_jobs_are_overtaken_by_short_late_jobs():
    mlfq = MultiLevelFeedbackQueue(base_quantum=8)  # quanta 8, 16, 32, 64 output tokens
    kw = dict(block_size=16, num_blocks=40, max_num_seqs=3)
    levels: dict[str, int] = {}

    def track(res, out, outputs):
        for name in LONGS:
            levels[name] = max(levels.get(name, 0), mlfq.level_of(res.requests[name]))

    res = run(longs_then_shorts(), [mlfq], on_step=track, check=True, **kw)
    fcfs = run(longs_then_shorts(), **kw)
    assert levels == dict.fromkeys(LONGS, 3)  # 8 + 16 + 32 tokens in, they hit the bottom
    assert res.sched.num_preemptions_total > 0 and fcfs.sched.num_preemptions_total > 0
    assert overtakes(res)  # a preempted long job re-enters at its low level
    assert overtakes(fcfs) == []  # FCFS puts it back at the head; shorts wait behind it
    shorts = [r for r in res.requests if r.startswith("s")]
    assert res.mean_ttft(shorts) < 0.6 * fcfs.mean_ttft(shorts)  # measured 0.86 s vs 1.67 s


def test_skip_join_picks_the_level_whose_quantum_covers_the_prefill():
    mlfq = MultiLevelFeedbackQueue(num_levels=4, base_quantum=4, quantum_growth=2.0,
                                   prefill_tokens_per_step=100)
    assert mlfq.quanta == [4, 8, 16, 32]
    assert [mlfq.skip_join_level(n) for n in (1, 400, 401, 800, 1600, 1601, 10**6)] == [
        0, 0, 1, 1, 2, 3, 3]
    res = run([req("short", 50, max_tokens=1), req("long", 1000, max_tokens=1)], [mlfq])
    assert [mlfq.level_of(res.requests[r]) for r in ("short", "long")] == [0, 2]


def test_the_waiting_queue_serves_the_highest_level_first():
    mlfq = MultiLevelFeedbackQueue(base_quantum=1, prefill_tokens_per_step=1)  # quanta 1,2,4,8
    reqs = [req("blocker", 4, max_tokens=5)]
    reqs += [req(r, n, t=0.001, max_tokens=1) for r, n in [("p9", 9), ("p3", 3), ("p2", 2), ("p5", 5)]]
    res = run(reqs, [mlfq], max_num_seqs=1)
    # Levels: p2 -> 1, p3 -> 2, p5 -> 3, p9 -> 3 (FCFS within a level: p9 came first).
    assert res.admitted == ["blocker", "p2", "p3", "p9", "p5"]


def _outputs(**tokens: int) -> dict[int, EngineCoreOutputs]:
    return {0: EngineCoreOutputs(outputs=[EngineCoreOutput(rid, [1] * n) for rid, n in tokens.items()])}


def test_a_request_is_demoted_after_its_quantum_of_output_tokens():
    mlfq = MultiLevelFeedbackQueue(num_levels=3, base_quantum=2, quantum_growth=2.0)
    queue = mlfq.schedkit_create_waiting_queue()
    r = req("r", 8)
    queue.add(r)
    for n, level in [(1, 0), (1, 1), (3, 1), (1, 2), (100, 2)]:
        mlfq.schedkit_on_step_end(outputs=_outputs(r=n), now=0.0)
        assert mlfq.level_of(r) == level
    mlfq.schedkit_on_request_finished(request=r)
    mlfq.schedkit_on_step_end(outputs={}, now=0.0)
    assert mlfq.level_of(req("r", 8)) == 0  # a new request with the same id starts afresh


def test_the_victim_is_the_running_request_in_the_lowest_level_latest_first():
    mlfq = MultiLevelFeedbackQueue(num_levels=3, base_quantum=2)
    queue = mlfq.schedkit_create_waiting_queue()
    a, b, c, d = (req(x, 8) for x in "abcd")
    for r in (a, b, c, d):
        queue.add(r)
    mlfq.schedkit_on_step_end(outputs=_outputs(b=2, c=2), now=0.0)  # b and c drop to level 1
    assert mlfq.schedkit_select_preemption_victim(running=[a, b, c, d]) is c
    assert mlfq.schedkit_select_preemption_victim(running=[a, c, b, d]) is b
    assert mlfq.schedkit_select_preemption_victim(running=[a, d]) is d


def test_preempted_victims_in_a_real_run_are_the_most_demoted():
    mlfq = MultiLevelFeedbackQueue(base_quantum=8)
    seen = []

    def on_step(res, out, outputs):
        seen.extend(out.preempted_req_ids)

    res = run(longs_then_shorts(), [mlfq], on_step=on_step, block_size=16, num_blocks=40,
              max_num_seqs=3)
    assert seen and all(rid in LONGS for rid in seen)
    assert res.sched.num_preemptions_total == len(seen)


@pytest.mark.parametrize("kwargs, name", [
    ({"num_levels": 0}, "num_levels"), ({"num_levels": 2.5}, "num_levels"),
    ({"base_quantum": 0}, "base_quantum"), ({"quantum_growth": 0.5}, "quantum_growth"),
    ({"quantum_growth": float("inf")}, "quantum_growth"),
    ({"prefill_tokens_per_step": 0}, "prefill_tokens_per_step"),
    ({"prefill_tokens_per_step": True}, "prefill_tokens_per_step"),
])
def test_bad_settings_name_the_setting_and_value(kwargs, name):
    with pytest.raises(ValueError, match=name):
        MultiLevelFeedbackQueue(**kwargs)
