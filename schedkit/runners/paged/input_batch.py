"""Per-request state kept across steps, and the packed inputs of one step.

Each live request owns a row of two persistent host arrays: its token ids (prompt,
outputs, and this step's drafts) and its block table. A step's inputs are then a few
vectorised gathers over those rows instead of per-token Python work.

A token sampled by a step whose output has not reached the host yet (async scheduling)
is *pending*: its row holds a placeholder, and the request's state remembers where it
lies in that step's sampled tensor, so the next step takes it from the device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from schedkit.core.request import SamplingParams


@dataclass(slots=True)
class RequestState:
    """What the runner remembers about one request between steps."""

    req_id: str
    row: int
    num_prompt_tokens: int
    num_tokens: int
    """Known tokens (prompt then outputs) in ``InputBatch.token_ids[row]``."""
    num_blocks: int
    num_computed_tokens: int
    sampling_params: SamplingParams
    pending_src: int = -1
    """Index, in the sampled tensor of the step in flight, of the token at
    ``pending_pos`` (-1: every token is on the host)."""
    pending_pos: int = -1
    num_draft_computed: int = 0
    """Leading positions whose KV an EAGLE head has written: those the request started
    with computed, then what the head caught up on."""


@dataclass(slots=True)
class StepInputs:
    """Host arrays of one step, in ``num_scheduled_tokens`` order."""

    req_ids: list[str]
    input_ids: np.ndarray
    """[T] int64."""
    positions: np.ndarray
    """[T] int64."""
    slot_mapping: np.ndarray
    """[T] int64."""
    query_start_loc: np.ndarray
    """[B + 1] int32."""
    seq_lens: np.ndarray
    """[B] int32."""
    block_table: np.ndarray
    """[B, max blocks used this step] int32."""
    logits_indices: np.ndarray
    """[N] int64: packed rows whose next token is sampled (or verified)."""
    sample_slices: list[tuple[int, int]] = field(default_factory=list)
    """Per request, its [start, end) range in ``logits_indices`` (empty for a chunk)."""
    sample_positions: list[int] = field(default_factory=list)
    """Per sampled row, the position of the token it samples."""
    sample_params: list[SamplingParams] = field(default_factory=list)
    """Per sampled row, its request's sampling parameters."""
    fill_rows: list[int] = field(default_factory=list)
    """Input rows whose token is pending: it comes from the previous step's sampled
    tensor, at ``fill_src``."""
    fill_src: list[int] = field(default_factory=list)
    placeholders: list[tuple[RequestState, int, int]] = field(default_factory=list)
    """(state, position, sampled row) of each token this step samples alone (no drafts):
    pending until :meth:`InputBatch.resolve` writes it."""

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def max_query_len(self) -> int:
        return int(np.diff(self.query_start_loc).max())

    @property
    def is_decode_only(self) -> bool:
        return len(self.input_ids) == len(self.seq_lens)


