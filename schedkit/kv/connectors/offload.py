"""The ``cpu-offload`` KV connector's scheduler side: KV blocks kept in host memory,
keyed by their prefix-cache hash, so that a preempted request resumes by loading its
KV instead of recomputing it (preemption by swap). The worker side, which moves the
tensors, is :mod:`schedkit.runners.paged.kv_offload`.

When a request is preempted (for KV blocks, or voluntarily by a policy), the full blocks
it had computed are saved unless their hash is stored already, and so is every cached
block that the prefix cache evicts to reuse it (with ``save_on_eviction``, off by
default: in a small store they push the victims' blocks out); the saves are
part of the step's connector metadata, and the worker copies those blocks to host
memory before the step's forward pass can overwrite them. Any waiting request, the victim or another one
with the same prefix, then finds the leading stored blocks that the local prefix cache
no longer has and loads them synchronously (they count as computed: they are not
recomputed, and ``num_recomputed_tokens`` says so). The store holds at most
``max_blocks`` blocks and drops the least recently used. It needs
``cache.enable_prefix_caching`` (the hashes are the keys).

Which preemptions save: ``save_on_preemption`` (default true), unless a policy decides
per victim with ``Preemption.save_kv``. On runners without a KV cache (fake, simulated)
only this side runs: hits are accounted, nothing is moved, and the simulator charges no
transfer time for a load.

Switch it on in YAML::

    cache: {enable_prefix_caching: true}
    plugins:
      - name: cpu-offload
        settings: {max_blocks: 8192}
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from schedkit.kv.connector import KVConnectorBase, KVConnectorRole


@dataclass(slots=True)
class OffloadMetadata:
    """What the worker does in one step, in this order: saves, loads, drops."""

    saves: list[tuple[int, bytes]] = field(default_factory=list)
    """(block id, hash): copy the block to host memory under the hash."""
    loads: list[tuple[bytes, int]] = field(default_factory=list)
    """(hash, block id): copy the stored block into the paged cache."""
    drops: list[bytes] = field(default_factory=list)
    """Hashes to forget (least recently used, beyond ``max_blocks``)."""


class CPUOffloadConnector(KVConnectorBase):
    """Args:
        role: Scheduler or worker side.
        config: The cache config (``block_size``, ``enable_prefix_caching``).
        max_blocks: Most blocks kept in host memory.
        save_on_preemption: Save a victim's KV unless its policy said otherwise.
        save_on_eviction: Save a cached block that the prefix cache evicts to reuse it.

    Raises:
        ValueError: Prefix caching is off, or a setting is out of range.
    """

    def __init__(self, role: KVConnectorRole, config: Any, max_blocks: int = 4096,
                 save_on_preemption: bool = True, save_on_eviction: bool = False) -> None:
        super().__init__(role, config)
        if not getattr(config, "enable_prefix_caching", False):
            raise ValueError("cpu-offload keys blocks by their prefix-cache hash: it needs "
                             "cache.enable_prefix_caching: true")
        self.block_size: int = config.block_size
        self.max_blocks = max_blocks
        self.save_on_preemption = save_on_preemption
        self.save_on_eviction = save_on_eviction
        self._stored: OrderedDict[bytes, None] = OrderedDict()
        """Hashes stored (or saved by a step not yet run), least recently used first."""
        self._meta = OffloadMetadata()
        self._loads: dict[tuple[str, int], tuple[bytes, int]] = {}
        """(request id, block index) -> (hash, block id) to load, since the last step."""
        self._first_ext: dict[str, int] = {}
        """Request id -> its first block beyond the local hits, from its last lookup."""
        self.num_saved_blocks = 0
        self.num_loaded_blocks = 0

    @property
    def num_stored_blocks(self) -> int:
        return len(self._stored)

    # -- scheduler side --------------------------------------------------------------------
    def bind_kv_cache_manager(self, manager: Any) -> None:
        super().bind_kv_cache_manager(manager)
        if self.save_on_eviction:
            manager.block_pool.record_evictions = True

    def _save(self, block_id: int, h: bytes) -> None:
        stored = self._stored
        if h in stored:
            stored.move_to_end(h)
            return
        stored[h] = None
        self._meta.saves.append((block_id, h))
        self.num_saved_blocks += 1

    def request_preempted(self, request: Any, block_ids: list[int], num_computed_tokens: int,
                          save_kv: bool | None) -> None:
        if not (self.save_on_preemption if save_kv is None else save_kv):
            return
        hashes = request.block_hashes
        for i in range(min(len(hashes), len(block_ids), num_computed_tokens // self.block_size)):
            self._save(block_ids[i], hashes[i])
        self._trim()

    def _trim(self) -> None:
        stored, drops = self._stored, self._meta.drops
        while len(stored) > self.max_blocks:
            h, _ = stored.popitem(last=False)
            drops.append(h)

    def get_num_new_matched_tokens(self, request: Any, num_local_hit_tokens: int) -> tuple[int | None, bool]:
        hashes, stored, bs = request.block_hashes, self._stored, self.block_size
        first = num_local_hit_tokens // bs
        last = min(len(hashes), (request.num_tokens - 1) // bs)  # leave a token to compute
        n = 0
        while first + n < last and hashes[first + n] in stored:
            n += 1
        self._first_ext[request.request_id] = first
        return n * bs, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        rid = request.request_id
        first = self._first_ext.pop(rid)
        hashes, stored = request.block_hashes, self._stored
        for i in range(first, first + num_external_tokens // self.block_size):
            stored.move_to_end(hashes[i])  # most recently used: not dropped before it loads
            self._loads[(rid, i)] = (hashes[i], block_ids[i])

    def build_connector_meta(self, scheduler_output: Any) -> OffloadMetadata:
        if self.save_on_eviction and self.kv_cache_manager is not None:  # evicted by this step
            for block_id, h in self.kv_cache_manager.block_pool.take_evicted():
                self._save(block_id, h)
            self._trim()
        meta, self._meta = self._meta, OffloadMetadata()
        # A load is sent only if its block still is the request's (a step that was
        # undone after the allocation gave the blocks back; it allocates again).
        table: dict[str, list[int]] = {}
        for (rid, i), (h, block_id) in self._loads.items():
            ids = table.get(rid)
            if ids is None:
                ids = table[rid] = self.kv_cache_manager.get_block_ids(rid)
            if i < len(ids) and ids[i] == block_id:
                meta.loads.append((h, block_id))
        self._loads.clear()
        self.num_loaded_blocks += len(meta.loads)
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._first_ext.pop(request.request_id, None)
        return False, None
