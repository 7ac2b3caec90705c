"""Seeded scheduler workloads for the benchmarks (stdlib only)."""

from __future__ import annotations

import random
import time

from schedkit.config import CacheConfig, SchedulerConfig
from schedkit.core.outputs import ModelRunnerOutput
from schedkit.core.scheduler import Scheduler
from schedkit.plugins.facade import HookFacade
from schedkit.plugins.manager import get_plugin_manager
from schedkit.plugins.testing import make_request, runner_output


def build_scheduler(hooks=None, **cfg) -> Scheduler:
    cache_keys = {"block_size", "num_blocks", "enable_prefix_caching"}
    sched_cfg = SchedulerConfig(**{k: v for k, v in cfg.items() if k not in cache_keys})
    cache_cfg = CacheConfig(**{k: v for k, v in cfg.items() if k in cache_keys})
    if hooks is None:
        hooks = HookFacade(get_plugin_manager(scheduler_config=sched_cfg))
    return Scheduler(sched_cfg, cache_cfg, hooks)


def decode_state(num_reqs: int, *, prompt_len: int = 512, hooks=None) -> tuple[Scheduler, ModelRunnerOutput]:
    """A scheduler with ``num_reqs`` requests all past their prefill, ready to decode.

    Returns it with a ModelRunnerOutput that samples one (non-EOS) token for each.
    """
    rng = random.Random(0)
    sched = build_scheduler(hooks, block_size=16, num_blocks=num_reqs * 300,
                            max_num_batched_tokens=8192, max_num_seqs=num_reqs,
                            max_model_len=4096, enable_prefix_caching=True)
    for i in range(num_reqs):
        prompt = [rng.randrange(3, 50000) for _ in range(prompt_len)]
        sched.add_request(make_request(f"r{i}", prompt, max_tokens=3000, eos_token_id=2))
    ids = [f"r{i}" for i in range(num_reqs)]
    out = None
    while True:
        so = sched.schedule()
        if all(n == 1 for n in so.num_scheduled_tokens.values()) and len(so.num_scheduled_tokens) == num_reqs:
            # Undo nothing: this decode step is real; feed it and start measuring after.
            out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                    sampled_token_ids=[[7] for _ in ids])
            sched.update_from_output(so, out)
            return sched, out
        sched.update_from_output(so, runner_output(so, {r: [7] for r in so.num_scheduled_tokens}))


def mixed_trace(num_requests: int = 2000, seed: int = 1) -> tuple[dict, list[dict]]:
    """Chunked prefill under preemption with shared system prompts and early EOS."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 50000) for _ in range(rng.choice([64, 256, 1024]))] for _ in range(8)]
    reqs = []
    for i in range(num_requests):
        body = [rng.randrange(3, 50000) for _ in range(rng.randint(32, 2000))]
        prompt = (systems[rng.randrange(8)] + body) if rng.random() < 0.6 else body
        max_tokens = rng.randint(8, 512)
        eos_at = rng.randint(0, max_tokens - 1) if rng.random() < 0.3 else None
        reqs.append({"id": f"m{i}", "prompt": prompt, "max_tokens": max_tokens,
                     "arrival_step": i // 8, "eos_at": eos_at})
    cfg = dict(block_size=16, num_blocks=6000, max_num_batched_tokens=2048, max_num_seqs=256,
               max_model_len=8192, enable_prefix_caching=True, long_prefill_token_threshold=512)
    return cfg, reqs


def replay(cfg: dict, reqs: list[dict], hooks=None) -> tuple[int, int, float]:
    """Replay a trace (one sampled token 7 per completed step, EOS 2 at ``eos_at``).

    Returns (steps, preemptions, seconds spent inside schedule() + update_from_output()).
    """
    sched = build_scheduler(hooks, **cfg)
    by_step: dict[int, list[dict]] = {}
    for r in reqs:
        by_step.setdefault(r["arrival_step"], []).append(r)
    eos_at = {r["id"]: r["eos_at"] for r in reqs}
    num_out = dict.fromkeys(eos_at, 0)
    last = max(by_step)
    step = 0
    in_sched = 0.0
    clock = time.perf_counter
    while step <= last or sched.has_requests():
        for r in by_step.get(step, ()):
            sched.add_request(make_request(r["id"], r["prompt"], max_tokens=r["max_tokens"],
                                           arrival_time=float(step), eos_token_id=2))
        t0 = clock()
        so = sched.schedule()
        in_sched += clock() - t0
        sampled = {}
        for rid in so.num_scheduled_tokens:
            req = sched.requests[rid]
            if req.num_computed_tokens >= req.num_tokens:
                sampled[rid] = [2 if num_out[rid] == eos_at[rid] else 7]
                num_out[rid] += 1
        ro = runner_output(so, sampled)
        t0 = clock()
        sched.update_from_output(so, ro)
        in_sched += clock() - t0
        step += 1
    return step, sched.num_preemptions_total, in_sched
