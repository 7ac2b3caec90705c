"""EAGLE heads, tested with seeded random heads (no trained head is reachable here).

Exactness only: greedy output is the target's whatever the head proposes, and every
draft the runner proposes, batched and incrementally (catching up after each step,
through preemption and prefix caching), equals the draft of the same head run from
scratch over the request's whole sequence.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from schedkit.core.request import SamplingParams  # noqa: E402
from schedkit.engine.core import EngineCore  # noqa: E402
from schedkit.errors import ConfigError  # noqa: E402
from schedkit.plugins.testing import assert_scheduler_consistent  # noqa: E402
from schedkit.runners.paged.builder import build_random_eagle_head  # noqa: E402
from schedkit.runners.paged.device_inputs import device_inputs  # noqa: E402
from schedkit.runners.paged.draft_model import Span, pack_spans  # noqa: E402
from schedkit.runners.paged.input_batch import InputBatch  # noqa: E402
from schedkit.runners.paged.kv_cache import allocate_kv_cache  # noqa: E402
from schedkit.runners.paged.testing import (  # noqa: E402
    greedy_request,
    paged_config,
    random_prompts,
    run_engine,
)

PROMPTS = random_prompts([21, 40, 9, 33], 512, seed=11)


def _head(model_path: Path, tmp_path: Path, seed: int = 0, **flavour: Any) -> Path:
    config = json.loads((model_path / "config.json").read_text())
    return build_random_eagle_head(tmp_path / f"head-{seed}-{sorted(flavour.items())}", config, seed, **flavour)


def _engine(path: Path, head: Path, k: int = 3, async_scheduling: bool = False, **kw: Any) -> EngineCore:
    return EngineCore(paged_config(path, speculative_method="eagle", draft_model={"name": str(head)},
                                   scheduler={"num_speculative_tokens": k, "async_scheduling": async_scheduling},
                                   **kw))


# Asynchronous scheduling: the head catches up and drafts inside each step, once the
# step before is settled; every draft is still the head's from scratch.
either_scheduling = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def _execute_name(engine: EngineCore) -> str:
    return "execute_async" if engine._launch_async else "execute"


@torch.inference_mode()
def reference_drafts(runner: Any, tokens: list[int], k: int) -> list[int]:
    """The head's drafts after ``tokens``, from scratch: the target over the whole
    sequence on a cache of its own, the head over every position, then ``k`` drafts."""
    drafter, bs = runner.draft, 16
    n = len(tokens)
    blocks = -(-(n + k) // bs) + 1
    ib = InputBatch(n + k + 8, bs, 1)
    ib.add("ref", tokens, n, list(range(1, blocks)), 0, SamplingParams())
    st = ib.states["ref"]
    target_kv = allocate_kv_cache(runner.args, blocks, bs, runner.kv_dtype, runner.device)
    head_kv = allocate_kv_cache(drafter.args, blocks, bs, runner.kv_dtype, runner.device)

    def pass_(model_call: Any, start: int, end: int, shift: int) -> Any:
        inputs = pack_spans(ib, [Span(st, start, end)], [False], token_shift=shift)
        ids, pos, meta = device_inputs(inputs, runner.device, runner.attention_backend, 1)
        return model_call(ids, pos, meta)

    hidden = pass_(lambda ids, pos, meta: runner.model(ids, pos, target_kv, meta), 0, n - 1, 0)
    out = pass_(lambda ids, pos, meta: drafter.head(ids, hidden, pos, head_kv[0], meta,
                                                    runner.model.model.embed_tokens), 0, n - 1, 1)
    g = out[-1:]
    drafts = [int(runner.model.compute_logits(g).argmax(-1))]
    for i in range(1, k):
        ib.token_ids[st.row, n - 1 + i] = drafts[-1]
        g = pass_(lambda ids, pos, meta, f=g: drafter.head(ids, f, pos, head_kv[0], meta,
                                                            runner.model.model.embed_tokens),
                  n - 2 + i, n - 1 + i, 1)
        drafts.append(int(runner.model.compute_logits(g).argmax(-1)))
    return drafts


def _record(engine: EngineCore) -> list[tuple[list[int], list[int]]]:
    """Every proposal as (the request's tokens then, its drafts); the scheduler's
    invariants checked before every step."""
    runner, seen = engine.runner, []
    propose, execute = runner.propose_draft_token_ids, getattr(runner, _execute_name(engine))

    def spy(plan: Any) -> Any:
        drafts = propose(plan)
        ib = runner.input_batch
        for rid, d in drafts.items():
            st = ib.states[rid]
            seen.append((ib.token_ids[st.row, :st.num_tokens].tolist(), list(d)))
        return drafts

    def checked(so: Any) -> Any:
        assert_scheduler_consistent(engine.scheduler)
        return execute(so)

    runner.propose_draft_token_ids = spy
    setattr(runner, _execute_name(engine), checked)
    return seen


@pytest.mark.parametrize("flavour", [{}, {"fc_bias": True, "input_norm": True, "own_embedding": True}],
                         ids=["eagle1", "with-norm-bias-embedding"])
@either_scheduling
def test_greedy_output_is_the_targets_and_every_draft_is_the_heads(model_dir: Any, tmp_path: Path,
                                                                   flavour: dict[str, Any],
                                                                   async_scheduling: bool) -> None:
    path = model_dir("llama")
    expected = run_engine(EngineCore(paged_config(path)), [greedy_request(str(i), p, 24)
                                                           for i, p in enumerate(PROMPTS)])
    engine = _engine(path, _head(path, tmp_path, **flavour), async_scheduling=async_scheduling)
    assert engine.scheduler.num_lookahead_tokens == 3
    seen = _record(engine)
    assert run_engine(engine, [greedy_request(str(i), p, 24) for i, p in enumerate(PROMPTS)]) == expected
    assert len(seen) > 20
    for tokens, drafts in seen:
        assert drafts == reference_drafts(engine.runner, tokens, len(drafts)), tokens
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1


@either_scheduling
def test_drafts_stay_exact_through_preemption_and_prefix_hits(model_dir: Any, tmp_path: Path,
                                                              async_scheduling: bool) -> None:
    path = model_dir("llama")
    shared = PROMPTS[1][:32]
    prompts = [shared + p[:8] for p in PROMPTS] + [shared]
    reqs = lambda: [greedy_request(str(i), p, 40) for i, p in enumerate(prompts)]  # noqa: E731
    small = {"num_blocks": 24, "block_size": 8, "enable_prefix_caching": True}
    expected = run_engine(EngineCore(paged_config(path, **small)), reqs())
    engine = _engine(path, _head(path, tmp_path, seed=1), async_scheduling=async_scheduling, **small)
    seen = _record(engine)
    assert run_engine(engine, reqs()) == expected
    assert engine.scheduler.num_preemptions_total > 0 and engine.stats()["prefix_cache_hits"] > 0
    assert seen
    for tokens, drafts in seen:
        assert drafts == reference_drafts(engine.runner, tokens, len(drafts)), tokens


@either_scheduling
def test_a_request_the_budget_leaves_out_is_drafted_from_its_kept_state(model_dir: Any, tmp_path: Path,
                                                                        async_scheduling: bool) -> None:
    """A 12-token budget runs three of four decoding requests a step (1 + 3 drafts each):
    the others are still drafted for, from the target hidden state kept for them."""
    path = model_dir("llama")
    reqs = lambda: [greedy_request(str(i), p[:3], 16) for i, p in enumerate(PROMPTS)]  # noqa: E731
    tight = {"max_num_batched_tokens": 12, "max_num_seqs": 4}
    expected = run_engine(EngineCore(paged_config(path, **tight)), reqs())
    engine = _engine(path, _head(path, tmp_path, seed=2), async_scheduling=async_scheduling, **tight)
    runner = engine.runner
    execute, left_out = getattr(runner, _execute_name(engine)), []

    def watch(so: Any) -> Any:
        ib = runner.input_batch
        left_out.append(sum(1 for rid, st in ib.states.items()
                            if rid not in so.num_scheduled_tokens and st.num_tokens > st.num_prompt_tokens))
        return execute(so)

    setattr(runner, _execute_name(engine), watch)
    seen = _record(engine)
    assert run_engine(engine, reqs()) == expected
    assert sum(left_out) > 0 and seen
    for tokens, drafts in seen:
        assert drafts == reference_drafts(engine.runner, tokens, len(drafts)), tokens


def test_a_prefix_hit_leaves_its_last_block_to_the_head(model_dir: Any, tmp_path: Path) -> None:
    """With an EAGLE head a prefix hit stops one block short: the head's KV at a block's
    last position pairs it with the next token, which the request that wrote it may
    not share, so the request computes that block and the head gets its hidden states."""
    path = model_dir("llama")
    shared = PROMPTS[1][:32]
    small = {"block_size": 8, "enable_prefix_caching": True}
    plain = EngineCore(paged_config(path, **small))
    engine = _engine(path, _head(path, tmp_path), **small)
    for e in (plain, engine):
        run_engine(e, [greedy_request("a", shared + [1, 2, 3], 4)])
        run_engine(e, [greedy_request("b", shared + [4, 5, 6], 4)])
    assert plain.stats()["prefix_cache_hits"] == 32
    assert engine.stats()["prefix_cache_hits"] == 24


def test_bad_heads_are_refused_with_what_is_wrong(model_dir: Any, tmp_path: Path) -> None:
    path = model_dir("llama")
    with pytest.raises(ConfigError, match="draft_model.name"):
        paged_config(path, speculative_method="eagle", scheduler={"num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="num_layers"):
        paged_config(path, speculative_method="eagle", draft_model={"name": "x", "num_layers": 1},
                     scheduler={"num_speculative_tokens": 2})
    other = model_dir("llama", hidden_size=32, num_heads=2, num_kv_heads=1)
    with pytest.raises(ConfigError, match="hidden_size"):
        _engine(path, _head(other, tmp_path))
    with pytest.raises(ConfigError, match="one decoder layer"):  # a whole model is not a head
        _engine(path, path)


@either_scheduling
def test_swap_carries_the_heads_kv(model_dir: Any, tmp_path: Path, async_scheduling: bool) -> None:
    """Preemption by swap (cpu-offload): the head's KV goes out and back in with the
    target's, so a resumed request's drafts are still those of the head from scratch."""
    from schedkit.config import config_from_dict

    path = model_dir("llama")
    prompts = PROMPTS + random_prompts([30, 26], 512, seed=12)
    reqs = lambda: [greedy_request(str(i), p, 40) for i, p in enumerate(prompts)]  # noqa: E731
    small = {"num_blocks": 22, "block_size": 8, "enable_prefix_caching": True}
    expected = run_engine(EngineCore(paged_config(path, **small)), reqs())
    cfg = paged_config(path, **small, speculative_method="eagle", draft_model={"name": str(_head(path, tmp_path))},
                       scheduler={"num_speculative_tokens": 3, "async_scheduling": async_scheduling}
                       ).model_dump(mode="json")
    cfg["plugins"] = [{"name": "cpu-offload"}]
    engine = EngineCore(config_from_dict(cfg))
    seen = _record(engine)
    assert run_engine(engine, reqs()) == expected
    connector = engine.scheduler.connector
    assert connector.num_loaded_blocks > 0 and connector.num_saved_blocks > 0
    for tokens, drafts in seen:
        assert drafts == reference_drafts(engine.runner, tokens, len(drafts)), tokens
