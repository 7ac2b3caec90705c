"""The ``kv-storage`` plugin: :mod:`schedkit.kv.connectors.storage` with its worker side.

The worker side copies stored chunks into the paged KV cache before a step's forward
pass, and saves the chunks the step completed after it: it gathers their blocks on the
device and starts the copy to pinned host memory, and a background thread writes the
file once the copy is done, so a save does not stall the step (nor, under async
scheduling, the overlap of host and device work). It imports torch only when it
moves tensors, so the plugin loads in a torch-free engine too (the simulator), where it
only reports hits.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from schedkit.config import cache_dir
from schedkit.hookspecs import hookimpl
from schedkit.kv.connector import KVConnectorRole
from schedkit.kv.connectors.storage import StorageConnector, StorageMetadata

log = logging.getLogger("schedkit.kv_storage")


class StorageWorker(StorageConnector):
    """The worker side: moves K and V between the stored files and the paged cache."""

    def __init__(self, role: KVConnectorRole, config: Any, path: str | os.PathLike[str],
                 chunk_blocks: int = 16) -> None:
        super().__init__(role, config, path, chunk_blocks)
        self._meta = StorageMetadata()
        self._kv_caches: Any = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-storage")
        self._writes: list[Future[None]] = []

    def register_kv_caches(self, kv_caches: Any) -> None:
        self._kv_caches = kv_caches

    def bind_connector_metadata(self, metadata: Any) -> None:
        self._meta = metadata if isinstance(metadata, StorageMetadata) else StorageMetadata()

    def start_load_kv(self, forward_context: Any) -> None:
        """Copy each stored chunk into its request's blocks (from its first block that
        was not a local prefix-cache hit)."""
        if not self._meta.loads:
            return
        from safetensors.torch import load_file

        bs = self.block_size
        for load in self._meta.loads:
            stored = load_file(str(self.file(load.key)))
            blocks = load.block_ids[load.first_block:]
            for i, (k_cache, v_cache) in enumerate(self._kv_caches):
                for cache, name in ((k_cache, "k"), (v_cache, "v")):
                    src = stored[f"{name}.{i}"][load.first_block * bs:]
                    src = src.view(len(blocks), bs, *src.shape[1:])
                    cache[blocks] = src.to(device=cache.device, dtype=cache.dtype)

    def wait_for_save(self) -> None:
        """Start saving the chunks this step completed (after its forward pass was
        launched: the gathers are ordered after it on the device)."""
        if not self._meta.saves:
            return
        import torch

        for save in self._meta.saves:
            tensors = {}
            for i, (k_cache, v_cache) in enumerate(self._kv_caches):
                for cache, name in ((k_cache, "k"), (v_cache, "v")):
                    chunk = cache[save.block_ids].flatten(0, 1)
                    tensors[f"{name}.{i}"] = chunk.to("cpu", non_blocking=True) if chunk.is_cuda else chunk
            copied = None
            if any(t.is_cuda for t in self._kv_caches[0]):
                copied = torch.cuda.Event()
                copied.record()
            self._writes = [w for w in self._writes if not w.done()]
            write = self._writer.submit(self._write, save.key, tensors, copied)
            write.add_done_callback(_log_failure)
            self._writes.append(write)

    def _write(self, key: str, tensors: dict[str, Any], copied: Any) -> None:
        from safetensors.torch import save_file

        if copied is not None:
            copied.synchronize()
        tmp = self.path / f".{key}.{os.getpid()}.tmp"
        save_file(tensors, str(tmp))
        tmp.replace(self.file(key))  # readers never see half a file

    def flush(self) -> None:
        """Wait until every save started so far is on disk (raises a failed write)."""
        for write in self._writes:
            write.result()
        self._writes = []


def _log_failure(write: Future[None]) -> None:
    if write.exception() is not None:  # the chunk is then never loaded: it has no file
        log.error("kv-storage: saving a chunk failed: %s", write.exception())


class KVStorage:
    """The ``kv-storage`` plugin.

    Args:
        path: Folder of stored chunks, shared by every engine that should reuse them
            (default: ``kv-storage`` in schedkit's cache folder, see
            :func:`schedkit.config.cache_dir`).
        chunk_blocks: KV blocks per stored chunk: the granularity of reuse.
    """

    def __init__(self, path: str | None = None, chunk_blocks: int = 16) -> None:
        if path is None:
            path = str(cache_dir() / "kv-storage")
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a non-empty folder path, got {path!r}")
        if not isinstance(chunk_blocks, int) or isinstance(chunk_blocks, bool) or chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be an integer >= 1, got {chunk_blocks!r}")
        self.path = path
        self.chunk_blocks = chunk_blocks

    @hookimpl
    def schedkit_create_kv_connector(self, role: KVConnectorRole, config: Any) -> StorageConnector:
        cls = StorageWorker if role is KVConnectorRole.WORKER else StorageConnector
        return cls(role, config, self.path, self.chunk_blocks)
