"""Config loading: unknown keys, wrong types and out-of-range values name key, value, file, line."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from schedkit.config import (
    Config,
    FakeRunnerConfig,
    PagedRunnerConfig,
    PluginRunnerConfig,
    SimulatedRunnerConfig,
    config_from_dict,
    load_config,
    load_yaml,
)
from schedkit.errors import ConfigError


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_quickstart_config_is_valid():
    cfg = load_config("configs/quickstart.yaml")
    assert cfg.scheduler.policy == "fcfs" and cfg.runner.kind == "fake"


def test_unknown_key_names_key_file_and_line(tmp_path):
    p = write(tmp_path, "scheduler:\n  policy: fcfs\n  max_num_seq: 4\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value) == f"{p}:3: unknown key 'scheduler.max_num_seq' (did you mean 'max_num_seqs'?)"
    p = write(tmp_path, "workload: {num_request: 4}\nzebra: 1\n")
    msg = str(pytest.raises(ConfigError, load_config, p).value)
    assert "unknown key 'workload.num_request' (did you mean 'num_requests'?)" in msg
    assert msg.endswith("unknown key 'zebra'")  # nothing close: no guess


def test_wrong_type_and_range(tmp_path):
    p = write(tmp_path, "cache:\n  block_size: big\nscheduler:\n  max_num_seqs: 0\n")
    msg = str(pytest.raises(ConfigError, load_config, p).value)
    assert f"{p}:2: cache.block_size = 'big'" in msg
    assert f"{p}:4: scheduler.max_num_seqs = 0" in msg


def test_cross_field_rule(tmp_path):
    p = write(tmp_path, "scheduler: {max_num_batched_tokens: 8, max_num_seqs: 16}\n")
    assert "max_num_seqs" in str(pytest.raises(ConfigError, load_config, p).value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "a: [1, 2\n"))
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_defaults_are_frozen():
    cfg = Config()
    with pytest.raises(ValidationError):
        cfg.scheduler.max_num_seqs = 3  # type: ignore[misc]


def test_every_shipped_config_is_valid():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs"
    files = sorted(root.rglob("*.yaml"))
    assert len(files) >= 4
    grids = [f for f in files if f.parent.name == "accuracy" and f.name.startswith("grid-")]
    assert grids  # the simulator's accuracy grids: their own format, naming engine configs
    for f in files:
        if f not in grids:
            load_config(f)
    from schedkit.lab.accuracy import load_grid

    for f in grids:
        load_grid(f)


@pytest.mark.parametrize("line, key, shown", [
    ("scheduler:\n  max_num_seqs: '8'\n", "scheduler.max_num_seqs", "'8'"),
    ("scheduler:\n  max_num_seqs: 8.0\n", "scheduler.max_num_seqs", "8.0"),
    ("scheduler:\n  async_scheduling: 'off'\n", "scheduler.async_scheduling", "'off'"),
    ("cache:\n  enable_prefix_caching: 1\n", "cache.enable_prefix_caching", "1"),
    ("workload:\n  prompt_len: ['8', 64]\n", "workload.prompt_len.min", "'8'"),
    ("runner:\n  step_time_ms: '10'\n", "runner.step_time_ms", "'10'"),
])
def test_strict_types_are_not_coerced(tmp_path, line, key, shown):
    p = write(tmp_path, line)
    msg = str(pytest.raises(ConfigError, load_config, p).value)
    assert f"{p}:2: {key} = {shown}" in msg


def test_int_is_a_valid_float_and_yaml_booleans_stay_booleans(tmp_path):
    cfg = load_config(write(tmp_path, "runner: {step_time_ms: 5}\nworkload: {rate: 2}\n"
                                      "scheduler: {async_scheduling: off}\n"))
    assert cfg.runner.step_time_ms == 5.0 and cfg.workload.rate == 2.0
    assert cfg.scheduler.async_scheduling is False


def test_strict_compare_profile_override(tmp_path):
    p = write(tmp_path, "compare:\n  profiles:\n    - name: a\n    - name: b\n"
                        "      scheduler:\n        max_num_seqs: '8'\n")
    msg = str(pytest.raises(ConfigError, load_config, p).value)
    assert f"{p}:6: compare.profiles.1.scheduler.max_num_seqs = '8'" in msg
    assert "compare profile 'b'" in msg


@pytest.mark.parametrize("text, where, key, value", [
    ("scheduler:\n  max_num_seqs: 4\n  policy: fcfs\n  max_num_seqs: 8\n", 4,
     "scheduler.max_num_seqs", "8"),
    ("scheduler: {policy: fcfs}\ncache: {}\nscheduler: {policy: priority}\n", 3,
     "scheduler", "{'policy': 'priority'}"),
    ("plugins:\n  - name: vtc\n    settings: {w: 1, w: 2}\n", 3, "plugins.0.settings.w", "2"),
    ("compare:\n  profiles:\n    - name: a\n      policy: fcfs\n      policy: priority\n", 5,
     "compare.profiles.0.policy", "'priority'"),
])
def test_duplicate_key_is_an_error(tmp_path, text, where, key, value):
    p = write(tmp_path, text)
    msg = str(pytest.raises(ConfigError, load_config, p).value)
    assert msg.startswith(f"{p}:{where}: {key} = {value}: duplicate key"), msg


def test_merge_keys_may_still_be_overridden():
    text = ("x-base: &b {max_num_seqs: 4, max_num_batched_tokens: 64}\n"
            "scheduler:\n  <<: *b\n  max_num_seqs: 8\n")
    data, _ = load_yaml(text, "m.yaml")
    assert data["scheduler"] == {"max_num_seqs": 8, "max_num_batched_tokens": 64}


# ------------------------------------------------------------------ the runner section
@pytest.mark.parametrize("text, line, key, value, owner", [
    ("runner:\n  kind: fake\n  device: cuda\n", 3, "runner.device", "'cuda'", "paged"),
    ("runner:\n  step_time_ms: 5\n  gpu_memory_utilization: 0.5\n", 3,
     "runner.gpu_memory_utilization", "0.5", "paged"),
    ("runner:\n  kind: simulated\n  num_threads: 2\n", 3, "runner.num_threads", "2", "paged"),
    ("runner:\n  kind: paged\n  profile: h200\n", 3, "runner.profile", "'h200'", "simulated"),
    ("runner:\n  kind: simulated\n  step_time_ms: 5\n", 3, "runner.step_time_ms", "5", "fake"),
])
def test_runner_refuses_a_key_its_kind_lacks(tmp_path, text, line, key, value, owner):
    p = write(tmp_path, text)
    msg = str(pytest.raises(ConfigError, load_config, p).value)
    kind = "simulated" if "simulated" in text else "paged" if "paged" in text else "fake"
    assert msg == (f"{p}:{line}: {key} = {value}: unknown key for runner kind {kind!r} "
                   f"(a key of the {owner} runner)")


@pytest.mark.parametrize("text, config_class, fields", [
    ("runner: {kind: fake, vocab_size: 100, eos_token_id: 2, step_time_ms: 5}\n",
     FakeRunnerConfig, {"vocab_size": 100, "eos_token_id": 2, "step_time_ms": 5.0}),
    ("runner: {kind: simulated, vocab_size: 100, eos_token_id: 2, profile: p.json}\n",
     SimulatedRunnerConfig, {"vocab_size": 100, "eos_token_id": 2, "profile": "p.json"}),
    ("runner: {kind: paged, vocab_size: 100, eos_token_id: 2, device: cuda, seed: 3,\n"
     "         gpu_memory_utilization: 0.5, enforce_eager: true, cuda_graph_max_batch_size: 8,\n"
     "         attention_backend: triton, num_threads: 4}\n",
     PagedRunnerConfig, {"vocab_size": 100, "eos_token_id": 2, "device": "cuda", "seed": 3,
                         "gpu_memory_utilization": 0.5, "enforce_eager": True,
                         "cuda_graph_max_batch_size": 8, "attention_backend": "triton",
                         "num_threads": 4}),
    ("runner: {kind: echo, vocab_size: 100, eos_token_id: 2, settings: {shift: 1}}\n",
     PluginRunnerConfig, {"kind": "echo", "vocab_size": 100, "eos_token_id": 2, "settings": {"shift": 1}}),
])
def test_each_runner_kind_accepts_its_keys(tmp_path, text, config_class, fields):
    runner = load_config(write(tmp_path, text)).runner
    assert type(runner) is config_class
    assert {k: getattr(runner, k) for k in fields} == fields


def test_runner_kind_defaults_to_fake(tmp_path):
    assert Config().runner == FakeRunnerConfig()
    assert load_config(write(tmp_path, "cache: {block_size: 16}\n")).runner == FakeRunnerConfig()
    runner = load_config(write(tmp_path, "runner: {step_time_ms: 5}\n")).runner
    assert runner == FakeRunnerConfig(step_time_ms=5)


@pytest.mark.parametrize("text, shown, message", [
    ("runner:\n  kind: paged\n  device: tpu\n", "runner.device = 'tpu'", "'cpu' or 'cuda'"),
    ("runner:\n  kind: 3\n", "runner.kind = 3", "Input should be a valid string"),
    ("runner:\n  kind: ''\n", "runner.kind = ''", "at least 1 character"),
    ("runner:\n  kind: echo\n  shift: 1\n", "runner.shift = 1",
     "unknown key for an installed runner's section; its own settings go under runner.settings"),
    ("runner:\n  kind: echo\n  device: cuda\n", "runner.device = 'cuda'",
     "unknown key for an installed runner's section (a key of the paged runner)"),
    ("runner:\n  kind: fak\n  step_time_ms: 5\n", "runner.step_time_ms = 5",
     "if runner.kind was meant to be the fake runner, it is misspelt"),
    ("runner:\n  kind: fake\n  settings: {shift: 1}\n", "runner.settings = {'shift': 1}",
     "unknown key for runner kind 'fake'"),
    ("runner:\n  kind: echo\n  settings: [1]\n", "runner.settings = [1]", "valid dictionary"),
])
def test_runner_errors_name_the_yaml_key(tmp_path, text, shown, message):
    p = write(tmp_path, text)
    msg = str(pytest.raises(ConfigError, load_config, p).value)
    line = text.count("\n")
    assert msg.startswith(f"{p}:{line}: {shown}: ") and message in msg, msg


@pytest.mark.parametrize("runner", [
    PagedRunnerConfig(device="cuda", num_threads=2),
    PluginRunnerConfig(kind="echo", settings={"shift": 1, "nested": {"a": [1, 2]}}),
])
def test_runner_config_round_trips_through_json(runner):
    """The engine process rebuilds its config from the client's JSON dump."""
    config = Config(runner=runner)
    again = Config.model_validate(config.model_dump(mode="json"))
    assert again.runner == config.runner and type(again.runner) is type(runner)


