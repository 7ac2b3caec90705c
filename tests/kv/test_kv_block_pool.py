"""Block pool, free queue and cached-block map.

Behaviours: docs/scheduler-behaviour.md#null-block, docs/scheduler-behaviour.md#free-queue-order,
docs/scheduler-behaviour.md#refcounts, docs/scheduler-behaviour.md#cached-block-map,
docs/scheduler-behaviour.md#cache-reset, docs/scheduler-behaviour.md#kv-events."""

from __future__ import annotations

import pytest

from schedkit.kv import (
    AllBlocksCleared,
    BlockHasher,
    BlockPool,
    BlockRemoved,
    BlockStored,
    CachedBlockMap,
)


def h(i: int) -> bytes:
    return bytes([i]) * 16


def test_initial_state_and_null_block():
    pool = BlockPool(6)
    assert pool.get_free_block_ids() == [1, 2, 3, 4, 5]
    assert pool.num_free_blocks == 5
    assert pool.usage == 0.0
    assert all(pool.ref_cnt(b) == 0 and pool.block_hash(b) is None for b in range(6))
    # The null block is never handed out, never freed, never touched.
    assert 0 not in pool.get_new_blocks(5)
    pool.free_blocks([0])
    pool.touch([0])
    assert pool.num_free_blocks == 0 and pool.ref_cnt(0) == 0
    assert pool.usage == 1.0


def test_single_block_pool():
    pool = BlockPool(1)
    assert pool.get_free_block_ids() == [] and pool.usage == 0.0
    assert pool.get_new_blocks(0) == []
    assert pool.reset_prefix_cache()


def test_popleft_order_and_overdraw_asserts():
    # docs/scheduler-behaviour.md#free-queue-order: popleft returns the head; popleft_n(0) == []; popping more than free fails.
    pool = BlockPool(7)
    assert pool.get_new_blocks(0) == []
    assert pool.get_new_blocks(1) == [1]
    assert pool.get_new_blocks(2) == [2, 3]
    assert pool.get_new_blocks(3) == [4, 5, 6]
    assert pool.get_free_block_ids() == []
    with pytest.raises(AssertionError):
        pool.get_new_blocks(1)


def test_touch_removes_from_middle_and_relinks():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(blocks, [h(i) for i in range(5)], 0, 5)
    pool.free_blocks(blocks)  # hashed -> tail, in batch order
    assert pool.get_free_block_ids() == [1, 2, 3, 4, 5]
    pool.touch([3])
    assert pool.get_free_block_ids() == [1, 2, 4, 5]
    assert pool.ref_cnt(3) == 1 and pool.num_free_blocks == 4
    pool.touch([3])  # already held: only the count grows
    assert pool.ref_cnt(3) == 2 and pool.num_free_blocks == 4
    pool.touch([1, 5])  # head and tail
    assert pool.get_free_block_ids() == [2, 4]
    assert pool.get_new_blocks(2) == [2, 4]
    assert pool.get_free_block_ids() == []


def test_free_unhashed_to_front_hashed_to_tail():
    # docs/scheduler-behaviour.md#free-queue-order: unhashed blocks go to the front in batch order, hashed to the tail.
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(7)
    pool.cache_full_blocks(blocks, [h(i) for i in range(7)], 0, 3)  # 1,2,3 hashed
    pool.free_blocks([2, 5, 1])
    assert pool.get_free_block_ids() == [5, 2, 1]
    pool.free_blocks([])  # no-op
    assert pool.get_free_block_ids() == [5, 2, 1]
    pool.free_blocks([7, 3, 6])
    assert pool.get_free_block_ids() == [7, 6, 5, 2, 1, 3]
    pool.free_blocks([4])
    assert pool.get_free_block_ids() == [4, 7, 6, 5, 2, 1, 3]
    assert pool.num_free_blocks == 7


def test_free_only_when_ref_reaches_zero_and_double_free_asserts():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    pool.free_blocks([b])
    assert pool.ref_cnt(b) == 1 and b not in pool.get_free_block_ids()
    pool.free_blocks([b])
    assert pool.ref_cnt(b) == 0 and pool.get_free_block_ids()[0] == b
    with pytest.raises(AssertionError):
        pool.free_blocks([b])


def test_popping_hashed_block_evicts_it():
    pool = BlockPool(3, enable_kv_events=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(1), h(2)], 0, 2, token_ids=list(range(32)))
    pool.take_events()
    pool.free_blocks(blocks)
    assert pool.get_cached_block(h(1)) == 1  # lazily kept while free
    assert pool.get_new_blocks(1) == [1]
    assert pool.block_hash(1) is None and pool.get_cached_block(h(1)) is None
    assert pool.get_cached_block(h(2)) == 2
    assert pool.take_events() == [BlockRemoved(block_hashes=[h(1)])]


