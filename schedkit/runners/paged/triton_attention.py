"""The unified varlen paged-attention kernel (Triton), for mixed prefill + decode batches.

One program owns ``BLOCK_Q`` query tokens of one sequence times the ``NUM_Q_PER_KV``
query heads that share one KV head (``BLOCK_M`` rows), so GQA reads each K/V tile
once per group. It walks the sequence's KV in tiles of ``TILE`` keys through the block
table with an online softmax, masking causally inside the query chunk. Programs find
their sequence by binary search over ``query_start_loc`` (no host-side schedule).

Split-context mode (``num_splits > 1``, for decode batches too small to fill the GPU)
gives each program a contiguous segment of the context; a second kernel merges the
segments' partial results with their log-sum-exp weights.

Under ``TRITON_INTERPRET=1`` (CPU tests) the kernels take two detours that the
interpreter needs: dots run in float32 (bf16 dots are wrong there) and KV loops are
``while`` loops (a ``for`` bound loaded from memory crashes it).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from schedkit.runners.paged.attention_metadata import AttentionMetadata

_LOG2E = 1.4426950408889634
NUM_SPLITS = 16
"""Segments of the split-context mode."""


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _find_seq(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q: tl.constexpr):
    """Last sequence whose first query block is at or before ``q_block_global``."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_global:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _attend_tile(acc, m_i, l_i, q, q_pos, tile, seq_len, k_cache_ptr, v_cache_ptr, bt_row_ptr,
                 kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                 offs_d, dim_mask, qk_scale, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    offs_n = tile * TILE + tl.arange(0, TILE)
    key_mask = offs_n < seq_len
    block = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
    in_block = (offs_n % BLOCK_SIZE).to(tl.int64)
    k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh
    v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
    k = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None],
                mask=key_mask[None, :] & dim_mask[:, None], other=0.0)  # [D, TILE]
    v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :],
                mask=key_mask[:, None] & dim_mask[None, :], other=0.0)  # [TILE, D]
    if INTERPRET:
        s = tl.dot(q.to(tl.float32), k.to(tl.float32))
    else:
        s = tl.dot(q, k, input_precision=DOT_PRECISION)
    s = s * qk_scale
    keep = (offs_n[None, :] <= q_pos[:, None]) & key_mask[None, :]
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if INTERPRET:
        pv = tl.dot(p, v.to(tl.float32))
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _unified_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr,
        query_start_loc_ptr, segm_out_ptr, segm_max_ptr, segm_sum_ptr, qk_scale, num_seqs,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_bt,
        NUM_HEADS: tl.constexpr, NUM_Q_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
        DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = _find_seq(query_start_loc_ptr, q_block_global, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    offs_m = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + offs_m // NUM_Q_PER_KV
    head = kv_head * NUM_Q_PER_KV + offs_m % NUM_Q_PER_KV
    row_mask = (tok < q_len) & (offs_m // NUM_Q_PER_KV < BLOCK_Q)
    offs_d = tl.arange(0, HEAD_DIM_P)
    dim_mask = offs_d < HEAD_DIM
    row = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    q_pos = context_len + tok
    kv_end = tl.minimum(context_len + (q_block + 1) * BLOCK_Q, seq_len)
    num_tiles = tl.cdiv(kv_end, TILE)
    if NUM_SEGMENTS > 1:
        tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
        first = segment * tiles_per_segment
        last = tl.minimum(first + tiles_per_segment, num_tiles)
    else:
        first = 0
        last = num_tiles
    bt_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    if INTERPRET:
        tile = first
        while tile < last:
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_pos, tile, seq_len, k_cache_ptr, v_cache_ptr, bt_row_ptr,
                kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                offs_d, dim_mask, qk_scale, BLOCK_SIZE, TILE, DOT_PRECISION, INTERPRET)
            tile += 1
    else:
        for tile in range(first, last):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q_pos, tile, seq_len, k_cache_ptr, v_cache_ptr, bt_row_ptr,
                kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                offs_d, dim_mask, qk_scale, BLOCK_SIZE, TILE, DOT_PRECISION, INTERPRET)
    if NUM_SEGMENTS > 1:
        seg_row = (row * NUM_HEADS + head) * NUM_SEGMENTS + segment
        tl.store(segm_out_ptr + seg_row[:, None] * HEAD_DIM_P + offs_d[None, :], acc,
                 mask=row_mask[:, None])
        tl.store(segm_max_ptr + seg_row, m_i, mask=row_mask)
        tl.store(segm_sum_ptr + seg_row, l_i, mask=row_mask)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


@triton.jit
def _merge_segments_kernel(out_ptr, segm_out_ptr, segm_max_ptr, segm_sum_ptr, stride_ot, stride_oh,
                           NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           HEAD_DIM_P: tl.constexpr, NUM_SEGMENTS: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (token * NUM_HEADS + head) * NUM_SEGMENTS
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_DIM_P)
    seg_max = tl.load(segm_max_ptr + base + offs_s)
    m = tl.max(seg_max, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(seg_max - m)
    total = tl.sum(tl.load(segm_sum_ptr + base + offs_s) * w, 0)
    parts = tl.load(segm_out_ptr + (base + offs_s)[:, None] * HEAD_DIM_P + offs_d[None, :])
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@functools.cache
def num_sms(device_index: int = 0) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H100/H200 SXM)."""
    if not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_query_len: int,
                      num_sms: int = 132) -> int:
    """Split the context only for decode-only batches with too few programs for the GPU."""
    if max_query_len == 1 and num_seqs * num_kv_heads < num_sms:
        return NUM_SPLITS
    return 1


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton counterpart of :func:`schedkit.runners.paged.attention.paged_attention_ref`."""
    num_tokens, num_heads, head_dim = q.shape
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_q_per_kv = num_heads // num_kv_heads
    block_m = 16 if num_q_per_kv <= 16 else triton.next_power_of_2(num_q_per_kv)
    block_q = block_m // num_q_per_kv
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    num_seqs = meta.seq_lens.shape[0]
    num_segments = meta.num_splits
    if out is None:
        out = torch.empty_like(q)
    if num_segments > 1:
        segm_out = torch.empty((num_tokens, num_heads, num_segments, head_dim_p),
                               dtype=torch.float32, device=q.device)
        segm_max = torch.empty((num_tokens, num_heads, num_segments), dtype=torch.float32,
                               device=q.device)
        segm_sum = torch.empty_like(segm_max)
    else:
        segm_out = segm_max = segm_sum = out  # unused
    interpret = interpreting()
    tile = 16 if meta.max_query_len == 1 or interpret else 32
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    _unified_attention_kernel[grid](
        out, q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.query_start_loc,
        segm_out, segm_max, segm_sum, scale * _LOG2E, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_table.stride(0),
        NUM_HEADS=num_heads, NUM_Q_PER_KV=num_q_per_kv, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        BLOCK_SIZE=block_size, TILE=tile, BLOCK_Q=block_q, BLOCK_M=block_m,
        NUM_SEGMENTS=num_segments, INTERPRET=interpret,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    if num_segments > 1:
        _merge_segments_kernel[(num_tokens, num_heads)](
            out, segm_out, segm_max, segm_sum, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
            NUM_SEGMENTS=num_segments)
    return out
