"""Load through HTTP: thousands of streams at a concurrency of 128, one client in ten
leaving mid-stream, on the wall-clock fake runner with a KV cache small enough to preempt.

Every request must end exactly once (a completed stream has one chunk with a
finish_reason, then usage, then ``[DONE]``), every disconnect must abort its engine
request (afterwards nothing runs or waits and no KV block is held), and ``/metrics``
must add up to what the clients saw.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.server.conftest import EOS, SPECIALS, VOCAB, metric, server_config

pytestmark = pytest.mark.slow  # thousands of HTTP streams

NUM_REQUESTS = 2000
CONCURRENCY = 128
DISCONNECT_EVERY = 10  # one client in ten leaves mid-stream
DISCONNECT_AFTER_CHUNKS = 3
MAX_MODEL_LEN = 2048
LONG_MAX_TOKENS = 1800
"""What a leaving client asks for: far more than the engine makes before the client
(which reads 3 chunks) leaves, so its request ends as an abort, not by its length."""
MODEL = "word-model"


def words(ids):
    """The text the word tokenizer gives for output ids (specials skipped)."""
    return "".join(f" w{i}" for i in ids if i >= len(SPECIALS))


sample = metric
"""The sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""


@dataclass
class Client:
    """One client's request and what it saw."""

    index: int
    chat: bool
    prompt: str
    prompt_len: int
    max_tokens: int
    leaves: bool
    status: int = 0
    chunks: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reasons: list[str | None] = field(default_factory=list)
    usage: dict | None = None
    done: bool = False
    after_done: list[str] = field(default_factory=list)
    error: str | None = None


def plan(rng: random.Random) -> list[Client]:
    out = []
    for i in range(NUM_REQUESTS):
        chat = i % 4 == 1
        n_words = rng.randint(3, 40)
        prompt = " ".join(f"w{rng.randrange(len(SPECIALS), VOCAB)}" for _ in range(n_words))
        prompt_len = n_words + 2 if chat else n_words  # the template adds <|user|>, <|assistant|>
        leaves = i % DISCONNECT_EVERY == 3
        max_tokens = LONG_MAX_TOKENS if leaves else rng.randint(4, 32)
        out.append(Client(i, chat, prompt, prompt_len, max_tokens, leaves))
    return out


async def one(http: httpx.AsyncClient, c: Client) -> None:
    body: dict = {"model": MODEL, "max_tokens": c.max_tokens, "stream": True,
                  "return_token_ids": True, "stream_options": {"include_usage": True}}
    if c.chat:
        url = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": c.prompt}]
    else:
        url = "/v1/completions"
        body["prompt"] = c.prompt
    async with http.stream("POST", url, json=body) as r:
        c.status = r.status_code
        if r.status_code != 200:
            c.error = (await r.aread()).decode(errors="replace")
            return
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            if c.done:
                c.after_done.append(data)
                continue
            if data == "[DONE]":
                c.done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                c.error = data
                continue
            c.chunks += 1
            if not chunk["choices"]:
                c.usage = chunk["usage"]
                continue
            (choice,) = chunk["choices"]
            c.token_ids += choice["token_ids"]
            c.text += (choice["delta"].get("content") or "") if c.chat else choice["text"]
            c.finish_reasons.append(choice["finish_reason"])
            if c.leaves and c.chunks >= DISCONNECT_AFTER_CHUNKS:
                return  # leaving the block closes the unfinished response: a disconnect


async def drive(url: str, clients: list[Client]) -> float:
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    sem = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60.0) as http:
        async def bounded(c: Client) -> None:
            async with sem:
                try:
                    await one(http, c)
                except httpx.HTTPError as e:  # reported with the server's log below
                    c.error = f"{type(e).__name__}: {e!r}"

        t0 = time.perf_counter()
        await asyncio.gather(*(bounded(c) for c in clients))
        return time.perf_counter() - t0


