"""A KV connector that stores prompt KV in a folder and loads it back: its scheduler
side. The worker side, which moves the tensors, is :mod:`schedkit.runners.paged.kv_storage`.

After vLLM's example "shared storage" connector (docs/scheduler-behaviour.md#storage-connector), with the storage cut into
chunks as LMCache does, so that a prompt reuses the longest stored prefix. A prompt's
tokens are split into chunks of ``chunk_blocks`` KV blocks. Chunk ``i`` is stored in one
file named by a hash chained over chunks ``0..i``, so a file stands for its whole prefix.
Once a step has computed a chunk of a prompt, the worker saves it, unless it is stored
already; the prompt's last token is never part of a chunk. A waiting request then
loads its leading stored chunks instead of computing them, whether they were saved by
this engine or by another one on the same folder: the scheduler side reports those
tokens as external hits (a synchronous load), and the worker side copies them into
the request's blocks before the forward pass.

Files hold K and V per layer as ``[chunk tokens, kv_heads, head_dim]``.

Switch it on in YAML::

    plugins:
      - name: kv-storage
        settings: {path: /tmp/schedkit-kv, chunk_blocks: 16}
"""

from __future__ import annotations

import hashlib
import os
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schedkit.kv.connector import KVConnectorBase, KVConnectorRole


def chunk_keys(token_ids: list[int], chunk_tokens: int) -> list[str]:
    """File stems of the chunks of ``token_ids``, each a sha256 chained over the chunks
    before it (the last token is never in a chunk: a load must leave one to compute)."""
    keys: list[str] = []
    parent = b""
    for end in range(chunk_tokens, len(token_ids), chunk_tokens):
        parent = hashlib.sha256(parent + array("q", token_ids[end - chunk_tokens:end]).tobytes()).digest()
        keys.append(parent.hex())
    return keys


@dataclass(slots=True)
class Transfer:
    """One chunk file to load into, or save from, a request's blocks."""

    key: str
    block_ids: list[int]
    """The request's blocks holding the chunk, in order."""
    first_block: int = 0
    """Load only from this block of the chunk on (the ones before are local hits)."""
    req_id: str = ""
    """The request whose blocks these are."""


@dataclass(slots=True)
class StorageMetadata:
    """What the worker side does in one step."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


class StorageConnector(KVConnectorBase):
    """Args:
        role: Scheduler or worker side.
        config: The cache config (its ``block_size``).
        path: The folder of stored chunks (created if missing).
        chunk_blocks: KV blocks per stored chunk.
    """

    def __init__(self, role: KVConnectorRole, config: Any, path: str | os.PathLike[str],
                 chunk_blocks: int = 16) -> None:
        super().__init__(role, config)
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.block_size: int = config.block_size
        self.chunk_blocks = chunk_blocks
        self.chunk_tokens = chunk_blocks * self.block_size
        self._keys: dict[str, list[str]] = {}
        """Request id -> the keys of its prompt's chunks."""
        self._to_load: dict[str, list[Transfer]] = {}
        self._matched: dict[str, int] = {}
        """Request id -> the stored tokens its last lookup found."""
        self._stored: set[str] = set()
        """Keys whose file exists (the folder is checked for the others)."""
        self._saving: set[str] = set()
        """Keys a step was told to save (not loaded until their file exists)."""

    def file(self, key: str) -> Path:
        return self.path / f"{key}.safetensors"

    def _is_stored(self, key: str) -> bool:
        if key in self._stored:
            return True
        if self.file(key).is_file():
            self._stored.add(key)
            return True
        return False

    def _num_stored_chunks(self, keys: list[str]) -> int:
        n = 0
        while n < len(keys) and self._is_stored(keys[n]):
            n += 1
        return n

    def _chunk_blocks(self, rid: str, chunk: int) -> list[int]:
        cb = self.chunk_blocks
        return list(self.kv_cache_manager.get_block_ids(rid)[chunk * cb:(chunk + 1) * cb])

    # -- scheduler side --------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        self._keys[request.request_id] = chunk_keys(list(request.prompt_token_ids), self.chunk_tokens)

    def get_num_new_matched_tokens(self, request: Any, num_local_hit_tokens: int) -> tuple[int | None, bool]:
        keys = self._keys.get(request.request_id)
        if not keys:
            return 0, False
        n = self._num_stored_chunks(keys) * self.chunk_tokens
        self._matched[request.request_id] = n
        return (n - num_local_hit_tokens, False) if n > num_local_hit_tokens else (0, False)

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        rid = request.request_id
        keys = self._keys[rid]
        local = self._matched[rid] - num_external_tokens
        cb, ct, bs = self.chunk_blocks, self.chunk_tokens, self.block_size
        loads = []
        for chunk in range(local // ct, (local + num_external_tokens) // ct):
            first = max(local - chunk * ct, 0) // bs
            loads.append(Transfer(keys[chunk], list(block_ids[chunk * cb:(chunk + 1) * cb]), first, rid))
        self._to_load[rid] = loads

    def build_connector_meta(self, scheduler_output: Any) -> StorageMetadata:
        meta = StorageMetadata()
        for loads in self._to_load.values():  # allocated this step (admitted, or a load started)
            meta.loads.extend(loads)
        self._to_load.clear()
        cached = scheduler_output.scheduled_cached_reqs
        before = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for new in scheduler_output.scheduled_new_reqs:
            before[new.req_id] = new.num_computed_tokens
        ct = self.chunk_tokens
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            keys = self._keys.get(rid)
            if not keys:
                continue
            # chunks whose last token this step computes
            for chunk in range(before[rid] // ct, min((before[rid] + n) // ct, len(keys))):
                if keys[chunk] not in self._saving and not self._is_stored(keys[chunk]):
                    self._saving.add(keys[chunk])
                    meta.saves.append(Transfer(keys[chunk], self._chunk_blocks(rid, chunk), req_id=rid))
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._keys.pop(rid, None)
        self._to_load.pop(rid, None)
        self._matched.pop(rid, None)
        return False, None
