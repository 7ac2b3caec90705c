"""An interrupted LLM.generate aborts its unfinished requests."""

from __future__ import annotations

import pytest

from schedkit.core.request import SamplingParams

from .conftest import assert_engine_idle


def test_interrupted_generate_aborts_its_requests(llm, monkeypatch):
    real_recv = llm.client.recv

    def recv_then_interrupt(timeout=1.0):
        batch = real_recv(timeout)
        if batch is not None and batch.outputs:
            raise KeyboardInterrupt  # Ctrl-C after the first output
        return batch

    monkeypatch.setattr(llm.client, "recv", recv_then_interrupt)
    params = [SamplingParams(max_tokens=1)] + [SamplingParams(max_tokens=90000)] * 16
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[3, 4, 5]] + [[i + 7] * 30 for i in range(16)], params, use_tqdm=False)
    monkeypatch.undo()
    assert_engine_idle(llm)
    assert llm.call_utility("stats")["num_free_blocks"] == 511
    outs = llm.generate([[1, 2]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert outs[0].finish_reason == "length" and len(outs[0].output_token_ids) == 3
