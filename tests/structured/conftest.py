"""Small tokenizers built in the test process (no downloads)."""

from __future__ import annotations

import pytest

CORPUS = [
    '{"name": "Ada", "age": 36, "tags": ["x", "y"]}',
    '{"items": [1, 2, 3], "ok": true, "ratio": 0.5}',
    '{"a": null, "b": false, "c": -12}',
    'yes no maybe 0123456789 abc def',
    "root ::= expr; (a|b)* [0-9]+",
]


def byte_level_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer (GPT-2 style) trained on a few JSON strings, wrapped in
    transformers' PreTrainedTokenizerFast; ids 0 and 1 are ``<eos>`` and ``<pad>``."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 10, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                                pad_token="<pad>")


@pytest.fixture(scope="session")
def bpe_tokenizer():
    return byte_level_tokenizer()
