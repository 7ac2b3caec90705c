"""The paged runner on CUDA (run on the H200; skipped without CUDA).

- the Triton kernel against the PyTorch reference on mixed batches (fp32 tight, bf16);
- fp32 greedy tokens identical to transformers through the real scheduler, with CUDA
  graphs on, and graphs vs eager;
- bf16 teacher-forced top-1 agreement with transformers (a trained model: >= 99%);
- KV cache sized from free memory, and a clear error when it cannot fit.

Run: ``python -m pytest tests/gpu/test_paged_gpu.py -m gpu -q`` (scripts/gpu_checks.sh runs it on the H200).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: run the GPU tests in their own process",
                allow_module_level=True)
pytest.importorskip("triton")

from schedkit.engine.core import EngineCore  # noqa: E402
from schedkit.runners.paged.attention import paged_attention_ref  # noqa: E402
from schedkit.runners.paged.builder import build_random_model, tiny_config  # noqa: E402
from schedkit.runners.paged.kv_cache import KVCacheAllocationError  # noqa: E402
from schedkit.runners.paged.model_runner import PagedModelRunner  # noqa: E402
from schedkit.runners.paged.testing import (  # noqa: E402
    BYTE_LM,
    greedy_request,
    held_out_text_sequences,
    hf_greedy,
    hf_next_tokens,
    load_hf_model,
    make_attention_case,
    paged_config,
    paged_next_tokens,
    random_prompts,
    run_engine,
    top1_agreement,
)
from schedkit.runners.paged.triton_attention import unified_attention  # noqa: E402


def _mixed_specs(n: int, seed: int, max_ctx: int = 1000) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    specs = []
    for i in range(n):
        ctx = int(torch.randint(0, max_ctx, (1,), generator=g))
        q = 1 if i % 3 else int(torch.randint(2, 300, (1,), generator=g))
        specs.append((ctx, q))
    return specs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(14, 2, 64, 16), (32, 8, 128, 32), (9, 3, 64, 16), (8, 8, 80, 16)])
def test_kernel_matches_reference_on_mixed_batches(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    heads, kv_heads, head_dim, bs = shape
    q, k, v, meta = make_attention_case(_mixed_specs(24, heads), block_size=bs, num_heads=heads,
                                        num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                                        device="cuda", seed=heads)
    out = unified_attention(q, k, v, meta, head_dim ** -0.5)
    ref = paged_attention_ref(q, k, v, meta, head_dim ** -0.5)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.parametrize("num_splits", [1, 16])
def test_kernel_decode_split_context(num_splits: int) -> None:
    specs = [(c, 1) for c in (1, 15, 16, 17, 500, 1023, 2047, 3000)]
    q, k, v, meta = make_attention_case(specs, block_size=16, num_heads=14, num_kv_heads=2,
                                        head_dim=64, device="cuda", num_splits=num_splits, seed=1)
    out = unified_attention(q, k, v, meta, 0.125)
    torch.testing.assert_close(out, paged_attention_ref(q, k, v, meta, 0.125), atol=2e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu-models")
    return {
        "llama": build_random_model(root / "llama", tiny_config("llama", num_heads=4, num_kv_heads=2)),
        "qwen2": build_random_model(root / "qwen2", tiny_config(
            "qwen2", hidden_size=128, num_layers=3, num_heads=8, num_kv_heads=2,
            intermediate_size=256, tie_word_embeddings=True)),
    }


def _workload() -> list[list[int]]:
    prompts = random_prompts([3, 17, 40, 64, 9, 33, 120, 1, 77, 50, 20, 5, 90], 512, seed=1)
    return prompts + [prompts[3][:40] + [1, 2, 3], list(prompts[6])]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("block_size, num_blocks, eager, async_scheduling", [
    (16, 400, False, False), (8, 40, False, False), (16, 400, True, False),
    (16, 400, False, True), (8, 40, False, True), (16, 400, True, True)])
def test_fp32_greedy_matches_transformers(models: dict[str, Path], family: str, block_size: int,
                                          num_blocks: int, eager: bool, async_scheduling: bool) -> None:
    """Async scheduling: two steps in flight on one stream; each decode input comes
    from the device tensor of the step before (CUDA graph and eager paths)."""
    path = models[family]
    engine = EngineCore(paged_config(path, device="cuda", block_size=block_size, num_blocks=num_blocks,
                                     enable_prefix_caching=True, max_num_batched_tokens=64,
                                     long_prefill_token_threshold=32, max_num_seqs=16,
                                     enforce_eager=eager,
                                     scheduler={"async_scheduling": async_scheduling}))
    assert (engine.runner.graphs is None) == eager
    prompts = _workload()
    got = run_engine(engine, [greedy_request(str(i), p, 24) for i, p in enumerate(prompts)])
    expected = hf_greedy(load_hf_model(path, device="cuda"), prompts, 24)
    for i in range(len(prompts)):
        assert got[str(i)] == expected[i], f"request {i} diverged"


def test_bf16_top1_agreement_on_a_trained_model() -> None:
    # the target: >= 99% teacher-forced top-1 agreement with transformers in bf16,
    # on a model that makes real decisions (random weights have flat logits)
    seqs = held_out_text_sequences(16, 500)
    runner = PagedModelRunner.from_config(paged_config(BYTE_LM, device="cuda", dtype="bfloat16",
                                                       vocab_size=256, max_model_len=1024))
    runner.initialize(1024, 16)
    got = paged_next_tokens(runner, seqs, chunk=64)
    hf_bf16, _ = hf_next_tokens(load_hf_model(BYTE_LM, torch.bfloat16, "cuda"), seqs)
    agreement = top1_agreement(got, hf_bf16)
    print(f"bf16 top-1 agreement, trained byte model: {agreement:.4f}")
    assert agreement >= 0.99


def test_bf16_top1_agreement_on_random_weights(models: dict[str, Path]) -> None:
    path = models["qwen2"]
    seqs = random_prompts([300, 250, 200, 150, 100, 64], 512, seed=9)
    runner = PagedModelRunner.from_config(paged_config(path, device="cuda", dtype="bfloat16",
                                                       max_model_len=512))
    runner.initialize(256, 16)
    got = paged_next_tokens(runner, seqs, chunk=48)
    hf_bf16, _ = hf_next_tokens(load_hf_model(path, torch.bfloat16, "cuda"), seqs)
    _, margins = hf_next_tokens(load_hf_model(path, torch.float32, "cuda"), seqs)
    print(f"bf16 top-1 agreement, random weights: all {top1_agreement(got, hf_bf16):.4f}, "
          f"clear decisions {top1_agreement(got, hf_bf16, margins, 0.05):.4f}")
    assert top1_agreement(got, hf_bf16, margins, min_margin=0.05) >= 0.99
    assert top1_agreement(got, hf_bf16) >= 0.95


@pytest.mark.skipif(not os.environ.get("SCHEDKIT_SMOLLM2_DIR"),
                    reason="set SCHEDKIT_SMOLLM2_DIR to a converted SmolLM2 folder")
def test_bf16_top1_agreement_on_real_weights() -> None:
    path = Path(os.environ["SCHEDKIT_SMOLLM2_DIR"])
    seqs = random_prompts([256] * 8, 49152, seed=3)
    runner = PagedModelRunner.from_config(paged_config(path, device="cuda", dtype="bfloat16",
                                                       vocab_size=49152, max_model_len=512))
    runner.initialize(256, 16)
    got = paged_next_tokens(runner, seqs, chunk=64)
    hf_bf16, _ = hf_next_tokens(load_hf_model(path, torch.bfloat16, "cuda"), seqs)
    assert top1_agreement(got, hf_bf16) >= 0.99


def test_kv_cache_is_sized_from_free_memory(models: dict[str, Path]) -> None:
    runner = PagedModelRunner.from_config(paged_config(models["llama"], device="cuda",
                                                       gpu_memory_utilization=0.5))
    total = torch.cuda.mem_get_info()[1]
    num_blocks = runner.initialize(10**9, 16)
    assert 1000 < num_blocks < 10**9
    assert torch.cuda.memory_allocated() <= 0.5 * total
    small = PagedModelRunner.from_config(paged_config(models["llama"], device="cuda"))
    assert small.initialize(100, 16) == 100  # cache.num_blocks caps what fits


def test_kv_cache_that_cannot_fit_is_a_clear_error(models: dict[str, Path]) -> None:
    runner = PagedModelRunner.from_config(paged_config(models["llama"], device="cuda",
                                                       gpu_memory_utilization=0.001))
    with pytest.raises(KVCacheAllocationError, match="gpu_memory_utilization"):
        runner.initialize(10**6, 16)


def test_cuda_graph_decode_matches_eager_at_every_bucket(models: dict[str, Path]) -> None:
    prompts = random_prompts([int(n) for n in torch.randint(1, 60, (37,))], 512, seed=4)

    def run(eager: bool, async_scheduling: bool = False) -> dict[str, list[int]]:
        engine = EngineCore(paged_config(models["llama"], device="cuda", max_num_seqs=37,
                                         max_num_batched_tokens=512, enforce_eager=eager,
                                         num_blocks=600,
                                         scheduler={"async_scheduling": async_scheduling}))
        return run_engine(engine, [greedy_request(str(i), p, 8 + i % 5) for i, p in enumerate(prompts)])

    eager = run(eager=True)
    assert run(eager=False) == eager
    assert run(eager=False, async_scheduling=True) == eager


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_kv_storage_loads_give_transformers_tokens(models: dict[str, Path], tmp_path: Path,
                                                  async_scheduling: bool) -> None:
    """The kv-storage connector on CUDA: prefixes saved by one engine, loaded by another."""
    from schedkit.config import PluginConfig

    path = models["llama"]
    prompts = random_prompts([41, 17, 33, 60], 512, seed=11)

    def engine() -> EngineCore:
        config = paged_config(path, device="cuda", block_size=16, num_blocks=400,
                              scheduler={"async_scheduling": async_scheduling})
        return EngineCore(config.model_copy(update={"plugins": [
            PluginConfig(name="kv-storage", settings={"path": str(tmp_path), "chunk_blocks": 1})]}))

    first = engine()
    run_engine(first, [greedy_request(str(i), p, 1) for i, p in enumerate(prompts)])
    first.runner.kv_connector.flush()
    assert len(list(tmp_path.glob("*.safetensors"))) == sum((len(p) - 1) // 16 for p in prompts)
    reqs = [greedy_request(str(i), p, 16) for i, p in enumerate(prompts)]
    got = run_engine(engine(), reqs)
    assert [r.num_cached_tokens for r in reqs] == [(len(p) - 1) // 16 * 16 for p in prompts]
    expected = hf_greedy(load_hf_model(path, device="cuda"), prompts, 16)
    assert [got[str(i)] for i in range(len(prompts))] == expected


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_drafters_on_cuda_keep_greedy_output(models: dict[str, Path], tmp_path: Path,
                                             async_scheduling: bool) -> None:
    """The draft model and the EAGLE head on CUDA (their KV sized with the target's from
    free memory, CUDA graphs on): greedy output equals the target's alone; the target
    drafting for itself has every draft accepted (its KV right at every position)."""
    import json

    from schedkit.runners.paged.builder import build_random_eagle_head

    path = models["llama"]
    prompts = random_prompts([41, 17, 33, 60, 9, 25], 512, seed=13)
    reqs = lambda: [greedy_request(str(i), p, 24) for i, p in enumerate(prompts)]  # noqa: E731

    def run(**runner: object) -> tuple[dict[str, list[int]], list]:
        spec = {"num_speculative_tokens": 3} if runner else {}
        engine = EngineCore(paged_config(path, device="cuda", num_blocks=400, **runner,
                                         scheduler={"async_scheduling": async_scheduling, **spec}))
        served = reqs()
        return run_engine(engine, served), served

    expected, _ = run()
    got, served = run(speculative_method="draft_model")
    assert got == expected
    assert sum(r.num_accepted_tokens for r in served) == sum(r.num_draft_tokens for r in served) > 0
    head = build_random_eagle_head(tmp_path / "head", json.loads((path / "config.json").read_text()), seed=5)
    got, served = run(speculative_method="eagle", draft_model={"name": str(head)})
    assert got == expected and sum(r.num_draft_tokens for r in served) > 0
