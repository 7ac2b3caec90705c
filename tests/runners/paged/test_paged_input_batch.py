"""Packed inputs of one step: positions, slot mapping, offsets, lengths, block table."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from schedkit.core.request import SamplingParams  # noqa: E402
from schedkit.runners.paged.input_batch import InputBatch  # noqa: E402


def test_mixed_step_inputs() -> None:
    ib = InputBatch(max_model_len=64, block_size=4, num_rows=1)
    sp = SamplingParams()
    ib.add("chunk", list(range(100, 110)), 10, [7, 3, 9], 4, sp)  # prefix hit of 4, chunk of 3
    ib.add("dec", [1, 2, 3, 4, 5], 4, [5, 6], 4, sp)  # one output, decoding
    ib.add("last", [9, 8, 7, 6, 5, 4], 6, [2, 8], 2, sp)  # final chunk of its prompt
    inp = ib.prepare({"chunk": 3, "dec": 1, "last": 4}, {})
    assert inp.positions.tolist() == [4, 5, 6, 4, 2, 3, 4, 5]
    assert inp.input_ids.tolist() == [104, 105, 106, 5, 7, 6, 5, 4]
    assert inp.slot_mapping.tolist() == [12, 13, 14, 24, 10, 11, 32, 33]
    assert inp.query_start_loc.tolist() == [0, 3, 4, 8]
    assert inp.seq_lens.tolist() == [7, 5, 6]
    assert inp.block_table.tolist() == [[7, 3], [5, 6], [2, 8]]
    assert inp.logits_indices.tolist() == [3, 7]  # the chunk samples nothing
    assert inp.sample_slices == [(0, 0), (0, 1), (1, 2)]
    assert inp.sample_positions == [5, 6]


def test_drafts_are_appended_and_verified_rows_sampled() -> None:
    ib = InputBatch(max_model_len=64, block_size=4)
    ib.add("r", [1, 2, 3], 3, [1], 2, SamplingParams())
    inp = ib.prepare({"r": 3}, {"r": [11, -1]})
    assert inp.input_ids.tolist() == [3, 11, 0]  # placeholder drafts become token 0
    assert inp.logits_indices.tolist() == [0, 1, 2]
    assert inp.sample_positions == [3, 4, 5]


def test_rows_are_reused_and_grow() -> None:
    ib = InputBatch(max_model_len=16, block_size=4, num_rows=2)
    for i in range(5):
        ib.add(str(i), [i], 1, [i + 1], 0, SamplingParams())
    assert sorted(st.row for st in ib.states.values()) == [0, 1, 2, 3, 4]
    row = ib.states["1"].row
    ib.remove("1")
    ib.add("new", [3], 1, [9], 0, SamplingParams())
    assert ib.states["new"].row == row
    ib.append_blocks("new", [4, 2])
    assert ib.block_table[row, :3].tolist() == [9, 4, 2]
