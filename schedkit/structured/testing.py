"""Test helpers for structured outputs on models without a tokenizer (the random-weight
test models): a synthetic vocabulary and a plugin serving the python backend over it."""

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
