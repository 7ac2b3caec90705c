"""The cluster simulation's disaggregated requests (docs/cluster-simulation.md#disaggregation):
their prefills, the KV hand-offs in flight, and the record of each hand-off.

A disaggregated request is prefilled on its prefill replica as a copy of itself that
asks for one token; that replica's ``transfer`` connector keeps the prompt's full blocks
when the copy finishes. The hand-off then sends the blocks the decode replica's prefix
cache does not hold (by hash, from the prompt's start), taking
:meth:`~schedkit.runners.cost_model.CostModel.kv_transfer_time` of them. When it ends
the prefill replica frees the blocks, the decode replica's connector is told what
arrived, and the request itself (arrival time unchanged) is added to the decode
replica, which computes the rest of the prompt and produces every output token.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

from schedkit.cluster.transfer import (
    Handoff,
    TransferConnector,
    num_blocks_held,
    transfer_connector,
)
from schedkit.core.outputs import EngineCoreOutput
from schedkit.core.request import Request, SamplingParams
from schedkit.engine.core import EngineCore
from schedkit.kv.hashing import BlockHasher

__all__ = ["Handoffs"]


class Handoffs:
    """Args:
        engines: The replicas' engines, each running the transfer connector.
        transfer_time: Seconds to send a given number of blocks (the cost model's
            ``kv_transfer_time``; 0 on a runner without a cost model).
        hasher: The engines' prefix-cache hasher (None without prefix caching).

    Raises:
        ConfigError: An engine runs another KV connector.
    """

    def __init__(self, engines: Sequence[EngineCore], transfer_time: Callable[[int], float],
                 hasher: BlockHasher | None) -> None:
        self.engines = engines
        self.connectors: list[TransferConnector] = [
            transfer_connector(e.scheduler.connector, i) for i, e in enumerate(engines)]
        self.transfer_time = transfer_time
        self.hasher = hasher
        self.prefilling: dict[str, tuple[Request, Request, int]] = {}
        """Request id -> (the request as its decode replica gets it, its prefill copy,
        its decode replica)."""
        self.in_flight: dict[str, tuple[Request, Handoff]] = {}
        self.due: list[tuple[float, int, str]] = []
        """Hand-offs in flight, a heap of (end, order started, request id)."""
        self.done: list[Handoff] = []
        """Every prefill hand-off started, in order."""
        self.moves: list[Handoff] = []
        """Every hand-off of a running request moved to another replica, in order."""
        self._order = itertools.count()
        self.prefill_of: dict[str, int] = {}
        """Request id -> its prefill replica."""
        self.cached_tokens: dict[str, int] = {}
        """Request id -> its prefill's prefix-cache hit (tokens), until it finishes."""

    def prefill_copy(self, req: Request) -> Request:
        """The request's prefill: its prompt, one output token, its block hashes reused."""
        copy = Request(req.request_id, req.prompt_token_ids,
                       SamplingParams(max_tokens=1, eos_token_id=req.sampling_params.eos_token_id),
                       arrival_time=req.arrival_time, priority=req.priority, tenant=req.tenant,
                       ttft_slo_s=req.ttft_slo_s, tpot_slo_s=req.tpot_slo_s, hints=req.hints)
        if self.hasher is not None:
            copy.block_hashes.extend(req.block_hashes)
            copy.set_block_hasher(self.hasher.extend, self.hasher.block_size)
        return copy

    def started(self, req: Request, copy: Request, prefill: int, decode: int) -> None:
        """The prefill copy was added to replica ``prefill``."""
        rid = req.request_id
        self.connectors[prefill].send_when_finished(rid)
        self.prefilling[rid] = (req, copy, decode)
        self.prefill_of[rid] = prefill

    def next_end(self) -> float:
        """When the first hand-off in flight ends (inf: none)."""
        return self.due[0][0] if self.due else float("inf")

    def prefill_ended(self, o: EngineCoreOutput, prefill: int, now: float) -> tuple[Request, Request] | None:
        """The prefill copy's last output, at ``now``: start the hand-off and return
        None; or, when the copy ended without its prompt computed (an error, a
        rejection), return (the request, the copy): the request ends with it."""
        rid = o.request_id
        req, copy, decode = self.prefilling.pop(rid)
        params = o.kv_transfer_params or {}
        if o.error is not None or o.finish_reason == "abort" or "block_ids" not in params:
            self.connectors[prefill].sent(rid)  # nothing goes anywhere
            return req, copy
        kv = self.engines[decode].scheduler.kv_cache_manager
        num_full = len(params["block_ids"])
        held = min(num_blocks_held(kv, params["block_hashes"]), num_full)
        handoff = Handoff(rid, prefill, decode, num_full - held, held, kv.block_size, now,
                          self.transfer_time(num_full - held))
        self.done.append(handoff)
        self.in_flight[rid] = (req, handoff)
        self.cached_tokens[rid] = o.num_cached_tokens
        heapq.heappush(self.due, (handoff.end, next(self._order), rid))
        return None

    def start_move(self, req: Request, source: int, target: int, now: float) -> Handoff:
        """A running request stopped on replica ``source`` (its connector keeps the full
        blocks of its computed tokens) moves to ``target``, as ``req`` (it resumed with
        its outputs): the blocks the target does not hold go over from ``now``."""
        rid = req.request_id
        blocks = self.connectors[source].held_blocks(rid) or []
        kv = self.engines[target].scheduler.kv_cache_manager
        held = min(num_blocks_held(kv, req.block_hashes[:len(blocks)]), len(blocks))
        handoff = Handoff(rid, source, target, len(blocks) - held, held, kv.block_size, now,
                          self.transfer_time(len(blocks) - held))
        self.moves.append(handoff)
        self.in_flight[rid] = (req, handoff)
        heapq.heappush(self.due, (handoff.end, next(self._order), rid))
        return handoff

    def deliver(self) -> tuple[Request, Handoff]:
        """End the first hand-off in flight (a prefill's or a move's): the sending replica
        frees its blocks, the receiving replica's connector learns what arrived. Returns
        the request, for the caller to add to the receiving replica."""
        _, _, rid = heapq.heappop(self.due)
        req, handoff = self.in_flight.pop(rid)
        self.connectors[handoff.prefill].sent(rid)
        self.connectors[handoff.decode].receive(rid, handoff.receipt)
        return req, handoff
