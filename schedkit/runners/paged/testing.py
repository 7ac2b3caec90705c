"""Helpers for testing the paged runner against transformers (CPU and GPU test suites).

``run_engine`` drives requests through the real scheduler and this runner;
``hf_greedy`` and ``hf_next_tokens`` compute the oracle with transformers on the same
weights (imported lazily: only tests need transformers).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from schedkit.config import Config, config_from_dict
from schedkit.core.request import Request, SamplingParams


def paged_config(model: str | Path, *, vocab_size: int = 512, device: str = "cpu",
                 dtype: str = "float32", block_size: int = 16, num_blocks: int = 256,
                 enable_prefix_caching: bool = False, max_num_batched_tokens: int = 64,
                 max_num_seqs: int = 8, max_model_len: int = 512,
                 long_prefill_token_threshold: int = 0, scheduler: dict[str, Any] | None = None,
                 **runner: Any) -> Config:
    """A validated Config for the paged runner on ``model`` (``scheduler``: extra
    scheduler keys; other keywords go to the runner section)."""
    return config_from_dict({
        "model": {"name": str(model), "dtype": dtype},
        "runner": {"kind": "paged", "device": device, "vocab_size": vocab_size, **runner},
        "cache": {"block_size": block_size, "num_blocks": num_blocks,
                  "enable_prefix_caching": enable_prefix_caching},
        "scheduler": {"max_num_batched_tokens": max_num_batched_tokens,
                      "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
                      "long_prefill_token_threshold": long_prefill_token_threshold,
                      **(scheduler or {})},
    })


def greedy_request(request_id: str, prompt: Sequence[int], max_tokens: int,
                   **params: Any) -> Request:
    """A request that never stops early (no EOS): greedy unless ``params`` say otherwise."""
    sp = SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, **params})
    return Request(request_id, list(prompt), sp, arrival_time=time.monotonic())


def random_prompts(lengths: Sequence[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def run_engine(engine: Any, requests: Sequence[Request], max_steps: int = 10_000) -> dict[str, list[int]]:
    """Add ``requests`` to an EngineCore and step until all finish; output ids per request."""
    for req in requests:
        engine.add_request(req)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for _ in range(max_steps):
        if not engine.has_requests():
            return outputs
        for eco in engine.step().values():
            for out in eco.outputs:
                outputs[out.request_id].extend(out.new_token_ids)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device).eval()


@torch.inference_mode()
def hf_greedy(hf_model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy ``generate`` for each prompt alone (no padding effects)."""
    dev = next(hf_model.parameters()).device
    outs = []
    for p in prompts:
        ids = torch.tensor([list(p)], device=dev)
        gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                eos_token_id=None, pad_token_id=0)
        outs.append(gen[0, len(p):].tolist())
    return outs


@torch.inference_mode()
def hf_next_tokens(hf_model: Any, sequences: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """Teacher-forced argmax after every position of each sequence, and its margin over
    the runner-up in units of that position's logit standard deviation."""
    dev = next(hf_model.parameters()).device
    tokens, margins = [], []
    for s in sequences:
        logits = hf_model(torch.tensor([list(s)], device=dev)).logits[0].float()
        top2 = logits.topk(2, dim=-1).values
        tokens.append(logits.argmax(-1).tolist())
        margins.append(((top2[:, 0] - top2[:, 1]) / logits.std(-1)).tolist())
    return tokens, margins


REPO_ROOT = Path(__file__).resolve().parents[3]
BYTE_LM = REPO_ROOT / "tests" / "fixtures" / "byte-lm"
"""A small trained byte-level Qwen2 model (scripts/train_byte_lm.py): confident
predictions, unlike random weights, for bf16 agreement checks."""


def held_out_text_sequences(count: int, length: int) -> list[list[int]]:
    """``count`` byte sequences of ``length`` from ``held-out.txt`` beside the byte
    model (excerpts of this repository's docs, text the model did not train on, frozen
    so that editing the docs cannot move the test's inputs), at evenly spaced offsets."""
    data = (BYTE_LM / "held-out.txt").read_bytes()
    assert len(data) >= count * length, "not enough held-out text in held-out.txt"
    stride = len(data) // count
    return [list(data[i * stride: i * stride + length]) for i in range(count)]


def top1_agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]],
                   margins: Sequence[Sequence[float]] | None = None, min_margin: float = 0.0) -> float:
    """Fraction of positions where ``a`` and ``b`` agree (only positions whose margin
    exceeds ``min_margin`` when margins are given)."""
    num = agree = 0
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for j, (s, t) in enumerate(zip(x, y, strict=True)):
            if margins is None or margins[i][j] > min_margin:
                num += 1
                agree += s == t
    return agree / max(num, 1)


