"""The ``cpu-offload`` plugin: :mod:`schedkit.kv.connectors.offload` with its worker side.

The worker keeps each saved block as one host tensor per layer holding K and V
(``[2, block_size, kv_heads, head_dim]``). Before a step's forward pass it saves the
blocks the scheduler names (a preempted request's, which this step may give to other
requests), then loads stored blocks into the blocks of the requests resuming, then
drops what the scheduler evicted from the store. It imports torch only when it moves
tensors, so the plugin loads in a torch-free engine too, where only the scheduler side
runs.
"""

from __future__ import annotations

from typing import Any

from schedkit.hookspecs import hookimpl
from schedkit.kv.connector import KVConnectorRole
from schedkit.kv.connectors.offload import CPUOffloadConnector, OffloadMetadata


class CPUOffloadWorker(CPUOffloadConnector):
    """The worker side: moves blocks between the paged cache and host memory."""

    def __init__(self, role: KVConnectorRole, config: Any, max_blocks: int = 4096,
                 save_on_preemption: bool = True, save_on_eviction: bool = False) -> None:
        super().__init__(role, config, max_blocks, save_on_preemption, save_on_eviction)
        self._meta = OffloadMetadata()
        self._kv_caches: Any = None
        self.host: dict[bytes, list[Any]] = {}
        """Hash -> per layer, K and V of the block stacked (on the host)."""

    def register_kv_caches(self, kv_caches: Any) -> None:
        self._kv_caches = kv_caches

    def bind_connector_metadata(self, metadata: Any) -> None:
        self._meta = metadata if isinstance(metadata, OffloadMetadata) else OffloadMetadata()

    def start_load_kv(self, forward_context: Any) -> None:
        meta = self._meta
        if not (meta.saves or meta.loads or meta.drops):
            return
        import torch

        caches = self._kv_caches
        for block_id, h in meta.saves:
            self.host[h] = [torch.stack((k[block_id], v[block_id])).to("cpu", copy=True)
                            for k, v in caches]
        for h, block_id in meta.loads:
            for (k, v), kv in zip(caches, self.host[h], strict=True):
                k[block_id].copy_(kv[0], non_blocking=True)
                v[block_id].copy_(kv[1], non_blocking=True)
        for h in meta.drops:
            self.host.pop(h, None)


class CPUOffload:
    """The ``cpu-offload`` plugin (preemption by swap to host memory).

    Args:
        max_blocks: Most KV blocks kept in host memory (>= 1, default 4096).
        save_on_preemption: Save a preempted request's KV unless its policy decides
            otherwise per victim (``Preemption.save_kv``); default true.
        save_on_eviction: Save a cached block the prefix cache evicts to reuse it, so a
            later request with that prefix loads it (default false: evicted blocks
            can push the victims' out of a small store; give ``max_blocks`` room).
    """

    def __init__(self, max_blocks: int = 4096, save_on_preemption: bool = True,
                 save_on_eviction: bool = False) -> None:
        if not isinstance(max_blocks, int) or isinstance(max_blocks, bool) or max_blocks < 1:
            raise ValueError(f"max_blocks must be an integer >= 1, got {max_blocks!r}")
        if not isinstance(save_on_preemption, bool):
            raise ValueError(f"save_on_preemption must be true or false, got {save_on_preemption!r}")
        if not isinstance(save_on_eviction, bool):
            raise ValueError(f"save_on_eviction must be true or false, got {save_on_eviction!r}")
        self.max_blocks = max_blocks
        self.save_on_preemption = save_on_preemption
        self.save_on_eviction = save_on_eviction

    @hookimpl
    def schedkit_create_kv_connector(self, role: KVConnectorRole, config: Any) -> CPUOffloadConnector:
        cls = CPUOffloadWorker if role is KVConnectorRole.WORKER else CPUOffloadConnector
        return cls(role, config, self.max_blocks, self.save_on_preemption, self.save_on_eviction)
