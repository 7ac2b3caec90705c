"""What one client's oversized or slow request costs the others: ``schedkit serve`` on
the fake runner, attacked at its front door while another client streams.

Method: the server runs in its own process (its engine in a third) on the fake runner
with a wall clock (10 ms steps) and a word-level tokenizer built here (token ``k`` is the
word ``wk``; ``max_model_len`` 2048). The victim is one unconstrained stream of 100 tokens
(a token-id prompt, EOS ignored), timed alone three times (the median is "alone"), then
once per attack: the attack starts 0.2 s into the stream, from its own connections, while
a prober sends ``GET /health`` every 20 ms on another. For each attack the script prints
the stream's time against alone (the front door holds when it is within 2x), the longest
``/health`` answer, the attack's HTTP status (or how its connection ended), and the
server's RSS before / at its largest while attacked / after (MiB). Attacks: a 48 MB request line, 48 MB of one header, slow
headers (a byte every 100 ms), a 5 MB body with a lone-surrogate escape after a million
strings (the costliest to scan), an 8 MB token-id prompt, 8 MB of ``stop_token_ids``,
8 MB to ``/detokenize``, and three 8 MB text prompts with a small text request sent
after them (its latency is printed too).

    python scripts/bench_front_door.py            # all attacks
    python scripts/bench_front_door.py --attacks request-line,text-prompts
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import yaml

VOCAB = 4096
SPECIALS = ["<unk>", "<pad>", "</s>"]
STREAM_TOKENS = 100
BIG = 8_000_000  # bytes: under the default server.max_body_bytes (8 MiB)
ATTACK_TIMEOUT_S = 60.0


def build_word_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + [f"w{i}" for i in range(len(SPECIALS), VOCAB)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(path)
    return path


def start_server(tmp: Path) -> tuple[subprocess.Popen, str]:
    cfg = {"model": {"name": "word-model", "tokenizer": str(build_word_tokenizer(tmp / "tok"))},
           "runner": {"kind": "fake", "vocab_size": VOCAB, "step_time_ms": 10, "clock": "wall",
                      "eos_token_id": 2},
           "cache": {"block_size": 16, "num_blocks": 2048},
           "scheduler": {"max_num_seqs": 64, "max_model_len": 2048, "max_num_batched_tokens": 2048},
           "server": {"port": 0}}
    path = tmp / "serve.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "schedkit.cli", "serve", str(path)],
                            stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            return proc, m.group(1)
    raise SystemExit("the server did not start")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# -- the victim and the prober ---------------------------------------------------------------
def stream_once(url: str) -> float:
    body = {"prompt": [7, 8, 9], "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                break
    return time.perf_counter() - t0


def probe_health(url: str, pid: int, stop: threading.Event, worst: list[float]) -> None:
    """``worst``: the longest /health answer, and the server's largest RSS."""
    with httpx.Client(base_url=url, timeout=120) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get("/health")
            worst[0] = max(worst[0], time.perf_counter() - t0)
            worst[1] = max(worst[1], rss_mib(pid))
            stop.wait(0.02)


# -- the attacks: each returns what it got -----------------------------------------------------
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


def raw_head(url: str, head: bytes) -> str:
    """Send all of ``head`` (an attacker does not stop for the answer), then read it."""
    sock = socket.create_connection(_address(url))
    view = memoryview(head)
    try:
        while view:
            view = view[sock.send(view[:1 << 20]):]
    except (BrokenPipeError, ConnectionResetError):
        pass
    return _status_of(sock)


def slow_head(url: str) -> str:
    sock = socket.create_connection(_address(url))
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


def post(url: str, path: str, body: bytes) -> str:
    try:
        r = httpx.post(url + path, content=body, headers={"Content-Type": "application/json"},
                       timeout=ATTACK_TIMEOUT_S)
    except httpx.TimeoutException:
        return f"no answer in {ATTACK_TIMEOUT_S:g} s"
    return str(r.status_code)


def surrogate_body() -> bytes:
    strings = b",".join([b'"w7"'] * ((5_000_000 - 40) // 5))
    return b'{"prompt": "w7", "stop": [' + strings + b', "\\ud800"]}'


def ids_body(field: str, base: dict) -> bytes:
    """``base`` with ``field``: 8 MB of token ids."""
    ids = b",".join([b"1234"] * (BIG // 5))
    head = json.dumps({**base, field: []}).encode()
    return head[:-2] + ids + b"]}"


def text_prompts(url: str, small_latency: list[float]) -> str:
    """Three 8 MB text prompts at once, then a small text request: its latency."""
    text = json.dumps({"prompt": "w7 " * (BIG // 3 - 10), "max_tokens": 1}).encode()
    statuses: list[str] = []
    threads = [threading.Thread(target=lambda: statuses.append(post(url, "/v1/completions", text)))
               for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # the big ones are in
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"prompt": "w7 w8", "max_tokens": 1}, timeout=120)
    small_latency.append(time.perf_counter() - t0)
    for t in threads:
        t.join()
    return ",".join(sorted(set(statuses))) + f" (small: {r.status_code})"


def attacks(small_latency: list[float]) -> dict[str, Callable[[str], str]]:
    return {
        "request-line": lambda u: raw_head(u, b"GET /" + b"a" * (48 << 20)),
        "headers": lambda u: raw_head(u, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (48 << 20)),
        "slow-headers": slow_head,
        "surrogate-5mb": lambda u: post(u, "/v1/completions", surrogate_body()),
        "token-id-prompt-8mb": lambda u: post(u, "/v1/completions", ids_body("prompt", {"max_tokens": 1})),
        "stop_token_ids-8mb": lambda u: post(u, "/v1/completions",
                                             ids_body("stop_token_ids", {"prompt": [7], "max_tokens": 1})),
        "detokenize-8mb": lambda u: post(u, "/detokenize", ids_body("tokens", {})),
        "text-prompts-3x8mb": lambda u: text_prompts(u, small_latency),
    }


def run_attack(url: str, pid: int, attack: Callable[[str], str], alone: float) -> dict:
    rss_before = rss_mib(pid)
    stop, worst, got = threading.Event(), [0.0, rss_before], []
    prober = threading.Thread(target=probe_health, args=(url, pid, stop, worst))
    prober.start()
    attacker = threading.Thread(target=lambda: got.append(attack(url)))
    timer = threading.Timer(0.2, attacker.start)
    timer.start()
    took = stream_once(url)
    timer.join()
    attacker.join()
    stop.set()
    prober.join()
    return {"stream_s": round(took, 2), "vs_alone": round(took / alone, 2),
            "health_max_ms": round(worst[0] * 1e3), "status": got[0] if got else "?",
            "rss_mib": f"{rss_before:.0f} / {worst[1]:.0f} / {rss_mib(pid):.0f}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attacks", default="", help="comma-separated names (default: all)")
    args = p.parse_args()
    small: list[float] = []
    table = attacks(small)
    names = [n for n in args.attacks.split(",") if n] or list(table)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(Path(tmp))
        try:
            stream_once(url)  # warm-up
            alone = statistics.median(stream_once(url) for _ in range(3))
            print(json.dumps({"attack": "none", "stream_s": round(alone, 2)}), flush=True)
            for name in names:
                row = {"attack": name, **run_attack(url, proc.pid, table[name], alone)}
                if name == "text-prompts-3x8mb" and small:
                    row["small_request_s"] = round(small[-1], 2)
                print(json.dumps(row), flush=True)
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
