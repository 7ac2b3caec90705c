"""A deterministic runner for tests and scheduler benchmarks: no model, no torch.

The "model" emits output token ``i`` of request ``r`` as a fixed function of ``r`` and
``i``; an optional per-request output length makes it emit EOS at that position. It
verifies drafts against the same function, so speculative decoding accepts exactly the
correct prefix of each draft list, as a real target model would; its own drafts are
right by a fixed pattern or, with ``draft_acceptance``, with a chance per request. A structured request's
token that its grammar bitmask forbids is replaced by an allowed one (a fixed function of
the forbidden token), as masked logits would make a model choose.
"""

from __future__ import annotations

import random
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from schedkit.core.outputs import DRAFT_PLACEHOLDER, ModelRunnerOutput, SchedulerOutput
from schedkit.core.structured_output import GrammarBitmask


def unit_hash(seed: int, index: int) -> float:
    """A number in [0, 1) that depends only on ``(seed, index)`` (a 64-bit mix)."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 29
    return x / 2.0**64


_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class DraftAcceptance:
    """Per-request draft acceptance drawn from a Beta distribution of mean ``mean`` and
    concentration ``concentration`` (``a = mean * concentration``, ``b = (1 - mean) *
    concentration``): the larger it is, the closer every request stays to the mean.
    Each request's draw depends only on its seed, so a workload gets the same chances in
    every run and under every policy."""

    mean: float
    concentration: float

    def draw(self, seed: int) -> float:
        if self.mean <= 0.0 or self.mean >= 1.0:
            return self.mean
        rng = random.Random(seed)
        return rng.betavariate(self.mean * self.concentration, (1.0 - self.mean) * self.concentration)


def tenant_acceptance(config: Any) -> dict[str, float]:
    """The workload's tenants' own draft acceptance (``workload.tenants[].draft_acceptance``),
    by tenant name."""
    workload = getattr(config, "workload", None)
    return {t.name: t.draft_acceptance for t in getattr(workload, "tenants", ()) if t.draft_acceptance is not None}


def draft_acceptance_of(runner_config: Any) -> float | DraftAcceptance | None:
    """The fake or simulated runner config's ``draft_acceptance`` (a number, or a
    mapping with ``mean`` and ``concentration``; None when absent)."""
    spec = getattr(runner_config, "draft_acceptance", None)
    if spec is None or isinstance(spec, (int, float)):
        return spec
    return DraftAcceptance(spec.mean, spec.concentration)


@dataclass(slots=True)
class _ReqState:
    seed: int
    num_prompt_tokens: int
    tokens: list[int]
    num_computed_tokens: int
    eos_at: int | None = None
    tenant: str = "default"


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
        draft_error_every: Every this many draft positions the proposal is wrong (0: never);
            without ``draft_acceptance``.
        draft_acceptance: Each request's chance that a draft is right (drafts after a
            wrong one are never reached): a number for every request, or a
            :class:`DraftAcceptance` drawing one per request (None: ``draft_error_every``).
        acceptance_by_tenant: Chances of given tenants' requests, over the above
            (``workload.tenants[].draft_acceptance``).
        step_time_s: Virtual duration reported for every step (drives the engine clock).
        is_virtual_clock: False: every step that runs a request sleeps ``step_time_s``
            and the engine keeps the wall clock.
    """

    vocab_size: int = 32000
    eos_token_id: int | None = None
    output_len: Callable[[str], int | None] | None = None
    draft_error_every: int = 3
    draft_acceptance: float | DraftAcceptance | None = None
    acceptance_by_tenant: dict[str, float] = field(default_factory=dict)
    step_time_s: float = 0.01
    is_virtual_clock: bool = True
    states: dict[str, _ReqState] = field(default_factory=dict)
    _parked: dict[str, tuple[int, int, str]] = field(default_factory=dict)
    """Preempted request -> its prompt length (to resume counting outputs), seed and tenant."""
    _last_sampled: list[str] = field(default_factory=list)
    drafts_in_step: ClassVar[bool] = True
    """It proposes the drafts of placeholder slots inside the step (asynchronous
    scheduling with speculation)."""

    @classmethod
    def from_config(cls, config: Any) -> FakeRunner:
        """Build from a :class:`schedkit.config.Config` (its ``runner`` section)."""
        rc = config.runner
        return cls(vocab_size=rc.vocab_size, eos_token_id=rc.eos_token_id,
                   draft_acceptance=draft_acceptance_of(rc), acceptance_by_tenant=tenant_acceptance(config),
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
                self._parked[rid] = (old.num_prompt_tokens, old.seed, old.tenant)
        for new in scheduler_output.scheduled_new_reqs:
            eos_at = self.output_len(new.req_id) if self.output_len is not None else None
            states[new.req_id] = _ReqState(request_seed(new.req_id, new.sampling_params.seed),
                                           len(new.prompt_token_ids),
                                           new.prompt_token_ids + new.output_token_ids,
                                           new.num_computed_tokens, eos_at, new.tenant)
        cached = scheduler_output.scheduled_cached_reqs
        for rid, tokens in cached.resumed_token_ids.items():
            num_prompt, seed, tenant = self._parked.pop(rid)
            eos_at = self.output_len(rid) if self.output_len is not None else None
            states[rid] = _ReqState(seed, num_prompt, list(tokens), 0, eos_at, tenant)
        for rid, tokens in cached.appended_token_ids.items():  # jump-forward decoding
            states[rid].tokens.extend(tokens)
        for rid, computed, num_out in zip(cached.req_ids, cached.num_computed_tokens,
                                          cached.num_output_tokens, strict=True):
            st = states[rid]
            # Planned before the step in flight's output was processed (asynchronous
            # scheduling), the scheduler still counts the drafts that step rejected.
            behind = st.num_prompt_tokens + num_out - len(st.tokens)
            st.num_computed_tokens = computed - max(behind, 0)
            del st.tokens[st.num_prompt_tokens + num_out:]  # tokens the scheduler dropped
        spec = scheduler_output.scheduled_spec_decode_tokens
        bitmask = scheduler_output.grammar_bitmask
        rows = scheduler_output.structured_output_request_ids if bitmask is not None else {}
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            st = states[rid]
            drafts = spec.get(rid, ())
            if drafts and drafts[0] == DRAFT_PLACEHOLDER:  # proposed here, inside the step
                drafts = self._propose(rid, st, len(drafts))
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

    def propose_draft_token_ids(self, num_spec_tokens: Mapping[str, int]) -> dict[str, list[int]]:
        """Propose the true next tokens, wrong at every ``draft_error_every``-th position."""
        drafts = {}
        for rid in self._last_sampled:
            st = self.states.get(rid)
            k = num_spec_tokens.get(rid, 0)
            if st is not None and k:
                drafts[rid] = self._propose(rid, st, k)
        return drafts

    def _propose(self, rid: str, st: _ReqState, k: int) -> list[int]:
        """``k`` drafts continuing the request's tokens."""
        base = len(st.tokens) - st.num_prompt_tokens
        alpha = self.acceptance_of(st.seed, tenant=st.tenant)
        props = []
        for j in range(k):
            tok = self.token_at(st, base + j)
            if alpha is None:
                wrong = bool(self.draft_error_every) and (st.seed + base + j) % self.draft_error_every == 0
            else:
                wrong = unit_hash(st.seed, base + j) >= alpha
            if wrong:
                tok = (tok + 1) % self.vocab_size
            props.append(tok)
        return props

    def acceptance_of(self, seed: int, *, tenant: str = "default") -> float | None:
        """The chance that a draft of a request of this seed and tenant is right (None:
        the fixed pattern of ``draft_error_every``)."""
        alpha = self.acceptance_by_tenant.get(tenant)
        if alpha is not None:
            return alpha
        spec = self.draft_acceptance
        if spec is None or isinstance(spec, (int, float)):
            return spec
        return spec.draw(seed)
