"""Speculation policies: the built-ins that cut draft tokens as the batch grows or a
request's drafts keep failing, and what a broken speculation plugin costs (the next
step's drafts, nothing else)."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import pytest

from schedkit import hookimpl
from schedkit.config import config_from_dict
from schedkit.core.request import Request, SamplingParams
from schedkit.engine.core import EngineCore
from schedkit.errors import ConfigError, PluginError
from schedkit.plugins.testing import assert_scheduler_consistent, drive_engine, make_requests
from schedkit.policies.speculation import (
    SpeculateByAcceptance,
    SpeculateByBatch,
    acceptance_estimate,
    drafts_worth_proposing,
)
from schedkit.runners.fake import FakeRunner


def _config(k: int, plugins: list[dict[str, Any]] | None = None, runner: dict[str, Any] | None = None,
            **scheduler: Any):
    return config_from_dict({"runner": {"kind": "fake", "vocab_size": 1000, **(runner or {})},
                             "cache": {"block_size": 4, "num_blocks": 200},
                             "scheduler": {"num_speculative_tokens": k, **scheduler},
                             "plugins": plugins or []})


def serve(k: int, plugins: list[dict[str, Any]] | None = None, extra: list[Any] = (), *,
          draft_error_every: int = 3, num_requests: int = 4, max_tokens: int = 24, **scheduler: Any):
    """Serve ``num_requests`` requests on the fake runner, checking the scheduler's
    invariants (every block accounted for) before every step; returns the tokens, the
    drafts scheduled per request, the number of steps and the engine."""
    engine = EngineCore(_config(k, plugins, **scheduler), extra_plugins=list(extra),
                        runner=FakeRunner(vocab_size=1000, draft_error_every=draft_error_every))
    drafted: Counter[str] = Counter()
    execute = engine.runner.execute

    def spy(so):
        assert_scheduler_consistent(engine.scheduler)
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            drafted[rid] += len(drafts)
        return execute(so)

    engine.runner.execute = spy
    tokens, errors = drive_engine(engine, make_requests(num_requests, num_tokens=10, max_tokens=max_tokens))
    assert not errors
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1  # no block leaked
    return tokens, drafted, engine.num_steps, engine


# Under asynchronous scheduling the runner proposes the drafts inside each step, in the
# places the scheduler planned for them: the policies decide the same things.
either_scheduling = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


@either_scheduling
def test_batch_cutoff_speculates_only_in_small_batches(async_scheduling):
    plain, _, plain_steps, _ = serve(0, async_scheduling=async_scheduling)
    # four requests running: above a cutoff of 2 nobody drafts, at 4 everybody does
    tokens, drafted, steps, _ = serve(3, [{"name": "speculate-by-batch", "settings": {"max_batch": 2}}],
                                      async_scheduling=async_scheduling)
    assert tokens == plain and not drafted and steps == plain_steps
    tokens, drafted, steps, _ = serve(3, [{"name": "speculate-by-batch", "settings": {"max_batch": 4}}],
                                      async_scheduling=async_scheduling)
    assert tokens == plain and set(drafted) == set(plain) and steps < plain_steps


@either_scheduling
def test_acceptance_policy_gives_good_drafters_all_and_bad_ones_probes(async_scheduling):
    plugins = [{"name": "speculate-by-acceptance",
                "settings": {"min_acceptance": 0.5, "prior": 0.9, "probe_every": 8}}]
    plain, _, _, _ = serve(0, max_tokens=40, async_scheduling=async_scheduling)
    # every draft right: the estimate stays above 0.9, every request gets all 3 each step
    tokens, good, _, _ = serve(3, plugins, draft_error_every=0, max_tokens=40, async_scheduling=async_scheduling)
    _, always, _, _ = serve(3, draft_error_every=0, max_tokens=40, async_scheduling=async_scheduling)
    assert tokens == plain and good == always
    # every draft wrong: 3 drafts (0.9), then 1 (0.6 after a miss), then none (0.45),
    # but for one probe draft every 8 steps
    tokens, bad, _, _ = serve(3, plugins, draft_error_every=1, max_tokens=40, async_scheduling=async_scheduling)
    _, wasted, _, _ = serve(3, draft_error_every=1, max_tokens=40, async_scheduling=async_scheduling)
    assert tokens == plain
    assert 0 < sum(bad.values()) < sum(wasted.values()) / 4
    assert all(bad[rid] > 4 for rid in plain)  # probed after the first four, not given up on


def test_a_pooled_prior_stops_trying_a_drafter_bad_for_everyone():
    """Requests one at a time, every draft wrong: each starts from the prior 0.5 alone
    and is tried the same way; with the pool, the later ones start from the earlier
    ones' record and get only the probes."""
    settings = {"min_acceptance": 0.3, "probe_every": 8}
    alone = [{"name": "speculate-by-acceptance", "settings": settings}]
    pooled = [{"name": "speculate-by-acceptance", "settings": {**settings, "pooled_prior": True}}]
    plain, _, _, _ = serve(0, num_requests=6, max_num_seqs=1)
    tokens, each, _, _ = serve(3, alone, draft_error_every=1, num_requests=6, max_num_seqs=1)
    assert tokens == plain and each["5"] == each["1"]  # every request tried the same way
    tokens, shared, _, _ = serve(3, pooled, draft_error_every=1, num_requests=6, max_num_seqs=1)
    assert tokens == plain
    assert shared["5"] < shared["0"] and sum(shared.values()) < sum(each.values())