def test_cache_blocks(make_request):
    bs = 4
    pool = BlockPool(5, block_size=bs)
    req = make_request(0, range(14), bs)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, req.block_hashes, 0, 2)
    assert len(pool.cached_block_map) == 2
    assert [pool.block_hash(b) for b in blocks] == [*req.block_hashes[:2], None, None]
    pool.cache_full_blocks(blocks, req.block_hashes, 2, 3)
    assert len(pool.cached_block_map) == 3
    assert pool.block_hash(blocks[2]) == req.block_hashes[2]
    pool.cache_full_blocks(blocks, req.block_hashes, 3, 3)  # nothing new
    assert len(pool.cached_block_map) == 3


def test_caching_disabled_pool_never_hashes():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [h(1), h(2), h(3)], 0, 3)
    assert len(pool.cached_block_map) == 0
    pool.free_blocks(reversed(blocks))
    assert pool.get_free_block_ids() == [3, 2, 1]


def test_evict_blocks():
    # Blocks 1..4 hashed h0, h1, h2, h0 (the null block cannot be cached here).
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(blocks, [h(0), h(1), h(2), h(0)], 0, 4)
    m = pool.cached_block_map
    assert m.get_all(h(0)) == [1, 4] and m.get_all(h(1)) == [2] and m.get_all(h(2)) == [3]
    pool.evict_blocks([2])
    assert m.get_all(h(0)) == [1, 4] and h(1) not in m and m.get_all(h(2)) == [3]
    pool.evict_blocks([1])
    assert m.get_all(h(0)) == [4] and m.get_all(h(2)) == [3]
    pool.evict_blocks([3])
    assert m.get_all(h(0)) == [4] and len(m) == 1
    pool.evict_blocks([4])
    assert len(m) == 0
    assert all(pool.ref_cnt(b) == 1 for b in blocks)  # ref counts untouched
    pool.evict_blocks([4])  # already evicted: no-op


def test_cached_block_map_single_and_multi():
    m = CachedBlockMap()
    m.insert(h(1), 5)
    assert m.get(h(1)) == 5
    assert m.pop(h(1), 6) is None and m.get(h(1)) == 5  # non-matching id: no-op
    assert m.pop(h(9), 5) is None
    assert m.pop(h(1), 5) == 5 and m.get(h(1)) is None and len(m) == 0
    m.insert(h(2), 7)
    m.insert(h(2), 3)
    m.insert(h(2), 9)
    assert m.get(h(2)) == 7 and m.get_all(h(2)) == [7, 3, 9]
    assert m.pop(h(2), 4) is None and m.get_all(h(2)) == [7, 3, 9]
    assert m.pop(h(2), 7) == 7 and m.get(h(2)) == 3
    assert m.pop(h(2), 9) == 9 and m.get_all(h(2)) == [3]
    assert m.pop(h(2), 3) == 3 and h(2) not in m
    m.insert(h(3), 1)
    m.clear()
    assert len(m) == 0


def test_reset_prefix_cache_requires_all_free():
    pool = BlockPool(4, enable_kv_events=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(1), h(2)], 0, 2, token_ids=[0] * 32)
    assert not pool.reset_prefix_cache()
    assert len(pool.cached_block_map) == 2
    pool.free_blocks(blocks)
    pool.take_events()
    assert pool.reset_prefix_cache()
    assert len(pool.cached_block_map) == 0
    assert all(pool.block_hash(b) is None for b in range(4))
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.take_events() == []


def test_null_parent_block_hash():
    pool = BlockPool(8, block_size=1, enable_kv_events=True)
    tokens = [10, 11, 12, 13]
    hashes: list[bytes] = []
    BlockHasher(1, "sha256").extend(tokens, hashes)
    new = pool.get_new_blocks(3)
    table = [new[0], 0, new[1], new[2]]
    pool.cache_full_blocks(table, hashes, 2, 4, token_ids=tokens)
    events = pool.take_events()
    assert events == [
        BlockStored(
            block_hashes=hashes[2:4], parent_block_hash=hashes[1], token_ids=[12, 13], block_size=1
        )
    ]
    assert pool.block_hash(0) is None
    assert pool.block_hash(new[1]) == hashes[2] and pool.block_hash(new[2]) == hashes[3]


def test_events_disabled_by_default():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(1), h(2)], 0, 2)
    pool.free_blocks(blocks)
    pool.get_new_blocks(2)
    assert pool.take_events() == []
