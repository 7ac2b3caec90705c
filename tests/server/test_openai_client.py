"""The official ``openai`` client, sync and async, streaming and not, against a live server."""

from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai")

from tests.server.conftest import SPECIALS  # noqa: E402


def words(ids):
    """The text the word tokenizer gives for output ids (specials skipped)."""
    return "".join(f" w{i}" for i in ids if i >= len(SPECIALS))


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["word-model"]


def test_completion_text_and_usage(client):
    r = client.completions.create(model="word-model", prompt="w7 w8 w9", max_tokens=6,
                                  extra_body={"return_token_ids": True})
    (choice,) = r.choices
    assert choice.finish_reason == "length"
    ids = choice.model_extra["token_ids"]
    assert len(ids) == 6 and choice.text == words(ids)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 6, 9)
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_token_id_prompts_in_a_batch_with_n(client):
    r = client.completions.create(model="word-model", prompt=[[7, 8], [9, 10, 11]], max_tokens=3, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12


def test_stream_matches_the_whole_answer(client):
    """The same seed gives the fake runner the same tokens: streamed deltas join to the
    non-streamed text, and the usage chunk comes last; X-Request-Id is the answer's id."""
    whole = client.completions.create(model="word-model", prompt="w20 w21", max_tokens=8, seed=5,
                                      extra_headers={"X-Request-Id": "same-1"})
    chunks = list(client.completions.create(model="word-model", prompt="w20 w21", max_tokens=8,
                                            stream=True, stream_options={"include_usage": True},
                                            seed=5, extra_headers={"X-Request-Id": "same-1"}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.id == "same-1" for c in chunks)


def test_stop_string_ends_the_text_and_the_request(client):
    full = client.completions.create(model="word-model", prompt="w30", max_tokens=10, seed=7,
                                     extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    ids = full.model_extra["token_ids"]
    k = next(k for k in range(3, 10) if ids[k] >= len(SPECIALS) and ids[k] not in ids[:k])
    stop = f"w{ids[k]}"
    for stream in (False, True):
        kw = {"model": "word-model", "prompt": "w30", "max_tokens": 10, "stop": [stop], "seed": 7,
              "extra_body": {"ignore_eos": True}}
        if stream:
            parts = list(client.completions.create(stream=True, **kw))
            text = "".join(p.choices[0].text for p in parts)
            finish = parts[-1].choices[0].finish_reason
        else:
            c = client.completions.create(**kw).choices[0]
            text, finish = c.text, c.finish_reason
        assert finish == "stop"
        assert text == words(ids[:k]) + " ", (stream, text)


def test_chat_completion_uses_the_chat_template(client):
    r = client.chat.completions.create(model="word-model", max_tokens=4,
                                       messages=[{"role": "user", "content": "w40 w41"}])
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    # <|user|> w40 w41 <|assistant|>
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 4


def test_chat_stream(client):
    chunks = list(client.chat.completions.create(model="word-model", max_completion_tokens=5, stream=True,
                                                 messages=[{"role": "user", "content": "w42"}],
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() and chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_async_client_concurrent_streams(live):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)

        async def one(i):
            stream = await aclient.completions.create(model="word-model", prompt=f"w{50 + i}",
                                                      max_tokens=5, stream=True)
            return [c async for c in stream]

        async def chat(i):
            return await aclient.chat.completions.create(
                model="word-model", max_tokens=3, messages=[{"role": "user", "content": f"w{60 + i}"}])

        streams = await asyncio.gather(*(one(i) for i in range(16)))
        chats = await asyncio.gather(*(chat(i) for i in range(8)))
        await aclient.close()
        return streams, chats

    streams, chats = asyncio.run(main())
    for chunks in streams:
        assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage.completion_tokens == 3 for c in chats)


def test_errors_arrive_as_the_clients_typed_errors(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="word-model", prompt="w7", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        client.completions.create(model="no-such-model", prompt="w7")
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="word-model", prompt="w7", logprobs=2)
    assert client.completions.create(model="word-model", prompt="w7", max_tokens=1).choices


def test_tokenize_detokenize_and_health(live):
    import httpx

    with httpx.Client(base_url=live.url, timeout=10) as h:
        r = h.post("/tokenize", json={"prompt": "w7 w8 w9"}).json()
        assert r == {"count": 3, "max_model_len": 512, "tokens": [7, 8, 9]}
        chat = h.post("/tokenize", json={"messages": [{"role": "user", "content": "w7"}]}).json()
        assert chat["tokens"] == [3, 7, 4]  # <|user|> w7 <|assistant|>
        assert h.post("/detokenize", json={"tokens": [7, 8, 9]}).json() == {"prompt": "w7 w8 w9"}
        bad = h.post("/detokenize", json={"tokens": [7, 9999]})
        assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
        assert h.post("/tokenize", json={}).status_code == 400
        assert h.get("/health").status_code == 200


def test_logprobs_zero_is_refused_too(client):
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="word-model", prompt="w7", logprobs=0)


def test_cached_tokens_are_reported_when_a_stop_string_ends_the_choice(client):
    """A stop string aborts the engine request before its final output: the cached count
    still comes from the deltas."""
    prompt = " ".join(f"w{100 + i}" for i in range(40))  # 2 full blocks of 16, then 8
    first = client.completions.create(model="word-model", prompt=prompt, max_tokens=6, seed=11,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = first.choices[0].model_extra["token_ids"]
    k = next(k for k in range(1, 6) if ids[k] >= len(SPECIALS) and ids[k] not in ids[:k])
    again = client.completions.create(model="word-model", prompt=prompt, max_tokens=6, seed=11,
                                      stop=[f"w{ids[k]}"], extra_body={"ignore_eos": True})
    assert again.choices[0].finish_reason == "stop"
    assert again.usage.prompt_tokens_details.cached_tokens == 32


def test_unknown_routes_and_methods_get_openai_error_objects(live):
    import httpx

    with httpx.Client(base_url=live.url, timeout=10) as h:
        r = h.get("/v1/nothing-here")
        assert r.status_code == 404 and r.json()["error"]["code"] == 404
        r = h.get("/v1/completions")
        assert r.status_code == 405 and "GET" in r.json()["error"]["message"]
        r = h.post("/v1/completions", content=b"[" * 100_000)
        assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
        r = h.post("/v1/completions", json={"prompt": "w7", "stop": [f"w{i}" for i in range(33)]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
        assert h.post("/v1/completions", json={"prompt": "w7", "max_tokens": 1}).status_code == 200


@pytest.mark.slow
def test_idle_keep_alive_outlives_the_clients_pool_expiry(live):
    """httpx (so the openai client) drops a pooled connection after 5 s idle; the server
    keeps it longer (server.keep_alive_s, 10 s), so a client reusing its connection at 5 s
    never races the server's close (a ReadError with no answer)."""
    import socket
    import time

    import httpx

    url = httpx.URL(live.url)
    body = b'{"prompt": "w7", "max_tokens": 1}'
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    def answer(sock) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"the server closed the connection: {data!r}"
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(rest) < length:
            rest += sock.recv(65536)
        return head

    with socket.create_connection((url.host, url.port), timeout=10) as sock:
        for pause in (0.0, 6.0):
            time.sleep(pause)
            sock.sendall(request)
            assert answer(sock).startswith(b"HTTP/1.1 200"), pause
