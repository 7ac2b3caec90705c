"""The simulator's cost model: the features read from a step, what each term charges,
old profiles, and profiles fitted on another machine."""

from __future__ import annotations

import copy
import json
import logging
import warnings

import pytest

from benchmarks.scenarios import kv_pressure
from schedkit.config import config_from_dict
from schedkit.core.request import Request, SamplingParams
from schedkit.errors import ConfigError, ForeignProfileWarning
from schedkit.kv.connectors.offload import OffloadMetadata
from schedkit.lab.profiles import minimal_payload, write_profile
from schedkit.lab.simulate import run_workload
from schedkit.plugins.testing import make_scheduler
from schedkit.runners.cost_model import (
    PROFILE_DIR,
    CostModel,
    StepFeatures,
    StepShapes,
    attention_idle,
)
from schedkit.runners.machine import cpu_times, describe_machine, steal_share, this_machine
from schedkit.runners.simulated import SimulatedRunner

BASE = dict(base_s=1e-3, per_token_s=1e-5, per_request_s=1e-4, per_context_token_s=1e-7,
            per_prefill_attention_s=1e-9)
EXTRA = dict(per_mixed_step_s=3e-3, per_sampled_row_s=1e-4, per_random_row_s=2e-4, per_filtered_row_s=4e-4,
             per_grammar_row_s=5e-4, per_block_store_s=1e-3, per_block_load_s=2e-3)


def _request(rid: str, n: int, **sampling) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=8, **sampling), arrival_time=0.0)


def _first_steps(*reqs: Request, budget: int = 100):
    """The first two scheduler outputs of ``reqs`` (each updated with a fake runner)."""
    sched = make_scheduler(max_num_batched_tokens=budget)
    runner = SimulatedRunner(cost_model=CostModel(**BASE))
    for r in reqs:
        sched.add_request(r)
    outs = []
    for _ in range(2):
        so = sched.schedule()
        outs.append(so)
        sched.update_from_output(so, runner.execute(so))
    return outs


def test_step_shapes_count_sampled_random_filtered_and_grammar_rows():
    # a: 30 tokens, greedy; b: 100 tokens with top-k. Step 1 finishes a's prompt (a
    # samples) and computes 70 of b's; step 2 decodes a and finishes b (both sample).
    s1, s2 = _first_steps(_request("a", 30, temperature=0.0), _request("b", 100, top_k=20))
    shapes = StepShapes()
    f1 = shapes.features(s1)
    assert (f1.sampled_rows, f1.random_rows, f1.filtered_rows) == (1, 0, 0)  # a alone: greedy
    assert f1.kind == "prefill"
    f2 = shapes.features(s2)
    assert f2.kind == "mixed" and f2.sampled_rows == 2
    assert f2.random_rows == 2 and f2.filtered_rows == 2  # b samples: the whole batch goes that way
    again = StepShapes()
    again.features(s1)
    s2.structured_output_request_ids = {"a": 0}
    assert again.features(s2).grammar_rows == 1


def test_every_new_term_is_charged_by_the_simulator():
    old = CostModel(**BASE)
    new = CostModel(**BASE, **EXTRA)
    s1, s2 = _first_steps(_request("a", 30), _request("b", 100, top_p=0.5))
    plain = StepShapes().features(s1)
    assert old.step_time(plain) < new.step_time(plain)  # sampled and random rows
    shapes = StepShapes()
    shapes.features(s1)
    mixed = shapes.features(s2)
    assert new.step_time(mixed) - old.step_time(mixed) == pytest.approx(
        3e-3 + 2 * (1e-4 + 2e-4 + 4e-4))

    def run(so, model):
        runner = SimulatedRunner(cost_model=model)
        return runner.execute(so).step_duration

    swapped = copy.copy(s1)
    swapped.kv_connector_metadata = OffloadMetadata(saves=[(5, b"x"), (6, b"y")], loads=[(b"z", 7)])
    assert run(swapped, new) == pytest.approx(run(s1, new) + 2 * 1e-3 + 2e-3)
    assert run(swapped, old) == pytest.approx(run(s1, old))  # old profiles charge no swap
    structured = copy.copy(s1)
    structured.structured_output_request_ids = {"a": 0}
    assert run(structured, new) == pytest.approx(run(s1, new) + 5e-4)


