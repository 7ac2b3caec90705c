"""Asynchronous KV loads through a connector and load failures (docs/scheduler-behaviour.md,
section "KV connectors and async loads").

The connector here behaves like vLLM's NixlConnector on the decode side of disaggregated
prefill: a request whose id starts with "remote" loads its whole prompt asynchronously,
once; every other request loads nothing. Set-up (docs/scheduler-behaviour.md#setup-connector):
64-token budget, block size 16, prefix caching on.
"""

from __future__ import annotations

import pytest

from schedkit import hookimpl
from schedkit.core.outputs import KVConnectorOutput
from schedkit.core.request import RequestStatus
from schedkit.errors import PluginError
from schedkit.kv.connector import KVConnectorBase
from schedkit.plugins.testing import (
    assert_scheduler_consistent,
    make_request,
    make_scheduler,
    runner_output,
    step,
)

LOADING = RequestStatus.WAITING_FOR_REMOTE_KVS
EOS = 50256


class RemotePrefill(KVConnectorBase):
    def __init__(self, role, config):
        super().__init__(role, config)
        self.loaded: set[str] = set()
        self.queries = 0
        self.allocs: list[tuple[str, int, int]] = []

    def get_num_new_matched_tokens(self, request, num_local_hit_tokens):
        self.queries += 1
        rid = request.request_id
        if not rid.startswith("remote") or rid in self.loaded:
            return 0, False
        n = request.num_prompt_tokens - num_local_hit_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocs.append((request.request_id, len(block_ids), num_external_tokens))
        if num_external_tokens:
            self.loaded.add(request.request_id)


class Plugin:
    connector: RemotePrefill

    @hookimpl
    def schedkit_create_kv_connector(self, role, config):
        self.connector = RemotePrefill(role, config)
        return self.connector


def h4(*extra_plugins, **kw):
    plugin = Plugin()
    kw = {"max_num_batched_tokens": 64, "enable_prefix_caching": True, **kw}
    return make_scheduler(plugins=[plugin, *extra_plugins], **kw), plugin


class FinishObserver:
    def __init__(self):
        self.finished = []

    @hookimpl
    def schedkit_on_request_finished(self, request):
        self.finished.append((request.request_id, request.status))


def prompt(k, n, common=0):
    return [1] * common + [i * k for i in range(n - common)]


def num_waiting(sched):
    return len(sched.waiting) + len(sched.kv_holding)


@pytest.mark.parametrize("num_tokens, blocks, hashed", [(40, 3, 2), (32, 2, 2)])  # docs/scheduler-behaviour.md#load-lifecycle
def test_remote_prefill_lifecycle(num_tokens, blocks, hashed):
    sched, _ = h4()
    kv = sched.kv_cache_manager
    sched.add_request(make_request("remote-1", prompt(1, num_tokens)))
    res = step(sched)
    req = sched.requests["remote-1"]
    assert res.scheduler_output.total_num_scheduled_tokens == 0 and not res.outputs
    assert [r.request_id for r in sched.kv_holding] == ["remote-1"] and not sched.waiting
    assert req.status is LOADING and req.num_computed_tokens == num_tokens
    assert len(kv.get_block_ids("remote-1")) == blocks and kv.get_num_cached_blocks("remote-1") == 0
    assert len(kv.block_pool.cached_block_map) == 0  # nothing is cached before the load lands
    step(sched)  # still loading
    assert req.status is LOADING
    step(sched, kv_connector_output=KVConnectorOutput(finished_recving={"remote-1"}))
    assert "remote-1" in sched.finished_recving_ids
    out = step(sched, sampled={"remote-1": [0]}).scheduler_output
    assert len(sched.running) == 1
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == num_tokens - 1 and out.num_scheduled_tokens == {"remote-1": 1}
    block_ids = kv.get_block_ids("remote-1")
    assert len(block_ids) == blocks and all(kv.block_pool.ref_cnt(b) == 1 for b in block_ids)
    assert kv.get_num_cached_blocks("remote-1") == hashed
    outs = step(sched, sampled={"remote-1": [EOS]}).outputs
    assert outs[0].finish_reason == "stop"
    step(sched)
    assert not sched.has_requests() and kv.num_free_blocks == 9999