def test_the_pool_counts_a_preempted_request_once():
    """A request that leaves the running list (preempted) and comes back adds only what
    it showed since: a new request's plan is the same as had it never left."""
    def plan_for_new(leaves: bool) -> int:
        policy = SpeculateByAcceptance(min_acceptance=0.3, pooled_prior=True, prior=0.0, prior_weight=10)
        old = Request("old", [1, 2, 3], SamplingParams(max_tokens=50), 0.0)
        old.num_accepted_tokens = 10  # ten drafts accepted, none missed
        policy.schedkit_num_speculative_tokens(running=[old], num_speculative_tokens=4, step=1)
        if leaves:
            policy.schedkit_num_speculative_tokens(running=[], num_speculative_tokens=4, step=2)
        new = Request("new", [1, 2, 3], SamplingParams(max_tokens=50), 0.0)
        return policy.schedkit_num_speculative_tokens(running=[old, new], num_speculative_tokens=4, step=3)["new"]

    # The pool: 10 accepted of 10 + the prior's 10 at 0 -> 0.5: one draft (0.5 ** 2 < 0.3).
    # Counted twice it would read 20 of 30 -> 0.67: two drafts.
    assert plan_for_new(leaves=False) == plan_for_new(leaves=True) == 1


@pytest.mark.parametrize("half_life", [None, 4])
def test_a_pool_with_a_half_life_follows_a_drafter_that_stops_fitting(half_life):
    """Forty drafts accepted, then a request whose drafts all miss, thirty times: the
    pool that never forgets still reads its drafter as fair; with a half-life of four
    drafts, the misses soon outweigh the old record and a new request gets none."""
    policy = SpeculateByAcceptance(min_acceptance=0.3, pooled_prior=True, pool_half_life=half_life,
                                   probe_every=1000)
    good = Request("good", [1, 2, 3], SamplingParams(max_tokens=50), 0.0)
    good.num_accepted_tokens = 40
    policy.schedkit_num_speculative_tokens(running=[good], num_speculative_tokens=4, step=1)
    bad = Request("bad", [1, 2, 3], SamplingParams(max_tokens=50), 0.0)
    for step in range(2, 32):
        bad.num_draft_misses += 1
        policy.schedkit_num_speculative_tokens(running=[bad], num_speculative_tokens=4, step=step)
    new = Request("new", [1, 2, 3], SamplingParams(max_tokens=50), 0.0)
    plan = policy.schedkit_num_speculative_tokens(running=[new], num_speculative_tokens=4, step=33)
    if half_life is None:  # (40 + 1) / (40 + 30 + 2) = 0.57: two drafts (0.57 ** 3 < 0.3)
        assert plan["new"] == 2
    else:  # the forty now weigh 0.5 ** 7.5 of what they did, the misses about 6.3: 0.14
        assert plan["new"] == 0


