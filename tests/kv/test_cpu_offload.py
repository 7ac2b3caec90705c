"""The cpu-offload connector's scheduler side (preemption by swap), torch-free: what a
preemption saves, what a resumption loads, the LRU bound, the policy's per-victim
choice, loads of an undone step never sent, and the recompute it saves on the simulator."""

from __future__ import annotations

import statistics

import pytest

from benchmarks.scenarios import kv_pressure
from schedkit import Preemption, hookimpl
from schedkit.config import CacheConfig
from schedkit.errors import PluginError
from schedkit.kv.connector import KVConnectorRole
from schedkit.kv.connectors.offload import CPUOffloadConnector
from schedkit.lab.metrics import summarize
from schedkit.lab.simulate import run_workload
from schedkit.plugins.testing import assert_scheduler_consistent, make_request, make_scheduler, step
from schedkit.runners.paged.kv_offload import CPUOffload


class Swap:
    """The plugin, plus a log of every step's connector metadata."""

    def __init__(self, **settings) -> None:
        self.plugin = CPUOffload(**settings)
        self.metas = []

    @hookimpl
    def schedkit_create_kv_connector(self, role, config):
        return self.plugin.schedkit_create_kv_connector(role, config)

    @hookimpl
    def schedkit_on_step_end(self, scheduler_output):
        self.metas.append(scheduler_output.kv_connector_metadata)


def _two_requests_that_do_not_fit(plugin, **kw):
    """a (40 tokens) and b (40 tokens) grow until 10 usable blocks of 8 run out; b, the
    newer, is preempted for KV blocks."""
    sched = make_scheduler(plugins=[plugin], block_size=8, num_blocks=11,
                           enable_prefix_caching=True, **kw)
    a = make_request("a", list(range(100, 140)), max_tokens=30)
    b = make_request("b", list(range(200, 240)), max_tokens=30)
    for r in (a, b):
        sched.add_request(r)
    return sched, a, b


