"""A request id already streaming in an AsyncLLM is refused at once; the running stream
is unaffected."""

from __future__ import annotations

import asyncio

import pytest

from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.errors import RequestError
from schedkit.llm import AsyncLLM

from .conftest import LONG


def test_duplicate_stream_id_raises_at_once_and_leaves_the_first_alone():
    async def main():
        async with await AsyncLLM.create(config_from_dict(LONG)) as llm:
            first = llm.generate([5, 6], SamplingParams(max_tokens=30), request_id="dup")
            got = len((await first.__anext__()).output_token_ids)
            with pytest.raises(RequestError, match="dup.*already streaming") as e:
                async for _ in llm.generate([7], SamplingParams(max_tokens=3), request_id="dup"):
                    raise AssertionError("the duplicate must not stream")
            assert e.value.request_id == "dup"
            last = None
            async for d in first:
                got += len(d.output_token_ids)
                last = d
            assert got == 30 and last is not None and last.finish_reason == "length"
            with pytest.raises(RequestError, match="tenant"):
                async for _ in llm.generate([7], tenant=3):
                    pass
            again = [d async for d in llm.generate([8], SamplingParams(max_tokens=2), request_id="dup")]
            assert again[-1].finish_reason == "length"

    asyncio.run(asyncio.wait_for(main(), 30))
