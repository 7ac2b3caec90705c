"""Prefill/decode disaggregation on real replicas (local engine processes): the prefill
replica computes the prompt, its KV travels through the front end to the decode
replica, which loads it and decodes. Greedy tokens equal one colocated engine's (the
tiny paged model, with n-gram speculation and structured outputs on); a stalled or
killed prefill replica, a killed decode replica and a decode replica without room all
end every request exactly once, with no KV block left held on the survivors."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter
from typing import Any

import pytest

from schedkit.cluster.front import ClusterClient
from schedkit.config import Config, config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.llm import LLM, AsyncLLM
from tests.cluster.replica_runs import DEATH, fake_tokens, max_tokens, prompt, sigkill, sigstop

pytestmark = pytest.mark.timeout(180)

PREFILL, DECODE = 0, 1
ROLES = {"prefill": 1, "decode": 1}
ALWAYS = {"plugins": [{"name": "selective-pd", "settings": {"threshold": 0}}]}
"""Every request with an uncached prompt token is disaggregated."""


def disagg(base: dict[str, Any], **replicas: Any) -> Config:
    return config_from_dict({**base, "replicas": {"count": 2, "roles": ROLES, **replicas}, "router": ALWAYS})


def paged_base(**scheduler: Any) -> dict[str, Any]:
    return {"runner": {"kind": "paged", "num_threads": 1}, "cache": {"num_blocks": 256},
            "scheduler": {"max_num_seqs": 16, **scheduler}}


def fake_base(**cache: Any) -> dict[str, Any]:
    return {"runner": {"kind": "fake", "clock": "wall", "step_time_ms": 5, "vocab_size": 32000},
            "scheduler": {"max_num_seqs": 32}, "cache": cache}


def random_prompts(n: int, seed: int = 0, lo: int = 20, hi: int = 140) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 32000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def colocated(base: dict[str, Any], prompts: list[list[int]], sps: list[SamplingParams]) -> list[list[int]]:
    with LLM(config_from_dict(base)) as llm:
        return [o.output_token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]


def split_run(base: dict[str, Any], prompts: list[list[int]], sps: list[SamplingParams],
              ) -> tuple[list[list[int]], list[list[int]], dict[str, Any]]:
    """(one colocated engine's tokens, the disaggregated cluster's tokens through
    ``LLM.generate``, the cluster's stats)."""
    want = colocated(base, prompts, sps)
    with LLM(disagg(base)) as llm:
        got = [o.output_token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
        return want, got, llm.call_utility("stats")


async def stream_all(llm: AsyncLLM, prompts: list[list[int]], sps: list[SamplingParams],
                     first_seen: dict[str, float] | None = None, tokens: dict[str, list[int]] | None = None,
                     ) -> tuple[dict[str, list[int]], Counter[str], dict[str, Any]]:
    """Stream every request at once: each one's tokens, how many times it ended, its
    last output (``first_seen``: filled with when each one's first token arrived,
    ``time.monotonic()``; ``tokens``: filled as they come, for a caller that gives up)."""
    tokens = {} if tokens is None else tokens
    ends: Counter[str] = Counter()
    finals: dict[str, Any] = {}

    async def one(i: int) -> None:
        rid = f"r{i}"
        tokens[rid] = []
        async for o in llm.generate(prompts[i], sps[i], request_id=rid):
            assert not ends[rid], f"{rid}: a delta after its end"
            if first_seen is not None and o.output_token_ids and not tokens[rid]:
                first_seen[rid] = time.monotonic()
            tokens[rid] += o.output_token_ids
            if o.finished:
                ends[rid] += 1
                finals[rid] = o

    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return tokens, ends, finals


def assert_nothing_held(stats: dict[str, Any], alive: tuple[int, ...] = (PREFILL, DECODE)) -> None:
    """Every live replica's KV blocks are free and nothing is kept or reserved for a
    hand-off."""
    for i in alive:
        rep = stats["replicas"][i]
        assert rep["healthy"], rep
        assert rep["kv_transfer_held_blocks"] == 0 and rep["kv_transfer_reserved_blocks"] == 0, rep
        assert rep["kv_cache_usage"] == 0.0, rep
        assert rep["num_running"] == rep["num_waiting"] == 0, rep


# ------------------------------------------------------------------ greedy equality
@pytest.mark.parametrize("speculative", [0, 3], ids=["plain", "ngram"])
def test_paged_greedy_tokens_equal_one_colocated_engine(speculative):
    base = paged_base(num_speculative_tokens=speculative)
    prompts = random_prompts(12)
    prompts += [p[:40] + p[:40] + p[:20] for p in prompts[:4]]  # repeats: n-gram drafts hit
    sps = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)] * len(prompts)
    want, got, stats = split_run(base, prompts, sps)
    assert got == want
    kv = stats["kv_transfer"]
    assert kv["num_handoffs"] == len(prompts) and kv["fallbacks"] == {}
    assert kv["num_blocks"] + kv["num_blocks_held"] == sum(len(p) // 16 for p in prompts)
    per_block = 4 * 2 * 16 * 2 * 32 * 4  # layers, K and V, block_size, kv heads, head_dim, float32
    assert kv["num_bytes"] == kv["num_blocks"] * per_block
    assert stats["replicas"][DECODE]["kv_transfer_received_tokens"] > 0
    assert stats["router"]["num_disaggregated"] == len(prompts)
    assert_nothing_held(stats)


def test_paged_async_streams_equal_colocated_and_prefix_blocks_are_not_sent_twice():
    base = paged_base()
    shared = random_prompts(1, seed=5, lo=64, hi=65)[0]  # four full blocks every prompt starts with
    prompts = [shared + p for p in random_prompts(6, seed=6, lo=5, hi=40)]
    sps = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)] * len(prompts)
    want = colocated(base, prompts, sps)

    async def run() -> tuple[dict[str, list[int]], Counter[str], dict[str, Any]]:
        async with await AsyncLLM.create(disagg(base)) as llm:
            first, _, _ = await stream_all(llm, prompts[:1], sps[:1])  # the decode replica caches the prefix
            rest, ends, _ = await stream_all(llm, prompts, sps)
            return {"r0": first["r0"], **{f"x{k}": v for k, v in rest.items()}}, ends, await llm.call_utility("stats")

    got, ends, stats = asyncio.run(run())
    assert got["r0"] == want[0]
    assert [got[f"xr{i}"] for i in range(len(prompts))] == want
    assert set(ends.values()) == {1}
    kv = stats["kv_transfer"]
    assert kv["num_blocks_held"] >= 4 * len(prompts)  # the shared prefix stayed on the decode side
    assert_nothing_held(stats)


