"""The cluster front end on local replicas: what reaches the router (sessions, KV
events), where aborts go, a silent replica, request ids."""

from __future__ import annotations

import asyncio
import signal

import pytest

import schedkit.engine.client as client_mod
from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.errors import RequestError
from schedkit.llm import AsyncLLM
from tests.cluster.replica_runs import DEATH, fake_tokens, sigkill, wait_gone

pytestmark = pytest.mark.timeout(60)

LONG = SamplingParams(max_tokens=100_000, ignore_eos=True)


def cfg(policy: str = "weighted", **more):
    return config_from_dict({"replicas": {"count": 2}, "router": {"policy": policy},
                             "runner": {"kind": "fake", "clock": "wall", "step_time_ms": 5}, **more})


async def drain(gen) -> list[int]:
    tokens: list[int] = []
    async for d in gen:
        tokens.extend(d.output_token_ids)
    return tokens


def test_abort_goes_to_the_requests_replica():
    async def main():
        async with await AsyncLLM.create(cfg()) as llm:
            gens = [llm.generate([1, 2, i], LONG, request_id=f"r{i}") for i in range(4)]
            for g in gens:
                await g.__anext__()
            where = {f"r{i}": llm.core.router.replica_of(f"r{i}") for i in range(4)}
            assert sorted(where.values()) == [0, 0, 1, 1]
            assert await llm.core.call_each("num_unfinished") == [2, 2]
            await gens[0].aclose()
            await gens[1].aclose()
            for _ in range(100):
                left = await llm.core.call_each("num_unfinished")
                if sum(left) == 2:
                    break
                await asyncio.sleep(0.02)
            assert left == [2 - list(where.values())[:2].count(i) for i in (0, 1)]
            assert llm.core.router.replica_of("r0") is None
            assert sum(r.num_outstanding for r in llm.core.router.replicas) == 2
            for g in gens[2:]:
                await g.aclose()

    asyncio.run(main())


def test_a_duplicate_request_id_is_refused_while_the_first_streams():
    async def main():
        async with await AsyncLLM.create(cfg()) as llm:
            first = llm.generate([1, 2], LONG, request_id="dup")
            await first.__anext__()
            with pytest.raises(RequestError, match="already streaming"):
                await drain(llm.generate([3, 4], SamplingParams(max_tokens=2), request_id="dup"))
            await first.aclose()
            again = await drain(llm.generate([3, 4], SamplingParams(max_tokens=2, ignore_eos=True),
                                             request_id="dup"))
            assert again == fake_tokens("dup", 2)

    asyncio.run(main())


def test_session_id_reaches_the_router():
    async def main():
        async with await AsyncLLM.create(cfg("session-affinity")) as llm:
            homes = {}
            for turn in range(3):
                for session in ("a", "b", "c"):
                    rid = f"{session}{turn}"
                    gen = llm.generate([turn, 7], SamplingParams(max_tokens=1), request_id=rid,
                                       session_id=session)
                    await gen.__anext__()
                    homes.setdefault(session, set()).add(llm.core.router.replica_of(rid))
                    await drain(gen)
            assert all(len(h) == 1 for h in homes.values()), homes

    asyncio.run(main())


def test_prefix_affinity_follows_the_replicas_kv_events():
    """A prompt goes where its prefix is cached, as the replica's own KV events said."""

    async def main():
        async with await AsyncLLM.create(cfg("prefix-affinity")) as llm:
            router = llm.core.router
            shared = list(range(500, 564))  # four full blocks
            await drain(llm.generate(shared + [1], SamplingParams(max_tokens=2), request_id="warm"))
            hashes = router.make_request("p", shared + [2]).block_hashes
            for _ in range(200):  # until the replica's report with the stored blocks arrives
                held = [r.index for r in router.replicas if r.cached_blocks.num_matched_blocks(hashes) == 4]
                if held:
                    break
                await asyncio.sleep(0.01)
            assert len(held) == 1
            for i in range(4):
                gen = llm.generate(shared + [10 + i], SamplingParams(max_tokens=1), request_id=f"p{i}")
                first = await gen.__anext__()
                assert router.replica_of(f"p{i}") == held[0] or first.finished
                await drain(gen)
            stats = await llm.call_utility("stats")
            assert stats["replicas"][held[0]]["prefix_cache_hits"] >= 4 * 64

    asyncio.run(main())