def test_no_spurious_prefix_caching():  # docs/scheduler-behaviour.md#load-no-spurious-hits
    sched, _ = h4()
    kv = sched.kv_cache_manager
    sched.add_request(make_request("remote-1", [1] * 40))
    step(sched)
    sched.add_request(make_request("local-1", [1] * 40))
    out = step(sched, sampled={"local-1": [0]}).scheduler_output
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0  # no hit on the loading blocks
    remote, local = kv.get_block_ids("remote-1"), kv.get_block_ids("local-1")
    assert not set(remote) & set(local)
    assert all(kv.block_pool.ref_cnt(b) == 1 for b in remote + local)
    assert all(kv.block_pool.block_hash(b) is None for b in remote)
    assert any(kv.block_pool.block_hash(b) is not None for b in local)


def test_interleaved_lifecycle():  # docs/scheduler-behaviour.md#load-interleaved
    sched, _ = h4()
    sched.add_request(make_request("local-a", prompt(1, 40)))
    out = step(sched, sampled={"local-a": [0]}).scheduler_output
    assert len(sched.running) == 1
    sched.add_request(make_request("local-b", prompt(2, 40)))
    sched.add_request(make_request("remote-r", prompt(3, 40)))
    out = step(sched, sampled={"local-a": [0], "local-b": [0]}).scheduler_output
    assert (len(sched.running), num_waiting(sched)) == (2, 1)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["local-b"] and out.scheduled_cached_reqs.req_ids == ["local-a"]
    for _ in range(2):
        out = step(sched, sampled={"local-a": [0], "local-b": [0]}).scheduler_output
        assert (len(sched.running), num_waiting(sched), len(out.scheduled_new_reqs)) == (2, 1, 0)
        assert len(out.scheduled_cached_reqs.req_ids) == 2
    step(sched, sampled={"local-a": [0], "local-b": [0]},
         kv_connector_output=KVConnectorOutput(finished_recving={"remote-r"}))  # the load lands
    out = step(sched, sampled={"local-a": [EOS], "local-b": [EOS], "remote-r": [EOS]}).scheduler_output
    assert [r.req_id for r in out.scheduled_new_reqs] == ["remote-r"]  # a NEW request
    assert len(out.scheduled_cached_reqs.req_ids) == 2 and len(sched.running) == 0
    step(sched)
    assert not sched.has_requests()


def test_cannot_schedule_after_recv():  # docs/scheduler-behaviour.md#load-then-preempted (5 usable blocks)
    sched, _ = h4(num_blocks=6)
    sched.add_request(make_request("local-n", prompt(1, 32)))
    step(sched, sampled={"local-n": [0]})  # 2 blocks, now 33 tokens
    sched.add_request(make_request("remote-r", prompt(2, 32)))
    step(sched, sampled={"local-n": [0]})  # n gets a 3rd block, r starts loading (2 blocks)
    assert sched.kv_cache_manager.num_free_blocks == 0
    assert (len(sched.running), num_waiting(sched)) == (1, 1)
    step(sched, sampled={"local-n": [0]},
         kv_connector_output=KVConnectorOutput(finished_recving={"remote-r"}))
    assert (len(sched.running), num_waiting(sched)) == (1, 1)
    out = step(sched, sampled={"local-n": [0], "remote-r": [0]}).scheduler_output
    assert out.scheduled_new_reqs[0].num_computed_tokens == 31 and out.num_scheduled_tokens["remote-r"] == 1
    assert (len(sched.running), num_waiting(sched)) == (2, 0)
    out = step(sched, sampled={"local-n": [0]}).scheduler_output  # r needs a 3rd block: it is the FCFS victim itself
    assert (len(sched.running), num_waiting(sched)) == (1, 1)
    assert sched.requests["remote-r"].status is RequestStatus.PREEMPTED
    step(sched, sampled={"local-n": [EOS]})
    assert (len(sched.running), num_waiting(sched)) == (0, 1)
    out = step(sched, sampled={"remote-r": [0]}).scheduler_output
    # resumed from its 2 cached prompt blocks: no second remote load
    assert out.scheduled_cached_reqs.resumed_req_ids == {"remote-r"}
    assert out.scheduled_cached_reqs.num_computed_tokens == [32]
    outs = step(sched, sampled={"remote-r": [EOS]}).outputs
    assert outs[0].finish_reason == "stop"
    step(sched)
    assert not sched.has_requests()


