"""Scheduler and connector together, with vLLM's MockKVConnector: a connector that always
has ``m`` more tokens, loading them synchronously or asynchronously
(docs/scheduler-behaviour.md#connector-sync-load and the items after it)."""

from __future__ import annotations

import pytest

from schedkit import hookimpl
from schedkit.config import config_from_dict
from schedkit.core.outputs import KVConnectorOutput
from schedkit.core.request import RequestStatus
from schedkit.kv.connector import KVConnectorBase
from schedkit.plugins.testing import (
    drive_engine,
    make_requests,
    make_scheduler,
    runner_output,
    step,
)


class MockKV(KVConnectorBase):
    """Always answers ``(m, load_async)``; its metadata lists the new and resumed
    requests of the step."""

    def __init__(self, role, config, m, load_async):
        super().__init__(role, config)
        self.m, self.load_async = m, load_async
        self.loading: set[str] = set()

    def get_num_new_matched_tokens(self, request, num_local_hit_tokens):
        return self.m, self.load_async and self.m > 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if self.load_async and num_external_tokens:
            self.loading.add(request.request_id)

    def build_connector_meta(self, scheduler_output):
        cached = scheduler_output.scheduled_cached_reqs
        return [r.req_id for r in scheduler_output.scheduled_new_reqs] + [
            r for r in cached.req_ids if r in cached.resumed_req_ids]


class MockKVPlugin:
    def __init__(self, m, load_async):
        self.m, self.load_async = m, load_async
        self.connector = None

    @hookimpl
    def schedkit_create_kv_connector(self, role, config):
        self.connector = MockKV(role, config, self.m, self.load_async)
        return self.connector


def mock_scheduler(m, load_async, **kw):
    plugin = MockKVPlugin(m, load_async)
    sched = make_scheduler(enable_prefix_caching=True, plugins=[plugin], **kw)
    return sched, plugin.connector


def finish_loads(sched, connector):
    """(async loads) One step that parks the requests, then one reporting their loads done."""
    out = sched.schedule()
    assert not out.num_scheduled_tokens and not sched.running
    ro = runner_output(out, {})
    ro.kv_connector_output = KVConnectorOutput(finished_recving=set(connector.loading))
    connector.loading.clear()
    sched.update_from_output(out, ro)


def test_kv_connector_unable_to_allocate():  # docs/scheduler-behaviour.md#connector-alloc-failure
    sched, _ = mock_scheduler(8, False, block_size=4, num_blocks=10)
    r0, r1 = make_requests(2, num_tokens=24, max_tokens=2)
    sched.add_request(r0)
    sched.add_request(r1)
    out = step(sched, sampled=1000).scheduler_output
    assert out.kv_connector_metadata == ["0"] and out.num_scheduled_tokens == {"0": 16}
    assert len(sched.running) == 1 and len(sched.waiting) == 1
    while sched.running:  # the other request is never admitted meanwhile
        out = step(sched, sampled=1000).scheduler_output
        assert "1" not in out.num_scheduled_tokens
    assert sched.kv_cache_manager.num_free_blocks == 9 and len(sched.waiting) == 1
    out = step(sched, sampled=1000).scheduler_output
    assert out.kv_connector_metadata == ["1"] and out.num_scheduled_tokens == {"1": 16}
    while sched.running:
        step(sched, sampled=1000)
    assert sched.kv_cache_manager.num_free_blocks == 9 and not sched.waiting


@pytest.mark.parametrize("load_async", [False, True])
def test_kv_connector_handles_preemption(load_async):  # docs/scheduler-behaviour.md#connector-preemption
    sched, connector = mock_scheduler(2, load_async, block_size=2, num_blocks=7)
    r0, r1 = make_requests(2, num_tokens=5, max_tokens=4)
    sched.add_request(r0)
    sched.add_request(r1)
    if load_async:
        finish_loads(sched, connector)
    kv = sched.kv_cache_manager
    out = step(sched, sampled=1000).scheduler_output
    assert sorted(out.kv_connector_metadata) == ["0", "1"]
    assert out.num_scheduled_tokens == {"0": 3, "1": 3}
    assert len(sched.running) == 2 and kv.num_free_blocks == 0
    out = step(sched, sampled=1000).scheduler_output
    assert out.num_scheduled_tokens == {"0": 1, "1": 1} and out.kv_connector_metadata == []
    out = step(sched, sampled=1000).scheduler_output  # r0 needs a 4th block: the tail, r1, is preempted
    assert out.num_scheduled_tokens == {"0": 1} and out.preempted_req_ids == {"1"}
    assert len(sched.running) == 1 and len(sched.waiting) == 1
    out = step(sched, sampled=1000).scheduler_output  # r1 needs 2 free-listed hits + 2 new blocks; only 2 are free
    assert out.num_scheduled_tokens == {"0": 1} and len(sched.waiting) == 1
    assert r0.status is RequestStatus.FINISHED_LENGTH_CAPPED and kv.num_free_blocks == 6
    if load_async:
        finish_loads(sched, connector)
    out = step(sched, sampled=1000).scheduler_output
    assert out.kv_connector_metadata == ["1"]
    assert out.scheduled_cached_reqs.resumed_req_ids == {"1"}
    assert out.num_scheduled_tokens == {"1": 1}
    assert len(sched.running) == 1 and not sched.waiting
    step(sched, sampled=1000)
    assert r1.status is RequestStatus.FINISHED_LENGTH_CAPPED and kv.num_free_blocks == 6


