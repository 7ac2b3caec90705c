"""The process boundary: request throughput and per-step overhead, fake runner.

    pytest benchmarks/test_engine_boundary.py --benchmark-only

Method:
- throughput: one client sends 20,000 one-token requests (prompt of 4 tokens, in batches
  of 1,000) to an engine process and waits for every finish; extra_info holds requests/s.
- per-step overhead: 256 requests decode 400 tokens each (prompt 512, block 16). The
  in-process variant adds them to EngineCore and steps it; the process variant runs the
  same requests through LLM.generate (prefix cache reset before each round). Both
  report the median wall time per engine step, adds included (extra_info
  ``ms_per_step``). A third variant streams every token delta of every request to a
  synchronous client of the same engine (AsyncLLM-style) instead of final outputs only.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time

import pytest

from schedkit.config import config_from_dict
from schedkit.core.request import Request, SamplingParams
from schedkit.engine.client import EngineClient, EngineProcess, wire_request
from schedkit.engine.core import EngineCore
from schedkit.llm import LLM


def decode_config():
    return config_from_dict({
        "cache": {"block_size": 16, "num_blocks": 256 * 64, "enable_prefix_caching": True},
        "scheduler": {"max_num_batched_tokens": 8192, "max_num_seqs": 256, "max_model_len": 4096},
        "runner": {"kind": "fake"},
    })


def decode_prompts(n=256, prompt_len=512):
    rng = random.Random(0)
    return [[rng.randrange(3, 30000) for _ in range(prompt_len)] for _ in range(n)]


DECODE_TOKENS = 400


def test_throughput_add_finish(benchmark):
    config = config_from_dict({"cache": {"num_blocks": 8192, "block_size": 16},
                               "scheduler": {"max_num_batched_tokens": 8192, "max_num_seqs": 1024}})
    engine = EngineProcess(config)
    client = EngineClient(engine.input_addr, engine.output_addr, engine=engine)
    params = SamplingParams(max_tokens=1)
    n = 20_000
    rounds = iter(range(100))

    def run():
        r = next(rounds)
        for start in range(0, n, 1000):
            client.add_requests([wire_request(f"{r}-{i}", [3, 4, i % 50 + 5, 6], params)
                                 for i in range(start, start + 1000)])
        done = 0
        while done < n:
            batch = client.recv(timeout=10)
            assert batch is not None
            done += sum(o.finish_reason is not None for o in batch.outputs)

    try:
        benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    finally:
        client.close()
        engine.shutdown()
    benchmark.extra_info["requests_per_s"] = n / benchmark.stats["median"]


@pytest.mark.parametrize("where", ["in_process", "engine_process", "engine_process_streaming"])
def test_decode_step_overhead(benchmark, where):
    config = decode_config()
    prompts = decode_prompts()
    params = SamplingParams(max_tokens=DECODE_TOKENS)
    seconds: list[float] = []
    steps: list[int] = []
    if where == "in_process":
        def run():
            engine = EngineCore(config)
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                engine.add_request(Request(f"r{i}", p, params, arrival_time=engine.now()))
            while engine.has_requests():
                engine.step()
            seconds.append(time.perf_counter() - t0)
            steps.append(engine.num_steps)
        benchmark.pedantic(run, rounds=5, iterations=1)
    else:
        llm = LLM(config)
        engine = llm.engine
        client = EngineClient(engine.input_addr, engine.output_addr, engine=engine)
        rounds = itertools.count()

        def run():
            assert llm.call_utility("reset_prefix_cache")  # every round starts cold
            before = llm.call_utility("stats")["num_steps"]
            t0 = time.perf_counter()
            if where == "engine_process":  # offline batch: final outputs only
                llm.generate(prompts, params, use_tqdm=False)
            else:  # every token delta of every request streamed to the client
                r = next(rounds)
                client.add_requests([wire_request(f"s{r}-{i}", p, params) for i, p in enumerate(prompts)])
                done = 0
                while done < len(prompts):
                    batch = client.recv(timeout=10)
                    assert batch is not None
                    done += sum(o.finish_reason is not None for o in batch.outputs)
            seconds.append(time.perf_counter() - t0)
            steps.append(llm.call_utility("stats")["num_steps"] - before)

        try:
            benchmark.pedantic(run, rounds=5, iterations=1)
        finally:
            client.close()
            llm.close()
    # The figure to compare: median over rounds of (time from first add to last finish)
    # per engine step; utility round trips between rounds are left out.
    benchmark.extra_info.update(where=where, steps=steps[-1],
                                ms_per_step=statistics.median(seconds) * 1e3 / steps[-1])