def test_cannot_recv():  # docs/scheduler-behaviour.md#load-cannot-start
    sched, _ = h4(num_blocks=6)
    sched.add_request(make_request("local-n", prompt(1, 32), max_tokens=3))
    step(sched, sampled={"local-n": [0]})
    sched.add_request(make_request("remote-r", prompt(2, 40)))
    step(sched, sampled={"local-n": [0]})  # r needs 3 blocks, 2 are free: no load starts
    assert sched.requests["remote-r"].status is RequestStatus.WAITING
    assert [r.request_id for r in sched.waiting] == ["remote-r"] and not sched.kv_holding
    step(sched, sampled={"local-n": [0]})  # n finishes (length)
    step(sched)
    assert sched.requests["remote-r"].status is LOADING
    step(sched, kv_connector_output=KVConnectorOutput(finished_recving={"remote-r"}))
    step(sched, sampled={"remote-r": [0]})
    assert [r.request_id for r in sched.running] == ["remote-r"]
    step(sched, sampled={"remote-r": [EOS]})
    step(sched)
    assert not sched.has_requests()


def test_loads_take_no_slot_and_kv_holding_is_served_first():  # docs/scheduler-behaviour.md#kv-holding-first
    sched, _ = h4(max_num_seqs=2)
    for rid, k, n in (("local-0", 1, 10), ("remote-1", 2, 40), ("local-2", 3, 10)):
        sched.add_request(make_request(rid, prompt(k, n)))
    out = step(sched, sampled={"local-0": [0], "local-2": [0]}).scheduler_output
    # the load starts without budget or a running slot: local-2 is admitted behind it
    assert list(out.num_scheduled_tokens) == ["local-0", "local-2"]
    assert [r.request_id for r in sched.kv_holding] == ["remote-1"] and not sched.waiting
    sched.add_request(make_request("local-3", prompt(4, 10)))
    step(sched, sampled={"local-0": [0], "local-2": [0]},
         kv_connector_output=KVConnectorOutput(finished_recving={"remote-1"}))  # no free slot
    assert [r.request_id for r in sched.waiting] == ["local-3"]
    sched.finish_requests(["local-0", "local-2"], RequestStatus.FINISHED_ABORTED)
    out = step(sched).scheduler_output
    assert [r.req_id for r in out.scheduled_new_reqs] == ["remote-1", "local-3"]


def test_abort_while_loading_keeps_blocks_until_the_load_ends():  # docs/scheduler-behaviour.md#load-abort
    sched, _ = h4()
    kv = sched.kv_cache_manager
    sched.add_request(make_request("remote-1", prompt(1, 40)))
    step(sched)
    (req,) = sched.finish_requests("remote-1", RequestStatus.FINISHED_ABORTED)
    assert req.status is RequestStatus.FINISHED_ABORTED
    assert "remote-1" in sched.requests and kv.num_free_blocks == 9999 - 3  # the worker writes there
    assert sched.get_num_unfinished_requests() == 0 and sched.has_requests()
    out = step(sched,
               kv_connector_output=KVConnectorOutput(finished_recving={"remote-1"})).scheduler_output
    assert out.finished_req_ids == {"remote-1"}
    assert not sched.requests and kv.num_free_blocks == 9999 and not sched.finished_recving_ids