def test_acceptance_policy_with_a_batch_limit():
    plugins = [{"name": "speculate-by-acceptance", "settings": {"max_batch": 2}}]
    _, drafted, _, _ = serve(3, plugins, draft_error_every=0, num_requests=4, max_tokens=6)
    assert not drafted  # four running the whole time: above the limit
    _, drafted, _, _ = serve(3, plugins, draft_error_every=0, num_requests=2, max_tokens=6)
    assert set(drafted) == {"0", "1"}


def test_the_request_keeps_its_own_record():
    seen: dict[str, tuple[int, int, int]] = {}

    class Watch:
        @hookimpl
        def schedkit_on_request_finished(self, request):
            seen[request.request_id] = (request.num_draft_tokens, request.num_accepted_tokens,
                                        request.num_draft_misses)

    serve(2, extra=[Watch()], draft_error_every=3)
    for drafted, accepted, misses in seen.values():
        assert drafted > 0 and 0 < accepted < drafted and misses > 0


def test_estimate_and_run_length():
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=0.0)
    assert acceptance_estimate(r, 0.7, 2.0) == pytest.approx(0.7)
    assert acceptance_estimate(r, 0.7, 0.0) == 0.7  # no record, no weight: the prior itself
    r.num_accepted_tokens, r.num_draft_misses = 6, 2
    assert acceptance_estimate(r, 0.5, 2.0) == pytest.approx(7 / 10)
    assert drafts_worth_proposing(0.9, 5, 0.5) == 5  # 0.9 ** 5 = 0.59
    assert drafts_worth_proposing(0.8, 5, 0.5) == 3  # 0.8 ** 3 = 0.51, 0.8 ** 4 = 0.41
    assert drafts_worth_proposing(0.5, 5, 0.5) == 1
    assert drafts_worth_proposing(0.4, 5, 0.5) == 0
    assert drafts_worth_proposing(1.0, 4, 0.9) == 4 and drafts_worth_proposing(0.0, 4, 0.1) == 0


@pytest.mark.parametrize(("cls", "settings", "named"), [
    (SpeculateByBatch, {"max_batch": 0}, "max_batch"),
    (SpeculateByBatch, {"max_batch": True}, "max_batch"),
    (SpeculateByAcceptance, {"min_acceptance": 0}, "min_acceptance"),
    (SpeculateByAcceptance, {"min_acceptance": 1.5}, "min_acceptance"),
    (SpeculateByAcceptance, {"prior": -0.1}, "prior"),
    (SpeculateByAcceptance, {"prior": 2}, "prior"),
    (SpeculateByAcceptance, {"prior_weight": "2"}, "prior_weight"),
    (SpeculateByAcceptance, {"probe_every": 0}, "probe_every"),
    (SpeculateByAcceptance, {"max_batch": 1.5}, "max_batch"),
    (SpeculateByAcceptance, {"pooled_prior": "yes"}, "pooled_prior"),
    (SpeculateByAcceptance, {"pool_half_life": 0}, "pool_half_life"),
    (SpeculateByAcceptance, {"pool_half_life": "4"}, "pool_half_life"),
])
def test_bad_settings_are_named(cls, settings, named):
    with pytest.raises(ValueError, match=named):
        cls(**settings)
    with pytest.raises(PluginError, match=named):
        EngineCore(_config(2, [{"name": "speculate-by-batch" if cls is SpeculateByBatch
                                else "speculate-by-acceptance", "settings": settings}]))


class Broken:
    """Raises every third call, answers something it may not every third, else drafts
    for the first request only."""

    def __init__(self, bad: Any) -> None:
        self.bad = bad
        self.calls = 0

    @hookimpl
    def schedkit_num_speculative_tokens(self, running, num_speculative_tokens):
        self.calls += 1
        if self.calls % 3 == 1:
            raise RuntimeError("speculation plugin bug")
        if self.calls % 3 == 2:
            return self.bad(running, num_speculative_tokens)
        return {r.request_id: 0 for r in running[1:]}


