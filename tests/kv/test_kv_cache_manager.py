"""KV cache manager scenarios (docs/scheduler-behaviour.md, section "Prefix caching and the
block pool"; set-up: docs/scheduler-behaviour.md#setup-kv-manager)."""

from __future__ import annotations

import pytest

from schedkit.errors import ConfigError
from schedkit.kv import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheManager

COMMON = [i for i in range(3) for _ in range(16)]  # 48 tokens = 3 blocks of 16


def manager(num_blocks: int, bs: int = 16, **kw) -> KVCacheManager:
    kw.setdefault("max_model_len", 8192)
    return KVCacheManager(block_size=bs, num_blocks=num_blocks, **kw)


def admit(m: KVCacheManager, req) -> list[int] | None:
    """Lookup + allocate for the whole uncomputed prompt (docs/scheduler-behaviour.md#setup-kv-manager)."""
    hits, num_hits = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - num_hits, num_hits, hits)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return new


def pool_snapshot(m: KVCacheManager):
    pool = m.block_pool
    return (
        pool.get_free_block_ids(),
        [pool.ref_cnt(b) for b in range(pool.num_blocks)],
        [pool.block_hash(b) for b in range(pool.num_blocks)],
        len(pool.cached_block_map),
    )


def test_config_validation():
    with pytest.raises(ConfigError):
        manager(10, watermark=1.0)
    with pytest.raises(ConfigError):
        manager(10, bs=0)


def test_prefill_plp_and_worked_example(make_request):
    m = manager(11)
    r0 = make_request(0, COMMON + [3] * 7, 16, skip_reading_prefix_cache=True)
    assert m.get_computed_blocks(r0) == ([], 0)
    assert m.allocate_slots(r0, 55) == [1, 2, 3, 4]
    pool = m.block_pool
    assert [pool.block_hash(b) for b in (1, 2, 3)] == r0.block_hashes[:3]
    assert pool.block_hash(4) is None
    assert m.get_num_cached_blocks("0") == 3

    r1 = make_request(1, COMMON + [5] * 3, 16)
    hits, num_hits = m.get_computed_blocks(r1)
    assert (hits, num_hits) == ([1, 2, 3], 48)
    assert m.allocate_slots(r1, 3, num_hits, hits) == [5]
    assert m.get_block_ids("1") == [1, 2, 3, 5]
    assert [pool.ref_cnt(b) for b in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]

    m.free(r0)
    assert pool.get_free_block_ids() == [4, 6, 7, 8, 9, 10]
    m.free(r1)
    assert pool.get_free_block_ids() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    # Worked example (docs/scheduler-behaviour.md#free-queue-order): a request hitting [1,2,3] that needs one more block gets 5.
    r3 = make_request(3, COMMON + [9] * 4, 16)
    hits, num_hits = m.get_computed_blocks(r3)
    assert hits == [1, 2, 3]
    assert m.allocate_slots(r3, 4, num_hits, hits) == [5]
    m.free(r3)

    # r2 with prompt logprobs: no hit, fresh blocks from the head; duplicate hashes allowed.
    m2 = manager(11)
    for r in (r0, r1):
        r.num_computed_tokens = 0
    assert admit(m2, r0) == [1, 2, 3, 4]
    assert admit(m2, r1) == [5]
    m2.free(r0)
    m2.free(r1)
    r2 = make_request(2, COMMON + [6] * 7, 16, skip_reading_prefix_cache=True)
    assert admit(m2, r2) == [5, 4, 6, 7]
    p2 = m2.block_pool
    assert [p2.block_hash(b) for b in (5, 4, 6, 7)] == [*r0.block_hashes[:3], None]
    assert all(p2.ref_cnt(b) == 1 for b in (5, 4, 6, 7))
    assert p2.get_cached_block(r0.block_hashes[0]) == 1  # first inserted survives
    assert p2.cached_block_map.get_all(r0.block_hashes[0]) == [1, 5]


