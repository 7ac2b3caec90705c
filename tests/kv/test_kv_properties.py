"""Property test: random admit/step/free/evict sequences keep the pool consistent."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schedkit.kv import KVCacheManager

BS = 4
NUM_BLOCKS = 10
NUM_REQS = 5

TEMPLATES = ([0, 1] * 16, list(range(32)))
# Prompts share prefixes (a template head) so that prefix hits are frequent.
prompts = st.builds(
    lambda t, k, tail: (TEMPLATES[t][:k] + tail) or [0],
    st.integers(0, len(TEMPLATES) - 1),
    st.sampled_from([0, 5, 8, 13, 16, 24, 28]),
    st.lists(st.integers(0, 1), max_size=4),
)
ops = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, NUM_REQS - 1), prompts, st.booleans(),
              st.integers(1, 40), st.integers(0, 3)),
    st.tuples(st.just("step"), st.integers(0, NUM_REQS - 1), st.integers(1, 8),
              st.integers(0, 3), st.integers(0, 1)),
    st.tuples(st.just("free"), st.integers(0, NUM_REQS - 1)),
    st.tuples(st.just("evict"), st.integers(1, NUM_BLOCKS - 1)),
)  # fmt: skip


def snapshot(m: KVCacheManager):
    pool = m.block_pool
    return (
        pool.get_free_block_ids(),
        [pool.ref_cnt(b) for b in range(NUM_BLOCKS)],
        [pool.block_hash(b) for b in range(NUM_BLOCKS)],
        len(pool.cached_block_map),
        {rid: m.get_block_ids(rid) for rid in map(str, range(NUM_REQS))},
    )


def check_invariants(m: KVCacheManager, active: dict) -> None:
    pool = m.block_pool
    holders = [0] * NUM_BLOCKS
    for rid, req in active.items():
        table = m.get_block_ids(rid)
        assert len(table) * BS >= req.num_computed_tokens
        num_cached = m.get_num_cached_blocks(rid)
        assert num_cached <= len(table)
        for i, b in enumerate(table):
            holders[b] += 1
            if i < num_cached:
                assert pool.block_hash(b) in (None, req.block_hashes[i])
            else:
                assert pool.block_hash(b) is None
    free = pool.get_free_block_ids()
    assert len(free) == len(set(free)) == pool.num_free_blocks
    for b in range(1, NUM_BLOCKS):
        assert pool.ref_cnt(b) == holders[b]
        assert (b in free) == (holders[b] == 0)
    assert 0 not in free and holders[0] == 0
    hashed: dict[bytes, list[int]] = {}
    for b in range(NUM_BLOCKS):
        h = pool.block_hash(b)
        if h is not None:
            assert b in pool.cached_block_map.get_all(h)
            hashed.setdefault(h, []).append(b)
    assert len(pool.cached_block_map) == len(hashed)
    assert m.num_tracked_requests == len(active)
    assert abs(m.usage - (1 - pool.num_free_blocks / (NUM_BLOCKS - 1))) < 1e-12


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(caching=st.booleans(), program=st.lists(ops, min_size=20, max_size=80))
def test_random_programs_keep_refcounts_consistent(make_request, caching, program):
    m = KVCacheManager(block_size=BS, num_blocks=NUM_BLOCKS, max_model_len=64,
                       enable_caching=caching)  # fmt: skip
    active: dict = {}
    for op in program:
        kind, *args = op
        if kind == "admit":
            i, prompt, must_fit, chunk, lookahead = args
            rid = str(i)
            if rid in active:
                continue
            req = make_request(rid, prompt, BS)
            hits, num_hits = m.get_computed_blocks(req)
            assert num_hits == len(hits) * BS < req.num_tokens
            n = min(chunk, req.num_tokens - num_hits)
            before = snapshot(m)
            new = m.allocate_slots(req, n, num_hits, hits, num_lookahead_tokens=lookahead,
                                   full_sequence_must_fit=must_fit)  # fmt: skip
            if new is None:
                assert snapshot(m) == before
                continue
            req.num_computed_tokens = num_hits + n
            active[rid] = req
        elif kind == "step":
            i, chunk, lookahead, token = args
            req = active.get(str(i))
            if req is None or req.num_tokens + 1 > 64:
                continue
            if req.num_computed_tokens == req.num_tokens:
                req.append(token)
            n = min(chunk, req.num_tokens - req.num_computed_tokens)
            before = snapshot(m)
            new = m.allocate_slots(req, n, num_lookahead_tokens=lookahead)
            if new is None:
                assert snapshot(m) == before
                m.free(req)  # preempt
                del active[req.request_id]
            else:
                assert (
                    m.get_block_ids(req.request_id)[
                        len(m.get_block_ids(req.request_id)) - len(new) :
                    ]
                    == new
                )
                req.num_computed_tokens += n
        elif kind == "free":
            req = active.pop(str(args[0]), None)
            if req is not None:
                m.free(req)
        else:
            m.evict_blocks([args[0]])
        check_invariants(m, active)
    for req in list(active.values()):
        m.free(req)
    active.clear()
    check_invariants(m, active)
    assert m.num_free_blocks == NUM_BLOCKS - 1
    assert all(m.block_pool.ref_cnt(b) == 0 for b in range(NUM_BLOCKS))
    assert m.reset_prefix_cache()
