"""CUDA graphs of decode-only forward passes, one per bucketed batch size.

Decode steps launch hundreds of small kernels; replaying a captured graph removes their
launch overhead. Each bucket's graph reads static input buffers; a batch of ``b``
requests replays the smallest bucket ``>= b`` with the extra rows padded: token 0 at
position 0, written to slot 0 of the reserved null block 0 and attending only to it,
so padding never touches a real request's KV. Sampling stays outside the graph.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np
import torch

from schedkit.runners.paged.attention_metadata import AttentionMetadata
from schedkit.runners.paged.input_batch import StepInputs
from schedkit.runners.paged.models import CausalLM


def batch_size_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_batch_size`` (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    sizes += list(range(16, max_batch_size, 16))
    return sorted(set(sizes) | {max_batch_size})


class DecodeGraphs:
    """Args:
        model: The model (already on CUDA).
        kv_caches: Its per-layer (K, V) caches.
        max_batch_size: Largest decode batch captured.
        max_blocks_per_seq: Width of the static block table.
        num_kv_heads: For the split-context decision of each bucket.
    """

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_batch_size: int, max_blocks_per_seq: int, num_kv_heads: int,
                 block_size: int) -> None:
        from schedkit.runners.paged.triton_attention import choose_num_splits, num_sms

        self.model, self.kv_caches = model, kv_caches
        self.buckets = batch_size_buckets(max_batch_size)
        self.block_size = block_size
        n, dev = self.buckets[-1], next(model.parameters()).device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=dev)
        sms = num_sms(dev.index or 0) if dev.type == "cuda" else 132
        self._splits = {b: choose_num_splits(b, num_kv_heads, 1, sms) for b in self.buckets}
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        """bucket -> (captured torch.cuda.CUDAGraph, its static output)."""
        pin = dev.type == "cuda"
        # Two sets of pinned staging buffers, used in turn: with two steps in flight the
        # copy out of one set may still be queued while the next step fills the other.
        self._staging_sets = [
            (torch.zeros((4, n), dtype=torch.int64, pin_memory=pin),
             torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, pin_memory=pin))
            for _ in range(2)]
        self._turn = 0

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[:b + 1],
            seq_lens=self.seq_lens[:b], block_table=self.block_table[:b], max_query_len=1,
            max_seq_len=self.block_table.shape[1] * self.block_size,
            query_start_loc_np=np.arange(b + 1, dtype=np.int32),
            seq_lens_np=np.ones(b, dtype=np.int32), num_splits=self._splits[b], backend="triton")

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory pool)."""
        pool = None
        for b in reversed(self.buckets):
            args = (self.input_ids[:b], self.positions[:b], self.kv_caches, self._meta(b))
            self.model(*args)  # warm-up: compiles the kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(*args)
            pool = graph.pool()
            self.graphs[b] = (graph, hidden)
        torch.cuda.synchronize()

    def can_run(self, inputs: StepInputs) -> bool:
        return (bool(self.graphs) and inputs.is_decode_only
                and len(inputs.req_ids) <= self.buckets[-1]
                and inputs.block_table.shape[1] <= self.block_table.shape[1])

    def run(self, inputs: StepInputs, fill: Any = None) -> torch.Tensor:
        """Hidden states [b, hidden] of a decode-only batch of ``b`` requests.

        ``fill``: (rows, source rows, source) overwriting input ids on the device (the
        tokens a step still in flight samples).
        """
        b = len(inputs.req_ids)
        bucket = self.buckets[bisect.bisect_left(self.buckets, b)]
        staging, staging_bt = self._staging_sets[self._turn]
        self._turn ^= 1
        st = staging.numpy()
        st[:, b:bucket] = 0
        st[0, :b], st[1, :b], st[2, :b] = inputs.input_ids, inputs.positions, inputs.slot_mapping
        st[3, :b], st[3, b:bucket] = inputs.seq_lens, 1
        bt = staging_bt.numpy()
        width = inputs.block_table.shape[1]
        bt[:bucket] = 0
        bt[:b, :width] = inputs.block_table
        staged = staging[:, :bucket].to(self.input_ids.device, non_blocking=True)
        self.input_ids[:bucket].copy_(staged[0])
        self.positions[:bucket].copy_(staged[1])
        self.slot_mapping[:bucket].copy_(staged[2])
        self.seq_lens[:bucket].copy_(staged[3])
        self.block_table[:bucket].copy_(staging_bt[:bucket], non_blocking=True)
        if fill is not None:
            dst, src, tokens = fill
            self.input_ids[dst] = tokens[src]
        graph, hidden = self.graphs[bucket]
        graph.replay()
        return hidden[:b]