def test_decode(make_request):
    m = manager(11)
    r0 = make_request(0, COMMON + [3] * 7, 16)
    assert admit(m, r0) == [1, 2, 3, 4]
    r0.append(8, 8, 8, 8)
    assert m.allocate_slots(r0, 4) == []
    assert m.block_pool.block_hash(4) is None
    r0.num_computed_tokens = 59
    r0.append(*([9] * 19))
    assert r0.num_tokens == 78
    new = m.allocate_slots(r0, 19)
    assert new == [5]
    assert m.block_pool.block_hash(4) == r0.block_hashes[3]
    assert m.block_pool.block_hash(5) is None
    assert m.get_num_cached_blocks("0") == 4


def test_hash_block_correct_reuse(make_request):
    m = manager(2)
    r = make_request(0, range(16), 16)
    assert admit(m, r) == [1]
    assert m.block_pool.block_hash(1) == r.block_hashes[0]
    m.free(r)
    r2 = make_request(1, range(15), 16)
    assert admit(m, r2) == [1]
    assert m.block_pool.block_hash(1) is None
    assert len(m.block_pool.cached_block_map) == 0


def test_prefix_caching_disabled(make_request):
    m = manager(5, bs=4, enable_caching=False)
    r = make_request(0, range(10), 4)
    assert admit(m, r) == [1, 2, 3]
    m.free(r)
    assert m.block_pool.get_free_block_ids() == [3, 2, 1, 4]
    r2 = make_request(1, list(range(10)) + [10] * 6, 4)
    assert m.get_computed_blocks(r2) == ([], 0)
    assert admit(m, r2) == [3, 2, 1, 4]
    r3 = make_request(2, range(4), 4)
    assert admit(m, r3) is None
    assert m.make_prefix_cache_stats() is None


def test_reset_prefix_cache(make_request):
    m = manager(11)
    r0 = make_request(0, COMMON + [3] * 7, 16)
    r1 = make_request(1, COMMON + [4] * 7, 16)
    assert admit(m, r0) == [1, 2, 3, 4]
    assert admit(m, r1) == [5]
    assert not m.reset_prefix_cache()
    assert len(m.block_pool.cached_block_map) == 3
    m.free(r0)
    m.free(r1)
    assert m.reset_prefix_cache()
    assert len(m.block_pool.cached_block_map) == 0
    assert all(m.block_pool.block_hash(b) is None for b in range(11))
    stats = m.make_prefix_cache_stats()
    assert stats is not None and stats.reset
    stats = m.make_prefix_cache_stats()
    assert stats is not None and not stats.reset


@pytest.mark.parametrize("k", [2, 3, 10])
def test_kv_cache_events(make_request, k):
    m = manager(k + 1, enable_kv_events=True)
    r = make_request(0, list(range(16 * k)), 16)
    assert m.allocate_slots(r, 16 * k) is not None
    events = m.take_events()
    assert len(events) == 1
    ev = events[-1]
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == r.block_hashes and len(ev.block_hashes) == k
    assert ev.token_ids == list(range(16 * k)) and ev.block_size == 16
    assert ev.parent_block_hash is None
    assert m.take_events() == []

    m.free(r)
    r2 = make_request(1, list(range(16 * k)), 16)
    assert m.allocate_slots(r2, 16 * k) is not None
    events = m.take_events()
    assert len(events) == k + 1
    assert all(isinstance(e, BlockRemoved) for e in events[:k])
    assert {e.block_hashes[0] for e in events[:k] if isinstance(e, BlockRemoved)} == set(
        r.block_hashes
    )
    assert isinstance(events[-1], BlockStored) and len(events[-1].block_hashes) == k

    m.free(r2)
    assert m.reset_prefix_cache()
    assert m.take_events()[-1] == AllBlocksCleared()
    assert len(m.block_pool.cached_block_map) == 0


@pytest.mark.parametrize("lookahead", [2, 4])
def test_allocate_with_lookahead(make_request, lookahead):
    m = manager(10, bs=4, max_model_len=100)
    r = make_request(0, [], 4)
    new = m.allocate_slots(r, 3, num_lookahead_tokens=lookahead)
    assert new is not None and len(new) == 2
    assert m.get_num_cached_blocks("0") == 0


