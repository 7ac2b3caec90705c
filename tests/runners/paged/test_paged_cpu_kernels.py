"""The CPU fast path: the compiled attention kernel against the PyTorch reference on
mixed prefill / decode / chunked batches (float32, bfloat16, float16 caches), the fused
RoPE + KV store + attention call, the norm and activation kernels, the packed linear
layers, and how the runner picks them."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from schedkit.errors import ConfigError  # noqa: E402
from schedkit.runners.paged import cpu_kernels  # noqa: E402
from schedkit.runners.paged.attention import (  # noqa: E402
    paged_attention_cpu,
    paged_attention_ref,
    rope_store_attention_cpu,
    store_kv,
)
from schedkit.runners.paged.cpu_linear import (  # noqa: E402
    PackedLinear,
    cpu_compute_dtype,
    onednn_matmul_supported,
)
from schedkit.runners.paged.model_runner import resolve_attention_backend  # noqa: E402
from schedkit.runners.paged.testing import make_attention_case  # noqa: E402

if cpu_kernels.load_cpu_kernels() is None:  # pragma: no cover - a machine without g++
    pytest.skip(f"no CPU kernel: {cpu_kernels.build_error()}", allow_module_level=True)

CASES = {
    # name: (specs as (context, query) per sequence, block_size, heads, kv_heads, head_dim)
    "mixed-gqa2-bs16": ([(0, 5), (10, 1), (37, 20), (3, 1), (16, 16)], 16, 4, 2, 32),
    "chunks-gqa7-d24-bs8": ([(0, 33), (17, 1), (50, 7)], 8, 7, 1, 24),
    "mha-bs32-prefill": ([(0, 40), (31, 2)], 32, 2, 2, 16),
    "gqa32-bs1": ([(3, 4), (9, 1)], 1, 32, 1, 16),
    "smollm-shape-decodes": ([(c, 1) for c in (1, 15, 16, 17, 200, 511)] + [(0, 70), (33, 90)],
                             16, 9, 3, 64),
    "odd-block-5": ([(0, 13), (7, 1), (22, 9), (4, 1)], 5, 6, 2, 8),
}
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(name: str, dtype: torch.dtype) -> None:
    specs, bs, heads, kv_heads, head_dim = CASES[name]
    q, k, v, meta = make_attention_case(specs, block_size=bs, num_heads=heads, num_kv_heads=kv_heads,
                                        head_dim=head_dim, dtype=dtype, seed=len(name))
    scale = head_dim ** -0.5
    out = paged_attention_cpu(q, k, v, meta, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), paged_attention_ref(q, k, v, meta, scale).float(), **TOL[dtype])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_result_does_not_depend_on_threads(threads: int) -> None:
    specs, bs, heads, kv_heads, head_dim = CASES["smollm-shape-decodes"]
    q, k, v, meta = make_attention_case(specs, block_size=bs, num_heads=heads, num_kv_heads=kv_heads,
                                        head_dim=head_dim, seed=5)
    one = paged_attention_cpu(q, k, v, meta, 0.125, num_threads=1)
    assert torch.equal(paged_attention_cpu(q, k, v, meta, 0.125, num_threads=threads), one)


def _rope_tables(positions: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_rope_store_attention_matches_the_step_by_step_path(dtype: torch.dtype) -> None:
    """The fused call leaves the same keys and values in the cache (in the cache's
    dtype, rounded as torch rounds) and returns the same attention as RoPE in torch,
    store_kv and the reference."""
    import numpy as np

    from schedkit.runners.paged.models.llama import RotaryEmbedding

    specs, heads, kv_heads, head_dim, bs = [(0, 9), (20, 1), (35, 6), (3, 1)], 6, 2, 16, 8
    _, k_cache, v_cache, meta = make_attention_case(specs, block_size=bs, num_heads=heads,
                                                    num_kv_heads=kv_heads, head_dim=head_dim,
                                                    dtype=dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    num_tokens = sum(n for _, n in specs)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    positions = torch.from_numpy(np.concatenate([np.arange(c, c + n) for c, n in specs]).astype(np.int64))
    # each token's slot through its sequence's block table
    slots = []
    for i, (c, n) in enumerate(specs):
        for p in range(c, c + n):
            slots.append(int(meta.block_table[i, p // bs]) * bs + p % bs)
    meta.slot_mapping = torch.tensor(slots, dtype=torch.int64)
    cos, sin = _rope_tables(64, head_dim)
    k2, v2 = k_cache.clone(), v_cache.clone()
    out = rope_store_attention_cpu(qkv, positions, cos, sin, k_cache, v_cache, meta, heads, 0.25)

    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q, k = (x.reshape(num_tokens, -1, head_dim) for x in (q, k))
    q = q * c + RotaryEmbedding._rotate_half(q) * s
    k = k * c + RotaryEmbedding._rotate_half(k) * s
    store_kv(k, v.reshape(num_tokens, kv_heads, head_dim), k2, v2, meta.slot_mapping)
    tol = TOL[dtype] if dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache.float(), k2.float(), **tol)
    assert torch.equal(v_cache, v2)
    ref = paged_attention_ref(q, k2, v2, meta, 0.25).reshape(num_tokens, -1)
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_add_rms_norm_and_silu_and_mul_match_torch() -> None:
    from schedkit.runners.paged.models.llama import RMSNorm

    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(37, 96, generator=g), torch.randn(37, 96, generator=g)
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=g) + 0.5)
    torch.testing.assert_close(cpu_kernels.add_rms_norm(x, None, norm.weight, 1e-5), norm(x), atol=1e-5, rtol=1e-5)
    summed = x + res
    out = cpu_kernels.add_rms_norm(x, res, norm.weight, 1e-5)
    assert torch.equal(res, summed), "the residual is updated in place"
    torch.testing.assert_close(out, norm(summed), atol=1e-5, rtol=1e-5)
    gu = torch.randn(5, 2 * 40, generator=g) * 4
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_and_mul(gu), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    lin = torch.nn.Linear(48, 80, bias=bias)
    x = torch.randn(rows, 48, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(PackedLinear.from_linear(lin)(x), lin(x), atol=1e-4, rtol=1e-5)


def test_compute_dtype_setting() -> None:
    assert cpu_compute_dtype(torch.bfloat16, "float32") == torch.float32
    assert cpu_compute_dtype(torch.bfloat16, "model") == torch.bfloat16
    assert cpu_compute_dtype(torch.float32, "auto") == torch.float32
    native = onednn_matmul_supported(torch.bfloat16)
    assert cpu_compute_dtype(torch.bfloat16, "auto") == (torch.bfloat16 if native else torch.float32)


def test_backend_resolution_and_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert resolve_attention_backend("auto", cpu, 64) == "cpu"
    assert resolve_attention_backend("torch", cpu, 64) == "torch"
    assert resolve_attention_backend("auto", cpu, 12) == "torch", "head_dim 12 is not a multiple of 8"
    with pytest.raises(ConfigError, match="multiple of 8"):
        resolve_attention_backend("cpu", cpu, 12)
    # no compiler: auto falls back to the reference, an explicit cpu is a ConfigError
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    assert resolve_attention_backend("auto", cpu, 64) == "torch"
    with pytest.raises(ConfigError, match="no C\\+\\+ compiler"):
        resolve_attention_backend("cpu", cpu, 64)


def test_a_failed_build_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("SCHEDKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "FLAGS", [*cpu_kernels.FLAGS, "-fno-such-flag-anywhere"])
    assert cpu_kernels.load_cpu_kernels() is None
    assert "failed" in (cpu_kernels.build_error() or "")
    assert not list((tmp_path / "kernels").iterdir()), "no half-built library or object is left behind"


def test_editing_any_kernel_source_or_header_builds_a_new_library(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Any) -> None:
    """The library's cache key covers every file of csrc/: a change to a header that
    only some sources include, or a new source, gives the library a new name, so the
    next load compiles it instead of loading a stale build."""
    import shutil

    csrc = tmp_path / "csrc"
    shutil.copytree(cpu_kernels.CSRC, csrc)
    monkeypatch.setattr(cpu_kernels, "CSRC", csrc)
    compiler = cpu_kernels._compiler()
    assert compiler is not None
    assert {f.name for f in cpu_kernels.sources()} >= {"attention.cpp", "gemm.cpp", "elementwise.cpp",
                                                       "sampling.cpp"}
    names = [cpu_kernels._library_path(compiler).name]
    assert names[0].startswith(f"{cpu_kernels.LIBRARY}-")
    for edit in ("simd.h", "attention_bf16_tiles.h", "gemm.cpp"):
        with open(csrc / edit, "a") as f:
            f.write("// edited\n")
        names.append(cpu_kernels._library_path(compiler).name)
    (csrc / "extra.cpp").write_text("// a new source\n")
    names.append(cpu_kernels._library_path(compiler).name)
    assert len(set(names)) == len(names), names


def test_silu_and_mul_of_large_negative_gates_is_zero_not_nan() -> None:
    gate = torch.tensor([-88.0, -89.0, -90.0, -100.0, -1e4, -3e38, 0.5, 3.0] * 2)
    out = cpu_kernels.silu_and_mul(torch.cat([gate, torch.ones(16)]).view(1, 32))
    assert not out.isnan().any()
    torch.testing.assert_close(out[0], F.silu(gate), atol=1e-6, rtol=1e-5)


def test_loading_the_kernels_keeps_denormals_for_the_rest_of_the_process() -> None:
    """Linked with -ffast-math, a shared library turns on flush-to-zero process-wide."""
    import numpy as np

    assert cpu_kernels.load_cpu_kernels() is not None
    assert float(torch.tensor([1e-39]) * 1) > 0
    assert float(np.float32(1e-39) * np.float32(1)) > 0


def _fused_case(dtype: torch.dtype = torch.float32) -> tuple[Any, ...]:
    import numpy as np

    specs, heads, kv_heads, head_dim, bs = [(0, 5), (9, 1)], 4, 2, 8, 4
    _, k_cache, v_cache, meta = make_attention_case(specs, block_size=bs, num_heads=heads,
                                                    num_kv_heads=kv_heads, head_dim=head_dim,
                                                    dtype=dtype, seed=1)
    positions = torch.from_numpy(np.concatenate([np.arange(c, c + n) for c, n in specs]).astype(np.int64))
    slots = [int(meta.block_table[i, p // bs]) * bs + p % bs
             for i, (c, n) in enumerate(specs) for p in range(c, c + n)]
    meta.slot_mapping = torch.tensor(slots, dtype=torch.int64)
    qkv = torch.randn(len(slots), (heads + 2 * kv_heads) * head_dim)
    cos, sin = _rope_tables(32, head_dim)
    return qkv, positions, cos, sin, k_cache, v_cache, meta, heads


@pytest.mark.parametrize("field,value,message", [
    ("slot", -1, "slot outside"), ("slot", 10**6, "slot outside"),
    ("block", -2, "block id outside"), ("block", 10**6, "block id outside"),
    ("position", 32, "position outside")])
def test_bad_indices_are_refused_before_anything_is_written(field: str, value: int, message: str) -> None:
    """A bad slot, block id or position is refused by name: the kernel checks them all
    up front instead of writing into another layer's cache."""
    qkv, positions, cos, sin, k_cache, v_cache, meta, heads = _fused_case()
    if field == "slot":
        meta.slot_mapping[2] = value
    elif field == "block":
        meta.block_table[1, 0] = value
    else:
        positions[0] = value
    k0, v0 = k_cache.clone(), v_cache.clone()
    with pytest.raises(RuntimeError, match=message):
        rope_store_attention_cpu(qkv, positions, cos, sin, k_cache, v_cache, meta, heads, 0.3)
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)


