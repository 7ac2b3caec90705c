"""Small tokenizers built in the test process (no downloads)."""

from __future__ import annotations

import pytest

from schedkit.structured.testing import byte_level_tokenizer


@pytest.fixture(scope="session")
def bpe_tokenizer():
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    return byte_level_tokenizer()
