"""Fitting the simulator's cost model to recorded step times."""

from __future__ import annotations

import random

import pytest

from schedkit.config import config_from_dict
from schedkit.lab.calibrate import (
    RotateSwapped,
    grid_phases,
    record_steps,
    sampling_phases,
    swap_config,
)
from schedkit.lab.cost_fit import fit, fit_linear, relative_error, residuals
from schedkit.lab.profiles import minimal_payload, write_profile
from schedkit.lab.step_recorder import Session
from schedkit.runners.cost_model import FEATURES, CostModel, StepFeatures
from schedkit.runners.simulated import SimulatedRunner

TRUE = dict(base_s=2e-3, per_token_s=4e-6, per_request_s=3e-5, per_context_token_s=5e-9,
            per_prefill_attention_s=2e-11, per_prefill_step_s=1e-3, per_mixed_step_s=4e-4,
            per_sampled_row_s=2e-5, per_random_row_s=1e-5)


class LaunchingSimulator(SimulatedRunner):
    """The simulator behind the execute_async interface of the paged runner."""

    def execute_async(self, scheduler_output):
        out = self.execute(scheduler_output)
        return type("Handle", (), {"result": lambda self: out})()


@pytest.mark.parametrize("async_scheduling,runner_cls", [
    (False, SimulatedRunner), (True, SimulatedRunner), (True, LaunchingSimulator)])
def test_fit_recovers_a_known_cost_model_from_recorded_steps(async_scheduling, runner_cls):
    # The "real" runner here is the simulator with known coefficients; recording its
    # steps and fitting must give those coefficients back (with two steps in flight too:
    # each duration is paired with the step it belongs to).
    config = config_from_dict({
        "runner": {"kind": "simulated"}, "cache": {"num_blocks": 2000, "block_size": 16},
        "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 64, "max_model_len": 8192,
                      "async_scheduling": async_scheduling},
        "workload": {"num_requests": 300, "rate": 40, "prompt_len": {"dist": "lognormal", "median": 400,
                     "sigma": 1.0, "min": 8, "max": 4000}, "output_len": [4, 200]}})
    # the grammar bursts need a structured-output backend, which the simulator has not
    sampling = [p for p in sampling_phases(config, output_len=8) if "structured_outputs" not in p.sampling]
    records = record_steps(config, runner=runner_cls(cost_model=CostModel(**TRUE)),
                           phases=grid_phases(config, output_len=8) + sampling)
    assert len(records) > 100
    assert {int(f[1]) for f, _ in records if not f[4]} >= {1, 4, 16, 64}  # decode batches of the grid
    assert {f.kind for f, _ in records} == {"prefill", "decode", "mixed"}
    model = fit(records)
    for k in FEATURES:
        assert getattr(model, k) == pytest.approx(TRUE.get(k, 0.0), rel=1e-3, abs=1e-12), k
    assert all(abs(t) < 1e-9 for _, t in model.decode_batch_residual_s)
    assert relative_error(records, model) < 1e-6
    r = residuals(records, model)
    assert set(r) == {"overall", "prefill", "decode", "mixed"}
    assert sum(r[k]["num_steps"] for k in ("prefill", "decode", "mixed")) == r["overall"]["num_steps"]
    assert r["overall"]["p90"] < 1e-6


