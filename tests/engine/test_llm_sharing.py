"""``LLM`` shared by threads takes turns; a closed LLM says so; input mistakes raise
before anything is sent."""

from __future__ import annotations

import threading

import pytest

from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.errors import EngineDeadError, RequestError
from schedkit.llm import LLM, AsyncLLM

FAKE = {"cache": {"block_size": 16, "num_blocks": 512}, "runner": {"kind": "fake", "vocab_size": 1000},
        "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "max_model_len": 1024}}


def test_threads_sharing_an_llm_each_get_all_their_outputs():
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    with LLM(config_from_dict(FAKE)) as llm:
        def work(k: int) -> None:
            try:
                results[k] = llm.generate([[k + 1] * 10] * 40, SamplingParams(max_tokens=12, ignore_eos=True),
                                          use_tqdm=False)
                assert llm.call_utility("num_unfinished") >= 0
            except BaseException as e:  # noqa: BLE001 -- reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads) and not errors
        for k in range(3):
            assert len(results[k]) == 40
            assert all(r.finish_reason == "length" and len(r.output_token_ids) == 12 for r in results[k])
        assert llm.call_utility("num_unfinished") == 0


def test_a_closed_llm_says_so():
    llm = LLM(config_from_dict(FAKE))
    llm.close()
    llm.close()  # twice is harmless
    with pytest.raises(EngineDeadError, match="this LLM was closed"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(EngineDeadError, match="this LLM was closed"):
        llm.call_utility("stats")


@pytest.mark.parametrize("params", [{"max_tokens": 3}, "max_tokens=3", 3])
def test_sampling_params_of_the_wrong_kind_are_named(params):
    with LLM(config_from_dict(FAKE)) as llm, pytest.raises(RequestError, match="sampling_params must be"):
        llm.generate([[1, 2]], params, use_tqdm=False)


def test_an_empty_prompt_raises_before_anything_is_sent():
    import asyncio

    with LLM(config_from_dict(FAKE)) as llm:
        with pytest.raises(RequestError, match=r"prompts\[1\].*the prompt is empty"):
            llm.generate([[1, 2], []], SamplingParams(max_tokens=2), use_tqdm=False)
        assert llm.call_utility("num_unfinished") == 0

    async def main():
        async with await AsyncLLM.create(config_from_dict(FAKE)) as allm:
            with pytest.raises(RequestError, match="the prompt is empty"):
                async for _ in allm.generate([], SamplingParams(max_tokens=2)):
                    pass

    asyncio.run(asyncio.wait_for(main(), 60))
