"""The ``kv-storage`` plugin: :mod:`schedkit.kv.connectors.storage` with its worker side.

The worker side copies stored prefixes into the paged KV cache before a step's forward
pass, and saves prefixes the step completed after it. It imports torch only when it
moves tensors, so the plugin loads in a torch-free engine too (the simulator), where it
only reports hits.
"""

from __future__ import annotations

import os
from typing import Any

from schedkit.config import cache_dir
from schedkit.hookspecs import hookimpl
from schedkit.kv.connector import KVConnectorRole
from schedkit.kv.connectors.storage import StorageConnector, StorageMetadata


class StorageWorker(StorageConnector):
    """The worker side: moves K and V between the stored files and the paged cache."""

    def __init__(self, role: KVConnectorRole, config: Any, path: str | os.PathLike[str]) -> None:
        super().__init__(role, config, path)
        self._meta = StorageMetadata()
        self._kv_caches: Any = None

    def register_kv_caches(self, kv_caches: Any) -> None:
        self._kv_caches = kv_caches

    def bind_connector_metadata(self, metadata: Any) -> None:
        self._meta = metadata if isinstance(metadata, StorageMetadata) else StorageMetadata()

    def start_load_kv(self, forward_context: Any) -> None:
        """Copy each stored prefix into its request's blocks (from its first block that
        was not a local prefix-cache hit)."""
        if not self._meta.loads:
            return
        from safetensors.torch import load_file

        bs = self.block_size
        for load in self._meta.loads:
            stored = load_file(str(self.path / f"{load.key}.safetensors"))
            blocks = load.block_ids[load.first_block:]
            for i, (k_cache, v_cache) in enumerate(self._kv_caches):
                for cache, name in ((k_cache, "k"), (v_cache, "v")):
                    src = stored[f"{name}.{i}"][load.first_block * bs:load.num_tokens]
                    src = src.view(len(blocks), bs, *src.shape[1:])
                    cache[blocks] = src.to(device=cache.device, dtype=cache.dtype)

    def wait_for_save(self) -> None:
        """Write the prefixes this step completed (after its forward pass)."""
        if not self._meta.saves:
            return
        from safetensors.torch import save_file

        for save in self._meta.saves:
            tensors = {}
            for i, (k_cache, v_cache) in enumerate(self._kv_caches):
                for cache, name in ((k_cache, "k"), (v_cache, "v")):
                    kv = cache[save.block_ids].flatten(0, 1)[:save.num_tokens]
                    tensors[f"{name}.{i}"] = kv.to("cpu").contiguous()
            tmp = self.path / f".{save.key}.{os.getpid()}.tmp"
            save_file(tensors, str(tmp))
            tmp.replace(self.path / f"{save.key}.safetensors")  # readers never see half a file


class KVStorage:
    """The ``kv-storage`` plugin.

    Args:
        path: Folder of stored prefixes, shared by every engine that should reuse them
            (default: ``kv-storage`` in schedkit's cache folder, see
            :func:`schedkit.config.cache_dir`).
    """

    def __init__(self, path: str | None = None) -> None:
        if path is None:
            path = str(cache_dir() / "kv-storage")
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a non-empty folder path, got {path!r}")
        self.path = path

    @hookimpl
    def schedkit_create_kv_connector(self, role: KVConnectorRole, config: Any) -> StorageConnector:
        if role is KVConnectorRole.WORKER:
            return StorageWorker(role, config, self.path)
        return StorageConnector(role, config, self.path)
