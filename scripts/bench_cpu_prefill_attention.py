"""Prefill attention in the CPU kernel, float32 tiles on and off (SmolLM2-135M's shape:
9 heads, 3 KV heads, head_dim 64, 16-token blocks).

Each shape is a batch of fresh prompts (no context), queries and caches built once by
``schedkit.runners.paged.testing.make_attention_case``. Method: one warm-up call per
setting, then REPEATS rounds that time one call with the tiles on and one with them off,
alternating, so that drift in the machine's speed hits both alike; the figure is the
median per call. GFLOP/s counts the causal products (QK and PV, 4 x heads x head_dim
flops per query-key pair a row sees).

    python scripts/bench_cpu_prefill_attention.py [--threads 2] [--repeats 15] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from schedkit.runners.paged import cpu_kernels
from schedkit.runners.paged.attention import paged_attention_cpu
from schedkit.runners.paged.testing import make_attention_case

SHAPES = [(16, 128), (1, 128), (4, 512), (1, 2048)]  # (prompts, tokens each)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a = ap.parse_args()
    if cpu_kernels.load_cpu_kernels() is None:
        raise SystemExit(f"no CPU kernel: {cpu_kernels.build_error()}")
    dtype = getattr(torch, a.dtype)
    heads, kv_heads, head_dim = 9, 3, 64
    cpu_kernels.set_amx(False)  # the float32 tiles run where no bfloat16 tile engine does
    cpu_kernels.set_bf16_tiles(False)
    try:
        for num_seqs, seq_len in SHAPES:
            q, k, v, meta = make_attention_case([(0, seq_len)] * num_seqs, block_size=16, num_heads=heads,
                                                num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, seed=1)
            flops = num_seqs * 4 * heads * head_dim * seq_len * (seq_len + 1) // 2
            times: dict[bool, list[float]] = {True: [], False: []}
            for tiles in (True, False):
                cpu_kernels.set_float_tiles(tiles)
                paged_attention_cpu(q, k, v, meta, head_dim ** -0.5, num_threads=a.threads)
            for _ in range(a.repeats):
                for tiles in (True, False):
                    cpu_kernels.set_float_tiles(tiles)
                    t = time.perf_counter()
                    paged_attention_cpu(q, k, v, meta, head_dim ** -0.5, num_threads=a.threads)
                    times[tiles].append(time.perf_counter() - t)
            on, off = statistics.median(times[True]), statistics.median(times[False])
            print(json.dumps(dict(prompts=num_seqs, tokens=seq_len, dtype=a.dtype, threads=a.threads,
                                  tiles_ms=round(on * 1e3, 2), items_ms=round(off * 1e3, 2),
                                  tiles_gflops=round(flops / on / 1e9, 1), items_gflops=round(flops / off / 1e9, 1),
                                  speedup=round(off / on, 2))))
    finally:
        cpu_kernels.set_float_tiles(True)
        cpu_kernels.set_amx(True)
        cpu_kernels.set_bf16_tiles(True)


if __name__ == "__main__":
    main()
