"""Flow control at the front door: requests held in queues by priority band and tenant
while the engines are saturated (docs/flow-control.md).

With ``flow_control.enabled``, every request that ``AsyncLLM.generate`` (and so
``schedkit serve``) sends first asks the :class:`FlowController` for a slot. While no
request is held and the saturation detector (``schedkit_flow_saturated``) says the
engines have room, it goes on at once; otherwise it waits in its band's queue for its
tenant. Each time a request finishes, or a replica reports its load, the controller
dispatches held requests while the detector allows: from the most urgent band (the
smallest priority) holding any, the tenant the fairness plugin
(``schedkit_flow_pick_tenant``) picks, that tenant's oldest request. A request held
past ``flow_control.queue_timeout_s`` is refused with
:class:`~schedkit.errors.EngineBusyError` (the server's 429, with the reason), so a
saturated deployment answers at once instead of letting requests time out in the
engines' queues. While ``max_queued`` are held, a newcomer displaces the newest request
of the tenant holding the most (in a less urgent band, or in its own band when that
tenant holds at least two more than the newcomer's), which is refused instead; with
none to displace, the newcomer is refused. A tenant flooding the door fills it with its
own requests, not with other tenants' refusals.

A flow plugin that raises or answers nonsense never fails a request: its answer is
dropped, counted and logged, and the next plugin (the built-in last) decides.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from schedkit.config import Config
from schedkit.core.flow import TenantQueue
from schedkit.core.routing import ReplicaState
from schedkit.engine.logs import RateLimitedLog
from schedkit.errors import EngineBusyError
from schedkit.hookspecs import FLOW_HOOK_NAMES
from schedkit.plugins.manager import describe_plugins, get_flow_plugin_manager

log = logging.getLogger("schedkit.flow")
ERROR_LOG_INTERVAL_S = 10.0
MAX_TRACKED_TENANTS = 4096
"""Tenants whose service the front door remembers: past it, the tenants served least
recently that hold nothing and have nothing at the engines are forgotten (down to three
quarters of it; a forgotten tenant's service starts again from 0), so any number of
distinct tenants takes bounded memory."""


@dataclass(slots=True, eq=False)
class FlowTicket:
    """One request at the front door."""

    request_id: str
    tenant: str
    band: int
    cost: int
    """Its size in tokens (prompt plus ``max_tokens``): what dispatching it charges its
    tenant's service."""
    arrival: float
    dispatched: bool = False
    seq: int = 0
    on_dispatch: Callable[[FlowTicket], None] | None = None
    """Called when a held ticket leaves its queue other than by its timeout: let through
    (``dispatched``), or displaced by a newcomer while the front door is full (``error``
    set)."""
    error: EngineBusyError | None = None
    """Why it was refused after being held (displaced)."""


@dataclass(slots=True)
class _Band:
    tenants: dict[str, deque[FlowTicket]] = field(default_factory=dict)
    """Tenant -> its held requests, oldest first (tenants in the order they first queued)."""
    spells: dict[str, int] = field(default_factory=dict)
    """Tenant -> the id of its current spell of holding requests here (the ``seq`` of the
    request that began it): :attr:`TenantQueue.backlog_id`."""

    def hold(self, ticket: FlowTicket) -> None:
        queue = self.tenants.get(ticket.tenant)
        if queue is None:
            queue = self.tenants[ticket.tenant] = deque()
            self.spells[ticket.tenant] = ticket.seq
        queue.append(ticket)

    def drop_tenant(self, tenant: str) -> None:
        del self.tenants[tenant]
        del self.spells[tenant]


class FlowController:
    """Args:
        config: The config (its ``flow_control`` section).
        replicas: The replicas' states the detector reads (the router's, or one made
            for a single engine and fed its load reports).
        clock: Seconds (default ``time.monotonic``).
        extra_plugins: Flow plugin objects registered after the configured ones.
    """

    def __init__(self, config: Config, replicas: Sequence[ReplicaState], *,
                 clock: Callable[[], float] = time.monotonic, extra_plugins: Iterable[Any] = ()) -> None:
        self.config = config.flow_control
        self.replicas = replicas
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.clock = clock
        self.plugin_manager = get_flow_plugin_manager(config, extra_plugins=extra_plugins)
        self._impls = {name: [(i.function, tuple(i.argnames), i.plugin_name)
                              for i in reversed(getattr(self.plugin_manager.hook, name).get_hookimpls())]
                       for name in FLOW_HOOK_NAMES}
        self._bands: dict[int, _Band] = {}
        self._service: dict[str, float] = {}
        self._outstanding: Counter[str] = Counter()
        self._seq = itertools.count()
        self.num_queued = 0
        self.num_outstanding = 0
        """Requests sent on that have not finished."""
        self.num_dispatched = 0
        """Requests sent on (at once or after waiting)."""
        self.num_held = 0
        """Requests that had to wait at the front door."""
        self.num_refused: Counter[str] = Counter()
        """Requests refused, by why: ``timeout``, ``full``."""
        self.errors: Counter[tuple[str, str]] = Counter()
        """Flow-hook errors by ``(plugin, hook)``."""
        self.is_saturated = False
        """The saturation detector's last answer (reading it asks no plugin)."""
        self._error_log = RateLimitedLog(log, ERROR_LOG_INTERVAL_S)

    # -- the request's side ----------------------------------------------------------------
    def submit(self, request_id: str, tenant: str, band: int, cost: int,
               on_dispatch: Callable[[FlowTicket], None] | None = None) -> FlowTicket:
        """Offer a request to the front door, without waiting: it is sent on at once
        (``ticket.dispatched``) or held, and ``on_dispatch(ticket)`` is called when a
        later :meth:`pump` lets it through (or a newcomer displaces it: ``ticket.error``). The synchronous core of :meth:`enter`, for a
        caller with its own clock (the cluster simulation), which calls :meth:`expire`
        when the ticket's ``queue_timeout_s`` has passed.

        Raises:
            EngineBusyError: ``max_queued`` requests are held already and none of them
                gives way to this one (see :meth:`_displaceable`).
        """
        ticket = FlowTicket(request_id, tenant, band, max(cost, 1), self.clock(), seq=next(self._seq),
                            on_dispatch=on_dispatch)
        if self.num_queued == 0 and not self._saturated():
            self._dispatch(ticket)
            return ticket
        if self.num_queued >= self.config.max_queued:
            victim = self._displaceable(tenant, band)
            self.num_refused["full"] += 1
            if victim is None:
                raise EngineBusyError(f"request {request_id!r}: the front door holds {self.num_queued} requests "
                                      f"(flow_control.max_queued) while the engines are saturated; retry later",
                                      request_id=request_id)
            self._unqueue(victim)
            by = (f"a more urgent request (priority {band} < {victim.band})" if band < victim.band
                  else "a request of a tenant holding fewer")
            victim.error = EngineBusyError(
                f"request {victim.request_id!r}: displaced from the front door, full at "
                f"{self.config.max_queued} requests (flow_control.max_queued), by {by}; retry later",
                request_id=victim.request_id)
            if victim.on_dispatch is not None:
                victim.on_dispatch(victim)
        self._bands.setdefault(band, _Band()).hold(ticket)
        self.num_queued += 1
        self.num_held += 1
        self.pump()  # a detector that changed its mind since, or a tenant ahead
        return ticket

    def _displaceable(self, tenant: str, band: int) -> FlowTicket | None:
        """When the front door is full: the held request a newcomer of ``tenant`` in
        ``band`` displaces, so that the limit falls on whoever holds the most: the newest
        request of the tenant holding the most in the least urgent band held, if that band
        is less urgent than the newcomer's, or is the newcomer's and that tenant holds at
        least two more than the newcomer's tenant there. None: the newcomer is refused."""
        worst = max(self._bands)
        if worst < band:
            return None
        tenants = self._bands[worst].tenants
        name, queue = max(tenants.items(), key=lambda kv: (len(kv[1]), kv[1][-1].seq))
        if worst == band and len(queue) < len(tenants.get(tenant, ())) + 2:
            return None
        return queue[-1]

    def expire(self, ticket: FlowTicket) -> EngineBusyError | None:
        """The ticket's ``queue_timeout_s`` has passed: if it is still held it leaves the
        queue and is counted refused; returns the error to answer it with (None: it was
        dispatched meanwhile and goes on)."""
        if ticket.dispatched or not self._unqueue(ticket):
            return None
        self.num_refused["timeout"] += 1
        return EngineBusyError(f"request {ticket.request_id!r}: held {self.config.queue_timeout_s:g} s at the "
                               "front door (flow_control.queue_timeout_s) while the engines were saturated; "
                               "retry later", request_id=ticket.request_id)

    async def enter(self, request_id: str, tenant: str, band: int, cost: int) -> FlowTicket:
        """Wait for a slot: returns once the request may go on to the engines.

        Raises:
            EngineBusyError: Held past ``queue_timeout_s``, or ``max_queued`` requests are
                held already (the reason says which).
        """
        future: asyncio.Future[None] | None = None  # made only for a request that waits

        def wake(_: FlowTicket) -> None:
            if future is not None and not future.done():
                future.set_result(None)

        ticket = self.submit(request_id, tenant, band, cost, wake)
        if ticket.dispatched:  # at once, or by the pump in submit (before any wake)
            return ticket
        future = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(future), self.config.queue_timeout_s)
            if ticket.error is not None:
                raise ticket.error
        except TimeoutError:
            if ticket.error is not None:  # displaced in the same instant: refused all the same
                raise ticket.error from None
            error = self.expire(ticket)
            if error is None:  # dispatched in the same instant: go on
                return ticket
            raise error from None
        except BaseException:  # cancelled (the client left): out of the queue, or give the slot back
            if ticket.dispatched:
                self.leave(ticket)
            else:
                self._unqueue(ticket)
            raise
        return ticket

    def leave(self, ticket: FlowTicket) -> None:
        """The request ended (or never reached the engines): its slot frees, held ones
        may go."""
        if ticket.dispatched:
            ticket.dispatched = False
            self.num_outstanding -= 1
            self._outstanding[ticket.tenant] -= 1
            if self._outstanding[ticket.tenant] <= 0:
                del self._outstanding[ticket.tenant]
        self.pump()

    # -- dispatch ----------------------------------------------------------------------------
    def pump(self) -> None:
        """Dispatch held requests while the detector allows (call when load changed)."""
        while self.num_queued and not self._saturated():
            band_no = min(self._bands)
            band = self._bands[band_no]
            tenant = self._pick(band_no, band)
            queue = band.tenants[tenant]
            ticket = queue.popleft()
            if not queue:
                band.drop_tenant(tenant)
                if not band.tenants:
                    del self._bands[band_no]
            self.num_queued -= 1
            self._dispatch(ticket)
            if ticket.on_dispatch is not None:
                ticket.on_dispatch(ticket)

    def _dispatch(self, ticket: FlowTicket) -> None:
        ticket.dispatched = True
        self.num_outstanding += 1
        self._outstanding[ticket.tenant] += 1
        self.num_dispatched += 1
        service = self._service
        service[ticket.tenant] = service.pop(ticket.tenant, 0.0) + ticket.cost  # most recent last
        if len(service) > MAX_TRACKED_TENANTS:
            self._forget_idle_tenants()

    def _forget_idle_tenants(self) -> None:
        """Drop the service of the least recently served tenants that hold nothing and
        have nothing at the engines, down to :data:`MAX_TRACKED_TENANTS`."""
        busy = set(self._outstanding)
        for band in self._bands.values():
            busy.update(band.tenants)
        excess = len(self._service) - MAX_TRACKED_TENANTS * 3 // 4  # room for a while
        for tenant in [t for t in self._service if t not in busy][:excess]:
            del self._service[tenant]

    def _unqueue(self, ticket: FlowTicket) -> bool:
        """Take a held ticket out of its queue (False: it is not held)."""
        band = self._bands.get(ticket.band)
        queue = band.tenants.get(ticket.tenant) if band is not None else None
        if queue is None or ticket not in queue:
            return False
        queue.remove(ticket)
        self.num_queued -= 1
        if not queue:
            band.drop_tenant(ticket.tenant)  # type: ignore[union-attr]
            if not band.tenants:  # type: ignore[union-attr]
                del self._bands[ticket.band]
        return True

    # -- the hooks ---------------------------------------------------------------------------
    def _bad(self, plugin: str, hook: str, why: str) -> None:
        self.errors[(plugin, hook)] += 1
        self._error_log.error("flow plugin %r, hook %s: %s (its answer is ignored)", plugin, hook, why)

    def _ask(self, hook: str, kwargs: dict[str, Any], valid: Callable[[Any], bool], what: str) -> Any:
        """The first answer of ``hook``'s plugins (the built-in last) that is not None and
        passes ``valid``; raises and invalid answers are counted and skipped. None if
        none answered."""
        for fn, argnames, plugin in self._impls[hook]:
            try:
                answer = fn(*[kwargs[a] for a in argnames])
            except Exception as e:
                self._bad(plugin, hook, f"raised {type(e).__name__}: {e}")
                continue
            if answer is None:
                continue
            if not valid(answer):
                self._bad(plugin, hook, f"answered {answer!r}, not {what}")
                continue
            return answer
        return None

    def _saturated(self) -> bool:
        kwargs = {"replicas": self.replicas, "num_outstanding": self.num_outstanding,
                  "num_queued": self.num_queued, "max_num_seqs": self.max_num_seqs}
        self.is_saturated = bool(self._ask("schedkit_flow_saturated", kwargs, lambda a: isinstance(a, bool), "a bool"))
        return self.is_saturated

    def _pick(self, band_no: int, band: _Band) -> str:
        now = self.clock()
        spells = band.spells
        queues = [TenantQueue(t, band_no, len(q), max(now - q[0].arrival, 0.0), self._outstanding.get(t, 0),
                              q[0].cost, self._service.get(t, 0.0), spells[t]) for t, q in band.tenants.items()]
        answer = self._ask("schedkit_flow_pick_tenant", {"band": band_no, "queues": queues, "now": now},
                           lambda a: isinstance(a, str) and a in band.tenants,
                           f"a tenant holding requests in band {band_no}")
        if answer is not None:
            return str(answer)
        return min(band.tenants.items(), key=lambda kv: kv[1][0].seq)[0]  # every plugin failed: oldest

    def stats(self) -> dict[str, Any]:
        """``stats()["flow_control"]``: the plugins, held now (by band and by tenant),
        dispatched, held, refused, the detector's last answer and hook errors. Asks no
        plugin: a scrape neither calls a detector outside its documented moments nor
        counts its errors again."""
        by_tenant: Counter[str] = Counter()
        for band in self._bands.values():
            for tenant, queue in band.tenants.items():
                by_tenant[tenant] += len(queue)
        return {"fairness": self.config.fairness, "saturation": self.config.saturation,
                "plugin_hooks": [[name, [h for h in hooks if h in FLOW_HOOK_NAMES]]
                                 for name, hooks in describe_plugins(self.plugin_manager)],
                "num_queued": self.num_queued, "num_outstanding": self.num_outstanding,
                "num_queued_by_band": {b: sum(len(q) for q in band.tenants.values())
                                       for b, band in sorted(self._bands.items())},
                "num_queued_by_tenant": dict(by_tenant),
                "num_dispatched": self.num_dispatched, "num_held": self.num_held,
                "num_refused": dict(self.num_refused), "saturated": self.is_saturated,
                "num_hook_errors": [[p, h, n] for (p, h), n in sorted(self.errors.items())]}
