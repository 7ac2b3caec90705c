from __future__ import annotations

import pytest

from schedkit.config import config_from_dict


@pytest.fixture
def small_config():
    """A config whose KV cache is small enough to force chunked prefill and preemption."""

    def make(policy: str = "fcfs", **sched):
        return config_from_dict({
            "cache": {"block_size": 4, "num_blocks": 40, "enable_prefix_caching": True},
            "scheduler": {"policy": policy, "max_num_batched_tokens": 48, "max_num_seqs": 8,
                          "max_model_len": 160, "long_prefill_token_threshold": 16, **sched},
            "runner": {"kind": "fake", "vocab_size": 1000},
        })

    return make