class InputBatch:
    """Args:
        max_model_len: Longest sequence; sizes the rows.
        block_size: Tokens per KV block.
        num_rows: Initial number of rows (grows on demand).
    """

    def __init__(self, max_model_len: int, block_size: int, num_rows: int = 64) -> None:
        self.block_size = block_size
        self.max_len = max_model_len + 32  # room for drafts past the last position
        self.max_blocks = -(-self.max_len // block_size)
        self.token_ids = np.zeros((num_rows, self.max_len), dtype=np.int64)
        self.block_table = np.zeros((num_rows, self.max_blocks), dtype=np.int32)
        self.states: dict[str, RequestState] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))

    # -- state ---------------------------------------------------------------------------
    def add(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
            block_ids: Sequence[int], num_computed_tokens: int, params: SamplingParams) -> None:
        """Start tracking a request (new, or resumed with its whole token list and table)."""
        self.remove(req_id)
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self.token_ids[row, :len(token_ids)] = token_ids
        self.block_table[row, :len(block_ids)] = block_ids
        self.states[req_id] = RequestState(req_id, row, num_prompt_tokens, len(token_ids),
                                           len(block_ids), num_computed_tokens, params,
                                           num_draft_computed=num_computed_tokens)

    def remove(self, req_id: str) -> RequestState | None:
        st = self.states.pop(req_id, None)
        if st is not None:
            self._free_rows.append(st.row)
            st.row = -1  # a tombstone: pending tokens of a step in flight are not written
        return st

    def resolve(self, placeholders: list[tuple[RequestState, int, int]], tokens: list[int]) -> None:
        """Write the sampled tokens of a step's placeholders (rows still alive)."""
        token_ids = self.token_ids
        for st, pos, src in placeholders:
            if st.row >= 0:
                token_ids[st.row, pos] = tokens[src]
                if st.pending_pos == pos:
                    st.pending_src = -1

    def append_blocks(self, req_id: str, block_ids: Sequence[int]) -> None:
        st = self.states[req_id]
        self.block_table[st.row, st.num_blocks:st.num_blocks + len(block_ids)] = block_ids
        st.num_blocks += len(block_ids)

    def append_tokens(self, req_id: str, token_ids: Sequence[int]) -> None:
        st = self.states[req_id]
        self.token_ids[st.row, st.num_tokens:st.num_tokens + len(token_ids)] = token_ids
        st.num_tokens += len(token_ids)

    def _grow(self) -> None:
        n = len(self.token_ids)
        self.token_ids = np.concatenate([self.token_ids, np.zeros_like(self.token_ids)])
        self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
        self._free_rows.extend(range(2 * n - 1, n - 1, -1))

    # -- one step ------------------------------------------------------------------------
    def prepare(self, num_scheduled: Mapping[str, int],
                drafts: Mapping[str, Sequence[int]]) -> StepInputs:
        """Packed inputs for tokens ``[computed, computed + n)`` of each scheduled request.

        A request samples when its chunk reaches the end of its known tokens; with ``k``
        drafts it samples ``k + 1`` rows (one per draft to verify, plus the bonus). A
        request sampling one token gets it as a pending placeholder at once (see
        :meth:`resolve`); with drafts the caller appends what was accepted.
        """
        states = self.states
        req_ids = list(num_scheduled)
        num_reqs = len(req_ids)
        count_list = list(num_scheduled.values())
        row_list: list[int] = []
        start_list: list[int] = []
        logits_idx: list[int] = []
        slices: list[tuple[int, int]] = []
        sample_pos: list[int] = []
        sample_params: list[SamplingParams] = []
        fill_rows: list[int] = []
        fill_src: list[int] = []
        placeholders: list[tuple[RequestState, int, int]] = []
        end_row = 0
        for rid, count in zip(req_ids, count_list, strict=True):
            st = states[rid]
            start = st.num_computed_tokens
            row_list.append(st.row)
            start_list.append(start)
            end_row += count
            if st.pending_src >= 0 and start <= st.pending_pos < start + count:
                fill_rows.append(end_row - count + st.pending_pos - start)
                fill_src.append(st.pending_src)
            first = len(logits_idx)
            k = len(drafts[rid]) if drafts and rid in drafts else 0
            if not k:
                if start + count >= st.num_tokens:  # samples one token: pending at once
                    pos = st.num_tokens
                    logits_idx.append(end_row - 1)
                    sample_pos.append(pos)
                    sample_params.append(st.sampling_params)
                    st.pending_src, st.pending_pos = first, pos
                    placeholders.append((st, pos, first))
                    st.num_tokens = pos + 1
                    slices.append((first, first + 1))
                else:
                    slices.append((first, first))  # a prompt chunk: nothing sampled
                continue
            d = np.asarray(drafts[rid], dtype=np.int64)
            self.token_ids[st.row, st.num_tokens:st.num_tokens + k] = np.maximum(d, 0)
            if start + count - k >= st.num_tokens:
                logits_idx.extend(range(end_row - k - 1, end_row))
                sample_pos.extend(range(st.num_tokens, st.num_tokens + k + 1))
                sample_params.extend([st.sampling_params] * (k + 1))
            slices.append((first, len(logits_idx)))
        rows = np.array(row_list, dtype=np.int64)
        starts = np.array(start_list, dtype=np.int64)
        counts = np.array(count_list, dtype=np.int64)
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        total = int(cu[-1])
        req_of_token = np.repeat(np.arange(num_reqs), counts)
        positions = starts[req_of_token] + (np.arange(total) - cu[:-1][req_of_token])
        token_rows = rows[req_of_token]
        bs = self.block_size
        blocks = self.block_table[token_rows, positions // bs].astype(np.int64)
        seq_lens = (starts + counts).astype(np.int32)
        width = -(-int(seq_lens.max()) // bs)
        return StepInputs(
            req_ids=req_ids, input_ids=self.token_ids[token_rows, positions], positions=positions,
            slot_mapping=blocks * bs + positions % bs, query_start_loc=cu.astype(np.int32),
            seq_lens=seq_lens, block_table=self.block_table[rows, :width],
            logits_indices=np.asarray(logits_idx, dtype=np.int64), sample_slices=slices,
            sample_positions=sample_pos, sample_params=sample_params, fill_rows=fill_rows,
            fill_src=fill_src, placeholders=placeholders)
