"""The fault-injection property test on the paged runner (tiny Llama, CPU float32):
random plugin faults on random traces with prefix caching and preemption; the requests
no fault touched get exactly the greedy tokens of a fault-free run, so no rolled-back
step left KV behind that a later request reads."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

from schedkit.runners.paged.testing import paged_config  # noqa: E402
from tests.core.test_fault_injection import check_against_control, make_trace  # noqa: E402


@pytest.mark.parametrize("seed,keyed,async_scheduling", [(1, False, False), (2, True, True), (3, True, False)])
def test_random_faults_keep_other_requests_tokens(model_dir: Any, seed: int, keyed: bool,
                                                  async_scheduling: bool) -> None:
    config = paged_config(model_dir("llama"), block_size=4, num_blocks=40, enable_prefix_caching=True,
                          max_num_batched_tokens=32, max_num_seqs=6, max_model_len=120,
                          long_prefill_token_threshold=16,
                          scheduler={"async_scheduling": async_scheduling})
    faults = check_against_control(config, make_trace(seed, vocab=500), seed, keyed, rate=0.05)
    assert sum(faults.raised.values()) > 0
