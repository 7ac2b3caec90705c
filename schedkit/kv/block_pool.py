"""Block pool: reference counts, the free queue and the prefix-cache map.

Behaviours: docs/scheduler-behaviour.md#null-block, docs/scheduler-behaviour.md#refcounts,
docs/scheduler-behaviour.md#free-queue-order, docs/scheduler-behaviour.md#cached-block-map.

All per-block state lives in flat lists indexed by block id, and the free queue is a
doubly linked list threaded through ``_prev``/``_next`` with a sentinel at index
``num_blocks``, so every operation is O(1) per block and allocates no objects.

Free-queue order (docs/scheduler-behaviour.md#free-queue-order): allocation pops from
the head; a freed batch puts its unhashed blocks at the head (batch order, first one
becomes the head) and appends its hashed blocks at the tail (LRU eviction of cached
blocks). Free hashed blocks keep their hash and can still be hit until they are popped
for reuse.

Transactions: between ``begin()`` and ``commit()`` every change is journaled, and
``rollback()`` undoes them in reverse, leaving reference counts, the free queue, the
prefix-cache map and the buffered events exactly as at ``begin()`` (the scheduler uses
this when a plugin raises mid-step). Outside a transaction the journal costs one
``is None`` test per call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from schedkit.kv.cached_block_map import CachedBlockMap
from schedkit.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from schedkit.kv.hashing import BlockHash

NULL_BLOCK_ID = 0

# Journal entry kinds (see BlockPool.begin).
_NEW, _TOUCH, _FREE, _CACHE, _EVICT = range(5)


class BlockPool:
    """Owns ``num_blocks`` KV blocks (ids ``0..num_blocks-1``); block 0 is the null block.

    Used only in the scheduler process. Not thread-safe.

    Attributes:
        num_blocks: Total blocks including the null block.
        block_size: Tokens per block (used for KV events).
        enable_caching: Whether blocks may be registered in the prefix cache.
        num_free_blocks: Blocks in the free queue (read-only for callers).
        cached_block_map: The hash -> block map (read-only for callers).
    """

    __slots__ = (
        "num_blocks",
        "record_evictions",
        "_evicted",
        "_evicted_mark",
        "block_size",
        "enable_caching",
        "enable_kv_events",
        "num_free_blocks",
        "cached_block_map",
        "_ref_cnt",
        "_hash",
        "_prev",
        "_next",
        "_sentinel",
        "_events",
        "_journal",
        "_events_mark",
    )

    def __init__(
        self,
        num_blocks: int,
        *,
        block_size: int = 16,
        enable_caching: bool = True,
        enable_kv_events: bool = False,
    ) -> None:
        """Create the pool with free queue ``[1, 2, ..., num_blocks-1]``.

        Args:
            num_blocks: Total blocks, including the null block 0 (>= 1).
            block_size: Tokens per block.
            enable_caching: Allow prefix caching.
            enable_kv_events: Buffer BlockStored/BlockRemoved/AllBlocksCleared events.
        """
        assert num_blocks >= 1, num_blocks
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_kv_events = enable_kv_events
        self.cached_block_map = CachedBlockMap()
        self._ref_cnt = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        s = num_blocks
        self._sentinel = s
        # Links for ids 1..N-1 plus the sentinel at index N; block 0 (null) is never linked.
        self._next = [s] * (num_blocks + 1)
        self._prev = [s] * (num_blocks + 1)
        p = s
        for b in range(1, num_blocks):
            self._next[p] = b
            self._prev[b] = p
            p = b
        self._next[p] = s
        self._prev[s] = p
        self.num_free_blocks = num_blocks - 1
        self._events: list[KVCacheEvent] = []
        self._journal: list[tuple] | None = None
        self._events_mark = 0
        self.record_evictions = False
        """Keep ``(block, hash)`` of every cached block an allocation evicts, for
        :meth:`take_evicted` (a KV connector that saves evicted blocks turns it on)."""
        self._evicted: list[tuple[int, BlockHash]] = []
        self._evicted_mark = 0

    # Queries ------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use: ``1 - free / (N - 1)`` (0 when N == 1)."""
        if self.num_blocks <= 1:
            return 0.0
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def ref_cnt(self, block_id: int) -> int:
        """Number of requests holding ``block_id``."""
        return self._ref_cnt[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The hash ``block_id`` is cached under, or None."""
        return self._hash[block_id]

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """Return a block cached under ``block_hash`` (first inserted), or None.

        Does not change any state (no LRU touch).
        """
        return self.cached_block_map.get(block_hash)

    def get_free_block_ids(self) -> list[int]:
        """The free queue from head to tail (O(N); for tests and debugging)."""
        out = []
        nxt = self._next
        s = self._sentinel
        b = nxt[s]
        while b != s:
            out.append(b)
            b = nxt[b]
        return out

    # Allocation and reference counting ----------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Pop ``num_blocks`` blocks from the head of the free queue, with ref_cnt 1.

        A popped block that still carries a hash is evicted from the prefix cache
        first. The caller must have checked ``num_blocks <= num_free_blocks``.
        """
        assert 0 <= num_blocks <= self.num_free_blocks, (num_blocks, self.num_free_blocks)
        nxt = self._next
        ref = self._ref_cnt
        hashes = self._hash
        s = self._sentinel
        out = [0] * num_blocks
        journal = self._journal
        evicted: list[tuple[int, BlockHash, int]] = []
        b = nxt[s]
        for i in range(num_blocks):
            out[i] = b
            ref[b] = 1
            h = hashes[b]
            if h is not None:
                if journal is not None:
                    evicted.append((b, h, self.cached_block_map.index_of(h, b)))
                if self.record_evictions:
                    self._evicted.append((b, h))
                self._evict(b)
            b = nxt[b]
        nxt[s] = b
        self._prev[b] = s
        self.num_free_blocks -= num_blocks
        if journal is not None:
            journal.append((_NEW, out, evicted))
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (prefix hit), pulling free ones out of the queue."""
        ref = self._ref_cnt
        nxt = self._next
        prev = self._prev
        journal = self._journal
        touched: list[tuple[int, int, int]] = []
        for b in block_ids:
            if b == NULL_BLOCK_ID:
                continue
            p = n = -1
            if ref[b] == 0:
                p = prev[b]
                n = nxt[b]
                nxt[p] = n
                prev[n] = p
                self.num_free_blocks -= 1
            ref[b] += 1
            if journal is not None:
                touched.append((b, p, n))
        if journal is not None:
            journal.append((_TOUCH, touched))

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the given order (docs/scheduler-behaviour.md#free-queue-order).

        Blocks reaching ref_cnt 0 return to the free queue: unhashed ones at the head
        (keeping batch order), hashed ones at the tail. The null block is ignored.
        """
        ref = self._ref_cnt
        hashes = self._hash
        nxt = self._next
        prev = self._prev
        s = self._sentinel
        front: list[int] = []
        num_freed = 0
        journal = self._journal
        if journal is not None:
            block_ids = [b for b in block_ids if b != NULL_BLOCK_ID]
            journal.append((_FREE, block_ids))
        for b in block_ids:
            if b == NULL_BLOCK_ID:
                continue
            r = ref[b] - 1
            assert r >= 0, f"double free of block {b}"
            ref[b] = r
            if r:
                continue
            num_freed += 1
            if hashes[b] is None:
                front.append(b)
            else:
                t = prev[s]
                nxt[t] = b
                prev[b] = t
                nxt[b] = s
                prev[s] = b
        if front:
            old_head = nxt[s]
            p = s
            for b in front:
                nxt[p] = b
                prev[b] = p
                p = b
            nxt[p] = old_head
            prev[old_head] = p
        self.num_free_blocks += num_freed

    # Prefix cache ----------------------------------------------------------------------

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: Sequence[int] | None = None,
    ) -> None:
        """Register ``block_ids[num_cached_blocks:num_full_blocks]`` in the prefix cache.

        Block ``block_ids[i]`` is cached under ``block_hashes[i]``; null blocks are
        skipped. Emits one BlockStored event when events are enabled (``token_ids``,
        the request's tokens, is then required).
        """
        if num_full_blocks <= num_cached_blocks or not self.enable_caching:
            return
        assert len(block_hashes) >= num_full_blocks, (len(block_hashes), num_full_blocks)
        hashes = self._hash
        insert = self.cached_block_map.insert
        stored: list[BlockHash] = []
        for i in range(num_cached_blocks, num_full_blocks):
            b = block_ids[i]
            if b == NULL_BLOCK_ID:
                continue
            h = block_hashes[i]
            assert hashes[b] is None, f"block {b} is already cached"
            hashes[b] = h
            insert(h, b)
            stored.append(h)
            if self._journal is not None:
                self._journal.append((_CACHE, b, h))
        if self.enable_kv_events and stored:
            assert token_ids is not None
            bs = self.block_size
            parent = block_hashes[num_cached_blocks - 1] if num_cached_blocks > 0 else None
            self._events.append(
                BlockStored(
                    block_hashes=stored,
                    parent_block_hash=parent,
                    token_ids=list(token_ids[num_cached_blocks * bs : num_full_blocks * bs]),
                    block_size=bs,
                )
            )

    def _evict(self, block_id: int) -> None:
        h = self._hash[block_id]
        assert h is not None
        self._hash[block_id] = None
        self.cached_block_map.pop(h, block_id)
        if self.enable_kv_events:
            self._events.append(BlockRemoved(block_hashes=[h]))

    def take_evicted(self) -> list[tuple[int, BlockHash]]:
        """``(block id, hash)`` of the cached blocks that allocations evicted to reuse
        them since the last call (recorded only with ``record_evictions``; the blocks
        still hold that KV until the step that reuses them runs)."""
        out, self._evicted = self._evicted, []
        return out

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the given blocks' hashes from the prefix cache; ref counts are untouched."""
        for b in block_ids:
            h = self._hash[b]
            if h is not None:
                if self._journal is not None:
                    self._journal.append((_EVICT, b, h, self.cached_block_map.index_of(h, b)))
                self._evict(b)

    def reset_prefix_cache(self) -> bool:
        """Clear the prefix cache if every usable block is free.

        Returns:
            True on success; False (nothing changed) while any block is in use.
        """
        assert self._journal is None, "prefix-cache reset inside a transaction"
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self.cached_block_map.clear()
        self._hash = [None] * self.num_blocks
        if self.enable_kv_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the buffered KV events (always empty when disabled)."""
        events = self._events
        self._events = []
        return events

    # Transactions ----------------------------------------------------------------------

    @property
    def in_transaction(self) -> bool:
        return self._journal is not None

    def begin(self) -> None:
        """Start journaling every change (see the module docstring)."""
        assert self._journal is None, "nested transaction"
        self._journal = []
        self._events_mark = len(self._events)
        self._evicted_mark = len(self._evicted)

    def commit(self) -> None:
        """Keep the changes since ``begin()`` and stop journaling."""
        self._journal = None

    def rollback(self) -> None:
        """Undo every change since ``begin()``, last first, and stop journaling."""
        journal = self._journal
        assert journal is not None, "rollback outside a transaction"
        self._journal = None
        del self._evicted[self._evicted_mark:]
        ref, hashes, nxt, prev, s = self._ref_cnt, self._hash, self._next, self._prev, self._sentinel
        cmap = self.cached_block_map
        for entry in reversed(journal):
            kind = entry[0]
            if kind == _CACHE:
                _, b, h = entry
                hashes[b] = None
                cmap.pop(h, b)
            elif kind == _EVICT:
                _, b, h, pos = entry
                hashes[b] = h
                cmap.insert_at(h, b, pos)
            elif kind == _FREE:
                for b in entry[1]:
                    if ref[b] == 0:  # it went back to the queue: take it out again
                        p, n = prev[b], nxt[b]
                        nxt[p] = n
                        prev[n] = p
                        self.num_free_blocks -= 1
                    ref[b] += 1
            elif kind == _TOUCH:
                for b, p, n in reversed(entry[1]):
                    ref[b] -= 1
                    if p >= 0:  # it was free, between p and n
                        nxt[p] = b
                        prev[b] = p
                        nxt[b] = n
                        prev[n] = b
                        self.num_free_blocks += 1
            else:  # _NEW: back to the head of the queue, hashes restored
                _, out, evicted = entry
                for b, h, pos in reversed(evicted):
                    hashes[b] = h
                    cmap.insert_at(h, b, pos)
                for b in reversed(out):
                    ref[b] = 0
                    head = nxt[s]
                    nxt[s] = b
                    prev[b] = s
                    nxt[b] = head
                    prev[head] = b
                self.num_free_blocks += len(out)
        del self._events[self._events_mark:]
