"""Test helpers for structured outputs: a small byte-level tokenizer trained on the spot,
and, for models without a tokenizer (the random-weight test models), a synthetic
vocabulary with a plugin serving the python backend over it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

STRUCTURED_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789-_"
"""The text of the synthetic vocabulary :func:`structured_backend_plugin` builds."""


def synthetic_token_strings(vocab_size: int) -> list[str | None]:
    """Token ``i``'s text for models without a tokenizer (the random-weight test models):
    one to three repeats of an alphabet character; token 0 (the stop token) has none."""
    n = len(STRUCTURED_ALPHABET)
    return [None] + [STRUCTURED_ALPHABET[i % n] * (1 + (i // n) % 3) for i in range(1, vocab_size)]


def structured_backend_plugin(vocab_size: int) -> Any:
    """A plugin answering ``structured_outputs.backend: synthetic`` with the python
    backend over :func:`synthetic_token_strings` (stop token 0)."""
    from schedkit.hookspecs import hookimpl
    from schedkit.structured.python_backend import PythonBackend

    class SyntheticVocabulary:
        @hookimpl
        def schedkit_create_structured_output_backend(self, config: Any) -> Any:
            if config.backend != "synthetic":
                return None
            return PythonBackend(synthetic_token_strings(vocab_size), [0], vocab_size)

    return SyntheticVocabulary()


def structured_text(token_ids: Sequence[int], vocab_size: int) -> str:
    """The text of tokens of the synthetic vocabulary (the stop token dropped)."""
    strings = synthetic_token_strings(vocab_size)
    return "".join(strings[t] or "" for t in token_ids)


TOKENIZER_CORPUS = [
    '{"name": "Ada", "age": 36, "tags": ["x", "y"]}',
    '{"items": [1, 2, 3], "ok": true, "ratio": 0.5}',
    '{"a": null, "b": false, "c": -12}',
    'yes no maybe 0123456789 abc def',
    "root ::= expr; (a|b)* [0-9]+",
]


def byte_level_tokenizer(vocab_size: int = 320, chat_template: str | None = None) -> Any:
    """A byte-level BPE tokenizer (GPT-2 style) trained on a few JSON strings, wrapped in
    transformers' PreTrainedTokenizerFast; ids 0 and 1 are ``<eos>`` and ``<pad>``.
    Needs ``tokenizers`` and ``transformers``; no download."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(TOKENIZER_CORPUS * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def word_level_tokenizer(vocab_size: int = 49152) -> Any:
    """A word-level tokenizer of ``vocab_size`` tokens (SmolLM2's size by default), for
    costs that grow with the vocabulary: ``<eos>`` (id 0), the characters of
    :data:`WORD_ALPHABET`, then random 2-8 character pieces of them (a fixed seed).
    Wrapped in transformers' PreTrainedTokenizerFast; no download."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    chars = list(WORD_ALPHABET)
    pieces: dict[str, None] = dict.fromkeys(["<eos>", *chars])
    while len(pieces) < vocab_size:
        pieces["".join(rng.choice(chars) for _ in range(rng.randrange(2, 9)))] = None
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


WORD_ALPHABET = "abcdefghijklmnopqrstuvwxyz{}[]:,0123456789.-"
"""The characters of :func:`word_level_tokenizer`'s pieces."""
