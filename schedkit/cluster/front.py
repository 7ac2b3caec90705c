"""The cluster front end: one client, the router, N replicas.

:class:`ClusterClient` is what a replicated :class:`~schedkit.llm.AsyncLLM` streams
through (``AsyncLLM.create(config)`` with ``replicas.count`` > 1; the sync ``LLM`` runs
that on a background loop). Per request it asks the router for a replica
(:meth:`Router.make_request` with the tenant, priority, ``max_tokens``, session id and
cache salt, then :meth:`Router.route`), sends the request there over that replica's own
:class:`~schedkit.engine.client.AsyncEngineClient` connection, streams its deltas back
and tells the router when it ends. Each replica's load reports (queue lengths, KV usage,
KV cache events) feed the router's view of it.

A replica that dies (its process exits, its Ray actor dies, or it sends nothing, not
even a heartbeat, for ``DEAD_AFTER_S``) is taken out of rotation at once and shut down.
Each of its outstanding requests then decides alone:

- it had produced no token (none reached the caller): it is re-routed to another replica
  and sent again under the same id; the caller's stream just goes on;
- it had produced tokens: its stream ends with ``finish_reason`` "error" and a one-line
  error naming the replica, its backend and the cause ("replica 1 (ray) died after this
  request produced 3 tokens: its worker process died (...)");
- no replica is left: EngineDeadError, as with one engine.

Nothing hangs: a connection's reader fails every waiting stream when its engine is found
dead, and when the client is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import msgspec

from schedkit.cluster.handoff import Cleanups, HandoffStats, hand_off
from schedkit.cluster.migration import Migrator
from schedkit.cluster.replicas import ReplicaSet, spawn_replicas
from schedkit.cluster.router import Router, replica_config
from schedkit.config import Config
from schedkit.core.hints import hints_from_wire
from schedkit.engine.client import AsyncEngineClient
from schedkit.engine.messages import (
    LoadReport,
    WireOutput,
    WireRequest,
    kv_events_from_wire,
    wire_max_tokens,
)
from schedkit.errors import EngineDeadError, RequestError

log = logging.getLogger("schedkit.cluster")

_SUMMED_DICTS = ("voluntary_preemptions", "num_rejected_by_plugin")
_COUNTERS = ("num_preemptions", "num_steps", "num_busy_steps", "prefix_cache_queries", "prefix_cache_hits",
             "voluntary_preemptions", "num_rejected_by_plugin", "num_hook_errors", "grammars_compiled",
             "grammar_compile_failures", "grammar_cache_hits", "jump_forward_tokens",
             "num_refused_connections", "grammar_compile_timeouts", "grammar_compiles_cancelled",
             "grammar_refusals", "grammar_step_budget_failures")
"""Stats that only grow: a dead replica's last values stay in the cluster totals."""


def _add(a: Any, b: Any) -> Any:
    """Two stats values of one key added (numbers, per-name counts, [plugin, hook, n] rows)."""
    if isinstance(a, dict):
        return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}
    if isinstance(a, list):
        merged: dict[tuple[str, str], int] = {}
        for plugin, hook, n in [*a, *b]:
            merged[(plugin, hook)] = merged.get((plugin, hook), 0) + n
        return [[p, h, n] for (p, h), n in merged.items()]
    return a + b
DEAD_SHUTDOWN_S = 2.0
"""Grace a replica found dead (or silent) gets to stop before it is killed."""