def test_a_victim_saves_its_computed_full_blocks_and_loads_them_back():
    swap = Swap()
    sched, a, b = _two_requests_that_do_not_fit(swap)
    saved = None
    for _ in range(200):
        if not sched.has_requests():
            break
        out = step(sched, sampled=7).scheduler_output
        meta = out.kv_connector_metadata
        if out.preempted_req_ids and saved is None:
            (victim,) = [r for r in (a, b) if r.request_id in out.preempted_req_ids]
            saved = meta.saves
            # exactly the full blocks whose KV was computed, under their hashes
            assert [h for _, h in saved] == victim.block_hashes[:victim.num_computed_high // 8]
        if saved is not None and meta.loads:
            assert {h for h, _ in meta.loads} <= {h for _, h in saved}
            break
    else:
        raise AssertionError("no preemption, or the victim never loaded")
    while sched.has_requests():
        step(sched, sampled=7)
    assert victim.num_preemptions >= 1 and victim.num_recomputed_tokens < 8 * victim.num_preemptions
    assert_scheduler_consistent(sched, [a, b])


def test_without_prefix_caching_it_refuses_to_start():
    with pytest.raises(PluginError, match="enable_prefix_caching"):
        make_scheduler(plugins=[CPUOffload()], enable_prefix_caching=False)


def test_the_store_keeps_the_most_recently_used_blocks():
    conn = CPUOffloadConnector(KVConnectorRole.SCHEDULER, CacheConfig(block_size=4, num_blocks=64,
                                                                      enable_prefix_caching=True),
                               max_blocks=3)
    req = make_request("x", list(range(20)))
    req.block_hashes = [bytes([i]) * 4 for i in range(5)]
    conn.request_preempted(req, [10, 11, 12, 13, 14], 20, None)
    meta = conn.build_connector_meta(None)
    assert [b for b, _ in meta.saves] == [10, 11, 12, 13, 14]
    assert meta.drops == [req.block_hashes[0], req.block_hashes[1]] and conn.num_stored_blocks == 3
    # the dropped leading blocks are gone, so a lookup finds nothing (hits must be leading)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    assert conn.get_num_new_matched_tokens(req, 8) == (8, False)  # blocks 2, 3; 4 holds the last token


def test_a_policy_decides_per_victim_and_save_on_preemption_is_the_default():
    class PreemptWith:
        def __init__(self, save_kv):
            self.save_kv = save_kv

        @hookimpl
        def schedkit_select_voluntary_preemptions(self, running, waiting, max_num_running):
            if len(running) >= max_num_running:
                return [Preemption(running[0], "test", save_kv=self.save_kv)]
            return None

    def saves(save_kv, default):
        swap = Swap(save_on_preemption=default)
        sched = make_scheduler(plugins=[swap, PreemptWith(save_kv)], max_num_seqs=1,
                               enable_prefix_caching=True, block_size=4)
        for i in range(2):
            sched.add_request(make_request(f"r{i}", [i + 1] * 20, max_tokens=3, arrival_time=float(i)))
        for _ in range(4):
            step(sched, sampled=7)
        return sum(len(m.saves) for m in swap.metas)

    assert saves(None, True) > 0 and saves(None, False) == 0
    assert saves(True, False) > 0 and saves(False, True) == 0


def test_loads_of_an_undone_step_are_never_sent():
    """A hook fails after the admission allocated blocks with external hits: the step
    is undone, the blocks are given back, and the next step must not load into them."""
    swap = Swap()
    sched, a, b = _two_requests_that_do_not_fit(swap)
    conn = None
    for _ in range(200):
        out = step(sched, sampled=7).scheduler_output
        if out.preempted_req_ids:
            conn = sched.connector
            break
    assert conn is not None
    victim = [r for r in (a, b) if r.num_preemptions][0]
    # Pretend an allocation recorded loads, then the step was undone before build.
    conn._loads[(victim.request_id, 0)] = (victim.block_hashes[0], 5)
    meta = conn.build_connector_meta(None)
    assert meta.loads == []  # block 5 is not the victim's (it holds none now)


def test_swap_cuts_the_recompute_of_kv_pressure_preemptions():
    ratios = []
    for seed in range(3):
        recompute = summarize(run_workload(kv_pressure(seed, [])).metrics)
        swap = summarize(run_workload(kv_pressure(seed, [{"name": "cpu-offload"}])).metrics)
        assert recompute["preemptions"] > 5 and swap["preemptions"] > 5
        ratios.append(swap["recomputed_tokens"] / recompute["recomputed_tokens"])
    assert statistics.mean(ratios) < 0.3, ratios


def test_blocks_the_prefix_cache_evicts_are_saved_and_loaded_by_a_later_hit():
    swap = Swap(save_on_eviction=True)
    sched = make_scheduler(plugins=[swap], block_size=4, num_blocks=9, enable_prefix_caching=True)
    prefix = list(range(500, 516))  # 4 full blocks
    first = make_request("first", prefix + [1], max_tokens=1)
    sched.add_request(first)
    while sched.has_requests():
        step(sched, sampled=7)
    hashes = list(first.block_hashes[:4])
    big = make_request("big", list(range(900, 931)), max_tokens=1)  # needs every block
    sched.add_request(big)
    while sched.has_requests():
        step(sched, sampled=7)
    saved = {h for m in swap.metas for _, h in m.saves}
    assert set(hashes) <= saved  # evicted to make room for "big", saved first
    again = make_request("again", prefix + [2, 3], max_tokens=1)
    sched.add_request(again)
    out = step(sched, sampled=7).scheduler_output
    assert [h for h, _ in out.kv_connector_metadata.loads] == hashes
    assert out.num_scheduled_tokens["again"] == 2  # the 16 prefix tokens were loaded
    assert_scheduler_consistent(sched)


def test_an_undone_step_forgets_its_evictions():
    from schedkit.kv.block_pool import BlockPool

    pool = BlockPool(num_blocks=6, enable_caching=True, block_size=4)
    pool.record_evictions = True
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"a" * 8, b"b" * 8], 0, 2)
    pool.free_blocks(blocks)
    pool.begin()
    pool.get_new_blocks(5)  # evicts both cached blocks
    pool.rollback()
    assert pool.take_evicted() == []
    pool.begin()
    pool.get_new_blocks(5)
    pool.commit()
    assert sorted(h for _, h in pool.take_evicted()) == [b"a" * 8, b"b" * 8]


def test_the_kv_pressure_victim_hook_chooses_swap_or_recompute():
    class Victim:
        def __init__(self, save_kv):
            self.save_kv = save_kv

        @hookimpl
        def schedkit_select_preemption_victim(self, running):
            return Preemption(running[-1], "newest", save_kv=self.save_kv)

    def saves(save_kv, default):
        swap = Swap(save_on_preemption=default)
        sched = make_scheduler(plugins=[swap, Victim(save_kv)], block_size=8, num_blocks=11,
                               enable_prefix_caching=True)
        for rid, base in (("a", 100), ("b", 200)):
            sched.add_request(make_request(rid, list(range(base, base + 40)), max_tokens=30))
        while sched.has_requests():
            step(sched, sampled=7)
        assert sched.num_preemptions_total > 0
        return sum(len(m.saves) for m in swap.metas)

    assert saves(True, False) > 0 and saves(False, True) == 0 and saves(None, True) > 0
