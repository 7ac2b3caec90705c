"""The ``kv-transfer`` plugin: :mod:`schedkit.kv.connectors.transfer` with its worker side,
which reads a finished prefill's blocks out of the paged cache and writes received ones in.

A sent request's KV travels as one payload: the blocks' K and V for every layer, as
``[layers, 2, blocks, block_size, kv_heads, head_dim]`` in the cache's dtype, flattened
to bytes (:func:`pack_blocks`), so it crosses a ZMQ socket as it is. The receiving
worker keeps it on the host until the step that admits its request, then copies each
block into the block the scheduler gave it (before the forward pass) and forgets it.
The worker imports torch only when it moves tensors, so the plugin loads in a
torch-free engine too, where only the scheduler side runs and a payload carries no
bytes.

A disaggregated cluster (``replicas.roles``) switches the plugin on in every replica by
itself; it has no settings.
"""

from __future__ import annotations

import warnings
from typing import Any

from schedkit.errors import RequestError
from schedkit.hookspecs import hookimpl
from schedkit.kv.connector import KVConnectorRole
from schedkit.kv.connectors.transfer import TransferConnector, TransferMetadata


def pack_blocks(kv_caches: Any, block_ids: list[int]) -> dict[str, Any]:
    """The payload of ``block_ids``: ``num_blocks``, and (with a cache) the tensor's
    ``shape``, ``dtype`` name and raw ``data`` (a memoryview of a new host tensor; it
    arrives as bytes)."""
    if not kv_caches or not block_ids:
        return {"num_blocks": len(block_ids)}
    import torch

    k0 = kv_caches[0][0]
    idx = torch.tensor(block_ids, dtype=torch.long, device=k0.device)
    blocks = torch.empty((len(kv_caches), 2, len(block_ids), *k0.shape[1:]), dtype=k0.dtype)
    for layer, kv in enumerate(kv_caches):
        for i, cache in enumerate(kv):
            if cache.device.type == "cpu":  # gathered straight into the payload
                torch.index_select(cache, 0, idx, out=blocks[layer, i])
            else:
                blocks[layer, i].copy_(cache.index_select(0, idx))
    # a view of the tensor's bytes: the socket's encoder copies them once, nothing before
    data = blocks.view(-1).view(torch.uint8).numpy().data
    return {"num_blocks": len(block_ids), "shape": list(blocks.shape), "dtype": str(blocks.dtype).removeprefix("torch."),
            "data": data}


def unpack_blocks(payload: dict[str, Any], kv_caches: Any, request_id: str) -> Any:
    """The tensor of a payload, checked against this worker's cache.

    Raises:
        RequestError: The payload's layout, dtype or size does not fit this cache.
    """
    import torch

    k0 = kv_caches[0][0]
    want = [len(kv_caches), 2, payload.get("num_blocks"), *k0.shape[1:]]
    shape, dtype = payload.get("shape"), payload.get("dtype")
    if shape != want or dtype != str(k0.dtype).removeprefix("torch."):
        raise RequestError(f"request {request_id!r}: received KV of shape {shape} and dtype {dtype}, "
                           f"but this engine's cache takes {want} of {k0.dtype} (the replicas must "
                           "run the same model, dtype and block size)", request_id=request_id)
    data = payload.get("data")
    numel = 1
    for d in want:
        numel *= d
    size = memoryview(data).nbytes if isinstance(data, bytes | bytearray | memoryview) else None
    if size != numel * k0.element_size():
        raise RequestError(f"request {request_id!r}: received KV has "
                           f"{type(data).__name__ if size is None else size} bytes, "
                           f"expected {numel * k0.element_size()}", request_id=request_id)
    with warnings.catch_warnings():  # read-only bytes: the tensor is only copied from
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(k0.dtype).view(want)


class TransferWorker(TransferConnector):
    """The worker side: reads sent blocks out of the paged cache, keeps received ones on
    the host and copies them into their blocks when their request is admitted."""

    def __init__(self, role: KVConnectorRole, config: Any) -> None:
        super().__init__(role, config)
        self._kv_caches: Any = None
        self._step_meta = TransferMetadata()
        self.staged: dict[str, Any] = {}
        """Request id -> its received blocks (a host tensor), until its request is admitted."""

    def register_kv_caches(self, kv_caches: Any) -> None:
        self._kv_caches = kv_caches

    def export_blocks(self, block_ids: list[int]) -> dict[str, Any]:
        """The payload of ``block_ids`` (engine-core process, between steps)."""
        return pack_blocks(self._kv_caches, block_ids)

    def stage(self, request_id: str, payload: dict[str, Any]) -> None:
        """Keep a received payload for the request until it is admitted.

        Raises:
            RequestError: The payload does not fit this engine's cache.
        """
        if self._kv_caches and payload.get("num_blocks"):
            self.staged[request_id] = unpack_blocks(payload, self._kv_caches, request_id)

    def drop(self, request_id: str) -> None:
        self.staged.pop(request_id, None)

    def bind_connector_metadata(self, metadata: Any) -> None:
        self._step_meta = metadata if isinstance(metadata, TransferMetadata) else TransferMetadata()

    def start_load_kv(self, forward_context: Any) -> None:
        meta = self._step_meta
        for rid in meta.drops:
            self.staged.pop(rid, None)
        if not meta.loads:
            return
        import torch

        caches = self._kv_caches
        device = caches[0][0].device
        for rid, pairs in meta.loads:
            blocks = self.staged.pop(rid, None)
            if blocks is None:  # a torch-free payload, or a bug: the engine recomputes nothing
                raise AssertionError(f"request {rid!r}: admitted with received KV that never arrived")
            dst = torch.tensor([b for b, _ in pairs], dtype=torch.long, device=device)
            src = torch.tensor([i for _, i in pairs], dtype=torch.long)
            chosen = blocks.index_select(2, src).to(device, non_blocking=True)
            for layer, (k, v) in enumerate(caches):
                k.index_copy_(0, dst, chosen[layer, 0])
                v.index_copy_(0, dst, chosen[layer, 1])
        self._step_meta = TransferMetadata()


class KVTransfer:
    """The ``kv-transfer`` plugin (prefill/decode disaggregation between engines). It
    is ``trylast``, so a connector plugin the config switches on wins, and a
    disaggregated cluster then refuses to start rather than run without the transfer."""

    @hookimpl(trylast=True)
    def schedkit_create_kv_connector(self, role: KVConnectorRole, config: Any) -> TransferConnector:
        cls = TransferWorker if role is KVConnectorRole.WORKER else TransferConnector
        return cls(role, config)
