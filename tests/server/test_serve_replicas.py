"""``schedkit serve`` with ``replicas.count: 2``: requests go through the router, /metrics
reports each replica and the router, and a replica that dies is taken out of rotation
while the server keeps answering."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.server.conftest import metric, server_config

pytestmark = pytest.mark.slow  # replicated servers

PROMPT = list(range(10, 43))  # two full blocks of 16 and one token


def engine_pids(server_pid: int) -> list[int]:
    """The engine-core processes the server started (its children running the engine)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == server_pid and b"schedkit.engine.process" in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def complete(client, prompt=PROMPT, **extra) -> dict:
    r = client.post("/v1/completions", json={"model": "word-model", "prompt": prompt,
                                             "max_tokens": 4, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_requests_are_routed_and_metrics_report_each_replica(serve, word_tokenizer):
    s = serve(server_config(word_tokenizer, replicas={"count": 2}, router={"policy": "round-robin"}))
    with s.client() as c:
        for i in range(10):
            out = complete(c, prompt=[i + 10] * 20)
            assert out["usage"]["completion_tokens"] == 4
    st = s.stats()
    assert metric(st, "schedkit:router_requests_routed_total", replica="0") == 5
    assert metric(st, "schedkit:router_requests_routed_total", replica="1") == 5
    assert metric(st, "schedkit:router_requests_outstanding", replica="0") == 0
    assert metric(st, "schedkit:replica_healthy") == 2
    assert metric(st, "schedkit:router_info", policy="round-robin") == 1
    assert metric(st, "schedkit:request_success_total") == 10
    # The cluster totals are the replicas' sums.
    steps = [metric(st, "schedkit:replica_engine_steps_total", replica=r) for r in ("0", "1")]
    assert all(n > 0 for n in steps)
    assert metric(st, "schedkit:engine_steps_total") == sum(steps)
    assert metric(st, "schedkit:router_hook_errors_total", plugin="round-robin",
                  hook="schedkit_router_pick") == 0


def test_prefix_affinity_over_http_follows_the_replica_that_cached_the_prompt(serve, word_tokenizer):
    s = serve(server_config(word_tokenizer, replicas={"count": 2}, router={"policy": "prefix-affinity"}))
    with s.client() as c:
        first = complete(c)
        assert (first["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
        # Wait for the first replica's KV events to reach the router.
        assert wait_for(lambda: sum(metric(s.stats(), "schedkit:router_cached_blocks", replica=r) > 0
                                    for r in ("0", "1")) == 1)
        st = s.stats()
        home = "0" if metric(st, "schedkit:router_cached_blocks", replica="0") else "1"
        for _ in range(4):
            out = complete(c)
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    st = s.stats()
    assert metric(st, "schedkit:router_requests_routed_total", replica=home) == 5


def test_session_id_keeps_a_conversation_on_one_replica(serve, word_tokenizer):
    s = serve(server_config(word_tokenizer, replicas={"count": 2}, router={"policy": "session-affinity"}))
    with s.client() as c:
        for i in range(6):
            complete(c, prompt=[i + 10] * 8, session_id="conversation-7")
        r = c.post("/v1/completions", json={"model": "word-model", "prompt": [1, 2], "session_id": 7})
        assert r.status_code == 400 and "session_id" in r.text
    st = s.stats()
    counts = sorted(metric(st, "schedkit:router_requests_routed_total", replica=r) for r in ("0", "1"))
    assert counts == [0, 6]


def test_a_dead_replica_leaves_rotation_and_the_server_keeps_serving(serve, word_tokenizer):
    s = serve(server_config(word_tokenizer, replicas={"count": 2}, router={"policy": "round-robin"}))
    pids = engine_pids(s.proc.pid)
    assert len(pids) == 2, pids
    with s.client() as c:
        complete(c)
        os.kill(pids[1], signal.SIGKILL)
        assert wait_for(lambda: metric(s.stats(), "schedkit:replica_healthy") == 1)
        for _ in range(6):
            complete(c)
        assert c.get("/health").status_code == 200
    st = s.stats()
    dead = [r for r in ("0", "1") if metric(st, "schedkit:replica_healthy", replica=r) == 0]
    assert len(dead) == 1
    alive = "1" if dead == ["0"] else "0"
    assert metric(st, "schedkit:router_requests_outstanding", replica=alive) == 0
    assert metric(st, "schedkit:engine_healthy") == 1
    assert metric(st, "schedkit:request_success_total") == 7


COMMON = {"runner": {"vocab_size": 320, "eos_token_id": 0}, "structured_outputs": {"backend": "xgrammar"},
          "scheduler": {"num_speculative_tokens": 2}}
"""The byte-level tokenizer's vocabulary, xgrammar and n-gram speculation."""
TEXT = '{"items": [1, 2, 3], "ok": true, "ratio": 0.5} yes no maybe 0123456789 abc def ' * 2
BODIES = [{"prompt": TEXT + str(i), "max_tokens": 40, "seed": i,
           **({"structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}} if i % 2 else {})} for i in range(6)]
"""Plain and regex-constrained requests, seeded (so the fake runner's tokens do not
depend on the request id)."""


@pytest.fixture
def bpe(tmp_path) -> Path:
    pytest.importorskip("xgrammar")
    pytest.importorskip("transformers")
    from schedkit.structured.testing import byte_level_tokenizer

    byte_level_tokenizer().save_pretrained(tmp_path / "bpe")
    return tmp_path / "bpe"


def answers(s, bodies=BODIES) -> list[str]:
    """Each body's text, asked whole and then streamed."""
    out = []
    with s.client() as c:
        for body in bodies:
            r = c.post("/v1/completions", json={"model": "word-model", **body})
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"][0]["text"])
            with c.stream("POST", "/v1/completions", json={"model": "word-model", **body, "stream": True}) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            out.append("".join(ch["choices"][0]["text"] for ch in chunks))
    return out


def test_disaggregated_server_answers_as_a_colocated_one(serve, bpe):
    """``replicas.roles`` behind ``schedkit serve``: regex-constrained and plain requests,
    whole and streamed, with n-gram speculation on, answer as one engine does, and
    /metrics counts the hand-offs and the queues per role."""
    want = answers(serve(server_config(bpe, **COMMON)))
    s = serve(server_config(bpe, **COMMON, replicas={"count": 2, "roles": {"prefill": 1, "decode": 1}},
                            router={"plugins": [{"name": "selective-pd", "settings": {"threshold": 0}}]}))
    got = answers(s)
    assert got == want
    assert all(re.fullmatch("[a-c]{3}-[0-9]{2}", t) for t in got[2::4])
    st = s.stats()
    assert metric(st, "schedkit:kv_transfer_handoffs_total") >= len(BODIES)  # a cached repeat may go whole
    assert metric(st, "schedkit:kv_transfer_blocks_total") > 0
    assert metric(st, "schedkit:kv_transfer_fallbacks_total") == 0
    assert metric(st, "schedkit:role_num_requests_waiting", role="decode") == 0
    assert metric(st, "schedkit:request_success_total") == 2 * len(BODIES)


def test_migrating_server_answers_as_one_engine(serve, bpe, install_plugin):
    """A router plugin moving requests at random steps behind ``schedkit serve``: whole and
    streamed answers, regex-constrained and plain, n-gram on, equal one engine's, and
    /metrics counts the moves and the KV they carried."""
    from tests.cluster.test_migration_replicas import RANDOM_MOVES

    install_plugin("random_moves", RANDOM_MOVES, {"random-moves": "random_moves:RandomMoves"})
    slow = {**COMMON, "runner": {**COMMON["runner"], "step_time_ms": 5}}
    want = answers(serve(server_config(bpe, **slow)))
    s = serve(server_config(bpe, **slow, replicas={"count": 2}, router={
        "policy": "round-robin", "migration_interval_s": 0.02,
        "plugins": [{"name": "random-moves", "settings": {"seed": 3, "share": 0.5}}]}))
    got = answers(s)
    assert got == want
    st = s.stats()
    moved = metric(st, "schedkit:router_migrations_total")
    assert moved >= 3
    assert metric(st, "schedkit:migration_kv_handoffs_total") == moved
    assert metric(st, "schedkit:migration_kv_blocks_total") > 0  # (the fake runner's blocks carry no bytes)
    assert metric(st, "schedkit:migration_kv_fallbacks_total") == 0
    assert metric(st, "schedkit:request_success_total") == 2 * len(BODIES)


def test_drain_endpoint_empties_a_replica_and_it_takes_no_new_request(serve, word_tokenizer):
    """``POST /v1/replicas/{index}/drain`` with the ``drain`` plugin: the replica's running
    streams move away and finish whole, the call answers 200 once it is empty, and new
    requests go to the other replica."""
    import concurrent.futures

    s = serve(server_config(word_tokenizer, runner={"step_time_ms": 10}, replicas={"count": 2}, router={
        "policy": "round-robin", "migration_interval_s": 0.02, "plugins": [{"name": "drain"}]}))

    def long_stream(i: int) -> list[int]:
        with s.client() as c, c.stream("POST", "/v1/completions", json={
                "model": "word-model", "prompt": [i + 10] * 20, "max_tokens": 300, "stream": True,
                "return_token_ids": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert chunks[-1]["usage"]["completion_tokens"] == 300
        return [t for ch in chunks for choice in ch["choices"] for t in choice.get("token_ids") or ()]

    with concurrent.futures.ThreadPoolExecutor(4) as pool, s.client() as c:
        streams = [pool.submit(long_stream, i) for i in range(4)]
        assert wait_for(lambda: metric(s.stats(), "schedkit:router_requests_outstanding", replica="0") == 2)
        r = c.post("/v1/replicas/0/drain", params={"timeout_s": 20})
        assert r.status_code == 200, r.text
        assert r.json() == {"replica": 0, "drained": True, "num_outstanding": 0, "healthy": True}
        assert [len(f.result()) for f in streams] == [300] * 4  # none lost or repeated
        routed = metric(s.stats(), "schedkit:router_requests_routed_total", replica="0")
        for i in range(4):
            complete(c, prompt=[i + 50] * 20)
    st = s.stats()
    assert metric(st, "schedkit:router_requests_routed_total", replica="0") == routed
    assert metric(st, "schedkit:router_migrations_total") >= 2
    assert metric(st, "schedkit:request_success_total") == 8


def test_drain_endpoint_refuses_what_it_cannot_do(serve, word_tokenizer):
    s = serve(server_config(word_tokenizer, replicas={"count": 2}))
    with s.client() as c:
        for path, status, words in (("/v1/replicas/2/drain", 404, "replicas 0 to 1"),
                                    ("/v1/replicas/-1/drain", 404, "no replica '-1'"),
                                    ("/v1/replicas/one/drain", 404, "no replica 'one'"),
                                    ("/v1/replicas/0/drain?timeout_s=-1", 400, "timeout_s"),
                                    ("/v1/replicas/0/drain?timeout_s=soon", 400, "timeout_s")):
            r = c.post(path)
            assert r.status_code == status and words in r.json()["error"]["message"], (path, r.text)
        # Nothing runs on replica 1: drained at once; it then takes no request.
        r = c.post("/v1/replicas/1/drain", params={"timeout_s": 0})
        assert r.status_code == 200 and r.json()["drained"] is True
        for i in range(3):
            complete(c, prompt=[i + 10] * 20)
    assert metric(s.stats(), "schedkit:router_requests_routed_total", replica="1") == 0
    one = serve(server_config(word_tokenizer))
    with one.client() as c:
        r = c.post("/v1/replicas/0/drain")
        assert r.status_code == 400 and "replicas.count 1" in r.text