def test_swap_steps_take_longer_on_the_simulator(tmp_path):
    # Preemption by swap under KV pressure: with per-block costs in the profile, the
    # steps that save and load blocks take longer, so the whole replay does.
    def replay(coefficients):
        path = tmp_path / f"p{len(coefficients)}.json"
        path.write_text(json.dumps({"name": "p", "coefficients": coefficients}))
        cfg = kv_pressure(0, [{"name": "cpu-offload"}])
        data = cfg.model_dump(mode="json", exclude={"compare"})
        data["runner"]["profile"] = str(path)
        runner = SimulatedRunner.from_config(config_from_dict(data))
        charged = []
        execute = runner.execute

        def spy(so):
            out = execute(so)
            charged.append(runner.last_features)
            return out

        runner.execute = spy
        result = run_workload(config_from_dict(data), runner=runner)
        return max(m.finish_time or 0.0 for m in result.metrics), charged

    coefficients = dict(BASE)
    plain, steps = replay(coefficients)
    assert sum(f.blocks_stored for f in steps) > 0 and sum(f.blocks_loaded for f in steps) > 0
    swapping, _ = replay({**coefficients, "per_block_store_s": 1e-3, "per_block_load_s": 1e-3})
    assert swapping > plain


def test_old_profiles_load_with_the_new_coefficients_at_zero():
    old = json.loads((PROFILE_DIR / "cpu-tiny-llama.json").read_text())
    assert "per_block_store_s" not in old["coefficients"]
    model = CostModel.load("cpu-tiny-llama")
    assert model.per_block_store_s == model.per_grammar_row_s == model.per_mixed_step_s == 0.0
    assert model.per_token_s == old["coefficients"]["per_token_s"]
    assert model.fitted_async_scheduling is None


