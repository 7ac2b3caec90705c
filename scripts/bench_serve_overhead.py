"""What the HTTP server costs: the same engine driven through ``schedkit serve`` and
directly through ``AsyncLLM``, streamed, on the fake runner.

Method: N streaming requests (token-id prompts of PROMPT tokens, max_tokens OUT, EOS
ignored) at a fixed concurrency C (each of C workers sends its next request when the
previous one ends). ``--step-ms 0`` runs the fake runner on its virtual clock (steps
take no time: the ceiling of the front end); ``--step-ms 10`` on the wall clock (each step
sleeps 10 ms, like a small model), where the difference in latency is the server's.
The HTTP client is aiohttp (one session, C connections; the load generator vLLM's
benchmarks use; ``pip install aiohttp``) in this process; the server runs in its own
process, its engine in a third. AsyncLLM runs in this process with its
engine in a second. Each side starts fresh, does a warm-up of C requests, then the
measured N. Prints one JSON line per side and the ratio.

    python scripts/bench_serve_overhead.py --n 2000 --concurrency 64 --out 32 --step-ms 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.llm import AsyncLLM


def config(step_ms: float) -> dict:
    runner = {"kind": "fake", "vocab_size": 32000}
    runner |= {"clock": "wall", "step_time_ms": step_ms} if step_ms > 0 else {"step_time_ms": 1}
    return {"model": {"name": "fake"}, "runner": runner,
            "cache": {"block_size": 16, "num_blocks": 8192, "enable_prefix_caching": False},
            "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "max_model_len": 2048},
            "server": {"port": 0, "max_pending_requests": 4096}}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else float("nan")


def summary(name: str, wall: float, ttfts: list[float], itls: list[float], tokens: int, n: int) -> dict:
    return {"side": name, "requests": n, "wall_s": round(wall, 3), "req_per_s": round(n / wall, 1),
            "out_tok_per_s": round(tokens / wall, 1), "ttft_p50_ms": round(pct(ttfts, 0.5) * 1e3, 2),
            "ttft_p99_ms": round(pct(ttfts, 0.99) * 1e3, 2),
            "itl_p50_ms": round(pct(itls, 0.5) * 1e3, 3), "itl_mean_ms": round(statistics.fmean(itls) * 1e3, 3)}


async def drive(one, n: int, conc: int) -> tuple[float, list[float], list[float], int]:
    ttfts: list[float] = []
    itls: list[float] = []
    tokens = 0
    queue = list(range(n))

    async def worker() -> None:
        nonlocal tokens
        while queue:
            i = queue.pop()
            t0 = time.perf_counter()
            last = None
            async for k in one(i):
                now = time.perf_counter()
                if last is None:
                    ttfts.append(now - t0)
                else:
                    itls.append((now - last) / max(k, 1))
                last = now
                tokens += k

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return time.perf_counter() - t0, ttfts, itls, tokens


async def bench_asyncllm(args) -> dict:
    llm = await AsyncLLM.create(config_from_dict(config(args.step_ms)))
    params = SamplingParams(max_tokens=args.out, ignore_eos=True)

    async def one(i):
        async for o in llm.generate([10 + (i + j) % 1000 for j in range(args.prompt)], params):
            if o.output_token_ids:
                yield len(o.output_token_ids)

    try:
        await drive(one, args.concurrency, args.concurrency)
        wall, ttfts, itls, tokens = await drive(one, args.n, args.concurrency)
    finally:
        await llm.close()
    return summary("AsyncLLM", wall, ttfts, itls, tokens, args.n)


async def bench_http(args, url: str) -> dict:
    import aiohttp

    conn = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(url, connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as http:
        async def one(i):
            body = {"prompt": [10 + (i + j) % 1000 for j in range(args.prompt)], "max_tokens": args.out,
                    "ignore_eos": True, "stream": True, "return_token_ids": True}
            async with http.post("/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.content:  # one SSE line at a time
                    if line.startswith(b"data: {"):
                        k = len(json.loads(line[6:])["choices"][0]["token_ids"])
                        if k:
                            yield k

        await drive(one, args.concurrency, args.concurrency)
        wall, ttfts, itls, tokens = await drive(one, args.n, args.concurrency)
    return summary("HTTP", wall, ttfts, itls, tokens, args.n)


def start_server(step_ms: float, tmp: Path) -> tuple[subprocess.Popen, str]:
    path = tmp / "serve.yaml"
    path.write_text(yaml.safe_dump(config(step_ms)))
    proc = subprocess.Popen([sys.executable, "-m", "schedkit.cli", "serve", str(path)],
                            stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            return proc, m.group(1)
    raise SystemExit("the server did not start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--out", type=int, default=32)
    p.add_argument("--step-ms", type=float, default=0.0)
    args = p.parse_args()
    direct = asyncio.run(bench_asyncllm(args))
    print(json.dumps(direct), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(args.step_ms, Path(tmp))
        try:
            http = asyncio.run(bench_http(args, url))
        finally:
            proc.terminate()
            proc.wait(30)
    print(json.dumps(http), flush=True)
    print(json.dumps({"ratio_req_per_s": round(http["req_per_s"] / direct["req_per_s"], 3),
                      "step_ms": args.step_ms, "concurrency": args.concurrency, "out": args.out}))


if __name__ == "__main__":
    main()
