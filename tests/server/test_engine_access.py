"""A server with an API key: another local process that finds its engine's socket (the
address is on the engine's command line) cannot use it to go around the key. Its
``shutdown`` is refused at the handshake, counted in ``/metrics``, and the server keeps
answering."""

from __future__ import annotations

import time

import pytest
import zmq

from schedkit.engine.messages import UtilityCall, client_encoder
from tests.server.conftest import metric, server_config
from tests.server.test_serve_replicas import complete, engine_pids

pytestmark = pytest.mark.slow  # servers and engine processes under attack


def engine_input_addr(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    return argv[argv.index("--input") + 1]


def test_a_local_process_cannot_go_around_the_api_key_through_the_engine_socket(serve, word_tokenizer):
    s = serve(server_config(word_tokenizer, server={"api_key": "sesame"}))
    [pid] = engine_pids(s.proc.pid)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(engine_input_addr(pid))
        sock.send(client_encoder.encode(UtilityCall(0, "shutdown", [])))
        with s.client(headers={"Authorization": "Bearer sesame"}) as c:
            deadline = time.monotonic() + 20
            while metric(s.stats(), "schedkit:engine_refused_connections_total") < 1:
                assert time.monotonic() < deadline, "the refusal was not counted"
                time.sleep(0.1)
            assert complete(c)["usage"]["completion_tokens"] == 4
        assert metric(s.stats(), "schedkit:engine_healthy") == 1
    finally:
        ctx.destroy(0)
