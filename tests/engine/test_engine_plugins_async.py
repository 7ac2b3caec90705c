"""A raising plugin inside the engine process, async streaming, cancellation, tcp."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.errors import RequestError
from schedkit.llm import LLM, AsyncLLM

PLUGIN = textwrap.dedent('''
    from schedkit import hookimpl

    class Boom:
        """Raises while deciding about any request whose prompt starts with 666."""

        @hookimpl
        def schedkit_admit_request(self, request):
            if request.prompt_token_ids[0] == 666:
                raise RuntimeError("cannot judge 666")
            return None
''')


@pytest.fixture
def boom_installed(install_plugin):
    install_plugin("boom_plugin", PLUGIN, {"boom": "boom_plugin:Boom"})
    return "boom"


def test_raising_plugin_fails_only_the_affected_request(boom_installed):
    config = config_from_dict({"plugins": [{"name": boom_installed}]})
    with LLM(config) as llm:
        outs = llm.generate([[5, 6, 7], [666, 1, 2], [8, 9]], SamplingParams(max_tokens=3),
                            use_tqdm=False)
        assert [o.finish_reason for o in outs] == ["length", "error", "length"]
        assert "'boom'" in outs[1].error and "schedkit_admit_request" in outs[1].error
        assert "cannot judge 666" in outs[1].error
        again = llm.generate([[4, 4]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert again[0].finish_reason == "length"
        assert llm.call_utility("stats")["num_free_blocks"] == 2047


@pytest.mark.parametrize("transport,async_scheduling", [("ipc", False), ("tcp", False), ("ipc", True)])
def test_async_streaming_and_cancel(transport, async_scheduling):
    config = config_from_dict({"scheduler": {"max_model_len": 100000, "async_scheduling": async_scheduling},
                               "cache": {"num_blocks": 512}})

    async def main():
        llm = await AsyncLLM.create(config, transport=transport)
        try:
            deltas = [d async for d in llm.generate([3, 4, 5], SamplingParams(max_tokens=5))]
            assert sum(len(d.output_token_ids) for d in deltas) == 5
            assert deltas[-1].finish_reason == "length" and deltas[-1].metrics is not None
            assert all(d.finish_reason is None for d in deltas[:-1])

            async def consume_some():
                n = 0
                async for d in llm.generate([7, 8], SamplingParams(max_tokens=90000), request_id="long"):
                    n += len(d.output_token_ids)
                    if n >= 20:
                        break  # closing the generator aborts the request
                return n

            assert await consume_some() >= 20
            for _ in range(100):  # the abort is asynchronous: wait for the engine to apply it
                stats = await llm.call_utility("stats")
                if stats["num_running"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert stats["num_running"] == 0 and stats["num_free_blocks"] == 511
            with pytest.raises(RequestError, match="max_model_len"):
                async for _ in llm.generate([1] * 100000, SamplingParams(max_tokens=1)):
                    pass
            again = [d async for d in llm.generate([9], SamplingParams(max_tokens=2))]
            assert again[-1].finish_reason == "length"
        finally:
            await llm.close()

    asyncio.run(main())
