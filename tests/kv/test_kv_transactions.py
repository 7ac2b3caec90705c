"""KVCacheManager / BlockPool transactions: any sequence of allocations, hits, caching,
evictions and frees between begin() and rollback() leaves no trace."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from schedkit.kv.hashing import BlockHasher
from schedkit.kv.kv_cache_manager import KVCacheManager
from schedkit.plugins.testing import make_request


def state(kv: KVCacheManager, rids) -> tuple:
    pool = kv.block_pool
    return (
        [pool.ref_cnt(b) for b in range(pool.num_blocks)],
        [pool.block_hash(b) for b in range(pool.num_blocks)],
        pool.get_free_block_ids(), pool.num_free_blocks,
        {h: pool.cached_block_map.get_all(h) for h in pool.cached_block_map._map},
        {r: (kv.get_block_ids(r), kv.get_num_cached_blocks(r)) for r in rids},
        kv.num_tracked_requests, kv.prefix_cache_totals.queries, kv.prefix_cache_totals.hits,
        len(pool._events),
    )


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "evict", "hit"]),
                         st.integers(0, 5), st.integers(1, 40)), max_size=25)


@settings(max_examples=300, deadline=None)
@given(before=ops, during=ops, prompts=st.lists(st.integers(0, 3), min_size=6, max_size=6))
def test_rollback_restores_everything(before, during, prompts):
    kv = KVCacheManager(block_size=4, num_blocks=24, max_model_len=200, enable_kv_events=True)
    hasher = BlockHasher(4, "xxhash")
    reqs = []
    for i, p in enumerate(prompts):
        r = make_request(f"r{i}", [p + 1] * 12 + [i + 1] * 20, max_tokens=50)
        r.set_block_hasher(hasher.extend, 4)
        reqs.append(r)
    rids = [r.request_id for r in reqs]

    def apply(seq):
        for op, i, n in seq:
            req = reqs[i]
            if op == "alloc":
                n = min(n, req.num_tokens - req.num_computed_tokens)
                if n > 0 and kv.allocate_slots(req, n) is not None:
                    req.num_computed_tokens += n
            elif op == "hit" and kv.get_num_blocks(req.request_id) == 0:
                blocks, num_hit = kv.get_computed_blocks(req)
                if kv.allocate_slots(req, 1, num_hit, blocks) is not None:
                    kv.record_prefix_cache_hits(req.num_tokens, num_hit, False)
                    req.num_computed_tokens = num_hit + 1
            elif op == "free":
                kv.free(req)
                req.num_computed_tokens = 0
            elif op == "evict":
                kv.evict_blocks(kv.get_block_ids(req.request_id)[:n % 3])

    apply(before)
    snap = state(kv, rids)
    computed = [r.num_computed_tokens for r in reqs]
    kv.begin()
    apply(during)
    kv.rollback()
    assert state(kv, rids) == snap
    for r, c in zip(reqs, computed, strict=True):
        r.num_computed_tokens = c
    # Still fully usable after the rollback, and a commit keeps changes.
    kv.begin()
    apply(during)
    after = state(kv, rids)
    kv.commit()
    assert state(kv, rids) == after
