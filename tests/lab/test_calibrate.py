"""Fitting the simulator's cost model to recorded step times."""

from __future__ import annotations

import pytest

from schedkit.config import config_from_dict
from schedkit.lab.calibrate import fit, record_steps, relative_error
from schedkit.runners.simulated import CostModel, SimulatedRunner

TRUE = dict(base_s=2e-3, per_token_s=4e-6, per_request_s=3e-5, per_context_token_s=5e-9,
            per_prefill_attention_s=2e-11)


def test_fit_recovers_a_known_cost_model_from_recorded_steps():
    # The "real" runner here is the simulator with known coefficients; recording its
    # steps and fitting must give those coefficients back.
    config = config_from_dict({
        "runner": {"kind": "simulated"}, "cache": {"num_blocks": 2000, "block_size": 16},
        "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 64, "max_model_len": 8192},
        "workload": {"num_requests": 300, "rate": 40, "prompt_len": {"dist": "lognormal", "median": 400,
                     "sigma": 1.0, "min": 8, "max": 4000}, "output_len": [4, 200]}})
    records = record_steps(config, runner=SimulatedRunner(cost_model=CostModel(**TRUE)))
    assert len(records) > 100
    coef = fit(records)
    for k, v in TRUE.items():
        assert coef[k] == pytest.approx(v, rel=1e-3)
    assert relative_error(records, coef) < 1e-6


def test_fit_drops_negative_coefficients():
    records = [((t, 1.0, t, 0.0), 1e-3 + 1e-6 * t) for t in (1, 10, 100, 1000, 50, 500)]
    coef = fit(records)
    assert all(v >= 0 for v in coef.values())
    assert relative_error(records, coef) < 0.01
