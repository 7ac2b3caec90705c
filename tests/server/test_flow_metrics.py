"""The front door's series on /metrics (``flow_control.enabled``): requests held now by
band and by tenant while the engine is saturated, refusals counted by reason once held
requests time out, and label values that stay bounded whatever tenants and priorities
clients send."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from schedkit.server.flow_metrics import MAX_BAND_LABELS
from schedkit.server.metrics import ServerMetrics
from tests.server.conftest import LiveServer, metric, server_config

httpx = pytest.importorskip("httpx")

DOOR = {"enabled": True, "plugins": [{"name": "queue-depth", "settings": {"max_waiting": 0}}]}


def wait_for(server: LiveServer, what: Any, timeout: float = 20.0) -> dict[str, float]:
    """Scrape until ``what(stats)`` holds; returns that scrape."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        if what(stats):
            return stats
        assert time.monotonic() < deadline, f"not seen on /metrics within {timeout} s"
        time.sleep(0.02)


def samples(metrics: ServerMetrics) -> dict[str, float]:
    out = {}
    for line in metrics.render().decode().splitlines():
        if line.startswith("schedkit:flow_"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_band_and_tenant_labels_are_capped_and_stay_once_given():
    """30 bands and 30 tenants held: band 0 and the next 15 bands seen keep their label,
    the others sum under "other"; so do the tenants past max_tenant_labels. Once nothing
    is held every label given reads 0; refusal reasons and each plugin's hook errors are
    there at 0 from the start."""
    m = ServerMetrics("m", "fcfs", [], max_tenant_labels=2)
    flow = {"fairness": "tenant-weighted", "saturation": "queue-depth",
            "plugin_hooks": [["tenant-weighted", ["schedkit_flow_pick_tenant"]],
                             ["queue-depth", ["schedkit_flow_saturated"]]],
            "num_queued": 30, "num_outstanding": 4, "saturated": True, "num_dispatched": 9, "num_held": 40,
            "num_refused": {"timeout": 2}, "num_hook_errors": [["tenant-weighted", "schedkit_flow_pick_tenant", 1]],
            "num_queued_by_band": {b: 1 for b in range(-5, 25)},
            "num_queued_by_tenant": {f"t{i}": 1 for i in range(30)}}
    m.engine.stats = {"flow_control": flow}
    busy = samples(m)
    bands = {k: v for k, v in busy.items() if k.startswith("schedkit:flow_num_requests_held{")}
    assert len(bands) == MAX_BAND_LABELS + 1 and sum(bands.values()) == 30
    assert metric(busy, "schedkit:flow_num_requests_held", band="other") == 30 - MAX_BAND_LABELS
    assert metric(busy, "schedkit:flow_num_requests_held", band="-5") == 1
    assert metric(busy, "schedkit:flow_num_requests_held", band="0") == 1
    tenants = {k: v for k, v in busy.items() if k.startswith("schedkit:flow_tenant_num_requests_held{")}
    assert len(tenants) == 3 and metric(busy, "schedkit:flow_tenant_num_requests_held", tenant="other") == 28
    assert metric(busy, "schedkit:flow_saturated") == 1
    assert metric(busy, "schedkit:flow_requests_refused_total", reason="timeout") == 2
    assert metric(busy, "schedkit:flow_requests_refused_total", reason="full") == 0
    assert metric(busy, "schedkit:flow_hook_errors_total", plugin="tenant-weighted") == 1
    assert [v for k, v in busy.items() if k.startswith("schedkit:flow_hook_errors_total{")
            and 'plugin="queue-depth"' in k and 'hook="schedkit_flow_saturated"' in k] == [0]
    m.engine.stats = {"flow_control": flow | {"num_queued": 0, "num_queued_by_band": {}, "num_queued_by_tenant": {},
                                              "saturated": False}}
    idle = samples(m)
    assert {k for k in idle if "num_requests_held{" in k} == {k for k in busy if "num_requests_held{" in k}
    assert metric(idle, "schedkit:flow_num_requests_held") == 0
    assert metric(idle, "schedkit:flow_tenant_num_requests_held") == 0
    m.engine.stats = {}
    assert samples(m) == {}  # flow control off: no flow series


def test_a_saturated_server_shows_what_it_holds_and_counts_refusals(serve, word_tokenizer):
    """One engine running one request at a time (max_num_seqs 1, max_waiting 0): while a
    long request runs, three more are held (two in band 0 for tenant bob, one in band 3);
    /metrics shows them by band and tenant with the detector saturated, and once they are
    held past queue_timeout_s each is a 429 counted as a timeout refusal."""
    s = serve(server_config(word_tokenizer, runner={"step_time_ms": 20}, scheduler={"max_num_seqs": 1},
                            flow_control={**DOOR, "queue_timeout_s": 1.0}))
    base = "schedkit:flow_num_requests_held"
    idle = s.stats()
    assert metric(idle, base, band="0") == 0 and metric(idle, "schedkit:flow_saturated") == 0
    assert metric(idle, "schedkit:flow_requests_refused_total", reason="timeout") == 0
    assert metric(idle, "schedkit:flow_requests_refused_total", reason="full") == 0
    assert any(k.startswith("schedkit:flow_info{") and 'fairness="tenant-round-robin"' in k
               and 'saturation="queue-depth"' in k for k in idle)

    def post(body: dict[str, Any]) -> httpx.Response:
        with s.client() as c:
            return c.post("/v1/completions", json={"prompt": "w7 w8", **body})

    with ThreadPoolExecutor(4) as pool:
        # 120 steps of 20 ms: the engine stays busy well past the others' timeout
        long = pool.submit(post, {"max_tokens": 120, "ignore_eos": True, "user": "alice"})
        wait_for(s, lambda st: metric(st, "schedkit:flow_num_requests_outstanding") == 1)
        held = [pool.submit(post, {"max_tokens": 2, "user": "bob"}) for _ in range(2)]
        held.append(pool.submit(post, {"max_tokens": 2, "user": "carol", "priority": 3}))
        during = wait_for(s, lambda st: metric(st, base) == 3)
        assert metric(during, base, band="0") == 2 and metric(during, base, band="3") == 1
        assert metric(during, "schedkit:flow_tenant_num_requests_held", tenant="bob") == 2
        assert metric(during, "schedkit:flow_tenant_num_requests_held", tenant="carol") == 1
        assert metric(during, "schedkit:flow_saturated") == 1
        refused = [f.result() for f in held]
        assert long.result().status_code == 200
    assert [r.status_code for r in refused] == [429, 429, 429], [r.text for r in refused]
    assert all("flow_control.queue_timeout_s" in r.json()["error"]["message"] for r in refused)
    after = s.stats()
    assert metric(after, "schedkit:flow_requests_refused_total", reason="timeout") == 3
    assert metric(after, "schedkit:flow_requests_refused_total", reason="full") == 0
    assert metric(after, "schedkit:http_request_errors_total", status="429") == 3
    assert metric(after, "schedkit:flow_requests_held_total") == 3
    assert metric(after, "schedkit:flow_requests_dispatched_total") == 1
    assert metric(after, base) == 0 and metric(after, "schedkit:flow_tenant_num_requests_held") == 0
    assert metric(after, "schedkit:flow_num_requests_outstanding") == 0
    # the detector's last answer: asked again when the next request arrives
    assert post({"max_tokens": 2}).status_code == 200
    after = s.stats()
    assert metric(after, "schedkit:flow_saturated") == 0
    assert metric(after, "schedkit:flow_requests_dispatched_total") == 2
    assert metric(after, "schedkit:flow_hook_errors_total") == 0
    # at 0 from the start, one series per plugin and hook
    assert [v for k, v in after.items() if k.startswith("schedkit:flow_hook_errors_total{")
            and 'plugin="queue-depth"' in k and 'hook="schedkit_flow_saturated"' in k] == [0]


NUM_TENANTS = 10_000
MAX_TENANT_LABELS = 8


@pytest.mark.slow  # 10,000 HTTP requests
def test_ten_thousand_tenants_keep_the_flow_series_bounded(serve, word_tokenizer):
    """10,000 distinct tenants, each with its own priority among 40, through a saturated
    door (32 clients, 4 running, none queued in the engine): every request is served; the
    tenant labels are the first 8 tenants plus "other", the band labels at most the first
    16 bands seen held plus "other", and after the first 1,000 tenants no series but a
    band's is added."""
    s = serve(server_config(word_tokenizer, runner={"step_time_ms": 1}, scheduler={"max_num_seqs": 4},
                            server={"max_tenant_labels": MAX_TENANT_LABELS}, flow_control=DOOR))
    seen_held: list[float] = []
    scrapes: dict[int, set[str]] = {}

    async def run() -> list[int]:
        statuses: list[int] = []
        next_id = iter(range(NUM_TENANTS))
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
            async def client() -> None:
                for i in next_id:
                    r = await c.post("/v1/completions", json={"prompt": "w7 w8", "max_tokens": 1,
                                                              "user": f"tenant-{i}", "priority": i % 40})
                    statuses.append(r.status_code)
                    if i % 1000 == 999:
                        text = (await c.get("/metrics")).text
                        keys = {line.rpartition(" ")[0] for line in text.splitlines()
                                if line and not line.startswith("#")}
                        scrapes[i + 1] = keys
                        seen_held.append(sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                                             if line.startswith("schedkit:flow_num_requests_held{")))

            await asyncio.gather(*(client() for _ in range(32)))
        return statuses

    statuses = asyncio.run(run())
    assert len(statuses) == NUM_TENANTS and set(statuses) == {200}
    assert any(seen_held), "the door never held a request: the test did not saturate it"
    final = set(s.stats())
    flow_tenants = {k for k in final if k.startswith("schedkit:flow_tenant_num_requests_held{")}
    assert len(flow_tenants) == MAX_TENANT_LABELS + 1 and any('tenant="other"' in k for k in flow_tenants)
    for name in ("schedkit:tenant_prompt_tokens_total{", "schedkit:tenant_generation_tokens_total{"):
        assert len({k for k in final if k.startswith(name)}) == MAX_TENANT_LABELS + 1, name
    bands = {k for k in final if k.startswith("schedkit:flow_num_requests_held{")}
    assert 1 <= len(bands) <= MAX_BAND_LABELS + 1
    # only band labels (the first 16 bands seen held) may have come after the first 1,000
    grew = sorted(final - scrapes[1000])
    assert all(k.startswith("schedkit:flow_num_requests_held{") for k in grew), grew[:10]
    assert len(final) < 600, len(final)
