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
from schedkit.engine.client import AsyncEngineClient
from schedkit.engine.process import EngineProcess
from schedkit.llm import AsyncLLM

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


def test_a_flood_is_dispatched_a_budget_at_a_time_and_the_rest_next_turn(monkeypatch):
    import time

    import schedkit.engine.client as client_mod

    monkeypatch.setattr(client_mod, "READ_BUDGET", 8)  # outputs; each message here carries one or more
    virtual = {**BIG, "runner": {"kind": "fake", "vocab_size": 1000, "clock": "virtual"}}

    async def main():
        async with await AsyncLLM.create(config_from_dict(virtual)) as llm:
            core = llm.core
            dispatched: list[int] = []
            real = core._dispatch
            def weighed(msg):
                dispatched.append(real(msg))
                return dispatched[-1]

            monkeypatch.setattr(core, "_dispatch", weighed)

            async def one(i):
                return [d async for d in llm.generate([i + 1, 2], SamplingParams(max_tokens=30, ignore_eos=True))]

            tasks = [asyncio.ensure_future(one(i)) for i in range(20)]
            for _ in range(5):  # each task runs to its send (synchronous), no further
                await asyncio.sleep(0)
            time.sleep(1.0)  # the loop stands still while the engine floods the socket
            dispatched.clear()
            core._read_outputs()  # one turn of the reader
            # it stopped at the first message that reached the budget; the rest: next turn
            assert sum(dispatched) >= 8 and sum(dispatched[:-1]) < 8 and core._more_scheduled
            outs = await asyncio.gather(*tasks)
            assert all(sum(len(d.output_token_ids) for d in o) == 30 for o in outs)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_watch_timer_far_behind_time_measures_the_silence_again():
    """The client's own process stood still (a paused container): the engine's heartbeats
    of that time may still be in ZeroMQ's threads, so that silence is no verdict."""
    import time

    engine = EngineProcess(config_from_dict(BIG))
    try:
        async def main():
            client = AsyncEngineClient(engine, owns_engine=False)
            await client.connect()
            client._watch.cancel()
            now = time.monotonic()
            client._last_seen = now - 30.0  # silent for 30 s, as the clock sees it...
            client._watch_due = now - 10.0  # ...because this timer is 10 s late
            client._watch_engine()
            assert client.dead is None and client._last_seen >= now
            client._watch.cancel()
            client._last_seen = time.monotonic() - 30.0
            client._watch_due = time.monotonic()  # on time: the silence is real
            client._watch_engine()
            assert client.dead is not None and "no message from the engine" in str(client.dead)
            await client.close()

        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_an_engine_found_silent_is_shut_down_not_left_running(monkeypatch):
    import os
    import signal
    import time

    import schedkit.engine.client as client_mod
    from schedkit.errors import EngineDeadError

    monkeypatch.setattr(client_mod, "DEAD_AFTER_S", 1.0)

    async def main():
        llm = await AsyncLLM.create(config_from_dict(BIG))
        proc = llm.engine.proc
        try:
            os.kill(proc.pid, signal.SIGSTOP)  # alive, but says nothing
            with pytest.raises(EngineDeadError, match="no message from the engine"):
                async for _ in llm.generate([1, 2], SamplingParams(max_tokens=5)):
                    pass
            deadline = time.monotonic() + 20
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert proc.poll() is not None  # its requests would otherwise run on for nobody
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            await llm.close()

    asyncio.run(asyncio.wait_for(main(), 60))