def test_structured_outputs_disaggregated_match_colocated(install_plugin):
    install_plugin("synthetic_vocab", "from schedkit.structured.testing import structured_backend_plugin\n"
                   "def Synthetic():\n    return structured_backend_plugin(32000)\n",
                   {"synthetic-vocab": "synthetic_vocab:Synthetic"})
    base = {**paged_base(num_speculative_tokens=2), "plugins": [{"name": "synthetic-vocab"}],
            "structured_outputs": {"backend": "synthetic"}}
    from schedkit.structured.testing import structured_text

    patterns = [r"[a-f]{2,4}-[0-9]{2}", r"(yes|no|maybe)", r"(ab|cd){1,3}x"]
    prompts = random_prompts(6, seed=9)
    sps = [SamplingParams(max_tokens=30, eos_token_id=0, temperature=0.0,
                          structured_outputs={"regex": patterns[i % 3]}) if i % 2 == 0 else
           SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0) for i in range(len(prompts))]
    want, got, stats = split_run(base, prompts, sps)
    assert got == want
    import re
    for i in range(0, len(prompts), 2):
        assert re.fullmatch(patterns[i % 3], structured_text(got[i], 32000)), got[i]
    assert stats["kv_transfer"]["num_handoffs"] == len(prompts)


# ------------------------------------------------------------------ failures mid-transfer
def intercept_export(client: ClusterClient, action) -> list[str]:
    """Run ``action(prefill handle)`` before the first ``kv_export`` reaches the prefill
    replica (the stall or the death then happens with its blocks kept, mid-hand-off)."""
    conn = client.conns[PREFILL]
    real = conn.call_utility
    fired: list[str] = []

    async def call_utility(method: str, *args: Any) -> Any:
        if method == "kv_export" and not fired:
            fired.append(args[0])
            action(client.replicas.handles[PREFILL])
        return await real(method, *args)

    conn.call_utility = call_utility  # type: ignore[method-assign]
    return fired


