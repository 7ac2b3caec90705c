"""Simulator workloads shared by the policy tests and ``scripts/bench_policies.py``:
the figures in docs/results.md ("Policies") and the assertions that pin them come from
the same configurations."""

from __future__ import annotations

import statistics
from typing import Any

from schedkit.config import Config, config_from_dict


def heavy_tailed(policy: str, seed: int, settings: dict[str, Any] | None = None,
                 rate: float = 60.0) -> Config:
    """Ample KV (no preemption for blocks), 16 seats, log-normal outputs (median 48,
    up to 1,500 tokens): the seats, not memory, are what short jobs wait for."""
    return config_from_dict({
        "runner": {"kind": "simulated"},
        "cache": {"num_blocks": 20000, "block_size": 16, "enable_prefix_caching": True},
        "scheduler": {"policy": policy, "max_num_batched_tokens": 2048, "max_num_seqs": 16},
        "plugins": [{"name": policy, "settings": settings}] if settings else [],
        "workload": {"rate": rate, "num_requests": 300, "prompt_len": [32, 256], "seed": seed,
                     "output_len": {"dist": "lognormal", "median": 48, "sigma": 1.4, "min": 4,
                                    "max": 1500}},
    })


def kv_pressure(seed: int, plugins: list[dict[str, Any]]) -> Config:
    """400 blocks of 16 tokens for 64 seats: preemptions for KV space, prefix caching on."""
    return config_from_dict({
        "runner": {"kind": "simulated"},
        "cache": {"num_blocks": 400, "block_size": 16, "enable_prefix_caching": True},
        "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 64},
        "plugins": plugins,
        "workload": {"rate": 40, "num_requests": 300, "prompt_len": [32, 512], "seed": seed,
                     "output_len": {"dist": "lognormal", "median": 64, "sigma": 1.0, "min": 4,
                                    "max": 800}}})


def short_mean_e2e(metrics: list[Any]) -> float:
    """Mean E2E of the jobs asking for at most the median output length."""
    cut = statistics.median(m.max_tokens for m in metrics)
    return statistics.mean(m.e2e for m in metrics if m.max_tokens <= cut)
