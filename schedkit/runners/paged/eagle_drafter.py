"""Drafting with an EAGLE head (``speculative_method: eagle``).

The head (:class:`~schedkit.runners.paged.models.eagle.EagleHead`) reads the target's
hidden states, so the runner hands it each step's (:meth:`EagleDrafter.observe`). Its
one layer's KV cache lies on the target's blocks, as a draft model's does
(:mod:`~schedkit.runners.paged.draft_model`): the scheduler's block tables account for
it, and its own drafts go into the lookahead slots.

After every step the head catches up on each request's positions the target just
computed (position ``p`` pairs the target's hidden state there with the token at
``p + 1``, so it runs one position behind the tokens), up to the last accepted one. A
planned request then gets its first draft off the head's output at the position before
its newest token, and each further draft by feeding the head its own output with the
draft before. A planned request the target did not run this step is fed its last
position again, from the target hidden state kept for it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from schedkit.runners.paged.device_inputs import device_inputs
from schedkit.runners.paged.draft_model import Span, next_draft_spans, pack_spans
from schedkit.runners.paged.input_batch import InputBatch, StepInputs
from schedkit.runners.paged.kv_cache import allocate_kv_cache, bytes_per_block
from schedkit.runners.paged.models import CausalLM
from schedkit.runners.paged.models.eagle import EagleHead


class EagleDrafter:
    """Args:
        head: The EAGLE head, on the target's device.
        target: The target model (its embedding and LM head serve the head).
        attention_backend: The target's resolved attention backend.
        kv_dtype: The target's KV cache dtype.
    """

    def __init__(self, head: EagleHead, target: CausalLM, attention_backend: str, kv_dtype: torch.dtype) -> None:
        self.head = head
        self.target = target
        self.args = head.args
        self.device = next(head.parameters()).device
        self.attention_backend = attention_backend
        self.kv_dtype = kv_dtype
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._hidden: torch.Tensor | None = None
        self._rows: dict[str, tuple[int, int, int]] = {}
        """The last step's rows per request: (first row in ``_hidden``, its position, count)."""
        self._last: dict[str, tuple[int, torch.Tensor]] = {}
        """Per request, the last position the head was fed and the target's hidden state there."""

    def bytes_per_block(self, block_size: int) -> int:
        return bytes_per_block(self.args, block_size, self.kv_dtype)

    def initialize(self, num_blocks: int, block_size: int) -> None:
        self.kv_caches = allocate_kv_cache(self.args, num_blocks, block_size, self.kv_dtype, self.device)

    def observe(self, inputs: StepInputs, hidden: torch.Tensor) -> None:
        """The target's step: its packed inputs and final hidden states."""
        qsl = inputs.query_start_loc
        self._hidden = hidden
        self._rows = {rid: (int(qsl[i]), int(inputs.positions[qsl[i]]), int(qsl[i + 1] - qsl[i]))
                      for i, rid in enumerate(inputs.req_ids) if qsl[i + 1] > qsl[i]}

    @torch.inference_mode()
    def propose(self, ib: InputBatch, plan: Mapping[str, int], max_model_len: int) -> dict[str, list[int]]:
        """Catch up on the target's last step, then draft up to ``plan[rid]`` tokens for
        each planned request."""
        bs = ib.block_size
        rows, hidden = self._rows, self._hidden
        self._rows, self._hidden = {}, None
        for rid in [r for r in self._last if r not in ib.states]:
            del self._last[rid]
        spans: list[Span] = []
        features: list[torch.Tensor] = []
        wanted: dict[str, int] = {}
        for rid, st in ib.states.items():
            n = st.num_tokens
            st.num_draft_computed = min(st.num_draft_computed, n - 1)
            start, end = st.num_draft_computed, n - 1
            step = rows.get(rid)
            caught_up = False
            if step is not None and hidden is not None and start >= step[1]:
                row0, pos0, count = step
                start, end = max(start, pos0), min(end, pos0 + count)
                if end > start:
                    spans.append(Span(st, start, end))
                    features.append(hidden[row0 + start - pos0:row0 + end - pos0])
                    self._last[rid] = (end - 1, hidden[row0 + end - 1 - pos0].clone())
                    st.num_draft_computed = end
                    caught_up = end == n - 1
            k = plan.get(rid, 0)
            if k <= 0 or st.num_draft_computed != n - 1:
                continue
            k = min(k, st.num_blocks * bs - n + 2, max_model_len - n)
            if k <= 0:
                continue
            if not caught_up:  # not run this step: feed its last position again
                last = self._last.get(rid)
                if last is None or last[0] != n - 2:
                    continue
                spans.append(Span(st, n - 2, n - 1))
                features.append(last[1].unsqueeze(0))
            wanted[rid] = k
        if not spans:
            return {}
        sample = [s.state.req_id in wanted for s in spans]
        out = self._pass(ib, spans, torch.cat(features), sample)
        drafts: dict[str, list[int]] = {}
        feature: dict[str, torch.Tensor] = {}
        tokens = self.target.compute_logits(out).argmax(dim=-1).tolist()
        for s, tok, g in zip([s for s, m in zip(spans, sample, strict=True) if m], tokens, out, strict=True):
            drafts[s.state.req_id] = [tok]
            feature[s.state.req_id] = g
        for i in range(1, max(wanted.values(), default=0)):
            going, steps = next_draft_spans(ib, wanted, drafts, i, behind=1)
            out = self._pass(ib, steps, torch.stack([feature[rid] for rid in going]), [True] * len(steps))
            for rid, tok, g in zip(going, self.target.compute_logits(out).argmax(dim=-1).tolist(), out,
                                   strict=True):
                drafts[rid].append(tok)
                feature[rid] = g
        return drafts

    def _pass(self, ib: InputBatch, spans: list[Span], features: torch.Tensor, sample: list[bool]) -> torch.Tensor:
        """One pass of the head over ``spans`` (its KV written); its output at the last
        position of each span marked in ``sample``."""
        inputs = pack_spans(ib, spans, sample, token_shift=1)
        input_ids, pos, meta = device_inputs(inputs, self.device, self.attention_backend, self.args.num_kv_heads)
        out = self.head(input_ids, features, pos, self.kv_caches[0], meta, self.target.model.embed_tokens)
        idx = torch.from_numpy(np.asarray(inputs.logits_indices)).to(self.device)
        return out[idx]