@pytest.mark.parametrize("bad", [
    lambda running, k: [k],  # not a mapping
    lambda running, k: {"nobody": 1},  # not a running request
    lambda running, k: {running[0].request_id: k + 1},  # above the configured most
    lambda running, k: {running[0].request_id: -1},
    lambda running, k: {running[0].request_id: 1.0},
    lambda running, k: {running[0].request_id: True},
])
@either_scheduling
def test_a_broken_speculation_plugin_costs_only_drafts(bad, caplog, async_scheduling):
    plain, _, _, _ = serve(0, async_scheduling=async_scheduling)
    plugin = Broken(bad)
    with caplog.at_level(logging.ERROR, logger="schedkit.engine"):
        tokens, drafted, _, engine = serve(3, extra=[plugin], async_scheduling=async_scheduling)
    assert tokens == plain  # every request served, its tokens unchanged
    assert plugin.calls > 6 and drafted  # asked again after each failure; its good answers used
    assert "schedkit_num_speculative_tokens" in caplog.text and "no draft tokens" in caplog.text
    errors = engine.scheduler.hooks.errors
    assert sum(n for (_, hook), n in errors.items() if hook == "schedkit_num_speculative_tokens") >= 2


# -- in the simulator ---------------------------------------------------------------------
def test_fake_runner_drafts_are_right_with_each_requests_chance():
    from schedkit.runners.fake import DraftAcceptance, unit_hash

    assert unit_hash(3, 7) == unit_hash(3, 7) and unit_hash(3, 7) != unit_hash(3, 8)
    draws = [DraftAcceptance(0.7, 20.0).draw(seed) for seed in range(2000)]
    assert abs(sum(draws) / len(draws) - 0.7) < 0.02 and min(draws) < 0.5 < max(draws)
    assert DraftAcceptance(0.7, 20.0).draw(5) == DraftAcceptance(0.7, 20.0).draw(5)
    # measured: the accepted share of drafts follows the chance (every draft of a
    # request is right with it, until the first wrong one ends the run)
    class Watch:
        def __init__(self) -> None:
            self.seen: dict[str, tuple[int, int]] = {}

        @hookimpl
        def schedkit_on_request_finished(self, request):
            self.seen[request.request_id] = (request.num_accepted_tokens, request.num_draft_misses)

    for alpha in (0.2, 0.8):
        watch = Watch()
        engine = EngineCore(_config(3, runner={"draft_acceptance": alpha}), extra_plugins=[watch])
        assert engine.runner.draft_acceptance == alpha
        drive_engine(engine, make_requests(8, num_tokens=10, max_tokens=200))
        accepted = sum(a for a, _ in watch.seen.values())
        misses = sum(m for _, m in watch.seen.values())
        assert accepted / (accepted + misses) == pytest.approx(alpha, abs=0.05)


def _simulated(acceptance: float, k: int, plugins: list[dict[str, Any]] | None = None,
               rate: float = 2.0, async_scheduling: bool = False) -> float:
    """Mean E2E latency of 60 requests on the simulator (SmolLM2's CPU profile)."""
    from schedkit.lab.simulate import run_workload

    cfg = config_from_dict({
        "runner": {"kind": "simulated", "profile": "cpu-smollm2-135m", "vocab_size": 49152,
                   "draft_acceptance": {"mean": acceptance, "concentration": 20}},
        "scheduler": {"num_speculative_tokens": k, "max_num_seqs": 16, "max_num_batched_tokens": 512,
                      "async_scheduling": async_scheduling},
        "workload": {"kind": "poisson", "rate": rate, "num_requests": 60, "prompt_len": [64, 256],
                     "output_len": [32, 128], "seed": 3},
        "plugins": plugins or []})
    result = run_workload(cfg)
    assert not result.failed
    return sum(m.e2e or 0.0 for m in result.metrics) / len(result.metrics)