def test_invalid_blocks_evicted_prevents_cache_pollution():  # docs/scheduler-behaviour.md#load-bad-blocks-fail
    sched, _ = mock_scheduler(1584, False, max_num_batched_tokens=64, kv_load_failure_policy="fail")
    (req,) = make_requests(1, num_tokens=1600)
    sched.add_request(req)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0": 16}
    kv = sched.kv_cache_manager
    table = list(kv.get_block_ids("0"))
    assert len(table) == 100
    hashes = [kv.block_pool.block_hash(b) for b in table]
    assert all(h is not None for h in hashes)  # cached at allocation (a synchronous load)
    ro = runner_output(out, {"0": [0]})
    ro.kv_connector_output = KVConnectorOutput(invalid_block_ids={table[50]})
    outs = sched.update_from_output(out, ro)
    assert [o.finish_reason for o in outs[0].outputs] == ["error"]
    assert req.status is RequestStatus.FINISHED_ERROR and "0" not in sched.requests
    pool = kv.block_pool
    for i, b in enumerate(table):
        if i < 50:
            assert pool.block_hash(b) == hashes[i] and pool.get_cached_block(hashes[i]) == b
        else:
            assert pool.block_hash(b) is None and pool.get_cached_block(hashes[i]) is None


@pytest.mark.parametrize("load_async", [False, True])
def test_external_prefix_cache_metrics_without_local_cache(load_async):  # docs/scheduler-behaviour.md#connector-stats (no local cache)
    plugin = MockKVPlugin(4, load_async)
    sched = make_scheduler(enable_prefix_caching=False, plugins=[plugin])
    for r in make_requests(2, num_tokens=8, max_tokens=2):
        sched.add_request(r)
    out = sched.schedule()  # the step that admits them, or starts their loads
    outs = sched.update_from_output(out, runner_output(out, {r: [1000] for r in out.num_scheduled_tokens}))
    stats = outs[0].scheduler_stats.connector_prefix_cache_stats
    assert (stats.queries, stats.hits, stats.requests, stats.preempted_requests) == (16, 8, 2, 0)
    assert outs[0].scheduler_stats.prefix_cache_stats is None  # no local cache


@pytest.mark.parametrize("load_async", [False, True])
def test_external_prefix_cache_metrics_with_local_cache(load_async):  # docs/scheduler-behaviour.md#connector-stats (local cache)
    sched, connector = mock_scheduler(32, load_async)
    (first,) = make_requests(1, num_tokens=64, max_tokens=2)
    connector.m = 0  # the first request computes everything and fills the local cache
    sched.add_request(first)
    while sched.has_requests():
        step(sched, sampled=1000)
    connector.m = 32
    sched.add_request(make_requests(1, num_tokens=128, max_tokens=2)[0])
    out = sched.schedule()
    outs = sched.update_from_output(out, runner_output(out, {r: [1000] for r in out.num_scheduled_tokens}))
    stats = outs[0].scheduler_stats
    local, ext = stats.prefix_cache_stats, stats.connector_prefix_cache_stats
    assert (local.queries, local.hits) == (128, 64)
    assert (ext.queries, ext.hits, ext.requests, ext.preempted_requests) == (64, 32, 1, 0)


