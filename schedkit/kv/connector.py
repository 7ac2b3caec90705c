"""KV connector API (two roles, after vLLM's connector v1) and the no-op connector.

A connector moves KV blocks between this engine and somewhere else (host memory, disk,
another engine). One scheduler-side instance lives in the engine-core process; one
worker-side instance lives next to each model runner. Connectors are created through
the ``schedkit_create_kv_connector`` hook. This module imports nothing from core: the
request objects are read duck-typed (``request_id``, ``num_tokens``,
``num_computed_tokens``, ``block_hashes``, ``all_token_ids``).
"""

from __future__ import annotations

import enum
from typing import Any


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class KVConnectorBase:
    """Base class; every method has a do-nothing default so a connector overrides only
    what it needs."""

    def __init__(self, role: KVConnectorRole, config: Any = None) -> None:
        self.role = role
        self.config = config
        self.kv_cache_manager: Any = None

    # Scheduler-side ---------------------------------------------------------------------
    def bind_kv_cache_manager(self, manager: Any) -> None:
        """Engine-core process, once, right after the KV cache manager exists."""
        self.kv_cache_manager = manager

    def on_new_request(self, request: Any) -> None:
        """Engine-core process, once per added request."""

    def get_num_new_matched_tokens(self, request: Any, num_local_hit_tokens: int) -> tuple[int | None, bool]:
        """Tokens this connector can load beyond the local prefix hits.

        Engine-core process; called for a waiting request with no computed tokens each
        time it reaches the head of the queue, so it must be side-effect free.

        Returns:
            ``(num_tokens, load_async)``; ``(None, False)`` asks the scheduler to try
            again next step. Synchronous loads must leave at least one token to compute.
        """
        return 0, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """Engine-core process, after every successful allocation of a waiting request."""

    def request_preempted(self, request: Any, block_ids: list[int], num_computed_tokens: int,
                          save_kv: bool | None) -> None:
        """Engine-core process, once per request preempted in a step that went through,
        just before that step's ``build_connector_meta``. ``block_ids`` were the
        request's blocks (freed now; the step may hand them to other requests, whose
        writes the worker must not let in before it saved them) and
        ``num_computed_tokens`` the leading tokens whose KV they held. ``save_kv`` is the
        policy's wish (``Preemption.save_kv``: keep its KV rather than recompute it), or
        None when it left that to the connector."""

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """Engine-core process, once per schedule(); must not mutate the output."""
        return None

    def update_connector_output(self, kv_connector_output: Any) -> None:
        """Engine-core process, once per update_from_output()."""

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Engine-core process, exactly once per finished request, before its blocks are freed.

        Returns:
            ``(delay_free, kv_transfer_params)``. ``delay_free=True`` keeps the blocks
            until the worker reports the request in ``finished_sending``.
        """
        return False, None

    def has_pending_block_frees(self) -> bool:
        """True while blocks held by the connector will come back soon (no preemption)."""
        return False

    # Worker-side ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Any) -> None:
        """Worker process, once, after the runner allocated its KV cache."""

    def bind_connector_metadata(self, metadata: Any) -> None:
        """Worker process, once per step before the forward pass."""

    def start_load_kv(self, forward_context: Any) -> None:
        """Worker process, once per step: start loading KV for this step's requests."""

    def wait_for_save(self) -> None:
        """Worker process, once per step after the forward pass."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker process: ids whose send / receive completed since the last call."""
        return None, None


class NoOpConnector(KVConnectorBase):
    """The default: finds nothing, stores nothing, delays nothing."""
