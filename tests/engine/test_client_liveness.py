"""Liveness comes from the engine's heartbeats, also those that arrived while the client
was idle."""

from __future__ import annotations

import asyncio
import time

import schedkit.engine.client as client_mod
from schedkit.core.request import SamplingParams
from schedkit.llm import LLM, AsyncLLM

from .conftest import raw_client


def test_idle_client_still_sees_a_live_engine(small_config, monkeypatch):
    monkeypatch.setattr(client_mod, "DEAD_AFTER_S", 1.0)  # heartbeats come every 0.5 s
    with LLM(small_config()) as llm, raw_client(llm) as client:
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
        time.sleep(1.5)  # both clients idle for longer than DEAD_AFTER_S
        client.check_alive()
        again = llm.generate([[4, 5]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert again[0].finish_reason == "length"
        time.sleep(1.5)
        assert llm.call_utility("num_unfinished") == 0


def test_blocked_event_loop_does_not_make_a_live_engine_dead(small_config, monkeypatch):
    monkeypatch.setattr(client_mod, "DEAD_AFTER_S", 1.0)

    async def main():
        async with await AsyncLLM.create(small_config()) as llm:
            assert [d async for d in llm.generate([1, 2], SamplingParams(max_tokens=2))][-1].finished
            time.sleep(1.5)  # blocks the loop: the reader's poll times out with beats queued
            deltas = [d async for d in llm.generate([3, 4], SamplingParams(max_tokens=2))]
            assert deltas[-1].finish_reason == "length"

    asyncio.run(main())