@pytest.mark.parametrize(
    ("caching", "queue_after", "next_blocks"),
    [
        (False, [2, 1, 3, 4, 5, 6, 7, 8, 9, 10], [2, 1, 3]),
        (True, [2, 3, 4, 5, 6, 7, 8, 9, 10, 1], [2, 3, 4]),
    ],
)
def test_free_queue_order(make_request, caching, queue_after, next_blocks):
    m = manager(11, enable_caching=caching, max_model_len=2048)
    r0 = make_request(0, range(20), 16)
    assert admit(m, r0) == [1, 2]
    r0.append(7)  # its one output token; then it finishes
    m.free(r0)
    assert m.block_pool.get_free_block_ids() == queue_after
    r1 = make_request(1, [1000 + i for i in range(40)], 16)
    assert admit(m, r1) == next_blocks


def test_identical_prompts_same_step_share_blocks(make_request):
    m = manager(20)
    a = make_request("a", range(40), 16)
    b = make_request("b", range(40), 16)
    assert admit(m, a) == [1, 2, 3]
    hits, n = m.get_computed_blocks(b)
    assert (hits, n) == ([1, 2], 32)
    assert m.allocate_slots(b, 8, n, hits) == [4]
    assert m.get_num_common_prefix_blocks("a", 2) == 2
    assert m.get_num_common_prefix_blocks("b", 1) == 0
    assert m.get_num_common_prefix_blocks("zzz", 1) == 0


def test_block_aligned_prompt_recomputes_last_block(make_request):
    m = manager(20)
    a = make_request("a", range(48), 16)
    admit(m, a)
    assert m.get_num_cached_blocks("a") == 3
    b = make_request("b", range(48), 16)
    assert m.get_computed_blocks(b) == ([1, 2], 32)
    assert m.get_computed_blocks(make_request("c", range(1), 16)) == ([], 0)
    assert m.get_computed_blocks(make_request("d", [], 16)) == ([], 0)


def test_lookup_has_no_side_effects(make_request):
    m = manager(6)
    a = make_request("a", range(40), 16)
    admit(m, a)
    m.free(a)
    before = pool_snapshot(m)
    hits, n = m.get_computed_blocks(make_request("b", range(40), 16))
    assert hits == [1, 2]
    assert pool_snapshot(m) == before
    stats = m.make_prefix_cache_stats()
    assert stats is not None and stats.requests == 0 and stats.queries == 0


def test_free_listed_hits_count_against_capacity_and_none_has_no_side_effects(make_request):
    m = manager(5)  # 4 usable
    a = make_request("a", range(40), 16)  # blocks 1,2 cached, 3 partial
    admit(m, a)
    m.free(a)  # queue [3,4,2,1]
    b = make_request("b", list(range(32)) + [7] * 40, 16)  # 72 tokens: 2 hits + 3 new
    hits, n = m.get_computed_blocks(b)
    assert hits == [1, 2]
    before = pool_snapshot(m)
    assert m.allocate_slots(b, b.num_tokens - n, n, hits) is None  # 3 + 2 > 4
    assert pool_snapshot(m) == before
    assert m.get_block_ids("b") == [] and m.num_tracked_requests == 0
    c = make_request("c", list(range(32)) + [7] * 30, 16)  # 62 tokens: 2 hits + 2 new
    hits, n = m.get_computed_blocks(c)
    assert m.allocate_slots(c, c.num_tokens - n, n, hits) == [3, 4]
    assert m.num_free_blocks == 0 and m.usage == 1.0


def test_watermark_and_reserved_blocks(make_request):
    m = manager(10, watermark=0.2)  # W = 2, 9 usable
    r = make_request("r", range(16 * 8 - 4), 16)
    before = pool_snapshot(m)
    assert m.allocate_slots(r, r.num_tokens, apply_watermark=True) is None
    assert m.allocate_slots(r, r.num_tokens, reserved_blocks=2) is None
    assert pool_snapshot(m) == before and m.num_tracked_requests == 0
    new = m.allocate_slots(r, r.num_tokens, reserved_blocks=1)
    assert new is not None and len(new) == 8
    r.num_computed_tokens = r.num_tokens
    r.append(1)
    # A running decode with no new block needed still fails a reservation it cannot honour.
    assert m.allocate_slots(r, 1, reserved_blocks=2) is None
    assert m.allocate_slots(r, 1) == []
    assert m.allocate_slots(r, 1, apply_watermark=True) is None


