"""The front door's books stay straight whatever a careless caller does: requests the
engine refuses after the door let them through, callers that cancel, break out or time
out while held or running, a duplicate id, and broken flow plugins all end with nothing
held and nothing outstanding, and the door then serves at full width. Reading the stats
asks no flow plugin."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from schedkit import hookimpl
from schedkit.cluster.flow import FlowController
from schedkit.config import config_from_dict
from schedkit.core.hints import RequestHints
from schedkit.core.request import SamplingParams
from schedkit.core.routing import ReplicaState
from schedkit.errors import EngineBusyError, RequestError
from schedkit.llm import AsyncLLM

pytestmark = pytest.mark.timeout(120)

SHORT = SamplingParams(max_tokens=3, ignore_eos=True)
LONG = SamplingParams(max_tokens=40, ignore_eos=True)


def config(**flow: Any) -> Any:
    return config_from_dict({
        "runner": {"kind": "fake", "clock": "wall", "step_time_ms": 5, "vocab_size": 512},
        "scheduler": {"max_num_seqs": 2, "max_model_len": 64, "max_num_batched_tokens": 256},
        "flow_control": {"enabled": True, "queue_timeout_s": 30, "max_queued": 16,
                         "plugins": [{"name": "queue-depth", "settings": {"max_waiting": 0}}], **flow}})


async def drain(gen: Any) -> list[int]:
    out: list[int] = []
    async for o in gen:
        out += o.output_token_ids
    return out


async def door(llm: AsyncLLM) -> dict[str, Any]:
    return (await llm.call_utility("stats"))["flow_control"]


async def settled(llm: AsyncLLM) -> dict[str, Any]:
    """The door's stats once nothing is held or outstanding (a leaked slot never gets
    there: the test's timeout fails it)."""
    while True:
        st = await door(llm)
        if st["num_queued"] == 0 and st["num_outstanding"] == 0:
            return st
        await asyncio.sleep(0.02)


async def full_width(llm: AsyncLLM) -> None:
    """Two slots free: a second request is served while the first one's stream is open
    (unread, so its slot stays taken until it is closed)."""
    first = llm.generate([10, 11], SamplingParams(max_tokens=60, ignore_eos=True))
    async for _ in first:
        break
    second = await asyncio.wait_for(drain(llm.generate([12], SHORT)), 10)
    assert len(second) == 3
    assert (await door(llm))["num_outstanding"] == 1
    await first.aclose()


async def occupied(llm: AsyncLLM) -> list[asyncio.Task[Any]]:
    """Both slots taken by long requests (what comes next is held)."""
    tasks = [asyncio.create_task(drain(llm.generate([10], LONG))) for _ in range(2)]
    while (await door(llm))["num_outstanding"] < 2:
        await asyncio.sleep(0.01)
    return tasks


def test_requests_the_engine_refuses_after_the_door_give_their_slot_back():
    async def run() -> None:
        async with await AsyncLLM.create(config()) as llm:
            refusals = [
                (llm.generate(list(range(10, 110)), SHORT), "max_model_len"),  # prompt too long
                (llm.generate([10], SHORT, hints=RequestHints(slo_class="gold")), "slo_classes"),
            ]
            for gen, words in refusals:
                with pytest.raises(RequestError, match=words):
                    await drain(gen)
            # the same while held: the door lets them through later, the engine refuses them
            busy = await occupied(llm)
            held = [asyncio.create_task(drain(llm.generate(list(range(10, 110)), SHORT))) for _ in range(3)]
            held += [asyncio.create_task(drain(llm.generate([10], SHORT, hints=RequestHints(slo_class="x"))))
                     for _ in range(3)]
            results = await asyncio.gather(*held, *busy, return_exceptions=True)
            assert [type(r).__name__ for r in results[:6]] == ["RequestError"] * 6
            st = await settled(llm)
            assert st["num_held"] == 6 and st["num_refused"] == {}
            await full_width(llm)

    asyncio.run(run())


def test_a_duplicate_request_id_gives_its_slot_back():
    async def run() -> None:
        async with await AsyncLLM.create(config()) as llm:
            first = asyncio.create_task(drain(llm.generate([10], LONG, request_id="dup")))
            while (await door(llm))["num_outstanding"] < 1:
                await asyncio.sleep(0.01)
            with pytest.raises(RequestError, match="already streaming"):
                await drain(llm.generate([10], SHORT, request_id="dup"))
            await first
            await settled(llm)
            await full_width(llm)

    asyncio.run(run())