@pytest.mark.parametrize("answer", [(-1, False), (0, True), (11, False), (10, False), (11, True)])
def test_impossible_connector_answers_fail_only_that_request(answer):
    """A connector answering a negative count, more tokens than the prompt has (a
    synchronous load must leave one to compute), or an asynchronous load of nothing: a
    PluginError naming it; the engine fails that request and goes on serving the others."""
    from schedkit.core.request import Request, SamplingParams
    from schedkit.engine.core import EngineCore

    class Liar(KVConnectorBase):
        def get_num_new_matched_tokens(self, request, num_local_hit_tokens):
            return answer if request.request_id == "bad" else (0, False)

    class LiarPlugin:
        @hookimpl
        def schedkit_create_kv_connector(self, role, config):
            return Liar(role, config)

    config = config_from_dict({"runner": {"kind": "fake", "vocab_size": 100}})
    engine = EngineCore(config, extra_plugins=[LiarPlugin()])
    reqs = [Request(rid, list(range(1, 11)), SamplingParams(max_tokens=3), 0.0) for rid in ("bad", "good")]
    _, errors = drive_engine(engine, reqs)
    assert set(errors) == {"bad"} and "get_num_new_matched_tokens" in errors["bad"]
    assert reqs[0].status is RequestStatus.FINISHED_ERROR
    assert reqs[1].status is RequestStatus.FINISHED_LENGTH_CAPPED


@pytest.mark.parametrize("load_async", [False, True])
def test_kv_connector_basic(load_async):  # docs/scheduler-behaviour.md#connector-sync-load
    sched, connector = mock_scheduler(32, load_async)
    kv = sched.kv_cache_manager
    total = kv.num_free_blocks
    for num_tokens, local_hit, blocks in ((64, 0, 4), (128, 64, 8)):  # set 2 extends set 1
        reqs = make_requests(2, num_tokens=num_tokens, max_tokens=3)
        for r in reqs:
            sched.add_request(r)
        if load_async:
            finish_loads(sched, connector)
        out = step(sched, sampled=1000).scheduler_output
        assert sorted(out.kv_connector_metadata) == ["0", "1"]
        assert out.num_scheduled_tokens == {"0": num_tokens - local_hit - 32, "1": num_tokens - local_hit - 32}
        for r in reqs:
            assert len(kv.get_block_ids(r.request_id)) == blocks
            assert len(r.block_hashes) == blocks
            assert all(kv.block_pool.block_hash(b) is not None for b in kv.get_block_ids(r.request_id))
        assert kv.num_free_blocks == total - 2 * blocks
        while sched.running:
            out = step(sched, sampled=1000).scheduler_output
            assert set(out.num_scheduled_tokens.values()) <= {1} and out.kv_connector_metadata == []
        sched.schedule()
        assert kv.num_free_blocks == total


def test_remote_decode_lifecycle_on_the_prefill_side():  # docs/scheduler-behaviour.md#prefill-side
    class PrefillSide(KVConnectorBase):
        """Keeps a finished request's blocks until they are sent (Nixl's P side)."""

        def request_finished(self, request, block_ids):
            if request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
                return True, {"remote_block_ids": list(block_ids)}
            return False, None

    class Plugin:
        @hookimpl
        def schedkit_create_kv_connector(self, role, config):
            return PrefillSide(role, config)

    sched = make_scheduler(enable_prefix_caching=True, max_num_batched_tokens=64, plugins=[Plugin()])
    (req,) = make_requests(1, num_tokens=40, max_tokens=1)
    sched.add_request(req)
    out = sched.schedule()
    outs = sched.update_from_output(out, runner_output(out, {"0": [0]}))
    (o,) = outs[0].outputs
    assert o.finish_reason == "length" and o.kv_transfer_params == {"remote_block_ids": [1, 2, 3]}
    assert req.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert "0" in sched.finished_req_ids and not sched.running and not sched.waiting
    assert "0" in sched.requests  # held for the transfer
    kv = sched.kv_cache_manager
    assert [kv.block_pool.ref_cnt(b) for b in kv.get_block_ids("0")] == [1, 1, 1]
    out = sched.schedule()
    assert out.finished_req_ids == {"0"} and not out.num_scheduled_tokens
    assert not sched.finished_req_ids and "0" in sched.requests and sched.has_requests()
    sched.update_from_output(out, runner_output(out, {}))
    out = sched.schedule()
    ro = runner_output(out, {})
    ro.kv_connector_output = KVConnectorOutput(finished_sending={"0"})
    sched.update_from_output(out, ro)
    assert not sched.requests and not sched.has_requests()
    assert kv.num_free_blocks == kv.num_blocks - 1
