"""What every layer's attention reads about one packed batch (see ``attention.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Packed-batch description shared by every layer of one forward pass.

    The tensors live on the model's device; the ``*_np`` arrays are host copies the
    CPU reference uses to avoid reading device memory.
    """

    slot_mapping: torch.Tensor
    """[T] int64: cache slot written by each query token."""
    query_start_loc: torch.Tensor
    """[B + 1] int32: row offsets of each sequence's queries."""
    seq_lens: torch.Tensor
    """[B] int32: context plus this step's tokens, per sequence."""
    block_table: torch.Tensor
    """[B, max_blocks] int32: block ids per sequence (unused entries 0)."""
    max_query_len: int
    max_seq_len: int
    query_start_loc_np: np.ndarray
    seq_lens_np: np.ndarray
    num_splits: int = 1
    """Split-context segments of the Triton kernel (1: off)."""
    backend: str = "auto"
    """``"triton"``, ``"cpu"`` (the compiled CPU kernel), ``"torch"`` (the reference) or
    ``"auto"`` (Triton on CUDA, else torch)."""
    cpu_tables: Any = field(default=None, repr=False, compare=False)
    """The CPU kernel's view of the tables, made by its first layer and shared by the
    rest of the pass (``attention._kernel_tables``)."""

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_np)

