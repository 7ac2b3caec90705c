"""The kv-storage connector end to end on the paged runner (CPU, float32): prompts
computed by one engine are saved to a folder in chunks; a fresh engine on the same
folder loads the longest stored prefix of each prompt instead of computing it, and
still emits transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from schedkit import hookimpl  # noqa: E402
from schedkit.config import PluginConfig  # noqa: E402
from schedkit.engine.core import EngineCore  # noqa: E402
from schedkit.runners.paged.testing import (  # noqa: E402
    greedy_request,
    hf_greedy,
    paged_config,
    random_prompts,
    run_engine,
)

BS = 8
CHUNK = 2 * BS  # chunk_blocks 2


class ComputedTokens:
    """Counts the prompt tokens each step computes."""

    def __init__(self) -> None:
        self.total = 0
        self.external_hits = 0

    @hookimpl
    def schedkit_on_step_end(self, scheduler_output: Any, stats: Any) -> None:
        self.total += scheduler_output.total_num_scheduled_tokens
        if stats is not None and stats.connector_prefix_cache_stats is not None:
            self.external_hits += stats.connector_prefix_cache_stats.hits


def engine_with_storage(model: Path, store: Path, counter: ComputedTokens, **kw: Any) -> EngineCore:
    config = paged_config(model, block_size=BS, num_blocks=kw.pop("num_blocks", 200),
                          max_num_batched_tokens=kw.pop("max_num_batched_tokens", 64),
                          max_model_len=256, **kw)
    config = config.model_copy(update={"plugins": [PluginConfig(
        name="kv-storage", settings={"path": str(store), "chunk_blocks": 2})]})
    return EngineCore(config, extra_plugins=[counter])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stored_prefixes_are_loaded_and_give_the_same_tokens(
        async_scheduling: bool, model_dir: Any, hf_model: Any, tmp_path: Path) -> None:
    path = model_dir("llama", num_heads=4, num_kv_heads=2)
    prompts = random_prompts([41, 17, 33, 9, 60], 512, seed=11)
    prompts.append(prompts[0][:40] + [5, 6, 7])  # prompt 0's first two chunks
    prompts.append(prompts[2] + random_prompts([20], 512, seed=12)[0])  # a later turn of prompt 2
    expected = hf_greedy(hf_model(path), prompts, 12)
    sched = {"async_scheduling": async_scheduling}

    first = ComputedTokens()
    engine = engine_with_storage(path, tmp_path, first, scheduler=sched)
    out = run_engine(engine, [greedy_request(str(i), p, 12) for i, p in enumerate(prompts[:5])])
    engine.runner.kv_connector.flush()  # the files are written in the background
    assert [out[str(i)] for i in range(5)] == expected[:5]
    stored = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(stored) == sum((len(p) - 1) // CHUNK for p in prompts[:5])  # 2+1+2+0+3 chunks

    second = ComputedTokens()
    engine = engine_with_storage(path, tmp_path, second, scheduler=sched)
    reqs = [greedy_request(f"again{i}", p, 12) for i, p in enumerate(prompts)]
    out = run_engine(engine, reqs)
    engine.runner.kv_connector.flush()
    assert [out[f"again{i}"] for i in range(len(prompts))] == expected
    loaded = [(len(p) - 1) // CHUNK * CHUNK for p in prompts[:6]] + [32]  # prompt 2's chunks
    assert [r.num_cached_tokens for r in reqs] == loaded
    assert second.external_hits == sum(loaded)
    assert first.total - second.total == sum(loaded[:5]) - sum(
        len(p) - n + 11 for p, n in zip(prompts[5:], loaded[5:], strict=True))
    now = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(now) == len(stored) + 1  # the later turn's third chunk is new


def test_a_corrupted_store_changes_the_tokens(model_dir: Any, hf_model: Any, tmp_path: Path) -> None:
    """The control: the loaded KV is really used (zeroed files give other tokens)."""
    from safetensors.torch import load_file, save_file

    path = model_dir("llama", num_heads=4, num_kv_heads=2)
    prompts = random_prompts([41, 33, 60], 512, seed=12)
    engine = engine_with_storage(path, tmp_path, ComputedTokens())
    run_engine(engine, [greedy_request(str(i), p, 12) for i, p in enumerate(prompts)])
    engine.runner.kv_connector.flush()
    for f in tmp_path.glob("*.safetensors"):
        save_file({k: torch.zeros_like(v) for k, v in load_file(str(f)).items()}, str(f))
    out = run_engine(engine_with_storage(path, tmp_path, ComputedTokens()),
                     [greedy_request(str(i), p, 12) for i, p in enumerate(prompts)])
    expected = hf_greedy(hf_model(path), prompts, 12)
    assert [out[str(i)] for i in range(3)] != expected


def test_preempted_requests_reload_their_prefix(model_dir: Any, hf_model: Any, tmp_path: Path) -> None:
    path = model_dir("qwen2", num_heads=4, num_kv_heads=4, tie_word_embeddings=True)
    prompts = random_prompts([30, 45, 38, 50], 512, seed=13)
    expected = hf_greedy(hf_model(path), prompts, 20)
    engine = engine_with_storage(path, tmp_path, ComputedTokens(), num_blocks=200)
    run_engine(engine, [greedy_request(str(i), p, 1) for i, p in enumerate(prompts)])
    engine.runner.kv_connector.flush()
    engine = engine_with_storage(path, tmp_path, ComputedTokens(), num_blocks=26)
    out = run_engine(engine, [greedy_request(str(i), p, 20) for i, p in enumerate(prompts)])
    assert engine.stats()["num_preemptions"] > 0
    assert [out[str(i)] for i in range(len(prompts))] == expected


def test_a_failed_write_is_reported_and_never_loaded(model_dir: Any, tmp_path: Path,
                                                     monkeypatch: Any, caplog: Any) -> None:
    from schedkit.runners.paged.kv_storage import StorageWorker

    def full_disk(self: Any, key: str, tensors: Any, copied: Any) -> None:
        raise OSError("No space left on device")

    path = model_dir("llama", num_heads=4, num_kv_heads=2)
    prompts = random_prompts([41, 33], 512, seed=14)
    with monkeypatch.context() as m:
        m.setattr(StorageWorker, "_write", full_disk)
        engine = engine_with_storage(path, tmp_path, ComputedTokens())
        first = run_engine(engine, [greedy_request(str(i), p, 6) for i, p in enumerate(prompts)])
        with pytest.raises(OSError, match="No space"):
            engine.runner.kv_connector.flush()
    assert "saving a chunk failed" in caplog.text
    assert not list(tmp_path.glob("*.safetensors"))
    reqs = [greedy_request(str(i), p, 6) for i, p in enumerate(prompts)]
    assert run_engine(engine_with_storage(path, tmp_path, ComputedTokens()), reqs) == first
    assert [r.num_cached_tokens for r in reqs] == [0, 0]  # computed, not loaded


class AsyncLoading:
    """kv-storage with its loads reported asynchronously (vLLM's async-load protocol,
    docs/scheduler-behaviour.md#load-lifecycle): the scheduler parks each request in ``kv_holding`` until the runner's
    connector output lists it in ``finished_recving``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reported: list[set[str]] = []

    @hookimpl
    def schedkit_create_kv_connector(self, role: Any, config: Any) -> Any:
        from schedkit.kv.connector import KVConnectorRole
        from schedkit.kv.connectors.storage import StorageConnector
        from schedkit.runners.paged.kv_storage import StorageWorker

        plugin = self

        class Scheduler(StorageConnector):
            def get_num_new_matched_tokens(self, request: Any, num_local: int) -> Any:
                n, _ = super().get_num_new_matched_tokens(request, num_local)
                return n, bool(n)

        class Worker(StorageWorker):
            loaded: set[str] = set()

            def start_load_kv(self, forward_context: Any) -> None:
                super().start_load_kv(forward_context)
                self.loaded = self.loaded | {load.req_id for load in self._meta.loads}

            def get_finished(self, finished_req_ids: set[str]) -> Any:
                done, self.loaded = self.loaded, set()
                if done:
                    plugin.reported.append(done)
                return None, done

        cls = Worker if role is KVConnectorRole.WORKER else Scheduler
        return cls(role, config, self.path, 2)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_asynchronous_loads_through_the_runner(async_scheduling: bool, model_dir: Any,
                                               hf_model: Any, tmp_path: Path) -> None:
    path = model_dir("llama", num_heads=4, num_kv_heads=2)
    prompts = random_prompts([41, 33, 60, 9], 512, seed=15)
    sched = {"async_scheduling": async_scheduling}
    engine = engine_with_storage(path, tmp_path, ComputedTokens(), scheduler=sched)
    run_engine(engine, [greedy_request(str(i), p, 1) for i, p in enumerate(prompts)])
    engine.runner.kv_connector.flush()
    loading = AsyncLoading(tmp_path)
    config = paged_config(path, block_size=BS, num_blocks=200, max_num_batched_tokens=64,
                          max_model_len=256, scheduler=sched)
    engine = EngineCore(config, extra_plugins=[loading])
    reqs = [greedy_request(str(i), p, 10) for i, p in enumerate(prompts)]
    out = run_engine(engine, reqs)
    assert [out[str(i)] for i in range(len(prompts))] == hf_greedy(hf_model(path), prompts, 10)
    assert set().union(*loading.reported) == {"0", "1", "2"}  # the 9-token prompt has no chunk
    assert [r.num_cached_tokens for r in reqs] == [(len(p) - 1) // CHUNK * CHUNK for p in prompts]
