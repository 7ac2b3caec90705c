"""``replicas.backend: local``: real engine processes behind the router, one of them
SIGKILLed mid-run (through AsyncLLM and through LLM.generate)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import threading

import pytest

from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.errors import EngineDeadError
from schedkit.llm import LLM, AsyncLLM
from tests.cluster.replica_runs import (
    DEATH,
    KILLED,
    check_kill_run,
    fake_config,
    fake_tokens,
    kill_mid_run,
    max_tokens,
    paged_config,
    paged_reference,
    prompt,
    sigkill,
    sigstop,
    wait_gone,
)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.slow
def test_async_kill_mid_run_reroutes_tokenless_requests_and_fails_the_others():
    n = 2000
    run = asyncio.run(kill_mid_run(fake_config("local"), n, stop=lambda h: sigstop(h.pid),
                                   kill=lambda h: sigkill(h.pid)))
    check_kill_run(run, n, fake_tokens)
    assert all(wait_gone(h.pid) for h in run.handles)
    assert all(DEATH.fullmatch(f.error)[3] == "the engine process exited (code -9)"
               for f in run.finals.values() if f.finish_reason == "error")
    print(f"death detected {run.detect_s * 1e3:.0f} ms after SIGKILL; "
          f"{sum(1 for k in run.at_kill.values() if not k)} re-routed, "
          f"{sum(1 for k in run.at_kill.values() if k)} failed")


@pytest.mark.slow
def test_llm_generate_kill_mid_run():
    """The sync LLM: a replica SIGKILLed from another thread while generate() runs."""
    n = 3000
    cfg = fake_config("local")
    with LLM(cfg) as llm:
        core = llm._async.core
        victim = core.replicas.handles[KILLED]
        replica = core.router.replicas[KILLED]
        killed = threading.Event()

        def kill_when_mid_run():
            while replica.num_routed - replica.num_outstanding < 100 or replica.num_running == 0:
                if killed.wait(0.005):
                    return
            sigkill(victim.pid)
            killed.set()

        killer = threading.Thread(target=kill_when_mid_run, daemon=True)
        killer.start()
        outs = llm.generate([prompt(i) for i in range(n)],
                            [SamplingParams(max_tokens=max_tokens(i), ignore_eos=True) for i in range(n)],
                            use_tqdm=False)
        killed.set()
        killer.join(5)
        stats = llm.call_utility("stats")
        assert len(outs) == n and all(o.finished for o in outs)
        failed = [o for o in outs if o.finish_reason == "error"]
        for i, o in enumerate(outs):
            want = fake_tokens(o.request_id, max_tokens(i))
            if o.finish_reason == "error":
                m = DEATH.fullmatch(o.error)
                assert m and int(m[1]) == KILLED and int(m[2]) == len(o.output_token_ids) > 0, o.error
                assert o.output_token_ids == want[:len(o.output_token_ids)]
            else:
                assert o.finish_reason == "length" and o.output_token_ids == want
        router = stats["router"]
        assert failed and router["num_failed_by_death"] == len(failed)
        assert router["num_rerouted"] > 0
        assert [r["healthy"] for r in router["replicas"]] == [True, False]
        assert stats["num_running"] == 0 and llm.call_utility("num_unfinished") == 0
        again = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert again[0].output_token_ids == fake_tokens(again[0].request_id, 3)
    assert wait_gone(core.replicas.handles[0].pid)


def test_every_replica_dead_is_engine_dead_error_never_a_hang():
    async def main():
        async with await AsyncLLM.create(fake_config("local")) as llm:
            gens = [llm.generate([1, 2, 3, i], SamplingParams(max_tokens=10_000, ignore_eos=True),
                                 request_id=f"r{i}") for i in range(8)]
            firsts = [await g.__anext__() for g in gens]  # each produced a token
            assert all(f.output_token_ids for f in firsts)
            for h in llm.core.replicas.handles:
                sigkill(h.pid)
            for g in gens:  # each ends with the error naming its replica
                last = [d async for d in g][-1]
                assert last.finish_reason == "error" and DEATH.fullmatch(last.error), last
            while llm.is_alive():
                await asyncio.sleep(0.01)
            with pytest.raises(EngineDeadError, match="all 2 replicas died"):
                async for _ in llm.generate([1, 2], SamplingParams(max_tokens=2)):
                    pass
            with pytest.raises(EngineDeadError):
                await llm.call_utility("stats")

    asyncio.run(asyncio.wait_for(main(), 60))


def test_tokenless_requests_with_no_replica_left_raise_engine_dead_error():
    async def main():
        cfg = config_from_dict({"replicas": {"count": 2},
                                "runner": {"kind": "fake", "clock": "wall", "step_time_ms": 5},
                                "scheduler": {"max_num_seqs": 1}})
        async with await AsyncLLM.create(cfg) as llm:
            busy = [llm.generate([1, i], SamplingParams(max_tokens=10_000, ignore_eos=True))
                    for i in range(2)]
            for g in busy:
                await g.__anext__()  # both seats taken
            queued = asyncio.create_task(anext(llm.generate([9, 9], SamplingParams(max_tokens=2))))
            await asyncio.sleep(0.2)
            for h in llm.core.replicas.handles:
                h.proc.send_signal(signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="no replica left"):
                await queued
            for g in busy:
                await g.aclose()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_stats_aggregate_and_per_replica_and_utilities():
    async def main():
        async with await AsyncLLM.create(fake_config("local")) as llm:
            for i in range(6):
                async for _ in llm.generate(prompt(i), SamplingParams(max_tokens=3, ignore_eos=True)):
                    pass
            stats = await llm.call_utility("stats")
            assert [r["index"] for r in stats["replicas"]] == [0, 1]
            assert stats["num_steps"] == sum(r["num_steps"] for r in stats["replicas"])
            assert stats["prefix_cache_queries"] == sum(r["prefix_cache_queries"] for r in stats["replicas"])
            assert sum(r["num_routed"] for r in stats["router"]["replicas"]) == 6
            assert await llm.call_utility("num_unfinished") == 0
            assert await llm.call_utility("reset_prefix_cache") is True
            assert "fcfs" in [name for name, _ in await llm.call_utility("list_plugins")]
            assert await llm.call_utility("set_pause_state", "unpaused") == "unpaused"
            assert len(await llm.core.call_each("num_unfinished")) == 2
            pids = [h.pid for h in llm.core.replicas.handles]
        assert all(wait_gone(p) for p in pids)

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
@pytest.mark.timeout(1200)
def test_paged_model_kill_mid_run():
    """The tiny paged model: 200 requests in CI (``SCHEDKIT_PAGED_KILL_REQUESTS=2000``
    runs 2,000 in about a minute), replica 1 SIGKILLed mid-run; every complete
    request's greedy tokens equal one engine's, every failed one's are a prefix of them."""
    n = int(os.environ.get("SCHEDKIT_PAGED_KILL_REQUESTS", "200"))
    expected = paged_reference(n)
    run = asyncio.run(kill_mid_run(paged_config("local"), n, stop=lambda h: sigstop(h.pid),
                                   kill=lambda h: sigkill(h.pid), min_done=20))
    check_kill_run(run, n, expected)