def test_callers_that_cancel_break_or_time_out_leave_nothing_behind():
    async def run() -> None:
        async with await AsyncLLM.create(config()) as llm:
            busy = await occupied(llm)
            held = [asyncio.create_task(drain(llm.generate([10], SHORT))) for _ in range(5)]
            while (await door(llm))["num_queued"] < 5:
                await asyncio.sleep(0.01)
            for t in held:
                t.cancel()
            busy[0].cancel()  # one running: its slot frees too
            await asyncio.gather(*held, *busy, return_exceptions=True)
            await settled(llm)

            # a first __anext__ that times out while held
            busy = await occupied(llm)
            gen = llm.generate([10], SHORT)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(gen.__anext__(), 0.01)
            await asyncio.gather(*busy)
            await settled(llm)

            # break out of the loop, then drop the generator
            gen = llm.generate([10], LONG)
            async for _ in gen:
                break
            assert (await door(llm))["num_outstanding"] == 1
            del gen
            gc.collect()
            await settled(llm)
            await full_width(llm)

    asyncio.run(run())


def test_a_timeout_and_a_full_door_refuse_with_reasons_and_leave_nothing_held():
    async def run() -> None:
        async with await AsyncLLM.create(config(queue_timeout_s=0.3, max_queued=2)) as llm:
            busy = [llm.generate([10], LONG) for _ in range(2)]  # open and unread: both slots stay taken
            for gen in busy:
                await gen.__anext__()
            held = [asyncio.create_task(drain(llm.generate([10], SHORT))) for _ in range(2)]
            while (await door(llm))["num_queued"] < 2:
                await asyncio.sleep(0.01)
            with pytest.raises(EngineBusyError, match="max_queued"):
                await drain(llm.generate([10], SHORT))
            for r in await asyncio.gather(*held, return_exceptions=True):
                assert isinstance(r, EngineBusyError) and "queue_timeout_s" in str(r)
            for gen in busy:
                await gen.aclose()
            st = await settled(llm)
            assert st["num_refused"] == {"full": 1, "timeout": 2}
            await full_width(llm)

    asyncio.run(run())


BROKEN_FLOW = '''
from schedkit import hookimpl


class Raises:
    @hookimpl
    def schedkit_flow_saturated(self, replicas, num_outstanding, num_queued, max_num_seqs):
        raise RuntimeError("boom")

    @hookimpl
    def schedkit_flow_pick_tenant(self, band, queues, now):
        raise RuntimeError("boom")
'''


def test_a_broken_flow_plugin_is_counted_once_per_call_and_fails_no_request(install_plugin):
    install_plugin("broken_flow_engine", BROKEN_FLOW, {"flow-raises": "broken_flow_engine:Raises"})

    async def run() -> None:
        cfg = config(plugins=[{"name": "queue-depth", "settings": {"max_waiting": 0}}, {"name": "flow-raises"}])
        async with await AsyncLLM.create(cfg) as llm:
            assert (await door(llm))["num_hook_errors"] == []
            outs = await asyncio.gather(*[drain(llm.generate([10, i], SHORT, tenant=f"t{i % 3}"))
                                          for i in range(10)])
            assert [len(o) for o in outs] == [3] * 10
            st = await settled(llm)
            errors = {hook: n for _, hook, n in st["num_hook_errors"]}
            assert errors["schedkit_flow_saturated"] >= 10 and errors["schedkit_flow_pick_tenant"] >= 1
            for _ in range(3):  # reading the stats (a /metrics scrape) asks no plugin
                assert (await door(llm))["num_hook_errors"] == st["num_hook_errors"]
            await full_width(llm)

    asyncio.run(run())


class CountingDetector:
    def __init__(self) -> None:
        self.calls = 0

    @hookimpl
    def schedkit_flow_saturated(self, num_outstanding, max_num_seqs):
        self.calls += 1
        return num_outstanding >= max_num_seqs


