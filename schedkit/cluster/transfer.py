"""Handing a disaggregated request's KV from its prefill replica to its decode replica.

The pieces a transfer needs whatever carries the bytes: the engine plugin that gives
each engine the ``transfer`` KV connector (:class:`KVTransfer`, ``kv-transfer`` by
name), what the receiver already holds (:func:`num_blocks_held`), and the record of one
hand-off (:class:`Handoff`). The cluster simulation (:mod:`schedkit.lab.cluster_sim`)
uses them with the cost model's transfer time; real replicas move the bytes through
their front end (:mod:`schedkit.cluster.handoff`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from schedkit.errors import ConfigError
from schedkit.kv.connector import KVConnectorBase
from schedkit.kv.connectors.transfer import KVReceipt, TransferConnector
from schedkit.kv.kv_cache_manager import KVCacheManager
from schedkit.runners.paged.kv_transfer import KVTransfer

__all__ = ["Handoff", "KVReceipt", "KVTransfer", "TransferConnector", "num_blocks_held",
           "transfer_connector"]


def transfer_connector(connector: KVConnectorBase, index: int) -> TransferConnector:
    """Replica ``index``'s scheduler-side connector, which must be the transfer one.

    Raises:
        ConfigError: Another connector plugin is switched on (the two do not combine yet).
    """
    if not isinstance(connector, TransferConnector):
        raise ConfigError(f"replicas.roles: replica {index} runs the KV connector "
                          f"{type(connector).__name__!r} from a plugin, but a disaggregated cluster "
                          "needs the transfer connector on every replica; switch the connector "
                          "plugin off (plugins) or leave replicas.roles out")
    return connector


def num_blocks_held(kv: KVCacheManager, block_hashes: Sequence[bytes]) -> int:
    """Leading blocks of a prompt (by their hashes) that ``kv``'s prefix cache holds: the
    blocks a receiver need not be sent (0 without prefix caching)."""
    return len(kv.cached_prefix(block_hashes))


@dataclass(slots=True, frozen=True)
class Handoff:
    """One request's KV hand-off from its prefill replica to its decode replica.

    Attributes:
        request_id: The request.
        prefill: The prefill replica's index.
        decode: The decode replica's index.
        num_blocks: Full prompt blocks sent (the ones the decode replica did not hold).
        num_blocks_held: Leading full blocks the decode replica held already (not sent).
        block_size: Tokens per block.
        start: When the prefill ended and the transfer began (engine clock, seconds).
        seconds: How long the transfer took.
    """

    request_id: str
    prefill: int
    decode: int
    num_blocks: int
    num_blocks_held: int
    block_size: int
    start: float
    seconds: float

    @property
    def end(self) -> float:
        """When the decode replica has the KV (and the prefill replica frees its blocks)."""
        return self.start + self.seconds

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV was sent."""
        return self.num_blocks * self.block_size

    @property
    def receipt(self) -> KVReceipt:
        """What the decode replica's connector is told arrived."""
        bs = self.block_size
        return KVReceipt(self.num_blocks_held * bs, (self.num_blocks_held + self.num_blocks) * bs)
