"""The kv-storage connector's scheduler side (no torch): what it reports, loads, saves."""

from __future__ import annotations

import pytest

from schedkit.errors import PluginError
from schedkit.kv.connectors.storage import StorageMetadata, chunk_keys
from schedkit.plugins.testing import make_request, make_scheduler, runner_output
from schedkit.runners.paged.kv_storage import KVStorage


def test_saves_once_when_the_prefix_is_computed_then_reports_and_loads_it(tmp_path):
    sched = make_scheduler(block_size=4, max_num_batched_tokens=6, max_num_seqs=4,
                           plugins=[KVStorage(str(tmp_path), chunk_blocks=2)])
    prompt = list(range(1, 12))  # 11 tokens: one chunk of 8 (the last token is never stored)
    assert len(chunk_keys(prompt, 8)) == 1
    sched.add_request(make_request("a", prompt, max_tokens=2))
    out = sched.schedule()  # 6 tokens: the prefix is not complete yet
    assert out.kv_connector_metadata == StorageMetadata()
    sched.update_from_output(out, runner_output(out, {}))
    out = sched.schedule()  # tokens 6..10: the 8-token prefix completes in this step
    (save,) = out.kv_connector_metadata.saves
    assert save.key == chunk_keys(prompt, 8)[0]
    assert save.block_ids == list(sched.kv_cache_manager.get_block_ids("a"))[:2]
    assert not out.kv_connector_metadata.loads
    (tmp_path / f"{save.key}.safetensors").write_bytes(b"")  # the worker's file
    sched.update_from_output(out, runner_output(out, {"a": [0]}))
    out = sched.schedule()
    assert out.kv_connector_metadata == StorageMetadata()  # saved only once
    sched.update_from_output(out, runner_output(out, {"a": [0]}))
    b_prompt = prompt[:8] + [99, 98]  # another prompt with the same 8-token prefix
    sched.add_request(make_request("b", b_prompt, max_tokens=2))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"b": 2}
    (load,) = out.kv_connector_metadata.loads
    assert (load.key, load.first_block) == (save.key, 0)
    assert load.block_ids == list(sched.kv_cache_manager.get_block_ids("b"))[:2]


def test_chunk_keys_chain_over_the_prefix():
    a, b = list(range(40)), list(range(16)) + [7] * 24
    ka, kb = chunk_keys(a, 8), chunk_keys(b, 8)
    assert len(ka) == 4 and len(chunk_keys(a[:33], 8)) == 4 and len(chunk_keys(a[:32], 8)) == 3
    assert ka[:2] == kb[:2] and ka[2] != kb[2]
    assert chunk_keys([9] * 8 + a[8:], 8)[1] != ka[1]  # a chunk's key depends on all before it


def test_a_prompt_whose_prefix_is_not_stored_is_computed(tmp_path):
    sched = make_scheduler(block_size=4, plugins=[KVStorage(str(tmp_path))])
    sched.add_request(make_request("a", list(range(20)), max_tokens=2))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 20} and not out.kv_connector_metadata.loads


@pytest.mark.parametrize("settings", [{"path": ""}, {"path": 3}, {"chunk_blocks": 0}, {"chunk_blocks": 1.5}])
def test_bad_settings(settings):
    from schedkit.config import config_from_dict
    from schedkit.plugins.manager import get_plugin_manager

    with pytest.raises(PluginError, match="kv-storage"):
        get_plugin_manager(config_from_dict({"plugins": [{"name": "kv-storage", "settings": settings}]}))


def test_default_folder_is_in_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SCHEDKIT_CACHE_DIR", str(tmp_path))
    assert KVStorage().path == str(tmp_path / "kv-storage")
