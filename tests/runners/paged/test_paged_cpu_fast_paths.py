"""The CPU kernel's machine-specific paths against the PyTorch reference: the bfloat16
prefill tiles (AMX, and vdpbf16ps where there is no AMX), the AVX-512 item path, SDPA for bfloat16 prefill
chunks, the bfloat16 activation kernels (rounded where torch rounds), the threaded
argmax, and an AVX2 build of the same library (``SCHEDKIT_KERNEL_MARCH``) so that the
paths an AVX-512 machine skips are still checked there."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from schedkit.runners.paged import attention as attention_mod  # noqa: E402
from schedkit.runners.paged import cpu_kernels  # noqa: E402
from schedkit.runners.paged.attention import (  # noqa: E402
    paged_attention_cpu,
    paged_attention_ref,
    rope_store_attention_cpu,
)
from schedkit.runners.paged.testing import make_attention_case  # noqa: E402

if cpu_kernels.load_cpu_kernels() is None:  # pragma: no cover - a machine without g++
    pytest.skip(f"no CPU kernel: {cpu_kernels.build_error()}", allow_module_level=True)

PREFILL_CASES = {
    # name: ((context, query) per sequence, block_size, heads, kv_heads, head_dim)
    "smollm-shape": ([(0, 70), (33, 90), (5, 1), (0, 16), (0, 17), (100, 31), (0, 64)], 16, 9, 3, 64),
    "bs32-d32": ([(0, 40), (31, 20), (64, 64), (2, 1)], 32, 4, 2, 32),
    "bs8-d128-mqa": ([(0, 33), (17, 18), (50, 40)], 8, 8, 1, 128),
    "bs5-odd-chunks": ([(0, 40), (7, 19), (3, 1)], 5, 6, 2, 64),
    "bs1": ([(0, 20), (4, 17)], 1, 2, 2, 32),
}
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


@pytest.fixture
def amx_off_after() -> Any:
    yield
    cpu_kernels.set_amx(True)
    cpu_kernels.set_bf16_tiles(True)


def _has_flag(flag: str) -> bool:
    return os.path.exists("/proc/cpuinfo") and flag in open("/proc/cpuinfo").read().split()


@pytest.mark.parametrize("name", list(PREFILL_CASES))
def test_bf16_prefill_matches_the_reference_on_every_engine(name: str, amx_off_after: Any) -> None:
    """Chunks of 16+ rows take the AMX tiles where the CPU has them, else the vdpbf16ps
    tiles (AVX512-BF16); shorter ones, and every row with both off, the AVX-512 or
    portable item path. Each within bfloat16 precision of the float32 reference, and the
    same whatever the thread count."""
    specs, bs, heads, kv_heads, head_dim = PREFILL_CASES[name]
    q, k, v, meta = make_attention_case(specs, block_size=bs, num_heads=heads, num_kv_heads=kv_heads,
                                        head_dim=head_dim, dtype=torch.bfloat16, seed=len(name))
    scale = head_dim ** -0.5
    ref = paged_attention_ref(q, k, v, meta, scale).float()
    results = {}
    for amx, dot in ((True, True), (False, True), (False, False)):
        cpu_kernels.set_amx(amx)
        assert cpu_kernels.set_bf16_tiles(dot) == (dot and _has_flag("avx512_bf16"))
        one = paged_attention_cpu(q, k, v, meta, scale, num_threads=1)
        torch.testing.assert_close(one.float(), ref, **BF16_TOL)
        assert torch.equal(paged_attention_cpu(q, k, v, meta, scale, num_threads=2), one)
        results[amx, dot] = one
    if _has_flag("avx512_bf16") and any(n >= 16 for _, n in specs):
        # the tiles really ran: P rounded to bfloat16 makes them differ from the item path
        assert not torch.equal(results[False, True], results[False, False])


def test_the_dot_tiles_are_on_where_the_cpu_has_avx512_bf16() -> None:
    if not _has_flag("avx512_bf16") or os.environ.get("SCHEDKIT_CPU_BF16_TILES") == "0":
        pytest.skip("no AVX512-BF16 here")
    assert cpu_kernels.bf16_tiles_enabled()


def test_amx_is_on_where_the_cpu_has_it() -> None:
    if not _has_flag("amx_bf16") or os.environ.get("SCHEDKIT_CPU_AMX") == "0":
        pytest.skip("no AMX here")
    assert cpu_kernels.amx_enabled()


def test_float32_prefill_and_decode_match_the_reference_tightly() -> None:
    """The AVX-512 item path (16 keys per step, a vector exp) keeps float32 exact to 2e-5."""
    for name, (specs, bs, heads, kv_heads, head_dim) in PREFILL_CASES.items():
        q, k, v, meta = make_attention_case(specs, block_size=bs, num_heads=heads, num_kv_heads=kv_heads,
                                            head_dim=head_dim, seed=7)
        torch.testing.assert_close(paged_attention_cpu(q, k, v, meta, 0.3), paged_attention_ref(q, k, v, meta, 0.3),
                                   atol=2e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float32_prefill_tiles_match_the_reference(dtype: torch.dtype, amx_off_after: Any) -> None:
    """Prefill chunks of 8+ rows as float32 tiles (keys transposed once per 16, shared by
    16 rows' query vectors; causal masks inside a chunk, chunks cut at block edges, GQA
    and MQA, context before the chunk) against the reference: float32 to 2e-5, the
    16-bit caches within their precision; the same whatever the thread count; and not
    the item path's bits, so the tiles really ran."""
    if dtype == torch.float16 and not cpu_kernels.supports_float16():
        pytest.skip("no float16 caches in this build")
    cpu_kernels.set_amx(False)
    cpu_kernels.set_bf16_tiles(False)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else BF16_TOL
    try:
        for name, (specs, bs, heads, kv_heads, head_dim) in PREFILL_CASES.items():
            q, k, v, meta = make_attention_case(specs, block_size=bs, num_heads=heads, num_kv_heads=kv_heads,
                                                head_dim=head_dim, dtype=dtype, seed=len(name) + 1)
            ref = paged_attention_ref(q, k, v, meta, 0.3).float()
            assert cpu_kernels.set_float_tiles(True)
            one = paged_attention_cpu(q, k, v, meta, 0.3, num_threads=1)
            torch.testing.assert_close(one.float(), ref, **tol, msg=name)
            assert torch.equal(paged_attention_cpu(q, k, v, meta, 0.3, num_threads=2), one), name
            assert not cpu_kernels.set_float_tiles(False)
            items = paged_attention_cpu(q, k, v, meta, 0.3, num_threads=1)
            torch.testing.assert_close(items.float(), ref, **tol, msg=name)
            if dtype == torch.float32 and head_dim % 16 == 0:
                assert not torch.equal(items, one), f"{name}: the float32 tiles did not run"
    finally:
        cpu_kernels.set_float_tiles(True)


