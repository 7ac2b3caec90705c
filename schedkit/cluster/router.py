"""The router: which replica gets each request, through the router hooks.

One decision: the open replicas -> the admission plugins (``schedkit_router_admit``:
refuse the request, or take it best effort, when its SLO class cannot be met) -> every
filter in turn -> every scorer (each plugin's scores times its ``router.weights`` entry,
summed per replica) -> the picker (first answer; the built-in ``BestScore`` last). With ``replicas.roles`` a request is
first either disaggregated or not (``schedkit_router_disaggregate``); a disaggregated
one then takes two such decisions, its prefill stage over the replicas that prefill and
its decode stage over those that decode (:meth:`Router.place`). The router keeps each replica's
:class:`~schedkit.core.routing.ReplicaState`: its outstanding requests (exact), its
queue lengths, KV usage and queued prefill work (as reported), and its prefix cache
(from its KV events). With a cost model (``router.latency_profile``, or the simulated
runner's profile) the hooks that take ``latency`` get the predicted TTFT and TPOT of the
request on each replica (:mod:`schedkit.cluster.latency`).

A router plugin that raises or answers nonsense never fails a request: its answer is
dropped for that decision, counted in :attr:`Router.errors` and logged (rate-limited),
and the others decide. Transport is not the router's business: the cluster front end
(:mod:`schedkit.cluster.front`) and the cluster simulation
(:mod:`schedkit.lab.cluster_sim`) call it.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from schedkit.cluster.latency import LatencyPredictor, RouterLatency
from schedkit.config import Config, PluginConfig, SLOTargets
from schedkit.core.hints import NO_HINTS, RequestHints
from schedkit.core.routing import (
    LatencyEstimate,
    Migration,
    Placement,
    ReplicaRole,
    ReplicaState,
    RouteAdmission,
    RouteEvent,
    RouteEventKind,
    RouteRequest,
    RouteStage,
    RouteVerdict,
)
from schedkit.engine.logs import RateLimitedLog
from schedkit.errors import ConfigError, EngineDeadError, RouteRefusedError
from schedkit.hookspecs import ROUTER_HOOK_NAMES
from schedkit.kv.events import KVCacheEvent
from schedkit.kv.hashing import BlockHasher
from schedkit.plugins.manager import describe_plugins, get_router_plugin_manager

log = logging.getLogger("schedkit.router")

ERROR_LOG_INTERVAL_S = 10.0

_Impl = tuple[Any, tuple[str, ...], str]

MAX_REASON_CHARS = 512
"""An admission plugin's reason is cut to this many characters."""


def _describe(answer: object) -> str:
    """A plugin's answer for a log line; its own __repr__ may raise."""
    try:
        text = repr(answer)
    except Exception:
        return f"a {type(answer).__name__}"
    return text if len(text) <= 200 else text[:200] + "..."


TRANSFER_PLUGIN = "kv-transfer"
"""The engine plugin every replica of a disaggregated cluster runs."""


def replica_config(config: Config, *, transfer: bool | None = None) -> Config:
    """The config each replica's engine runs: the same, with KV cache events on (the
    router's view of each prefix cache is built from them) and, when KV moves between
    engines (``transfer``; default: with ``replicas.roles``), the ``kv-transfer``
    connector switched on."""
    update: dict[str, Any] = {}
    if not config.cache.enable_kv_events:
        update["cache"] = config.cache.model_copy(update={"enable_kv_events": True})
    if transfer is None:
        transfer = config.replicas.roles is not None
    if transfer and all(p.name != TRANSFER_PLUGIN for p in config.plugins):
        update["plugins"] = [*config.plugins, PluginConfig(name=TRANSFER_PLUGIN)]
    return config.model_copy(update=update) if update else config


