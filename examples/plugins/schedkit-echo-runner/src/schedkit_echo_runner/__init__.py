"""A model runner that echoes each prompt back: an example schedkit runner plugin.

Output token ``i`` of a request is its prompt's token ``i`` (cycling through the prompt),
plus ``shift`` modulo the vocabulary. There is no model and no KV cache, but the runner
follows every request through the scheduler's steps as a real one must: chunked
prefill, preemption and resumption, finished and aborted requests. It is installed
through the ``schedkit.runners`` entry-point group and chosen with ``runner.kind: echo``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from schedkit import ConfigError, ModelRunnerOutput, SchedulerOutput

__all__ = ["EchoRunner"]
__version__ = "0.1.0"

SETTINGS = {"shift": 0, "step_time_ms": 1.0}
"""Settings under ``runner.settings`` and their defaults."""


@dataclass(slots=True)
class _Req:
    num_prompt_tokens: int
    tokens: list[int]
    """Prompt, then outputs."""
    num_computed_tokens: int


class EchoRunner:
    """Args:
        vocab_size: Output tokens are below it (``runner.vocab_size``).
        shift: Added to each echoed token, modulo ``vocab_size`` (an int >= 0).
        step_time_ms: Virtual duration of a step that runs requests (> 0); the engine's
            clock advances by it, so a workload replays without waiting.
    """

    is_virtual_clock = True

    def __init__(self, vocab_size: int = 32000, shift: int = 0, step_time_ms: float = 1.0) -> None:
        self.vocab_size = vocab_size
        self.shift = shift
        self.step_time_s = step_time_ms / 1e3
        self.reqs: dict[str, _Req] = {}

    @classmethod
    def from_config(cls, config: Any) -> EchoRunner:
        """Build from a validated ``schedkit.Config``: ``runner.vocab_size`` and this
        runner's ``runner.settings``.

        Raises:
            ConfigError: An unknown setting or a bad value, named by its key.
        """
        settings = config.runner.settings
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise ConfigError(f"runner.settings: unknown key(s) {unknown} for the echo runner "
                              f"(it takes {sorted(SETTINGS)})")
        shift, step_time_ms = (settings.get(k, default) for k, default in SETTINGS.items())
        if isinstance(shift, bool) or not isinstance(shift, int) or shift < 0:
            raise ConfigError(f"runner.settings.shift = {shift!r}: must be an integer >= 0")
        if isinstance(step_time_ms, bool) or not isinstance(step_time_ms, (int, float)) \
                or not 0 < step_time_ms < float("inf"):
            raise ConfigError(f"runner.settings.step_time_ms = {step_time_ms!r}: must be a "
                              "number > 0")
        return cls(vocab_size=config.runner.vocab_size, shift=shift,
                   step_time_ms=float(step_time_ms))

    def initialize(self, num_blocks: int, block_size: int) -> int:
        """No KV cache to allocate: every block the config asks for is available."""
        return num_blocks

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Bring the requests up to date with the step, then sample one token for each
        request whose prompt (and earlier outputs) the step finishes computing."""
        self._update_states(scheduler_output)
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            req = self.reqs[rid]
            req.num_computed_tokens += n
            req_ids.append(rid)
            if req.num_computed_tokens < len(req.tokens):
                sampled.append([])  # a prefill chunk: no token yet
                continue
            token = self._echo(req)
            req.tokens.append(token)
            sampled.append([token])
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled,
                                 step_duration=self.step_time_s if req_ids else 0.0)

    def propose_draft_token_ids(self, num_spec_tokens: Mapping[str, int]) -> dict[str, list[int]]:
        """No drafts: with ``scheduler.num_speculative_tokens`` set, requests decode one
        token a step."""
        return {}

    def _echo(self, req: _Req) -> int:
        num_outputs = len(req.tokens) - req.num_prompt_tokens
        return (req.tokens[num_outputs % req.num_prompt_tokens] + self.shift) % self.vocab_size

    def _update_states(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids:
            self.reqs.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.reqs[new.req_id] = _Req(len(new.prompt_token_ids), list(new.prompt_token_ids),
                                         new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for rid, tokens in cached.resumed_token_ids.items():  # preempted, now recomputed
            self.reqs[rid].tokens = list(tokens)
        for rid, computed, num_outputs in zip(cached.req_ids, cached.num_computed_tokens,
                                              cached.num_output_tokens, strict=True):
            req = self.reqs[rid]
            req.num_computed_tokens = computed
            del req.tokens[req.num_prompt_tokens + num_outputs:]  # tokens the scheduler dropped
        for rid, tokens in cached.appended_token_ids.items():  # jump-forward decoding
            self.reqs[rid].tokens.extend(tokens)
