"""AsyncLLM.create returns only once the engine knows the client's output socket (its
``Ready`` arrived): outputs sent to a client the output ROUTER does not know yet are
dropped, which hung the first stream now and then on a loaded machine."""

from __future__ import annotations

import asyncio

from schedkit.core.request import SamplingParams
from schedkit.llm import AsyncLLM


def test_async_create_waits_for_the_engines_ready(small_config):
    async def main():
        async with await AsyncLLM.create(small_config()) as llm:
            assert llm.client_index == 0 and llm._ready.is_set()
            deltas = [d async for d in llm.generate([1, 2, 3], SamplingParams(max_tokens=3))]
            assert deltas[-1].finish_reason == "length"

    asyncio.run(asyncio.wait_for(main(), 30))
