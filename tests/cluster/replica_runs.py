"""Runs shared by the replica tests (local processes and Ray): two real replicas behind
the router, thousands of requests, one replica killed mid-run.

The kill is made exact rather than timed: the replica's engine is first stopped
(SIGSTOP), what it had already sent is let arrive, the tokens every request has
received are noted, and only then is the replica killed (SIGKILL for a local process,
``ray.kill`` for a Ray actor). So "had produced a token before the kill" is known for
every request, and the test checks each one's fate: re-routed and complete, or failed
with the error that names the replica and its token count.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from schedkit.config import Config, config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.llm import AsyncLLM, RequestOutput
from schedkit.runners.fake import request_seed

KILLED = 1
"""The replica every run kills."""
VOCAB = 32000
SHARED = list(range(100, 132))
"""A 32-token prefix every prompt starts with (two full blocks: the replicas' KV events
report them, and the router's prefix view fills)."""
DEATH = re.compile(r"replica (\d+) \((?:local|ray)\) died after this request produced (\d+) tokens: "
                   r"([^\n]+)")
"""A request's error when its replica died after it produced tokens: one line naming the
replica, its backend, the tokens and the cause."""


def fake_config(backend: str, **replicas: Any) -> Config:
    """Two replicas on the fake runner in wall-clock time (5 ms steps), 32 seats each."""
    return config_from_dict({
        "replicas": {"count": 2, "backend": backend, **replicas},
        "runner": {"kind": "fake", "clock": "wall", "step_time_ms": 5, "vocab_size": VOCAB},
        "scheduler": {"max_num_seqs": 32},
    })


def prompt(i: int) -> list[int]:
    return SHARED + [1000 + i % 500, 2000 + i]


def max_tokens(i: int) -> int:
    """Staggered lengths, so that at any moment running requests are at every stage."""
    return 6 + i % 13


def fake_tokens(request_id: str, n: int, vocab: int = VOCAB) -> list[int]:
    """The fake runner's first ``n`` tokens for a request without a seed and no EOS."""
    seed = request_seed(request_id)
    return [(seed + 7919 * k) % vocab for k in range(n)]


def pid_gone(pid: int) -> bool:
    """The process exited (gone, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or during the read
        return True


def wait_gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid_gone(pid):
            return True
        time.sleep(0.05)
    return False


@dataclass
class KillRun:
    """What one async run saw."""

    config: Config
    finals: dict[str, RequestOutput] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finishes: Counter[str] = field(default_factory=Counter)
    at_kill: dict[str, int] = field(default_factory=dict)
    """The killed replica's outstanding requests -> tokens each had received."""
    stats: dict[str, Any] = field(default_factory=dict)
    detect_s: float = 0.0
    """Seconds from the kill until the router took the replica out of rotation."""
    after: RequestOutput | None = None
    """A request sent after the death (served by the survivor)."""
    handles: list[Any] = field(default_factory=list)
    """The replicas' handles (closed by the end of the run)."""


QUIET_S = 1.0
"""Seconds without a new token from a stopped replica before its requests' tokens count
as all it sent."""


async def kill_mid_run(config: Config, n: int, *, stop: Callable[[Any], None],
                       kill: Callable[[Any], None],
                       after_detect: Callable[[Any], None] | None = None,
                       min_done: int = 50) -> KillRun:
    """Stream ``n`` requests through a replicated AsyncLLM; once replica KILLED has
    finished ``min_done`` requests and is streaming others, stop it, note every
    request's tokens, kill it, and let everything finish. ``after_detect(handle)`` runs
    once the router took the replica out of rotation."""
    run = KillRun(config)
    async with await AsyncLLM.create(config) as llm:
        core = llm.core
        router = core.router
        handle = core.replicas.handles[KILLED]
        run.handles = list(core.replicas.handles)

        async def one(i: int) -> None:
            rid = f"q{i}"
            run.tokens[rid] = []
            sp = SamplingParams(max_tokens=max_tokens(i), ignore_eos=True, temperature=0.0)
            async for d in llm.generate(prompt(i), sp, request_id=rid):
                assert not run.finishes[rid], f"{rid}: a delta after its end"
                run.tokens[rid].extend(d.output_token_ids)
                if d.finished:
                    run.finishes[rid] += 1
                    run.finals[rid] = d

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        replica = router.replicas[KILLED]

        def streaming_there() -> bool:
            return any(run.tokens[r] and not run.finishes[r] and router.replica_of(r) == KILLED
                       for r in run.tokens)

        while not (replica.num_routed - replica.num_outstanding >= min_done and streaming_there()):
            assert not any(t.done() and t.exception() for t in tasks), [t.exception() for t in tasks if t.done()]
            await asyncio.sleep(0.01)
        there = [r for r in run.tokens if not run.finishes[r] and router.replica_of(r) == KILLED]
        stop(handle)
        # Let what the stopped engine had sent arrive: no new token for QUIET_S (a busy
        # front end can take a few tenths of a second to read what is already on its way).
        seen, quiet_since = -1, time.monotonic()
        while time.monotonic() - quiet_since < QUIET_S:
            total = sum(len(run.tokens[r]) for r in there)
            if total != seen:
                seen, quiet_since = total, time.monotonic()
            await asyncio.sleep(0.02)
        run.at_kill = {r: len(run.tokens[r]) for r in there if not run.finishes[r]}
        t0 = time.monotonic()
        kill(handle)
        while replica.healthy:
            await asyncio.sleep(0.005)
        run.detect_s = time.monotonic() - t0
        if after_detect is not None:
            after_detect(handle)
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        after: list[int] = []
        async for d in llm.generate(prompt(n), SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
                                    request_id="after"):
            after.extend(d.output_token_ids)
            if d.finished:
                run.after = d
                run.tokens["after"] = after
        run.stats = await llm.call_utility("stats")
        assert llm.is_alive()
    return run


def check_kill_run(run: KillRun, n: int, expected: Callable[[str, int], list[int]]) -> None:
    """Every request ended exactly once; the killed replica's requests that failed had
    tokens and name the replica, the others (no token at the kill: re-routed to the
    survivor) were served whole.

    A stream is classed by how it ended, not by the tokens counted at the kill: a busy
    front end can read a stopped engine's last outputs after the quiet period, so a
    request with tokens at the kill may still finish whole, and a failed request's
    count is every token its stream delivered."""
    assert len(run.finals) == n and set(run.finishes.values()) == {1}
    assert set(run.finals) == {f"q{i}" for i in range(n)}
    lengths = {f"q{i}": max_tokens(i) for i in range(n)}
    failed = [r for r in run.at_kill if run.finals[r].finish_reason == "error"]
    rerouted = [r for r, k in run.at_kill.items() if k == 0 and r not in failed]
    assert rerouted and failed, run.at_kill  # the kill landed mid-run
    for rid, final in run.finals.items():
        want = expected(rid, lengths[rid])
        if rid in failed:
            k = len(run.tokens[rid])
            assert k >= run.at_kill[rid] and k > 0, (rid, k, run.at_kill[rid])
            m = DEATH.fullmatch(final.error or "")
            assert m and int(m[1]) == KILLED and int(m[2]) == k, final.error
            assert run.tokens[rid] == want[:k]
        else:  # elsewhere all along, re-routed before its first token, or ended before the kill
            assert final.finish_reason == "length", (rid, final)
            assert run.tokens[rid] == want, rid
            assert final.metrics is not None and final.metrics.num_output_tokens == len(want)
    router = run.stats["router"]
    assert router["num_rerouted"] == len(rerouted)
    assert router["num_failed_by_death"] == len(failed)
    assert [r["healthy"] for r in router["replicas"]] == [True, False]
    assert all(r["num_outstanding"] == 0 for r in router["replicas"])
    assert router["replicas"][0]["num_cached_blocks"] > 0  # its KV events arrived
    assert router["num_lost_load_reports"] == 0
    per = run.stats["replicas"]
    assert per[0]["healthy"] and not per[KILLED]["healthy"] and "error" in per[KILLED]
    assert run.after is not None and run.after.finish_reason == "length"
    assert run.tokens["after"] == expected("after", 4)


def paged_config(backend: str, **replicas: Any) -> Config:
    """Two replicas of the built-in tiny-llama on the paged runner (CPU, one thread)."""
    return config_from_dict({
        "replicas": {"count": 2, "backend": backend, **replicas},
        "runner": {"kind": "paged", "num_threads": 1},
        "cache": {"num_blocks": 256},
        "scheduler": {"max_num_seqs": 16},
    })


def paged_reference(n: int) -> Callable[[str, int], list[int]]:
    """``expected(request id, k)`` for :func:`kill_mid_run`'s requests on the paged
    runner: the greedy tokens one engine gives them (it also builds the model into the
    cache before two replicas would race to)."""
    from schedkit.llm import LLM

    cfg = paged_config("local").model_copy(update={"replicas": config_from_dict({}).replicas})
    sps = [SamplingParams(max_tokens=max_tokens(i), ignore_eos=True, temperature=0.0) for i in range(n)]
    with LLM(cfg) as llm:
        outs = llm.generate([prompt(i) for i in range(n + 1)],
                            [*sps, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)],
                            use_tqdm=False)
    ref = {f"q{i}": o.output_token_ids for i, o in enumerate(outs[:n])} | {"after": outs[n].output_token_ids}
    return lambda rid, k: ref[rid][:k]


def sigstop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
