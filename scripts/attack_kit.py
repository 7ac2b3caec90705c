"""The attacks of ``scripts/bench_attacks.py`` on a live ``schedkit serve``, its victims,
and how to read the server's and its engine's resources from outside.

Every attack is a function of a :class:`Target` that returns what it got: the HTTP
status, how its connection ended, or what the engine's socket did with it.
"""

from __future__ import annotations

import json
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
import zmq
from bench_grammar_isolation import AMBIGUOUS, SLOW_REGEX, VOCAB_SIZE, deep_schema
from zmq.utils.monitor import recv_monitor_message

from schedkit.engine.messages import UtilityCall, client_encoder
from schedkit.structured.testing import word_level_tokenizer

API_KEY = "victims-only"
STREAM_TOKENS = 100
BIG = 8_000_000  # bytes: under the default server.max_body_bytes (8 MiB)
HEAD = 48 << 20  # a 48 MB request line or header
ATTACK_TIMEOUT_S = 60.0
SLOW_CLIENT_S = 1.0  # the slow-regex clients leave after this long
NESTED_STAR = "(a*)*b"


@dataclass
class Target:
    """A live server: its URL and process, its engine's process and input socket (read
    from the engine's command line, as a local attacker would)."""

    url: str
    proc: subprocess.Popen
    engine_pid: int
    engine_addr: str
    zmq_ctx: zmq.Context = field(default_factory=zmq.Context)
    num_choices: int = 0  # structured victims sent: each gets a choice never compiled before

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}


# -- the server ------------------------------------------------------------------------------
def start_server(tmp: Path, step_ms: float, log_path: Path) -> Target:
    """``schedkit serve`` on the fake runner (wall clock), xgrammar over a 49,152-token
    word-level tokenizer, with an API key; its log goes to ``log_path``."""
    word_level_tokenizer(VOCAB_SIZE).save_pretrained(tmp / "tok")
    cfg = {"model": {"name": "word-model", "tokenizer": str(tmp / "tok")},
           "runner": {"kind": "fake", "vocab_size": VOCAB_SIZE, "step_time_ms": step_ms, "clock": "wall",
                      "eos_token_id": 0},
           "cache": {"block_size": 16, "num_blocks": 2048},
           "scheduler": {"max_num_seqs": 64, "max_model_len": 2048, "max_num_batched_tokens": 2048},
           "structured_outputs": {"backend": "xgrammar"},
           "server": {"port": 0, "api_key": API_KEY}}
    path = tmp / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = log_path.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "schedkit.cli", "serve", str(path)],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=os.environ.copy())
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # never let it block
            [pid] = engine_pids(proc.pid)
            return Target(m.group(1), proc, pid, engine_input_addr(pid))
    raise SystemExit(f"the server did not start (its log: {log_path})")


