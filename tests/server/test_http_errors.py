"""The server's failure paths over raw HTTP: every bad field, the API key, the body and
pending limits, admission rejections, clients that hang up, a dead engine, SIGTERM.

Each bad request must get its status and OpenAI's error object naming the field or the
limit, and the server must serve a good request right after it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.server.conftest import LiveServer, metric, server_config, start_server

httpx = pytest.importorskip("httpx")

KEY = "sk-test-key"
MAX_MODEL_LEN = 64
MAX_N = 4
MAX_BODY = 2048
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD = {"prompt": "w7", "max_tokens": 1}
DRAIN_GRACE_S = 1.0


# -- helpers -------------------------------------------------------------------------------
def assert_error(r: Any, status: int, *, param: str | None = None, says: tuple[str, ...] = ()) -> dict:
    """``r`` is an OpenAI error object with ``status``; its param is ``param`` (or names a
    part of it: ``stop[0]``), and its message contains each of ``says``."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == status and isinstance(err["type"], str) and err["type"]
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] is not None and re.match(rf"{re.escape(param)}($|[.\[])", err["param"]), err
        # the message names the field, or the limit it broke (a config key)
        field = re.split(r"[.\[]", param)[0]
        assert field in err["message"] or any("." in x for x in says), err
    for s in says:
        assert s in err["message"], err
    return err


