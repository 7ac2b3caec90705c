"""A third-party queue whose key function raises, inside the engine process: only the
requests whose key raised fail, the engine stays alive and serves later calls (no
EngineDeadError)."""

from __future__ import annotations

import textwrap

import pytest

from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.llm import LLM

PLUGIN = textwrap.dedent('''
    from schedkit import hookimpl
    from schedkit.core.queues import KeyedQueue

    def key(request):
        if request.prompt_token_ids[0] == 666:
            raise RuntimeError("no key for 666")
        return request.arrival_time

    class BadKey:
        @hookimpl
        def schedkit_create_waiting_queue(self):
            return KeyedQueue(key)

    class NoQueue:
        @hookimpl
        def schedkit_create_waiting_queue(self):
            return 5
''')


@pytest.fixture
def badkey_installed(install_plugin):
    install_plugin("badkey_plugin", PLUGIN, {"badkey": "badkey_plugin:BadKey", "noqueue": "badkey_plugin:NoQueue"})
    return "badkey"


def test_raising_key_fails_only_its_request_in_the_engine_process(badkey_installed):
    config = config_from_dict({"plugins": [{"name": badkey_installed}]})
    with LLM(config) as llm:
        outs = llm.generate([[5, 6, 7], [666, 1, 2], [8, 9]], SamplingParams(max_tokens=3),
                            use_tqdm=False)
        assert [o.finish_reason for o in outs] == ["length", "error", "length"]
        assert "'badkey'" in outs[1].error and "KeyedQueue.add" in outs[1].error
        assert "no key for 666" in outs[1].error
        again = llm.generate([[4, 4]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert again[0].finish_reason == "length"
        stats = llm.call_utility("stats")
        assert stats["num_waiting"] == 0 and stats["num_running"] == 0


def test_a_build_hook_error_in_the_engine_process_keeps_its_type(badkey_installed):
    """It used to arrive as EngineDeadError("failed to start: PluginError: ...")."""
    from schedkit.errors import PluginError

    config = config_from_dict({"plugins": [{"name": "noqueue"}]})
    with pytest.raises(PluginError, match="schedkit_create_waiting_queue returned 5"):
        LLM(config)