def test_abort_after_the_load_finished_frees_at_once():  # docs/scheduler-behaviour.md#load-abort
    sched, _ = h4()
    sched.add_request(make_request("remote-1", prompt(1, 40)))
    step(sched)
    step(sched, kv_connector_output=KVConnectorOutput(finished_recving={"remote-1"}))
    sched.finish_requests("remote-1", RequestStatus.FINISHED_ABORTED)
    assert not sched.requests and sched.kv_cache_manager.num_free_blocks == 9999
    assert not sched.finished_recving_ids


def test_failed_load_with_recompute_starts_over():
    sched, plugin = h4(kv_load_failure_policy="recompute")
    kv = sched.kv_cache_manager
    sched.add_request(make_request("remote-1", prompt(1, 40)))
    step(sched)
    step(sched, kv_connector_output=KVConnectorOutput(failed_recving={"remote-1"}))
    req = sched.requests["remote-1"]
    assert req.num_computed_tokens == 0 and "remote-1" in sched.failed_recving_ids
    out = step(sched, sampled={"remote-1": [0]}).scheduler_output
    # promoted with its blocks dropped; the connector loads once, so it prefills locally
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0 and out.num_scheduled_tokens == {"remote-1": 40}
    assert plugin.connector.queries == 2 and not sched.failed_recving_ids
    assert kv.num_free_blocks == 9999 - 3


def test_failed_load_with_fail_policy_finishes_with_an_error():
    observer = FinishObserver()
    sched, _ = h4(observer)
    sched.add_request(make_request("remote-1", prompt(1, 40)))
    sched.add_request(make_request("local-2", prompt(2, 8)))
    step(sched, sampled={"local-2": [0]})
    outs = step(sched, sampled={"local-2": [0]},
                kv_connector_output=KVConnectorOutput(failed_recving={"remote-1"})).outputs
    (err,) = [o for o in outs if o.request_id == "remote-1"]
    assert err.finish_reason == "error" and "failed to load" in err.error
    assert "remote-1" not in sched.requests and sched.kv_cache_manager.num_free_blocks == 9999 - 1
    assert observer.finished == [("remote-1", RequestStatus.FINISHED_ERROR)]
    step(sched, sampled={"local-2": [EOS]})  # the other request is served on
    step(sched)
    assert not sched.has_requests()


def test_a_load_started_in_a_failed_step_is_rolled_back(monkeypatch):
    sched, plugin = h4()
    build_meta = plugin.connector.build_connector_meta
    calls = []

    def fails_once(scheduler_output):
        calls.append(scheduler_output)
        if len(calls) == 1:
            raise RuntimeError("metadata store unavailable")
        return build_meta(scheduler_output)

    monkeypatch.setattr(plugin.connector, "build_connector_meta", fails_once)
    sched.add_request(make_request("local-0", prompt(1, 10)))
    sched.add_request(make_request("remote-1", prompt(2, 40)))
    with pytest.raises(PluginError, match="build_connector_meta"):
        sched.schedule()
    assert_scheduler_consistent(sched)
    assert [r.request_id for r in sched.waiting] == ["local-0", "remote-1"] and not sched.kv_holding
    assert sched.requests["remote-1"].status is RequestStatus.WAITING
    assert sched.kv_cache_manager.num_free_blocks == 9999
    # the scheduler undid its own state; the connector saw update_state_after_alloc for
    # the load that never started, and repairing its own state is up to it
    plugin.connector.loaded.clear()
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["local-0"]
    assert sched.requests["remote-1"].status is LOADING


