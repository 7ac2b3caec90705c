"""What one engine's prefix cache holds, rebuilt from its KV cache events.

The router keeps one :class:`CachedPrefixIndex` per replica and feeds it the replica's
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events
(:mod:`schedkit.kv.events`), so a prefix-affinity decision counts blocks the engine
really holds rather than guessing from where similar requests went before. Block hashes
chain (each covers its whole prefix), so a request's leading blocks that are present
are exactly the prefix-cache hit that engine would give it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from schedkit.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


class CachedPrefixIndex:
    """The set of block hashes an engine's prefix cache holds."""

    __slots__ = ("_blocks", "num_events")

    def __init__(self) -> None:
        self._blocks: set[bytes] = set()
        self.num_events = 0
        """Events applied so far (all kinds)."""

    def apply(self, events: Iterable[KVCacheEvent]) -> None:
        """Apply events in the order the engine emitted them."""
        blocks = self._blocks
        for ev in events:
            self.num_events += 1
            if isinstance(ev, BlockStored):
                blocks.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                blocks.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                blocks.clear()

    def clear(self) -> None:
        self._blocks.clear()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def num_matched_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """How many of ``block_hashes`` (a request's, in order) the cache holds from the
        start: the prefix-cache hit in blocks."""
        blocks = self._blocks
        n = 0
        for h in block_hashes:
            if h not in blocks:
                break
            n += 1
        return n
