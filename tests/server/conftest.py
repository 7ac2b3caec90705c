"""A live ``schedkit serve`` on 127.0.0.1 for the server tests.

The server runs as its own process, started the way a user starts it (the CLI, a YAML
file, port 0), on the fake runner with a small word-level tokenizer built here: token
``k`` is the word ``wk`` (ids 0-5 are specials), so text in and out is real text.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

VOCAB = 512
SPECIALS = ["<unk>", "<pad>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
EOS = 2
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
_LISTENING = re.compile(r"listening on (http://[\d.]+:\d+)")
_LABELS = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def build_word_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + [f"w{i}" for i in range(len(SPECIALS), VOCAB)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>",
                                   pad_token="<pad>", additional_special_tokens=SPECIALS[3:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def word_tokenizer(tmp_path_factory) -> Path:
    return build_word_tokenizer(tmp_path_factory.mktemp("word-tokenizer"))


@dataclass
class LiveServer:
    url: str
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30.0, **kw)

    def stats(self) -> dict[str, float]:
        """The /metrics samples without labels' detail: ``name{labels} -> value``."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def server_config(tokenizer: Path | None, **sections: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": {"name": "word-model", **({"tokenizer": str(tokenizer)} if tokenizer else {})},
        "runner": {"kind": "fake", "vocab_size": VOCAB, "step_time_ms": 2, "clock": "wall",
                   "eos_token_id": EOS},  # the fake runner then never emits EOS by chance
        "cache": {"block_size": 16, "num_blocks": 512},
        "scheduler": {"max_num_seqs": 64, "max_model_len": 512, "max_num_batched_tokens": 512},
        "server": {"port": 0, "drain_grace_s": 2},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values} if isinstance(values, dict) else values
    return cfg


def start_server(tmp_path: Path, cfg: dict[str, Any], *args: str, env: dict[str, str] | None = None,
                 timeout: float = 60.0) -> LiveServer:
    """Run ``schedkit serve`` on ``cfg`` and wait for its listening line."""
    path = tmp_path / f"serve-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log_path = path.with_suffix(".log")
    log = log_path.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "schedkit.cli", "serve", str(path), *args],
                            stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, **(env or {})})
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    url = None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = _LISTENING.search(line)
        if m:
            url = m.group(1)
            break
    if url is None:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the server did not start:\n{log_path.read_text()}")
    return LiveServer(url, proc, log_path)


@pytest.fixture
def serve(tmp_path) -> Iterator[Any]:
    """``serve(cfg, *args)`` starts a server; every one started is stopped afterwards."""
    started: list[LiveServer] = []

    def _start(cfg: dict[str, Any], *args: str, **kw: Any) -> LiveServer:
        s = start_server(tmp_path, cfg, *args, **kw)
        started.append(s)
        return s

    yield _start
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
        s.proc.wait(10)


@pytest.fixture(scope="module")
def live(tmp_path_factory, word_tokenizer) -> Iterator[LiveServer]:
    """One server shared by a module's tests (they must leave it serving)."""
    s = start_server(tmp_path_factory.mktemp("live"), server_config(word_tokenizer))
    yield s
    stop_server(s)


def stop_server(s: LiveServer) -> None:
    """SIGTERM (the server drains), then SIGKILL after 30 s."""
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGTERM)
        try:
            s.proc.wait(30)
        except subprocess.TimeoutExpired:
            s.proc.kill()
            s.proc.wait()


def metric(stats: dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for key, value in stats.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        have = dict(_LABELS.findall(rest))
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total
