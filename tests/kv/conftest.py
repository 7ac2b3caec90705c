"""Fixtures for the KV tests: a tiny duck-typed request (the KVRequest protocol)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest

from schedkit.kv import BlockHasher


@dataclass
class FakeRequest:
    """Just enough of a request for the KV cache manager."""

    request_id: str
    prompt_token_ids: list[int]
    hasher: BlockHasher
    cache_salt: str | None = None
    lora: tuple[str, str] | None = None
    skip_reading_prefix_cache: bool = False
    num_computed_tokens: int = 0
    all_token_ids: list[int] = field(init=False)
    block_hashes: list[bytes] = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.block_hashes = []
        self._rehash()

    def _rehash(self) -> None:
        self.hasher.extend(self.all_token_ids, self.block_hashes, self.cache_salt, self.lora)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append(self, *tokens: int) -> None:
        """Append output tokens, extending block_hashes like a real request."""
        self.all_token_ids.extend(tokens)
        self._rehash()


MakeRequest = Callable[..., FakeRequest]


@pytest.fixture(scope="session")
def make_request() -> MakeRequest:
    """Factory: ``make_request(id, tokens, block_size, algo="sha256", **fields)``."""

    def make(
        request_id: str | int,
        tokens: Sequence[int],
        block_size: int,
        algo: str = "sha256",
        **kwargs: object,
    ) -> FakeRequest:
        return FakeRequest(
            str(request_id),
            list(tokens),
            BlockHasher(block_size, algo),
            **kwargs,  # type: ignore[arg-type]
        )

    return make