class Router:
    """Args:
        config: The whole config (its ``router`` and ``cache`` sections are read).
        num_replicas: Replicas behind the router (default ``replicas.count``).
        extra_plugins: Router plugin objects registered after the configured ones.
    """

    def __init__(self, config: Config, num_replicas: int | None = None, *,
                 extra_plugins: Iterable[Any] = ()) -> None:
        n = config.replicas.count if num_replicas is None else num_replicas
        assert n >= 1, "a router needs at least one replica"
        self.config = config
        self.plugin_manager = get_router_plugin_manager(config, extra_plugins=extra_plugins)
        self.replicas = [ReplicaState(i, role=ReplicaRole(config.replicas.role_of(i))) for i in range(n)]
        self.has_roles = any(r.role is not ReplicaRole.BOTH for r in self.replicas)
        """Roles are configured: requests may be disaggregated (:meth:`place`)."""
        self.weights = dict(config.router.weights)
        cache = config.cache
        self._hasher = BlockHasher(cache.block_size, cache.hash_algo) if cache.enable_prefix_caching else None
        self._impls: dict[str, tuple[_Impl, ...]] = {}
        for name in ROUTER_HOOK_NAMES:
            impls = getattr(self.plugin_manager.hook, name).get_hookimpls()
            self._impls[name] = tuple((i.function, tuple(i.argnames), i.plugin_name) for i in reversed(impls))
        self.migrates = bool(self._impls["schedkit_router_migrate"])
        """A plugin may move running requests (``schedkit_router_migrate``)."""
        scorers = {plugin for _, _, plugin in self._impls["schedkit_router_score"]}
        idle = sorted(set(self.weights) - scorers)
        if idle:
            raise ConfigError(f"router.weights: {idle} implement no scorer (schedkit_router_score); "
                              f"the scoring plugins switched on are {sorted(scorers) or 'none'}")
        self.errors: Counter[tuple[str, str]] = Counter()
        """Router-hook errors so far by ``(plugin, hook)``: raises and bad answers."""
        self._error_log = RateLimitedLog(log, ERROR_LOG_INTERVAL_S)
        self._placed: dict[str, tuple[RouteRequest, int]] = {}
        """Outstanding requests: id -> (request, replica index: whole or decode stage)."""
        self._prefilling: dict[str, tuple[RouteRequest, int]] = {}
        """Disaggregated requests whose prefill is under way: id -> (request, replica index)."""
        self.num_rerouted = 0
        self.num_failed_by_death = 0
        self.num_disaggregated = 0
        """Requests placed on a prefill and a decode replica."""
        self.num_migrated = 0
        """Requests moved, running, to another replica."""
        self.num_refused: Counter[str] = Counter()
        """Requests an admission plugin refused, by SLO class (``-``: none)."""
        self.num_downgraded: Counter[str] = Counter()
        """Requests an admission plugin routed best effort, by SLO class."""
        self.latency_predictor = LatencyPredictor.from_config(config)
        """Predicts each replica's TTFT and TPOT (None without a cost-model profile)."""
        asking = sorted({plugin for impls in self._impls.values() for _, names, plugin in impls if "latency" in names})
        if asking and self.latency_predictor is None:
            raise ConfigError(f"router plugins {asking} predict latency (their hooks take `latency`), which needs a "
                              "cost-model profile: set router.latency_profile (a bundled profile such as "
                              "cpu-smollm2-135m, or a file fitted by `schedkit calibrate`)")
        self.predicts = bool(asking)
        """A plugin asks for latency predictions: the replicas' reports should carry
        their queued prefill work (the cluster simulation reads it only then)."""
        self._latency = RouterLatency(self.latency_predictor, n) if self.latency_predictor is not None else None

    # -- requests ------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_token_ids: Sequence[int], *, tenant: str = "default",
                     priority: int = 0, max_tokens: int | None = None, session_id: str | None = None,
                     cache_salt: str | None = None, block_hashes: list[bytes] | None = None,
                     hints: RequestHints = NO_HINTS) -> RouteRequest:
        """A RouteRequest whose block hashes match the replicas' prefix caches
        (``block_hashes``: the prompt's, already computed the same way, e.g. by the
        engine's own Request in the cluster simulation)."""
        hasher = self._hasher
        if hasher is None:
            return RouteRequest(request_id, prompt_token_ids, tenant=tenant, priority=priority,
                                max_tokens=max_tokens, session_id=session_id, hints=hints,
                                slo=self._slo(hints))

        def hashes(tokens: Sequence[int]) -> list[bytes]:
            if block_hashes is not None:
                return block_hashes
            out: list[bytes] = []
            hasher.extend(tokens, out, cache_salt)
            return out

        return RouteRequest(request_id, prompt_token_ids, tenant=tenant, priority=priority,
                            max_tokens=max_tokens, session_id=session_id, hash_fn=hashes,
                            block_size=hasher.block_size, hints=hints, slo=self._slo(hints))

    def _slo(self, hints: RequestHints) -> SLOTargets | None:
        return self.config.slo_classes.get(hints.slo_class) if hints.slo_class is not None else None

    def route(self, request: RouteRequest, *, now: float | None = None) -> ReplicaState:
        """Choose a healthy replica for the whole of ``request`` (never disaggregated:
        with roles, among the replicas that decode) and count it as outstanding there.
        ``now``: the decision's time on the router's clock, as the replicas' reports
        are stamped (default ``time.monotonic()``; the cluster simulation's virtual
        clock). The admission plugins are asked first, unless the request is routed
        again (its replica died).

        Raises:
            EngineDeadError: No replica is healthy.
            RouteRefusedError: An admission plugin refused it.
        """
        self._begin(request, now)
        return self._route_whole(request, admit=request.attempt == 0)

    def _route_whole(self, request: RouteRequest, *, admit: bool) -> ReplicaState:
        assert request.request_id not in self._placed, f"{request.request_id} is already routed"
        candidates = self._open() or [r for r in self.replicas if r.healthy]
        if not candidates:
            raise EngineDeadError(f"no replica left to take request {request.request_id!r}: "
                                  f"all {len(self.replicas)} died")
        if self.has_roles:
            candidates = [r for r in candidates if r.role.can_decode] or candidates
        if admit:
            self._admit(request, candidates)
        return self._decide(request, RouteStage.WHOLE, candidates)

    def _begin(self, request: RouteRequest, now: float | None) -> None:
        """A decision about ``request`` starts at ``now``: fresh latency predictions."""
        if self._latency is not None:
            self._latency.begin(request, time.monotonic() if now is None else now)

    def estimate(self, request: RouteRequest, index: int, *, now: float | None = None) -> LatencyEstimate:
        """The TTFT and TPOT ``request`` is predicted to get on replica ``index`` if it
        is routed there at ``now`` (default ``time.monotonic()``), as the hooks'
        ``latency`` answers it.

        Raises:
            ConfigError: The router has no cost model (``router.latency_profile``).
        """
        if self._latency is None:
            raise ConfigError("latency predictions need a cost-model profile: set router.latency_profile")
        self._latency.begin(request, time.monotonic() if now is None else now)
        return self._latency.estimate(request, self.replicas[index])

    def place(self, request: RouteRequest, *, now: float | None = None) -> Placement:
        """Place ``request``: without roles as :meth:`route`; with roles, first decide
        whether it is disaggregated (``schedkit_router_disaggregate``), then choose its
        prefill replica (stage PREFILL, among the replicas that prefill) and its decode
        replica (stage DECODE, among those that decode, less the prefill one), or the one
        replica that serves it whole. Each chosen replica counts it as outstanding: the
        prefill replica until :meth:`prefill_done`, the other until :meth:`finished`.
        ``now`` and the admission plugins as for :meth:`route`.

        Raises:
            EngineDeadError: No replica is healthy.
            RouteRefusedError: An admission plugin refused it.
        """
        if not self.has_roles:
            return Placement(self.route(request, now=now))
        self._begin(request, now)
        healthy = self._open()
        decode = [r for r in healthy if r.role.can_decode]
        # the one replica left to decode (a ``both`` one) cannot also be the prefill one
        prefill = [r for r in healthy if r.role.can_prefill and not (len(decode) == 1 and r is decode[0])]
        if not (prefill and decode and self._disaggregate(request, prefill, decode)):
            return Placement(self._route_whole(request, admit=request.attempt == 0))
        assert request.request_id not in self._placed, f"{request.request_id} is already routed"
        self._admit(request, healthy)
        first = self._decide(request, RouteStage.PREFILL, prefill)
        self.num_disaggregated += 1
        return Placement(self._decide(request, RouteStage.DECODE, [r for r in decode if r is not first]), first)

    def _open(self) -> list[ReplicaState]:
        """The replicas that take new requests: healthy and not draining."""
        return [r for r in self.replicas if r.healthy and not r.draining]

    def _decide(self, request: RouteRequest, stage: RouteStage, candidates: list[ReplicaState]) -> ReplicaState:
        """One routing decision over ``candidates`` (filters, scorers, picker), counted
        at the replica chosen and announced to the observers."""
        request.stage = stage
        candidates = self._filter(request, candidates)
        scores = self._score(request, candidates)
        replica = self._pick(request, candidates, scores)
        replica.num_outstanding += 1
        replica.num_routed += 1
        if self.predicts:
            assert self._latency is not None
            self._latency.routed(request, replica, stage)
        table = self._prefilling if stage is RouteStage.PREFILL else self._placed
        table[request.request_id] = (request, replica.index)
        self._emit(RouteEvent(RouteEventKind.ROUTED, request, replica,
                              {r.index: s for r, s in zip(candidates, scores, strict=True)}, stage))
        return replica

    def prefill_done(self, request_id: str, *, failed: bool = False) -> None:
        """A disaggregated request's prefill ended on its prefill replica, its KV on its
        way to the decode replica (``failed``: the prefill failed, and so does the
        request). Unknown ids are ignored."""
        self._end(self._prefilling, request_id, failed, RouteStage.PREFILL)

    def replica_of(self, request_id: str) -> int | None:
        """The replica an outstanding request is on (None once it finished)."""
        placed = self._placed.get(request_id)
        return placed[1] if placed is not None else None

    def finished(self, request_id: str, *, failed: bool = False) -> None:
        """The request ended on its replica (``failed``: with an error). Unknown ids
        (finished already, never routed) are ignored."""
        self._end(self._placed, request_id, failed)

    def _end(self, table: dict[str, tuple[RouteRequest, int]], request_id: str, failed: bool,
             stage: RouteStage | None = None) -> None:
        """Take a placement out of ``table``: its replica has one request fewer
        outstanding, and observers hear it finished (or failed) at ``stage`` (default the
        request's own)."""
        placed = table.pop(request_id, None)
        if placed is None:
            return
        request, index = placed
        replica = self.replicas[index]
        replica.num_outstanding -= 1
        self._emit(RouteEvent(RouteEventKind.FAILED if failed else RouteEventKind.FINISHED, request, replica,
                              stage=request.stage if stage is None else stage))

    def replica_died(self, index: int) -> list[RouteRequest]:
        """Take replica ``index`` out of rotation; returns its outstanding requests (still
        counted there until :meth:`reroute` or :meth:`finished` is called for each)."""
        replica = self.replicas[index]
        if replica.healthy:
            log.error("%s died; %d requests were outstanding there", replica.name, replica.num_outstanding)
        replica.healthy = False
        replica.cached_blocks.clear()
        return [req for req, i in self._placed.values() if i == index]

    def reroute(self, request_id: str) -> ReplicaState:
        """Route an outstanding request again (its replica died before it produced a
        token): a REROUTED event for the old replica, then a new decision.

        Raises:
            EngineDeadError: No healthy replica is left (the request is forgotten).
        """
        request, index = self._placed.pop(request_id)
        old = self.replicas[index]
        old.num_outstanding -= 1
        self._emit(RouteEvent(RouteEventKind.REROUTED, request, old))
        request.attempt += 1
        self.num_rerouted += 1
        return self.route(request)

    # -- migration -----------------------------------------------------------------------
    def plan_migrations(self, moving: Iterable[str] = ()) -> list[tuple[RouteRequest, int, int, str]]:
        """Ask ``schedkit_router_migrate`` which outstanding requests to move now:
        ``(request, source, target, reason)`` for each valid move (``moving``: requests
        already on their way, not offered)."""
        hook = "schedkit_router_migrate"
        impls = self._impls[hook]
        if not impls:
            return []
        busy = set(moving)
        requests: dict[int, list[RouteRequest]] = {r.index: [] for r in self.replicas if r.healthy}
        for rid, (req, index) in self._placed.items():
            if index in requests and rid not in busy and rid not in self._prefilling:
                requests[index].append(req)
        kwargs = {"replicas": self.replicas, "requests": requests}
        for fn, argnames, plugin in impls:
            ok, answer = self._call(fn, argnames, plugin, hook, kwargs)
            if not ok or answer is None:
                continue
            moves = self._listed(plugin, hook, answer, "Migration")
            if moves is None:
                continue
            if not all(isinstance(m, Migration) for m in moves):
                self._bad(plugin, hook, f"answered {_describe(answer)}, not a list of Migration")
                continue
            return self._valid_moves(plugin, hook, moves, requests)
        return []

    def _valid_moves(self, plugin: str, hook: str, moves: list[Migration],
                     requests: dict[int, list[RouteRequest]]) -> list[tuple[RouteRequest, int, int, str]]:
        offered = {req.request_id: index for index, reqs in requests.items() for req in reqs}
        out: list[tuple[RouteRequest, int, int, str]] = []
        seen: set[str] = set()
        for m in moves:
            source = offered.get(m.request_id)
            target = m.target
            if source is None or m.request_id in seen:
                why = "named twice" if m.request_id in seen else "not an outstanding request it was offered"
                self._bad(plugin, hook, f"moves {m.request_id!r}: {why}")
                continue
            if not (type(target) is int and 0 <= target < len(self.replicas)) or target == source:
                self._bad(plugin, hook, f"moves {m.request_id!r} to {target!r}: not another replica's index")
                continue
            r = self.replicas[target]
            if not (r.healthy and not r.draining and r.role.can_decode):
                self._bad(plugin, hook, f"moves {m.request_id!r} to {r.name}, which is "
                                        f"{'draining' if r.draining else 'unhealthy' if not r.healthy else r.role.value}")
                continue
            seen.add(m.request_id)
            out.append((self._placed[m.request_id][0], source, target, str(m.reason)))
        return out

    def migrated(self, request_id: str, target: int) -> None:
        """The request now runs on replica ``target`` (a MIGRATED event for its old one).
        Unknown ids are ignored."""
        placed = self._placed.get(request_id)
        if placed is None:
            return
        request, source = placed
        old, new = self.replicas[source], self.replicas[target]
        old.num_outstanding -= 1
        new.num_outstanding += 1
        self._placed[request_id] = (request, target)
        self.num_migrated += 1
        self._emit(RouteEvent(RouteEventKind.MIGRATED, request, old, target=new))

    def drain(self, index: int) -> None:
        """Take replica ``index`` out of rotation for new requests (its own go on, or move
        away through ``schedkit_router_migrate``: the ``drain`` plugin)."""
        self.replicas[index].draining = True

    # -- what replicas report ------------------------------------------------------------
    def update_load(self, index: int, *, num_waiting: int, num_running: int, kv_cache_usage: float,
                    num_prefill_tokens: int = 0, num_prefill_requests: int = 0, prefill_attention: float = 0.0,
                    num_context_tokens: int = 0, decode_tokens_left: Sequence[int] = (),
                    prefill_queue: Sequence[tuple[int, int, int]] = (), now: float | None = None) -> None:
        """Replica ``index``'s load report (:class:`~schedkit.engine.load.LoadFigures`),
        received at ``now`` on the router's clock (default ``time.monotonic()``; the
        cluster simulation: the end of the step it reports)."""
        r = self.replicas[index]
        r.num_waiting, r.num_running, r.kv_cache_usage = num_waiting, num_running, kv_cache_usage
        r.num_prefill_tokens, r.num_prefill_requests = num_prefill_tokens, num_prefill_requests
        r.prefill_attention, r.num_context_tokens = prefill_attention, num_context_tokens
        r.decode_tokens_left, r.prefill_queue = tuple(decode_tokens_left), tuple(prefill_queue)
        r.reported_at = time.monotonic() if now is None else now

    def apply_kv_events(self, index: int, events: Iterable[KVCacheEvent]) -> None:
        """Fold a replica's KV cache events into its prefix-cache view (ignored once the
        replica is out of rotation)."""
        r = self.replicas[index]
        if r.healthy:
            r.cached_blocks.apply(events)

    # -- the decision's phases -----------------------------------------------------------
    def _bad(self, plugin: str, hook: str, why: str) -> None:
        self.errors[(plugin, hook)] += 1
        self._error_log.error("router plugin %r, hook %s: %s (its answer is ignored)", plugin, hook, why)

    def _call(self, fn: Any, argnames: tuple[str, ...], plugin: str, hook: str,
              kwargs: dict[str, Any]) -> tuple[bool, Any]:
        try:
            return True, fn(*[kwargs[a] for a in argnames])
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # a plugin's exit() must not end the front end
            self._bad(plugin, hook, f"raised {type(e).__name__}: {e}")
            return False, None

    def _listed(self, plugin: str, hook: str, answer: Any, what: str) -> list[Any] | None:
        """A plugin's answer as a list (a generator runs plugin code here: its raise is
        the plugin's bad answer, counted, and None)."""
        try:
            return list(answer)
        except Exception as e:
            self._bad(plugin, hook, f"answered {_describe(answer)}, not a list of {what} "
                                    f"({type(e).__name__}: {e})")
            return None

    def _admit(self, request: RouteRequest, candidates: list[ReplicaState]) -> None:
        """Ask the admission plugins about ``request``: the first answer decides (none:
        admitted).

        Raises:
            RouteRefusedError: A plugin answered REFUSE.
        """
        hook = "schedkit_router_admit"
        kwargs = {"request": request, "replicas": candidates, "latency": self._latency}
        for fn, argnames, plugin in self._impls[hook]:
            ok, answer = self._call(fn, argnames, plugin, hook, kwargs)
            if not ok or answer is None:
                continue
            if not (isinstance(answer, RouteAdmission) and isinstance(answer.verdict, RouteVerdict)
                    and isinstance(answer.reason, str)):
                self._bad(plugin, hook, f"answered {_describe(answer)}, not a RouteAdmission or None")
                continue
            slo_class = request.hints.slo_class
            if answer.verdict is RouteVerdict.REFUSE:
                self.num_refused[slo_class or "-"] += 1
                reason = answer.reason[:MAX_REASON_CHARS] or "it gave no reason"
                raise RouteRefusedError(f"request {request.request_id!r} refused by router plugin {plugin!r}: "
                                        f"{reason}", request_id=request.request_id, plugin=plugin,
                                        slo_class=slo_class, reason=reason)
            if answer.verdict is RouteVerdict.DOWNGRADE:
                self.num_downgraded[slo_class or "-"] += 1
            return

    def _disaggregate(self, request: RouteRequest, prefill: list[ReplicaState],
                      decode: list[ReplicaState]) -> bool:
        """The first bool a ``schedkit_router_disaggregate`` plugin answers (False when
        none does)."""
        hook = "schedkit_router_disaggregate"
        kwargs = {"request": request, "prefill_replicas": prefill, "decode_replicas": decode}
        for fn, argnames, plugin in self._impls[hook]:
            ok, answer = self._call(fn, argnames, plugin, hook, kwargs)
            if not ok or answer is None:
                continue
            if type(answer) is bool:
                return answer
            self._bad(plugin, hook, f"answered {_describe(answer)}, not True, False or None")
        return False

    def _filter(self, request: RouteRequest, candidates: list[ReplicaState]) -> list[ReplicaState]:
        hook = "schedkit_router_filter"
        for fn, argnames, plugin in self._impls[hook]:
            ok, answer = self._call(fn, argnames, plugin, hook, {"request": request, "replicas": candidates,
                                                                 "latency": self._latency})
            if not ok or answer is None:
                continue
            kept = self._listed(plugin, hook, answer, "replicas")
            if kept is None:
                continue
            allowed = {id(r) for r in candidates}
            if any(id(r) not in allowed for r in kept):
                self._bad(plugin, hook, "answered a replica that is not a candidate")
            elif not kept:
                self._bad(plugin, hook, "left no candidate")
            else:
                chosen = {id(r) for r in kept}
                candidates = [r for r in candidates if id(r) in chosen]
        return candidates

    def _score(self, request: RouteRequest, candidates: list[ReplicaState]) -> list[float]:
        hook = "schedkit_router_score"
        total = [0.0] * len(candidates)
        for fn, argnames, plugin in self._impls[hook]:
            weight = self.weights.get(plugin, 1.0)
            if not weight:
                continue
            ok, answer = self._call(fn, argnames, plugin, hook, {"request": request, "replicas": candidates,
                                                                 "latency": self._latency})
            if not ok or answer is None:
                continue
            try:  # a generator, or an object's __float__, runs plugin code here
                scores = [float(s) for s in answer]
            except Exception as e:
                self._bad(plugin, hook, f"answered {_describe(answer)}, not a list of numbers "
                          f"({type(e).__name__}: {e})")
                continue
            if len(scores) != len(candidates) or not all(math.isfinite(s) for s in scores):
                self._bad(plugin, hook, f"answered {len(scores)} scores for {len(candidates)} "
                          "candidates, or a score that is not finite")
                continue
            for i, s in enumerate(scores):
                total[i] += weight * s
        return total

    def _pick(self, request: RouteRequest, candidates: list[ReplicaState], scores: list[float]) -> ReplicaState:
        hook = "schedkit_router_pick"
        kwargs = {"request": request, "replicas": candidates, "scores": scores, "latency": self._latency}
        allowed = {id(r) for r in candidates}
        for fn, argnames, plugin in self._impls[hook]:
            ok, answer = self._call(fn, argnames, plugin, hook, kwargs)
            if not ok or answer is None:
                continue
            if id(answer) in allowed:
                return answer  # type: ignore[no-any-return]
            self._bad(plugin, hook, f"answered {_describe(answer)}, which is not a candidate")
        # Every picker failed, the built-in included (it cannot, but a plugin can block
        # it): the first candidate, so the request still goes somewhere.
        return candidates[0]

    def _emit(self, event: RouteEvent) -> None:
        hook = "schedkit_on_route_event"
        for fn, argnames, plugin in self._impls[hook]:
            self._call(fn, argnames, plugin, hook, {"event": event})

    # -- reporting -----------------------------------------------------------------------
    def list_plugins(self) -> list[tuple[str, list[str]]]:
        return describe_plugins(self.plugin_manager)

    def stats(self) -> dict[str, Any]:
        plugins = [(name, [h for h in hooks if h in ROUTER_HOOK_NAMES]) for name, hooks in self.list_plugins()]
        return {
            "policy": self.config.router.policy,
            "plugins": [name for name, _ in plugins],
            "plugin_hooks": [[name, hooks] for name, hooks in plugins],
            "replicas": [{"index": r.index, "role": r.role.value, "healthy": r.healthy, "draining": r.draining,
                          "num_outstanding": r.num_outstanding,
                          "num_routed": r.num_routed, "num_waiting": r.num_waiting,
                          "num_running": r.num_running, "kv_cache_usage": r.kv_cache_usage,
                          "num_prefill_tokens": r.num_prefill_tokens,
                          "num_cached_blocks": len(r.cached_blocks)} for r in self.replicas],
            "num_rerouted": self.num_rerouted,
            "num_failed_by_death": self.num_failed_by_death,
            "num_disaggregated": self.num_disaggregated,
            "num_migrated": self.num_migrated,
            "num_refused": dict(sorted(self.num_refused.items())),
            "num_downgraded": dict(sorted(self.num_downgraded.items())),
            "latency_profile": self.latency_predictor.cost_model.name if self.latency_predictor is not None else None,
            "num_hook_errors": [[p, h, n] for (p, h), n in self.errors.items()],
        }