# -------------------------- per-block load failures (docs/scheduler-behaviour.md#load-bad-blocks)
class MockKV(KVConnectorBase):
    """Every request gets ``ext`` external tokens, once (vLLM's MockKVConnector)."""

    def __init__(self, role, config, ext, load_async):
        super().__init__(role, config)
        self.ext, self.load_async = ext, load_async
        self.queries = 0
        self.loaded: set[str] = set()
        self.never: set[str] = set()

    def get_num_new_matched_tokens(self, request, num_local_hit_tokens):
        self.queries += 1
        if request.request_id in self.loaded or request.request_id in self.never:
            return 0, False
        return self.ext, self.load_async

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if num_external_tokens:
            self.loaded.add(request.request_id)


class MockPlugin:
    def __init__(self, ext=1584, load_async=True):
        self.kw = dict(ext=ext, load_async=load_async)

    @hookimpl
    def schedkit_create_kv_connector(self, role, config):
        self.connector = MockKV(role, config, **self.kw)
        return self.connector


def failure_setup(load_async, policy="recompute"):
    plugin = MockPlugin(load_async=load_async)
    sched = make_scheduler(plugins=[plugin], max_num_batched_tokens=64, enable_prefix_caching=True,
                           kv_load_failure_policy=policy)
    for k in (1, 2, 3):
        sched.add_request(make_request(f"r{k}", [k] * 1600))
    return sched, plugin.connector


def bad_blocks(sched, rid, indices):
    table = sched.kv_cache_manager.get_block_ids(rid)
    return {table[i] for i in indices}


@pytest.mark.parametrize("indices", [{0, 98}, {50, 98}, {98}])
def test_async_load_failure_truncates_and_retries(indices):  # docs/scheduler-behaviour.md#load-bad-blocks
    sched, conn = failure_setup(load_async=True)
    step(sched)
    assert not sched.waiting and len(sched.kv_holding) == 3 and conn.queries == 3
    assert all(r.status is LOADING and r.num_computed_tokens == 1584 for r in sched.kv_holding)
    out = sched.schedule()
    ro = runner_output(out, {})
    ro.kv_connector_output = KVConnectorOutput(finished_recving={"r1", "r3"},
                                               invalid_block_ids=bad_blocks(sched, "r2", indices))
    sched.update_from_output(out, ro)
    assert_scheduler_consistent(sched)
    assert len(sched.kv_holding) == 3 and sched.failed_recving_ids == {"r2"} and conn.queries == 3
    computed = {r.request_id: r.num_computed_tokens for r in sched.kv_holding}
    assert computed == {"r1": 1584, "r2": min(indices) * 16, "r3": 1584}
    out = step(sched).scheduler_output
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [("r1", 1584), ("r3", 1584)]
    assert out.num_scheduled_tokens == {"r1": 16, "r3": 16}


@pytest.mark.parametrize("indices", [{0, 98}, {50, 98}, {98}])
def test_sync_load_failure_recomputes_from_the_first_bad_block(indices):  # docs/scheduler-behaviour.md#load-bad-blocks
    sched, _ = failure_setup(load_async=False)
    out = sched.schedule()
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [
        ("r1", 1584), ("r2", 1584), ("r3", 1584)]
    ro = runner_output(out, {"r1": [EOS], "r2": [EOS], "r3": [EOS]})
    ro.kv_connector_output = KVConnectorOutput(invalid_block_ids=bad_blocks(sched, "r2", indices))
    outs = [o for g in sched.update_from_output(out, ro).values() for o in g.outputs]
    assert_scheduler_consistent(sched)
    assert sorted(o.request_id for o in outs) == ["r1", "r3"]  # no token for r2
    assert [r.request_id for r in sched.running] == ["r2"]
    assert sched.requests["r2"].num_computed_tokens == min(indices) * 16
    assert sched.requests["r2"].num_output_tokens == 0


