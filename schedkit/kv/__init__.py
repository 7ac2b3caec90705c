"""KV cache management: block hashing, the block pool and the KV cache manager.

Imports only the standard library, ``xxhash`` and ``schedkit.errors``; requests are read
duck-typed through :class:`KVRequest`.
"""

from schedkit.kv.block_pool import BlockPool
from schedkit.kv.cached_block_map import CachedBlockMap
from schedkit.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from schedkit.kv.hashing import (
    NONE_HASH,
    BlockHash,
    BlockHasher,
    compute_none_hash,
    hash_block_tokens,
)
from schedkit.kv.interfaces import KVRequest
from schedkit.kv.kv_cache_manager import KVCacheManager
from schedkit.kv.metrics import CachingMetrics, PrefixCacheStats

__all__ = [
    "NONE_HASH",
    "AllBlocksCleared",
    "BlockHash",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CachedBlockMap",
    "CachingMetrics",
    "KVCacheEvent",
    "KVCacheManager",
    "KVRequest",
    "PrefixCacheStats",
    "compute_none_hash",
    "hash_block_tokens",
]