def test_prefill_replica_stalled_past_the_timeout_decode_computes_the_prompt():
    base = paged_base()
    prompts = random_prompts(4, seed=11)
    sps = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)] * len(prompts)
    want = colocated(base, prompts, sps)

    async def run() -> tuple[Any, ...]:
        async with await AsyncLLM.create(disagg(base, transfer_timeout_s=0.3)) as llm:
            stopped: list[float] = []

            def stall(handle: Any) -> None:
                sigstop(handle.pid)
                stopped.append(time.monotonic())

            fired = intercept_export(llm.core, stall)
            first, ends, _ = await stream_all(llm, prompts[:1], sps[:1])
            os.kill(llm.core.replicas.handles[PREFILL].pid, signal.SIGCONT)
            rest, more, _ = await stream_all(llm, prompts, sps)
            await asyncio.sleep(0.2)  # the late release reaches the prefill replica
            return fired, first, ends, rest, more, await llm.call_utility("stats")

    fired, first, ends, rest, more, stats = asyncio.run(run())
    assert fired == ["r0"] and first["r0"] == want[0] and set(ends.values()) == {1}
    assert [rest[f"r{i}"] for i in range(len(prompts))] == want and set(more.values()) == {1}
    kv = stats["kv_transfer"]
    assert kv["fallbacks"] == {"timeout": 1} and kv["num_handoffs"] == len(prompts)
    assert stats["router"]["replicas"][PREFILL]["healthy"]
    assert_nothing_held(stats)


def test_prefill_replica_killed_mid_transfer_decode_computes_the_prompt():
    base = paged_base()
    prompts = random_prompts(5, seed=12)
    sps = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)] * len(prompts)
    want = colocated(base, prompts, sps)

    async def run() -> tuple[Any, ...]:
        async with await AsyncLLM.create(disagg(base)) as llm:
            fired = intercept_export(llm.core, lambda h: sigkill(h.pid))
            tokens, ends, finals = await stream_all(llm, prompts, sps)
            return fired, tokens, ends, await llm.call_utility("stats")

    fired, tokens, ends, stats = asyncio.run(run())
    assert len(fired) == 1 and set(ends.values()) == {1}
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == want
    assert stats["kv_transfer"]["fallbacks"].get("prefill_died", 0) >= 1
    assert [r["healthy"] for r in stats["router"]["replicas"]] == [False, True]
    assert_nothing_held(stats, alive=(DECODE,))


def test_decode_without_room_holds_the_prefill_blocks_until_it_has_some():
    base = paged_base()
    base["cache"] = {"num_blocks": 40}  # 39 usable blocks: room for about three prompts at once
    prompts = random_prompts(12, seed=13, lo=150, hi=190)
    sps = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)] * len(prompts)
    want, got, stats = split_run(base, prompts, sps)
    assert got == want
    kv = stats["kv_transfer"]
    assert kv["num_room_waits"] > 0 and kv["num_handoffs"] == len(prompts) and kv["fallbacks"] == {}
    assert_nothing_held(stats)


