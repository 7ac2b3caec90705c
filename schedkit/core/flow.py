"""What the flow-control hooks see: one tenant's queue at the front door."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TenantQueue"]


@dataclass(slots=True, eq=False)
class TenantQueue:
    """One tenant's requests held at the front door, in one priority band.

    Attributes:
        tenant: The tenant (``Request.tenant``, the OpenAI ``user``).
        band: The priority band (the requests' ``priority``; smaller is served first).
        num_queued: Its requests held now in this band (at least 1 when offered).
        oldest_wait_s: How long the oldest of them has waited, in seconds.
        num_outstanding: Its requests dispatched to the engines and not finished (all
            bands).
        head_cost: The size of its oldest held request in tokens (prompt plus
            ``max_tokens``): what dispatching it next would cost.
        service: Tokens (prompt plus ``max_tokens``) of all its requests dispatched so
            far, held or not.
        backlog_id: Identifies its current spell of holding requests in this band: a
            new id each time it starts holding requests there after holding none (its
            held requests all dispatched, refused or timed out in between). A fairness
            policy that treats a returning tenant differently (VTC's counter lift)
            compares it with the id it saw last.
    """

    tenant: str
    band: int
    num_queued: int = 0
    oldest_wait_s: float = 0.0
    num_outstanding: int = 0
    head_cost: int = 0
    service: float = 0.0
    backlog_id: int = 0
