"""An interrupted LLM.generate aborts its unfinished requests."""

from __future__ import annotations

import signal
import threading

import pytest

import schedkit.llm as llm_mod
from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams

from .conftest import LONG, assert_engine_idle


@pytest.fixture
def llm():
    """An engine whose steps take 1 ms of wall time: the long requests run for seconds
    (their length is capped by the KV cache at 8,176 tokens), so the interrupt lands while
    they run however late the signal is delivered on a busy machine."""
    from schedkit.llm import LLM

    with LLM(config_from_dict({**LONG, "runner": {"kind": "fake", "clock": "wall", "step_time_ms": 1}})) as engine:
        yield engine


def test_interrupted_generate_aborts_its_requests(llm, monkeypatch):
    first_output = threading.Event()
    real_apply = llm_mod._apply

    def apply_and_tell(o, results):
        first_output.set()
        return real_apply(o, results)

    def ctrl_c_after_the_first_output():
        if first_output.wait(30):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    monkeypatch.setattr(llm_mod, "_apply", apply_and_tell)
    # Ctrl-C must raise KeyboardInterrupt here however pytest was started: a shell starts
    # a background job (``cmd &``) with SIGINT ignored, and Python then leaves it ignored.
    params = [SamplingParams(max_tokens=1)] + [SamplingParams(max_tokens=90000)] * 16
    interrupter = threading.Thread(target=ctrl_c_after_the_first_output, daemon=True)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        interrupter.start()
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[3, 4, 5]] + [[i + 7] * 30 for i in range(16)], params, use_tqdm=False)
        interrupter.join(5)
    finally:
        signal.signal(signal.SIGINT, previous)
    monkeypatch.undo()
    assert_engine_idle(llm)
    assert llm.call_utility("stats")["num_free_blocks"] == 511
    outs = llm.generate([[1, 2]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert outs[0].finish_reason == "length" and len(outs[0].output_token_ids) == 3