def test_a_silent_replica_is_taken_out_and_its_requests_move(monkeypatch):
    """SIGSTOP: the process lives but sends nothing, not even heartbeats. After
    DEAD_AFTER_S it is out of rotation, its token-less requests run on the other replica,
    the others fail naming it, and it is shut down (killed, since it cannot answer)."""
    monkeypatch.setattr(client_mod, "DEAD_AFTER_S", 1.0)

    async def main():
        async with await AsyncLLM.create(cfg(scheduler={"max_num_seqs": 1})) as llm:
            router = llm.core.router
            runs = {f"run{i}": llm.generate([1, i], LONG, request_id=f"run{i}") for i in range(2)}
            for g in runs.values():
                await g.__anext__()  # one running on each replica, each holding its one seat
            on = {router.replica_of(rid): g for rid, g in runs.items()}
            assert sorted(on) == [0, 1]
            waiting = asyncio.create_task(drain(llm.generate(
                [5, 5], SamplingParams(max_tokens=3, ignore_eos=True), request_id="wait")))
            while router.replica_of("wait") is None:
                await asyncio.sleep(0.01)
            x = router.replica_of("wait")  # queued behind the request running there
            silent = llm.core.replicas.handles[x]
            silent.proc.send_signal(signal.SIGSTOP)
            await on[1 - x].aclose()  # a seat on the other replica
            assert await asyncio.wait_for(waiting, 30) == fake_tokens("wait", 3)
            assert not router.replicas[x].healthy and router.num_rerouted == 1
            tail = [d async for d in on[x]]
            assert tail[-1].finish_reason == "error", tail
            m = DEATH.fullmatch(tail[-1].error)
            assert m and int(m[1]) == x and m[3] == "no message from the engine for 1 s", tail[-1].error
            assert wait_gone(silent.pid)  # shut down by the front end

    asyncio.run(main())


def test_cluster_counters_keep_a_dead_replicas_counts():
    """The summed counters of ``stats`` (steps, prefix-cache queries...) never go down
    when a replica dies: its last counts stay in the totals, its load leaves them."""
    async def main():
        async with await AsyncLLM.create(cfg("round-robin")) as llm:
            for i in range(4):
                await drain(llm.generate([1, 2, 3, i], SamplingParams(max_tokens=8)))
            before = await llm.call_utility("stats")
            dead = llm.core.replicas.handles[1]
            sigkill(dead.pid)
            for _ in range(200):
                if not llm.core.router.replicas[1].healthy:
                    break
                await asyncio.sleep(0.02)
            after = await llm.call_utility("stats")
            assert [r["healthy"] for r in after["replicas"]] == [True, False]
            for key in ("num_steps", "prefix_cache_queries"):
                assert after[key] >= before[key] > 0, key
            assert after["num_running"] == 0

    asyncio.run(main())


def test_an_slo_refusal_reaches_the_caller_and_the_reports_feed_the_predictor():
    """A class no replica can meet is refused with RouteRefusedError (the server's 429);
    the replicas' load reports carry what the latency predictor replays."""
    from schedkit.core.hints import RequestHints
    from schedkit.errors import EngineBusyError, RouteRefusedError

    async def main():
        config = cfg("slo-headroom", slo_classes={"instant": {"ttft_s": 1e-6}, "relaxed": {"ttft_s": 60}},
                     router={"policy": "slo-headroom", "latency_profile": "cpu-tiny-llama",
                             "plugins": [{"name": "slo-headroom", "settings": {"on_miss": "refuse"}}]})
        async with await AsyncLLM.create(config) as llm:
            router = llm.core.router
            long = [llm.generate([1, 2, i], LONG, request_id=f"r{i}", hints=RequestHints(slo_class="relaxed"))
                    for i in range(2)]
            for g in long:
                await g.__anext__()
            for _ in range(100):  # the decoding requests show in the next reports
                if all(r.decode_tokens_left for r in router.replicas):
                    break
                await asyncio.sleep(0.02)
            assert [len(r.decode_tokens_left) for r in router.replicas] == [1, 1]
            assert all(r.reported_at is not None and r.num_context_tokens >= 3 for r in router.replicas)
            with pytest.raises(RouteRefusedError, match="SLO class 'instant'") as info:
                await drain(llm.generate([5, 6, 7], SamplingParams(max_tokens=2), request_id="now",
                                         hints=RequestHints(slo_class="instant")))
            assert isinstance(info.value, EngineBusyError) and info.value.slo_class == "instant"
            assert router.stats()["num_refused"] == {"instant": 1}
            for g in long:
                await g.aclose()

    asyncio.run(main())
