"""The decode CUDA-graph runner's static buffers and padding, without CUDA: the
"graph" replays the model eagerly on the static buffers, with the Triton kernel under
the interpreter, so bucketing, padding rows on block 0 and output slicing are checked
against transformers."""

from __future__ import annotations

import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
pytest.importorskip("transformers")

from schedkit.engine.core import EngineCore  # noqa: E402
from schedkit.runners.paged.cuda_graphs import DecodeGraphs, batch_size_buckets  # noqa: E402
from schedkit.runners.paged.testing import (  # noqa: E402
    greedy_request,
    hf_greedy,
    paged_config,
    random_prompts,
    run_engine,
)

pytestmark = pytest.mark.slow  # transformers references over padded replays


class _EagerGraph:
    def __init__(self, fn: Any, out: torch.Tensor) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


class _EagerDecodeGraphs(DecodeGraphs):
    def capture(self) -> None:
        for b in self.buckets:
            args = (self.input_ids[:b], self.positions[:b], self.kv_caches, self._meta(b))
            fn = (lambda a: lambda: self.model(*a))(args)
            out = fn()
            self.graphs[b] = (_EagerGraph(fn, out), out)
        self.replays: list[tuple[int, int]] = []
        self.num_filled = 0

    def run(self, inputs: Any, fill: Any = None) -> torch.Tensor:
        self.replays.append((len(inputs.req_ids), inputs.block_table.shape[1]))
        self.num_filled += fill is not None
        return super().run(inputs, fill)


def test_buckets() -> None:
    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(6) == [1, 2, 4, 6]
    assert batch_size_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_padded_decode_replays_match_transformers(async_scheduling: bool, model_dir: Any,
                                                  hf_model: Any) -> None:
    """With async scheduling each replay takes its input tokens from the device tensor
    of the step still in flight."""
    path = model_dir("llama", num_layers=1)
    engine = EngineCore(paged_config(path, block_size=8, max_num_seqs=6, max_num_batched_tokens=64,
                                     scheduler={"async_scheduling": async_scheduling}))
    runner = engine.runner
    graphs = _EagerDecodeGraphs(runner.model, runner.kv_caches, 6, runner.input_batch.max_blocks,
                                runner.args.num_kv_heads, 8)
    with torch.inference_mode():
        graphs.capture()
    runner.graphs = graphs
    prompts = random_prompts([5, 12, 3, 20, 9], 512, seed=6)
    reqs = [greedy_request(str(i), p, 3 + 2 * i) for i, p in enumerate(prompts)]
    got = run_engine(engine, reqs)
    expected = hf_greedy(hf_model(path), prompts, 11)
    for i in range(len(prompts)):
        assert got[str(i)] == expected[i][:3 + 2 * i]
    sizes = {b for b, _ in graphs.replays}
    assert {5, 3, 1} <= sizes  # replays padded into buckets 6 and 4 as requests finish
    assert graphs.num_filled == (len(graphs.replays) if async_scheduling else 0)