def test_full_sequence_must_fit_gate(make_request):
    m = manager(6)  # 5 usable
    r = make_request("r", range(100), 16)  # 7 blocks
    assert m.allocate_slots(r, 32, full_sequence_must_fit=True) is None
    assert m.num_tracked_requests == 0
    assert m.allocate_slots(r, 32) == [1, 2]
    assert m.allocate_slots(make_request("s", range(48), 16), 16, full_sequence_must_fit=True) == [
        3
    ]


def test_max_model_len_clamp_and_drafts_never_cached(make_request):
    m = manager(10, bs=4, max_model_len=20)
    r = make_request("r", range(18), 4)
    new = m.allocate_slots(r, 18, num_lookahead_tokens=10)
    assert new is not None and len(new) == 5  # clamped at 20 slots
    m2 = manager(10)
    s = make_request("s", range(16), 16)
    # 16 real tokens + 4 draft slots scheduled: only the block of real tokens is cached.
    assert m2.allocate_slots(s, 20, num_lookahead_tokens=16) == [1, 2, 3]
    assert m2.get_num_cached_blocks("s") == 1
    t = make_request("t", range(15), 16)
    assert m2.allocate_slots(t, 20) == [4, 5]
    assert m2.get_num_cached_blocks("t") == 0


def test_external_tokens_and_delayed_caching(make_request):
    m = manager(20)
    r = make_request("r", range(40), 16)
    new = m.allocate_slots(r, 0, num_external_computed_tokens=40, delay_cache_blocks=True)
    assert new == []
    assert m.get_block_ids("r") == [1, 2, 3]
    assert len(m.block_pool.cached_block_map) == 0
    r.num_computed_tokens = 40
    m.cache_blocks(r, 40)
    assert m.get_num_cached_blocks("r") == 2
    assert [m.block_pool.block_hash(b) for b in (1, 2, 3)] == [*r.block_hashes, None]
    m.cache_blocks(r, 16)  # monotone: nothing changes
    assert m.get_num_cached_blocks("r") == 2
    # Local hits plus external tokens plus new tokens.
    s = make_request("s", list(range(32)) + [5] * 40, 16)
    hits, n = m.get_computed_blocks(s)
    assert hits == [1, 2]
    new = m.allocate_slots(s, 8, n, hits, num_external_computed_tokens=32)
    assert m.get_block_ids("s") == [1, 2, 4, 5, 6]
    assert new == [6]
    assert m.get_num_cached_blocks("s") == 4


def test_free_forgets_request(make_request):
    m = manager(10)
    r = make_request("r", range(20), 16)
    admit(m, r)
    assert m.num_tracked_requests == 1
    m.free(r)
    m.free(r)  # idempotent
    assert m.num_tracked_requests == 0 and m.get_block_ids("r") == []
    assert m.get_num_cached_blocks("r") == 0 and m.num_free_blocks == 9


def test_evict_blocks(make_request):
    m = manager(10)
    r = make_request("r", range(40), 16)
    admit(m, r)
    m.evict_blocks([2])
    assert m.block_pool.block_hash(2) is None
    assert m.get_computed_blocks(make_request("s", range(40), 16)) == ([1], 16)


def test_prefix_cache_stats(make_request):
    m = manager(10)
    m.record_prefix_cache_hits(100, 32, preempted=False)
    m.record_prefix_cache_hits(50, 16, preempted=True)
    s = m.make_prefix_cache_stats()
    assert s is not None
    assert (s.requests, s.queries, s.hits) == (1, 100, 32)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 50, 16)
    assert not s.reset
    s2 = m.make_prefix_cache_stats()
    assert s2 is not None
    assert (s2.requests, s2.preempted_requests) == (0, 0)
    m.record_prefix_cache_hits(50, 0, preempted=False)
    assert m.prefix_cache_totals.requests == 2
    assert m.prefix_cache_hit_rate == pytest.approx(48 / 200)
