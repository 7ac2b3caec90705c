"""Tests of the echo runner: schedkit's scheduler drives it step by step (the test kit
``schedkit.plugins.testing``, available wherever schedkit is installed), and, once the
package is installed, an engine runs it from a config naming ``runner.kind: echo``."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
from schedkit import LLM, Config, ConfigError, SamplingParams
from schedkit.plugins.testing import make_request, make_scheduler, step

from schedkit_echo_runner import EchoRunner

VOCAB = 100


def make_config(settings: dict | None = None) -> Config:
    return Config.model_validate({"runner": {"kind": "echo", "vocab_size": VOCAB,
                                             "settings": settings or {}}})


def echoed(prompt: list[int], n: int, shift: int = 0) -> list[int]:
    return [(prompt[i % len(prompt)] + shift) % VOCAB for i in range(n)]


def serve(runner: EchoRunner, prompts: dict[str, list[int]], max_tokens: int, **scheduler):
    """Every request to the end through a scheduler; returns its tokens per request, the
    number of steps that ran tokens, and the scheduler."""
    sched = make_scheduler(**scheduler)
    for rid, prompt in prompts.items():
        sched.add_request(make_request(rid, prompt, max_tokens=max_tokens))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    busy_steps = 0
    while sched.has_requests():
        result = step(sched, runner)
        busy_steps += bool(result.scheduler_output.total_num_scheduled_tokens)
        for out in result.outputs:
            tokens[out.request_id] += out.new_token_ids
    return tokens, busy_steps, sched


def test_outputs_echo_the_prompt_with_the_shift():
    prompts = {"a": [5, 6, 7], "b": [99, 1]}
    tokens, _, _ = serve(EchoRunner.from_config(make_config({"shift": 2})), prompts, max_tokens=5)
    assert tokens == {rid: echoed(p, 5, shift=2) for rid, p in prompts.items()}


def test_a_prompt_prefilled_in_chunks_samples_once_it_is_whole():
    prompt = list(range(1, 41))  # 40 tokens, 16 a step: three steps of prefill
    tokens, busy_steps, _ = serve(EchoRunner(VOCAB), {"long": prompt}, max_tokens=4,
                                  max_num_batched_tokens=16, max_num_seqs=4)
    assert tokens == {"long": echoed(prompt, 4)}
    assert busy_steps == 3 + 3  # 3 prefill chunks (the last samples), then 3 decodes


def test_preempted_requests_resume_where_they_were():
    # 8 usable blocks of 4 tokens: four 6-token prompts growing to 14 tokens must preempt.
    prompts = {f"r{i}": [i + 1] * 5 + [50 + i] for i in range(4)}
    tokens, _, sched = serve(EchoRunner(VOCAB), prompts, max_tokens=8, block_size=4, num_blocks=9)
    assert sched.num_preemptions_total > 0
    assert tokens == {rid: echoed(p, 8) for rid, p in prompts.items()}


@pytest.mark.parametrize("settings, key", [
    ({"shift": -1}, "runner.settings.shift = -1"),
    ({"shift": "one"}, "runner.settings.shift = 'one'"),
    ({"step_time_ms": 0}, "runner.settings.step_time_ms = 0"),
    ({"shfit": 1}, r"unknown key\(s\) \['shfit'\]"),
])
def test_bad_settings_are_config_errors_naming_the_key(settings, key):
    with pytest.raises(ConfigError, match=key):
        EchoRunner.from_config(make_config(settings))


INSTALLED = {ep.name: ep for ep in entry_points(group="schedkit.runners")}


@pytest.mark.skipif("echo" not in INSTALLED, reason="schedkit-echo-runner is not installed")
def test_an_engine_builds_the_installed_runner_from_the_config():
    assert INSTALLED["echo"].load() is EchoRunner
    with LLM(make_config({"shift": 1})) as llm:
        out, = llm.generate([[3, 4]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert out.output_token_ids == echoed([3, 4], 3, shift=1)
