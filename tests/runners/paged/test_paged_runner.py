"""The runner behind the real scheduler beyond greedy equality: seeded sampling, draft
verification, the built-in model, measured step time."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from schedkit.engine.core import EngineCore  # noqa: E402
from schedkit.policies.speculation import SpeculateByAcceptance  # noqa: E402
from schedkit.runners.paged.testing import (  # noqa: E402
    greedy_request,
    paged_config,
    random_prompts,
    run_engine,
)

SAMPLED = dict(temperature=0.9, top_k=50, top_p=0.9)


def _sampled_tokens(path: Any, seed: int, *, crowd: int, num_blocks: int,
                    async_scheduling: bool = False) -> tuple[list[int], int]:
    engine = EngineCore(paged_config(path, block_size=8, num_blocks=num_blocks, max_num_seqs=6,
                                     max_num_batched_tokens=48,
                                     scheduler={"async_scheduling": async_scheduling}))
    prompts = random_prompts([30] + [40] * crowd, 512, seed=3)
    reqs = [greedy_request("x", prompts[0], 16, seed=seed, **SAMPLED)]
    reqs += [greedy_request(f"o{i}", p, 16, **SAMPLED) for i, p in enumerate(prompts[1:])]
    out = run_engine(engine, reqs)
    return out["x"], engine.stats()["num_preemptions"]


def test_seeded_sampling_ignores_batch_and_preemption(model_dir: Any) -> None:
    path = model_dir("llama")
    alone, _ = _sampled_tokens(path, seed=7, crowd=0, num_blocks=200)
    crowded, num_preempted = _sampled_tokens(path, seed=7, crowd=5, num_blocks=20)
    assert num_preempted > 0
    assert crowded == alone
    other, _ = _sampled_tokens(path, seed=8, crowd=0, num_blocks=200)
    assert other != alone
    pipelined, num_preempted = _sampled_tokens(path, seed=7, crowd=5, num_blocks=20,
                                               async_scheduling=True)
    assert num_preempted > 0
    assert pipelined == alone  # async scheduling: same positions, same draws


def test_top_k_one_is_greedy(model_dir: Any) -> None:
    path = model_dir("qwen2")
    prompts = random_prompts([12, 25], 512, seed=4)
    greedy = run_engine(EngineCore(paged_config(path)),
                        [greedy_request(str(i), p, 10) for i, p in enumerate(prompts)])
    top1 = run_engine(EngineCore(paged_config(path)),
                      [greedy_request(str(i), p, 10, temperature=1.3, top_k=1)
                       for i, p in enumerate(prompts)])
    assert top1 == greedy


def test_drafts_are_verified_like_greedy(model_dir: Any) -> None:
    """With speculative decoding on, drafts (right, wrong and placeholder) never change
    greedy output, and right drafts save steps."""
    path = model_dir("llama")
    prompts = random_prompts([9, 30, 18], 512, seed=5)
    plain = EngineCore(paged_config(path))
    expected = run_engine(plain, [greedy_request(str(i), p, 16) for i, p in enumerate(prompts)])

    engine = EngineCore(paged_config(path, scheduler={"num_speculative_tokens": 3}))
    runner = engine.runner

    def propose(plan: dict[str, int]) -> dict[str, list[int]]:
        drafts = {}
        for rid, st in runner.input_batch.states.items():
            done = st.num_tokens - st.num_prompt_tokens
            d = expected[rid][done:done + plan.get(rid, 0)]
            if done % 3 == 2 and d:
                d[-1] = (d[-1] + 1) % 512  # a wrong draft every third step
            drafts[rid] = d
        return drafts

    runner.propose_draft_token_ids = propose
    got = run_engine(engine, [greedy_request(str(i), p, 16) for i, p in enumerate(prompts)])
    assert got == expected
    assert engine.num_steps < plain.num_steps


def test_builtin_tiny_llama_runs_from_the_default_config(tmp_path: Any, monkeypatch: Any) -> None:
    from schedkit.config import config_from_dict

    monkeypatch.setenv("SCHEDKIT_CACHE_DIR", str(tmp_path))
    cfg = config_from_dict({"runner": {"kind": "paged"}, "cache": {"num_blocks": 64}})
    engine = EngineCore(cfg)
    assert not hasattr(engine.runner, "step_time_s")  # wall-clock engine
    out = run_engine(engine, [greedy_request("r", [1, 2, 3, 4, 5], 4)])
    assert len(out["r"]) == 4 and all(0 <= t < 32000 for t in out["r"])
    assert (tmp_path / "models" / "tiny-llama-seed0" / "model.safetensors").is_file()


def test_step_duration_is_measured(model_dir: Any) -> None:
    engine = EngineCore(paged_config(model_dir("llama")))
    engine.add_request(greedy_request("r", [1, 2, 3], 2))
    so = engine.scheduler.schedule()
    out = engine.runner.execute(so)
    assert out.step_duration is not None and out.step_duration > 0
    assert out.sampled_token_ids[0] and out.req_ids == ["r"]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_model_free_drafts_keep_greedy_output_and_save_steps(model_dir: Any, method: str) -> None:
    """The runner's own drafters (n-gram lookup, suffix decoding): on repetitive prompts
    they propose, greedy output stays the same, and accepted drafts save steps."""
    path = model_dir("llama")
    prompts = [[5, 6, 7, 8] * 6, [9, 10] * 10, random_prompts([20], 512, seed=6)[0]]
    reqs = lambda: [greedy_request(str(i), p, 24) for i, p in enumerate(prompts)]  # noqa: E731
    plain = EngineCore(paged_config(path))
    expected = run_engine(plain, reqs())
    engine = EngineCore(paged_config(path, scheduler={"num_speculative_tokens": 3}, speculative_method=method))
    proposed = []
    inner = engine.runner.propose_draft_token_ids

    def spy(plan: dict[str, int]) -> dict[str, list[int]]:
        drafts = inner(plan)
        proposed.append(sum(len(d) for d in drafts.values()))
        return drafts

    engine.runner.propose_draft_token_ids = spy
    assert run_engine(engine, reqs()) == expected
    assert sum(proposed) > 0
    assert engine.num_steps < plain.num_steps


def test_a_closed_engine_frees_the_kv_cache_and_weights_of_the_runner_it_built(model_dir: Any) -> None:
    """Engines form reference cycles; a loop of runs in one process (a grid, a compare)
    must not hold every finished run's KV cache and weights until the next full
    collection."""
    import gc
    import weakref

    from schedkit.lab.simulate import run_workload
    from schedkit.lab.workloads import WorkloadRequest

    built: list[Any] = []
    cfg = paged_config(model_dir("llama"), num_blocks=64)
    workload = [WorkloadRequest(f"r{i}", 0.0, [1, 2, 3, 4 + i], 3) for i in range(3)]
    orig = EngineCore.__init__

    def spy(self: EngineCore, *a: Any, **k: Any) -> None:
        orig(self, *a, **k)
        built.append((weakref.ref(self.runner.kv_caches[0][0]), self.runner))

    gc.disable()
    try:
        EngineCore.__init__ = spy  # type: ignore[method-assign]
        try:
            assert len(run_workload(cfg, workload).metrics) == 3
        finally:
            EngineCore.__init__ = orig  # type: ignore[method-assign]
        ((kv, closed),) = built
        assert kv() is None  # freed at once, no collection needed
        assert "model" not in vars(closed)
        # A runner passed in stays its owner's: the engine leaves it whole.
        runner = EngineCore._build_runner(cfg)
        engine = EngineCore(cfg, runner=runner)
        engine.close()
        assert runner.kv_caches and runner.model is not None
    finally:
        gc.enable()


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_drafts_under_preemption_and_a_speculation_policy(model_dir: Any, method: str) -> None:
    """A KV cache too small for every request at once: requests are preempted and
    recompute while drafting, under the acceptance policy; greedy output is that of a
    run without drafts, and every block is accounted for before each step."""
    from schedkit.plugins.testing import assert_scheduler_consistent

    path = model_dir("llama")
    prompts = [[5, 6, 7, 8] * 8, [9, 10] * 14, [3, 1, 4, 1, 5, 9, 2, 6] * 3, random_prompts([24], 512, seed=8)[0]]
    reqs = lambda: [greedy_request(str(i), p, 40) for i, p in enumerate(prompts)]  # noqa: E731
    small = {"num_blocks": 14, "block_size": 8}
    expected = run_engine(EngineCore(paged_config(path, **small)), reqs())
    engine = EngineCore(paged_config(path, **small, speculative_method=method,
                                     scheduler={"num_speculative_tokens": 3}),
                        extra_plugins=[SpeculateByAcceptance(min_acceptance=0.4)])
    execute = engine.runner.execute
    drafted = []

    def checked(so):
        assert_scheduler_consistent(engine.scheduler)
        drafted.append(sum(len(d) for d in so.scheduled_spec_decode_tokens.values()))
        return execute(so)

    engine.runner.execute = checked
    assert run_engine(engine, reqs()) == expected
    assert engine.scheduler.num_preemptions_total > 0 and sum(drafted) > 0
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1