def test_the_new_coefficients_are_fitted_when_their_features_vary():
    # Synthetic steps in which sampling, grammar and swap terms vary independently of
    # the shape: the fit gives back every coefficient.
    true = CostModel(base_s=1e-3, per_token_s=2e-6, per_request_s=1e-5, per_context_token_s=3e-9,
                     per_prefill_attention_s=1e-11, per_prefill_step_s=5e-4, per_mixed_step_s=2e-4,
                     per_sampled_row_s=3e-5, per_random_row_s=2e-5, per_filtered_row_s=6e-5,
                     per_grammar_row_s=8e-5, per_block_store_s=4e-4, per_block_load_s=3e-4)
    rng = random.Random(0)
    records = []
    for _ in range(400):
        reqs = rng.randint(1, 32)
        prefill = rng.random() < 0.4
        mixed = prefill and rng.random() < 0.5
        tokens = reqs + (rng.randint(16, 1024) if prefill else 0)
        rows = rng.randint(0, reqs)
        is_random = rng.random() < 0.6
        attention = tokens * rng.randint(0, 500) if prefill else 0
        stored, loaded = (rng.choice((0, 0, 0, rng.randint(1, 40))) for _ in range(2))
        f = StepFeatures(tokens, reqs, tokens + rng.randint(0, 20000), attention, float(prefill), float(mixed),
                         rows, rows if is_random else 0, rows if is_random and rng.random() < 0.5 else 0,
                         rng.randint(0, rows), stored, loaded)
        records.append((f, true.step_time(f)))
    coef = fit_linear(records)
    for k in FEATURES:
        assert coef[k] == pytest.approx(getattr(true, k), rel=1e-4), k


def test_fit_drops_negative_coefficients():
    records = [((t, 1.0, t, 0.0, 0.0), 1e-3 + 1e-6 * t) for t in (1, 10, 100, 1000, 50, 500, 20)] * 3
    coef = fit_linear(records)
    assert all(v >= 0 for v in coef.values())
    assert relative_error(records, CostModel.from_coefficients(coef)) < 0.01


def test_decode_residual_table_captures_what_the_line_cannot(tmp_path):
    # decode steps: 1 ms + 0.1 ms per request, except batch 3, which costs 2 ms extra
    # (as a CPU matmul can); prefill steps are linear
    def decode(b: int) -> float:
        return 1e-3 + 1e-4 * b + (2e-3 if b == 3 else 0.0)

    records = [((b, b, 100.0 * b, 0.0, 0.0), decode(b)) for b in (1, 2, 3, 4, 8) for _ in range(5)]
    records += [((t, 1.0, t, t * t / 2, 1.0), 2e-3 + 1e-5 * t) for t in (64, 128, 512, 1024)]
    model = fit(records)
    assert dict(model.decode_batch_residual_s).keys() == {1, 2, 3, 4, 8}
    for b in (1, 2, 3, 4, 8):
        assert model.step_time((b, b, 100.0 * b, 0.0, 0.0)) == pytest.approx(decode(b), rel=0.05)
    # between listed sizes the residual is interpolated; beyond them it stays at the end value
    r = dict(model.decode_batch_residual_s)
    assert model.decode_residual(6) == pytest.approx((r[4] + r[8]) / 2)
    assert model.decode_residual(64) == r[8]
    write_profile(tmp_path / "p.json", minimal_payload("p", model, "test"))
    loaded = CostModel.load(str(tmp_path / "p.json"))
    assert loaded.decode_batch_residual_s == model.decode_batch_residual_s
    assert loaded.step_time(records[10][0]) == model.step_time(records[10][0])


def test_grid_phases_cover_batches_and_prompts_within_the_cache():
    config = config_from_dict({
        "runner": {"kind": "simulated"}, "cache": {"num_blocks": 1400, "block_size": 16},
        "scheduler": {"max_num_batched_tokens": 2048, "max_num_seqs": 48, "max_model_len": 2048}})
    phases = grid_phases(config, output_len=16)
    distinct = [ph for ph in phases if not ph.shared_prefix]
    shapes = {(len(ph.requests[0].prompt_token_ids), len(ph.requests)) for ph in distinct}
    # 22400 KV slots: 32 x (1024 + 32) does not fit in 80%, 16 x (1024 + 32) does
    batches = (1, 2, 3, 4, 6, 8, 12, 16, 32, 48)
    assert shapes == {(p, b) for p in (32, 256, 1024) for b in batches} - {(1024, 32), (1024, 48)}
    # Prefix caching is on (the default): bursts of prompts sharing a 256- or 1024-token
    # prefix, the first arriving alone so the others read its cached blocks; the prefix
    # is held once, so 48 of them fit.
    shared = [ph for ph in phases if ph.shared_prefix]
    assert {(ph.shared_prefix, len(ph.requests)) for ph in shared} == {
        (p, b) for p in (256, 1024) for b in (4, 16, 48)}
    for ph in shared:
        assert ph.is_timed and ph.requests[0].arrival_time < min(r.arrival_time for r in ph.requests[1:])
        assert len({tuple(r.prompt_token_ids[:ph.shared_prefix]) for r in ph.requests}) == 1
        assert len({tuple(r.prompt_token_ids[ph.shared_prefix:]) for r in ph.requests}) == len(ph.requests)
    phases = distinct + sampling_phases(config)
    prompts = [tuple(r.prompt_token_ids[:16]) for ph in phases for r in ph.requests]
    prompts += [tuple(ph.requests[0].prompt_token_ids[:16]) for ph in shared]
    assert len(set(prompts)) == len(prompts)  # no prefix-cache hits between bursts
    assert len({ph.name for ph in phases + shared}) == len(phases) + len(shared)
    no_cache = config.model_copy(update={"cache": config.cache.model_copy(update={"enable_prefix_caching": False})})
    assert not any(ph.shared_prefix for ph in grid_phases(no_cache, output_len=16))


