"""Least outstanding prompt tokens: an example schedkit router plugin."""

from __future__ import annotations

from collections.abc import Sequence

from schedkit import ReplicaState, RouteEvent, RouteEventKind, RouteRequest, hookimpl

__all__ = ["LeastOutstandingTokens"]


class LeastOutstandingTokens:
    """Score 1 for the replica with the fewest outstanding prompt tokens, 0 for the most.

    Settings:
        cached_discount: Fraction of a prompt's tokens already in a replica's prefix
            cache that still count as work there (0: cached tokens are free; 1: no
            discount).
    """

    def __init__(self, cached_discount: float = 1.0) -> None:
        if isinstance(cached_discount, bool) or not isinstance(cached_discount, (int, float)) \
                or not 0 <= cached_discount <= 1:
            raise ValueError(f"cached_discount must be a number in [0, 1], got {cached_discount!r}")
        self.cached_discount = float(cached_discount)
        self.tokens: dict[int, int] = {}
        self._charged: dict[str, tuple[int, int]] = {}

    def _cost(self, request: RouteRequest, replica: ReplicaState) -> int:
        hashes = request.block_hashes
        if not hashes or self.cached_discount == 1.0:
            return request.num_prompt_tokens
        cached = replica.cached_blocks.num_matched_blocks(hashes) * request.block_size
        return round(request.num_prompt_tokens - (1 - self.cached_discount) * cached)

    @hookimpl
    def schedkit_router_score(self, request: RouteRequest,
                              replicas: Sequence[ReplicaState]) -> list[float]:
        loads = [self.tokens.get(r.index, 0) + self._cost(request, r) for r in replicas]
        lo, hi = min(loads), max(loads)
        return [1.0 if hi == lo else (hi - x) / (hi - lo) for x in loads]

    @hookimpl
    def schedkit_on_route_event(self, event: RouteEvent) -> None:
        rid = event.request.request_id
        if event.kind is RouteEventKind.ROUTED:
            cost = self._cost(event.request, event.replica)
            self.tokens[event.replica.index] = self.tokens.get(event.replica.index, 0) + cost
            self._charged[rid] = (event.replica.index, cost)
        elif rid in self._charged:  # finished, failed or re-routed: its tokens leave
            index, cost = self._charged.pop(rid)
            self.tokens[index] -= cost