def test_a_profile_fitted_on_another_machine_warns_but_loads(tmp_path):
    elsewhere = {"cpu": "Imaginary CPU 9000", "cpu_count": 4096, "gpu": "NVIDIA H999"}
    path = tmp_path / "far.json"
    path.write_text(json.dumps({"name": "far", "hardware": elsewhere, "coefficients": BASE}))
    with pytest.warns(ForeignProfileWarning) as caught:
        model = CostModel.load(str(path))
    assert model.base_s == BASE["base_s"]
    message = str(caught[0].message)
    assert "Imaginary CPU 9000, 4096 CPUs, NVIDIA H999" in message
    assert describe_machine(this_machine()) in message
    # fitted here: no warning
    path.write_text(json.dumps({"name": "near", "hardware": this_machine(), "coefficients": BASE}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CostModel.load(str(path))


def test_a_profile_fitted_in_the_other_scheduling_mode_is_reported(tmp_path, caplog):
    path = tmp_path / "async.json"
    path.write_text(json.dumps({"name": "a", "fitted_on": {"async_scheduling": True}, "coefficients": BASE}))

    def build(is_async):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="schedkit.runners.simulated"):
            SimulatedRunner.from_config(config_from_dict({
                "runner": {"kind": "simulated", "profile": str(path)},
                "scheduler": {"async_scheduling": is_async}}))
        return caplog.text

    assert "async_scheduling = True" in build(False)
    assert build(True) == ""


def test_a_scaled_model_predicts_every_step_that_many_times_longer():
    model = CostModel.load("cpu-smollm2-135m")
    slow = model.scaled(1.25)
    steps = _first_steps(_request("a", 30), _request("b", 100, top_k=20), _request("c", 300))
    shapes = StepShapes()
    for so in steps:
        features = shapes.features(so)
        assert slow.step_time(features) == pytest.approx(1.25 * model.step_time(features))
    assert slow.decode_residual(5) == pytest.approx(1.25 * model.decode_residual(5))
    assert slow.coefficients == {k: 1.25 * v for k, v in model.coefficients.items()}
    assert model.per_block_transfer_s  # the profile measured its hand-offs: they slow down too
    assert slow.kv_transfer_time(10) == pytest.approx(1.25 * model.kv_transfer_time(10))


def test_a_model_scaled_by_step_kind_scales_prompt_chunk_steps_by_their_own_factor():
    model = CostModel.load("cpu-smollm2-135m")
    decode = StepFeatures(tokens=6, requests=6, context_tokens=3000, prefill_attention=0, is_prefill_step=0,
                          sampled_rows=6)
    prefill = StepFeatures(tokens=300, requests=1, context_tokens=300, prefill_attention=300 * 150,
                           is_prefill_step=1, sampled_rows=1)
    mixed = prefill._replace(tokens=305, requests=6, is_mixed_step=1, sampled_rows=6)
    slow = model.scaled(1.1, prefill_factor=0.9)
    assert slow.step_time(decode) == pytest.approx(1.1 * model.step_time(decode))
    for f in (prefill, mixed):
        assert slow.step_time(f) == pytest.approx(0.9 * model.step_time(f)), f.kind
    # The KV swap of a prompt-chunk step is a copy, not compute: it keeps the one factor.
    swapping = prefill._replace(blocks_stored=4, blocks_loaded=2)
    swap = model.transfer_time(swapping)
    assert swap > 0
    assert slow.step_time(swapping) == pytest.approx(0.9 * (model.step_time(swapping) - swap) + 1.1 * swap)
    # Scaled again, the factors compound per kind; one factor alone scales both alike.
    again = slow.scaled(2.0, prefill_factor=3.0)
    assert again.step_time(decode) == pytest.approx(2.2 * model.step_time(decode))
    assert again.step_time(prefill) == pytest.approx(2.7 * model.step_time(prefill))
    assert slow.scaled(2.0).step_time(prefill) == pytest.approx(1.8 * model.step_time(prefill))


def test_steal_share_is_the_steal_column_over_all_cpu_time():
    before = (100, 0, 50, 800, 10, 0, 0, 40, 0, 0)
    after = (200, 0, 100, 1550, 10, 0, 0, 140, 0, 0)  # 1000 ticks, 100 of them stolen
    assert steal_share(before, after) == pytest.approx(0.1)
    assert steal_share(before, before) is None  # no time passed
    assert steal_share(None, after) is None
    now = cpu_times()
    if now is not None:  # Linux: the real counters parse
        assert len(now) >= 8 and all(x >= 0 for x in now)


def _shared_prefix_steps(enable_prefix_caching: bool) -> list:
    """Scheduler outputs of one request computing a 256-token prefix, then three more
    with the same prefix and their own 16 tokens, all decoding together."""
    sched = make_scheduler(max_num_batched_tokens=512, enable_prefix_caching=enable_prefix_caching)
    runner = SimulatedRunner(cost_model=CostModel(**BASE))
    prefix = list(range(1000, 1256))
    outs = []

    def step() -> None:
        so = sched.schedule()
        outs.append(so)
        sched.update_from_output(so, runner.execute(so))

    sched.add_request(Request("a", prefix + list(range(16)), SamplingParams(max_tokens=8), arrival_time=0.0))
    step()
    for i, rid in enumerate("bcd"):
        tail = list(range(100 * (i + 1), 100 * (i + 1) + 16))
        sched.add_request(Request(rid, prefix + tail, SamplingParams(max_tokens=8), arrival_time=0.0))
    for _ in range(3):
        step()
    return outs


def test_reads_of_a_block_another_request_of_the_step_reads_are_told_apart():
    shapes = StepShapes()
    features = [shapes.features(so) for so in _shared_prefix_steps(True)]
    last = features[-1]  # a, b, c, d decoding: b, c and d read a's 16 prefix blocks again
    assert last.kind == "decode" and last.requests == 4
    assert last.shared_context_tokens == 3 * 256
    assert last.context_tokens + last.shared_context_tokens == 4 * (256 + 16) + 3 + 2 * 3
    assert features[0].shared_context_tokens == 0  # a alone
    # Without prefix caching every request has blocks of its own: nothing is read again.
    alone = StepShapes()
    assert all(alone.features(so).shared_context_tokens == 0 for so in _shared_prefix_steps(False))


def test_a_profile_without_the_shared_read_term_charges_them_as_any_read(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"name": "old", "coefficients": BASE}))
    old = CostModel.load(str(path))
    assert old.per_shared_context_token_s == old.per_context_token_s
    shapes = StepShapes()
    last = [shapes.features(so) for so in _shared_prefix_steps(True)][-1]
    merged = last._replace(context_tokens=last.context_tokens + last.shared_context_tokens, shared_context_tokens=0)
    assert old.step_time(last) == pytest.approx(old.step_time(merged))
    cheaper = CostModel(**BASE, per_shared_context_token_s=BASE["per_context_token_s"] / 4)
    assert cheaper.step_time(last) < old.step_time(last)


