"""Live migration on real replicas (local engine processes): a router plugin moves
running requests between replicas at random steps, and every stream still equals what
one colocated engine produces, token for token, none lost or repeated (the tiny paged
model greedy, seeded sampling, n-gram speculation, structured outputs; the fake runner
with a thousand requests); ``drain`` empties a replica; blocks are all free at the end."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections import Counter
from typing import Any

import pytest

from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.llm import LLM, AsyncLLM
from tests.cluster.replica_runs import fake_tokens
from tests.cluster.test_disagg_replicas import (
    colocated,
    fake_base,
    paged_base,
    random_prompts,
    stream_all,
)

pytestmark = pytest.mark.timeout(180)
STREAMS_DEADLINE_S = 120.0
"""Far past a normal run (seconds): the streams of a run that hangs are reported then."""

RANDOM_MOVES = '''
import random

from schedkit import Migration, hookimpl


class RandomMoves:
    """Moves each outstanding request, with probability ``share`` per round, to another
    open replica chosen at random (seeded)."""

    def __init__(self, seed=0, share=0.3):
        self.rng = random.Random(seed)
        self.share = share

    @hookimpl
    def schedkit_router_migrate(self, replicas, requests):
        open_ = [r.index for r in replicas if r.healthy and not r.draining]
        moves = []
        for index, reqs in sorted(requests.items()):
            for q in reqs:
                others = [i for i in open_ if i != index]
                if others and self.rng.random() < self.share:
                    moves.append(Migration(q.request_id, self.rng.choice(others), "random"))
        return moves
'''


@pytest.fixture
def random_moves(install_plugin):
    install_plugin("random_moves", RANDOM_MOVES, {"random-moves": "random_moves:RandomMoves"})


def moving(base: dict[str, Any], n: int = 2, share: float = 0.5, interval: float = 0.02, **replicas: Any) -> Any:
    return config_from_dict({**base, "replicas": {"count": n, **replicas}, "router": {
        "policy": "round-robin", "migration_interval_s": interval,
        "plugins": [{"name": "random-moves", "settings": {"seed": 1, "share": share}}]}})


def assert_all_free(stats: dict[str, Any]) -> None:
    for rep in stats["replicas"]:
        assert rep["kv_cache_usage"] == 0.0 and rep["num_running"] == rep["num_waiting"] == 0, rep
        assert rep["kv_transfer_held_blocks"] == 0 and rep["kv_transfer_reserved_blocks"] == 0, rep


@pytest.mark.parametrize("kind", ["greedy", "seeded", "ngram"])
def test_moved_at_random_steps_the_tokens_equal_one_engine(random_moves, kind):
    base = paged_base(num_speculative_tokens=3 if kind == "ngram" else 0)
    prompts = random_prompts(10, seed=31)
    if kind == "ngram":
        prompts = [p[:30] * 3 for p in prompts]  # repeats: drafts are proposed and accepted
    sps = [SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.0) if kind != "seeded" else
           SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.9, top_k=50, seed=100 + i)
           for i in range(len(prompts))]
    want = colocated(base, prompts, sps)

    async def run() -> tuple[Any, ...]:
        async with await AsyncLLM.create(moving(base)) as llm:
            seen: dict[str, float] = {}
            so_far: dict[str, list[int]] = {}
            t0 = time.monotonic()
            try:
                tokens, ends, finals = await asyncio.wait_for(stream_all(llm, prompts, sps, seen, so_far),
                                                              STREAMS_DEADLINE_S)
            except TimeoutError:  # say where each request stands, not only that it hung
                stats = await asyncio.wait_for(llm.call_utility("stats"), 10)
                raise AssertionError(
                    f"streams open after {STREAMS_DEADLINE_S} s: tokens per request "
                    f"{ {r: len(t) for r, t in so_far.items()} }; migration {stats.get('migration')}; "
                    f"router {stats['router']['replicas']}") from None
            return t0, seen, tokens, ends, finals, await llm.call_utility("stats")

    t0, seen, tokens, ends, finals, stats = asyncio.run(run())
    assert set(ends.values()) == {1}
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == want
    for rid, final in finals.items():  # the metrics span the replicas it ran on
        m = final.metrics
        assert m.num_output_tokens == 48
        assert t0 <= m.arrival_time <= m.first_token_time <= seen[rid] <= m.finish_time, (rid, m)
    mig = stats["migration"]
    assert mig["num_migrated"] >= 3 and mig["num_handoffs"] == mig["num_migrated"] and mig["fallbacks"] == {}
    assert mig["num_blocks"] > 0
    assert_all_free(stats)


def test_moved_with_structured_outputs_the_grammar_follows(random_moves, install_plugin):
    install_plugin("synthetic_vocab", "from schedkit.structured.testing import structured_backend_plugin\n"
                   "def Synthetic():\n    return structured_backend_plugin(32000)\n",
                   {"synthetic-vocab": "synthetic_vocab:Synthetic"})
    from schedkit.structured.testing import structured_text

    base = {**paged_base(), "plugins": [{"name": "synthetic-vocab"}], "structured_outputs": {"backend": "synthetic"}}
    pattern = r"([a-f]{2,4}-[0-9]{2} ?){3,6}"
    prompts = random_prompts(8, seed=32)
    sps = [SamplingParams(max_tokens=60, eos_token_id=0, temperature=0.0,
                          structured_outputs={"regex": pattern}) if i % 2 == 0 else
           SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0) for i in range(len(prompts))]
    want = colocated(base, prompts, sps)
    with LLM(moving(base, share=0.7)) as llm:
        got = [o.output_token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
        stats = llm.call_utility("stats")
    assert got == want
    for i in range(0, len(prompts), 2):
        assert re.fullmatch(pattern, structured_text(got[i], 32000)), got[i]
    assert stats["migration"]["num_migrated"] >= 2
    assert_all_free(stats)


@pytest.mark.parametrize("n", [1000, pytest.param(4000, marks=pytest.mark.slow)])
def test_a_thousand_fake_requests_moved_at_random_each_end_once_with_their_tokens(random_moves, n):
    cfg = moving(fake_base(num_blocks=2048), n=3, share=0.05, interval=0.01)

    async def run() -> tuple[Any, ...]:
        async with await AsyncLLM.create(cfg) as llm:
            prompts = [list(range(100, 132)) + [1000 + i] for i in range(n)]
            sps = [SamplingParams(max_tokens=10 + i % 30, ignore_eos=True) for i in range(n)]
            tokens, ends, finals = await stream_all(llm, prompts, sps)
            return tokens, ends, finals, await llm.call_utility("stats")

    tokens, ends, finals, stats = asyncio.run(run())
    assert len(ends) == n and set(ends.values()) == {1}
    for i in range(n):
        assert tokens[f"r{i}"] == fake_tokens(f"r{i}", 10 + i % 30), i
        assert finals[f"r{i}"].finish_reason == "length"
    assert stats["migration"]["num_migrated"] >= 20
    assert stats["router"]["num_migrated"] == stats["migration"]["num_migrated"]
    assert_all_free(stats)


def test_drain_moves_every_request_off_a_replica_and_it_takes_no_new_one():
    cfg = config_from_dict({**fake_base(num_blocks=2048), "replicas": {"count": 2}, "router": {
        "policy": "round-robin", "migration_interval_s": 0.01, "plugins": [{"name": "drain"}]}})

    async def run() -> tuple[Any, ...]:
        async with await AsyncLLM.create(cfg) as llm:
            core = llm.core
            n = 200
            tokens: dict[str, list[int]] = {}
            ends: Counter[str] = Counter()

            async def one(i: int) -> None:
                rid = f"d{i}"
                tokens[rid] = []
                async for o in llm.generate([5, 6, 7, i], SamplingParams(max_tokens=200, ignore_eos=True),
                                            request_id=rid):
                    tokens[rid] += o.output_token_ids
                    ends[rid] += o.finished

            tasks = [asyncio.create_task(one(i)) for i in range(n)]
            while sum(map(len, tokens.values())) < 400:  # every request under way on both replicas
                await asyncio.sleep(0.01)
            before = core.router.replicas[1].num_outstanding
            await core.drain(1, timeout=60)
            after_drain = core.router.replicas[1].num_outstanding
            extra = [o async for o in llm.generate([9, 9], SamplingParams(max_tokens=3), request_id="late")]
            await asyncio.gather(*tasks)
            return before, after_drain, tokens, ends, extra, await llm.call_utility("stats")

    before, after_drain, tokens, ends, extra, stats = asyncio.run(run())
    assert before > 50 and after_drain == 0
    assert set(ends.values()) == {1}
    assert all(tokens[f"d{i}"] == fake_tokens(f"d{i}", 200) for i in range(200))
    assert extra[-1].finished
    router = stats["router"]
    assert router["replicas"][1]["draining"] and router["replicas"][1]["num_routed"] == 100
    assert router["replicas"][0]["num_routed"] == 101  # the late request too
    assert stats["migration"]["num_migrated"] >= before and stats["migration"]["fallbacks"] == {}
    assert_all_free(stats)


def test_a_replica_killed_while_requests_move_every_request_ends_once(random_moves):
    """Three fake replicas moving requests at random, one SIGKILLed mid-run: requests it
    held with tokens fail naming it; every other request, moved or not, ends once with all
    its tokens; the survivors hold no block."""
    from tests.cluster.replica_runs import DEATH, sigkill

    cfg = moving(fake_base(num_blocks=2048), n=3, share=0.1, interval=0.01)
    n = 600

    async def run() -> tuple[Any, ...]:
        async with await AsyncLLM.create(cfg) as llm:
            core = llm.core
            tokens: dict[str, list[int]] = {}
            finals: dict[str, Any] = {}
            ends: Counter[str] = Counter()

            async def one(i: int) -> None:
                rid = f"k{i}"
                tokens[rid] = []
                async for o in llm.generate([7, 8, i], SamplingParams(max_tokens=30 + i % 40, ignore_eos=True),
                                            request_id=rid):
                    tokens[rid] += o.output_token_ids
                    if o.finished:
                        ends[rid] += 1
                        finals[rid] = o

            tasks = [asyncio.create_task(one(i)) for i in range(n)]
            while core.router.num_migrated < 20:
                assert not all(t.done() for t in tasks), "every request ended before 20 moves"
                await asyncio.sleep(0.01)
            sigkill(core.replicas.handles[1].pid)
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            return tokens, finals, ends, await llm.call_utility("stats")

    tokens, finals, ends, stats = asyncio.run(run())
    assert len(ends) == n and set(ends.values()) == {1}
    failed = 0
    for i in range(n):
        rid, final = f"k{i}", finals[f"k{i}"]
        want = fake_tokens(rid, 30 + i % 40)
        if final.finish_reason == "error":
            failed += 1
            assert DEATH.fullmatch(final.error or "") and int(DEATH.fullmatch(final.error)[1]) == 1, final.error
            assert tokens[rid] == want[:len(tokens[rid])]
        else:
            assert final.finish_reason == "length" and tokens[rid] == want, rid
    assert failed and stats["router"]["num_failed_by_death"] == failed
    for i in (0, 2):
        rep = stats["replicas"][i]
        assert rep["kv_cache_usage"] == 0.0 and rep["num_running"] == rep["num_waiting"] == 0
        assert rep["kv_transfer_held_blocks"] == 0 and rep["kv_transfer_reserved_blocks"] == 0


def test_a_source_stalled_mid_move_past_the_timeout_the_target_computes_the_kv(random_moves):
    """The first move's source is SIGSTOPped as its KV is asked for: past
    ``replicas.transfer_timeout_s`` the target computes the request's KV from its prompt
    and outputs itself, the stalled replica's requests go on once it runs again, every
    stream equals one engine's, and nothing stays held or reserved."""
    from tests.cluster.replica_runs import sigstop

    base = paged_base()
    prompts = random_prompts(6, seed=41)
    sps = [SamplingParams(max_tokens=48, ignore_eos=True, temperature=0.0)] * len(prompts)
    want = colocated(base, prompts, sps)

    async def run() -> tuple[Any, ...]:
        async with await AsyncLLM.create(moving(base, transfer_timeout_s=0.3)) as llm:
            core = llm.core
            stalled: list[int] = []

            def stall_first_export(index: int, real: Any) -> Any:
                async def call_utility(method: str, *args: Any) -> Any:
                    if method == "kv_export" and not stalled:
                        stalled.append(index)
                        sigstop(core.replicas.handles[index].pid)
                    return await real(method, *args)
                return call_utility

            for i, conn in enumerate(core.conns):
                conn.call_utility = stall_first_export(i, conn.call_utility)

            async def wake_after_the_fallback() -> None:
                while not core.migrator.stats.fallbacks:
                    await asyncio.sleep(0.01)
                os.kill(core.replicas.handles[stalled[0]].pid, signal.SIGCONT)

            waker = asyncio.create_task(wake_after_the_fallback())
            tokens, ends, _ = await stream_all(llm, prompts, sps)
            await waker
            await asyncio.sleep(0.3)  # the late release reaches the stalled replica
            return stalled, tokens, ends, await llm.call_utility("stats")

    stalled, tokens, ends, stats = asyncio.run(run())
    assert len(stalled) == 1 and set(ends.values()) == {1}
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == want
    mig = stats["migration"]
    # A move toward the stalled replica meanwhile times out the same way.
    assert set(mig["fallbacks"]) == {"timeout"} and mig["fallbacks"]["timeout"] >= 1
    assert mig["num_handoffs"] == mig["num_migrated"] - mig["fallbacks"]["timeout"]
    assert all(r["healthy"] for r in stats["replicas"])
    assert_all_free(stats)
