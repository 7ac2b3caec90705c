"""Paged-attention kernel speed on CUDA (Qwen2.5-0.5B attention shape, bf16).

- decode: batch 256 x 1024 tokens of context; achieved bandwidth = bytes of K and V read
  (plus q and out) / kernel time, against the device's copy bandwidth measured here;
- prefill: causal prefill without context, against dense SDPA on the same shapes.

Times are CUDA-event medians over repeated launches after a warm-up.

  python scripts/bench_paged_kernels.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from schedkit.runners.paged.testing import make_attention_case
from schedkit.runners.paged.triton_attention import choose_num_splits, unified_attention


def cuda_time_ms(fn, iters: int = 50) -> float:  # type: ignore[no-untyped-def]
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = cuda_time_ms(lambda: y.copy_(x), iters=20)
    return 2 * x.numel() / ms / 1e6


def decode(batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int, block_size: int) -> dict:
    q, k, v, meta = make_attention_case([(ctx - 1, 1)] * batch, block_size=block_size,
                                        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                        dtype=torch.bfloat16, device="cuda")
    meta.num_splits = choose_num_splits(batch, kv_heads, 1)
    out = torch.empty_like(q)
    ms = cuda_time_ms(lambda: unified_attention(q, k, v, meta, head_dim ** -0.5, out=out))
    kv_bytes = 2 * batch * ctx * kv_heads * head_dim * 2
    moved = kv_bytes + 2 * q.numel() * 2
    return dict(batch=batch, context=ctx, splits=meta.num_splits, kernel_us=ms * 1e3,
                achieved_gbs=moved / ms / 1e6)


def prefill(num_seqs: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, block_size: int) -> dict:
    q, k, v, meta = make_attention_case([(0, seq_len)] * num_seqs, block_size=block_size,
                                        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                        dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    paged_ms = cuda_time_ms(lambda: unified_attention(q, k, v, meta, head_dim ** -0.5, out=out))
    qd = q.view(num_seqs, seq_len, heads, head_dim).transpose(1, 2).contiguous()
    kd = torch.randn(num_seqs, kv_heads, seq_len, head_dim, dtype=torch.bfloat16, device="cuda")
    vd = torch.randn_like(kd)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_ms = cuda_time_ms(lambda: sdpa(qd, kd, vd, is_causal=True, enable_gqa=True))
    return dict(num_seqs=num_seqs, seq_len=seq_len, paged_ms=paged_ms, sdpa_ms=sdpa_ms,
                speed_vs_sdpa=sdpa_ms / paged_ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    shape = dict(heads=14, kv_heads=2, head_dim=64, block_size=16)
    copy_gbs = copy_bandwidth_gbs()
    result = dict(device=torch.cuda.get_device_name(), copy_gbs=copy_gbs,
                  decode=[decode(b, c, **shape) for b, c in ((256, 1024), (32, 1024), (8, 4096))],
                  prefill=[prefill(n, s, **shape) for n, s in ((8, 1024), (2, 4096), (32, 256))])
    for d in result["decode"]:
        d["fraction_of_copy_bw"] = d["achieved_gbs"] / copy_gbs
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
