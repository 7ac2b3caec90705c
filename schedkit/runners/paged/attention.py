"""Paged attention: the store-KV step and one varlen attention entry point.

A step's batch is packed: ``T`` query tokens of ``B`` sequences back to back, sequence
``i`` owning rows ``query_start_loc[i]:query_start_loc[i + 1]``. Its ``seq_lens[i]``
counts every token whose KV the step may read, context (earlier chunks and prefix-cache
hits) plus this step's tokens, so query ``j`` of that sequence sits at position
``seq_lens[i] - q_len + j`` and attends causally to keys ``0..`` that position. Prefill
chunks and decodes mix freely in one batch.

The KV cache of a layer is ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and
the same for V; token ``p`` of a sequence lives in slot ``block_table[p // bs] * bs + p % bs``.

:func:`paged_attention` runs the Triton kernel on CUDA and the compiled C++ kernel
(:func:`paged_attention_cpu`, ``csrc/attention.cpp``) on the CPU, which reads each
sequence's blocks in place in the cache's own dtype. :func:`paged_attention_ref`, a plain
PyTorch reference, is every kernel's test oracle and the CPU fallback where no compiler
works.
"""

from __future__ import annotations

import functools
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F

from schedkit.runners.paged.attention_metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "paged_attention", "paged_attention_cpu", "paged_attention_ref",
           "rope_store_attention_cpu", "store_kv"]