def settled(live, total: int, deadline_s: float = 20.0) -> dict[str, float]:
    """/metrics once every request has ended and the engine holds nothing (or at the
    deadline, for the assertions to say what is left)."""
    deadline = time.monotonic() + deadline_s
    while True:
        st = live.stats()
        idle = all(sample(st, f"schedkit:{name}") == 0 for name in (
            "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))
        if (idle and sample(st, "schedkit:request_success_total") >= total) or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


def test_thousands_of_streams_with_disconnects(serve, word_tokenizer):
    cfg = server_config(
        word_tokenizer,
        # The runner never draws its eos_token_id, so only max_tokens ends a stream.
        runner={"step_time_ms": 2, "eos_token_id": EOS},
        # 128 running requests of up to ~70 tokens want up to 5 blocks each: 128 preempt.
        cache={"num_blocks": 128},
        scheduler={"max_num_seqs": CONCURRENCY, "max_num_batched_tokens": 2048,
                   "max_model_len": MAX_MODEL_LEN},
        server={"max_pending_requests": 4 * CONCURRENCY})
    live = serve(cfg)
    clients = plan(random.Random(1234))
    elapsed = asyncio.run(drive(live.url, clients))
    st = settled(live, NUM_REQUESTS)
    print(f"\n{NUM_REQUESTS} streams at concurrency {CONCURRENCY} in {elapsed:.1f} s: "
          f"{NUM_REQUESTS / elapsed:.0f} requests/s; "
          f"{sample(st, 'schedkit:num_preemptions_total'):.0f} preemptions")

    bad = [(c.index, c.status, c.error) for c in clients if c.status != 200 or c.error]
    assert not bad, (len(bad), bad[:5], live.log()[-4000:])
    completed = [c for c in clients if not c.leaves]
    left = [c for c in clients if c.leaves]
    for c in completed:
        # Exactly one end: one finish_reason, on the last choice chunk, then usage, [DONE].
        assert [f for f in c.finish_reasons if f is not None] == ["length"], (c.index, c.finish_reasons)
        assert c.finish_reasons[-1] == "length", (c.index, c.finish_reasons)
        assert c.done and not c.after_done, (c.index, c.done, c.after_done)
        assert len(c.token_ids) == c.max_tokens, (c.index, len(c.token_ids), c.max_tokens)
        assert EOS not in c.token_ids
        assert c.text == words(c.token_ids), c.index
        assert c.usage is not None
        assert c.usage["prompt_tokens"] == c.prompt_len, (c.index, c.usage, c.prompt_len)
        assert c.usage["completion_tokens"] == c.max_tokens, (c.index, c.usage)
    for c in left:
        assert c.chunks == DISCONNECT_AFTER_CHUNKS and not c.done, c.index
        assert all(f is None for f in c.finish_reasons), (c.index, c.finish_reasons)
        assert len(c.token_ids) < c.max_tokens

    # Every disconnect was aborted: nothing is left in the engine, no KV block leaked.
    assert sample(st, "schedkit:num_requests_running") == 0
    assert sample(st, "schedkit:num_requests_waiting") == 0
    assert sample(st, "schedkit:kv_cache_usage_perc") == 0
    assert sample(st, "schedkit:engine_healthy") == 1

    # Every request ended exactly once, the way its client saw it. A leaving client's
    # request could in principle end by its length before the server saw the client go
    # (the engine does not wait for slow readers); with 1800 tokens asked and 3 chunks
    # read it practically never does, and it may only be rare.
    assert sample(st, "schedkit:request_success_total") == NUM_REQUESTS
    lengths = sample(st, "schedkit:request_success_total", finished_reason="length")
    aborts = sample(st, "schedkit:request_success_total", finished_reason="abort")
    raced = lengths - len(completed)
    assert 0 <= raced <= len(left) // 50, (lengths, len(completed))
    assert aborts == len(left) - raced, (aborts, len(left), raced)
    assert sample(st, "schedkit:prompt_tokens_total") == sum(c.prompt_len for c in clients)
    seen = sum(len(c.token_ids) for c in completed)
    generated = sample(st, "schedkit:generation_tokens_total")
    read = [len(c.token_ids) for c in left]
    low = seen + sum(read) + raced * (LONG_MAX_TOKENS - max(read))  # a raced one made all its tokens
    high = seen + sum(c.max_tokens - 1 for c in left) + raced  # an aborted request stopped short
    assert low <= generated <= high, (low, generated, high)
    assert sample(st, "schedkit:tenant_generation_tokens_total") == generated
    assert sample(st, "schedkit:tenant_prompt_tokens_total") == sum(c.prompt_len for c in clients)
    # Every request got a first token (a leaving client read some) and ended once.
    assert sample(st, "schedkit:time_to_first_token_seconds_count") == NUM_REQUESTS
    assert sample(st, "schedkit:e2e_request_latency_seconds_count") == NUM_REQUESTS
    assert sample(st, "schedkit:request_queue_time_seconds_count") <= NUM_REQUESTS
    # At most one inter-token gap per token after the first.
    assert sample(st, "schedkit:inter_token_latency_seconds_count") <= generated - NUM_REQUESTS
    errors = {k: v for k, v in st.items() if k.startswith("schedkit:http_request_errors_total") and v}
    assert not errors, errors