def engine_pids(server_pid: int) -> list[int]:
    """The engine processes the server started (its children running the engine)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
            cmdline = (entry / "cmdline").read_bytes().split(b"\0") if stat else []
        except OSError:
            continue
        if cmdline and int(stat.rsplit(")", 1)[1].split()[1]) == server_pid \
                and b"schedkit.engine.process" in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def engine_input_addr(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index("--input") + 1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def metrics(t: Target) -> dict[str, float]:
    """``/metrics``' unlabelled-by-us samples, by name (labels dropped, values summed),
    on a connection the server closes at once."""
    text = httpx.get(t.url + "/metrics", headers={"Connection": "close"}, timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{")[0].split(" ")[0], line.rsplit(" ", 1)[1]
            out[name] = out.get(name, 0.0) + float(value)
    return out


# -- the victims -------------------------------------------------------------------------------
def stream_once(t: Target) -> float:
    """An unconstrained 100-token stream (EOS ignored): its seconds."""
    body = {"prompt": [7, 8, 9], "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    with httpx.Client(base_url=t.url, headers=t.auth, timeout=120) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                break
    return time.perf_counter() - t0


def choice_once(t: Target) -> float:
    """A small structured request: a text prompt and a choice of two words not asked for
    before (so its grammar is compiled, not found in the cache); its seconds."""
    t.num_choices += 1
    n = t.num_choices
    body = {"prompt": "a b c", "max_tokens": 16, "structured_outputs": {"choice": [f"yes{n}", f"no{n}"]}}
    t0 = time.perf_counter()
    r = httpx.post(t.url + "/v1/completions", json=body, headers=t.auth, timeout=120)
    r.raise_for_status()
    return time.perf_counter() - t0


def probe_health(t: Target, stop: threading.Event, worst: dict[str, float]) -> None:
    """Until ``stop``: ``GET /health`` every 20 ms; ``worst`` keeps its longest answer and
    the largest RSS of the server and of the engine."""
    with httpx.Client(base_url=t.url, timeout=120) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get("/health")
            worst["health_s"] = max(worst["health_s"], time.perf_counter() - t0)
            worst["server_mib"] = max(worst["server_mib"], rss_mib(t.proc.pid))
            worst["engine_mib"] = max(worst["engine_mib"], rss_mib(t.engine_pid))
            stop.wait(0.02)


# -- attacks on the front door (unauthenticated) --------------------------------------------------
def _address(url: str) -> tuple[str, int]:
    u = httpx.URL(url)
    return u.host, int(u.port or 80)


def _status_of(sock: socket.socket, timeout: float = ATTACK_TIMEOUT_S) -> str:
    sock.settimeout(timeout)
    raw = b""
    try:
        while b"\r\n" not in raw:
            chunk = sock.recv(4096)
            if not chunk:
                break
            raw += chunk
    except TimeoutError:
        return f"no answer in {timeout:g} s"
    except ConnectionResetError:
        return "reset" if not raw else raw.split(b" ")[1].decode()
    finally:
        sock.close()
    return raw.split(b" ")[1].decode() if raw else "closed"


def raw_head(t: Target, head: bytes) -> str:
    """Send all of ``head`` (an attacker does not stop for the answer), then read it."""
    sock = socket.create_connection(_address(t.url))
    view = memoryview(head)
    try:
        while view:
            view = view[sock.send(view[:1 << 20]):]
    except (BrokenPipeError, ConnectionResetError):
        pass
    return _status_of(sock)


def slow_head(t: Target) -> str:
    """Headers at a byte every 100 ms, until the server answers."""
    sock = socket.create_connection(_address(t.url))
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
    deadline = time.monotonic() + ATTACK_TIMEOUT_S
    for b in head:
        if time.monotonic() > deadline or select.select([sock], [], [], 0.1)[0]:
            break
        try:
            sock.sendall(bytes([b]))
        except (BrokenPipeError, ConnectionResetError):
            break
    return _status_of(sock, 5.0)


# -- attacks in the body (authenticated: an API key does not make a client harmless) ---------------
def post(t: Target, path: str, body: bytes, timeout: float = ATTACK_TIMEOUT_S) -> str:
    try:
        r = httpx.post(t.url + path, content=body, timeout=timeout,
                       headers={"Content-Type": "application/json", **t.auth})
    except httpx.TimeoutException:
        return f"no answer in {timeout:g} s"
    return str(r.status_code)


def post_json(t: Target, body: dict[str, Any], timeout: float = ATTACK_TIMEOUT_S) -> str:
    return post(t, "/v1/completions", json.dumps(body).encode(), timeout)


def surrogate_body() -> bytes:
    """5 MB: a million stop strings, then an escaped lone surrogate (the costliest to scan)."""
    strings = b",".join([b'"w7"'] * ((5_000_000 - 40) // 5))
    return b'{"prompt": "w7", "stop": [' + strings + b', "\\ud800"]}'


def ids_body(field_name: str, base: dict[str, Any]) -> bytes:
    """``base`` with ``field_name``: 8 MB of token ids."""
    ids = b",".join([b"1234"] * (BIG // 5))
    head = json.dumps({**base, field_name: []}).encode()
    return head[:-2] + ids + b"]}"


def text_prompts(t: Target, count: int) -> str:
    """``count`` 8 MB text prompts at once."""
    text = json.dumps({"prompt": "abc " * (BIG // 4 - 10), "max_tokens": 1}).encode()
    statuses: list[str] = []
    threads = [threading.Thread(target=lambda: statuses.append(post(t, "/v1/completions", text)))
               for _ in range(count)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return ",".join(sorted(set(statuses)))


def surrogate_bytes(t: Target) -> str:
    """A prompt holding a surrogate's raw UTF-8 bytes (not valid UTF-8)."""
    return post(t, "/v1/completions", b'{"prompt": "abc \xed\xa0\x80 def", "max_tokens": 4}')