def test_the_swap_phase_has_a_small_cache_and_the_offload_connector():
    config = config_from_dict({
        "runner": {"kind": "simulated"}, "cache": {"num_blocks": 1400, "block_size": 16},
        "scheduler": {"max_num_batched_tokens": 512, "max_num_seqs": 16, "max_model_len": 2048},
        "plugins": [{"name": "cpu-offload", "settings": {"max_blocks": 8}}]})
    swap, phase = swap_config(config)
    assert [p.name for p in swap.plugins] == ["cpu-offload"]
    assert swap.plugins[0].settings["max_blocks"] > 8
    assert swap.cache.enable_prefix_caching
    need = sum(len(r.prompt_token_ids) + r.max_tokens for r in phase.requests)
    assert need > 2 * swap.cache.num_blocks * swap.cache.block_size  # preemptions for blocks
    assert swap.scheduler.max_model_len < swap.cache.num_blocks * swap.cache.block_size


def test_the_swap_phase_saves_blocks_and_loads_them_back():
    config = config_from_dict({
        "runner": {"kind": "simulated"}, "cache": {"num_blocks": 1400, "block_size": 16},
        "scheduler": {"max_num_batched_tokens": 512, "max_num_seqs": 16, "max_model_len": 2048}})
    swap, phase = swap_config(config)
    session = Session(swap, SimulatedRunner.from_config(swap), extra_plugins=[RotateSwapped()])
    try:
        assert session.run(phase).status == "ran"
    finally:
        session.close()
    stored = [f.blocks_stored for f, _ in session.records if f.blocks_stored]
    loaded = [f.blocks_loaded for f, _ in session.records if f.blocks_loaded]
    assert len(stored) >= 8 and len(loaded) >= 8  # the rotation swaps, not only KV pressure
    assert max(loaded) >= 8  # whole requests' KV comes back, not a block or two


def test_backfitting_keeps_a_jump_by_batch_size_out_of_the_context_coefficient():
    # Decode steps cost 3 us per context token read, plus a jump by batch size that no
    # line follows; a larger batch also reads more context, so a line fitted once leans
    # on the context coefficient to follow the jump.
    jump = {1: 0.0, 2: 8e-3, 4: 6e-3, 8: 5e-3, 16: 2e-3}

    def decode(b: int, c: int) -> float:
        return 2e-3 + jump[b] + 1e-4 * b + 3e-6 * b * c

    records = [(StepFeatures(b, b, b * c, 0.0, 0.0), decode(b, c))
               for b in jump for c in (20, 100, 500, 1000) for _ in range(3)]
    records += [(StepFeatures(t, 1.0, t, t * t / 2, 1.0), 2e-3 + 1.3e-5 * t) for t in (64, 128, 512, 1024)
                for _ in range(2)]
    once = fit(records, rounds=1)
    assert abs(once.per_context_token_s / 3e-6 - 1) > 0.1
    model = fit(records)
    assert model.per_context_token_s == pytest.approx(3e-6, rel=0.02)
    assert relative_error(records, model) < relative_error(records, once)