def test_shared_reads_equal_a_count_over_every_block_each_request_reads():
    """A stream of requests on three shared prefixes, joining and finishing while others
    run (prefix hits, growing contexts, preemption by a small cache): every step's shared
    reads equal a plain count over the blocks each scheduled request reads."""
    import random

    rng = random.Random(7)
    sched = make_scheduler(max_num_batched_tokens=256, max_num_seqs=12, num_blocks=40,
                           enable_prefix_caching=True)
    runner = SimulatedRunner(cost_model=CostModel(**BASE))
    shapes = StepShapes()
    prefixes = [list(range(1000 * k, 1000 * k + 16 * rng.randint(2, 8))) for k in range(1, 4)]
    pending = [Request(f"r{i}", rng.choice(prefixes) + [7000 + 50 * i + j for j in range(rng.randint(1, 40))],
                       SamplingParams(max_tokens=rng.randint(2, 120)), arrival_time=0.0) for i in range(60)]
    checked = preempted = 0
    while pending or sched.has_requests():
        for _ in range(rng.randint(0, 2)):
            if pending:
                sched.add_request(pending.pop(0))
        so = sched.schedule()
        features = shapes.features(so)
        before = {nr.req_id: nr.num_computed_tokens for nr in so.scheduled_new_reqs}
        before.update(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens,
                          strict=True))
        readers: dict[int, int] = {}
        for rid, n in so.num_scheduled_tokens.items():
            for b in shapes._blocks[rid][:(before[rid] + n) // 16]:
                readers[b] = readers.get(b, 0) + 1
        assert features.shared_context_tokens == 16 * sum(c - 1 for c in readers.values()), so.step
        checked += features.shared_context_tokens > 0
        preempted += len(so.preempted_req_ids)
        sched.update_from_output(so, runner.execute(so))
    assert checked > 10  # the stream did share blocks
    assert preempted > 0  # and resumed requests found their blocks again


def test_attention_idle_is_what_the_busiest_worker_leaves_the_others():
    assert attention_idle([1000], 2) == 1000  # one sequence: the other thread waits
    assert attention_idle([500, 500], 2) == 0
    assert attention_idle([500, 500, 500], 2) == 500  # two on one thread, one on the other
    assert attention_idle([10, 1, 1, 1], 2) == 2 * 10 - 13  # longest first: 10 | 1 + 1 + 1
    assert attention_idle([7, 5, 4, 3, 3], 2) == 2 * 12 - 22  # 7 + 3 | 5 + 4 + 3
    assert attention_idle([1000], 4) == 3000


def _decode_steps(n: int, prompt_len: int, workers: int):
    """Features of ``n`` requests of ``prompt_len`` tokens, prefill then decode steps."""
    sched = make_scheduler(max_num_batched_tokens=4096)
    runner = SimulatedRunner(cost_model=CostModel(**BASE))
    for i in range(n):
        sched.add_request(_request(f"r{i}", prompt_len))
    shapes = StepShapes(workers=workers)
    features = []
    for _ in range(3):
        so = sched.schedule()
        features.append(shapes.features(so))
        sched.update_from_output(so, runner.execute(so))
    return features


def test_decode_steps_read_their_imbalance_over_the_workers():
    prefill, first, second = _decode_steps(3, 200, workers=2)
    assert prefill.kind == "prefill" and prefill.idle_context_tokens == 0  # tiles fill every worker
    assert first.kind == second.kind == "decode"
    assert first.idle_context_tokens == 201 and second.idle_context_tokens == 202
    assert _decode_steps(2, 200, workers=2)[1].idle_context_tokens == 0
    assert _decode_steps(1, 200, workers=2)[1].idle_context_tokens == 201
    assert _decode_steps(1, 200, workers=0)[1].idle_context_tokens == 0  # not modelled
    uneven = CostModel(**BASE, per_idle_context_token_s=1e-6)
    one = _decode_steps(1, 200, workers=2)[1]
    assert uneven.step_time(one) == pytest.approx(CostModel(**BASE).step_time(one) + 201e-6)


def test_attention_workers_travel_with_the_profile(tmp_path):
    model = CostModel.from_coefficients({**BASE, "per_idle_context_token_s": 2e-6}, attention_workers=2)
    path = tmp_path / "p.json"
    write_profile(path, minimal_payload("p", model, "test"))
    loaded = CostModel.load(str(path))
    assert loaded.attention_workers == 2 and loaded.per_idle_context_token_s == 2e-6
    runner = SimulatedRunner(cost_model=loaded)
    runner.initialize(64, 16)
    assert runner.shapes.workers == 2  # the simulator reads the feature the profile charges
    assert CostModel.load("cpu-tiny-llama").attention_workers == 0  # older profiles: not modelled
    for bad in (-1, 1.5, "2", True):
        path.write_text(json.dumps({"name": "p", "coefficients": BASE, "attention_workers": bad}))
        with pytest.raises(ConfigError, match="attention_workers"):
            CostModel.load(str(path))


@pytest.mark.parametrize("change, needle", [
    ({"coefficients": {**BASE, "base_s": float("nan")}}, "coefficients.base_s must be a number of seconds"),
    ({"coefficients": {**BASE, "per_token_s": float("inf")}}, "coefficients.per_token_s"),
    ({"coefficients": {**BASE, "base_s": 1e308}}, "coefficients.base_s"),
    ({"coefficients": {**BASE, "base_s": -0.5}}, "coefficients.base_s"),
    ({"coefficients": {**BASE, "per_request_s": "0.01"}}, "coefficients.per_request_s"),
    ({"coefficients": {**BASE, "per_tokn_s": 0.5}}, "unknown key 'per_tokn_s' (did you mean 'per_token_s'?)"),
    ({"coefficients": {k: v for k, v in BASE.items() if k != "per_token_s"}}, "coefficients lacks per_token_s"),
    ({"coefficients": {**BASE, "base_s": 0.0, "per_token_s": 0.0, "per_request_s": 0.0}}, "no time"),
    ({"coefficients": [1, 2]}, "coefficients must be a JSON object"),
    ({"decode_batch_residual_s": {"1": float("nan")}}, "decode_batch_residual_s['1']"),
    ({"decode_batch_residual_s": [1, 2]}, "decode_batch_residual_s must map"),
    ({"decode_batch_residual_s": {"zero": 0.1}}, "key 'zero' is not a batch size"),
    ({"attention_workers": 10**9}, "attention_workers must be an integer in [0, 4096]"),
    ({"fitted_on": "oops"}, "fitted_on must be a JSON object"),
    ({"speed_probe": 3}, "speed_probe must be a JSON object"),
])
def test_a_bad_profile_is_refused_naming_the_key(tmp_path, change, needle):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"name": "bad", "coefficients": BASE, **change}))
    with pytest.raises(ConfigError) as exc:
        CostModel.load(str(path))
    assert str(exc.value).startswith(f"{path}: not a cost-model profile: ")
    assert needle in str(exc.value)


def test_a_truncated_or_non_object_profile_is_refused(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text(json.dumps({"coefficients": BASE})[:20])
    with pytest.raises(ConfigError, match="not readable JSON"):
        CostModel.load(str(path))
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="top level must be a JSON object, got list"):
        CostModel.load(str(path))
