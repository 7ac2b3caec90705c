"""KV cache events published when ``enable_kv_events`` is on (docs/scheduler-behaviour.md#kv-events).

Events are buffered by the block pool in the scheduler process and drained once per
step with ``take_events()``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class BlockStored:
    """Consecutive full blocks of one request were registered in the prefix cache.

    Attributes:
        block_hashes: Hashes of the newly cached blocks, in table order.
        parent_block_hash: Hash of the block before the first one (taken from the
            request's hash list even when that physical block is the null block), or
            None when the first cached block is block 0 of the request.
        token_ids: Token ids covered by the cached range.
        block_size: Tokens per block.
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    """Cached blocks were evicted from the prefix cache (reused or explicitly evicted).

    Attributes:
        block_hashes: Hashes of the evicted blocks.
    """

    block_hashes: list[bytes]


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
