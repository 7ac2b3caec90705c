"""CPU float32: the paged runner, driven by the real scheduler, emits exactly transformers'
greedy tokens for every request of mixed batches with chunked prefill, prefix-cache hits,
preemption and resumption, several block sizes, GQA, Llama and Qwen2."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from schedkit import hookimpl  # noqa: E402
from schedkit.engine.core import EngineCore  # noqa: E402
from schedkit.runners.paged.testing import (  # noqa: E402
    greedy_request,
    hf_greedy,
    paged_config,
    random_prompts,
    run_engine,
)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

CASES: dict[str, dict[str, Any]] = {
    "llama-gqa-bs16-chunked-prefix": dict(
        family="llama", model=dict(num_heads=4, num_kv_heads=2), block_size=16, num_blocks=256,
        enable_prefix_caching=True, max_num_batched_tokens=32, long_prefill_token_threshold=16,
        max_num_seqs=6),
    "qwen2-mha-tied-bs8-preempt-prefix": dict(
        family="qwen2", model=dict(num_heads=4, num_kv_heads=4, tie_word_embeddings=True),
        block_size=8, num_blocks=24, enable_prefix_caching=True, max_num_batched_tokens=48,
        max_num_seqs=6, expect_preemption=True),
    "llama-gqa4-llama3rope-bs32-preempt-chunked": dict(
        family="llama", model=dict(num_heads=8, num_kv_heads=2, hidden_size=128, head_dim=32,
                                   rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
        block_size=32, num_blocks=7, enable_prefix_caching=False, max_num_batched_tokens=40,
        long_prefill_token_threshold=24, max_num_seqs=5, expect_preemption=True),
    "qwen2-gqa3-bs4-chunked-prefix": dict(
        family="qwen2", model=dict(num_heads=6, num_kv_heads=2, hidden_size=96), block_size=4,
        num_blocks=300, enable_prefix_caching=True, max_num_batched_tokens=24,
        long_prefill_token_threshold=8, max_num_seqs=8),
}

MAX_TOKENS = 14


def _workload(vocab: int = 512) -> tuple[list[list[int]], list[list[int]]]:
    """Wave 1, then wave 2 arriving mid-decode: shared prefixes, a repeated prompt, new ones."""
    first = random_prompts([3, 17, 40, 64, 9, 33], vocab, seed=1)
    extra = random_prompts([5, 21, 2], vocab, seed=2)
    second = [first[3][:40] + extra[0], list(first[2]), first[1][:16] + extra[1], extra[2]]
    return first, second


class ChunkCounter:
    """Counts scheduled requests that produced no output (prefill chunks)."""

    def __init__(self) -> None:
        self.num_chunks = 0

    @hookimpl
    def schedkit_on_step_end(self, scheduler_output: Any, outputs: Any) -> None:
        emitted = {o.request_id for group in outputs.values() for o in group.outputs}
        self.num_chunks += sum(1 for r in scheduler_output.num_scheduled_tokens if r not in emitted)


def _run_two_waves(engine: EngineCore, first: list[list[int]],
                   second: list[list[int]]) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    pending = [greedy_request(f"b{i}", p, MAX_TOKENS) for i, p in enumerate(second)]
    for i, p in enumerate(first):
        engine.add_request(greedy_request(f"a{i}", p, MAX_TOKENS))
        outputs[f"a{i}"] = []
    for _ in range(2000):
        if not engine.has_requests() and not pending:
            break
        if pending and sum(1 for k, v in outputs.items() if k[0] == "a" and v) >= 3:
            for req in pending:
                engine.add_request(req)
                outputs[req.request_id] = []
            pending = []
        for eco in engine.step().values():
            for o in eco.outputs:
                outputs[o.request_id].extend(o.new_token_ids)
    assert not engine.has_requests()
    return outputs


@pytest.mark.parametrize("name,async_scheduling,backend", [(n, False, "auto") for n in CASES] + [
    ("qwen2-mha-tied-bs8-preempt-prefix", True, "auto"),
    ("llama-gqa4-llama3rope-bs32-preempt-chunked", True, "auto"),
    ("qwen2-mha-tied-bs8-preempt-prefix", False, "torch"),
    ("llama-gqa4-llama3rope-bs32-preempt-chunked", True, "torch")])
def test_greedy_tokens_match_transformers(name: str, async_scheduling: bool, backend: str,
                                          model_dir: Any, hf_model: Any) -> None:
    """Also with async scheduling: two steps in flight, each decode step's input token
    taken on the device from the step before it. ``auto`` is the compiled CPU kernel
    (checked: no silent fallback), ``torch`` the per-op PyTorch reference path."""
    case = dict(CASES[name])
    family, model_kw = case.pop("family"), case.pop("model")
    expect_preemption = case.pop("expect_preemption", False)
    path = model_dir(family, **model_kw)
    counter = ChunkCounter()
    engine = EngineCore(paged_config(path, max_model_len=256, attention_backend=backend,
                                     scheduler={"async_scheduling": async_scheduling}, **case),
                        extra_plugins=[counter])
    assert engine.runner.attention_backend == ("cpu" if backend == "auto" else backend)
    first, second = _workload()
    outputs = _run_two_waves(engine, first, second)
    num_chunks = counter.num_chunks
    prompts = {f"a{i}": p for i, p in enumerate(first)} | {f"b{i}": p for i, p in enumerate(second)}
    expected = dict(zip(prompts, hf_greedy(hf_model(path), list(prompts.values()), MAX_TOKENS),
                        strict=True))
    for rid in prompts:
        assert outputs[rid] == expected[rid], f"{name}: request {rid} diverged"
    stats = engine.stats()
    if case.get("long_prefill_token_threshold"):
        assert num_chunks > 0, "no chunked prefill happened"
    if case["enable_prefix_caching"]:
        assert stats["prefix_cache_hit_rate"] > 0, "no prefix-cache hit happened"
    if expect_preemption:
        assert stats["num_preemptions"] > 0, "no preemption happened"


@pytest.mark.parametrize("seed", range(6))
def test_greedy_matches_transformers_on_random_settings(seed: int, model_dir: Any, hf_model: Any) -> None:
    """Randomised block sizes (down to 1), budgets, chunk caps and cache sizes; seeds 4
    and 5 with async scheduling."""
    import random

    r = random.Random(seed)
    family = ("llama", "qwen2")[seed % 2]
    path = model_dir(family, num_heads=4, num_kv_heads=(1, 2, 4)[seed % 3])
    block_size = r.choice([1, 2, 5, 16, 32])
    prompts = random_prompts([r.randint(1, 60) for _ in range(7)], 512, seed=seed)
    prompts.append(prompts[0] * 2)  # a repeated prefix
    max_tokens = [r.randint(1, 12) for _ in prompts]
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens, strict=True))
    num_blocks = r.choice([2 * -(-longest // block_size) + 1, 400])
    engine = EngineCore(paged_config(
        path, block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=bool(seed % 2),
        max_num_batched_tokens=r.choice([8, 16, 64]), max_num_seqs=r.choice([1, 3, 8]),
        long_prefill_token_threshold=r.choice([0, 4, 8]), max_model_len=256,
        scheduler={"async_scheduling": seed >= 4}))
    out = run_engine(engine, [greedy_request(str(i), p, m)
                              for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))])
    expected = hf_greedy(hf_model(path), prompts, max(max_tokens))
    for i, m in enumerate(max_tokens):
        assert out[str(i)] == expected[i][:m], f"request {i} diverged"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_reset_prefix_cache_of_running_requests_keeps_greedy_output(
        async_scheduling: bool, model_dir: Any) -> None:  # docs/scheduler-behaviour.md#reset-prefix-cache
    """Resetting the prefix cache with running requests preempts them all at step 10.
    Their outputs still in flight are dropped and recomputed, so greedy output is
    unchanged: no token is lost or duplicated."""
    path = model_dir("llama", num_heads=4, num_kv_heads=2)
    prompts = random_prompts([30, 17, 45, 8], 512, seed=9)

    def run(reset_at: int | None) -> tuple[dict[str, list[int]], int]:
        engine = EngineCore(paged_config(path, block_size=8, enable_prefix_caching=True,
                                         max_num_batched_tokens=64, max_model_len=256,
                                         scheduler={"async_scheduling": async_scheduling}))
        for i, p in enumerate(prompts):
            engine.add_request(greedy_request(str(i), p, 20))
        outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        step = 0
        while engine.has_requests():
            if step == reset_at:
                assert engine.num_steps_in_flight == (1 if async_scheduling else 0)
                assert engine.reset_prefix_cache(reset_running_requests=True)
            for eco in engine.step().values():
                for o in eco.outputs:
                    outputs[o.request_id].extend(o.new_token_ids)
            step += 1
        return outputs, engine.stats()["num_preemptions"]

    plain, none = run(None)
    reset, num_preempted = run(10)
    assert none == 0 and num_preempted == len(prompts)
    assert reset == plain
    assert all(len(v) == 20 for v in reset.values())
