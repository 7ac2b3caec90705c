"""KV hand-off between real replicas: blocks per second and the TTFT it adds.

Method: one colocated replica, then one prefill + one decode replica (every request
split, ``selective-pd`` threshold 0), local engine processes on the paged CPU runner,
one thread each. The same requests go one at a time (no queueing), each a fresh random
prompt of ``--prompt-len`` tokens and ``--max-tokens`` outputs; the first ``--warmup``
are not counted. Reported: the TTFT (client side, arrival to first token) median of
each deployment and their difference; the hand-off's own rate from the front end's
counters (blocks and bytes sent over the seconds from each prefill's end to the decode
replica holding its KV); and the share of the split TTFT that the hand-off takes.

    python scripts/bench_kv_transfer.py --model tiny-llama
    python scripts/bench_kv_transfer.py --model smollm2-135m-instruct --prompt-len 128,512 --vocab 49152

With several prompt lengths it also fits a profile's ``kv_transfer`` terms (the seconds
of a hand-off against the blocks it sends: ``latency_s`` and ``per_block_s``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
from typing import Any

from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.llm import AsyncLLM


def config(model: str, split: bool, num_blocks: int) -> Any:
    cfg: dict[str, Any] = {"model": {"name": model}, "runner": {"kind": "paged", "num_threads": 1},
                           "cache": {"num_blocks": num_blocks}, "scheduler": {"max_num_seqs": 8}}
    if split:
        cfg["replicas"] = {"count": 2, "roles": {"prefill": 1, "decode": 1}}
        cfg["router"] = {"plugins": [{"name": "selective-pd", "settings": {"threshold": 0}}]}
    return config_from_dict(cfg)


async def run(model: str, split: bool, prompts: list[list[int]], max_tokens: int, warmup: int,
              num_blocks: int) -> dict[str, Any]:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    ttfts: list[float] = []
    async with await AsyncLLM.create(config(model, split, num_blocks)) as llm:
        before: dict[str, Any] = {}
        for i, prompt in enumerate(prompts):
            if i == warmup and split:  # the hand-offs counted from here
                before = (await llm.call_utility("stats"))["kv_transfer"]
            t0 = time.perf_counter()
            first = None
            async for o in llm.generate(prompt, sp, request_id=f"r{i}"):
                if first is None and o.output_token_ids:
                    first = time.perf_counter() - t0
            if i >= warmup:
                assert first is not None
                ttfts.append(first)
        stats = await llm.call_utility("stats") if split else {}
    out: dict[str, Any] = {"ttft_p50_s": statistics.median(ttfts), "ttft_mean_s": statistics.fmean(ttfts)}
    if split:
        kv = {k: v - before.get(k, 0) for k, v in stats["kv_transfer"].items() if k != "fallbacks"}
        kv["fallbacks"] = stats["kv_transfer"]["fallbacks"]
        out |= {"handoffs": kv["num_handoffs"], "blocks": kv["num_blocks"], "bytes": kv["num_bytes"],
                "handoff_s": kv["seconds"], "fallbacks": kv["fallbacks"],
                "blocks_per_s": kv["num_blocks"] / kv["seconds"], "mb_per_s": kv["num_bytes"] / kv["seconds"] / 1e6,
                "bytes_per_block": kv["num_bytes"] / max(kv["num_blocks"], 1),
                "handoff_mean_s": kv["seconds"] / kv["num_handoffs"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--prompt-len", default="512", help="prompt tokens; several, comma-separated, "
                    "also fit the profile's kv_transfer terms")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    ap.add_argument("-o", "--output", help="write the result as JSON here")
    args = ap.parse_args()
    rng = random.Random(0)
    results = []
    for n in (int(x) for x in args.prompt_len.split(",")):
        prompts = [[rng.randrange(1, args.vocab) for _ in range(n)] for _ in range(args.requests)]
        colocated = asyncio.run(run(args.model, False, prompts, args.max_tokens, args.warmup, args.num_blocks))
        split = asyncio.run(run(args.model, True, prompts, args.max_tokens, args.warmup, args.num_blocks))
        added = split["ttft_p50_s"] - colocated["ttft_p50_s"]
        result = {"prompt_len": n, "colocated": colocated, "disaggregated": split, "added_ttft_p50_s": added,
                  "handoff_share_of_split_ttft": split["handoff_mean_s"] / split["ttft_mean_s"]}
        results.append(result)
        print(f"{args.model}, {n}-token prompts, {args.requests - args.warmup} requests one at a time")
        print(f"  TTFT p50: colocated {colocated['ttft_p50_s'] * 1e3:.1f} ms, disaggregated "
              f"{split['ttft_p50_s'] * 1e3:.1f} ms (+{added * 1e3:.1f} ms)")
        print(f"  hand-off: {split['blocks_per_s']:.0f} blocks/s, {split['mb_per_s']:.0f} MB/s, "
              f"{split['bytes_per_block'] / 1024:.0f} KiB per block, {split['handoff_mean_s'] * 1e3:.1f} ms "
              f"per request ({result['handoff_share_of_split_ttft']:.0%} of the split TTFT); "
              f"fallbacks {split['fallbacks'] or 'none'}")
    out: dict[str, Any] = {"model": args.model, "requests": args.requests - args.warmup,
                           "machine": platform.processor() or platform.machine(), "results": results}
    if len(results) >= 2:  # seconds per hand-off = latency + blocks x per block, least squares
        xs = [r["disaggregated"]["blocks"] / r["disaggregated"]["handoffs"] for r in results]
        ys = [r["disaggregated"]["handoff_mean_s"] for r in results]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        out["kv_transfer"] = {"latency_s": max(my - slope * mx, 0.0), "per_block_s": slope}
        print(f"profile terms: kv_transfer: {json.dumps(out['kv_transfer'])}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
