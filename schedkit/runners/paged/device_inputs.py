"""A packed step's host arrays on the model's device, with its attention metadata."""

from __future__ import annotations

from typing import Any

import torch

from schedkit.runners.paged.attention_metadata import AttentionMetadata
from schedkit.runners.paged.input_batch import StepInputs


def device_inputs(inputs: StepInputs, device: torch.device, backend: str,
                  num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Input ids, positions and attention metadata of a packed step on ``device``."""

    def put(a: Any) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=put(inputs.slot_mapping), query_start_loc=put(inputs.query_start_loc),
        seq_lens=put(inputs.seq_lens), block_table=put(inputs.block_table),
        max_query_len=inputs.max_query_len, max_seq_len=int(inputs.seq_lens.max()),
        query_start_loc_np=inputs.query_start_loc, seq_lens_np=inputs.seq_lens, backend=backend)
    if device.type == "cuda":
        from schedkit.runners.paged.triton_attention import choose_num_splits, num_sms

        meta.num_splits = choose_num_splits(meta.num_seqs, num_kv_heads, meta.max_query_len,
                                            num_sms(device.index or 0))
    return put(inputs.input_ids), put(inputs.positions), meta
