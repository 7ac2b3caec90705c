"""A deterministic runner for tests and scheduler benchmarks: no model, no torch.

The "model" emits output token ``i`` of request ``r`` as a fixed function of ``r`` and
``i``; an optional per-request output length makes it emit EOS at that position. It
verifies drafts against the same function, so speculative decoding accepts exactly the
correct prefix of each draft list, as a real target model would. A structured request's
token that its grammar bitmask forbids is replaced by an allowed one (a fixed function of
the forbidden token), as masked logits would make a model choose.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from schedkit.core.outputs import ModelRunnerOutput, SchedulerOutput
from schedkit.core.structured_output import GrammarBitmask


@dataclass(slots=True)
class _ReqState:
    seed: int
    num_prompt_tokens: int
    tokens: list[int]
    num_computed_tokens: int
    eos_at: int | None = None


def request_seed(request_id: str, seed: int | None = None) -> int:
    """What a request's fake tokens derive from: its sampling seed when it has one (the
    same seed gives the same tokens whatever the id), else its id."""
    return zlib.crc32(request_id.encode()) if seed is None else seed % (2**32) + 1


@dataclass
class FakeRunner:
    """Args:
        vocab_size: Tokens are drawn from ``[0, vocab_size)``.
        eos_token_id: Token emitted at a request's ``output_len``; never otherwise.
        output_len: ``request_id -> number of outputs before EOS`` (None: never EOS).
        draft_error_every: Every this many draft positions the proposal is wrong (0: never).
        step_time_s: Virtual duration reported for every step (drives the engine clock).
        is_virtual_clock: False: every step that runs a request sleeps ``step_time_s``
            and the engine keeps the wall clock.
    """

    vocab_size: int = 32000
    eos_token_id: int | None = None
    output_len: Callable[[str], int | None] | None = None
    draft_error_every: int = 3
    step_time_s: float = 0.01
    is_virtual_clock: bool = True
    states: dict[str, _ReqState] = field(default_factory=dict)
    _parked: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Preempted request -> its prompt length (to resume counting outputs) and seed."""
    _last_sampled: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: Any) -> FakeRunner:
        """Build from a :class:`schedkit.config.Config` (its ``runner`` section)."""
        rc = config.runner
        return cls(vocab_size=rc.vocab_size, eos_token_id=rc.eos_token_id,
                   step_time_s=rc.step_time_ms / 1e3, is_virtual_clock=rc.clock == "virtual")

    def initialize(self, num_blocks: int, block_size: int) -> int:
        return num_blocks

    def token_at(self, state: _ReqState, output_index: int) -> int:
        if state.eos_at is not None and output_index == state.eos_at and self.eos_token_id is not None:
            return self.eos_token_id
        tok = (state.seed + 7919 * output_index) % self.vocab_size
        if tok == self.eos_token_id:
            tok = (tok + 1) % self.vocab_size
        return tok

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        states = self.states
        for rid in scheduler_output.finished_req_ids:
            states.pop(rid, None)
            self._parked.pop(rid, None)
        for rid in scheduler_output.preempted_req_ids:
            old = states.pop(rid, None)
            if old is not None:
                self._parked[rid] = (old.num_prompt_tokens, old.seed)
        for new in scheduler_output.scheduled_new_reqs:
            eos_at = self.output_len(new.req_id) if self.output_len is not None else None
            states[new.req_id] = _ReqState(request_seed(new.req_id, new.sampling_params.seed),
                                           len(new.prompt_token_ids),
                                           new.prompt_token_ids + new.output_token_ids,
                                           new.num_computed_tokens, eos_at)
        cached = scheduler_output.scheduled_cached_reqs
        for rid, tokens in cached.resumed_token_ids.items():
            num_prompt, seed = self._parked.pop(rid)
            eos_at = self.output_len(rid) if self.output_len is not None else None
            states[rid] = _ReqState(seed, num_prompt, list(tokens), 0, eos_at)
        for rid, computed, num_out in zip(cached.req_ids, cached.num_computed_tokens,
                                          cached.num_output_tokens, strict=True):
            st = states[rid]
            st.num_computed_tokens = computed
            del st.tokens[st.num_prompt_tokens + num_out:]  # tokens the scheduler dropped
        for rid, tokens in cached.appended_token_ids.items():  # jump-forward decoding
            states[rid].tokens.extend(tokens)
        spec = scheduler_output.scheduled_spec_decode_tokens
        bitmask = scheduler_output.grammar_bitmask
        rows = scheduler_output.structured_output_request_ids if bitmask is not None else {}
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            st = states[rid]
            drafts = spec.get(rid, ())
            end = st.num_computed_tokens + n - len(drafts)
            st.num_computed_tokens += n
            req_ids.append(rid)
            if end < len(st.tokens):
                sampled.append([])  # a prefill chunk: no token yet
                continue
            row = rows.get(rid)
            out = self._verify(st, drafts, None if row is None or bitmask is None else (bitmask, row))
            st.tokens.extend(out)
            st.num_computed_tokens -= len(drafts) - (len(out) - 1)
            sampled.append(out)
        self._last_sampled = [r for r, s in zip(req_ids, sampled, strict=True) if s]
        if req_ids and not self.is_virtual_clock:
            time.sleep(self.step_time_s)
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled,
                                 step_duration=self.step_time_s if req_ids else 0.0)

    def _verify(self, st: _ReqState, drafts: list[int] | tuple[()],
                mask: tuple[GrammarBitmask, int] | None = None) -> list[int]:
        base = len(st.tokens) - st.num_prompt_tokens
        out = []
        for j, d in enumerate(drafts):
            tok = self._sample(st, base + j, mask, j)
            out.append(tok)
            if d != tok or tok == self.eos_token_id:
                return out
        out.append(self._sample(st, base + len(drafts), mask, len(drafts)))
        return out

    def _sample(self, st: _ReqState, output_index: int, mask: tuple[GrammarBitmask, int] | None,
                offset: int) -> int:
        """The token at ``output_index``; under a grammar (bitmask, first row), an allowed one."""
        tok = self.token_at(st, output_index)
        if mask is None:
            return tok
        bitmask, row = mask[0], mask[1] + offset
        if bitmask.allows(row, tok):
            return tok
        allowed = bitmask.allowed(row)
        return allowed[tok % len(allowed)] if allowed else tok

    def propose_draft_token_ids(self, num_spec_tokens: int) -> dict[str, list[int]]:
        """Propose the true next tokens, wrong at every ``draft_error_every``-th position."""
        drafts = {}
        for rid in self._last_sampled:
            st = self.states.get(rid)
            if st is None:
                continue
            base = len(st.tokens) - st.num_prompt_tokens
            props = []
            for j in range(num_spec_tokens):
                tok = self.token_at(st, base + j)
                if self.draft_error_every and (st.seed + base + j) % self.draft_error_every == 0:
                    tok = (tok + 1) % self.vocab_size
                props.append(tok)
            drafts[rid] = props
        return drafts