def test_a_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_bytes(b"scheduler:\n  policy: \xff\xfe\n")
    with pytest.raises(ConfigError, match=rf"{p}:2: not UTF-8 text \(byte 0xff"):
        load_config(p)


def test_num_blocks_has_a_ceiling_short_of_the_hosts_memory(tmp_path):
    p = write(tmp_path, "cache: {num_blocks: 100000000000}\n")
    with pytest.raises(ConfigError, match=r"cache.num_blocks = 100000000000: .*less than or equal to 16777216"):
        load_config(p)


@pytest.mark.parametrize(("text", "where"), [
    ("compare:\n  profiles:\n    - {name: a, policy: fcfs}\n    - {name: a, policy: sjf}\n",
     ":4: compare.profiles.1.name = 'a': the name 'a' is taken by an earlier profile"),
    ("plugins:\n  - name: lpm\n  - name: lpm\n", ":3: plugins.1.name = 'lpm': plugin 'lpm' is listed twice"),
    ("replicas: {count: 2}\nrouter:\n  plugins:\n    - name: x\n    - name: x\n",
     ":5: router.plugins.1.name = 'x': router plugin 'x' is listed twice"),
])
def test_names_that_must_be_unique_point_at_the_second_one(tmp_path, text, where):
    p = write(tmp_path, text)
    msg = str(pytest.raises(ConfigError, load_config, p).value)
    assert f"{p}{where}" in msg and "Value error" not in msg


def test_async_scheduling_with_drafts_needs_a_drafter_inside_the_step():
    def cfg(runner: dict, profile: dict | None = None) -> Config:
        compare = {"profiles": [{"name": "a"}, {"name": "b", "scheduler": profile}]} if profile else None
        scheduler = {"num_speculative_tokens": 2, "async_scheduling": profile is None}
        return config_from_dict({"runner": runner, "scheduler": scheduler, "compare": compare})

    for runner in ({"kind": "fake"}, {"kind": "simulated"}, {"kind": "paged", "speculative_method": "draft_model"}):
        assert cfg(runner).scheduler.async_scheduling  # they propose inside the step
    for method in ("ngram", "suffix"):
        msg = str(pytest.raises(ConfigError, cfg, {"kind": "paged", "speculative_method": method}).value)
        assert "scheduler.async_scheduling" in msg and repr(method) in msg and "draft_model or eagle" in msg
    msg = str(pytest.raises(ConfigError, cfg, {"kind": "paged"}, {"async_scheduling": True}).value)
    assert "compare.profiles.1.scheduler.async_scheduling" in msg