def test_fused_call_with_a_float16_cache_and_wrong_inputs() -> None:
    if not cpu_kernels.supports_float16():  # pragma: no cover - an old compiler
        pytest.skip("this compiler has no _Float16")
    qkv, positions, cos, sin, k_cache, v_cache, meta, heads = _fused_case(torch.float16)
    out = rope_store_attention_cpu(qkv, positions, cos, sin, k_cache, v_cache, meta, heads, 0.3)
    assert out.shape == (qkv.shape[0], heads * 8) and not out.isnan().any()
    with pytest.raises(ValueError, match="int64"):
        rope_store_attention_cpu(qkv, positions.int(), cos, sin, k_cache, v_cache, meta, heads, 0.3)
    with pytest.raises(ValueError, match="unit stride"):
        rope_store_attention_cpu(qkv.t().contiguous().t(), positions, cos, sin, k_cache, v_cache,
                                 meta, heads, 0.3)
    with pytest.raises(ValueError, match="one shape and dtype"):
        rope_store_attention_cpu(qkv, positions, cos, sin, k_cache, v_cache.float(), meta, heads, 0.3)


def test_cpu_backend_on_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="needs runner.device = 'cpu'"):
        resolve_attention_backend("cpu", torch.device("cuda"), 64)


def test_prepare_cpu_model_keeps_the_rope_tables_in_float32(model_dir: Any) -> None:
    from schedkit.runners.paged.cpu_linear import prepare_cpu_model
    from schedkit.runners.paged.loader import load_model, read_model_args

    path = model_dir("llama", num_heads=4, num_kv_heads=2)
    args = read_model_args(path)
    model = load_model(path, args, dtype=torch.bfloat16, device=torch.device("cpu"), max_positions=64)
    prepare_cpu_model(model, torch.float32)
    assert model.model.rotary_emb.cos.dtype == torch.float32
    assert next(model.parameters()).dtype == torch.float32
    assert isinstance(model.model.layers[0].mlp.down_proj, PackedLinear)
    assert isinstance(model.lm_head, PackedLinear), "the tied head gets a packed copy"
