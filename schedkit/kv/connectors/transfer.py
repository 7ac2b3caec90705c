"""The ``transfer`` KV connector's scheduler side: a request's prompt KV handed from the
engine that prefilled it to the engine that decodes it (prefill/decode disaggregation,
docs/cluster-simulation.md#disaggregation).

Sending engine (the prefill replica): a request marked with :meth:`send_when_finished`
keeps the full blocks of its prompt when it finishes. The connector takes a reference
on them, so that they are neither reused nor evicted while the KV is on its way, and
hands their ids and hashes out in the request's ``kv_transfer_params``;
:meth:`TransferConnector.sent` drops the reference once the receiver has them (the
blocks stay in the sender's prefix cache).

Receiving engine (the decode replica): :meth:`TransferConnector.reserve` first holds
room for the request's blocks (or answers that there is none yet: the sender keeps its
blocks and waits, which is the backpressure), then :meth:`TransferConnector.receive`
records that its prompt KV has arrived, up to a token count. When the scheduler looks
the request up, the connector answers the tokens past its local prefix-cache hit as
external tokens (a synchronous load: the engine computes only the rest of the prompt,
at least its last token, and then decodes), once: a request that is preempted later
finds what is left of them in the local prefix cache, like any other. The step that
admits it carries, in its :class:`TransferMetadata`, which received block goes into
which of the request's blocks; the worker side copies them before the forward pass.

The cluster simulation drives the scheduler side of both engines and charges the
transfer's time; real replicas move the bytes through their front end
(:mod:`schedkit.engine.kv_handoff`, :mod:`schedkit.cluster.handoff`) and the paged
runner's worker side (:mod:`schedkit.runners.paged.kv_transfer`) reads and writes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from schedkit.kv.connector import KVConnectorBase, KVConnectorRole


@dataclass(slots=True, frozen=True)
class KVReceipt:
    """A request's prompt KV that reached this engine: tokens ``[first_token, end_token)``
    were sent; the ones before ``first_token`` this engine's prefix cache held already."""

    first_token: int
    end_token: int


@dataclass(slots=True)
class TransferMetadata:
    """What the worker side does in one step, before the forward pass."""

    loads: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)
    """(request id, [(block id, index of the received block)]): copy received blocks
    into the request's blocks, then forget them."""
    drops: list[str] = field(default_factory=list)
    """Requests whose received KV is not used (they computed their prompt instead, or
    ended first): forget it."""


class TransferConnector(KVConnectorBase):
    """Args:
        role: Scheduler or worker side (the worker side is the paged runner's subclass).
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
        self._reserved: dict[str, int] = {}
        """Request id -> blocks of room held for it until it is admitted."""
        self._hits: dict[str, int] = {}
        """Request id -> its local prefix-cache hit (tokens) at its last lookup."""
        self._meta = TransferMetadata()
        self.num_tokens_received = 0

    # -- sending (the prefill engine) --------------------------------------------------------
    def send_when_finished(self, request_id: str) -> None:
        """Keep the full blocks of the request's computed tokens (a finished prefill: its
        prompt's) when it finishes, for :meth:`sent` to release. Engine-core process;
        call before the request finishes."""
        self._to_send.add(request_id)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self.cancel(rid)
        if rid not in self._to_send:
            return False, None
        self._to_send.discard(rid)
        self.sent(rid)  # a release still on its way for an earlier request of this id
        num_full = request.num_computed_tokens // self.block_size
        blocks = list(block_ids[:num_full])
        self.kv_cache_manager.block_pool.touch(blocks)
        self._held[rid] = blocks
        return False, {"block_ids": blocks, "block_hashes": list(request.block_hashes[:num_full]),
                       "num_tokens": num_full * self.block_size}

    def sent(self, request_id: str) -> bool:
        """The receiver has the request's KV (or will never get it): release the blocks
        kept for it (they return to the free queue, still cached). Engine-core process,
        between steps; returns whether any were kept."""
        self._to_send.discard(request_id)
        blocks = self._held.pop(request_id, None)
        if blocks is None:
            return False
        if blocks:
            self.kv_cache_manager.block_pool.free_blocks(reversed(blocks))
        return True

    def held_blocks(self, request_id: str) -> list[int] | None:
        """The blocks kept for the request's send (None: none are kept)."""
        return self._held.get(request_id)

    def has_pending_block_frees(self) -> bool:
        return bool(self._held)

    @property
    def num_held_blocks(self) -> int:
        """Blocks kept for sends not yet done."""
        return sum(len(b) for b in self._held.values())

    # -- receiving (the decode engine) -------------------------------------------------------
    def reserve(self, request_id: str, block_hashes: Sequence[bytes], num_prompt_tokens: int,
                busy: bool) -> int | None:
        """Hold room for a request about to be sent here: the blocks of its prompt (and
        one to decode into) past the leading ones this engine's prefix cache holds.
        Returns that number of leading blocks held (they need not be sent), or None when
        the free blocks, less the room held for others, are too few (the sender keeps its
        blocks and asks again later). An idle engine (``busy`` false, nothing held for
        others) always takes it, and so does one the request could never fit: its
        scheduler decides then. Engine-core process."""
        kv = self.kv_cache_manager
        held = len(kv.cached_prefix(block_hashes))
        need = -(-(num_prompt_tokens + 1) // self.block_size) - held
        room = kv.num_free_blocks - self.num_reserved_blocks
        if need > room and (busy or self._reserved) and need < kv.block_pool.num_blocks:
            return None
        self._reserved[request_id] = max(need, 0)
        return held

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks of room held for requests not yet admitted."""
        return sum(self._reserved.values())

    def receive(self, request_id: str, receipt: KVReceipt) -> None:
        """The request's prompt KV arrived (before the request is added here). Engine-core
        process."""
        self._received[request_id] = receipt

    def cancel(self, request_id: str) -> bool:
        """Forget what was reserved or received for the request (it will not be added
        here, or it ended); returns whether there was anything."""
        had = self._reserved.pop(request_id, None) is not None
        self._hits.pop(request_id, None)
        if self._received.pop(request_id, None) is not None:
            self._meta.drops.append(request_id)
            return True
        return had

    def get_num_new_matched_tokens(self, request: Any, num_local_hit_tokens: int) -> tuple[int | None, bool]:
        receipt = self._received.get(request.request_id)
        if receipt is None or num_local_hit_tokens < receipt.first_token:
            # nothing arrived, or the blocks it held when the transfer began were evicted
            # since: what arrived does not join up with what is cached, recompute it
            return 0, False
        self._hits[request.request_id] = num_local_hit_tokens
        end = min(receipt.end_token, request.num_tokens - 1)  # the last token gives the logits
        return max(end - num_local_hit_tokens, 0), False

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        rid = request.request_id
        self._reserved.pop(rid, None)
        receipt = self._received.pop(rid, None)
        hits = self._hits.pop(rid, 0)
        if receipt is None:
            return
        if num_external_tokens <= 0:
            self._meta.drops.append(rid)
            return
        self.num_tokens_received += num_external_tokens
        bs = self.block_size
        first_sent = receipt.first_token // bs
        end = -(-(hits + num_external_tokens) // bs)
        self._meta.loads.append((rid, [(block_ids[i], i - first_sent) for i in range(hits // bs, end)]))

    def build_connector_meta(self, scheduler_output: Any) -> TransferMetadata | None:
        meta = self._meta
        if not (meta.loads or meta.drops):
            return None
        self._meta = TransferMetadata()
        return meta
