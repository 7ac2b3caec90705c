"""A step whose plugin raises inside schedule() is undone completely:
the KV cache (references, free queue, prefix-cache hashes, statistics) and the
scheduler (running list, queues, request counters) are exactly as before the step."""

from __future__ import annotations

import pytest

from schedkit import PluginError, hookimpl
from schedkit.config import config_from_dict
from schedkit.core.request import Request, RequestStatus, SamplingParams
from schedkit.engine.core import EngineCore
from schedkit.kv.block_pool import BlockPool
from schedkit.plugins.testing import (
    assert_scheduler_consistent,
    make_request,
    make_scheduler,
    serve,
    step,
)
from schedkit.runners.fake import FakeRunner


def pool_state(pool: BlockPool) -> tuple:
    return (
        [pool.ref_cnt(b) for b in range(pool.num_blocks)],
        [pool.block_hash(b) for b in range(pool.num_blocks)],
        pool.get_free_block_ids(),
        pool.num_free_blocks,
        sorted((h, tuple(pool.cached_block_map.get_all(h))) for h in pool.cached_block_map._map),
    )


def sched_state(sched) -> tuple:
    kv = sched.kv_cache_manager
    reqs = sorted(sched.requests.values(), key=lambda r: r.request_id)
    return (
        pool_state(kv.block_pool),
        {r.request_id: kv.get_block_ids(r.request_id) for r in reqs},
        {r.request_id: kv.get_num_cached_blocks(r.request_id) for r in reqs},
        [r.request_id for r in sched.running],
        [r.request_id for r in sched.waiting],
        [(r.request_id, r.status, r.num_computed_tokens, r.num_preemptions, r.num_cached_tokens,
          r.num_recomputed_tokens, list(r.spec_token_ids), len(r.events)) for r in reqs],
        kv.prefix_cache_totals.queries, kv.prefix_cache_totals.hits,
        sched.num_preemptions_total, sched.current_step, set(sched.skipped_ids),
    )


class RaiseOnAdmission:
    """admit_request raises for the request named ``victim`` while armed."""

    def __init__(self, victim: str) -> None:
        self.victim = victim
        self.armed = True

    @hookimpl
    def schedkit_admit_request(self, request):
        if self.armed and request.request_id == self.victim:
            raise RuntimeError(f"no decision for {request.request_id}")
        return None


def test_rolled_back_admission_leaves_no_uncomputed_hash():
    plugin = RaiseOnAdmission("b")
    sched = make_scheduler(plugins=[plugin], enable_prefix_caching=True, num_blocks=64)
    a = make_request("a", list(range(1, 65)), max_tokens=4)  # 4 full blocks
    b = make_request("b", list(range(100, 120)), max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    before = sched_state(sched)
    with pytest.raises(PluginError, match="no decision for b") as exc:
        sched.schedule()
    assert exc.value.request_ids == ["b"]
    assert sched_state(sched) == before
    assert len(sched.kv_cache_manager.block_pool.cached_block_map) == 0
    # What the engine does: fail b, serve the rest. a finds nothing cached.
    sched.finish_requests("b", RequestStatus.FINISHED_ERROR)
    out = sched.schedule()
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a"]
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert a.num_cached_tokens == 0
    assert sched.kv_cache_manager.prefix_cache_totals.hits == 0


def test_rollback_restores_evicted_hashes_and_free_queue_order():
    """The step pops free blocks that carry hashes (evicting them) before it fails: the
    hashes come back, so the KV they name is still found."""
    plugin = RaiseOnAdmission("d")
    sched = make_scheduler(plugins=[plugin], enable_prefix_caching=True, num_blocks=9)
    runner = FakeRunner()
    for rid, base in (("p", 1), ("q", 200)):
        sched.add_request(make_request(rid, list(range(base, base + 33)), max_tokens=1))
        serve(sched, runner)
    assert len(sched.kv_cache_manager.block_pool.cached_block_map) == 4
    c = make_request("c", list(range(500, 564)), max_tokens=2)  # needs 5 of 8 blocks: evicts
    d = make_request("d", [7] * 5, max_tokens=2)
    sched.add_request(c)
    sched.add_request(d)
    before = sched_state(sched)
    with pytest.raises(PluginError):
        sched.schedule()
    assert sched_state(sched) == before
    probe = make_request("probe", list(range(1, 34)), max_tokens=1)
    probe.set_block_hasher(sched._hasher.extend, 16)
    assert sched.kv_cache_manager.get_computed_blocks(probe)[1] == 32


class SecondVictimRaises:
    """Picks the last running request as victim; a second victim in one step raises, so
    the failed step had already preempted someone."""

    def __init__(self) -> None:
        self.calls = 0
        self.armed = True

    @hookimpl
    def schedkit_step_token_budget(self):
        self.calls = 0
        return None

    @hookimpl
    def schedkit_select_preemption_victim(self, running, request):
        self.calls += 1
        if self.armed and self.calls == 2:
            raise RuntimeError(f"no second victim for {request.request_id}")
        return running[-1]


def test_rollback_undoes_preemptions():
    plugin = SecondVictimRaises()
    sched = make_scheduler(plugins=[plugin], block_size=4, num_blocks=9, enable_prefix_caching=True)
    runner = FakeRunner()
    reqs = [make_request(f"r{i}", [i + 1] * 7, max_tokens=12, eos_token_id=None) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    failures = []
    for _ in range(200):
        if not sched.has_requests():
            break
        before = sched_state(sched)
        try:
            step(sched, runner)
        except PluginError as e:
            assert sched_state(sched) == before, "a failed step changed the scheduler"
            assert_scheduler_consistent(sched, reqs)
            failures.append(e.request_id)
            plugin.armed = False
    assert failures == ["r2"]
    assert not sched.has_requests()
    assert all(r.status is RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)


def _engine(plugin, **cache):
    cfg = config_from_dict({
        "runner": {"kind": "fake"},
        "cache": {"block_size": 16, "num_blocks": 64, "enable_prefix_caching": True, **cache},
        "scheduler": {"max_num_batched_tokens": 512, "max_model_len": 512},
    })
    return EngineCore(cfg, extra_plugins=[plugin])


def _req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=3, ignore_eos=True), arrival_time=0.0)


def test_engine_reports_no_phantom_prefix_hit_after_a_failed_step():
    plugin = RaiseOnAdmission("b")
    engine = _engine(plugin)
    engine.add_request(_req("a", list(range(1, 65))))
    engine.add_request(_req("b", list(range(100, 120))))
    results: dict[str, list] = {}
    for _ in range(50):
        if not engine.has_requests():
            break
        for group in engine.step().values():
            for o in group.outputs:
                results.setdefault(o.request_id, []).append(o)
    assert results["b"][-1].finish_reason == "error" and "no decision for b" in results["b"][-1].error
    assert results["a"][-1].finish_reason == "length"
    assert all(o.num_cached_tokens == 0 for o in results["a"])
    assert engine.scheduler.kv_cache_manager.prefix_cache_hit_rate == 0.0
