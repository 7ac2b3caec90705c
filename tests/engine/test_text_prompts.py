"""Text prompts through the engine process, with a real (tiny, locally built) tokenizer."""

from __future__ import annotations

import pytest

from schedkit.config import config_from_dict
from schedkit.core.request import SamplingParams
from schedkit.errors import RequestError
from schedkit.llm import LLM

pytest.importorskip("transformers")


@pytest.fixture
def tokenizer_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", "</s>", "hello", "world", "how", "are", "you"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(tmp_path)
    return tmp_path


def test_text_prompts_are_tokenized_with_the_models_tokenizer(tokenizer_dir):
    config = config_from_dict({"model": {"tokenizer": str(tokenizer_dir)}})
    with LLM(config) as llm:
        outs = llm.generate(["hello world", "how are you"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[3, 4], [5, 6, 7]]
    assert all(len(o.output_token_ids) == 3 and o.finish_reason == "length" for o in outs)


def test_text_prompts_without_a_tokenizer_fail_clearly():
    with LLM(config_from_dict({})) as llm, pytest.raises(RequestError, match="tokenizer"):
        llm.generate(["hello"], use_tqdm=False)