# -- attacks through the grammar (authenticated) --------------------------------------------------
def grammar_attack(t: Target, **constraint: str) -> str:
    return post_json(t, {"prompt": [50, 60, 70], "max_tokens": 2000, "structured_outputs": constraint})


def slow_regexes(t: Target) -> str:
    """Four clients (four ``user``s) each send a regex that takes about 20 s to compile,
    and disconnect after 1 s."""
    statuses: list[str] = []

    def one(i: int) -> None:
        regex = SLOW_REGEX.format("pqrs"[i], "PQRS"[i])
        statuses.append(post_json(t, {"prompt": [50, 60, 70], "max_tokens": 20, "user": f"slow{i}",
                                      "structured_outputs": {"regex": regex}}, SLOW_CLIENT_S))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return ",".join(sorted(set(statuses))).replace("no answer in", "left after")


# -- an attack on the engine's socket ------------------------------------------------------------
HANDSHAKE_EVENTS = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "refused (handshake failed)",
                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "refused (handshake failed: protocol)",
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused (handshake failed: auth)",
                    zmq.EVENT_HANDSHAKE_SUCCEEDED: "ADMITTED",
                    zmq.EVENT_DISCONNECTED: "refused (disconnected)"}


def engine_shutdown(t: Target) -> str:
    """Connect to the engine's input socket without its key and send ``shutdown``; what
    the handshake came to."""
    sock = t.zmq_ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    events = 0
    for e in HANDSHAKE_EVENTS:
        events |= e
    monitor = sock.get_monitor_socket(events)
    try:
        sock.connect(t.engine_addr)
        sock.send(client_encoder.encode(UtilityCall(0, "shutdown", [])))
        if not monitor.poll(5000):
            return "no handshake in 5 s"
        event = recv_monitor_message(monitor)["event"]
        return HANDSHAKE_EVENTS.get(event, f"event {event}")
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


def timed_attacks() -> dict[str, Callable[[Target], str]]:
    """Each attack timed against the victims, by name (the kind in brackets)."""
    return {
        "ambiguous-grammar": lambda t: grammar_attack(t, grammar=AMBIGUOUS),         # (1)
        "nested-star-regex": lambda t: grammar_attack(t, regex=NESTED_STAR),         # (1b)
        "deep-schema": lambda t: grammar_attack(t, json=deep_schema(600)),           # (2)
        "slow-regexes-4x": slow_regexes,                                              # (3)
        "request-line-48mb": lambda t: raw_head(t, b"GET /" + b"a" * HEAD),          # (4)
        "headers-48mb": lambda t: raw_head(t, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * HEAD),
        "slow-headers": slow_head,
        "surrogate-escape-5mb": lambda t: post(t, "/v1/completions", surrogate_body()),  # (5)
        "token-id-prompt-8mb": lambda t: post(t, "/v1/completions", ids_body("prompt", {"max_tokens": 1})),
        "stop_token_ids-8mb": lambda t: post(t, "/v1/completions",
                                             ids_body("stop_token_ids", {"prompt": [7], "max_tokens": 1})),
        "detokenize-8mb": lambda t: post(t, "/detokenize", ids_body("tokens", {})),
        "text-prompts-3x8mb": lambda t: text_prompts(t, 3),
        "surrogate-bytes": surrogate_bytes,                                           # (6)
        "engine-socket-shutdown": engine_shutdown,                                    # (7)
    }
