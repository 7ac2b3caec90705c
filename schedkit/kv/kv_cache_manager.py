"""Scheduler-side KV cache manager for one full-attention KV group.

Behaviours: docs/scheduler-behaviour.md#prefix-hits, docs/scheduler-behaviour.md#allocate-slots,
docs/scheduler-behaviour.md#cache-reset.

Keeps each request's block table and its number of prefix-cached blocks (one
:class:`RequestBlocks` per request id), and delegates block bookkeeping to
:class:`BlockPool`. Runs in the scheduler (engine-core) process only; not thread-safe.

Hot path: a decode step calls ``allocate_slots(req, 1)`` for every running request; when
no block is needed and no block fills up, that costs one dict lookup and a few integer
operations.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from schedkit.errors import ConfigError
from schedkit.kv.block_pool import BlockPool
from schedkit.kv.events import KVCacheEvent
from schedkit.kv.hashing import BlockHash
from schedkit.kv.interfaces import KVRequest
from schedkit.kv.metrics import PrefixCacheStats

__all__ = ["KVCacheManager", "KVRequest", "RequestBlocks"]


@dataclass(slots=True)
class RequestBlocks:
    """One request's KV state, kept in a dict keyed by request id.

    Attributes:
        block_ids: The block table, in token order.
        num_cached_blocks: Leading blocks registered in the prefix cache (only grows).
    """

    block_ids: list[int]
    num_cached_blocks: int = 0


class KVCacheManager:
    """Allocates, caches and frees KV blocks for requests.

    Attributes:
        block_size: Tokens per block.
        num_blocks: Total blocks including the null block 0.
        max_model_len: No slot is ever allocated at a position >= this.
        enable_caching: Whether prefix caching is on.
        block_pool: The underlying pool.
        prefix_cache_totals: Cumulative prefix-cache stats since construction.
    """

    __slots__ = (
        "block_size",
        "num_blocks",
        "max_model_len",
        "enable_caching",
        "drop_last_hit_block",
        "block_pool",
        "prefix_cache_totals",
        "_watermark_blocks",
        "_reqs",
        "_stats",
        "_journal",
        "_saved_stats",
    )

    def __init__(
        self,
        *,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        enable_caching: bool = True,
        watermark: float = 0.0,
        enable_kv_events: bool = False,
        drop_last_hit_block: bool = False,
    ) -> None:
        """Create the manager and its block pool.

        Args:
            block_size: Tokens per block (>= 1).
            num_blocks: Total blocks including the null block (>= 1).
            max_model_len: Maximum sequence length (>= 1).
            enable_caching: Enable prefix caching.
            watermark: Fraction of ``num_blocks`` kept free for admissions that pass
                ``apply_watermark=True``; in [0, 1).
            enable_kv_events: Buffer KV events for ``take_events()``.
            drop_last_hit_block: A prefix hit leaves out its last block, which the
                request then computes (an EAGLE head needs the target's hidden states
                there: its KV at a block's last position pairs it with the next token,
                which another request's may not share).
        Raises:
            ConfigError: A value is out of range.
        """
        if block_size < 1 or num_blocks < 1 or max_model_len < 1:
            raise ConfigError(
                f"KVCacheManager needs block_size, num_blocks and max_model_len >= 1, got "
                f"{block_size}, {num_blocks}, {max_model_len}"
            )
        if not 0.0 <= watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {watermark}")
        self.drop_last_hit_block = drop_last_hit_block
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(
            num_blocks,
            block_size=block_size,
            enable_caching=enable_caching,
            enable_kv_events=enable_kv_events,
        )
        self._watermark_blocks = int(watermark * num_blocks)
        self._reqs: dict[str, RequestBlocks] = {}
        self._stats = PrefixCacheStats()
        self.prefix_cache_totals = PrefixCacheStats()
        self._journal: dict[str, tuple[RequestBlocks | None, int, int]] | None = None
        """In a transaction: each request's table as it was at ``begin()`` (the state
        object, its length, its cached count), recorded before its first change."""
        self._saved_stats: tuple[PrefixCacheStats, PrefixCacheStats] | None = None
        """In a transaction: the statistics before their first change."""

    # Queries ------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """KV cache usage, ``1 - free / (num_blocks - 1)``."""
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue (including cached ones that may still be hit)."""
        return self.block_pool.num_free_blocks

    @property
    def num_tracked_requests(self) -> int:
        """Requests that currently own a block table."""
        return len(self._reqs)

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's full block table ([] when it holds none)."""
        state = self._reqs.get(request_id)
        return list(state.block_ids) if state is not None else []

    def get_num_blocks(self, request_id: str) -> int:
        """Blocks in the request's table (0 for an unknown request)."""
        state = self._reqs.get(request_id)
        return len(state.block_ids) if state is not None else 0

    def get_num_cached_blocks(self, request_id: str) -> int:
        """Number of leading blocks of the request registered in the prefix cache."""
        state = self._reqs.get(request_id)
        return state.num_cached_blocks if state is not None else 0

    def _num_leading_blocks(self, request_id: str, holds: Callable[[int], bool]) -> int:
        """Leading blocks of the request's table whose reference count passes ``holds``."""
        state = self._reqs.get(request_id)
        if state is None:
            return 0
        ref = self.block_pool.ref_cnt
        n = 0
        for b in state.block_ids:
            if not holds(ref(b)):
                break
            n += 1
        return n

    def get_num_common_prefix_blocks(self, request_id: str, num_running_requests: int) -> int:
        """Leading blocks of the request's table held by all ``num_running_requests``."""
        return self._num_leading_blocks(request_id, lambda n: n == num_running_requests)

    def get_num_shared_prefix_blocks(self, request_id: str) -> int:
        """Leading blocks of the request's table that another request holds too: they
        stay allocated, and cached, when this request frees its blocks."""
        return self._num_leading_blocks(request_id, lambda n: n >= 2)

    def get_computed_blocks(self, request: KVRequest) -> tuple[list[int], int]:
        """Look up the request's longest cached prefix, in whole blocks.

        At most ``num_tokens - 1`` tokens can hit (one token must be computed to get
        logits). Changes no state and records no stats.

        Returns:
            (hit block ids, number of hit tokens); ([], 0) when caching is off or the
            request skips prefix-cache reads.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks <= 0:
            return [], 0
        hits = self.cached_prefix(request.block_hashes[:max_blocks])
        if self.drop_last_hit_block and hits:
            hits.pop()
        return hits, len(hits) * self.block_size

    def cached_prefix(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the longest run of ``block_hashes`` from the first one
        (none when caching is off). Changes no state."""
        if not self.enable_caching:
            return []
        get = self.block_pool.cached_block_map.get
        hits: list[int] = []
        for h in block_hashes:
            b = get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    # Allocation ---------------------------------------------------------------------

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[int] = (),
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        apply_watermark: bool = False,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` (+ lookahead) tokens of the request
        (docs/scheduler-behaviour.md#allocate-slots).

        Layout: ``[computed | new local hits | external hits | new tokens | lookahead]``.
        Full blocks up to ``min(computed + hits + external + num_new_tokens, num_tokens)``
        are registered in the prefix cache immediately unless ``delay_cache_blocks``.

        Args:
            request: The request; its ``num_computed_tokens`` excludes the new hits.
            num_new_tokens: Tokens to compute this step.
            num_new_computed_tokens: Local prefix-hit tokens (from get_computed_blocks).
            new_computed_blocks: Local prefix-hit blocks (from get_computed_blocks).
            num_lookahead_tokens: Extra slots for speculative tokens (never cached).
            num_external_computed_tokens: Tokens a KV connector will load.
            delay_cache_blocks: Do not cache now (async external load).
            full_sequence_must_fit: Refuse unless the whole current sequence fits.
            reserved_blocks: Free blocks this allocation must leave untouched.
            apply_watermark: Also keep ``int(watermark * num_blocks)`` blocks free.
        Returns:
            The newly allocated block ids (possibly []), excluding hit and external
            blocks; or None, with no side effects, when the blocks do not fit.
        """
        if new_computed_blocks or num_external_computed_tokens or full_sequence_must_fit:
            return self._allocate_general(
                request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
                full_sequence_must_fit, reserved_blocks, apply_watermark,
            )  # fmt: skip
        # Fast path (every running request): no hits, no external tokens, no gate.
        assert num_new_tokens > 0 or num_new_computed_tokens > 0, "nothing to allocate"
        state = self._reqs.get(request.request_id)
        end = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        need = end + num_lookahead_tokens
        if need > self.max_model_len:
            need = self.max_model_len
        bs = self.block_size
        if state is not None and need <= len(state.block_ids) * bs:
            if apply_watermark or reserved_blocks:
                pool = self.block_pool
                wm = self._watermark_blocks if apply_watermark else 0
                if wm > pool.num_free_blocks - reserved_blocks:
                    return None
            new_blocks = []
        else:
            num_new = (need + bs - 1) // bs - (len(state.block_ids) if state is not None else 0)
            pool = self.block_pool
            wm = self._watermark_blocks if apply_watermark else 0
            if num_new + wm > pool.num_free_blocks - reserved_blocks:
                return None
            if self._journal is not None:
                self._remember(request.request_id, state)
            new_blocks = pool.get_new_blocks(num_new)
            if state is None:
                state = self._reqs[request.request_id] = RequestBlocks(new_blocks.copy())
            else:
                state.block_ids += new_blocks
        if end // bs > state.num_cached_blocks and self.enable_caching and not delay_cache_blocks:
            num_full = min(end, request.num_tokens) // bs
            if num_full > state.num_cached_blocks:
                self._cache(request, state, num_full)
        return new_blocks

    def _allocate_general(
        self,
        request: KVRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: Sequence[int],
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
        delay_cache_blocks: bool,
        full_sequence_must_fit: bool,
        reserved_blocks: int,
        apply_watermark: bool,
    ) -> list[int] | None:
        ext = num_external_computed_tokens
        assert num_new_tokens > 0 or ext > 0 or num_new_computed_tokens > 0, "nothing to allocate"
        rid = request.request_id
        bs = self.block_size
        pool = self.block_pool
        state = self._reqs.get(rid)
        num_held = (len(state.block_ids) if state else 0) + len(new_computed_blocks)
        assert not (new_computed_blocks and state and state.block_ids), (
            "hits for a request holding blocks"
        )
        total_computed = min(
            request.num_computed_tokens + num_new_computed_tokens + ext, self.max_model_len
        )
        wm = self._watermark_blocks if apply_watermark else 0
        ref = pool.ref_cnt
        num_evictable_hits = sum(1 for b in new_computed_blocks if ref(b) == 0)
        free = pool.num_free_blocks
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            gate = max(-(-full // bs) - num_held, 0) + num_evictable_hits
            if gate + wm > free:
                return None
        need = min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_blocks = max(-(-need // bs) - num_held, 0) + num_evictable_hits
        if num_blocks + wm > free - reserved_blocks:
            return None

        if self._journal is not None:
            self._remember(rid, state)
        if state is None:
            state = self._reqs[rid] = RequestBlocks([])
        table = state.block_ids
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            table.extend(new_computed_blocks)
            state.num_cached_blocks = len(table)
        if ext:
            num_ext_blocks = -(-total_computed // bs) - len(table)
            if num_ext_blocks > 0:
                table.extend(pool.get_new_blocks(num_ext_blocks))
        num_new = -(-need // bs) - len(table)
        new_blocks = pool.get_new_blocks(num_new) if num_new > 0 else []
        table.extend(new_blocks)
        if self.enable_caching and not delay_cache_blocks:
            num_full = min(total_computed + num_new_tokens, request.num_tokens) // bs
            if num_full > state.num_cached_blocks:
                self._cache(request, state, num_full)
        return new_blocks

    # Caching and freeing ------------------------------------------------------------

    def _cache(self, request: KVRequest, state: RequestBlocks, num_full: int) -> None:
        assert num_full <= len(state.block_ids), (num_full, len(state.block_ids))
        if self._journal is not None:
            self._remember(request.request_id, state)
        pool = self.block_pool
        token_ids = request.all_token_ids if pool.enable_kv_events else None
        pool.cache_full_blocks(
            state.block_ids, request.block_hashes, state.num_cached_blocks, num_full, token_ids
        )
        state.num_cached_blocks = num_full

    def cache_blocks(self, request: KVRequest, num_tokens: int) -> None:
        """Register the request's full blocks covering its first ``num_tokens`` tokens.

        Monotone: blocks already cached for the request are skipped. Needs
        ``request.block_hashes`` to cover those blocks. No-op with caching off.
        """
        if not self.enable_caching:
            return
        state = self._reqs[request.request_id]
        num_full = num_tokens // self.block_size
        if num_full > state.num_cached_blocks:
            self._cache(request, state, num_full)

    def free(self, request: KVRequest) -> None:
        """Release the request's blocks, last block first, and forget its table."""
        state = self._reqs.pop(request.request_id, None)
        if self._journal is not None and state is not None:
            self._remember(request.request_id, state)
        if state is not None and state.block_ids:
            self.block_pool.free_blocks(reversed(state.block_ids))

    def new_step_starts(self) -> None:
        """Per-step hook; nothing to do for full attention."""

    def reset_prefix_cache(self) -> bool:
        """Clear the prefix cache if no block is in use (sets the stats reset flag).

        Returns:
            True on success, False when any request still holds blocks.
        """
        if not self.block_pool.reset_prefix_cache():
            return False
        self._stats.reset = True
        return True

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the given blocks from the prefix cache (e.g. after a failed KV load)."""
        self.block_pool.evict_blocks(block_ids)

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear buffered KV events ([] when events are disabled)."""
        return self.block_pool.take_events()

    # Transactions -------------------------------------------------------------------

    def begin(self) -> None:
        """Journal every change until ``commit()`` or ``rollback()`` (one scheduler step)."""
        self._journal = {}
        self._saved_stats = None
        self.block_pool.begin()

    def commit(self) -> None:
        self._journal = None
        self.block_pool.commit()

    def rollback(self) -> None:
        """Undo every change since ``begin()``: block tables, cached counts, the pool
        (references, free queue, prefix-cache hashes, events) and the statistics."""
        journal = self._journal
        assert journal is not None, "rollback outside a transaction"
        self._journal = None
        self.block_pool.rollback()
        if self._saved_stats is not None:
            self._stats, self.prefix_cache_totals = self._saved_stats
            self._saved_stats = None
        reqs = self._reqs
        for rid, (state, length, num_cached) in journal.items():
            if state is None:
                reqs.pop(rid, None)
            else:
                del state.block_ids[length:]
                state.num_cached_blocks = num_cached
                reqs[rid] = state

    def _remember(self, rid: str, state: RequestBlocks | None) -> None:
        journal = self._journal
        assert journal is not None
        if rid not in journal:
            journal[rid] = (state, len(state.block_ids), state.num_cached_blocks) if state else (None, 0, 0)

    # Statistics ---------------------------------------------------------------------

    def record_prefix_cache_hits(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Record one admitted request's lookup: ``num_tokens`` queried, ``num_hits`` hit."""
        if self._journal is not None and self._saved_stats is None:
            self._saved_stats = (copy.copy(self._stats), copy.copy(self.prefix_cache_totals))
        self._stats.record(num_tokens, num_hits, preempted)
        self.prefix_cache_totals.record(num_tokens, num_hits, preempted)

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Return this step's prefix-cache stats and start new ones (None if caching is off)."""
        if not self.enable_caching:
            return None
        stats = self._stats
        self._stats = PrefixCacheStats()
        return stats

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Cumulative hit rate (hit tokens / queried tokens) since construction."""
        return self.prefix_cache_totals.hit_rate