def test_float32_tiles_in_the_fused_call_keep_the_cache_and_the_answer() -> None:
    """The fused call in float32 keeps its rotated queries in ``out`` until each item
    replaces its rows: with the tiles (one KV head's rows at a time) the answer is the
    item path's, within float32 rounding, and the cache the same."""
    specs, heads, kv_heads, head_dim, bs = [(0, 40), (24, 33), (9, 1), (0, 7), (3, 16)], 6, 2, 64, 16
    qkv, positions, cos, sin, k1, v1, meta = _fused_inputs(specs, heads, kv_heads, head_dim, bs, torch.float32)
    k2, v2 = k1.clone(), v1.clone()
    try:
        assert cpu_kernels.set_float_tiles(True)
        tiles = rope_store_attention_cpu(qkv, positions, cos, sin, k1, v1, meta, heads, 0.125)
        cpu_kernels.set_float_tiles(False)
        items = rope_store_attention_cpu(qkv, positions, cos, sin, k2, v2, meta, heads, 0.125)
    finally:
        cpu_kernels.set_float_tiles(True)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    torch.testing.assert_close(tiles, items, atol=2e-5, rtol=1e-5)
    assert not torch.equal(tiles, items)


def _fused_inputs(specs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, bs: int,
                  dtype: torch.dtype) -> tuple[Any, ...]:
    import numpy as np

    _, k_cache, v_cache, meta = make_attention_case(specs, block_size=bs, num_heads=heads,
                                                    num_kv_heads=kv_heads, head_dim=head_dim,
                                                    dtype=dtype, seed=11)
    positions = torch.from_numpy(np.concatenate([np.arange(c, c + n) for c, n in specs]).astype(np.int64))
    slots = [int(meta.block_table[i, p // bs]) * bs + p % bs
             for i, (c, n) in enumerate(specs) for p in range(c, c + n)]
    meta.slot_mapping = torch.tensor(slots, dtype=torch.int64)
    g = torch.Generator().manual_seed(12)
    qkv = torch.randn(len(slots), (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    emb = torch.outer(torch.arange(256, dtype=torch.float32), inv).repeat(1, 2)
    return qkv, positions, emb.cos(), emb.sin(), k_cache, v_cache, meta


def test_sdpa_prefill_chunks_match_the_kernel(monkeypatch: pytest.MonkeyPatch, amx_off_after: Any) -> None:
    """bfloat16 chunks of dense_min_query+ rows through SDPA (fresh prompts and chunks
    with context) give the kernel's answer within bfloat16 precision, and write the same
    cache."""
    specs, heads, kv_heads, head_dim, bs = [(0, 40), (24, 33), (9, 1), (0, 7)], 6, 2, 64, 16
    cpu_kernels.set_amx(False)
    monkeypatch.setattr(attention_mod, "_dense_prefill_supported", lambda: True)
    qkv, positions, cos, sin, k1, v1, meta = _fused_inputs(specs, heads, kv_heads, head_dim, bs, torch.bfloat16)
    k2, v2 = k1.clone(), v1.clone()
    dense = rope_store_attention_cpu(qkv, positions, cos, sin, k1, v1, meta, heads, 0.125, dense_min_query=16)
    paged = rope_store_attention_cpu(qkv, positions, cos, sin, k2, v2, meta, heads, 0.125, dense_min_query=0)
    assert dense.dtype == torch.bfloat16
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    torch.testing.assert_close(dense.float(), paged.float(), **BF16_TOL)


def test_bf16_fused_call_matches_the_float32_one() -> None:
    specs, heads, kv_heads, head_dim, bs = [(0, 20), (30, 1), (5, 18)], 4, 2, 32, 8
    qkv, positions, cos, sin, k1, v1, meta = _fused_inputs(specs, heads, kv_heads, head_dim, bs, torch.bfloat16)
    k2, v2 = k1.clone(), v1.clone()
    out16 = rope_store_attention_cpu(qkv, positions, cos, sin, k1, v1, meta, heads, 0.2)
    out32 = rope_store_attention_cpu(qkv.float(), positions, cos, sin, k2, v2, meta, heads, 0.2)
    assert out16.dtype == torch.bfloat16 and out32.dtype == torch.float32
    assert torch.equal(k1, k2) and torch.equal(v1, v2), "the cache holds the same rounded keys"
    torch.testing.assert_close(out16.float(), out32, **BF16_TOL)


@pytest.mark.parametrize("dim", [96, 576, 40])
def test_bf16_norm_and_silu_round_as_torch_does(dim: int) -> None:
    """In bfloat16 the kernels round where transformers' bfloat16 ops round: the residual
    sum, the normalised row before the weight, the SiLU before the product."""
    from schedkit.runners.paged.models.llama import RMSNorm

    g = torch.Generator().manual_seed(dim)
    x = (torch.randn(33, dim, generator=g) * 3).bfloat16()
    res = torch.randn(33, dim, generator=g).bfloat16()
    norm = RMSNorm(dim, 1e-5).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim, generator=g) + 0.5)
    w32 = norm.weight.detach().float()
    summed = x + res  # bfloat16 add, rounded
    residual = res.clone()
    out = cpu_kernels.add_rms_norm(x, residual, w32, 1e-5)
    assert out.dtype == torch.bfloat16 and torch.equal(residual, summed)
    with torch.no_grad():
        expected = norm(summed)
    # the same roundings; the float32 sum of squares may differ in its last bit
    assert (out.float() - expected.float()).abs().max() <= 2 ** -7 * expected.float().abs().max()
    assert (out == expected).float().mean() > 0.97
    gu = (torch.randn(9, 2 * dim, generator=g) * 4).bfloat16()
    gate, up = gu.chunk(2, dim=-1)
    got = cpu_kernels.silu_and_mul(gu)
    want = F.silu(gate) * up
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
    assert (got == want).float().mean() > 0.97


def test_bf16_kernels_refuse_mixed_dtypes() -> None:
    x = torch.randn(3, 32).bfloat16()
    with pytest.raises(ValueError, match="residual"):
        cpu_kernels.add_rms_norm(x, torch.randn(3, 32), torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_kernels.silu_and_mul(x.half())
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.add_rms_norm(x, None, torch.ones(32).bfloat16(), 1e-5)


@pytest.mark.parametrize("shape", [(64, 49152), (3, 17), (5, 1), (7, 16), (2, 33), (1, 0)])
def test_argmax_rows_is_torch_argmax(shape: tuple[int, int]) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    if shape[1] == 0:
        with pytest.raises(IndexError):
            x.argmax(-1)
        assert cpu_kernels.argmax_rows(x).tolist() == [0] * shape[0]
        return
    assert torch.equal(cpu_kernels.argmax_rows(x), x.argmax(-1))


def test_argmax_rows_ties_nan_and_infinities() -> None:
    x = torch.randn(8, 1000)
    x[0, 100] = x[0, 50] = float("nan")  # the first NaN wins
    x[1, :] = 1.0  # ties: the first index
    x[2, 7] = x[2, 9] = float("inf")
    x[3, :] = float("-inf")
    x[4, 999] = float("nan")  # in the scalar tail
    x[5, 3] = x[5, 700] = 50.0
    assert torch.equal(cpu_kernels.argmax_rows(x), x.argmax(-1))
    assert cpu_kernels.argmax_rows(x)[:6].tolist() == [50, 0, 7, 0, 999, 3]
    with pytest.raises(ValueError, match="unit row stride"):
        cpu_kernels.argmax_rows(x.t())


def test_the_sampler_uses_the_kernel_for_greedy_rows() -> None:
    from schedkit.core.request import SamplingParams
    from schedkit.runners.paged.sampler import Sampler, SamplingBatch

    logits = torch.randn(6, 300)
    logits[2, :] = 0.5
    batch = SamplingBatch.build([SamplingParams(temperature=0.0)] * 6, [0] * 6, 300, torch.device("cpu"))
    assert torch.equal(Sampler(torch.device("cpu"))(logits, batch), logits.argmax(-1))


GEMV_SHAPES = [  # (out, in, bias): an odd number of 16-output blocks, one block, K odd, no gemv (N % 16)
    (960, 576, False), (48, 10, True), (16, 7, True), (80, 1536, True), (20, 8, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_one_row_linear_matches_the_reference(dtype: torch.dtype) -> None:
    from schedkit.runners.paged.cpu_linear import PackedLinear

    if not cpu_kernels.gemv_supported(dtype):
        pytest.skip(f"this build has no one-row GEMM for {dtype}")
    g = torch.Generator().manual_seed(0)
    for n, k, has_bias in GEMV_SHAPES:
        if dtype == torch.bfloat16 and k % 2:
            continue
        w = torch.randn(n, k, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype) if has_bias else None
        lin = PackedLinear(w, b)
        assert (lin.gemv_weight is not None) == (n % 16 == 0)
        x = torch.randn(3, k, generator=g).to(dtype)
        ref = F.linear(x.float(), w.float(), None if b is None else b.float())
        one = lin(x[1:2])  # the one-row path
        assert one.dtype == dtype and one.shape == (1, n)
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else BF16_TOL
        torch.testing.assert_close(one.float(), ref[1:2], **tol)
        torch.testing.assert_close(lin(x).float(), ref, **tol)  # three rows: the tiles (AVX2) or oneDNN


GEMM_ROWS = [2, 5, 6, 7, 13, 150, 301]
"""Row counts of the multi-row kernel: tails of 1-5 rows after full tiles of 6, more than
one panel of 144 rows."""


@pytest.mark.parametrize("n, k, has_bias", [(960, 576, False), (48, 10, True), (16, 7, True), (80, 1536, True),
                                            (32, 1600, False)])
def test_several_rows_through_the_packed_kernel_match_the_reference(n: int, k: int, has_bias: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The multi-row float32 GEMM against float64, for row tails, K in one, several and
    uneven chunks (7 and 576 in one, 1536 = 2 x 768, 1600 = 534 + 534 + 532), rows read
    with a stride, and the same bits on one thread as on two (each output is summed by one
    thread in one order)."""
    from schedkit.runners.paged.cpu_linear import PackedLinear

    if not cpu_kernels.gemm_supported(torch.float32):
        pytest.skip("this build has no multi-row GEMM (it needs AVX2 and FMA)")
    monkeypatch.setenv("SCHEDKIT_CPU_GEMM", "1")  # the tiles, even where oneDNN is the faster
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if has_bias else None
    lin = PackedLinear(w, b)
    assert lin._many_rows
    wide = torch.randn(max(GEMM_ROWS), k + 9, generator=g)
    threads = torch.get_num_threads()
    for rows in GEMM_ROWS:
        x = wide[:rows, 3:3 + k]  # a row stride of k + 9
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        got = lin(x)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, atol=1e-4 * max(1.0, k ** 0.5), rtol=1e-4)
        torch.set_num_threads(1)
        try:
            assert torch.equal(lin(x.contiguous()), got)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_calls_get_rows_padded_to_a_multiple_of_16(dtype: torch.dtype,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN builds a kernel per row count (cpu_linear.ROW_ALIGN): a call of more than
    pad_from(dtype) rows (16 in bfloat16, 256 in float32) reaches it padded with zero rows
    to a multiple of 16, and the answer is the first rows, the same as the unpadded call's;
    smaller calls go as they are."""
    from schedkit.runners.paged import cpu_linear

    if not cpu_linear.onednn_matmul_supported(dtype):
        pytest.skip(f"oneDNN has no native {dtype} matmul on this CPU")
    monkeypatch.setenv("SCHEDKIT_CPU_GEMM", "0")  # oneDNN for every row count
    seen: list[int] = []
    inner = cpu_linear._LINEAR

    def recording(x: torch.Tensor, *args: object) -> torch.Tensor:
        seen.append(x.shape[0])
        return inner(x, *args)

    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(96, 64, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    lin = cpu_linear.PackedLinear(w, b)
    lin._many_rows = False
    wide = torch.randn(301, 70, generator=g).to(dtype)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else BF16_TOL
    for rows in (2, 16, 17, 32, 37, 150, 301):
        x = wide[:rows, 3:67]  # strided rows
        exact = inner(x.contiguous(), lin.packed_weight, lin.bias, "none", [], "")
        monkeypatch.setattr(cpu_linear, "_LINEAR", recording)
        got = lin(x)
        monkeypatch.setattr(cpu_linear, "_LINEAR", inner)
        assert got.shape == (rows, 96) and got.dtype == dtype and got.is_contiguous()
        assert seen[-1] == cpu_linear.padded_rows(rows, dtype)
        assert seen[-1] == (rows if rows <= cpu_linear.pad_from(dtype) else -(-rows // 16) * 16)
        torch.testing.assert_close(got, exact, **tol)
        ref = F.linear(x.float(), w.float(), b.float())
        torch.testing.assert_close(got.float(), ref, **(dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32
                                                          else BF16_TOL))


def test_the_runner_warms_every_row_count_a_call_can_reach_onednn_with(monkeypatch: pytest.MonkeyPatch) -> None:
    from schedkit.runners.paged import cpu_linear

    assert cpu_linear.warm_row_counts(40, torch.bfloat16) == [*range(1, 17), 32, 48]
    assert cpu_linear.warm_row_counts(40, torch.float32) == list(range(1, 41))
    assert cpu_linear.padded_rows(300, torch.float32) == 304 and cpu_linear.padded_rows(256, torch.float32) == 256
    monkeypatch.setenv("SCHEDKIT_CPU_GEMM", "0")
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Linear(32, 48, bias=False) for _ in range(3))  # one shape
    model.mlp = torch.nn.Linear(48, 32, bias=True)
    model.lm_head = torch.nn.Linear(32, 48, bias=False)  # the layers' shape: their kernels
    cpu_linear.prepare_cpu_model(model, torch.float32)
    calls: list[tuple[int, int, int]] = []
    inner = cpu_linear._LINEAR

    def recording(x: torch.Tensor, w: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append((x.shape[0], x.shape[1], w.shape[0]))
        return inner(x, w, *args)

    monkeypatch.setattr(cpu_linear, "_LINEAR", recording)
    cpu_linear.warm_gemm_row_counts(model, 20)
    first = 1 if model.mlp.gemv_weight is None else 2  # the one-row kernel takes 1 row where built
    # each shape once per count: the three layers share their kernels
    assert calls == [(m, 32, 48) for m in range(first, 21)] + [(m, 48, 32) for m in range(first, 21)]


def test_the_multi_row_path_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from schedkit.runners.paged.cpu_linear import PackedLinear

    monkeypatch.setenv("SCHEDKIT_CPU_GEMM", "0")
    assert not cpu_kernels.gemm_supported(torch.float32)
    w, x = torch.randn(32, 16), torch.randn(4, 16)
    lin = PackedLinear(w, None)
    assert not lin._many_rows
    torch.testing.assert_close(lin(x), F.linear(x, w), atol=1e-5, rtol=1e-5)


@pytest.fixture
def probe_beside(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """multi_row_gemm as on an AVX-512 CPU, its verdicts kept beside a library file in
    tmp_path and forgotten by the process before and after."""
    from schedkit.runners.paged import cpu_linear

    if not cpu_kernels.gemm_supported(torch.float32):
        pytest.skip("this build has no multi-row GEMM (it needs AVX2 and FMA)")
    monkeypatch.delenv("SCHEDKIT_CPU_GEMM", raising=False)
    monkeypatch.setattr(cpu_kernels, "cpu_has_avx512", lambda: True)
    monkeypatch.setattr(cpu_kernels, "library_path", lambda: tmp_path / "lib.so")
    monkeypatch.setattr(cpu_linear, "_choices", {})
    return tmp_path / "lib.so.gemm.json"


def test_on_avx512_the_multi_row_path_is_chosen_by_a_probe_kept_per_machine(
        probe_beside: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN has AVX-512 the tiles are used only if they ran the probe shapes
    faster by the margin; the verdict is measured once, written beside the library, and
    read from there by the next process (no probe), per thread count."""
    import json

    from schedkit.runners.paged import cpu_linear

    threads = torch.get_num_threads()
    verdict = cpu_linear.multi_row_gemm(torch.float32)
    saved = json.loads(probe_beside.read_text())[str(threads)]
    assert saved["multi_row"] is verdict and saved["key"] == cpu_linear._verdict_key()
    assert saved["onednn_ms"] > 0 and saved["schedkit_ms"] > 0
    assert len(saved["rounds_ms"]) == cpu_linear.GEMM_PROBE_ROUNDS
    assert verdict is all(ours <= cpu_linear.GEMM_PROBE_MARGIN * dnn + 1e-3 for dnn, ours in saved["rounds_ms"])
    assert cpu_linear.PackedLinear(torch.randn(32, 16), None)._many_rows is verdict

    def no_probe(*_: Any, **__: Any) -> Any:
        raise AssertionError("probed again")

    monkeypatch.setattr(cpu_linear, "probe_gemm", no_probe)
    monkeypatch.setattr(cpu_linear, "_choices", {})  # a new process
    assert cpu_linear.multi_row_gemm(torch.float32) is verdict
    # the file decides, whatever it says
    entry = {"multi_row": not verdict, "key": cpu_linear._verdict_key()}
    probe_beside.write_text(json.dumps({str(threads): entry}))
    monkeypatch.setattr(cpu_linear, "_choices", {})
    assert cpu_linear.multi_row_gemm(torch.float32) is (not verdict)
    # SCHEDKIT_CPU_GEMM overrides it both ways
    for setting, want in (("1", True), ("0", False)):
        monkeypatch.setenv("SCHEDKIT_CPU_GEMM", setting)
        assert cpu_linear.multi_row_gemm(torch.float32) is want
    assert not cpu_linear.multi_row_gemm(torch.bfloat16)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "[" * 100_000 + "]" * 100_000,
                                     '{"%d": {"multi_row": "false", "key": "KEY"}}',
                                     '{"%d": {"multi_row": true, "key": "torch 0.0"}}'],
                         ids=["not-json", "a-list", "deeply-nested", "a-string-verdict", "another-torch"])
def test_a_damaged_or_stale_verdict_is_probed_again(probe_beside: Any, content: str) -> None:
    import json

    from schedkit.runners.paged import cpu_linear

    threads = torch.get_num_threads()
    if "%d" in content:
        content = content.replace("%d", str(threads)).replace("KEY", cpu_linear._verdict_key())
    probe_beside.write_text(content)
    verdict = cpu_linear.multi_row_gemm(torch.float32)
    saved = json.loads(probe_beside.read_text())[str(threads)]
    assert saved["multi_row"] is verdict and saved["key"] == cpu_linear._verdict_key()


def test_the_tiles_must_win_every_probe_round(probe_beside: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One round in the tiles' favour among rounds that are not (a momentary slowdown of
    oneDNN's threads) leaves oneDNN in charge, and the file says what each round saw."""
    import json

    from schedkit.runners.paged import cpu_linear

    rounds = iter([(2.0, 1.0), (1.0, 1.0), (2.0, 1.0)])  # oneDNN, tiles: the middle one a tie
    monkeypatch.setattr(cpu_linear, "probe_gemm", lambda: next(rounds))
    assert not cpu_linear.multi_row_gemm(torch.float32)
    saved = json.loads(probe_beside.read_text())[str(torch.get_num_threads())]
    assert saved["rounds_ms"] == [[2000.0, 1000.0], [1000.0, 1000.0], [2000.0, 1000.0]]
    assert saved["multi_row"] is False and (saved["onednn_ms"], saved["schedkit_ms"]) == (2000.0, 1000.0)

    monkeypatch.setattr(cpu_linear, "_choices", {})
    probe_beside.unlink()
    rounds = iter([(2.0, 1.0), (1.0, 0.9), (2.0, 1.5)])  # the tiles ahead by the margin each time
    assert cpu_linear.multi_row_gemm(torch.float32)


def test_verdicts_of_other_thread_counts_are_kept(probe_beside: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from schedkit.runners.paged import cpu_linear

    threads = torch.get_num_threads()
    other = {"multi_row": True, "key": cpu_linear._verdict_key(), "onednn_ms": 2.0, "schedkit_ms": 1.0}
    probe_beside.write_text(json.dumps({str(threads + 7): other}))
    monkeypatch.setattr(cpu_linear, "probe_gemm", lambda: (1.0, 2.0))  # oneDNN twice as fast
    assert not cpu_linear.multi_row_gemm(torch.float32)
    saved = json.loads(probe_beside.read_text())
    assert saved[str(threads + 7)] == other and saved[str(threads)]["multi_row"] is False


def test_a_failed_probe_leaves_onednn_in_charge_and_saves_nothing(
        probe_beside: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from schedkit.runners.paged import cpu_linear

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("schedkit_gemm: unsupported shape")

    monkeypatch.setattr(cpu_linear, "probe_gemm", broken)
    with caplog.at_level("WARNING", logger="schedkit.runners.paged.cpu_linear"):
        lin = cpu_linear.PackedLinear(torch.randn(32, 16), None)  # the model still loads
    assert not lin._many_rows
    assert "several rows go to oneDNN" in caplog.text and "unsupported shape" in caplog.text
    assert not probe_beside.exists()


def test_an_unwritable_cache_still_decides(probe_beside: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from schedkit.runners.paged import cpu_linear

    monkeypatch.setattr(cpu_linear, "probe_gemm", lambda: (2.0, 1.0))  # the tiles twice as fast
    probe_beside.mkdir()  # a folder where the file goes: the write fails
    assert cpu_linear.multi_row_gemm(torch.float32)
    assert [p.name for p in probe_beside.parent.iterdir() if p.suffix == ".json"] == [probe_beside.name]


def test_without_avx512_the_multi_row_path_needs_no_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    from schedkit.runners.paged import cpu_linear

    if not cpu_kernels.gemm_supported(torch.float32):
        pytest.skip("this build has no multi-row GEMM (it needs AVX2 and FMA)")

    def no_probe(*_: Any, **__: Any) -> Any:
        raise AssertionError("probed")

    monkeypatch.delenv("SCHEDKIT_CPU_GEMM", raising=False)
    monkeypatch.setattr(cpu_kernels, "cpu_has_avx512", lambda: False)
    monkeypatch.setattr(cpu_linear, "probe_gemm", no_probe)
    monkeypatch.setattr(cpu_linear, "_choices", {})
    assert cpu_linear.multi_row_gemm(torch.float32)


def test_the_one_row_path_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from schedkit.runners.paged.cpu_linear import PackedLinear

    monkeypatch.setenv("SCHEDKIT_CPU_GEMV", "0")
    assert not cpu_kernels.gemv_supported(torch.float32)
    w, x = torch.randn(32, 16), torch.randn(1, 16)
    lin = PackedLinear(w, None)
    assert lin.gemv_weight is None
    torch.testing.assert_close(lin(x), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_gemv_refuses_a_row_of_another_dtype() -> None:
    if not cpu_kernels.gemv_supported(torch.float32):
        pytest.skip("this build has no one-row GEMM")
    packed = cpu_kernels.pack_gemv_weight(torch.randn(16, 8))
    with pytest.raises(ValueError, match="gemv takes"):
        cpu_kernels.gemv(torch.randn(1, 8).bfloat16(), packed, None, 16)
    with pytest.raises(ValueError, match="gemv takes"):
        cpu_kernels.gemv(torch.randn(1, 9), packed, None, 16)  # K other than the weight's
    with pytest.raises(ValueError, match="gemv takes"):
        cpu_kernels.gemv(torch.randn(0, 8), packed, None, 16)
    with pytest.raises(ValueError, match="gemv takes"):
        cpu_kernels.gemv(torch.randn(8, 2).t(), packed, None, 16)  # no unit stride along K


AVX2_SCRIPT = r"""
import torch
import torch.nn.functional as F
from schedkit.runners.paged import cpu_kernels
from schedkit.runners.paged.attention import paged_attention_cpu, paged_attention_ref
from schedkit.runners.paged.testing import make_attention_case
assert cpu_kernels.load_cpu_kernels() is not None, cpu_kernels.build_error()
assert not cpu_kernels.amx_enabled() and not cpu_kernels.bf16_tiles_enabled()
specs = [(0, 70), (33, 20), (5, 1), (17, 1), (0, 16)]
assert cpu_kernels.float_tiles_enabled()
for tiles in (True, False):
    cpu_kernels.set_float_tiles(tiles)
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
        for bs, d in ((16, 64), (5, 32)):
            q, k, v, meta = make_attention_case(specs, block_size=bs, num_heads=6, num_kv_heads=2,
                                                head_dim=d, dtype=dtype, seed=3)
            torch.testing.assert_close(paged_attention_cpu(q, k, v, meta, 0.2).float(),
                                       paged_attention_ref(q, k, v, meta, 0.2).float(), atol=tol, rtol=tol)
x = torch.randn(5, 96).bfloat16(); r = torch.randn(5, 96).bfloat16(); r2 = r.clone()
cpu_kernels.add_rms_norm(x, r2, torch.ones(96), 1e-5)
assert torch.equal(r2, x + r)
logits = torch.randn(4, 1000)
assert torch.equal(cpu_kernels.argmax_rows(logits), logits.argmax(-1))
from schedkit.runners.paged.cpu_linear import PackedLinear
assert cpu_kernels.gemv_supported(torch.float32) and not cpu_kernels.gemv_supported(torch.bfloat16)
for n, k in ((64, 96), (48, 7), (960, 576)):  # the AVX2 one-row GEMM: odd blocks, odd K
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(1, k)
    lin = PackedLinear(w, b)
    assert lin.gemv_weight is not None
    torch.testing.assert_close(lin(x), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
assert cpu_kernels.gemm_supported(torch.float32)
import os
os.environ["SCHEDKIT_CPU_GEMM"] = "1"  # the tiles, even where oneDNN (AVX-512 here) is the faster
for rows, n, k in ((2, 64, 96), (7, 48, 7), (150, 960, 576), (13, 32, 1600)):  # the multi-row tiles
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(rows, k)
    lin = PackedLinear(w, b)
    assert lin._many_rows
    torch.testing.assert_close(lin(x).double(), F.linear(x.double(), w.double(), b.double()), atol=3e-3, rtol=1e-4)
print("ok")
"""


@pytest.mark.slow
def test_an_avx2_build_of_the_kernels_matches_the_reference(tmp_path: Any) -> None:
    """The library built for x86-64-v3 (AVX2, no AVX-512, no AMX) in a fresh process:
    the portable item path, norms and argmax, as CI's AVX2 machines run them."""
    import platform

    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if platform.machine() != "x86_64" or " avx2" not in flags:
        pytest.skip("needs an x86-64 CPU with AVX2")
    env = {**os.environ, "SCHEDKIT_KERNEL_MARCH": "x86-64-v3", "SCHEDKIT_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", AVX2_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    kernels = tmp_path / "kernels"
    assert [f.name.split("-")[0] for f in kernels.glob("*.so")] == [cpu_kernels.LIBRARY]
    assert not [f for f in kernels.iterdir() if f.is_dir()], "the build leaves no object files behind"