_CACHE_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _rows_per_item(num_heads: int) -> int:
    """Query rows of one CPU kernel work item: a prefill tile of ~48 query vectors, which
    share every key block the item loads."""
    return max(1, 48 // num_heads)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write this step's keys and values ([T, kv_heads, head_dim]) into their slots."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of the packed queries ``q`` ([T, heads, head_dim]) over the paged cache,
    by ``meta.backend``.

    Returns:
        [T, heads, head_dim], the dtype of ``q``.
    """
    backend = meta.backend
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        from schedkit.runners.paged.triton_attention import unified_attention

        return unified_attention(q, k_cache, v_cache, meta, scale)
    if backend == "cpu":
        return paged_attention_cpu(q, k_cache, v_cache, meta, scale)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale)


DENSE_PREFILL_MIN_QUERY = 64
"""Query rows from which a bfloat16 prefill chunk is attended by torch's SDPA rather than
by the paged kernel's AVX-512 path, on a CPU with AMX whose kernel runs without its own
AMX tiles (``SCHEDKIT_CPU_AMX=0``, or a kernel built for another ``-march``): there
SDPA's GEMMs still get AMX through oneDNN. About where SDPA's per-call cost is paid
back (docs/model-runner.md)."""


@functools.cache
def _torch_has_amx_bf16() -> bool:
    from schedkit.runners.paged.cpu_linear import onednn_matmul_supported

    return bool(torch.cpu._is_amx_tile_supported()) and onednn_matmul_supported(torch.bfloat16)


def _dense_prefill_supported() -> bool:
    """SDPA for long bfloat16 chunks only where torch has AMX and the kernel does not: on
    AVX512-BF16 without AMX (AMD Zen 4) the kernel is faster (its vdpbf16ps tiles take
    0.20 s, its item path 0.37 s, SDPA 0.72 s of attention per 2,048-token prefill step
    of SmolLM2-135M on 2 cores, docs/results.md)."""
    from schedkit.runners.paged.cpu_kernels import amx_enabled

    return not amx_enabled() and _torch_has_amx_bf16()


def _dense_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                   meta: AttentionMetadata, table: torch.Tensor, seqs: list[int], num_heads: int,
                   scale: float) -> None:
    """Attention of the listed sequences' query rows by SDPA over their keys gathered from
    the cache (bfloat16), causal from each row's position; written into ``out``'s rows."""
    qsl, seq_lens = meta.query_start_loc_np, meta.seq_lens_np
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_blocks = [-(-int(seq_lens[i]) // block_size) for i in seqs]
    ids = torch.cat([table[i, :n] for i, n in zip(seqs, num_blocks, strict=True)]).long()
    k_all, v_all = k_cache[ids], v_cache[ids]  # one gather each for every listed sequence
    qb = q.view(-1, num_heads, head_dim).to(k_cache.dtype)
    o_rows = out.view(-1, num_heads, head_dim)
    first = 0
    for i, n in zip(seqs, num_blocks, strict=True):
        a, b, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
        context = seq_len - (b - a)
        k = k_all[first:first + n].view(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)
        v = v_all[first:first + n].view(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)
        first += n
        mask = None if context == 0 else (
            torch.arange(seq_len)[None, :] <= torch.arange(context, seq_len)[:, None])
        o = F.scaled_dot_product_attention(qb[a:b].transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                           is_causal=mask is None, scale=scale, enable_gqa=True)
        o_rows[a:b].copy_(o[0].transpose(0, 1))


def rope_store_attention_cpu(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             meta: AttentionMetadata, num_heads: int, scale: float,
                             dense_min_query: int | None = None) -> torch.Tensor:
    """One layer's attention on the CPU from its fused projection ``qkv``
    ([T, (heads + 2 * kv_heads) * head_dim], float32 or bfloat16) in one kernel call: RoPE
    on q and k (``cos`` / ``sin``: [positions, head_dim] float32 tables), k and v written
    to their slots in the cache's dtype, then :func:`paged_attention_cpu`'s attention
    (float32 arithmetic).

    With bfloat16 activations and caches on a CPU with native bfloat16 GEMMs, prefill
    chunks of at least ``dense_min_query`` rows (default :data:`DENSE_PREFILL_MIN_QUERY`;
    0 turns this off) are attended by torch's SDPA after the kernel stored their keys.

    Returns:
        [T, heads * head_dim] in ``qkv``'s dtype.
    """
    from schedkit.runners.paged.cpu_kernels import (
        ACTIVATION_DTYPES,
        check_cpu_tensors,
        check_kernel_result,
        cpu_kernels,
    )

    num_tokens = qkv.shape[0]
    num_kv_heads, block_size, head_dim = k_cache.shape[2], k_cache.shape[1], k_cache.shape[3]
    if qkv.stride(1) != 1 or qkv.dtype not in ACTIVATION_DTYPES or qkv.is_cuda:
        raise ValueError("qkv must be float32 or bfloat16 on the CPU with unit stride along its rows")
    check_cpu_tensors(cos, sin)
    _check_caches(k_cache, v_cache)
    if positions.dtype != torch.int64 or positions.is_cuda or not positions.is_contiguous():
        raise ValueError("positions must be contiguous int64 on the CPU")
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=qkv.dtype)
    # float32: the rotated queries live in out until each work item replaces its rows
    q_buf = out if qkv.dtype == torch.float32 else torch.empty(num_tokens, num_heads * head_dim)
    code = ACTIVATION_DTYPES[qkv.dtype]
    qsl, seq_lens, table = _kernel_tables(meta)
    min_rows = DENSE_PREFILL_MIN_QUERY if dense_min_query is None else dense_min_query
    dense: list[int] = []
    if (min_rows > 0 and meta.max_query_len >= min_rows and qkv.dtype == torch.bfloat16
            and k_cache.dtype == torch.bfloat16 and _dense_prefill_supported()):
        dense = np.flatnonzero(np.diff(qsl) >= min_rows).tolist()
    paged = np.setdiff1d(np.arange(len(seq_lens), dtype=np.int32), dense).astype(np.int32) if dense else None
    rc = cpu_kernels().schedkit_rope_store_attention(
        qkv.data_ptr(), code, qkv.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        meta.slot_mapping.data_ptr(), num_tokens, k_cache.data_ptr(), v_cache.data_ptr(),
        q_buf.data_ptr(), out.data_ptr(), code, qsl.ctypes.data, seq_lens.ctypes.data, table.data_ptr(), table.shape[1],
        None if paged is None else paged.ctypes.data, len(seq_lens) if paged is None else len(paged),
        num_heads, num_kv_heads, head_dim, block_size, scale,
        _CACHE_DTYPES[k_cache.dtype], _rows_per_item(num_heads), torch.get_num_threads(),
        k_cache.shape[0], cos.shape[0])
    check_kernel_result("schedkit_rope_store_attention", rc)
    if dense:
        _dense_prefill(q_buf, k_cache, v_cache, out, meta, table, dense, num_heads, scale)
    return out


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if (k_cache.is_cuda or v_cache.is_cuda or not k_cache.is_contiguous() or not v_cache.is_contiguous()
            or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype
            or k_cache.dtype not in _CACHE_DTYPES):
        raise ValueError("the CPU kernel takes two contiguous CPU caches of one shape and dtype "
                         f"(float32, bfloat16 or float16), got {k_cache.dtype} {tuple(k_cache.shape)} "
                         f"on {k_cache.device} and {v_cache.dtype} {tuple(v_cache.shape)} on {v_cache.device}")


def _kernel_tables(meta: AttentionMetadata) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """``query_start_loc`` and ``seq_lens`` as int32 host arrays and the block table as a
    contiguous int32 CPU tensor; made (and checked) once per pass, every layer reuses them."""
    cached = meta.cpu_tables
    if cached is not None:
        return cast(tuple[np.ndarray, np.ndarray, torch.Tensor], cached)
    qsl = np.ascontiguousarray(meta.query_start_loc_np, dtype=np.int32)
    seq_lens = np.ascontiguousarray(meta.seq_lens_np, dtype=np.int32)
    table = meta.block_table
    if table.dtype != torch.int32 or not table.is_contiguous():
        table = table.to(torch.int32).contiguous()
    if meta.slot_mapping.dtype != torch.int64 or not meta.slot_mapping.is_contiguous() \
            or meta.slot_mapping.is_cuda or table.is_cuda:
        raise ValueError("the CPU kernel takes a contiguous int64 slot_mapping and a block table on the CPU")
    meta.cpu_tables = (qsl, seq_lens, table)
    return qsl, seq_lens, table


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, num_threads: int | None = None) -> torch.Tensor:
    """The compiled CPU kernel over the whole mixed batch in one call: every sequence's
    keys read in place from its blocks (no gather, no padding, no float32 copy of a
    bfloat16 cache), softmax in float32.

    Raises:
        RuntimeError: The kernel library could not be built (see
            :func:`schedkit.runners.paged.cpu_kernels.build_error`).
    """
    from schedkit.runners.paged.cpu_kernels import (
        build_error,
        check_kernel_result,
        load_cpu_kernels,
    )

    lib = load_cpu_kernels()
    if lib is None:
        raise RuntimeError(f"the CPU attention kernel is unavailable: {build_error()}")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if q.is_cuda:
        raise ValueError("paged_attention_cpu takes CPU tensors")
    _check_caches(k_cache, v_cache)
    qf = q.to(torch.float32).contiguous()
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    qsl, seq_lens, table = _kernel_tables(meta)
    rc = lib.schedkit_paged_attention(
        qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        qsl.ctypes.data, seq_lens.ctypes.data, table.data_ptr(), table.shape[1],
        None, len(seq_lens), num_heads, num_kv_heads, head_dim, block_size, scale,
        _CACHE_DTYPES[k_cache.dtype], _rows_per_item(num_heads),
        num_threads if num_threads is not None else torch.get_num_threads(), k_cache.shape[0])
    check_kernel_result("schedkit_paged_attention", rc)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q [..., kv_heads, R, D] (R query rows per KV head), k/v [..., kv_heads, L, D], mask
    (True = attend) broadcast to [..., kv_heads, R, L]; softmax in float32."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float())


def _gather_kv(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[..., nb] block ids -> [..., kv_heads, nb * bs, head_dim]."""
    x = cache[blocks]  # [..., nb, bs, kvh, D]
    return x.flatten(-4, -3).transpose(-3, -2)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The PyTorch reference: one batched pass over all one-token queries (decodes),
    then one pass per longer query chunk."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    qsl, seq_lens = meta.query_start_loc_np, meta.seq_lens_np
    q_lens = np.diff(qsl)
    decodes = np.flatnonzero(q_lens == 1)
    if len(decodes):
        rows = torch.from_numpy(qsl[decodes].astype(np.int64)).to(q.device)
        lens = seq_lens[decodes]
        num_blocks = -(-int(lens.max()) // block_size)
        sel = torch.from_numpy(decodes).to(q.device)
        blocks = meta.block_table[sel, :num_blocks].long()
        k, v = _gather_kv(k_cache, blocks), _gather_kv(v_cache, blocks)  # [n, kvh, L, D]
        qd = q[rows].view(-1, num_kv_heads, group, head_dim)
        key_pos = torch.arange(num_blocks * block_size, device=q.device)
        mask = key_pos < torch.from_numpy(lens.astype(np.int64)).to(q.device)[:, None]
        o = _attend(qd, k, v, mask[:, None, None, :], scale)  # [n, kvh, G, D]
        out[rows] = o.reshape(-1, num_heads, head_dim).to(q.dtype)
    for i in np.flatnonzero(q_lens > 1):
        start, end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
        q_len = end - start
        num_blocks = -(-seq_len // block_size)
        blocks = meta.block_table[i, :num_blocks].long()
        k, v = _gather_kv(k_cache, blocks), _gather_kv(v_cache, blocks)  # [kvh, L, D]
        # rows of one KV head ordered (group member, token)
        qp = q[start:end].view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        key_pos = torch.arange(num_blocks * block_size, device=q.device)
        mask = (key_pos[None, :] <= q_pos[:, None]).repeat(group, 1)
        o = _attend(qp.reshape(num_kv_heads, group * q_len, head_dim), k, v, mask, scale)
        o = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
        out[start:end] = o.reshape(q_len, num_heads, head_dim).to(q.dtype)
    return out