class ClusterClient:
    """The replicas' connections and the router (an ``AsyncCore`` for AsyncLLM).

    Use ``await ClusterClient.start(config)``, or ``AsyncLLM.create(config)`` with
    ``replicas.count`` > 1, which wraps it.

    Attributes:
        config: The front end's config (replicas run :func:`replica_config` of it).
        router: The router (its ``replicas`` are the router's view of each replica).
        replicas: The backend's replica handles (``replicas.handles[i]``: an
            EngineProcess for ``local``, a RayReplica for ``ray``).
        conns: One connection per replica, index order.
        num_lost_load_reports: Load reports a replica sent that never arrived (a gap
            in their sequence numbers; 0 unless something is badly wrong).
    """

    def __init__(self, config: Config, replicas: ReplicaSet, router: Router) -> None:
        self.config = config
        self.router = router
        self.replicas = replicas
        self.conns = [AsyncEngineClient(h, owns_engine=False, on_load=functools.partial(self._on_load, i),
                                        on_dead=functools.partial(self._on_dead, i))
                      for i, h in enumerate(replicas.handles)]
        self._active: set[str] = set()
        self._next_seq: list[int | None] = [None] * len(self.conns)
        self._closed = False
        self._shutdowns: list[asyncio.Future[None]] = []
        self.num_lost_load_reports = 0
        self.load_listeners: list[Callable[[], None]] = []
        """Called after every load report is folded in (the flow controller's pump)."""
        self._last_stats: dict[int, dict[str, Any]] = {}
        """Each replica's last stats answer (a dead one's counters stay in the totals)."""
        self.handoffs = HandoffStats()
        """The KV hand-offs of disaggregated requests (:mod:`schedkit.cluster.handoff`)."""
        self._cleanups = Cleanups()
        self.migrator = Migrator(config, router, self.conns, self._cleanups)
        """Moves running requests between replicas (:mod:`schedkit.cluster.migration`)."""

    @classmethod
    async def start(cls, config: Config) -> ClusterClient:
        """Start ``replicas.count`` replicas on ``replicas.backend`` and connect to each.

        Raises:
            ConfigError, PluginError: A bad config, router or engine plugin, or
                ``backend: ray`` without Ray installed (the message says how to install
                it); nothing is left running.
            EngineDeadError: A replica failed to start.
        """
        router = Router(config)
        rcfg = replica_config(config, transfer=router.has_roles or router.migrates)
        if config.replicas.backend == "ray":  # connecting to Ray blocks for seconds
            spawn = asyncio.ensure_future(asyncio.to_thread(spawn_replicas, rcfg))
            try:
                replicas = await asyncio.shield(spawn)
            except asyncio.CancelledError:  # the thread goes on: stop what it starts
                spawn.add_done_callback(_shutdown_when_spawned)
                raise
        else:  # spawned from the loop's thread (the engines' parent-death signal)
            replicas = spawn_replicas(rcfg)
        try:
            await asyncio.to_thread(replicas.wait_ready)
            client = cls(config, replicas, router)
        except BaseException:
            await asyncio.to_thread(replicas.shutdown)
            raise
        connects = [asyncio.ensure_future(c.connect()) for c in client.conns]
        try:
            await asyncio.gather(*connects)
        except BaseException:  # the other connects are cancelled, not left to fail alone
            for task in connects:
                task.cancel()
            await asyncio.gather(*connects, return_exceptions=True)
            await client.close()
            raise
        if router.migrates:
            client.migrator.start()
        return client

    # -- what the replicas report --------------------------------------------------------
    def _on_load(self, index: int, report: LoadReport) -> None:
        expected = self._next_seq[index]
        if expected is not None and report.seq != expected:
            self.num_lost_load_reports += report.seq - expected
            log.warning("replica %d: %d load reports lost", index, report.seq - expected)
        self._next_seq[index] = report.seq + 1
        router = self.router
        router.update_load(index, num_waiting=report.num_waiting, num_running=report.num_running,
                           kv_cache_usage=report.kv_cache_usage, num_prefill_tokens=report.num_prefill_tokens,
                           num_prefill_requests=report.num_prefill_requests,
                           prefill_attention=report.prefill_attention,
                           num_context_tokens=report.num_context_tokens,
                           decode_tokens_left=tuple(report.decode_tokens_left),
                           prefill_queue=tuple(report.prefill_queue))
        if report.kv_events:
            router.apply_kv_events(index, kv_events_from_wire(report.kv_events))
        for listener in self.load_listeners:
            listener()

    def _on_dead(self, index: int, error: EngineDeadError) -> None:
        if self._closed:
            return
        log.error("replica %d died: %s; it is out of rotation", index, error)
        self.router.replica_died(index)
        # Dead, or silent and maybe hung: make sure it is gone and frees what it holds.
        handle = self.replicas.handles[index]
        self._shutdowns.append(asyncio.ensure_future(asyncio.to_thread(handle.shutdown, DEAD_SHUTDOWN_S)))

    # -- the AsyncCore interface ---------------------------------------------------------
    @property
    def dead(self) -> EngineDeadError | None:
        if self._closed:
            return EngineDeadError("the client was closed")
        if any(c.dead is None for c in self.conns):
            return None
        reasons = "; ".join(f"replica {i}: {c.dead}" for i, c in enumerate(self.conns))
        return EngineDeadError(f"all {len(self.conns)} replicas died ({reasons})")

    def is_alive(self) -> bool:
        """At least one replica runs and answers."""
        return not self._closed and any(c.is_alive() for c in self.conns)

    async def stream(self, request: WireRequest, *,
                     session_id: str | None = None) -> AsyncGenerator[WireOutput, None]:
        """Route one request and stream its outputs from its replica, re-routing it if
        that replica dies before the request produced a token (module docstring). Its
        replica streams every delta, even of a ``final_only`` request: whether it
        produced a token decides what the replica's death does to it.

        Raises:
            EngineDeadError: No replica is left to take it.
            RequestError: Its id is already streaming in this client.
            RouteRefusedError: A router admission plugin refused it (its SLO class
                cannot be met now: ``slo-headroom`` with ``on_miss: refuse``).
        """
        rid = request.request_id
        if rid in self._active:
            raise RequestError(f"request {rid!r} is already streaming in this client "
                               "(request ids must be unique)", request_id=rid)
        router = self.router
        dead = self.dead
        if dead is not None:
            raise dead
        placement = router.place(router.make_request(
            rid, request.prompt_token_ids, tenant=request.tenant, priority=request.priority,
            max_tokens=wire_max_tokens(request), session_id=session_id, cache_salt=request.cache_salt,
            hints=hints_from_wire(request.hints, rid)))
        replica = placement.replica
        if request.final_only:
            request = msgspec.structs.replace(request, final_only=False)
        self._active.add(rid)
        produced = 0
        ended = False
        received = placement.prefill is not None
        """KV may have reached its replica for it (a hand-off)."""
        try:
            if placement.prefill is not None:
                await self._prefill(request, placement.prefill.index, replica.index)
            while True:
                index = replica.index
                try:
                    moved = None
                    async with contextlib.aclosing(self.conns[index].stream(request)) as outputs:
                        async for item in outputs:
                            if item.finish_reason == "migrated":  # stopped there to move
                                moved = item
                                break
                            produced += len(item.new_token_ids)
                            if item.finish_reason is not None:
                                ended = True
                                router.finished(rid, failed=item.finish_reason == "error")
                                self.migrator.whole_metrics(item)
                            yield item
                    if moved is None:
                        return
                    request, replica = await self.migrator.move(request, index, moved, produced)
                    received = True
                except EngineDeadError as e:
                    if self._closed:
                        ended = True
                        raise
                    router.replica_died(index)  # known already when its reader saw it die
                    if produced:
                        ended = True
                        router.finished(rid, failed=True)
                        router.num_failed_by_death += 1
                        yield WireOutput(rid, finish_reason="error", error=(
                            f"replica {index} ({self.replicas.backend}) died after this request "
                            f"produced {produced} tokens: {e}"))
                        return
                    try:
                        replica = router.reroute(rid)
                    except EngineDeadError:
                        ended = True  # the router forgot it
                        raise
                    log.info("request %r: replica %d died before its first token; re-routed "
                             "to replica %d", rid, index, replica.index)
        finally:
            self._active.discard(rid)
            self.migrator.forget(rid)
            if not ended:  # the caller left early: aborted on its replica
                router.finished(rid)
                if placement.prefill is not None:
                    router.prefill_done(rid)
                conn = self.conns[replica.index]
                if received and conn.dead is None:  # what reached it for the request is not needed
                    self._cleanups.spawn(conn.call_utility("kv_cancel", rid), f"request {rid!r}: kv_cancel")

    async def drain(self, index: int, timeout: float | None = None) -> None:
        """Empty replica ``index``: no new request goes there, and a migration plugin
        (``drain``) moves its requests away (without one they finish there); returns
        once nothing is outstanding on it.

        Raises:
            TimeoutError: Requests were still there after ``timeout`` seconds.
        """
        self.router.drain(index)
        replica = self.router.replicas[index]

        async def emptied() -> None:
            while replica.num_outstanding and replica.healthy:
                await asyncio.sleep(0.02)

        await asyncio.wait_for(emptied(), timeout)

    async def _prefill(self, request: WireRequest, prefill: int, decode: int) -> None:
        """A disaggregated request's prefill on replica ``prefill`` and the hand-off of
        its KV to replica ``decode`` (:mod:`schedkit.cluster.handoff`). Whatever goes
        wrong, the request then goes on to its decode replica, which computes what did
        not arrive."""
        rid = request.request_id
        copy = WireRequest(rid, request.prompt_token_ids, {"max_tokens": 1}, priority=request.priority,
                           tenant=request.tenant, cache_salt=request.cache_salt, kv_send=True,
                           ttft_slo_s=request.ttft_slo_s, hints=request.hints)
        last = None
        try:
            async with contextlib.aclosing(self.conns[prefill].stream(copy)) as outputs:
                async for item in outputs:
                    last = item
        except EngineDeadError:
            self.router.replica_died(prefill)
            self.router.prefill_done(rid)
            self.handoffs.fallbacks["prefill_died"] += 1
            log.info("request %r: its prefill replica %d died; replica %d computes its prompt",
                     rid, prefill, decode)
            return
        ok = last is not None and last.finish_reason in ("length", "stop") and last.kv_transfer_params
        self.router.prefill_done(rid, failed=not ok)
        if not ok:
            self.handoffs.fallbacks["prefill_failed"] += 1
            log.info("request %r: its prefill on replica %d ended with %s; replica %d computes its prompt",
                     rid, prefill, last.error or last.finish_reason if last else "nothing", decode)
            return
        assert last is not None and last.kv_transfer_params is not None
        await hand_off(self.conns[prefill], self.conns[decode], rid, last.kv_transfer_params,
                       len(request.prompt_token_ids), self.config.replicas.transfer_timeout_s,
                       self.handoffs, self._cleanups)

    async def stream_many(self, requests: Sequence[WireRequest]) -> AsyncGenerator[WireOutput, None]:
        """:meth:`stream` of every request at once, their outputs merged as they come.

        A request with an arrival offset is routed when it arrives (offset seconds after
        this call), with the replicas' load at that moment, as the cluster simulation
        does, instead of placing a whole trace at once. Leaving early aborts every request
        still running.

        Raises:
            EngineDeadError: No replica is left for one of them (the others are aborted).
        """
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        merged: asyncio.Queue[WireOutput | asyncio.Task[None]] = asyncio.Queue()

        async def one(w: WireRequest) -> None:
            if w.arrival_offset is not None:
                await asyncio.sleep(max(t0 + w.arrival_offset - loop.time(), 0.0))
                w = msgspec.structs.replace(w, arrival_offset=None)
            async with contextlib.aclosing(self.stream(w)) as outputs:
                async for o in outputs:
                    merged.put_nowait(o)

        tasks = [asyncio.create_task(one(w)) for w in requests]
        for task in tasks:
            task.add_done_callback(merged.put_nowait)  # after the task's own outputs
        try:
            num_running = len(tasks)
            while num_running:
                item = await merged.get()
                if isinstance(item, asyncio.Task):
                    num_running -= 1
                    item.result()  # raises what ended it
                else:
                    yield item
        finally:  # one failed (no replica left) or the caller left: abort the others
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def call_each(self, method: str, *args: Any) -> list[Any]:
        """Run a utility method on every live replica; its answer per replica, None for
        a dead one.

        Raises:
            EngineDeadError: Every replica is dead.
            SchedkitError: The method failed (a bad argument: the same on every replica).
        """
        dead = self.dead
        if dead is not None:
            raise dead

        async def one(conn: AsyncEngineClient) -> Any:
            if conn.dead is not None:
                return None
            try:
                return await conn.call_utility(method, *args)
            except EngineDeadError:
                return None

        results = await asyncio.gather(*(one(c) for c in self.conns), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return list(results)

    async def call_utility(self, method: str, *args: Any) -> Any:
        """A utility method on every live replica, answered as one engine would answer:

        - ``stats``: the replicas' counters summed (``kv_cache_usage`` averaged,
          ``prefix_cache_hit_rate`` recomputed), plus ``replicas`` (each replica's own
          stats with ``index`` and ``healthy``; a dead one: ``healthy`` False and
          ``error``) and ``router`` (:meth:`Router.stats`);
        - ``num_unfinished``: the sum; ``reset_prefix_cache``: True if every live replica
          reset; ``list_plugins``, ``set_pause_state``: the first live replica's answer
          (they run the same config);
        - anything else: the list :meth:`call_each` returns.
        """
        results = await self.call_each(method, *args)
        live = [r for r, c in zip(results, self.conns, strict=True) if c.dead is None and r is not None]
        if method == "stats":
            return self._stats(results)
        if not live:
            raise self.dead or EngineDeadError("no replica answered")
        if method == "num_unfinished":
            return sum(live)
        if method == "reset_prefix_cache":
            return all(live)
        if method in ("list_plugins", "set_pause_state", "shutdown"):
            return live[0]
        return results

    def _stats(self, results: list[Any]) -> dict[str, Any]:
        per: list[dict[str, Any]] = []
        live: list[dict[str, Any]] = []
        gone: list[dict[str, Any]] = []
        for i, (r, conn) in enumerate(zip(results, self.conns, strict=True)):
            if isinstance(r, dict) and conn.dead is None:
                per.append({"index": i, "healthy": True, **r})
                live.append(r)
                self._last_stats[i] = r
            else:
                per.append({"index": i, "healthy": False,
                            "error": str(conn.dead) if conn.dead is not None else "no answer"})
                if i in self._last_stats:
                    gone.append(self._last_stats[i])
        out = aggregate_stats(live)
        # A dead replica's counters stay in the totals (a counter never goes down), at
        # their last values; its load (running, waiting, KV) is gone with it.
        for key, value in aggregate_stats(gone).items():
            if key in _COUNTERS and key in out:
                out[key] = _add(out[key], value)
        out["replicas"] = per
        out["router"] = self.router.stats() | {"num_lost_load_reports": self.num_lost_load_reports}
        if self.router.has_roles:
            out["kv_transfer"] = self.handoffs.as_dict()
        if self.router.migrates:
            out["migration"] = self.migrator.stats.as_dict() | {"num_migrated": self.router.num_migrated}
        return out

    async def close(self) -> None:
        """Disconnect and stop every replica (streams still waiting end with
        EngineDeadError)."""
        if self._closed:
            return
        self._closed = True
        await self.migrator.stop()
        await self._cleanups.wait(self.config.replicas.transfer_timeout_s)
        await asyncio.gather(*(c.close() for c in self.conns), return_exceptions=True)
        await asyncio.gather(*self._shutdowns, return_exceptions=True)
        await asyncio.to_thread(self.replicas.shutdown)


def _shutdown_when_spawned(spawn: asyncio.Future[ReplicaSet]) -> None:
    """Stop the replicas a start that was cancelled went on to spawn (off the loop)."""
    if not spawn.cancelled() and spawn.exception() is None:
        threading.Thread(target=spawn.result().shutdown, name="schedkit-replica-shutdown",
                         daemon=True).start()


def aggregate_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's ``stats`` shape from several: numbers summed, except
    ``kv_cache_usage`` (the mean), ``now`` (the latest) and ``prefix_cache_hit_rate``
    (hits over queries); per-plugin counts summed; other values from the first."""
    out: dict[str, Any] = {}
    if not stats:
        return out
    for key in stats[0]:
        values = [s[key] for s in stats if key in s]
        first = values[0]
        if key == "num_hook_errors":
            merged: dict[tuple[str, str], int] = {}
            for v in values:
                for plugin, hook, n in v:
                    merged[(plugin, hook)] = merged.get((plugin, hook), 0) + n
            out[key] = [[p, h, n] for (p, h), n in merged.items()]
        elif key in _SUMMED_DICTS and all(isinstance(v, dict) for v in values):
            total: dict[str, Any] = {}
            for v in values:
                for k, n in v.items():
                    total[k] = total.get(k, 0) + n
            out[key] = total
        elif key == "kv_cache_usage":
            out[key] = sum(values) / len(values)
        elif key == "now":
            out[key] = max(values)
        elif all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            out[key] = sum(values)
        else:
            out[key] = first
    if "prefix_cache_hit_rate" in out:
        queries = out.get("prefix_cache_queries", 0)
        out["prefix_cache_hit_rate"] = out.get("prefix_cache_hits", 0) / queries if queries else 0.0
    return out
