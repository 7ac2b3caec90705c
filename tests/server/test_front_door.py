"""The front door over raw sockets: what one client may send, and how slowly, before
authentication, and what the server answers when it sends more.

A request line or headers over their limits get 414 / 431 with OpenAI's error object
naming the ``server.*`` key, a head or body that takes too long gets 408, and the
connection is closed; the server reads no more of an oversized head than the limits
(its memory does not grow by what the client sends), and serves the next client.
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import LiveServer, metric, server_config, start_server, stop_server

httpx = pytest.importorskip("httpx")

KEY = "sk-door"
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
ATTACK_BYTES = 48 * 1024 * 1024


@pytest.fixture(scope="module")
def door(tmp_path_factory, word_tokenizer) -> Iterator[LiveServer]:
    """A server with an API key (the limits apply before it) and short time limits."""
    cfg = server_config(word_tokenizer, server={"header_timeout_s": HEADER_TIMEOUT_S,
                                                "body_timeout_s": BODY_TIMEOUT_S})
    s = start_server(tmp_path_factory.mktemp("door"), cfg, "--api-key", KEY)
    yield s
    stop_server(s)


def _connect(s: LiveServer, timeout: float = 10.0) -> socket.socket:
    u = httpx.URL(s.url)
    return socket.create_connection((u.host, u.port), timeout=timeout)


def _read_response(sock: socket.socket, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes, float]:
    """Status, headers, body, and the seconds until the server closed the connection."""
    t0 = time.monotonic()
    sock.settimeout(timeout)
    raw = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        except TimeoutError:
            raise AssertionError(f"no answer within {timeout} s; so far {raw[:300]!r}") from None
        if not chunk:
            break
        raw += chunk
    sock.close()
    assert raw, "the server closed the connection without an answer"
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body, time.monotonic() - t0


def _assert_refused(status: int, headers: dict[str, str], body: bytes, want: int, *says: str) -> None:
    assert status == want, (status, body)
    assert headers.get("connection") == "close"
    err = json.loads(body)["error"]
    assert err["code"] == want and err["type"].endswith("Error"), err
    for s in says:
        assert s in err["message"], err


def _send_refused(s: LiveServer, request: bytes) -> tuple[int, dict[str, str], bytes, float]:
    sock = _connect(s)
    sock.sendall(request)
    return _read_response(sock)


def _assert_serves(s: LiveServer) -> None:
    with s.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        r = c.post("/v1/completions", json={"prompt": "w7", "max_tokens": 1})
        assert r.status_code == 200, r.text


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# -- sizes -------------------------------------------------------------------------------------
def test_a_request_target_over_the_limit_is_a_414(door):
    def refused() -> float:
        return metric(door.stats(), "schedkit:http_request_errors_total", status="414")

    before = refused()
    status, headers, body, _ = _send_refused(door, b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    _assert_refused(status, headers, body, 414, "8192", "server.max_request_line_bytes")
    assert refused() == before + 1  # counted, though the app never saw it
    _assert_serves(door)


@pytest.mark.parametrize(("headers", "says"), [
    ([f"X-H{i}: 1" for i in range(101)], ("100 headers", "server.max_headers")),
    ([f"X-Big: {'a' * 17000}"], ("'x-big'", "17005 bytes", "16384", "server.max_header_line_bytes")),
    ([f"X-H{i}: {'a' * 15000}" for i in range(5)], ("65536", "server.max_header_bytes")),
], ids=["count", "one-header", "all-headers"])
def test_headers_over_a_limit_are_a_431(door, headers, says):
    request = "\r\n".join(["POST /v1/completions HTTP/1.1", "Host: x", *headers, "", ""]).encode()
    status, hdrs, body, _ = _send_refused(door, request)
    _assert_refused(status, hdrs, body, 431, *says)
    _assert_serves(door)


def _attack(s: LiveServer, request: bytes) -> tuple[int, dict[str, str], bytes, float]:
    """Send all of ``request`` whatever the server answers meanwhile (as an attacker
    does), then read the answer."""
    sock = _connect(s)
    view = memoryview(request)
    try:
        while view:
            sent = sock.send(view[:1 << 20])
            view = view[sent:]
    except (BrokenPipeError, ConnectionResetError):
        pass  # cut off: what matters is what the server holds and answered
    readable, _, _ = select.select([sock], [], [], 10.0)
    assert readable, "no answer within 10 s"
    return _read_response(sock)


@pytest.mark.parametrize(("head", "status", "key"), [
    (b"GET /", 414, "server.max_request_line_bytes"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ", 431, "server.max_header_bytes"),
], ids=["request-line", "header"])
def test_a_48_mb_head_is_cut_off_at_the_limit(door, head, status, key):
    """The server stops reading a head at its limit: its memory does not grow by the
    48 MB the client sends, and the client still reads the refusal."""
    rss = _rss_bytes(door.proc.pid)
    got, headers, body, _ = _attack(door, head + b"a" * ATTACK_BYTES)
    grown = _rss_bytes(door.proc.pid) - rss
    assert grown < 16 * 1024 * 1024, f"the server grew by {grown / 2**20:.0f} MiB"
    _assert_refused(got, headers, body, status, key)
    _assert_serves(door)


# -- time --------------------------------------------------------------------------------------
def _trickle(sock: socket.socket, data: bytes, every_s: float, until_s: float) -> None:
    """Send ``data`` a byte at a time, one every ``every_s``, until the server answers
    (or closes) or ``until_s`` passes."""
    deadline = time.monotonic() + until_s
    for b in data:
        if time.monotonic() > deadline or select.select([sock], [], [], every_s)[0]:
            return
        try:
            sock.sendall(bytes([b]))
        except (BrokenPipeError, ConnectionResetError):
            return


def test_slow_headers_are_cut_off(door):
    """A head trickled a byte at a time (each byte in time for an idle timeout) gets 408
    once ``header_timeout_s`` has passed since its first byte."""
    sock = _connect(door)
    t0 = time.monotonic()
    _trickle(sock, b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 1000, 0.1, 15.0)
    status, headers, body, _ = _read_response(sock)
    took = time.monotonic() - t0
    _assert_refused(status, headers, body, 408, "server.header_timeout_s")
    assert HEADER_TIMEOUT_S * 0.9 <= took < HEADER_TIMEOUT_S + 5, took
    _assert_serves(door)


def test_a_connection_that_sends_nothing_is_closed(door):
    sock = _connect(door)
    t0 = time.monotonic()
    sock.settimeout(HEADER_TIMEOUT_S + 5)
    assert sock.recv(100) == b""  # closed, nothing said
    assert time.monotonic() - t0 >= HEADER_TIMEOUT_S * 0.9
    sock.close()


def test_a_slow_body_is_cut_off(door):
    """The body must arrive within ``body_timeout_s`` of its headers: a client trickling
    it gets 408 and its connection closed, and its request never reaches the engine."""
    sock = _connect(door)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n".encode())
    sock.sendall(head)
    t0 = time.monotonic()
    _trickle(sock, b'{"prompt": "w7", "max_tokens": 1, "user": "' + b"a" * 900, 0.1, 15.0)
    status, headers, body, _ = _read_response(sock)
    took = time.monotonic() - t0
    _assert_refused(status, headers, body, 408, f"{BODY_TIMEOUT_S:g} s", "server.body_timeout_s")
    assert BODY_TIMEOUT_S * 0.9 <= took < BODY_TIMEOUT_S + 5, took
    _assert_serves(door)


@pytest.mark.slow
def test_the_limits_are_configurable(tmp_path, word_tokenizer, serve):
    """A smaller ``max_request_line_bytes`` refuses what the default takes."""
    s = serve(server_config(word_tokenizer, server={"max_request_line_bytes": 512, "max_headers": 8}))
    status, headers, body, _ = _send_refused(s, b"GET /health?" + b"a" * 600 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    _assert_refused(status, headers, body, 414, "512", "server.max_request_line_bytes")
    request = "\r\n".join(["GET /health HTTP/1.1", *(f"X-{i}: 1" for i in range(9)), "", ""]).encode()
    status, headers, body, _ = _send_refused(s, request)
    _assert_refused(status, headers, body, 431, "8 headers", "server.max_headers")
    assert httpx.get(s.url + "/health?" + "a" * 400, timeout=10).status_code == 200


@pytest.mark.slow
def test_the_head_timer_spares_long_responses_and_idle_keep_alive(door):
    """``header_timeout_s`` times a head only: a stream longer than it runs to its end,
    and a keep-alive connection idle for longer than it serves its next request."""
    with door.client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        t0 = time.monotonic()
        body = {"prompt": "w7", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert time.monotonic() - t0 > HEADER_TIMEOUT_S
        assert lines[-1] == "data: [DONE]" and '"length"' in lines[-2]
    sock = _connect(door)
    for _ in range(2):
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while not answer.endswith(b"\r\n\r\n"):  # /health answers with headers only
            chunk = sock.recv(4096)
            assert chunk, f"closed after {answer!r}"
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer
        time.sleep(HEADER_TIMEOUT_S * 1.5)
    sock.close()
