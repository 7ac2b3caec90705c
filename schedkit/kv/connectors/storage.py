"""A KV connector that stores prompt KV in a folder and loads it back (spec 5.6):
its scheduler side. The worker side, which moves the tensors, is
:mod:`schedkit.runners.paged.kv_storage`.

After vLLM's example "shared storage" connector. When a request's prompt has been
computed, the worker side saves the KV of its block-aligned prefix (all but the last
prompt token, rounded down to whole blocks) to one file named by a hash of those tokens.
A later request whose own prefix (taken the same way) is a stored one, in this engine or
in another one pointed at the same folder, loads it instead of computing it: the
scheduler side reports those tokens as external hits (a synchronous load) and the worker
side copies them into the request's blocks before the forward pass.

Files hold K and V per layer as ``[tokens, kv_heads, head_dim]``, so they do not depend
on the block size.

Switch it on in YAML::

    plugins:
      - name: kv-storage
        settings: {path: /tmp/schedkit-kv}
"""

from __future__ import annotations

import hashlib
import os
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schedkit.kv.connector import KVConnectorBase, KVConnectorRole


def prefix_key(token_ids: list[int]) -> str:
    """File stem of a stored prefix: sha256 of its token ids."""
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()


@dataclass(slots=True)
class Transfer:
    """One file to load into, or save from, a request's blocks."""

    key: str
    block_ids: list[int]
    """The request's blocks covering the prefix, in order."""
    num_tokens: int
    """Tokens of the prefix (a multiple of the block size)."""
    first_block: int = 0
    """Load only from this block on (the ones before are local prefix-cache hits)."""


@dataclass(slots=True)
class StorageMetadata:
    """What the worker side does in one step."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


class StorageConnector(KVConnectorBase):
    """Args:
        role: Scheduler or worker side.
        config: The cache config (its ``block_size``).
        path: The folder of stored prefixes (created if missing).
    """

    def __init__(self, role: KVConnectorRole, config: Any, path: str | os.PathLike[str]) -> None:
        super().__init__(role, config)
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.block_size: int = config.block_size
        # scheduler side
        self._prompts: dict[str, list[int]] = {}
        self._to_load: dict[str, Transfer] = {}
        self._saved: set[str] = set()
        """Keys stored or being stored (the folder is also checked)."""
        self._saving: dict[str, str] = {}
        """Request id -> key whose save is scheduled once its prefix is computed."""

    # -- scheduler side --------------------------------------------------------------------
    def _prefix_len(self, num_prompt_tokens: int) -> int:
        return (num_prompt_tokens - 1) // self.block_size * self.block_size

    def _is_stored(self, key: str) -> bool:
        if key in self._saved:
            return True
        if (self.path / f"{key}.safetensors").is_file():
            self._saved.add(key)
            return True
        return False

    def on_new_request(self, request: Any) -> None:
        self._prompts[request.request_id] = list(request.prompt_token_ids)

    def get_num_new_matched_tokens(self, request: Any, num_local_hit_tokens: int) -> tuple[int | None, bool]:
        prompt = self._prompts.get(request.request_id)
        if prompt is None:
            return 0, False
        n = self._prefix_len(len(prompt))
        if n <= num_local_hit_tokens or not self._is_stored(prefix_key(prompt[:n])):
            return 0, False
        return n - num_local_hit_tokens, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        rid = request.request_id
        if num_external_tokens <= 0:
            return
        prompt = self._prompts[rid]
        n = self._prefix_len(len(prompt))
        local = n - num_external_tokens
        self._to_load[rid] = Transfer(prefix_key(prompt[:n]), list(block_ids[:n // self.block_size]), n,
                                      first_block=local // self.block_size)

    def build_connector_meta(self, scheduler_output: Any) -> StorageMetadata:
        meta = StorageMetadata()
        to_load = self._to_load
        if to_load:
            for rid in scheduler_output.num_scheduled_tokens:
                load = to_load.pop(rid, None)
                if load is not None:
                    meta.loads.append(load)
        cached = scheduler_output.scheduled_cached_reqs
        before = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for new in scheduler_output.scheduled_new_reqs:
            before[new.req_id] = new.num_computed_tokens
        for rid, n_sched in scheduler_output.num_scheduled_tokens.items():
            prompt = self._prompts.get(rid)
            if prompt is None:
                continue
            n = self._prefix_len(len(prompt))
            if n == 0 or before[rid] >= n or before[rid] + n_sched < n:
                continue  # the prefix is not completed by this step
            key = prefix_key(prompt[:n])
            if self._is_stored(key):
                continue
            self._saved.add(key)
            blocks = list(self.kv_cache_manager.get_block_ids(rid))[:n // self.block_size]
            meta.saves.append(Transfer(key, blocks, n))
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._prompts.pop(rid, None)
        self._to_load.pop(rid, None)
        return False, None
