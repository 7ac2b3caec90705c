"""The asyncio client reads its output socket from the event loop (``add_reader`` on
ZeroMQ's descriptor, which signals edges): every message must reach its stream once,
also when the descriptor's signal is missed, and a client dropped without ``close()``
must leave no descriptor on the loop."""

from __future__ import annotations

import asyncio
import gc
import random

import pytest

from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.engine.client import AsyncEngineClient, AsyncLLM
from schedkit.engine.process import EngineProcess

BIG = {"cache": {"block_size": 16, "num_blocks": 2048}, "runner": {"kind": "fake", "vocab_size": 1000},
       "scheduler": {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "max_model_len": 2048}}


def test_hundreds_of_streams_each_get_every_token_once():
    rng = random.Random(0)
    wants = [rng.randrange(1, 40) for _ in range(300)]

    async def one(llm, i, n):
        tokens, finishes = [], []
        async for d in llm.generate([1 + i % 900, 2, 3], SamplingParams(max_tokens=n, ignore_eos=True)):
            tokens += d.output_token_ids
            if d.finish_reason is not None:
                finishes.append(d.finish_reason)
        return len(tokens), finishes

    async def main():
        async with await AsyncLLM.create(config_from_dict(BIG)) as llm:
            got = await asyncio.gather(*(one(llm, i, n) for i, n in enumerate(wants)))
            assert [g[0] for g in got] == wants
            assert all(g[1] == ["length"] for g in got)
            assert await llm.call_utility("num_unfinished") == 0

    asyncio.run(asyncio.wait_for(main(), 120))


def test_outputs_still_arrive_when_the_descriptor_never_signals():
    async def main():
        async with await AsyncLLM.create(config_from_dict(BIG)) as llm:
            core = llm.core
            assert isinstance(core, AsyncEngineClient)
            # Take the socket off the loop: only the watch timer reads it now.
            assert asyncio.get_running_loop().remove_reader(core._fd)
            deltas = [d async for d in llm.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))]
            assert sum(len(d.output_token_ids) for d in deltas) == 4
            assert deltas[-1].finish_reason == "length"
            assert llm.is_alive()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_client_dropped_without_close_takes_its_descriptor_off_the_loop():
    engine = EngineProcess(config_from_dict(BIG))
    try:
        async def main():
            client = AsyncEngineClient(engine, owns_engine=False)
            await client.connect()
            fd = client._fd
            del client
            gc.collect()
            # remove_reader answers whether a reader was registered: the finalizer took it
            assert not asyncio.get_running_loop().remove_reader(fd)

        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()


def test_an_asyncllm_follows_to_a_new_loop_once_its_own_has_ended():
    llm = asyncio.run(AsyncLLM.create(config_from_dict(BIG)))  # that loop is closed now

    async def use():
        deltas = [d async for d in llm.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))]
        assert sum(len(d.output_token_ids) for d in deltas) == 3
        assert await llm.call_utility("num_unfinished") == 0

    try:
        asyncio.run(asyncio.wait_for(use(), 30))
        asyncio.run(asyncio.wait_for(use(), 30))  # and to the next one
    finally:
        asyncio.run(llm.close())


def test_an_asyncllm_whose_loop_runs_in_another_thread_refuses_this_one():
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    llm = asyncio.run_coroutine_threadsafe(AsyncLLM.create(config_from_dict(BIG)), loop).result(60)
    try:
        async def elsewhere():
            with pytest.raises(RuntimeError, match="create one AsyncLLM per event loop"):
                async for _ in llm.generate([1, 2], SamplingParams(max_tokens=2)):
                    pass
            with pytest.raises(RuntimeError, match="create one AsyncLLM per event loop"):
                await llm.call_utility("num_unfinished")

        asyncio.run(asyncio.wait_for(elsewhere(), 30))

        async def at_home():  # its own loop still serves
            return [d async for d in llm.generate([1, 2], SamplingParams(max_tokens=2, ignore_eos=True))]

        deltas = asyncio.run_coroutine_threadsafe(at_home(), loop).result(30)
        assert deltas[-1].finish_reason == "length"
    finally:
        asyncio.run_coroutine_threadsafe(llm.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
