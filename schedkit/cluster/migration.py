"""Live migration: running requests moved between a cluster's replicas, their streams
going on (docs/cluster.md#live-migration).

Every ``router.migration_interval_s`` the :class:`Migrator` asks the router which
requests to move (``schedkit_router_migrate``: the ``rebalance`` and ``drain`` plugins,
or a third-party one). Each move starts with ``migrate_out`` on the request's replica:
at its next step boundary the engine stops the request, keeps the full blocks of its
computed tokens (the ``kv-transfer`` connector, switched on in every replica of a
cluster that migrates) and ends its stream there with finish_reason "migrated" and its
state: the blocks, their hashes, its outputs so far. That last output comes after
every delta the request had, so the request's own stream in the front end
(:meth:`ClusterClient.stream`) has delivered exactly those outputs when it sees it; it
then calls :meth:`Migrator.move`, which hands the KV to the target as a disaggregated
prefill's is handed (:func:`~schedkit.cluster.handoff.hand_off`: only blocks the target
does not hold, under its backpressure) and resends the request with its outputs
(``WireRequest.resume_token_ids``). The target computes what did not arrive (at least
the last token), advances the request's grammar by its outputs, and samples on:
seeded sampling draws by position, n-gram drafts come from the tokens, so the tokens
are those the source would have produced.

A target that dies before the request is resent there is replaced by the source (or
another replica), which computes the KV itself; a source that dies before it stopped
the request fails it as any replica death does once tokens were produced.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import msgspec

from schedkit.cluster.handoff import Cleanups, HandoffStats, hand_off
from schedkit.cluster.router import Router
from schedkit.config import Config
from schedkit.core.routing import ReplicaState
from schedkit.engine.client import AsyncEngineClient
from schedkit.engine.messages import WireMetrics, WireOutput, WireRequest
from schedkit.errors import EngineDeadError, SchedkitError

log = logging.getLogger("schedkit.cluster")


class Migrator:
    """Args:
        config: The front end's config (``router.migration_interval_s``,
            ``replicas.transfer_timeout_s``).
        router: The cluster's router.
        conns: One connection per replica, index order.
        cleanups: Where best-effort releases run.

    Attributes:
        stats: The moved requests' KV hand-offs (``stats()["migration"]``).
    """

    def __init__(self, config: Config, router: Router, conns: Sequence[AsyncEngineClient],
                 cleanups: Cleanups) -> None:
        self.config = config
        self.router = router
        self.conns = conns
        self.cleanups = cleanups
        self.stats = HandoffStats()
        self.moving: dict[str, int] = {}
        """Requests asked to stop on their replica to move -> their target."""
        self.first_metrics: dict[str, WireMetrics] = {}
        """Moved requests -> their metrics on the replica they started on (until they end)."""
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start asking the router for moves (on the running loop)."""
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def forget(self, request_id: str) -> None:
        """The request's stream ended: a move asked for it no longer applies."""
        self.moving.pop(request_id, None)
        self.first_metrics.pop(request_id, None)

    def whole_metrics(self, out: WireOutput) -> None:
        """A moved request's last output: its metrics (its last replica's) made the whole
        request's, from its arrival on the first replica (:func:`merge_metrics`)."""
        first = self.first_metrics.pop(out.request_id, None)
        if first is not None and out.metrics is not None:
            out.metrics = merge_metrics(first, out.metrics)

    async def _loop(self) -> None:
        interval = self.config.router.migration_interval_s
        while True:
            await asyncio.sleep(interval)
            for req, source, target, reason in self.router.plan_migrations(self.moving):
                await self._start(req.request_id, source, target, reason)

    async def _start(self, rid: str, source: int, target: int, reason: str) -> None:
        """Ask replica ``source`` to stop ``rid`` for its move to ``target``."""
        if self.conns[source].dead is not None or self.conns[target].dead is not None:
            return
        self.moving[rid] = target
        try:
            started = await asyncio.wait_for(self.conns[source].call_utility("migrate_out", rid),
                                             self.config.replicas.transfer_timeout_s)
        except TimeoutError:
            # A stalled source: the call may still land and stop the request, so it stays
            # marked as moving (not asked again; its stream's end forgets it) and the
            # other replicas' moves go on.
            log.warning("request %r: replica %d did not answer migrate_out within %.1f s", rid, source,
                        self.config.replicas.transfer_timeout_s)
            return
        except (SchedkitError, EngineDeadError) as e:  # it finished meanwhile, or its replica died
            log.debug("request %r: not moved (%s)", rid, e)
            started = False
        if started:
            log.info("request %r: moving from replica %d to replica %d: %s", rid, source, target, reason)
        else:  # a step was in flight, or it is gone: the next round may ask again
            self.moving.pop(rid, None)

    async def move(self, request: WireRequest, source: int, moved: WireOutput,
                   produced: int) -> tuple[WireRequest, ReplicaState]:
        """Carry a request that stopped on replica ``source`` (``moved``: its last output
        there, its state in ``kv_transfer_params``; ``produced``: the tokens its stream
        delivered) over to its target: returns the request as the target resumes it, and
        the target.

        Raises:
            EngineDeadError: No replica is left to resume it on.
        """
        rid = request.request_id
        state = moved.kv_transfer_params or {}
        outputs = list(state.get("output_token_ids", ()))
        assert len(outputs) == produced, f"{rid}: moved with {len(outputs)} outputs, {produced} delivered"
        target = self.moving.pop(rid)
        if moved.metrics is not None:
            self.first_metrics[rid] = (merge_metrics(self.first_metrics[rid], moved.metrics)
                                       if rid in self.first_metrics else moved.metrics)
        tokens = len(request.prompt_token_ids) + len(outputs)
        why = await hand_off(self.conns[source], self.conns[target], rid, state, tokens,
                             self.config.replicas.transfer_timeout_s, self.stats, self.cleanups)
        router = self.router
        if why == "decode_died":
            router.replica_died(target)
            alive = [r for r in router.replicas if r.healthy and r.role.can_decode]
            if not alive:
                raise EngineDeadError(f"request {rid!r}: no replica left to resume it on")
            target = source if router.replicas[source].healthy else alive[0].index
        router.migrated(rid, target)
        log.info("request %r: moved from replica %d to replica %d after %d tokens%s", rid, source, target,
                 len(outputs), f" ({why}: it computes its KV itself)" if why else "")
        return msgspec.structs.replace(request, resume_token_ids=outputs), router.replicas[target]


def merge_metrics(first: WireMetrics, last: WireMetrics) -> WireMetrics:
    """One request's metrics over two replicas it ran on in turn: arrival, first
    scheduling and first token from the first, the end and the output count from the
    last, preemptions and recomputed tokens summed, queued stretches joined. (Engine
    clocks are each process's monotonic clock: comparable on one machine, not across
    nodes.)"""
    spans = list(first.queued_spans) + list(last.queued_spans)
    return msgspec.structs.replace(
        last, arrival_time=first.arrival_time,
        first_token_time=first.first_token_time if first.first_token_time is not None else last.first_token_time,
        first_scheduled_time=(first.first_scheduled_time if first.first_scheduled_time is not None
                              else last.first_scheduled_time),
        num_preemptions=first.num_preemptions + last.num_preemptions,
        num_cached_tokens=first.num_cached_tokens,
        num_recomputed_tokens=first.num_recomputed_tokens + last.num_recomputed_tokens,
        longest_wait_s=max((b - a for a, b in spans), default=None), queued_spans=spans)
