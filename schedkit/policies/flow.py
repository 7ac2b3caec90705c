"""The bundled flow-control plugins: fairness between tenants at the front door and the
saturation detector (docs/flow-control.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from schedkit.core.flow import TenantQueue
from schedkit.core.routing import ReplicaState
from schedkit.hookspecs import hookimpl
from schedkit.policies.common import check_int, check_number

__all__ = ["QueueDepth", "TenantRoundRobin", "TenantWeighted"]

MAX_COUNTERS = 4096
"""Virtual counters ``tenant-weighted`` keeps: past it, those of tenants not backlogged
are dropped (down to three quarters of it), oldest first. Also the most bands (distinct
priorities) either fairness plugin remembers its last pick or backlog for."""


class TenantRoundRobin:
    """The tenants holding requests in a band, in turn: after tenant ``t`` the next one
    (in the order tenants first queued) that holds a request. Every backlogged tenant
    gets one dispatch per round, whatever it sends.

    Hooks: ``schedkit_flow_pick_tenant`` (trylast: the built-in, answered when no other
    fairness plugin does).
    """

    def __init__(self) -> None:
        self._last: dict[int, str] = {}

    @hookimpl(trylast=True)
    def schedkit_flow_pick_tenant(self, band: int, queues: Sequence[TenantQueue]) -> str | None:
        names = [q.tenant for q in queues]
        last = self._last.get(band)
        if last in names:
            pick = names[(names.index(last) + 1) % len(names)]
        else:  # the last one emptied its queue: the first after it in the order is unknown
            pick = names[0]
        self._last.pop(band, None)
        self._last[band] = pick  # most recent band last
        if len(self._last) > MAX_COUNTERS:  # many distinct bands (priorities): forget the oldest
            del self._last[next(iter(self._last))]
        return pick


class TenantWeighted:
    """Least service per weight first, with VTC's counter lift: each tenant has a virtual
    counter; dispatching a request adds its size (prompt plus ``max_tokens``) divided by
    the tenant's weight; the backlogged tenant with the smallest counter goes next. A
    tenant that comes back after holding nothing has its counter lifted to the smallest
    of the tenants backlogged then, so no tenant banks credit while away (Sheng et al.,
    "Fairness in Serving Large Language Models", OSDI'24). Under saturation a tenant's
    share of the dispatched tokens approaches its weight's share; one that sends ten
    times its share waits behind its own requests.

    Counters move only with dispatches from the queues (while saturated); requests that
    go on at once charge nothing, since fairness matters only when there is contention.
    At most :data:`MAX_COUNTERS` are kept: past it, tenants not backlogged lose theirs
    (one that comes back is lifted to the least counter backlogged, as any newcomer),
    so any number of distinct tenants takes bounded memory.

    Hooks: ``schedkit_flow_pick_tenant``.

    Args:
        weights: Tenant -> weight (> 0; default 1 for a tenant not named).

    Raises:
        ValueError: A weight that is not a finite number > 0.
    """

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        if weights is not None and not isinstance(weights, Mapping):
            raise ValueError(f"weights must be a map of tenant -> weight, got {weights!r}")
        self.weights = {str(k): check_number(f"weights[{k!r}]", v, strict=True) for k, v in (weights or {}).items()}
        self._virtual: dict[str, float] = {}
        self._backlogged: dict[int, dict[str, int]] = {}
        """Band -> tenant -> the backlog spell it was in when last seen backlogged there."""

    @hookimpl
    def schedkit_flow_pick_tenant(self, band: int, queues: Sequence[TenantQueue]) -> str | None:
        virtual = self._virtual
        before = self._backlogged.get(band, {})
        staying = [q for q in queues if before.get(q.tenant) == q.backlog_id]
        floor = min(virtual.get(q.tenant, 0.0) for q in staying) if staying else None
        for q in queues:  # back after an idle spell (or new): no banked credit
            if before.get(q.tenant) != q.backlog_id:
                if floor is not None:
                    virtual[q.tenant] = max(virtual.get(q.tenant, 0.0), floor)
                else:
                    virtual.setdefault(q.tenant, 0.0)
        pick = min(queues, key=lambda q: virtual.get(q.tenant, 0.0))
        virtual[pick.tenant] = virtual.get(pick.tenant, 0.0) + pick.head_cost / self.weights.get(pick.tenant, 1.0)
        self._backlogged.pop(band, None)
        self._backlogged[band] = {q.tenant: q.backlog_id for q in queues
                                  if q is not pick or q.num_queued > 1}  # most recent band last
        if len(self._backlogged) > MAX_COUNTERS:  # many distinct bands: forget the oldest
            del self._backlogged[next(iter(self._backlogged))]
        if len(virtual) > MAX_COUNTERS:
            self._forget_idle()
        return pick.tenant

    def _forget_idle(self) -> None:
        backlogged = set().union(*self._backlogged.values())
        excess = len(self._virtual) - MAX_COUNTERS * 3 // 4
        for tenant in [t for t in self._virtual if t not in backlogged][:excess]:
            del self._virtual[tenant]


class QueueDepth:
    """Saturated when the live replicas (healthy, not draining) have no room: the
    requests the front door sent on and that have not finished reach what they can run
    plus ``max_waiting`` queued each (``num_outstanding >= live * (max_num_seqs +
    max_waiting)``: exact at once, so a burst is held at the door, not in the engines),
    or every one of them reports more than ``max_waiting`` requests queued or its KV
    cache at least ``max_kv_usage`` full (an engine short of KV runs fewer than
    ``max_num_seqs``). With no live replica it says not saturated: the request then
    fails as it would without flow control.

    Hooks: ``schedkit_flow_saturated`` (trylast: the built-in).

    Args:
        max_waiting: Requests a replica may queue beyond those it runs (>= 0, default 8).
        max_kv_usage: KV cache usage at which a replica is full (in (0, 1], default 0.98).

    Raises:
        ValueError: A setting out of range.
    """

    def __init__(self, max_waiting: int = 8, max_kv_usage: float = 0.98) -> None:
        self.max_waiting = check_int("max_waiting", max_waiting, minimum=0)
        self.max_kv_usage = check_number("max_kv_usage", max_kv_usage, strict=True)
        if self.max_kv_usage > 1:
            raise ValueError(f"max_kv_usage must be in (0, 1], got {max_kv_usage!r}")

    @hookimpl(trylast=True)
    def schedkit_flow_saturated(self, replicas: Sequence[ReplicaState], num_outstanding: int,
                                max_num_seqs: int) -> bool | None:
        live = [r for r in replicas if r.healthy and not r.draining]
        if not live:
            return False
        if num_outstanding >= len(live) * (max_num_seqs + self.max_waiting):
            return True
        return all(r.num_waiting > self.max_waiting or r.kv_cache_usage >= self.max_kv_usage for r in live)
