"""What the KV cache manager reads from a request (duck-typed; no import of core)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class KVRequest(Protocol):
    """The request attributes the KV cache manager reads. It never mutates them.

    Attributes:
        request_id: Unique id; keys the manager's per-request state.
        num_tokens: Prompt plus output tokens (drafts excluded).
        num_computed_tokens: Leading tokens whose KV is (or will be) in the cache.
        block_hashes: Chained hashes of every full block of ``all_token_ids``.
        skip_reading_prefix_cache: True when every prompt position must be computed.
        all_token_ids: Prompt followed by outputs (read only for KV events).
    """

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> Sequence[bytes]: ...

    @property
    def skip_reading_prefix_cache(self) -> bool: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...