def test_stats_report_the_detectors_last_answer_without_asking_it():
    async def run() -> None:
        detector = CountingDetector()
        ctl = FlowController(config(), [ReplicaState(0)], extra_plugins=[detector])
        assert ctl.stats()["saturated"] is False and detector.calls == 0
        for i in range(2):
            await ctl.enter(f"r{i}", "a", 0, 10)
        held = asyncio.create_task(ctl.enter("r2", "a", 0, 10))
        await asyncio.sleep(0)
        calls = detector.calls
        for _ in range(3):
            assert ctl.stats()["saturated"] is True and ctl.stats()["num_queued"] == 1
        assert detector.calls == calls
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)

    asyncio.run(run())


class Closed:
    """The engines are full, whatever they report."""

    @hookimpl
    def schedkit_flow_saturated(self):
        return True


def test_a_request_displaced_as_its_timeout_fires_is_refused_not_sent_on(monkeypatch):
    """The displacement wakes the held request through a callback the event loop runs
    on its next pass; when the timeout fires first, the request must still be refused
    (it is out of the queue and holds no slot), not go on to the engines."""
    async def run() -> None:
        ctl = FlowController(config(max_queued=2, queue_timeout_s=5), [ReplicaState(0)], extra_plugins=[Closed()])
        first = asyncio.create_task(ctl.enter("f1", "flood", 0, 10))
        await asyncio.sleep(0)

        async def displaced_as_it_times_out(awaitable: Any, timeout: float) -> None:
            ctl.submit("p1", "polite", 0, 10)  # the door is full: this displaces the flooder's newest
            awaitable.cancel()
            raise TimeoutError

        monkeypatch.setattr(asyncio, "wait_for", displaced_as_it_times_out)
        with pytest.raises(EngineBusyError, match="displaced"):
            await ctl.enter("f2", "flood", 0, 10)
        monkeypatch.undo()
        assert ctl.num_outstanding == 0 and ctl.num_queued == 2 and ctl.num_refused == {"full": 1}
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)

    asyncio.run(run())


def test_a_request_displaced_by_a_more_urgent_band_is_told_so():
    async def run() -> None:
        ctl = FlowController(config(max_queued=2), [ReplicaState(0)], extra_plugins=[Closed()])
        held = [asyncio.create_task(ctl.enter(f"p{i}", "polite", 0, 10)) for i in range(2)]
        await asyncio.sleep(0)
        urgent = asyncio.create_task(ctl.enter("u", "other", -1, 10))
        await asyncio.sleep(0)
        with pytest.raises(EngineBusyError, match=r"by a more urgent request \(priority -1 < 0\)"):
            await held[1]
        for t in (held[0], urgent):
            t.cancel()
        await asyncio.gather(held[0], urgent, return_exceptions=True)

    asyncio.run(run())


class MaxOutstanding:
    """Saturated while ``limit`` requests are out."""

    def __init__(self) -> None:
        self.limit = 0

    @hookimpl
    def schedkit_flow_saturated(self, num_outstanding):
        return num_outstanding >= self.limit


def test_a_tenant_whose_held_requests_timed_out_banks_no_credit_when_it_returns():
    """E and B hold requests in band 0; E's first goes on; B's time out. While band -1
    keeps the door busy, E is served there (its counter grows by 3,000 tokens). B comes
    back to band 0: VTC lifts it to E's counter, so E's held request in band 0 is among
    the next two dispatched, not behind every one B sends."""
    detector = MaxOutstanding()
    ctl = FlowController(config(fairness="tenant-weighted", max_queued=64), [ReplicaState(0)],
                         extra_plugins=[detector])
    dispatched: list[Any] = []

    def submit(rid: str, tenant: str, band: int, cost: int) -> Any:
        return ctl.submit(rid, tenant, band, cost, dispatched.append)

    submit("e1", "E", 0, 10)
    submit("e2", "E", 0, 10)
    b1 = submit("b1", "B", 0, 10)
    detector.limit = 1  # one slot: each leave lets exactly one held request go
    ctl.pump()
    assert ctl.expire(b1) is not None  # B's request times out: B holds nothing now
    for i in range(3):  # band -1 keeps the slot busy with E's big requests
        submit(f"u{i}", "E", -1, 1000)
        ctl.leave(dispatched[-1])
    for i in range(2, 6):
        submit(f"b{i}", "B", 0, 10)  # B is back in band 0
    for _ in range(2):
        ctl.leave(dispatched[-1])
    names = [t.request_id for t in dispatched]
    assert names[:4] == ["e1", "u0", "u1", "u2"]
    assert "e2" in names[4:6], names