def make_attention_case(specs: Sequence[tuple[int, int]], *, block_size: int = 16,
                        num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32,
                        dtype: torch.dtype = torch.float32, device: str = "cpu",
                        num_splits: int = 1, seed: int = 0) -> tuple[Any, ...]:
    """A random paged-attention problem: ``specs`` is ``(context_len, query_len)`` per
    sequence; blocks are scattered randomly through a cache with spare blocks.

    Returns:
        ``(q, k_cache, v_cache, meta)`` with ``meta`` an AttentionMetadata.
    """
    import numpy as np

    from schedkit.runners.paged.attention_metadata import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-(c + n) // block_size) for c, n in specs]
    num_blocks = sum(per_seq) + 3
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    block_table = torch.zeros(len(specs), max(per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        block_table[i, :n] = torch.tensor(perm[used:used + n], dtype=torch.int32)
        used += n
    q_lens = [n for _, n in specs]
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq_lens = np.array([c + n for c, n in specs], dtype=np.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(q), dtype=torch.int64, device=device),
        query_start_loc=torch.from_numpy(qsl).to(device), seq_lens=torch.from_numpy(seq_lens).to(device),
        block_table=block_table.to(device), max_query_len=max(q_lens),
        max_seq_len=int(seq_lens.max()), query_start_loc_np=qsl, seq_lens_np=seq_lens,
        num_splits=num_splits)
    return q.to(device), k_cache.to(device), v_cache.to(device), meta


def dense_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any,
                    scale: float) -> torch.Tensor:
    """An independent oracle: per sequence, gather K/V token by token and run SDPA with an
    explicit causal mask (float64)."""
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    bs = k_cache.shape[1]
    qsl, seq_lens = meta.query_start_loc_np, meta.seq_lens_np
    for i in range(len(seq_lens)):
        start, end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
        table = meta.block_table[i].tolist()
        k = torch.stack([k_cache[table[p // bs], p % bs] for p in range(seq_len)])
        v = torch.stack([v_cache[table[p // bs], p % bs] for p in range(seq_len)])
        rep = num_heads // num_kv_heads
        k = k.double().repeat_interleave(rep, dim=1).transpose(0, 1)
        v = v.double().repeat_interleave(rep, dim=1).transpose(0, 1)
        qi = q[start:end].double().transpose(0, 1)
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out


@torch.inference_mode()
def paged_next_tokens(runner: Any, sequences: Sequence[Sequence[int]], chunk: int = 64) -> list[list[int]]:
    """Teacher-forced argmax after every position, computed by an initialized runner's
    model over its paged cache: all sequences prefill together in chunks of ``chunk``
    tokens, so later chunks attend to cached context."""
    from schedkit.runners.paged.input_batch import InputBatch

    bs = runner.kv_caches[0][0].shape[1]
    ib = InputBatch(max(len(s) for s in sequences) + 1, bs, len(sequences))
    next_block = 1
    for i, seq in enumerate(sequences):
        n = -(-len(seq) // bs)
        ib.add(str(i), list(seq), len(seq), list(range(next_block, next_block + n)), 0, SamplingParams())
        next_block += n
    assert next_block <= runner.kv_caches[0][0].shape[0], "KV cache too small for the sequences"
    argmax: list[list[int]] = [[] for _ in sequences]
    while True:
        todo = {str(i): min(chunk, len(s) - ib.states[str(i)].num_computed_tokens)
                for i, s in enumerate(sequences) if ib.states[str(i)].num_computed_tokens < len(s)}
        if not todo:
            return argmax
        inputs = ib.prepare(todo, {})
        ids = runner.model.compute_logits(runner._forward(inputs)).argmax(-1).tolist()
        for j, rid in enumerate(inputs.req_ids):
            a, b = int(inputs.query_start_loc[j]), int(inputs.query_start_loc[j + 1])
            argmax[int(rid)].extend(ids[a:b])
            ib.states[rid].num_computed_tokens += b - a


def compile_kernels_for_cuda(arch: int = 90) -> dict[str, int]:
    """Compile the attention kernels ahead of time for ``sm_<arch>`` (no GPU needed:
    Triton lowers to PTX and runs its bundled ptxas). Must run where TRITON_INTERPRET is
    unset. Returns the shared memory of each variant, in bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from schedkit.runners.paged import triton_attention as ta

    target = GPUTarget("cuda", arch, 32)

    def build(kernel: Any, types: dict[str, str], const: dict[str, Any]) -> int:
        names = kernel.arg_names
        sig = {n: "constexpr" if n in const else types.get(n, "i64" if n.startswith("stride") else "i32")
               for n in names}
        src = ASTSource(fn=kernel, signature=sig,
                        constexprs={(names.index(n),): v for n, v in const.items()})
        return int(triton.compile(src, target=target, options={"num_warps": 4}).metadata.shared)

    shared = {}
    for dt, prec in (("bf16", "tf32"), ("fp16", "tf32"), ("fp32", "ieee")):
        types = {n: f"*{dt}" for n in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
        types |= {n: "*i32" for n in ("block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr")}
        types |= {n: "*fp32" for n in ("segm_out_ptr", "segm_max_ptr", "segm_sum_ptr")}
        types["qk_scale"] = "fp32"
        for segments, tile in ((1, 32), (ta.NUM_SPLITS, 16)):
            const = dict(NUM_HEADS=14, NUM_Q_PER_KV=7, HEAD_DIM=64, HEAD_DIM_P=64, BLOCK_SIZE=16,
                         TILE=tile, BLOCK_Q=2, BLOCK_M=16, NUM_SEGMENTS=segments,
                         DOT_PRECISION=prec, INTERPRET=False)
            shared[f"attention-{dt}-splits{segments}"] = build(ta._unified_attention_kernel, types, const)
        shared[f"merge-{dt}"] = build(
            ta._merge_segments_kernel,
            {"out_ptr": f"*{dt}", "segm_out_ptr": "*fp32", "segm_max_ptr": "*fp32",
             "segm_sum_ptr": "*fp32"},
            dict(NUM_HEADS=14, HEAD_DIM=64, HEAD_DIM_P=64, NUM_SEGMENTS=ta.NUM_SPLITS))
    return shared

