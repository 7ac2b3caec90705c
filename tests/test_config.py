"""Config loading: unknown keys, wrong types and out-of-range values name key, value, file, line."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from schedkit.config import Config, load_config
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
    assert f"{p}:3" in str(e.value) and "scheduler.max_num_seq" in str(e.value)


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
    for f in files:
        load_config(f)