def assert_serves(client: httpx.Client, path: str = "/v1/completions", **headers: str) -> None:
    body = GOOD if path == "/v1/completions" else {"messages": [{"role": "user", "content": "w9"}],
                                                     "max_tokens": 1}
    r = client.post(path, json=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def wait_for(cond: Callable[[], Any], timeout: float, what: str, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


def engine_load(s: LiveServer) -> tuple[float, float, float]:
    st = s.stats()
    return (metric(st, "schedkit:num_requests_running"), metric(st, "schedkit:num_requests_waiting"),
            metric(st, "schedkit:kv_cache_usage_perc"))


def aborts(s: LiveServer) -> float:
    return metric(s.stats(), "schedkit:request_success_total", finished_reason="abort")


def wait_idle(s: LiveServer, timeout: float = 3.0) -> None:
    wait_for(lambda: engine_load(s) == (0, 0, 0), timeout, "the engine to be idle with an empty KV cache")


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid``, from /proc (psutil may be missing)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return out


def engine_pid(s: LiveServer) -> int:
    for pid in child_pids(s.proc.pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if b"schedkit.engine.process" in cmd:
            return pid
    raise AssertionError(f"no engine process among the children of {s.proc.pid}")


class Raw:
    """One HTTP/1.1 request on a raw socket, read as far as wanted; ``close`` hangs up."""

    def __init__(self, url: str, path: str, body: Any, headers: dict[str, str] | None = None,
                 timeout: float = 10.0) -> None:
        u = httpx.URL(url)
        self.sock = socket.create_connection((u.host, u.port), timeout=timeout)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = [f"POST {path} HTTP/1.1", f"Host: {u.host}:{u.port}", "Content-Type: application/json",
                f"Content-Length: {len(data)}", "Connection: close",
                *(f"{k}: {v}" for k, v in (headers or {}).items())]
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        self.raw = b""
        self.eof = False

    def _recv(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out reading the response; so far: {self.raw[-2000:]!r}")
        self.sock.settimeout(left)
        try:
            chunk = self.sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        self.eof = not chunk
        self.raw += chunk

    def read_until(self, marker: bytes, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while marker not in self.raw:
            if self.eof:
                raise AssertionError(f"the response ended before {marker!r}: {self.raw!r}")
            self._recv(deadline)

    def read_all(self, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
        """Status, headers (lower-case names) and the de-chunked body, at EOF."""
        deadline = time.monotonic() + timeout
        while not self.eof:
            self._recv(deadline)
        self.close()
        head, _, body = self.raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        if headers.get("transfer-encoding") == "chunked":
            body = _dechunk(body)
        return status, headers, body

    def events(self, timeout: float = 10.0) -> tuple[int, list[Any]]:
        """Status and the ``data:`` payloads (JSON decoded; ``"[DONE]"`` as is)."""
        status, _, body = self.read_all(timeout)
        out: list[Any] = []
        for line in body.decode().splitlines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
        return status, out

    def close(self) -> None:
        self.sock.close()


def _dechunk(body: bytes) -> bytes:
    out = b""
    while body:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += body[:size]
        body = body[size + 2:]
    return out


def finish_reasons(events: list[Any]) -> list[str]:
    return [c["finish_reason"] for e in events if isinstance(e, dict) and "choices" in e
            for c in e["choices"] if c.get("finish_reason")]


def _configs(tok: Path) -> dict[str, tuple[dict[str, Any], tuple[str, ...], dict[str, str] | None]]:
    """The servers this module needs: ``name -> (config, CLI args, environment)``."""
    return {
        # fast steps, an API key on the command line, small limits, the edf policy with a
        # generous default SLO (only a request's own tiny ttft_slo_s gets it rejected)
        "api": (server_config(tok, scheduler={"policy": "edf", "max_model_len": MAX_MODEL_LEN},
                              plugins=[{"name": "edf", "settings": {"ttft_slo_s": 600.0, "on_miss": "reject"}}],
                              server={"max_body_bytes": MAX_BODY, "max_n": MAX_N}), ("--api-key", KEY), None),
        "env-key": (server_config(tok), (), {"SCHEDKIT_API_KEY": "env-key"}),
        "no-tokenizer": (server_config(None), (), None),
        # 50 ms wall-clock steps, one running request at a time, two pending at most
        "slow": (server_config(tok, runner={"step_time_ms": 50}, scheduler={"max_num_seqs": 1},
                               server={"max_pending_requests": 2}), (), None),
        # one each for the tests that end their server
        "doomed": (server_config(tok, runner={"step_time_ms": 20}), (), None),
        "fatal": (server_config(tok, runner={"step_time_ms": 20}, server={"exit_on_engine_death": True}),
                  (), None),
        "drained": (server_config(tok, runner={"step_time_ms": 20}, server={"drain_grace_s": DRAIN_GRACE_S}),
                    (), None),
    }


@pytest.fixture(scope="module")
def servers(tmp_path_factory, word_tokenizer) -> Iterator[dict[str, LiveServer]]:
    """Every server of the module, started at once (each takes seconds to boot)."""
    specs = _configs(word_tokenizer)
    dirs = {name: tmp_path_factory.mktemp(name) for name in specs}
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {name: pool.submit(start_server, dirs[name], cfg, *args, env=env)
                   for name, (cfg, args, env) in specs.items()}
    started, failed = {}, None
    for name, f in futures.items():
        try:
            started[name] = f.result()
        except Exception as e:  # noqa: PERF203
            failed = failed or e
    try:
        if failed is not None:
            raise failed
        yield started
    finally:
        for srv in started.values():
            if srv.proc.poll() is None:
                srv.proc.send_signal(signal.SIGTERM)
        for srv in started.values():
            try:
                srv.proc.wait(15)
            except subprocess.TimeoutExpired:
                srv.proc.kill()
                srv.proc.wait()


@pytest.fixture(scope="module")
def api(servers) -> LiveServer:
    return servers["api"]


@pytest.fixture(scope="module")
def slow(servers) -> LiveServer:
    return servers["slow"]


@pytest.fixture
def client(api) -> Iterator[httpx.Client]:
    with api.client(headers=AUTH) as c:
        yield c


# -- 1. every bad field is a 400 naming it ---------------------------------------------------
def _c(**kw: Any) -> dict[str, Any]:
    return {"prompt": "w7", "max_tokens": 2, **kw}


def _m(**kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "w7"}], "max_tokens": 2, **kw}


COMPLETION_BAD: list[tuple[str, Any, int, str | None, tuple[str, ...]]] = [
    # (id, body (dict, or bytes sent as is), status, param, message parts)
    ("max_tokens-str", _c(max_tokens="5"), 400, "max_tokens", ()),
    ("max_tokens-bool", _c(max_tokens=True), 400, "max_tokens", ()),
    ("max_tokens-float", _c(max_tokens=2.0), 400, "max_tokens", ()),
    ("max_tokens-neg", _c(max_tokens=-1), 400, "max_tokens", ()),
    ("max_tokens-zero", _c(max_tokens=0), 400, "max_tokens", ()),
    ("temperature-neg", _c(temperature=-1), 400, "temperature", ()),
    ("temperature-str", _c(temperature="0.5"), 400, "temperature", ()),
    ("temperature-nan", b'{"prompt": "w7", "temperature": NaN}', 400, "temperature", ()),
    ("temperature-inf", b'{"prompt": "w7", "temperature": 1e999}', 400, "temperature", ()),
    ("top_p-zero", _c(top_p=0), 400, "top_p", ()),
    ("top_p-two", _c(top_p=2), 400, "top_p", ()),
    ("top_k-minus-two", _c(top_k=-2), 400, "top_k", ()),
    ("top_k-float", _c(top_k=1.5), 400, "top_k", ()),
    ("n-zero", _c(n=0), 400, "n", ()),
    ("n-over-max_n", _c(n=MAX_N + 1), 400, "n", (str(MAX_N), "server.max_n")),
    ("n-bool", _c(n=True), 400, "n", ()),
    ("seed-str", _c(seed="1"), 400, "seed", ()),
    ("stream-str", _c(stream="yes"), 400, "stream", ()),
    ("stream_options-bad", _c(stream=True, stream_options={"include_usage": 1}), 400,
     "stream_options.include_usage", ()),
    ("stream_options-unknown", _c(stream=True, stream_options={"usage": True}), 400,
     "stream_options.usage", ()),
    ("stop-int", _c(stop=5), 400, "stop", ()),
    ("stop-list-int", _c(stop=["w9", 1]), 400, "stop", ()),
    ("stop_token_ids-neg", _c(stop_token_ids=[-1]), 400, "stop_token_ids", ()),
    ("stop_token_ids-str", _c(stop_token_ids=["2"]), 400, "stop_token_ids", ()),
    ("min_tokens-neg", _c(min_tokens=-1), 400, "min_tokens", ()),
    ("min_tokens-over-max_tokens", _c(min_tokens=5, max_tokens=2), 400, "min_tokens", ()),
    ("ignore_eos-int", _c(ignore_eos=1), 400, "ignore_eos", ()),
    ("user-int", _c(user=7), 400, "user", ()),
    ("user-too-long", _c(user="u" * 300), 400, "user", ("at most 256 characters",)),
    ("user-nul", _c(user="a\u0000b"), 400, "user", ("must not contain control characters",)),
    ("user-newline", _c(user="a\nb"), 400, "user", ("must not contain control characters",)),
    ("session_id-empty", _c(session_id=""), 400, "session_id", ("at least 1 character",)),
    ("session_id-escape", _c(session_id="s\u001b[31m"), 400, "session_id", ("control characters",)),
    ("priority-float", _c(priority=1.5), 400, "priority", ()),
    ("ttft_slo_s-zero", _c(ttft_slo_s=0), 400, "ttft_slo_s", ()),
    ("unknown-field", _c(foo=1), 400, "foo", ("unknown field",)),
    ("misspelt-field", _c(max_token=5), 400, "max_token", ("unknown field",)),
    ("frequency_penalty", _c(frequency_penalty=0.5), 400, "frequency_penalty", ("not supported",)),
    ("presence_penalty", _c(presence_penalty=-1.0), 400, "presence_penalty", ("not supported",)),
    ("repetition_penalty", _c(repetition_penalty=1.2), 400, "repetition_penalty", ("not supported",)),
    ("logit_bias", _c(logit_bias={"7": 10}), 400, "logit_bias", ("not supported",)),
    ("best_of", _c(best_of=3), 400, "best_of", ("not supported",)),
    ("echo", _c(echo=True), 400, "echo", ("not supported",)),
    ("suffix", _c(suffix="w9"), 400, "suffix", ("not supported",)),
    ("logprobs", _c(logprobs=1), 400, "logprobs", ()),
    ("logprobs-too-many", _c(logprobs=21), 400, "logprobs", ()),
    ("prompt-missing", {"max_tokens": 2}, 400, "prompt", ("required",)),
    ("prompt-int", _c(prompt=7), 400, "prompt", ()),
    ("prompt-empty-string", _c(prompt=""), 400, "prompt", ("empty",)),
    ("prompt-empty-list", _c(prompt=[]), 400, "prompt", ("empty",)),
    ("prompt-list-of-empty-string", _c(prompt=[""]), 400, "prompt", ("empty",)),
    ("prompt-empty-token-list", _c(prompt=[[]]), 400, "prompt", ("empty",)),
    ("prompt-batch-with-empty", _c(prompt=["w7", ""]), 400, "prompt[1]", ("empty",)),
    ("prompt-token-neg", _c(prompt=[7, -1]), 400, "prompt", ()),
    ("prompt-token-vocab", _c(prompt=[7, 512]), 400, "prompt[1]", ("512", "vocabulary")),
    ("prompt-lone-surrogate", b'{"prompt": "w7 \\ud800", "max_tokens": 2}', 400, "prompt", ("surrogate",)),
    ("prompt-batch-lone-surrogate", b'{"prompt": ["w7", "\\udfff w8"]}', 400, "prompt[1]", ("surrogate",)),
    ("stop-lone-surrogate", b'{"prompt": "w7", "stop": ["w9", "\\udc00"]}', 400, "stop[1]", ("surrogate",)),
    ("key-lone-surrogate", b'{"prompt": "w7", "\\ud800": 1}', 400, None, ("surrogate",)),
    ("stop_token_ids-vocab", _c(stop_token_ids=[3, 512]), 400, "stop_token_ids[1]", ("512", "vocabulary")),
    ("prompt-batch-token-vocab", _c(prompt=[[7], [8, 9999]]), 400, "prompt[1]", ("9999",)),
    ("prompt-mixed-list", _c(prompt=[7, "w8"]), 400, "prompt", ()),
    ("prompt-over-max_model_len", _c(prompt=[7] * MAX_MODEL_LEN, max_tokens=None), 400, "prompt",
     (str(MAX_MODEL_LEN), "scheduler.max_model_len")),
    ("prompt-batch-over-max_model_len", _c(prompt=[[7] * 10, [7] * MAX_MODEL_LEN], max_tokens=None), 400,
     "prompt[1]", ("scheduler.max_model_len",)),
    ("max_tokens-plus-prompt-over-max_model_len", _c(prompt=[7] * 10, max_tokens=MAX_MODEL_LEN - 9), 400,
     "max_tokens", (str(MAX_MODEL_LEN), "scheduler.max_model_len")),
    ("model-wrong", _c(model="gpt-4"), 404, "model", ("gpt-4",)),
    ("model-int", _c(model=3), 400, "model", ()),
    ("body-not-json", b'{"prompt": "w7", ', 400, None, ("not valid JSON",)),
    ("body-not-utf8", b'{"prompt": "\xff\xfe"}', 400, None, ("not valid JSON",)),
    ("body-empty", b"", 400, None, ("not valid JSON",)),
    ("body-json-list", b'[{"prompt": "w7"}]', 400, None, ("JSON object", "list")),
    ("body-json-string", b'"w7"', 400, None, ("JSON object",)),
]

CHAT_BAD: list[tuple[str, Any, int, str | None, tuple[str, ...]]] = [
    ("messages-missing", {"max_tokens": 2}, 400, "messages", ("required",)),
    ("messages-empty", _m(messages=[]), 400, "messages", ()),
    ("messages-str", _m(messages="w7"), 400, "messages", ()),
    ("message-bad-role", _m(messages=[{"role": "robot", "content": "w7"}]), 400, "messages[0].role", ()),
    ("message-no-role", _m(messages=[{"content": "w7"}]), 400, "messages[0].role", ("required",)),
    ("message-content-int", _m(messages=[{"role": "user", "content": 7}]), 400, "messages[0].content", ()),
    ("message-image-part", _m(messages=[{"role": "user", "content": [
        {"type": "text", "text": "w7"},
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]), 400,
     "messages[0].content", ()),
    ("message-text-part-extra", _m(messages=[{"role": "user", "content": [
        {"type": "text", "text": "w7", "detail": "high"}]}]), 400, "messages[0].content", ()),
    ("max_tokens-str", _m(max_tokens="5"), 400, "max_tokens", ()),
    ("max_tokens-zero", _m(max_tokens=0), 400, "max_tokens", ()),
    ("max_completion_tokens-neg", _m(max_completion_tokens=-3), 400, "max_completion_tokens", ()),
    ("max_completion_tokens-bool", _m(max_completion_tokens=False), 400, "max_completion_tokens", ()),
    ("max_completion_tokens-over-context", _m(max_completion_tokens=MAX_MODEL_LEN), 400,
     "max_completion_tokens", ("scheduler.max_model_len",)),
    ("max_tokens-over-context", _m(max_tokens=MAX_MODEL_LEN), 400, "max_tokens", ("scheduler.max_model_len",)),
    ("messages-over-context", _m(messages=[{"role": "user", "content": " ".join(["w7"] * MAX_MODEL_LEN)}],
                                 max_tokens=None), 400, "messages", ("scheduler.max_model_len",)),
    ("temperature-neg", _m(temperature=-1), 400, "temperature", ()),
    ("temperature-nan", b'{"messages": [{"role": "user", "content": "w7"}], "temperature": NaN}', 400,
     "temperature", ()),
    ("top_p-zero", _m(top_p=0), 400, "top_p", ()),
    ("top_p-two", _m(top_p=2), 400, "top_p", ()),
    ("top_k-minus-two", _m(top_k=-2), 400, "top_k", ()),
    ("n-zero", _m(n=0), 400, "n", ()),
    ("n-over-max_n", _m(n=MAX_N + 1), 400, "n", ("server.max_n",)),
    ("stop-non-string", _m(stop=[None]), 400, "stop", ()),
    ("message-lone-surrogate", b'{"messages": [{"role": "user", "content": "w7 \\ud800"}]}', 400,
     "messages[0].content", ("surrogate",)),
    ("stop_token_ids-neg", _m(stop_token_ids=[3, -7]), 400, "stop_token_ids", ()),
    ("min_tokens-over-max_tokens", _m(min_tokens=3, max_tokens=1), 400, "min_tokens", ()),
    ("unknown-field", _m(prompt="w7"), 400, "prompt", ("unknown field",)),
    ("misspelt-field", _m(temprature=0.5), 400, "temprature", ("unknown field",)),
    ("frequency_penalty", _m(frequency_penalty=0.5), 400, "frequency_penalty", ("not supported",)),
    ("min_p", _m(min_p=0.1), 400, "min_p", ("not supported",)),
    ("response_format", _m(response_format={"type": "json_schema", "json_schema": {"name": "p"}}), 400,
     "response_format.json_schema.schema", ("required",)),
    ("tools", _m(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", ("not supported",)),
    ("tool_choice", _m(tool_choice="auto"), 400, "tool_choice", ("not supported",)),
    ("logprobs", _m(logprobs=True), 400, "logprobs", ()),
    ("logprobs-int", _m(logprobs=1), 400, "logprobs", ()),
    ("top_logprobs", _m(top_logprobs=2), 400, "top_logprobs", ()),
    ("model-wrong", _m(model="word-model-2"), 404, "model", ("word-model-2",)),
    ("body-not-json", b"messages=w7", 400, None, ("not valid JSON",)),
    ("body-json-list", b"[]", 400, None, ("JSON object",)),
    ("body-json-null", b"null", 400, None, ("JSON object",)),
]


def _post(client: httpx.Client, path: str, body: Any, **kw: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"Content-Type": "application/json"}, **kw)
    return client.post(path, json=body, **kw)


@pytest.mark.parametrize(("body", "status", "param", "says"), [c[1:] for c in COMPLETION_BAD],
                         ids=[c[0] for c in COMPLETION_BAD])
def test_bad_completion_body(client, body, status, param, says):
    assert_error(_post(client, "/v1/completions", body), status, param=param, says=says)
    if isinstance(body, dict) and "stream" not in body:  # as a stream: refused before any event
        assert_error(_post(client, "/v1/completions", {**body, "stream": True}), status, param=param, says=says)
    assert_serves(client)


@pytest.mark.parametrize(("body", "status", "param", "says"), [c[1:] for c in CHAT_BAD],
                         ids=[c[0] for c in CHAT_BAD])
def test_bad_chat_body(client, body, status, param, says):
    assert_error(_post(client, "/v1/chat/completions", body), status, param=param, says=says)
    if isinstance(body, dict) and "stream" not in body:
        assert_error(_post(client, "/v1/chat/completions", {**body, "stream": True}), status, param=param,
                     says=says)
    assert_serves(client, "/v1/chat/completions")


@pytest.mark.parametrize("value", ["x" * 257, "has space", "tab\there", "", "caf\u00e9"],
                         ids=["too-long", "space", "tab", "empty", "non-ascii"])
def test_bad_request_id_header(client, value):
    raw = value.encode("utf-8")  # httpx would refuse to send some of these itself
    r = client.post("/v1/completions", json=GOOD, headers=[(b"X-Request-Id", raw)])
    assert_error(r, 400, param="X-Request-Id", says=("256",))
    assert "x-request-id" not in r.headers  # an id that is itself the mistake is not echoed
    ok = client.post("/v1/completions", json=GOOD, headers={"X-Request-Id": "x" * 256})
    assert ok.status_code == 200 and ok.json()["id"] == "x" * 256
    assert ok.headers["x-request-id"] == "x" * 256


def test_limits_on_a_request_too_large_to_ever_fit(slow):
    # (on the server with the default body limit: these bodies are over the api server's)
    with slow.client() as c:
        r = c.post("/v1/completions", json=_c(prompt=[[7]] * 3000))  # pending limit 2
        assert_error(r, 400, param="prompt", says=("3000", "server.max_pending_requests"))
        assert "retry-after" not in r.headers
        r = c.post("/v1/completions", json=_c(prompt=["w7"] * 3, n=1))
        assert_error(r, 400, param="prompt", says=("3", "server.max_pending_requests"))
        r = c.post("/v1/completions", json=_c(prompt=[7] * 3))  # one prompt of three tokens fits
        assert r.status_code == 200, r.text
        r = c.post("/v1/completions", json=_c(stop_token_ids=[7] * 1025))
        assert_error(r, 400, param="stop_token_ids", says=("1024",))
        assert_serves(c)


def test_a_valid_surrogate_pair_is_text(client):
    # an emoji spelt as a JSON surrogate pair is one character, not a lone surrogate
    r = _post(client, "/v1/completions", b'{"prompt": "w7 \\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200, r.text
    r = _post(client, "/tokenize", b'{"prompt": "w7 \\ud800"}')
    assert_error(r, 400, param="prompt", says=("surrogate",))
    assert_serves(client)


def test_a_wrong_method_says_which_are_allowed(client):
    r = client.get("/v1/completions")
    assert_error(r, 405)
    assert r.headers["allow"] == "POST" and r.json()["error"]["type"] == "MethodNotAllowedError"
    assert client.head("/health").status_code == 200
    assert client.head("/v1/models").status_code == 200


def test_bad_requests_are_counted(api, client):
    before = metric(api.stats(), "schedkit:http_request_errors_total", status="400")
    for _ in range(3):
        assert_error(client.post("/v1/completions", json=_c(top_k=-2)), 400, param="top_k")
    assert_error(client.post("/v1/completions", json=_c(model="nope")), 404, param="model")
    stats = api.stats()
    assert metric(stats, "schedkit:http_request_errors_total", status="400") == before + 3
    assert metric(stats, "schedkit:http_request_errors_total", status="404") >= 1


# -- 2. API key ----------------------------------------------------------------------------------
def _check_api_key(s: LiveServer, key: str) -> None:
    with s.client() as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key},
                        {"Authorization": f"Basic {key}"}, {"Authorization": f"Bearer {key}x"}):
            for method, path, body in (("POST", "/v1/completions", GOOD), ("GET", "/v1/models", None),
                                       ("POST", "/v1/chat/completions", _m()),
                                       ("POST", "/tokenize", {"prompt": "w7"})):
                r = c.request(method, path, json=body, headers=headers)
                assert_error(r, 401, says=("API key",))
                assert r.headers.get("www-authenticate") == "Bearer"
        # a 401 is answered before the body is even read: a huge one changes nothing
        r = c.post("/v1/completions", content=b"x" * (MAX_BODY * 4))
        assert r.status_code == 401
        ok = {"Authorization": f"Bearer {key}"}
        assert c.get("/v1/models", headers=ok).status_code == 200
        assert c.post("/tokenize", json={"prompt": "w7"}, headers=ok).json()["tokens"] == [7]
        assert_serves(c, **ok)
        assert_serves(c, "/v1/chat/completions", **{"authorization": f"bearer {key}"})
        assert c.get("/health").status_code == 200
        m = c.get("/metrics")
        assert m.status_code == 200 and "schedkit:num_requests_running" in m.text


def test_api_key_from_the_command_line(api):
    _check_api_key(api, KEY)


def test_api_key_from_the_environment(servers):
    _check_api_key(servers["env-key"], "env-key")


# -- 3. body size ---------------------------------------------------------------------------------
def _big_body() -> bytes:
    body = json.dumps(_c(prompt="w7 " * 1000)).encode()
    assert len(body) > MAX_BODY
    return body


def test_body_over_the_limit_with_content_length(client):
    body = _big_body()
    r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert_error(r, 413, says=(str(MAX_BODY), "server.max_body_bytes"))
    assert str(len(body)) in r.json()["error"]["message"]
    assert r.content == json.dumps(r.json(), separators=(",", ":")).encode()  # compact, like every answer
    assert_serves(client)


def test_body_over_the_limit_chunked(client):
    body = _big_body()

    def pieces() -> Iterator[bytes]:
        for i in range(0, len(body), 500):
            yield body[i:i + 500]

    r = client.post("/v1/completions", content=pieces(), headers={"Content-Type": "application/json"})
    assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
    assert_error(r, 413, says=(str(MAX_BODY), "server.max_body_bytes"))
    assert_serves(client)


def test_body_under_the_limit_chunked_is_served(client):
    body = json.dumps(GOOD).encode()
    r = client.post("/v1/completions", content=iter([body[:5], body[5:]]),
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text


def test_content_length_not_a_number(api):
    u = httpx.URL(api.url)
    with socket.create_connection((u.host, u.port), timeout=5) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Length: abc\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    assert data.split(b" ")[1] == b"400", data
    with api.client(headers=AUTH) as c:
        assert_serves(c)


# -- 5. admission rejection ----------------------------------------------------------------------
def test_admission_rejection_is_a_429(api, client):
    def rejected() -> float:
        return metric(api.stats(), "schedkit:admission_rejections_total", plugin="edf")

    before = rejected()
    hopeless = _c(ttft_slo_s=1e-9, max_tokens=4)
    r = client.post("/v1/completions", json=hopeless)
    # the plugin's name and its own reason (edf's Rejection: the SLO, the wait, the estimate)
    err = assert_error(r, 429, says=("edf", "TTFT deadline cannot be met", "SLO 1e-09 s"))
    assert err["type"] == "RateLimitError"
    assert int(r.headers["retry-after"]) >= 0
    r = client.post("/v1/completions", json={**hopeless, "stream": True})
    assert_error(r, 429, says=("edf",))
    assert "retry-after" in r.headers
    r = client.post("/v1/chat/completions", json=_m(ttft_slo_s=1e-9, stream=True))
    assert_error(r, 429, says=("edf",))
    assert_serves(client)
    assert client.post("/v1/completions", json=_c(ttft_slo_s=30.0)).status_code == 200
    assert rejected() == before + 3
    # a rejected n=2 request is one 429 and none of its choices is left behind: the other
    # choice is rejected too, or aborted first when it reached the engine a step later
    assert_error(client.post("/v1/completions", json={**hopeless, "n": 2}), 429, says=("edf",))
    wait_idle(api)
    assert before + 4 <= rejected() <= before + 5


# -- 4. pending limit -----------------------------------------------------------------------------
def _long(max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"prompt": "w11 w12", "max_tokens": max_tokens, "ignore_eos": True, "stream": True, **kw}


def test_pending_limit_is_a_503_with_retry_after(slow):
    a = Raw(slow.url, "/v1/completions", _long(20))  # 1 s each, one after the other
    b = Raw(slow.url, "/v1/completions", _long(20))
    try:
        a.read_until(b"data: ")
        wait_for(lambda: engine_load(slow)[:2] == (1, 1), 3.0, "one running and one waiting request")
        with slow.client() as c:
            r = c.post("/v1/completions", json=GOOD)
            assert_error(r, 503, says=("2", "server.max_pending_requests"))
            assert r.headers["retry-after"] == "1"
            r = c.post("/v1/completions", json={**GOOD, "stream": True})
            assert_error(r, 503, says=("server.max_pending_requests",))
            for raw in (a, b):
                status, events = raw.events()
                assert status == 200 and events[-1] == "[DONE]"
                assert finish_reasons(events) == ["length"]
            assert_serves(c)
            # n counts: n=3 alone can never fit the limit of 2, so waiting cannot help: a 400
            r = c.post("/v1/completions", json={**GOOD, "n": 3})
            assert_error(r, 400, param="n", says=("3", "server.max_pending_requests"))
            assert "retry-after" not in r.headers
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w7"}], "n": 3})
            assert_error(r, 400, param="n", says=("server.max_pending_requests",))
            assert_serves(c)
    finally:
        a.close()
        b.close()
    wait_idle(slow)


# -- 6. disconnects ------------------------------------------------------------------------------
def _assert_aborted(s: LiveServer, before: float, count: int = 1, running: int = 0) -> None:
    wait_for(lambda: aborts(s) == before + count and engine_load(s)[:2] == (running, 0), 2.0,
             f"{count} abort(s) with {running} request(s) left running")


def test_stream_client_hangs_up(slow):
    before = aborts(slow)
    raw = Raw(slow.url, "/v1/completions", _long(200))
    raw.read_until(b'"text"')
    assert engine_load(slow)[0] == 1
    raw.close()
    _assert_aborted(slow, before)
    wait_idle(slow)
    with slow.client() as c:
        assert_serves(c)


def test_a_hang_up_aborts_within_about_one_engine_step(slow):
    """The client's disconnect reaches the engine at once: the request leaves the running
    batch within a step or two of the hang-up, counted in engine steps (each /metrics
    probe is answered between two steps, so the count it reads is exact)."""
    raw = Raw(slow.url, "/v1/completions", _long(400))
    raw.read_until(b'"text"')
    assert engine_load(slow)[0] == 1
    steps_before = metric(slow.stats(), "schedkit:engine_steps_total")
    raw.close()

    def gone() -> dict[str, float] | None:
        st = slow.stats()
        return st if metric(st, "schedkit:num_requests_running") == 0 else None

    after = wait_for(gone, 2.0, "the request to leave the batch", step=0.005)
    steps = metric(after, "schedkit:engine_steps_total") - steps_before
    # one step may start between the probe and the hang-up, one runs while the abort
    # travels, and the probe that sees it gone may wait for one more
    print(f"\n{steps:.0f} engine steps from the hang-up to the abort")
    assert steps <= 3, f"the request ran {steps:.0f} more engine steps after its client left"
    wait_idle(slow)


def test_chat_stream_client_hangs_up(slow):
    before = aborts(slow)
    body = {"messages": [{"role": "user", "content": "w20"}], "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    raw = Raw(slow.url, "/v1/chat/completions", body)
    raw.read_until(b'"content"')
    raw.close()
    _assert_aborted(slow, before)
    wait_idle(slow)


def test_non_streaming_client_times_out(slow):
    before = aborts(slow)
    with slow.client() as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={**GOOD, "max_tokens": 200, "ignore_eos": True}, timeout=0.5)
    _assert_aborted(slow, before)
    wait_idle(slow)
    with slow.client() as c:
        assert_serves(c)


def test_non_streaming_n2_client_hangs_up(slow):
    """Both choices of an n=2 request are aborted: the running one and the waiting one."""
    before = aborts(slow)
    raw = Raw(slow.url, "/v1/completions", {**GOOD, "max_tokens": 200, "ignore_eos": True, "n": 2})
    wait_for(lambda: engine_load(slow)[:2] == (1, 1), 3.0, "one choice running, one waiting")
    raw.close()
    _assert_aborted(slow, before, count=2)
    wait_idle(slow)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_waiting_request_client_hangs_up(slow, stream):
    before = aborts(slow)
    running = Raw(slow.url, "/v1/completions", _long(200))
    try:
        running.read_until(b'"text"')
        body = {**GOOD, "max_tokens": 5, "ignore_eos": True, "stream": stream}
        waiting = Raw(slow.url, "/v1/completions", body)
        wait_for(lambda: engine_load(slow)[:2] == (1, 1), 3.0, "a request waiting behind the running one")
        waiting.close()
        _assert_aborted(slow, before, running=1)
    finally:
        running.close()
    _assert_aborted(slow, before, count=2)
    wait_idle(slow)
    with slow.client() as c:
        assert_serves(c)


# -- 7. engine death -----------------------------------------------------------------------------
def test_engine_death_mid_stream(servers):
    s = servers["doomed"]
    raw = Raw(s.url, "/v1/completions", _long(300))
    raw.read_until(b'"text"')
    assert metric(s.stats(), "schedkit:num_requests_running") == 1  # a snapshot with it running
    pid = engine_pid(s)
    os.kill(pid, signal.SIGKILL)
    status, events = raw.events(timeout=5)
    assert status == 200
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1, events
    assert errors[0]["code"] == 503 and "engine" in errors[0]["message"]
    assert "length" not in finish_reasons(events)
    with s.client() as c:
        r = wait_for(lambda: (h := c.get("/health")).status_code == 503 and h, 3.0, "/health to turn 503")
        assert_error(r, 503, says=("engine",))
        for path, body in (("/v1/completions", GOOD), ("/v1/completions", {**GOOD, "stream": True}),
                           ("/v1/chat/completions", _m())):
            assert_error(c.post(path, json=body), 503, says=("engine",))
        m = c.get("/metrics")
        assert m.status_code == 200
        stats = s.stats()
        assert metric(stats, "schedkit:engine_healthy") == 0
        # a dead engine runs nothing: not the last snapshot's running request
        assert metric(stats, "schedkit:num_requests_running") == 0
        assert metric(stats, "schedkit:kv_cache_usage_perc") == 0
    assert s.proc.poll() is None  # the HTTP server itself lives on to say so


def test_exit_on_engine_death_ends_streams_then_exits_1(servers):
    s = servers["fatal"]
    raw = Raw(s.url, "/v1/completions", _long(300))
    raw.read_until(b'"text"')
    os.kill(engine_pid(s), signal.SIGKILL)
    status, events = raw.events(timeout=5)
    assert status == 200
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["code"] == 503, events  # the stream told first
    assert s.proc.wait(10) == 1
    assert "the engine died; exiting" in s.log()


# -- 8. SIGTERM drains ---------------------------------------------------------------------------
def test_sigterm_drains_then_exits_0(servers):
    grace = DRAIN_GRACE_S
    s = servers["drained"]
    u = httpx.URL(s.url)
    long = Raw(s.url, "/v1/completions", _long(400))  # 8 s: outlives the grace
    long.read_until(b'"text"')
    short = Raw(s.url, "/v1/completions", {**_long(15), "stream": False})  # 0.3 s: finishes in it
    wait_for(lambda: engine_load(s)[0] == 2, 3.0, "both requests running")
    engine = engine_pid(s)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)

    def refused() -> bool:
        try:
            socket.create_connection((u.host, u.port), timeout=1).close()
        except ConnectionRefusedError:
            return True
        return False

    wait_for(refused, 2.0, "the listening socket to close")
    status, headers, body = short.read_all(timeout=5)
    assert status == 200, body
    answer = json.loads(body)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 15
    status, events = long.events(timeout=grace + 5)
    assert status == 200
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events if isinstance(e, dict))
    assert finish_reasons(events) == ["abort"]
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert grace * 0.9 <= time.monotonic() - t0 < grace + 3  # it had its grace, then no more
    assert s.proc.wait(grace + 8) == 0
    assert "draining (2 requests in flight, 1 s grace)" in s.log()
    assert not Path(f"/proc/{engine}").exists()  # the engine went with it


_SLOW_ENGINE_START = '''\
import pathlib, time
if b"schedkit.engine.process" in pathlib.Path("/proc/self/cmdline").read_bytes():
    time.sleep(float(__import__("os").environ["SLOW_ENGINE_START_S"]))
'''


@pytest.mark.slow
def test_sigterm_while_the_engine_starts_exits_0(tmp_path, word_tokenizer):
    """A stop asked for during start-up is not a failure: the engine finishes starting,
    serves nothing, is shut down, and the process exits 0 without ever listening."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SLOW_ENGINE_START)  # the engine process imports slowly
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(server_config(word_tokenizer)))
    env = {**os.environ, "SLOW_ENGINE_START_S": "2",
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "schedkit.cli", "serve", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        def engine_started() -> bool:
            return any(b"schedkit.engine.process" in _cmdline(pid) for pid in child_pids(proc.pid))

        wait_for(engine_started, 30.0, "the engine process to be spawned")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "listening on" not in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""


@pytest.mark.slow
@pytest.mark.parametrize("what", ["address in use", "engine fails"])
def test_a_start_that_fails_exits_1(tmp_path, word_tokenizer, what):
    """uvicorn itself exits 3 on a failed start-up; docs/serving.md promises 1."""
    cfg = server_config(word_tokenizer)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    if what == "address in use":
        cfg["server"]["port"] = taken.getsockname()[1]
    else:  # the engine process refuses the config at start (no such policy plugin)
        cfg["scheduler"]["policy"] = "no-such-policy"
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    try:
        proc = subprocess.run([sys.executable, "-m", "schedkit.cli", "serve", str(path)],
                              capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert proc.returncode == 1, proc.stderr
    assert "listening on" not in proc.stdout
    if what == "address in use":
        assert "address already in use" in proc.stderr
    else:
        assert "no-such-policy" in proc.stderr


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/v1/completions", {"prompt": "hi"}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ("/v1/completions", {"prompt": [1, 2], "response_format": {"type": "json_object"}}, "response_format"),
    ("/tokenize", {"prompt": "hi"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/detokenize", {"tokens": [1, 2]}, "tokens"),
], ids=["chat", "text", "regex", "json_object", "tokenize", "tokenize-chat", "detokenize"])
def test_what_needs_a_tokenizer_names_its_field_on_a_model_without_one(servers, path, body, param):
    with servers["no-tokenizer"].client() as c:
        r = c.post(path, json={"max_tokens": 2, **body} if path.startswith("/v1") else body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "tokenizer" in err["message"], err
        assert ("send token ids" in err["message"]) == (param == "prompt")
        ok = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
