"""Preemption by swap on the paged runner (CPU, float32): with the cpu-offload connector
a preempted request's KV goes to host memory and comes back when it resumes, so it
recomputes (almost) nothing, and every request still emits transformers' greedy tokens."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from schedkit.config import PluginConfig  # noqa: E402
from schedkit.engine.core import EngineCore  # noqa: E402
from schedkit.runners.paged.testing import (  # noqa: E402
    greedy_request,
    hf_greedy,
    paged_config,
    random_prompts,
    run_engine,
)

MAX_TOKENS = 24


def _engine(path: Any, offload: bool, async_scheduling: bool) -> EngineCore:
    config = paged_config(path, block_size=8, num_blocks=22, enable_prefix_caching=True,
                          max_num_batched_tokens=48, max_num_seqs=6, max_model_len=256,
                          scheduler={"async_scheduling": async_scheduling})
    if offload:
        config = config.model_copy(update={"plugins": [PluginConfig(name="cpu-offload")]})
    return EngineCore(config)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_swap_keeps_greedy_tokens_and_saves_the_recompute(async_scheduling: bool, model_dir: Any,
                                                          hf_model: Any) -> None:
    path = model_dir("qwen2", num_heads=4, num_kv_heads=2)
    prompts = random_prompts([30, 45, 17, 52, 38, 25], 512, seed=7)
    runs = {}
    for offload in (False, True):
        engine = _engine(path, offload, async_scheduling)
        reqs = [greedy_request(f"r{i}", p, MAX_TOKENS) for i, p in enumerate(prompts)]
        runs[offload] = (run_engine(engine, reqs), engine, reqs)
    expected = hf_greedy(hf_model(path), prompts, MAX_TOKENS)
    for offload, (tokens, engine, _) in runs.items():
        assert engine.stats()["num_preemptions"] > 0, "the cache never ran out"
        for i, want in enumerate(expected):
            assert tokens[f"r{i}"] == want, f"offload={offload}: request r{i} diverged"
    recompute = {o: sum(r.num_recomputed_tokens for r in reqs) for o, (_, _, reqs) in runs.items()}
    connector = runs[True][1].scheduler.connector
    assert connector.num_loaded_blocks > 0 and connector.num_saved_blocks > 0
    assert recompute[True] < recompute[False] / 2, recompute
