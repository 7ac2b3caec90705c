"""Tests of the shortest-prompt-first plugin, written with schedkit's pytest11 fixtures
(``make_scheduler``, ``registered_plugin``, ``fake_runner``), which are available in any
test suite once schedkit is installed."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
from schedkit import PluginError
from schedkit.plugins.testing import make_request

from schedkit_spf import ShortestPromptFirst


def admission_order(sched, runner) -> list[str]:
    """Serve every request to the end; return the ids in the order they were admitted."""
    order = []
    while sched.has_requests():
        out = sched.schedule()
        order += [new.req_id for new in out.scheduled_new_reqs]
        sched.update_from_output(out, runner.execute(out))
    return order


def test_shortest_prompt_is_admitted_first(registered_plugin, make_scheduler, fake_runner):
    registered_plugin(ShortestPromptFirst())
    sched = make_scheduler(max_num_seqs=1)
    for rid, prompt_len in [("long", 30), ("short", 10), ("mid", 20)]:
        sched.add_request(make_request(rid, [1] * prompt_len, max_tokens=2))
    assert admission_order(sched, fake_runner()) == ["short", "mid", "long"]


def test_equal_prompts_keep_arrival_order(registered_plugin, make_scheduler, fake_runner):
    registered_plugin(ShortestPromptFirst())
    sched = make_scheduler(max_num_seqs=1)
    for rid in ["b", "a", "c"]:
        sched.add_request(make_request(rid, [1] * 8, max_tokens=2))
    assert admission_order(sched, fake_runner()) == ["b", "a", "c"]


def test_aging_lets_an_old_long_prompt_go_first(registered_plugin, make_scheduler, fake_runner):
    registered_plugin(ShortestPromptFirst(aging=1.0))  # 1 token forgiven per second waited
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("old-long", [1] * 100, max_tokens=2, arrival_time=0.0))
    sched.add_request(make_request("new-short", [1] * 10, max_tokens=2, arrival_time=100.0))
    assert admission_order(sched, fake_runner()) == ["old-long", "new-short"]


@pytest.mark.parametrize("aging", [-1.0, float("inf"), "fast", True])
def test_bad_aging_is_refused(aging):
    with pytest.raises(ValueError, match="aging"):
        ShortestPromptFirst(aging=aging)


def test_preempted_requests_are_requeued_and_finish(registered_plugin, make_scheduler,
                                                   fake_runner):
    registered_plugin(ShortestPromptFirst())
    # 8 usable blocks of 4 tokens: four 6-token prompts growing to 14 tokens must preempt.
    sched = make_scheduler(block_size=4, num_blocks=9)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", [i + 1] * (6 - i % 2), max_tokens=8))
    admission_order(sched, fake_runner())
    assert sched.num_preemptions_total > 0
    assert not sched.requests and len(sched.waiting) == 0 and not sched.running


INSTALLED = {ep.name for ep in entry_points(group="schedkit")}


@pytest.mark.skipif("spf" not in INSTALLED, reason="schedkit-spf is not installed")
def test_installed_entry_point_is_switched_on_by_name(make_scheduler, fake_runner):
    sched = make_scheduler(policy="spf", max_num_seqs=1)
    for rid, prompt_len in [("long", 30), ("short", 10)]:
        sched.add_request(make_request(rid, [1] * prompt_len, max_tokens=2))
    assert admission_order(sched, fake_runner()) == ["short", "long"]
    with pytest.raises(PluginError, match="spf") as exc:
        make_scheduler(plugin_settings={"spf": {"aging": -1}})
    assert exc.value.plugin == "spf"
