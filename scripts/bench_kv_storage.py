"""What the kv-storage connector saves when an engine starts cold on prompts another
engine already served: prompt tokens computed, TTFT and wall time, with the store warm,
with it empty (the engine that fills it) and without the connector.

Method: one model (``--model``, default the tiny built-in Llama, float32 on CPU), one
seeded workload of ``--n`` requests with prompts of ``--prompt`` tokens, ``--out`` output
tokens each, all added at once; each row is a fresh in-process engine with prefix
caching on, so only the store can carry KV across engines. TTFT is the wall time from
adding the requests to the step that produced each request's first token.

  python scripts/bench_kv_storage.py --n 32 --prompt 512,1024 --out 16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from typing import Any

from schedkit.config import PluginConfig
from schedkit.core.request import Request, SamplingParams
from schedkit.engine.core import EngineCore
from schedkit.hookspecs import hookimpl
from schedkit.runners.paged.testing import paged_config


class PromptTokens:
    """Counts the prompt tokens the engine computes (scheduled tokens that sample nothing,
    plus each prompt's last token)."""

    def __init__(self) -> None:
        self.scheduled = 0

    @hookimpl
    def schedkit_on_step_end(self, scheduler_output: Any) -> None:
        self.scheduled += scheduler_output.total_num_scheduled_tokens


def run(a: argparse.Namespace, store: str | None, prompts: list[list[int]]) -> dict[str, Any]:
    config = paged_config(a.model, block_size=16, num_blocks=4096, enable_prefix_caching=True,
                          max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=4096,
                          num_threads=a.threads)
    if store is not None:
        config = config.model_copy(update={"plugins": [PluginConfig(
            name="kv-storage", settings={"path": store, "chunk_blocks": a.chunk_blocks})]})
    counter = PromptTokens()
    engine = EngineCore(config, extra_plugins=[counter])
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(Request(str(i), p, SamplingParams(max_tokens=a.out, temperature=0.0,
                                                               ignore_eos=True), time.monotonic()))
    first: dict[str, float] = {}
    while engine.has_requests():
        for group in engine.step().values():
            for o in group.outputs:
                if o.new_token_ids and o.request_id not in first:
                    first[o.request_id] = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    if engine.runner.kv_connector is not None:
        engine.runner.kv_connector.flush()
    return dict(prompt_tokens_computed=counter.scheduled - len(prompts) * (a.out - 1),
                ttft_p50_s=statistics.median(first.values()), wall_s=wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--prompt", default="512,1024")
    ap.add_argument("--out", type=int, default=16)
    ap.add_argument("--chunk-blocks", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    lo, hi = map(int, a.prompt.split(","))
    r = random.Random(0)
    prompts = [[r.randrange(10, 500) for _ in range(r.randint(lo, hi))] for _ in range(a.n)]
    rows = {"no connector": run(a, None, prompts)}
    with tempfile.TemporaryDirectory() as store:
        rows["empty store (fills it)"] = run(a, store, prompts)
        rows["warm store"] = run(a, store, prompts)
    for name, row in rows.items():
        print(json.dumps({"engine": name, **{k: round(v, 4) if isinstance(v, float) else v
                                             for k, v in row.items()}}))


if __name__ == "__main__":
    main()
