"""The PyTorch paged-attention reference and the store-KV step, against a dense oracle
that gathers every token and runs SDPA in float64."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from schedkit.runners.paged.attention import paged_attention, store_kv  # noqa: E402
from schedkit.runners.paged.testing import dense_attention, make_attention_case  # noqa: E402

MIXED = [(0, 5), (10, 1), (37, 20), (3, 1), (0, 1), (16, 16), (63, 1)]


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_reference_matches_dense_oracle_on_mixed_batches(block_size: int, heads: tuple[int, int]) -> None:
    q, k, v, meta = make_attention_case(MIXED, block_size=block_size, num_heads=heads[0],
                                        num_kv_heads=heads[1], head_dim=16, seed=block_size)
    meta.backend = "torch"
    out = paged_attention(q, k, v, meta, 0.25)
    torch.testing.assert_close(out, dense_attention(q, k, v, meta, 0.25), atol=2e-6, rtol=1e-5)


def test_reference_in_bfloat16_is_close() -> None:
    q, k, v, meta = make_attention_case(MIXED, dtype=torch.bfloat16, seed=3)
    out = paged_attention(q, k, v, meta, 32 ** -0.5)
    assert out.dtype == torch.bfloat16
    ref = dense_attention(q.float(), k.float(), v.float(), meta, 32 ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_store_kv_writes_each_token_to_its_slot() -> None:
    k_cache = torch.zeros(4, 8, 2, 16)
    v_cache = torch.zeros(4, 8, 2, 16)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([8 * 2 + 5, 8 * 3 + 0, 8 * 1 + 7])
    store_kv(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache[2, 5], k[0])
    torch.testing.assert_close(v_cache[3, 0], v[1])
    torch.testing.assert_close(k_cache[1, 7], k[2])
    assert k_cache[0].abs().sum() == 0  # the null block is untouched
