"""The ``transfer`` KV connector's scheduler side: a request's prompt KV handed from the
engine that prefilled it to the engine that decodes it (prefill/decode disaggregation,
docs/cluster-simulation.md#disaggregation).

Sending engine (the prefill replica): a request marked with :meth:`send_when_finished`
keeps the full blocks of its prompt when it finishes. The connector takes a reference
on them, so that they are neither reused nor evicted while the KV is on its way, and
hands their ids and hashes out in the request's ``kv_transfer_params``;
:meth:`TransferConnector.sent` drops the reference once the receiver has them (the
blocks stay in the sender's prefix cache).

Receiving engine (the decode replica): :meth:`TransferConnector.receive` records that
a request's prompt KV has arrived, up to a token count. When the scheduler looks the
request up, the connector answers the tokens past its local prefix-cache hit as
external tokens (a synchronous load: the engine computes only the rest of the prompt,
at least its last token, and then decodes), once: a request that is preempted later
finds what is left of them in the local prefix cache, like any other.

The cluster simulation drives both sides and charges the transfer's time; an engine
with a worker side would move the bytes between the two ``kv_transfer_params``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schedkit.kv.connector import KVConnectorBase, KVConnectorRole


@dataclass(slots=True, frozen=True)
class KVReceipt:
    """A request's prompt KV that reached this engine: tokens ``[first_token, end_token)``
    were sent; the ones before ``first_token`` this engine's prefix cache held already."""

    first_token: int
    end_token: int


class TransferConnector(KVConnectorBase):
    """Args:
        role: Scheduler side (the only one this connector has).
        config: The cache config (its ``block_size``).

    Attributes:
        num_tokens_received: Tokens the scheduler took as external (not computed) so far.
    """

    def __init__(self, role: KVConnectorRole, config: Any) -> None:
        super().__init__(role, config)
        self.block_size: int = config.block_size
        self._to_send: set[str] = set()
        self._held: dict[str, list[int]] = {}
        """Request id -> the blocks kept for its send (one reference each)."""
        self._received: dict[str, KVReceipt] = {}
        self.num_tokens_received = 0

    # -- sending (the prefill engine) --------------------------------------------------------
    def send_when_finished(self, request_id: str) -> None:
        """Keep the request's prompt blocks when it finishes, for :meth:`sent` to release.
        Engine-core process; call before the request finishes."""
        self._to_send.add(request_id)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._received.pop(rid, None)
        if rid not in self._to_send:
            return False, None
        self._to_send.discard(rid)
        num_full = min(request.num_prompt_tokens, request.num_computed_tokens) // self.block_size
        blocks = list(block_ids[:num_full])
        self.kv_cache_manager.block_pool.touch(blocks)
        self._held[rid] = blocks
        return False, {"block_ids": blocks, "block_hashes": list(request.block_hashes[:num_full]),
                       "num_tokens": num_full * self.block_size}

    def sent(self, request_id: str) -> None:
        """The receiver has the request's KV: release the blocks kept for it (they return
        to the free queue, still cached). Engine-core process, between steps; unknown ids
        are ignored."""
        blocks = self._held.pop(request_id, None)
        if blocks:
            self.kv_cache_manager.block_pool.free_blocks(reversed(blocks))

    def has_pending_block_frees(self) -> bool:
        return bool(self._held)

    @property
    def num_held_blocks(self) -> int:
        """Blocks kept for sends not yet done."""
        return sum(len(b) for b in self._held.values())

    # -- receiving (the decode engine) -------------------------------------------------------
    def receive(self, request_id: str, receipt: KVReceipt) -> None:
        """The request's prompt KV arrived (before the request is added here). Engine-core
        process."""
        self._received[request_id] = receipt

    def get_num_new_matched_tokens(self, request: Any, num_local_hit_tokens: int) -> tuple[int | None, bool]:
        receipt = self._received.get(request.request_id)
        if receipt is None or num_local_hit_tokens < receipt.first_token:
            # nothing arrived, or the blocks it held when the transfer began were evicted
            # since: what arrived does not join up with what is cached, recompute it
            return 0, False
        end = min(receipt.end_token, request.num_tokens - 1)  # the last token gives the logits
        return max(end - num_local_hit_tokens, 0), False

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        if self._received.pop(request.request_id, None) is not None:
            self.num_tokens_received += num_external_tokens
