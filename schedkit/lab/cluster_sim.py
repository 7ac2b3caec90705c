"""Cluster simulation: N replicas behind the router, on one shared virtual clock.

:func:`run_cluster_workload` replays a workload through ``replicas.count`` in-process
:class:`~schedkit.engine.core.EngineCore` replicas (each built from
:func:`~schedkit.cluster.router.replica_config`, the config's own runner: fake or
simulated, so every replica's clock is virtual) and one
:class:`~schedkit.cluster.router.Router` running the configured router plugins. Routing
policies are then compared on traces the way engine policies are (docs/cluster-simulation.md).

The event loop (a discrete-event simulation; every time is on the one shared clock):

* Requests arrive in arrival order (ties: workload order). Each is routed *at its
  arrival time*: first every replica report due by then is applied to the router, then
  the router decides, then the request is added to the chosen replica with
  :meth:`~schedkit.engine.core.EngineCore.add_request_at`, so its ``arrival_time`` is
  the trace's. A replica whose clock is behind (idle) jumps to the arrival; a busy one
  whose step in progress ends after the arrival takes it in its next step.
* Replicas step in order of the time their next step starts (a heap of ``(time,
  index)``; ties: arrivals first, then the lower index). A replica steps only when no
  unrouted request arrives before or at that time, so no replica runs ahead of an
  arrival that could be routed to it. A replica with nothing to run is not in the heap;
  one whose last step ran nothing waits for the next arrival (the engine's own rule for
  its virtual clock).
* What a step ends with is reported to the router when the step ends, not before: the
  replica's queue lengths and KV usage (``update_load``), its KV cache events
  (``apply_kv_events``; the prefix-affinity view) and the requests that finished
  (``finished``). A request that arrives while a step runs is routed on the state the
  replicas had reported by then, as a real router would see it.

* With ``replicas.roles`` the router may disaggregate a request
  (:meth:`~schedkit.cluster.router.Router.place`): its prefill copy (one output token)
  runs on its prefill replica; when it ends, its KV hand-off to the decode replica takes
  the cost model's transfer time (:mod:`schedkit.lab.cluster_handoffs`), a third kind of
  event beside arrivals and steps (ties: arrivals first). At its end the prefill replica
  frees the blocks it kept, and the request, its arrival time unchanged, is added to the
  decode replica, whose ``transfer`` connector hands it the KV that arrived.

* With a migration plugin (``schedkit_router_migrate``) the router is asked every
  ``router.migration_interval_s`` which running requests to move: each stops on its
  replica after the step in progress, keeping the blocks of its computed tokens, and
  goes to its target as a request resuming with its outputs (its arrival time and
  events kept, so its metrics span both) once the blocks the target lacks have taken
  the transfer time: the same hand-off event as a disaggregated prefill's.

* With ``flow_control.enabled`` every arrival first goes through the front door's
  :class:`~schedkit.cluster.flow.FlowController`, on the same clock, fed the load the
  replicas reported: it is routed at once, or held and routed when a report (a request
  finishing, a replica's new load) lets it through, or refused (a 429: ``max_queued``
  held already, or held past ``queue_timeout_s``). While requests are held, every report
  and every queue timeout is an event of its own (ties: before an arrival). A held
  request keeps its arrival time, so its TTFT counts its wait at the door.

Token times and metrics are recorded as :func:`~schedkit.lab.simulate.run_workload`
records them, so :func:`~schedkit.lab.metrics.summarize` works on the union, and with one
replica the result equals ``run_workload``'s request for request. Everything is
deterministic: the same config and workload give identical metrics.
:func:`~schedkit.lab.cluster_summary.summarize_cluster` adds the cluster's own figures:
per replica, load imbalance, prefix hit rate, the router's counters, the hand-offs.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from schedkit.cluster.flow import FlowController, FlowTicket
from schedkit.cluster.router import Router, replica_config
from schedkit.cluster.transfer import KVTransfer
from schedkit.config import Config
from schedkit.core.hints import NO_HINTS, RequestHints
from schedkit.core.outputs import EngineCoreOutput
from schedkit.core.request import EventType, Request, SamplingParams
from schedkit.core.routing import RouteRequest
from schedkit.engine.core import EngineCore
from schedkit.engine.kv_handoff import KVHandoffs
from schedkit.engine.load import LoadFigures, load_figures
from schedkit.errors import (
    ConfigError,
    EngineBusyError,
    RequestError,
    RouteRefusedError,
    SchedkitError,
)
from schedkit.kv.hashing import BlockHasher
from schedkit.lab.cluster_handoffs import Handoffs
from schedkit.lab.cluster_summary import ClusterRunResult, summarize_cluster
from schedkit.lab.metrics import RequestMetrics, refused_metrics, request_metrics
from schedkit.lab.workloads import WorkloadRequest, generate

__all__ = ["ClusterRunResult", "run_cluster_workload", "summarize_cluster"]

_INF = math.inf
GC_THRESHOLD = (100_000, 50, 100)
"""``gc.set_threshold`` during a run (the default is (700, 10, 10))."""


def _refused(req: Request, start: float, error: str) -> RequestMetrics:
    return refused_metrics(req.request_id, req.arrival_time - start, req.num_prompt_tokens, error,
                           tenant=req.tenant, priority=req.priority, max_tokens=req.max_tokens)


class _Replica:
    """One replica's engine and the loop's bookkeeping for it."""

    __slots__ = ("index", "engine", "version", "key", "added", "busy_s", "waiting_s", "max_waiting")

    def __init__(self, index: int, engine: EngineCore) -> None:
        self.index = index
        self.engine = engine
        self.version = 0
        """Bumped at every (re)scheduling; heap entries of older versions are stale."""
        self.key: float | None = None
        """When its next step starts (None: not in the heap)."""
        self.added = False
        """A request was added (or blocks freed) since its last step (so a last empty
        step says nothing)."""
        self.busy_s = 0.0
        self.waiting_s = 0.0
        """The waiting queue's length after each step times the step's duration, summed."""
        self.max_waiting = 0
        """The longest waiting queue after a step."""


def run_cluster_workload(config: Config, workload: list[WorkloadRequest] | None = None, *,
                         router_extra_plugins: Iterable[Any] = (),
                         base_dir: str | Path | None = None) -> ClusterRunResult:
    """Replay ``workload`` (default: the config's own) through ``replicas.count``
    simulated replicas behind the configured router (module docstring).

    Args:
        config: The whole config: ``replicas.count``, ``router``, and the engine sections
            every replica runs (the runner must have a virtual clock: ``fake`` or
            ``simulated``).
        workload: The requests (default: generated from ``config.workload``).
        router_extra_plugins: Router plugin objects registered after the configured ones.
        base_dir: Where relative trace paths are looked up first (the config's folder).

    Raises:
        ConfigError: The runner's clock is not virtual, or a router plugin cannot be built.
        ValueError: Two requests of the workload have the same id (each must be routed
            once).
    """
    if workload is None:
        workload = generate(config.workload, config.runner.vocab_size, base_dir)
    ids = [w.request_id for w in workload]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1} if len(ids) < 10_000 else set())
        raise ValueError(f"the workload's request ids must be unique for the cluster "
                         f"simulation{f': {dup[:5]} repeat' if dup else ''}")
    with _fewer_collections():
        return _ClusterRun(config, workload, router_extra_plugins).run()


@contextlib.contextmanager
def _fewer_collections() -> Iterator[None]:
    """Run with the cyclic garbage collector relaxed: the objects alive before (the
    workload: every prompt) are frozen out of its scans, and it runs far less often
    (:data:`GC_THRESHOLD`). A long cluster run allocates many containers and frees nearly
    all of them by reference counting, so the scans found little and took a quarter of
    the run. Restored afterwards (the freeze is left alone when the caller froze objects
    already)."""
    threshold = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if freeze:
            gc.unfreeze()


class _Report(NamedTuple):
    """What a replica's step ended with, due to the router when the step ends. Ordered
    in the heap by ``time``, then ``seq`` (unique: the order the steps ended in)."""

    time: float
    seq: int
    replica: int
    load: LoadFigures
    kv_events: list[Any]
    finished: list[tuple[str, bool]]
    """(request_id, failed) of each request that finished in the step."""
    prefilled: list[tuple[str, bool, bool]]
    """(request_id, failed, ended) of each disaggregated request whose prefill ended in
    the step (``ended``: the request ended with it)."""


class _ClusterRun:
    """One replay through the cluster (module docstring): the replicas and the router,
    the arrivals in order, the heaps of replica steps and of reports due to the router,
    and what became of each request. :meth:`run` replays it once."""

    def __init__(self, config: Config, workload: list[WorkloadRequest],
                 router_extra_plugins: Iterable[Any]) -> None:
        self.wall0 = time.perf_counter()
        n = config.replicas.count
        rconfig = replica_config(config)
        self.router = Router(config, n, extra_plugins=router_extra_plugins)
        has_roles = config.replicas.roles is not None
        moves = self.router.migrates
        engine_plugins = [KVTransfer()] if has_roles or moves else []
        self.engines = [EngineCore(rconfig, extra_plugins=engine_plugins) for _ in range(n)]
        if not all(e.is_virtual for e in self.engines):
            raise ConfigError("the cluster simulation needs a virtual clock: runner.kind fake or "
                              "simulated, with runner.clock virtual")
        self.replicas = [_Replica(i, e) for i, e in enumerate(self.engines)]
        self.start = self.engines[0].start_time
        assert all(e.start_time == self.start for e in self.engines)
        cache = rconfig.cache
        self.block_size = cache.block_size
        self.hasher = BlockHasher(cache.block_size, cache.hash_algo) if cache.enable_prefix_caching else None
        cost_model = getattr(self.engines[0].runner, "cost_model", None)
        self.handoffs = Handoffs(self.engines, cost_model.kv_transfer_time if cost_model is not None
                                 else lambda num_blocks: 0.0, self.hasher) if has_roles or moves else None
        """Disaggregated and moved requests (None without ``replicas.roles`` or migration)."""
        self.interval = config.router.migration_interval_s
        self.next_round = self.start + self.interval if moves else _INF
        """When the router is next asked which running requests to move (inf: never)."""
        self.eos = config.runner.eos_token_id
        self.slo = config.workload.slo
        self.now = self.start
        """The clock of the event being handled (the front door's clock)."""
        self.flow = (FlowController(config, self.router.replicas, clock=lambda: self.now)
                     if config.flow_control.enabled else None)
        self.tickets: dict[str, FlowTicket] = {}
        """Request id -> its front-door ticket, while it is held or runs."""
        self.held: dict[str, tuple[Request, WorkloadRequest]] = {}
        """Requests held at the front door."""
        self.released: list[FlowTicket] = []
        """Tickets the front door let through, to be routed now."""
        self.timeouts: list[tuple[float, int, FlowTicket]] = []
        """(when its queue timeout passes, seq, ticket) of each held request (a heap)."""
        self.tenant_hints = {t.name: RequestHints(slo_class=t.slo_class)
                             for t in config.workload.tenants if t.slo_class is not None}
        """The hints of each tenant's requests (``workload.tenants[i].slo_class``)."""
        self.workload = workload
        self.order = sorted(range(len(workload)), key=lambda k: workload[k].arrival_time)
        self.arrivals = [self.start + workload[k].arrival_time for k in self.order]
        self.num_arrivals = len(self.order)
        self.next_arrival = 0
        """Index into ``order`` / ``arrivals`` of the next request to route."""
        self.ready: list[tuple[float, int, int]] = []
        """Replica steps due: (step start, replica index, version)."""
        self.reports: list[_Report] = []
        """Reports due to the router (a heap)."""
        self.num_reports = 0
        self.live: dict[str, Request] = {}
        self.token_times: dict[str, list[float]] = {}
        self.failed: dict[str, str] = {}
        self.metrics: list[RequestMetrics] = []
        self.replica_of: dict[str, int] = {}

    def run(self) -> ClusterRunResult:
        """Step the replica due first, or take the next event when it comes before (or
        with) every step due: a KV hand-off ending, or the next arrival (first on a tie);
        then deliver the reports left and sum up."""
        handoffs = self.handoffs
        while True:
            rep = self._replica_due()
            if rep is not None:
                self._step(rep)
            elif (handoffs is not None and handoffs.due and handoffs.next_end() < self._next_arrival_time()
                  and handoffs.next_end() <= self.next_round):
                self._deliver(handoffs)
            elif self.next_round < self._next_arrival_time():
                self._migration_round()
            elif self.held and self._next_door_time() <= self._next_arrival_time():
                self._door_event()
            elif self.next_arrival < self.num_arrivals:
                self._route_next_arrival()
            else:
                break
        self._apply_reports(_INF)
        return self._result()

    def _next_arrival_time(self) -> float:
        return self.arrivals[self.next_arrival] if self.next_arrival < self.num_arrivals else _INF

    def _next_event_time(self) -> float:
        """When the next arrival, KV hand-off end or migration round comes (inf: none is
        left)."""
        t = min(self._next_arrival_time(), self.next_round)
        if self.held:
            t = min(t, self._next_door_time())
        return t if self.handoffs is None else min(t, self.handoffs.next_end())

    # -- the front door (flow control) --------------------------------------------------
    def _next_door_time(self) -> float:
        """While requests are held: when the next report reaches the router (it may let
        some through) or the next queue timeout passes."""
        t = self.reports[0].time if self.reports else _INF
        timeouts = self.timeouts
        while timeouts and timeouts[0][2].request_id not in self.held:
            heapq.heappop(timeouts)  # dispatched since
        return min(t, timeouts[0][0]) if timeouts else t

    def _door_event(self) -> None:
        """The next front-door event: reports due (which may let held requests through)
        or a held request's queue timeout (it is refused)."""
        timeouts = self.timeouts
        if timeouts and (not self.reports or timeouts[0][0] < self.reports[0].time):
            t, _, ticket = heapq.heappop(timeouts)
            self._apply_reports(t)
            self.now = t
            assert self.flow is not None
            error = self.flow.expire(ticket)
            if error is not None:
                req, _ = self.held.pop(ticket.request_id)
                self.tickets.pop(ticket.request_id)
                self._refuse(req, error)
            return
        self._apply_reports(self.reports[0].time)

    def _refuse(self, req: Request, error: SchedkitError) -> None:
        """Refused at the front door (``rejected_by`` ``front-door``)."""
        self.failed[req.request_id] = str(error)
        self.metrics.append(replace(_refused(req, self.start, str(error)), rejected_by="front-door"))

    def _admit(self, req: Request, w: WorkloadRequest, t: float) -> None:
        """The arrival at the front door: routed now, held, or refused."""
        assert self.flow is not None
        self.now = t
        try:
            ticket = self.flow.submit(req.request_id, req.tenant, req.priority,
                                      len(w.prompt_token_ids) + w.max_tokens, self.released.append)
        except EngineBusyError as err:
            self._refuse(req, err)
            return
        self.tickets[req.request_id] = ticket
        if ticket.dispatched and ticket not in self.released:
            self._place(req, w, t)
        else:
            self.held[req.request_id] = (req, w)
            heapq.heappush(self.timeouts, (t + self.flow.config.queue_timeout_s, ticket.seq, ticket))
        self._route_released(t)

    def _route_released(self, t: float) -> None:
        """Route, at ``t``, the held requests the front door just let through (and refuse
        those it displaced)."""
        while self.released:
            ticket = self.released.pop(0)
            req, w = self.held.pop(ticket.request_id)
            if ticket.error is not None:  # displaced by a newcomer while the door was full
                self.tickets.pop(ticket.request_id)
                self._refuse(req, ticket.error)
            else:
                self._place(req, w, t)

    def _left(self, rid: str) -> None:
        """Request ``rid`` ended (as the router learnt): its front-door slot frees."""
        ticket = self.tickets.pop(rid, None)
        if ticket is not None:
            assert self.flow is not None
            self.flow.leave(ticket)

    def _migration_round(self) -> None:
        """Ask the router which running requests to move (on what the replicas had
        reported by now) and stop each on its replica; the next round is due an
        interval later while anything is left to run."""
        t = self.next_round
        self._apply_reports(t)
        assert self.handoffs is not None
        for route_req, source, target, _ in self.router.plan_migrations(self.handoffs.in_flight):
            self._move(route_req.request_id, source, target, t)
        busy = self.live or self.next_arrival < self.num_arrivals or self.handoffs.due
        self.next_round = t + self.interval if busy else _INF

    def _move(self, rid: str, source: int, target: int, t: float) -> None:
        """Stop request ``rid`` on replica ``source`` at its step boundary (its step in
        progress, if one is, ends first), keeping its computed blocks, and start their
        hand-off to ``target``, where it resumes with its outputs, its events and its
        arrival time (so its metrics span both)."""
        assert self.handoffs is not None
        e = self.engines[source]
        try:  # as the engine process does it (migrate_out)
            moved = KVHandoffs(e).migrate_out([rid])
        except RequestError:  # it finished since the replica last reported
            return
        if moved is None:  # a step in flight: the next round may ask again
            return
        old, _ = moved
        new = Request(rid, old.prompt_token_ids, old.sampling_params, arrival_time=old.arrival_time,
                      priority=old.priority, tenant=old.tenant, ttft_slo_s=old.ttft_slo_s,
                      tpot_slo_s=old.tpot_slo_s, hints=old.hints)
        for token in old.output_token_ids:
            new.append_output_token_ids(token)
        new.events.extend(ev for ev in old.events if ev[0] is not EventType.FINISHED)  # it goes on
        new.num_preemptions = old.num_preemptions
        new.num_cached_tokens = old.num_cached_tokens
        new.num_recomputed_tokens = old.num_recomputed_tokens
        if self.hasher is not None:
            new.block_hashes.extend(old.block_hashes)
            new.set_block_hasher(self.hasher.extend, self.block_size)
        self.live[rid] = new
        self.handoffs.start_move(new, source, target, max(t, e.now()))
        self.router.migrated(rid, target)
        self.replica_of[rid] = target
        rep = self.replicas[source]
        rep.added = True  # its freed blocks may let a waiting request in
        self._schedule(rep)

    def _replica_due(self) -> _Replica | None:
        """The replica whose step starts first, if it starts before the next arrival
        or hand-off end (stale heap entries are dropped on the way)."""
        ready, replicas = self.ready, self.replicas
        t_next = self._next_event_time()
        while ready and ready[0][2] != replicas[ready[0][1]].version:
            heapq.heappop(ready)
        if ready and ready[0][0] < t_next:
            key, i, _ = heapq.heappop(ready)
            rep = replicas[i]
            rep.key = None
            rep.engine.advance_to(key)
            return rep
        return None

    def _next_step_time(self, rep: _Replica) -> float | None:
        """When the replica's next step starts (None: it has nothing to do)."""
        e = rep.engine
        if not e.has_requests():
            return None
        now = e.now()
        wait = e.next_arrival_in()
        if wait is not None and (e.last_step_empty or not e.scheduler.has_requests()):
            return now + wait  # idle until its next held arrival: the engine jumps there
        if e.last_step_empty and not rep.added:
            # Its last step ran nothing and nothing came since: like the engine's clock,
            # which then jumps to its next held arrival, it waits for the next arrival
            # or hand-off end (to anyone); with none left it steps on, as run_workload's
            # engine would.
            t = self._next_event_time()
            return max(now, t) if t < _INF else now
        return now

    def _schedule(self, rep: _Replica) -> None:
        """Put the replica's next step in the heap (a new version: older entries go stale)."""
        key = self._next_step_time(rep)
        if key == rep.key:
            return
        rep.version += 1
        rep.key = key
        if key is not None:
            heapq.heappush(self.ready, (key, rep.index, rep.version))

    def _step(self, rep: _Replica) -> None:
        """Run one step of the replica; record its tokens and finished requests, and
        queue its report to the router for when the step ends."""
        e = rep.engine
        before = e.now()
        outputs = e.step()
        now = e.now()
        rep.busy_s += now - before
        rep.added = False
        finished: list[tuple[str, bool]] = []
        prefilled: list[tuple[str, bool, bool]] = []
        prefilling = self.handoffs.prefilling if self.handoffs is not None else None
        for group in outputs.values():
            for o in group.outputs:
                if prefilling and o.request_id in prefilling:
                    self._prefill_output(o, rep.index, now, prefilled)
                elif self._record_output(o, now):
                    finished.append((o.request_id, o.error is not None))
        sched = e.scheduler
        rep.waiting_s += len(sched.waiting) * (now - before)
        rep.max_waiting = max(rep.max_waiting, len(sched.waiting))
        kv = sched.kv_cache_manager
        self.num_reports += 1
        heapq.heappush(self.reports, _Report(now, self.num_reports, rep.index,
                                             load_figures(sched, detail=self.router.predicts),
                                             kv.take_events(), finished, prefilled))
        self._schedule(rep)

    def _prefill_output(self, o: EngineCoreOutput, index: int, now: float,
                        prefilled: list[tuple[str, bool, bool]]) -> None:
        """An output of a disaggregated request's prefill copy on replica ``index``: its
        one token is not the request's (the decode replica produces every token); at its
        end the KV hand-off starts, or the request ends there (an error, a rejection)."""
        if o.finish_reason is None:
            return
        assert self.handoffs is not None
        rid = o.request_id
        ended = self.handoffs.prefill_ended(o, index, now)
        prefilled.append((rid, o.error is not None, ended is not None))
        if ended is None:
            return
        req, copy = ended
        if o.error is not None:
            self.failed[rid] = o.error
        self.metrics.append(replace(request_metrics(copy, [], self.start, o.error), max_tokens=req.max_tokens))

    def _record_output(self, o: EngineCoreOutput, now: float) -> bool:
        """One request's output of a step: its token times, and its metrics when it
        finished. Returns whether it finished."""
        rid = o.request_id
        times = self.token_times.get(rid)
        if times is not None and o.new_token_ids:
            times.extend([now] * len(o.new_token_ids))
        if o.finish_reason is None:
            return False
        ended = self.live.pop(rid, None)
        if o.error is not None:
            self.failed[rid] = o.error
        if ended is not None:
            times = self.token_times.pop(rid)
            if not ended.is_finished:  # refused when it arrived
                self.metrics.append(_refused(ended, self.start, o.error or "refused"))
            else:
                m = request_metrics(ended, times, self.start, self.failed.get(rid))
                if self.handoffs is not None and rid in self.handoffs.cached_tokens:
                    # disaggregated: its prompt was computed, and hit the cache, on its prefill replica
                    m = replace(m, num_cached_tokens=self.handoffs.cached_tokens.pop(rid))
                self.metrics.append(m)
        return True

    def _apply_reports(self, upto: float) -> None:
        """Deliver to the router every report due by ``upto``."""
        reports, router, flow = self.reports, self.router, self.flow
        while reports and reports[0].time <= upto:
            r = heapq.heappop(reports)
            self.now = r.time
            router.update_load(r.replica, **r.load._asdict(), now=r.time)
            if r.kv_events:
                router.apply_kv_events(r.replica, r.kv_events)
            for rid, bad in r.finished:
                router.finished(rid, failed=bad)
                if flow is not None:
                    self._left(rid)
            for rid, bad, ended in r.prefilled:
                router.prefill_done(rid, failed=bad)
                if ended:
                    router.finished(rid, failed=bad)
                    if flow is not None:
                        self._left(rid)
            if flow is not None:
                if flow.num_queued:
                    flow.pump()  # its new load may let held requests through
                if self.released:
                    self._route_released(r.time)

    def _route_next_arrival(self) -> None:
        """Route the next arrival, on what the replicas had reported by its arrival
        time, and add it to the chosen replica (a refusal is recorded as one)."""
        w = self.workload[self.order[self.next_arrival]]
        t = self.arrivals[self.next_arrival]
        self.next_arrival += 1
        self._apply_reports(t)
        req = Request(w.request_id, w.prompt_token_ids,
                      SamplingParams(max_tokens=w.max_tokens, eos_token_id=self.eos),
                      arrival_time=t, priority=w.priority, tenant=w.tenant,
                      ttft_slo_s=self.slo.class_target("ttft_s", w.tenant, w.priority),
                      hints=self.tenant_hints.get(w.tenant, NO_HINTS))
        if self.flow is not None:
            self._admit(req, w, t)
        else:
            self._place(req, w, t)

    def _place(self, req: Request, w: WorkloadRequest, t: float) -> None:
        """Route the request at ``t`` and add it to its replica (or start its prefill). A
        request held at the front door (it arrived before ``t``) keeps its arrival time;
        its replica's clock, if behind, first catches up with ``t`` (nothing ran there
        since: no replica runs ahead of an event that could reach it)."""
        try:
            placement = self.router.place(self._route_request(w, req), now=t)
        except RouteRefusedError as err:  # an admission plugin refused it
            self.failed[w.request_id] = str(err)
            self.metrics.append(replace(_refused(req, self.start, str(err)), rejected_by=err.plugin))
            if self.flow is not None:
                self._left(w.request_id)
            return
        j = placement.replica.index
        self.replica_of[w.request_id] = j
        first = j if placement.prefill is None else placement.prefill.index
        if req.arrival_time < t:
            self.engines[first].advance_to(t)
        if placement.prefill is not None:
            self._start_prefill(req, first, j, t)
        else:
            self._add(req, j, req.arrival_time)

    def _add(self, req: Request, index: int, arrival: float) -> None:
        """Add the request to replica ``index``, arrived at ``arrival`` (at or before the
        replica's clock, or held until then); a refusal is recorded as one."""
        rid = req.request_id
        rep = self.replicas[index]
        try:
            rep.engine.add_request_at(req, arrival)
        except SchedkitError as err:
            self.failed[rid] = str(err)
            self.metrics.append(_refused(req, self.start, str(err)))
            self.router.finished(rid, failed=True)
            if self.flow is not None:
                self._left(rid)
            return
        self.live[rid] = req
        self.token_times.setdefault(rid, [])  # a moved request keeps its token times
        rep.added = True
        self._schedule(rep)

    def _start_prefill(self, req: Request, prefill: int, decode: int, t: float) -> None:
        """A disaggregated request: its prefill copy goes to replica ``prefill`` (a
        refusal there ends the request)."""
        assert self.handoffs is not None
        copy = self.handoffs.prefill_copy(req)
        rep = self.replicas[prefill]
        try:
            rep.engine.add_request_at(copy, t)
        except SchedkitError as err:
            self.failed[req.request_id] = str(err)
            self.metrics.append(_refused(req, self.start, str(err)))
            self.router.prefill_done(req.request_id, failed=True)
            self.router.finished(req.request_id, failed=True)
            if self.flow is not None:
                self._left(req.request_id)
            return
        self.handoffs.started(req, copy, prefill, decode)
        rep.added = True
        self._schedule(rep)

    def _deliver(self, handoffs: Handoffs) -> None:
        """The first KV hand-off in flight ends: its prefill replica frees the blocks
        (and may schedule what waited for them), and the request reaches its decode
        replica, whose idle clock catches up with the hand-off's end."""
        req, handoff = handoffs.deliver()
        self._apply_reports(handoff.end)
        sender = self.replicas[handoff.prefill]
        sender.engine.advance_to(handoff.end)  # behind only when idle: it uses the blocks from now on
        sender.added = True
        self._schedule(sender)
        self.engines[handoff.decode].advance_to(handoff.end)
        self._add(req, handoff.decode, req.arrival_time)
        if self.released:  # it failed there: its front-door slot let a held request through
            self._route_released(handoff.end)

    def _route_request(self, w: WorkloadRequest, req: Request) -> RouteRequest:
        """What the router sees of the request. With prefix caching the prompt is hashed
        once, for the replica's prefix cache and the router both (the same hasher the
        schedulers build; a request that comes with its block hashes keeps them): on
        long-prompt traces hashing is a large share of the run."""
        if self.hasher is None:
            return self.router.make_request(w.request_id, w.prompt_token_ids, tenant=w.tenant,
                                            priority=w.priority, max_tokens=w.max_tokens, hints=req.hints)
        req.set_block_hasher(self.hasher.extend, self.block_size)
        # The prompt's blocks as they are now (the list grows with output blocks later).
        return self.router.make_request(w.request_id, req.prompt_token_ids, tenant=w.tenant,
                                        priority=w.priority, max_tokens=w.max_tokens,
                                        block_hashes=req.block_hashes[:], hints=req.hints)

    def _result(self) -> ClusterRunResult:
        """The run's metrics (sorted by arrival) and the replicas' and router's figures."""
        self.metrics.sort(key=lambda m: (m.arrival_time, m.request_id))
        engines = self.engines
        prefix = []
        for e in engines:
            totals = e.scheduler.kv_cache_manager.prefix_cache_totals
            prefix.append({"queries": totals.queries + totals.preempted_queries,
                           "hits": totals.hits + totals.preempted_hits})
        return ClusterRunResult(
            self.metrics, self.failed, sum(e.num_steps for e in engines),
            time.perf_counter() - self.wall0, self.start, num_replicas=len(engines),
            replica_of=self.replica_of, replica_steps=[e.num_steps for e in engines],
            replica_busy_s=[r.busy_s for r in self.replicas], engine_prefix_cache=prefix,
            router_stats=self.router.stats(),
            replica_roles=[r.role.value for r in self.router.replicas],
            replica_queue_depth=[r.waiting_s / r.busy_s if r.busy_s else 0.0 for r in self.replicas],
            prefill_of=dict(self.handoffs.prefill_of) if self.handoffs is not None else {},
            handoffs=list(self.handoffs.done) if self.handoffs is not None else [],
            moves=list(self.handoffs.moves) if self.handoffs is not None else [],
            replica_max_waiting=[r.max_waiting for r in self.replicas],
            flow_stats=self.flow.stats() if self.flow is not None else None)