# ------------------------------------------------------------------ thousands, one side killed
async def kill_one_side(victim: int, n: int) -> dict[str, Any]:
    """``n`` requests through 1 prefill + 1 decode replica of the fake runner; once 50
    hand-offs are done and requests are streaming, replica ``victim`` is stopped, the
    tokens every request has are noted, and it is killed."""
    cfg = disagg(fake_base(num_blocks=1024))
    out: dict[str, Any] = {"tokens": {}, "ends": Counter(), "finals": {}}
    async with await AsyncLLM.create(cfg) as llm:
        core = llm.core

        async def one(i: int) -> None:
            rid = f"q{i}"
            out["tokens"][rid] = []
            sp = SamplingParams(max_tokens=max_tokens(i), ignore_eos=True, temperature=0.0)
            async for d in llm.generate(prompt(i), sp, request_id=rid):
                assert not out["ends"][rid], f"{rid}: a delta after its end"
                out["tokens"][rid] += d.output_token_ids
                if d.finished:
                    out["ends"][rid] += 1
                    out["finals"][rid] = d

        async def arrive() -> None:  # a steady stream: prefills are under way until the last one
            for i in range(n):
                tasks.append(asyncio.create_task(one(i)))
                await asyncio.sleep(0.004)

        tasks: list[asyncio.Task[None]] = []
        arrivals = asyncio.create_task(arrive())
        prefill = core.router.replicas[PREFILL]
        while not (core.handoffs.num_handoffs >= 50 and prefill.num_outstanding
                   and any(t and not out["ends"][r] for r, t in out["tokens"].items())):
            assert not any(t.done() and t.exception() for t in tasks)
            assert not arrivals.done(), "the kill found no prefill under way"
            await asyncio.sleep(0.005)
        handle = core.replicas.handles[victim]
        sigstop(handle.pid)
        seen, quiet = -1, time.monotonic()
        while time.monotonic() - quiet < 0.3:  # what the stopped engine sent has arrived
            total = sum(map(len, out["tokens"].values()))
            if total != seen:
                seen, quiet = total, time.monotonic()
            await asyncio.sleep(0.02)
        out["at_kill"] = {r: len(t) for r, t in out["tokens"].items() if not out["ends"][r]}
        out["prefilling"] = prefill.num_outstanding
        sigkill(handle.pid)
        await arrivals
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        after: list[int] = []
        async for d in llm.generate(prompt(n), SamplingParams(max_tokens=4, ignore_eos=True), request_id="after"):
            after += d.output_token_ids
        out["after"] = after
        out["stats"] = await llm.call_utility("stats")
    return out


@pytest.mark.parametrize("n", [400, pytest.param(3000, marks=pytest.mark.slow)])
def test_prefill_replica_killed_mid_run_every_request_completes_once(n):
    run = asyncio.run(kill_one_side(PREFILL, n))
    assert len(run["finals"]) == n and set(run["ends"].values()) == {1}
    assert run["prefilling"]  # the kill landed with prefills under way
    for i in range(n):
        rid = f"q{i}"
        assert run["finals"][rid].finish_reason == "length", run["finals"][rid]
        assert run["tokens"][rid] == fake_tokens(rid, max_tokens(i)), rid
    assert run["after"] == fake_tokens("after", 4)
    stats = run["stats"]
    assert stats["kv_transfer"]["fallbacks"]["prefill_died"] >= 1
    assert stats["router"]["num_failed_by_death"] == 0
    assert_nothing_held(stats, alive=(DECODE,))


@pytest.mark.parametrize("n", [400, pytest.param(3000, marks=pytest.mark.slow)])
def test_decode_replica_killed_mid_run_every_request_ends_once(n):
    run = asyncio.run(kill_one_side(DECODE, n))
    assert len(run["finals"]) == n and set(run["ends"].values()) == {1}
    # Classed by how each stream ended: a stopped engine's last outputs may still be read
    # after the quiet period, so tokens counted at the kill only bound what failed.
    failed = {r for r, f in run["finals"].items() if f.finish_reason == "error"}
    assert any(run["at_kill"].get(r) for r in failed)  # the kill landed with requests streaming there
    for i in range(n):
        rid = f"q{i}"
        final, want = run["finals"][rid], fake_tokens(rid, max_tokens(i))
        if rid in failed:
            m = DEATH.fullmatch(final.error or "")
            assert final.finish_reason == "error" and m and int(m[1]) == DECODE, final
            k = len(run["tokens"][rid])
            assert k > 0 and k >= run["at_kill"].get(rid, 0) and run["tokens"][rid] == want[:k]
            assert int(m[2]) == k, final.error
        else:  # done before, or re-routed whole (no token yet): complete
            assert final.finish_reason == "length", final
            assert run["tokens"][rid] == want, rid
    assert run["after"] == fake_tokens("after", 4)
    stats = run["stats"]
    assert stats["router"]["num_failed_by_death"] == len(failed)
    assert_nothing_held(stats, alive=(PREFILL,))
