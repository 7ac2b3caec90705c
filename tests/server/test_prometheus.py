"""A real Prometheus scrapes a live server under load, and its queries agree with what
the clients saw: the request and token counters exactly, the TTFT and E2E medians
within a histogram bucket.

Needs the ``prometheus`` binary (``apt-get install prometheus``): without it the test
skips, except in CI (``CI=1``), where it fails.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from schedkit.server.metrics import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from tests.server.conftest import EOS, server_config

pytestmark = pytest.mark.slow  # a real Prometheus

NUM_REQUESTS = 240
CONCURRENCY = 16  # light enough that neither event loop lags the latencies much
MAX_TOKENS = 100  # 100 steps of 5 ms and a little: an E2E of about 0.55 s
PROMPT = "w7 w8 w9 w10 w11 w12 w13 w14"
PROMPT_LEN = 8
MISSING = "the prometheus binary is not on PATH (install it: apt-get install prometheus)"


def in_ci() -> bool:
    """CI sets ``CI`` (.ci/run exports CI=1, as hosted CI services do)."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus process on loopback with a scrape config of its own."""

    def __init__(self, binary: str, workdir: Path, target: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "schedkit", "scrape_interval": "1s", "scrape_timeout": "1s",
                                "metrics_path": "/metrics", "static_configs": [{"targets": [target]}]}],
        }))
        self.log_path = workdir / "prometheus.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"prometheus was not ready in {timeout} s:\n{self.log()}")

    def query(self, promql: str) -> list[dict]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (promql, body)
        return body["data"]["result"]

    def scalar(self, promql: str) -> float | None:
        """The value of a query that gives one series (None when it gives none)."""
        result = self.query(promql)
        if not result:
            return None
        assert len(result) == 1, (promql, result)
        return float(result[0]["value"][1])

    def wait_for(self, promql: str, want: float, timeout: float = 15.0) -> float | None:
        """Query until ``promql`` equals ``want`` (a scrape or two later); the last value."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.scalar(promql)
            if value == want:
                return value
            time.sleep(0.2)
        return value

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture
def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        if in_ci():
            pytest.fail(f"{MISSING}; CI must run this test", pytrace=False)
        pytest.skip(MISSING)
    return binary


@pytest.fixture
def prometheus(prometheus_binary, tmp_path) -> Iterator[object]:
    """``prometheus(target)`` starts one scraping ``host:port`` (not waiting for it to
    be ready); every one started is killed at teardown."""
    started: list[Prometheus] = []

    def _start(target: str) -> Prometheus:
        workdir = tmp_path / f"prometheus-{len(started)}"
        workdir.mkdir()
        p = Prometheus(prometheus_binary, workdir, target)
        started.append(p)
        return p

    yield _start
    for p in started:
        p.stop()


def bucket_index(bounds: tuple[float, ...], value: float) -> int:
    """The index of the histogram bucket ``(bounds[i-1], bounds[i]]`` holding ``value``
    (``len(bounds)`` for +Inf)."""
    return bisect.bisect_left(bounds, value)


async def load(url: str) -> list[tuple[float, float, int]]:
    """NUM_REQUESTS streams; per request: (TTFT, E2E, tokens) as the client saw them."""
    body = {"model": "word-model", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True,
            "return_token_ids": True}
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    sem = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60.0) as http:
        async def one() -> tuple[float, float, int]:
            async with sem:
                t0 = time.perf_counter()
                first, tokens, finish = None, 0, None
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200, await r.aread()
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        (choice,) = json.loads(line[len("data: "):])["choices"]
                        if choice["token_ids"] and first is None:
                            first = time.perf_counter()
                        tokens += len(choice["token_ids"])
                        finish = choice["finish_reason"] or finish
                end = time.perf_counter()
                assert first is not None and finish == "length", finish
                return first - t0, end - t0, tokens

        return await asyncio.gather(*(one() for _ in range(NUM_REQUESTS)))


def test_prometheus_scrapes_agree_with_the_clients(serve, prometheus, word_tokenizer):
    # Prometheus first: its first scrape comes some 5 s after it starts (its discovery
    # manager's update tick), time in which the server starts on the port it will scrape.
    port = free_port()
    prom = prometheus(f"127.0.0.1:{port}")
    live = serve(server_config(word_tokenizer, runner={"step_time_ms": 5, "eos_token_id": EOS},
                               server={"port": port}))
    prom.wait_ready()
    # A scrape before the load, so increase() sees every request from zero.
    assert prom.wait_for('up{job="schedkit"}', 1.0) == 1.0, prom.log()
    assert prom.scalar("schedkit:time_to_first_token_seconds_count") == 0

    t0 = time.perf_counter()
    seen = asyncio.run(load(live.url))
    elapsed = time.perf_counter() - t0
    assert all(tokens == MAX_TOKENS for _, _, tokens in seen)
    ttft_p50 = statistics.median(t for t, _, _ in seen)
    e2e_p50 = statistics.median(e for _, e, _ in seen)

    # The counters, once a scrape after the load has landed: exactly what the clients saw.
    assert prom.wait_for("sum(schedkit:request_success_total)", NUM_REQUESTS) == NUM_REQUESTS
    assert prom.scalar('sum(schedkit:request_success_total{finished_reason="length"})') == NUM_REQUESTS
    assert prom.wait_for("schedkit:generation_tokens_total", NUM_REQUESTS * MAX_TOKENS) \
        == NUM_REQUESTS * MAX_TOKENS
    assert prom.scalar("schedkit:prompt_tokens_total") == NUM_REQUESTS * PROMPT_LEN
    assert prom.scalar("schedkit:time_to_first_token_seconds_count") == NUM_REQUESTS
    assert prom.scalar('schedkit:num_requests_running{model_name="word-model"}') == 0

    # The medians Prometheus estimates from the buckets: in the client's bucket or next to it.
    window = f"{max(60, math.ceil(time.perf_counter() - t0) + 30)}s"
    ttft_est = prom.scalar("histogram_quantile(0.5, sum by (le) "
                           f"(increase(schedkit:time_to_first_token_seconds_bucket[{window}])))")
    e2e_est = prom.scalar("histogram_quantile(0.5, sum by (le) "
                          f"(increase(schedkit:e2e_request_latency_seconds_bucket[{window}])))")
    assert ttft_est is not None and e2e_est is not None
    print(f"\n{NUM_REQUESTS} requests in {elapsed:.1f} s; TTFT p50 client {ttft_p50 * 1e3:.1f} ms, "
          f"Prometheus {ttft_est * 1e3:.1f} ms; E2E p50 client {e2e_p50 * 1e3:.0f} ms, "
          f"Prometheus {e2e_est * 1e3:.0f} ms")
    for name, bounds, client, est in (("TTFT", TTFT_BUCKETS, ttft_p50, ttft_est),
                                      ("E2E", REQUEST_LATENCY_BUCKETS, e2e_p50, e2e_est)):
        ci, pi = bucket_index(bounds, client), bucket_index(bounds, est)
        assert abs(ci - pi) <= 1, (f"{name} p50: the clients measured {client:.4f} s (bucket {ci}), "
                                   f"Prometheus estimates {est:.4f} s (bucket {pi}) of {bounds}")
