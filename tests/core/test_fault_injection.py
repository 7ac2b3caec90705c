"""Fault-injection property test: plugins raise at random hook calls (every per-step
hook, the waiting queue's methods and its key function) on random traces, with draft
tokens planned at random where scheduling is synchronous, and some
structured requests have grammars that are slow to compile, to fill their bitmask or to
accept tokens. After every step the scheduler invariants hold and no block leaks; at the
end nothing is left; only requests a fault concerned fail, and every other request's
tokens equal those of a fault-free run."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedkit.config import Config, config_from_dict
from schedkit.core.request import Request, SamplingParams
from schedkit.engine.core import EngineCore
from schedkit.errors import PluginError
from schedkit.plugins.testing import assert_scheduler_consistent
from tests.faults import (
    HOOKS,
    SLOW_GRAMMAR_FAULTS,
    SLOW_GRAMMAR_LIMITS,
    FaultInjector,
    SlowGrammars,
)


def make_trace(seed: int, vocab: int = 1000) -> list[tuple[str, list[int], int, float]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, vocab) for _ in range(rng.randrange(4, 24))] for _ in range(3)]
    trace = []
    for i in range(rng.randrange(8, 20)):
        prompt = list(rng.choice(prefixes)) if rng.random() < 0.6 else []
        prompt += [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 40))]
        offset = 0.0 if rng.random() < 0.3 else round(rng.uniform(0, 0.4), 3)
        trace.append((f"r{i}", prompt[:90], rng.randrange(1, 24), offset))
    return trace


def fake_config(async_scheduling: bool, drafts: bool = False) -> dict:
    return {
        "runner": {"kind": "fake", "vocab_size": 1000},
        "cache": {"block_size": 4, "num_blocks": 40, "enable_prefix_caching": True},
        "scheduler": {"max_num_batched_tokens": 32, "max_num_seqs": 6, "max_model_len": 120,
                      "long_prefill_token_threshold": 16, "async_scheduling": async_scheduling,
                      # drafts (and the speculation hook; under async scheduling, placeholders
                      # the runner proposes inside the step)
                      "num_speculative_tokens": 2 if drafts else 0},
    }


def run_trace(config: dict | Config, trace, faults: FaultInjector, max_steps: int = 5000,
              constraints: dict[str, str] | None = None):
    """Serve the trace (``constraints``: request id -> its ``regex`` constraint); returns
    (tokens per request, failed request -> error)."""
    cfg = config if isinstance(config, Config) else config_from_dict(config)
    engine = EngineCore(cfg, extra_plugins=[faults, SlowGrammars()])
    tokens: dict[str, list[int]] = {rid: [] for rid, *_ in trace}
    failed: dict[str, str] = {}
    constraints = constraints or {}
    for rid, prompt, max_tokens, offset in trace:
        so = {"regex": constraints[rid]} if rid in constraints else None
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                  structured_outputs=so), arrival_time=0.0)
        try:
            engine.add_request(req, arrival_offset=offset)
        except PluginError as e:
            failed[rid] = str(e)
    for _ in range(max_steps):
        if not engine.has_requests():
            break
        wait = engine.next_arrival_in()
        if wait and not engine.is_virtual and not engine.scheduler.has_requests():
            time.sleep(wait)  # a wall-clock runner: idle until the next arrival
        if engine.last_step_empty and engine.waiting_for_grammars():
            time.sleep(0.002)  # as the engine process waits for a compile
        for group in engine.step().values():
            for o in group.outputs:
                tokens[o.request_id] += o.new_token_ids
                if o.finish_reason == "error":
                    failed[o.request_id] = o.error
        with faults.paused():
            assert_scheduler_consistent(engine.scheduler)
    else:
        raise AssertionError(f"not finished after {max_steps} steps")
    engine.close()
    sched = engine.scheduler
    kv = sched.kv_cache_manager
    assert not sched.requests and not sched.running and not len(sched.waiting)
    assert kv.num_free_blocks == kv.num_blocks - 1 and kv.num_tracked_requests == 0
    return tokens, failed


def check_against_control(config: dict | Config, trace, seed: int, keyed: bool, rate: float) -> FaultInjector:
    control, control_failed = run_trace(config, trace, FaultInjector(seed, 0.0, keyed))
    assert not control_failed
    faults = FaultInjector(seed, rate, keyed)
    tokens, failed = run_trace(config, trace, faults)
    assert set(failed) <= faults.touched, (failed, faults.touched)
    for err in failed.values():
        assert "injected fault" in err, err
    for rid, toks in control.items():
        if rid not in failed:
            assert tokens[rid] == toks, f"{rid}: {tokens[rid]} != {toks} (faults {dict(faults.raised)})"
    return faults


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), keyed=st.booleans(), async_scheduling=st.booleans(),
       drafts=st.booleans(), rate=st.sampled_from([0.02, 0.05, 0.15]))
def test_random_faults_fail_only_the_requests_they_touch(seed, keyed, async_scheduling, drafts, rate):
    check_against_control(fake_config(async_scheduling, drafts), make_trace(seed), seed, keyed, rate)


def test_the_faults_reach_every_hook_and_queue_method():
    """The property test is only as good as its reach: over a few seeds the injector
    raised in every per-step hook and every queue method the scheduler calls."""
    raised: Counter[str] = Counter()
    voluntary = 0
    for seed in range(12):
        for keyed in (False, True):
            faults = check_against_control(fake_config(seed % 2 == 1, drafts=seed % 4 == 0),
                                           make_trace(seed), seed, keyed, 0.05)
            raised += faults.raised
            voluntary += faults.num_voluntary
    assert voluntary > 10  # and its voluntary preemptions
    expected = set(HOOKS) | {"add", "peek", "pop", "prepend_request", "prepend_requests",
                             "remove_requests", "key"}
    assert expected <= set(raised), expected - set(raised)


def slow_grammar_constraints(seed: int, trace) -> dict[str, str]:
    """A constraint for about half the requests: fast ("ok") or slow in one place."""
    rng = random.Random(seed + 7)
    kinds = [None] * 5 + ["ok"] * 2 + list(SLOW_GRAMMAR_FAULTS)
    return {rid: kind for rid, *_ in trace if (kind := rng.choice(kinds)) is not None}


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), keyed=st.booleans(), async_scheduling=st.booleans(),
       rate=st.sampled_from([0.0, 0.05]))
def test_slow_grammars_fail_alone_and_the_others_are_served(seed, keyed, async_scheduling, rate):
    """A grammar slow to compile fails at the compile timeout, one slow to fill or accept
    on its step budget; the others (hook faults aside) get the tokens of a run where
    every grammar is fast, and nothing leaks."""
    config = {**fake_config(async_scheduling), "structured_outputs": SLOW_GRAMMAR_LIMITS}
    trace = make_trace(seed)
    slow = slow_grammar_constraints(seed, trace)
    fast = {rid: "ok" for rid in slow}
    control, control_failed = run_trace(config, trace, FaultInjector(seed, 0.0, keyed), constraints=fast)
    assert not control_failed
    faults = FaultInjector(seed, rate, keyed)
    tokens, failed = run_trace(config, trace, faults, constraints=slow)
    slow_ids = {rid for rid, kind in slow.items() if kind != "ok"}
    assert set(failed) <= faults.touched | slow_ids, (failed, faults.touched, slow)
    for rid, err in failed.items():
        if rid in faults.touched and "injected fault" in err:
            continue
        key = "compile_timeout_s" if slow[rid] == "slow-compile" else "step_budget_ms"
        assert f"structured_outputs.{key}" in err, (rid, slow[rid], err)
    for rid, toks in control.items():
        if rid not in failed:
            assert tokens[rid] == toks, f"{rid}: {tokens[rid]} != {toks}"
    # A request slow to fill or accept fails after two slow steps: a shorter one may finish first.
    assert {rid for rid in slow_ids if len(control[rid]) > 3 or slow[rid] == "slow-compile"} <= set(failed)
