"""Hot-path benchmark: one decode step of 1,024 running requests (pytest-benchmark)."""

from __future__ import annotations

from schedkit.kv import KVCacheManager

NUM_REQS = 1024


def test_decode_step_allocate_slots_1k(benchmark, make_request):
    m = KVCacheManager(block_size=16, num_blocks=NUM_REQS * 8 + 1, max_model_len=4096)
    reqs = []
    for i in range(NUM_REQS):
        r = make_request(i, [i] * 100, 16, algo="xxhash")
        assert m.allocate_slots(r, 100) is not None
        r.num_computed_tokens = 100
        r.append(1)  # 101 tokens: the next decode slot fits in the 7th block
        reqs.append(r)
    free_before = m.num_free_blocks

    def step() -> None:
        alloc = m.allocate_slots
        for r in reqs:
            alloc(r, 1)

    benchmark(step)
    assert m.num_free_blocks == free_before  # no new block was needed
    assert all(m.get_num_cached_blocks(r.request_id) == 6 for r in reqs)
