"""Scheduler-side KV connector calls (synchronous loads, delayed frees)."""

from __future__ import annotations

import pytest

from schedkit import hookimpl
from schedkit.core.outputs import KVConnectorOutput
from schedkit.errors import PluginError
from schedkit.kv.connector import KVConnectorBase, KVConnectorRole
from schedkit.plugins.testing import (
    assert_scheduler_consistent,
    make_request,
    make_scheduler,
    runner_output,
)


class StoreConnector(KVConnectorBase):
    """Pretends an external store holds the first 32 tokens of prompts starting with 1;
    holds the blocks of finished requests until the worker reports them sent."""

    def __init__(self, role, config, load_async=False):
        super().__init__(role, config)
        self.load_async = load_async
        self.calls = []

    def on_new_request(self, request):
        self.calls.append(("new", request.request_id))

    def get_num_new_matched_tokens(self, request, num_local_hit_tokens):
        if request.prompt_token_ids[0] != 1:
            return 0, False
        return max(32 - num_local_hit_tokens, 0), self.load_async

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.calls.append(("alloc", request.request_id, len(block_ids), num_external_tokens))

    def build_connector_meta(self, scheduler_output):
        return {"step": scheduler_output.step, "new": [r.req_id for r in scheduler_output.scheduled_new_reqs]}

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.request_id, list(block_ids)))
        return True, {"remote_block_ids": list(block_ids)}


class Plugin:
    def __init__(self, **kw):
        self.kw = kw
        self.connector = None

    @hookimpl
    def schedkit_create_kv_connector(self, role, config):
        self.connector = StoreConnector(role, config, **self.kw)
        return self.connector


def test_sync_external_hits_and_delayed_free():
    plugin = Plugin()
    sched = make_scheduler(plugins=[plugin])
    conn = plugin.connector
    assert conn.role is KVConnectorRole.SCHEDULER and conn.kv_cache_manager is sched.kv_cache_manager
    sched.add_request(make_request("a", [1] * 40, max_tokens=1))
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 32
    assert out.num_scheduled_tokens == {"a": 8}
    assert out.kv_connector_metadata == {"step": 1, "new": ["a"]}
    assert ("alloc", "a", 3, 32) in conn.calls
    outs = sched.update_from_output(out, runner_output(out, {"a": [5]}))
    (o,) = outs[0].outputs
    assert o.finish_reason == "length" and o.kv_transfer_params == {"remote_block_ids": [1, 2, 3]}
    # Held for the connector: still known, blocks still allocated, engine keeps stepping.
    assert "a" in sched.requests and sched.kv_cache_manager.num_free_blocks == 9999 - 3
    assert sched.has_requests() and sched.get_num_unfinished_requests() == 0
    assert_scheduler_consistent(sched)
    out = sched.schedule()
    assert out.finished_req_ids == {"a"}
    ro = runner_output(out, {})
    ro.kv_connector_output = KVConnectorOutput(finished_sending={"a"})
    sched.update_from_output(out, ro)
    assert not sched.requests and sched.kv_cache_manager.num_free_blocks == 9999
    assert not sched.has_requests()


class DeferB:
    @hookimpl
    def schedkit_admit_request(self, request):
        from schedkit.core.hooks import AdmissionDecision

        return AdmissionDecision.SKIP if request.request_id == "b" else None


class FlakyMetaConnector(KVConnectorBase):
    def __init__(self, role, config):
        super().__init__(role, config)
        self.fail = True

    def build_connector_meta(self, scheduler_output):
        if self.fail:
            self.fail = False
            raise RuntimeError("metadata store unavailable")
        return None


class FlakyPlugin:
    @hookimpl
    def schedkit_create_kv_connector(self, role, config):
        return FlakyMetaConnector(role, config)


def test_connector_error_rolls_back_the_step_without_duplicating_skipped_requests():
    sched = make_scheduler(plugins=[DeferB(), FlakyPlugin()])
    for rid in ("a", "b", "c"):
        sched.add_request(make_request(rid, [1, 2, 3], max_tokens=2))
    with pytest.raises(PluginError, match="build_connector_meta") as e:
        sched.schedule()
    assert e.value.plugin == "FlakyMetaConnector" and e.value.hook == "KVConnector.build_connector_meta"
    # counted with the hooks' errors (stats' num_hook_errors, the server's metric)
    assert sched.hooks.errors == {("FlakyMetaConnector", "KVConnector.build_connector_meta"): 1}
    assert_scheduler_consistent(sched)
    assert [r.request_id for r in sched.waiting] == ["a", "b", "c"]
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["a", "c"]
    assert out.scheduled_new_reqs[0].req_id == "a"
