"""A draft model proposing tokens for the target model to verify (``draft_model``).

The draft is a smaller causal LM sharing the target's tokenizer (or the target itself,
or its first few layers). Its KV cache lies on the target's blocks: one more K and V
tensor per draft layer, indexed by the same block ids, so the scheduler's block tables
account for the draft's KV exactly. A block allocated, cached for a prefix, swapped out
and in, or freed carries both models' KV; a rejected draft's slots are rewritten, as
the target's are.

Each request planned drafts first catches the draft up on the tokens it gained since
the draft last ran for it (the accepted drafts and the token just sampled; every token,
prompt and prefix hits included, when the request is new to the runner or resumed, so
the draft never reads a block its own KV was not written to), all planned requests in
one batched pass that writes the draft's KV, and reads the request's next token
greedily off the last position. It then decodes ``k - 1`` more, one batched pass per
token, writing their KV into the request's *lookahead slots*: the scheduler allocates
``num_speculative_tokens`` slots past each step's tokens (``num_lookahead_tokens``).
The draft writes nowhere else; a request whose blocks leave less room gets fewer
drafts. A request the policy plans none costs the draft nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from schedkit.runners.paged.device_inputs import device_inputs
from schedkit.runners.paged.input_batch import InputBatch, RequestState, StepInputs
from schedkit.runners.paged.kv_cache import allocate_kv_cache, bytes_per_block
from schedkit.runners.paged.models import CausalLM, ModelArgs


@dataclass(slots=True)
class Span:
    state: RequestState
    start: int
    end: int
    """Tokens ``[start, end)`` of the request go through the draft this pass."""


class DraftModel:
    """Args:
        model: The draft model, on the target's device.
        attention_backend: The target's resolved attention backend.
        kv_dtype: The target's KV cache dtype.
        max_tokens: Most tokens one catch-up pass runs (the step's token budget).
        target_vocab_size: The target's vocabulary (None: the draft's). Where the two
            are padded to different sizes, the draft proposes only tokens both embed,
            and reads a target token past its own vocabulary as token 0 (the target
            verifies every draft, so this costs acceptance, never exactness).
    """

    def __init__(self, model: CausalLM, attention_backend: str, kv_dtype: torch.dtype, max_tokens: int,
                 target_vocab_size: int | None = None) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.args: ModelArgs = model.args
        self.vocab_size = min(self.args.vocab_size, target_vocab_size or self.args.vocab_size)
        """Token ids below this are drafted."""
        self._reads_past_vocab = self.args.vocab_size < (target_vocab_size or 0)
        """The target may produce tokens the draft does not embed."""
        self.device = next(model.parameters()).device
        self.attention_backend = attention_backend
        self.kv_dtype = kv_dtype
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._done: dict[str, tuple[RequestState, int]] = {}
        """Per request (its runner state, to tell a readmission): tokens whose KV the
        draft has written."""

    def bytes_per_block(self, block_size: int) -> int:
        """KV bytes the draft adds to every block."""
        return bytes_per_block(self.args, block_size, self.kv_dtype)

    def initialize(self, num_blocks: int, block_size: int) -> None:
        """Allocate the draft's KV cache over the same ``num_blocks`` block ids.

        Raises:
            KVCacheAllocationError: It does not fit.
        """
        self.kv_caches = allocate_kv_cache(self.args, num_blocks, block_size, self.kv_dtype, self.device)

    @torch.inference_mode()
    def propose(self, ib: InputBatch, plan: Mapping[str, int], max_model_len: int) -> dict[str, list[int]]:
        """Draft up to ``plan[rid]`` greedy tokens for each planned request, first
        catching the draft up on its tokens since it last drafted for it, at most
        ``max_tokens`` of them in the pass: a request whose catch-up does not fit is
        caught up in part, and drafted for at a later step."""
        bs = ib.block_size
        budget = self.max_tokens
        for rid in [r for r in self._done if r not in ib.states]:
            del self._done[rid]
        spans: list[Span] = []
        wanted: dict[str, int] = {}
        for rid, k in plan.items():
            st = ib.states.get(rid)
            if st is None or k <= 0:
                continue
            n, room = st.num_tokens, st.num_blocks * bs  # room: the slots the scheduler allocated
            # Draft i is decoded at position n - 1 + i and written there by the next draft:
            # the last one needs no slot, and none may pass max_model_len.
            k = min(k, room - n + 1, max_model_len - n)
            if k <= 0:
                continue
            seen = self._done.get(rid)
            # New to the runner (admitted, resumed): from its first token, prefix hits
            # included, whose blocks may hold no draft KV. Drafts continue the last
            # token, fed again if it was fed already (or taken back by the scheduler).
            start = min(seen[1], n - 1) if seen is not None and seen[0] is st else 0
            end = min(n, start + budget)
            if end <= start:
                continue
            budget -= end - start
            spans.append(Span(st, start, end))
            if end == n:
                wanted[rid] = k
        if not spans:
            return {}
        sample = [s.state.req_id in wanted for s in spans]
        tokens = self._pass(ib, spans, sample)
        for span in spans:
            self._done[span.state.req_id] = (span.state, span.end)
        drafts = {s.state.req_id: [tok] for s, tok in zip([s for s, m in zip(spans, sample, strict=True) if m],
                                                          tokens, strict=True)}
        for i in range(1, max(wanted.values(), default=0)):
            going, steps = next_draft_spans(ib, wanted, drafts, i)
            for rid, tok in zip(going, self._pass(ib, steps, [True] * len(steps)), strict=True):
                drafts[rid].append(tok)
        return drafts

    def _pass(self, ib: InputBatch, spans: list[Span], sample: list[bool]) -> list[int]:
        """One forward pass of the draft over ``spans`` (writing their KV); the greedy
        next token after the last position of each span marked in ``sample``."""
        inputs = pack_spans(ib, spans, sample)
        input_ids, pos, meta = device_inputs(inputs, self.device, self.attention_backend, self.args.num_kv_heads)
        if self._reads_past_vocab:
            input_ids = torch.where(input_ids < self.args.vocab_size, input_ids, 0)
        hidden = self.model(input_ids, pos, self.kv_caches, meta)
        if not len(inputs.logits_indices):
            return []
        idx = torch.from_numpy(inputs.logits_indices).to(self.device)
        logits = self.model.compute_logits(hidden[idx])
        if self.vocab_size < self.args.vocab_size:
            logits = logits[:, :self.vocab_size]
        return logits.argmax(dim=-1).tolist()


def next_draft_spans(ib: InputBatch, wanted: Mapping[str, int], drafts: Mapping[str, list[int]], i: int,
                     behind: int = 0) -> tuple[list[str], list[Span]]:
    """The requests that want more than ``i`` drafts and a one-token span each: draft
    ``i`` written at its position (``n - 1 + i``) and fed from ``behind`` positions
    before it (an EAGLE head runs one behind the tokens)."""
    going = [rid for rid, k in wanted.items() if k > i]
    steps = []
    for rid in going:
        st = ib.states[rid]
        ib.token_ids[st.row, st.num_tokens - 1 + i] = drafts[rid][-1]
        pos = st.num_tokens - 1 - behind + i
        steps.append(Span(st, pos, pos + 1))
    return going, steps


def pack_spans(ib: InputBatch, spans: list[Span], sample: list[bool], token_shift: int = 0) -> StepInputs:
    """Packed inputs of positions ``[start, end)`` of each span's request, written to
    their own slots, each with the token ``token_shift`` places on (an EAGLE head reads
    the next token); ``logits_indices`` are the last rows of the spans marked in
    ``sample``."""
    bs = ib.block_size
    rows = np.array([s.state.row for s in spans], dtype=np.int64)
    starts = np.array([s.start for s in spans], dtype=np.int64)
    counts = np.array([s.end - s.start for s in spans], dtype=np.int64)
    cu = np.zeros(len(spans) + 1, dtype=np.int64)
    np.cumsum(counts, out=cu[1:])
    total = int(cu[-1])
    req_of_token = np.repeat(np.arange(len(spans)), counts)
    positions = starts[req_of_token] + (np.arange(total) - cu[:-1][req_of_token])
    token_rows = rows[req_of_token]
    held = np.array([s.state.num_blocks for s in spans], dtype=np.int64)[req_of_token]
    assert (positions // bs < held).all(), "a draft token outside its request's blocks"
    blocks = ib.block_table[token_rows, positions // bs].astype(np.int64)
    seq_lens = (starts + counts).astype(np.int32)
    width = -(-int(seq_lens.max()) // bs)
    return StepInputs(
        req_ids=[s.state.req_id for s in spans], input_ids=ib.token_ids[token_rows, positions + token_shift],
        positions=positions, slot_mapping=blocks * bs + positions % bs,
        query_start_loc=cu.astype(np.int32), seq_lens=seq_lens, block_table=ib.block_table[rows, :width],
        logits_indices=(cu[1:] - 1)[np.asarray(sample, dtype=bool)])
