"""The Triton unified paged-attention kernel against the PyTorch reference on mixed
prefill / decode / chunked batches. Without CUDA it runs under the Triton interpreter
(TRITON_INTERPRET=1, set before the kernel module is imported)."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    # Before triton's first import: its own @jit helpers (tl.cdiv ...) must be interpreted too.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from schedkit.runners.paged.attention import paged_attention_ref  # noqa: E402
from schedkit.runners.paged.testing import make_attention_case  # noqa: E402
from schedkit.runners.paged.triton_attention import choose_num_splits, unified_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = {
    # name: (specs as (context, query) per sequence, block_size, heads, kv_heads, head_dim)
    "mixed-gqa2-bs16": ([(0, 5), (10, 1), (37, 20), (3, 1), (16, 16)], 16, 4, 2, 32),
    "chunks-gqa7-d24-bs8": ([(0, 33), (17, 1), (50, 7)], 8, 7, 1, 24),
    "mha-bs32-prefill": ([(0, 40), (31, 2)], 32, 2, 2, 16),
    "gqa32-bs1": ([(3, 4), (9, 1)], 1, 32, 1, 16),
}


def _run(name: str, dtype: torch.dtype, num_splits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    specs, bs, heads, kv_heads, head_dim = CASES[name]
    q, k, v, meta = make_attention_case(specs, block_size=bs, num_heads=heads, num_kv_heads=kv_heads,
                                        head_dim=head_dim, dtype=dtype, device=DEVICE,
                                        num_splits=num_splits, seed=len(name))
    scale = head_dim ** -0.5
    out = unified_attention(q, k, v, meta, scale)
    return out, paged_attention_ref(q, k, v, meta, scale)


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_fp32(name: str) -> None:
    out, ref = _run(name, torch.float32)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["mixed-gqa2-bs16", "chunks-gqa7-d24-bs8"])
def test_kernel_matches_reference_bf16(name: str) -> None:
    out, ref = _run(name, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_split_context_decode_fp32() -> None:
    specs = [(5, 1), (40, 1), (100, 1)]
    q, k, v, meta = make_attention_case(specs, block_size=16, num_heads=4, num_kv_heads=2,
                                        head_dim=32, device=DEVICE, num_splits=4, seed=7)
    out = unified_attention(q, k, v, meta, 0.2)
    torch.testing.assert_close(out, paged_attention_ref(q, k, v, meta, 0.2), atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_split_context_decode_bf16_full_segments() -> None:
    specs = [(30, 1), (1, 1), (200, 1)]
    q, k, v, meta = make_attention_case(specs, block_size=16, num_heads=8, num_kv_heads=8,
                                        head_dim=16, dtype=torch.bfloat16, device=DEVICE,
                                        num_splits=16, seed=11)
    out = unified_attention(q, k, v, meta, 0.25)
    ref = paged_attention_ref(q, k, v, meta, 0.25)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_split_mode_is_chosen_only_for_small_decode_batches() -> None:
    assert choose_num_splits(4, 2, 1) > 1
    assert choose_num_splits(4, 2, 7) == 1  # a prefill in the batch
    assert choose_num_splits(256, 2, 1) == 1  # enough programs already


def test_kernels_compile_for_sm90_without_a_gpu() -> None:
    """Lower the kernels through PTX and ptxas for the H200 (sm_90), in a process without
    TRITON_INTERPRET, so compile errors show up before a run on a GPU."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json; from schedkit.runners.paged.testing import compile_kernels_for_cuda; "
            "print(json.dumps(compile_kernels_for_cuda(90)))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shared = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(shared) == 9 and all(0 < v <= 228 * 1024 for v in shared.values())
