from __future__ import annotations

import contextlib
from collections.abc import Iterator

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


LONG = {"cache": {"num_blocks": 512}, "scheduler": {"max_model_len": 100000}}
"""Room for long-running requests (the fake runner)."""


@pytest.fixture(scope="module")
def llm():
    """One engine process shared by a module's tests (each leaves it idle)."""
    from schedkit.llm import LLM

    with LLM(config_from_dict(LONG)) as engine_llm:
        yield engine_llm


def assert_engine_idle(llm) -> None:
    """The engine holds no request: nothing running, waiting or tracked as live."""
    stats = llm.call_utility("stats")
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    assert llm.call_utility("num_unfinished") == 0


@contextlib.contextmanager
def raw_client(llm) -> Iterator:
    """A second, synchronous client of ``llm``'s engine, for messages an LLM never sends."""
    from schedkit.engine.client import EngineClient

    engine = llm.engine
    client = EngineClient(engine.input_addr, engine.output_addr, engine=engine)
    try:
        yield client
    finally:
        client.close()