@pytest.mark.parametrize("indices", [{0, 49}, {25, 49}, {49}])
def test_sync_load_failure_with_shared_blocks(indices):  # docs/scheduler-behaviour.md#load-bad-blocks
    plugin = MockPlugin(load_async=False)
    sched = make_scheduler(plugins=[plugin], max_num_batched_tokens=64, enable_prefix_caching=True,
                           kv_load_failure_policy="recompute")
    plugin.connector.never.add("r2")
    sched.add_request(make_request("r1", [1] * 1600))
    sched.add_request(make_request("r2", [1] * 800 + [2] * 800))
    out = sched.schedule()
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [("r1", 1584), ("r2", 800)]
    ro = runner_output(out, {"r1": [EOS]})
    ro.kv_connector_output = KVConnectorOutput(invalid_block_ids=bad_blocks(sched, "r1", indices))
    sched.update_from_output(out, ro)
    assert_scheduler_consistent(sched)
    assert [r.request_id for r in sched.running] == ["r1", "r2"]
    # r1 claims the shared bad blocks and recomputes them; r2 keeps its count before the step
    assert sched.requests["r1"].num_computed_tokens == min(indices) * 16
    assert sched.requests["r2"].num_computed_tokens == 800


def test_async_progressive_load_failure():  # docs/scheduler-behaviour.md#load-bad-blocks
    plugin = MockPlugin()
    sched = make_scheduler(plugins=[plugin], max_num_batched_tokens=64, enable_prefix_caching=True,
                           kv_load_failure_policy="recompute")
    sched.add_request(make_request("r1", [1] * 1600))
    step(sched)
    table = sched.kv_cache_manager.get_block_ids("r1")
    smallest = 99
    for i in (50, 98, 0):
        smallest = min(smallest, i)
        out = sched.schedule()
        ro = runner_output(out, {})
        ro.kv_connector_output = KVConnectorOutput(invalid_block_ids={table[i]})
        sched.update_from_output(out, ro)
        assert_scheduler_consistent(sched)
        req = sched.requests["r1"]
        assert req.status is LOADING and req.num_computed_tokens == smallest * 16
        assert sched.failed_recving_ids == {"r1"} and plugin.connector.queries == 1


def test_load_failure_with_fail_policy_errors_the_readers_and_uncaches_bad_blocks():
    sched, _ = failure_setup(load_async=False, policy="fail")
    out = sched.schedule()
    kv = sched.kv_cache_manager
    bad = bad_blocks(sched, "r2", {50})
    ro = runner_output(out, {"r1": [0], "r2": [0], "r3": [0]})
    ro.kv_connector_output = KVConnectorOutput(invalid_block_ids=bad)
    outs = {o.request_id: o for g in sched.update_from_output(out, ro).values() for o in g.outputs}
    assert_scheduler_consistent(sched)
    assert outs["r2"].finish_reason == "error" and not outs["r2"].new_token_ids
    assert outs["r1"].new_token_ids == [0] and outs["r3"].new_token_ids == [0]
    assert "r2" not in sched.requests and [r.request_id for r in sched.running] == ["r1", "r3"]
    assert all(kv.block_pool.block_hash(b) is None for b in bad)


def test_skipped_waiting_requests_in_stats():  # docs/scheduler-behaviour.md#waiting-stats (loads in progress are the blockers)
    sched, _ = h4(max_num_batched_tokens=100)
    for rid, k in (("remote-3", 4), ("remote-4", 5), ("local-0", 1), ("local-1", 2), ("local-2", 3)):
        sched.add_request(make_request(rid, prompt(k, 50)))
    out = sched.schedule()  # the two loads start (no budget); 0 and 1 fill the budget
    assert list(out.num_scheduled_tokens) == ["local-0", "local-1"]
    assert len(sched.waiting) == 1 and len(sched.kv_holding) == 2
    assert sched.skipped_ids == {"remote-3", "remote-4"}
    outs = sched.update_from_output(out, runner_output(out, {"local-0": [1], "local-1": [1]}))
    stats = outs[0].scheduler_stats
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_skipped_waiting_reqs) == (2, 1, 2)
    step(sched, sampled={},
         kv_connector_output=KVConnectorOutput(finished_recving={"remote-3", "remote-4"}))  # loads done: admitted next step
    out = sched.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["remote-3", "remote-4"]
    assert not sched.skipped_ids
