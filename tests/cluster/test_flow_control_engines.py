"""Flow control in front of real engines (the fake runner, local processes): the door
keeps the engines' queues bounded, a flooding tenant does not push another tenant's
requests behind its own, a request held past the timeout is refused with a reason, and
with flow control off nothing changes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.errors import EngineBusyError
from schedkit.llm import AsyncLLM

pytestmark = pytest.mark.timeout(180)


def config(replicas: int = 1, **flow: Any) -> Any:
    return config_from_dict({
        "runner": {"kind": "fake", "clock": "wall", "step_time_ms": 2, "vocab_size": 32000},
        "scheduler": {"max_num_seqs": 2},
        "replicas": {"count": replicas},
        "flow_control": {"enabled": bool(flow) or False, **flow}})


ON = {"enabled": True, "plugins": [{"name": "queue-depth", "settings": {"max_waiting": 0}}]}


async def flood(llm: AsyncLLM, heavy: int, light: int, first: list[str]) -> None:
    """``heavy`` requests of tenant "heavy" at once, then, once the first heavy one has a
    token, ``light`` of tenant "light"; ``first`` gets each id when its first token
    arrives."""
    started = asyncio.Event()

    async def one(rid: str, tenant: str) -> None:
        async for out in llm.generate([5, 6, 7, len(rid)], SamplingParams(max_tokens=10, ignore_eos=True),
                                      request_id=rid, tenant=tenant):
            if out.output_token_ids and rid not in first:
                first.append(rid)
                started.set()

    tasks = [asyncio.create_task(one(f"h{i}", "heavy")) for i in range(heavy)]
    await started.wait()
    tasks += [asyncio.create_task(one(f"l{i}", "light")) for i in range(light)]
    await asyncio.gather(*tasks)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_flooding_tenant_does_not_push_another_behind_its_backlog(replicas):
    def run(flow: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
        async def go() -> tuple[list[str], dict[str, Any]]:
            first: list[str] = []
            async with await AsyncLLM.create(config(replicas, **flow)) as llm:
                await flood(llm, 40, 4, first)
                return first, await llm.call_utility("stats")
        return asyncio.run(go())

    off, _ = run({})
    on, stats = run(ON)
    # Off: the engines serve in arrival order; the light requests come after the whole
    # heavy backlog that was there before them.
    assert min(off.index(f"l{i}") for i in range(4)) >= 40 - 2 * replicas * 2
    # On: the door alternates between the tenants, so each light request waits for at
    # most a few heavy ones that were already at the engines or dispatched beside it.
    assert max(on.index(f"l{i}") for i in range(4)) < 4 * 2 + 2 * replicas * 2 + 2
    flow = stats["flow_control"]
    assert flow["num_held"] > 30 and flow["num_dispatched"] == 44 and flow["num_queued"] == 0
    assert flow["num_outstanding"] == 0 and flow["num_refused"] == {} and flow["num_hook_errors"] == []


def test_the_door_keeps_the_engine_queue_bounded():
    """max_waiting 0, max_num_seqs 2: the engine never holds more than 2 requests."""
    async def go() -> list[int]:
        seen: list[int] = []
        async with await AsyncLLM.create(config(**ON)) as llm:
            async def watch() -> None:
                while True:
                    st = await llm.call_utility("stats")
                    seen.append(st["num_running"] + st["num_waiting"])
                    await asyncio.sleep(0.005)

            watcher = asyncio.create_task(watch())
            await flood(llm, 30, 0, [])
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        return seen

    seen = asyncio.run(go())
    assert len(seen) > 5 and max(seen) <= 2


def test_a_request_held_past_the_timeout_is_refused_and_the_others_are_served():
    async def go() -> tuple[list[Any], dict[str, Any]]:
        cfg = config_from_dict({
            "runner": {"kind": "fake", "clock": "wall", "step_time_ms": 20, "vocab_size": 32000},
            "scheduler": {"max_num_seqs": 1},
            "flow_control": {**ON, "queue_timeout_s": 0.2}})
        async with await AsyncLLM.create(cfg) as llm:
            async def one(rid: str, n: int) -> Any:
                try:
                    async for out in llm.generate([1, 2, 3], SamplingParams(max_tokens=n, ignore_eos=True),
                                                  request_id=rid):
                        if out.finished:
                            return out.finish_reason
                except EngineBusyError as e:
                    return e

            long = asyncio.create_task(one("long", 60))  # 1.2 s at the engine
            await asyncio.sleep(0.05)
            results = await asyncio.gather(long, one("held", 2))
            after = await one("after", 2)  # the engine is free again: served at once
            return [*results, after], await llm.call_utility("stats")

    (long, held, after), stats = asyncio.run(go())
    assert long == "length" and after == "length"
    assert isinstance(held, EngineBusyError) and "flow_control.queue_timeout_s" in str(held)
    assert stats["flow_control"]["num_refused"] == {"timeout": 1}
    assert stats["flow_control"]["num_queued"] == 0 and stats["flow_control"]["num_outstanding"] == 0


def test_off_by_default():
    async def go() -> Any:
        async with await AsyncLLM.create(config()) as llm:
            assert llm.flow is None
            return await llm.call_utility("stats")

    assert "flow_control" not in asyncio.run(go())