def test_the_simulator_prices_a_draft_model_that_does_not_fit():
    """A draft model whose drafts are right 1% of the time and cost 12 ms each (about
    0.4 of a SmolLM2 step on two CPU threads): always on is far slower than off (the
    queue grows: about 20x the mean E2E), and the acceptance policy set for such a
    drafter is within a few percent of off, as on the real runner (docs/policies.md)."""
    from schedkit.config import config_from_dict
    from schedkit.lab.simulate import run_workload

    def mean_e2e(k: int, plugins: list[dict[str, Any]] | None = None) -> float:
        cfg = config_from_dict({
            "runner": {"kind": "simulated", "profile": "cpu-smollm2-135m", "vocab_size": 49152,
                       "draft_acceptance": 0.01, "draft_token_s": 0.012},
            "scheduler": {"num_speculative_tokens": k, "max_num_seqs": 16, "max_num_batched_tokens": 512},
            "workload": {"kind": "poisson", "rate": 1, "num_requests": 30, "prompt_len": [64, 256],
                         "output_len": [32, 96], "seed": 4},
            "plugins": plugins or []})
        result = run_workload(cfg)
        assert not result.failed
        return sum(m.e2e or 0.0 for m in result.metrics) / len(result.metrics)

    off, on = mean_e2e(0), mean_e2e(4)
    policy = mean_e2e(4, [{"name": "speculate-by-acceptance", "settings": {
        "draft_cost": 0.4, "min_acceptance": 0.1, "prior": 0.2, "pooled_prior": True}}])
    assert on > 1.5 * off, (on, off)
    assert policy <= 1.05 * off, (policy, off)


@either_scheduling
def test_the_simulator_compares_speculation_policies_before_they_run(async_scheduling):
    """Speculation pays where drafts are accepted and costs where they are not; the
    acceptance policy follows the better of always-on and off in both. Under
    asynchronous scheduling it plans each step before the one in flight is known, so a
    request's record reaches it a step later and a new request ramps up from the prior
    more slowly (6% behind always-on at 0.9 acceptance from the default prior): there
    the pooled prior, every request's record so far, starts new requests."""
    settings = {"draft_cost": 0.04, "pooled_prior": async_scheduling}
    policy = [{"name": "speculate-by-acceptance", "settings": settings}]
    for acceptance, better in ((0.9, "on"), (0.15, "off")):
        off = _simulated(acceptance, 0, async_scheduling=async_scheduling)
        on = _simulated(acceptance, 4, async_scheduling=async_scheduling)
        dynamic = _simulated(acceptance, 4, policy, async_scheduling=async_scheduling)
        assert (on < off) == (better == "on"), (acceptance, on, off)
        assert dynamic <= 1.05 * min(on, off), (acceptance, dynamic, on, off)


def test_a_runner_that_cannot_draft_inside_the_step_is_refused_under_async():
    class BetweenSteps(FakeRunner):
        drafts_in_step = False

    with pytest.raises(ConfigError, match="drafts inside the step; BetweenSteps does not"):
        EngineCore(_config(2, async_scheduling=True), runner=BetweenSteps(vocab_size=1000))
    EngineCore(_config(2), runner=BetweenSteps(vocab_size=1000))  # synchronous: proposed between steps


def test_a_speculation_policy_with_speculation_off_is_reported(caplog, monkeypatch):
    from schedkit.config import config_from_dict
    from schedkit.plugins import manager
    from schedkit.plugins.manager import get_plugin_manager
    from schedkit.policies.speculation import SpeculateByBatch

    monkeypatch.setattr(manager, "_warned_idle", set())
    with caplog.at_level("WARNING", logger="schedkit.plugins"):
        get_plugin_manager(config_from_dict({}), extra_plugins=[SpeculateByBatch()])  # a replay's own
    assert "never called" not in caplog.text
    with caplog.at_level("WARNING", logger="schedkit.plugins"):
        for _ in range(2):  # once
            get_plugin_manager(config_from_dict({"plugins": [{"name": "speculate-by-batch"}]}))
    assert caplog.text.count("'speculate-by-batch' implements schedkit_num_speculative_tokens") == 1
    caplog.clear()
    with caplog.at_level("WARNING", logger="schedkit.plugins"):
        get_plugin_manager(config_from_dict({"scheduler": {"num_speculative_tokens": 2},
                                             "plugins": [{"name": "speculate-by-batch"}]}))
    assert "never called" not in caplog.text
