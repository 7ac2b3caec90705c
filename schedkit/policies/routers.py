"""Built-in router plugins: which replica gets a request (docs/cluster.md).

Each is a class (its settings are the constructor's keyword arguments) implementing some
of the router hooks: filters narrow the candidates, scorers score them 0..1, a picker
chooses. ``BestScore`` is the default picker every router has (registered ``trylast``):
the highest weighted score wins; ties go to the first candidate after the replica that
got the previous request, so a router with no scorer is round-robin.

The load a router sees at once is ``ReplicaState.num_outstanding`` (requests routed to a
replica and not finished; the router's own count), so the load-aware scorers use it
rather than the queue lengths a replica reports now and then.

``Rebalance`` and ``Drain`` move running requests between replicas (live migration,
``schedkit_router_migrate``).

``SLOHeadroom`` routes by the router's latency predictions (the hooks' ``latency``
argument: each replica's predicted TTFT and TPOT for the request, from the cost model)
against the request's SLO class, and refuses or downgrades a request whose class no
replica can meet (``schedkit_router_admit``).

With ``replicas.roles``, ``SelectivePD`` decides which requests are disaggregated, and
the rotations (``BestScore``'s ties, ``RoundRobin``, ``SessionAffinity``'s homes) keep
prefill stages apart from the rest: prefill replicas and decode replicas each take
their turn among themselves.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from schedkit.config import SLOTargets
from schedkit.core.routing import (
    LatencyEstimate,
    Migration,
    ReplicaState,
    RouteAdmission,
    RouteEvent,
    RouteEventKind,
    RouteLatency,
    RouteRequest,
    RouteStage,
    RouteVerdict,
)
from schedkit.hookspecs import hookimpl
from schedkit.policies.common import check_int, check_number

__all__ = ["BestScore", "Drain", "KVUsage", "LeastOutstanding", "PrefixAffinity", "Rebalance", "RoundRobin",
           "SLOHeadroom", "SelectivePD", "SessionAffinity", "Weighted", "free_kv_scores", "least_outstanding_scores", "num_uncached_tokens",
           "prefix_scores"]


def _next_after(replicas: Sequence[ReplicaState], last: int) -> int:
    """Position in ``replicas`` of the first one whose index follows ``last`` (wrapping)."""
    for pos, r in enumerate(replicas):
        if r.index > last:
            return pos
    return 0


def least_outstanding_scores(replicas: Sequence[ReplicaState]) -> list[float]:
    """1 for the least loaded candidate, 0 for the most loaded, linear between (all 1
    when every candidate has the same load)."""
    loads = [r.num_outstanding for r in replicas]
    lo, hi = min(loads), max(loads)
    if hi == lo:
        return [1.0] * len(loads)
    return [(hi - x) / (hi - lo) for x in loads]


def prefix_scores(request: RouteRequest, replicas: Sequence[ReplicaState]) -> list[float]:
    """The fraction of the prompt's full blocks each candidate's prefix cache holds from
    the start (its prefix-cache hit for this request); all 0 for a prompt shorter than
    one block."""
    hashes = request.block_hashes
    if not hashes:
        return [0.0] * len(replicas)
    n = len(hashes)
    return [r.cached_blocks.num_matched_blocks(hashes) / n for r in replicas]


def num_uncached_tokens(request: RouteRequest, replicas: Sequence[ReplicaState]) -> int:
    """Prompt tokens that the candidate with the longest cached prefix does not hold
    (the whole prompt when no candidate holds any of it, or without prefix caching)."""
    hashes = request.block_hashes
    best = max(r.cached_blocks.num_matched_blocks(hashes) for r in replicas) if hashes and replicas else 0
    return request.num_prompt_tokens - best * request.block_size


def _is_prefill(stage: RouteStage) -> bool:
    """Prefill stages rotate apart from whole requests and decode stages."""
    return stage is RouteStage.PREFILL


def free_kv_scores(replicas: Sequence[ReplicaState]) -> list[float]:
    """``1 - kv_cache_usage`` of each candidate, as it last reported (clamped to 0..1)."""
    return [1.0 - min(max(r.kv_cache_usage, 0.0), 1.0) for r in replicas]


class BestScore:
    """The default picker: highest score, ties rotate (round-robin among equals; prefill
    stages in a rotation of their own)."""

    def __init__(self) -> None:
        self.last = {False: -1, True: -1}

    @hookimpl(trylast=True)
    def schedkit_router_pick(self, request: RouteRequest, replicas: Sequence[ReplicaState],
                             scores: Sequence[float]) -> ReplicaState:
        best = max(scores)
        start = _next_after(replicas, self.last[_is_prefill(request.stage)])
        n = len(replicas)
        for k in range(n):
            pos = (start + k) % n
            if scores[pos] == best:
                return replicas[pos]
        raise AssertionError("no candidate has the best score")

    @hookimpl
    def schedkit_on_route_event(self, event: RouteEvent) -> None:
        if event.kind is RouteEventKind.ROUTED:
            self.last[_is_prefill(event.stage)] = event.replica.index


class RoundRobin:
    """Each request to the next healthy replica in turn, whatever the scores (prefill
    stages in a rotation of their own).

    Defining property: over any run of requests with no replica joining or leaving, the
    counts routed to the replicas differ by at most one.
    """

    def __init__(self) -> None:
        self.last = {False: -1, True: -1}

    @hookimpl
    def schedkit_router_pick(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> ReplicaState:
        key = _is_prefill(request.stage)
        r = replicas[_next_after(replicas, self.last[key])]
        self.last[key] = r.index
        return r


class LeastOutstanding:
    """Score replicas by requests in flight: the least loaded gets 1 (Vidur's and Ray
    Serve's "least outstanding requests"; vLLM's data-parallel balancing by queue)."""

    @hookimpl
    def schedkit_router_score(self, replicas: Sequence[ReplicaState]) -> list[float]:
        return least_outstanding_scores(replicas)


class KVUsage:
    """Score replicas by free KV cache: ``1 - kv_cache_usage`` as each last reported,
    so long prompts go where their blocks fit without preempting."""

    @hookimpl
    def schedkit_router_score(self, replicas: Sequence[ReplicaState]) -> list[float]:
        return free_kv_scores(replicas)


class PrefixAffinity:
    """Send a request where its prefix is cached: the score is the fraction of its
    prompt blocks the replica's prefix cache holds (tracked from the replica's KV
    events). A filter keeps affinity from piling work on one replica: a replica with
    more than ``max_imbalance`` requests outstanding above the least loaded candidate is
    not a candidate (0 turns the filter off).

    Defining property: with balanced load, a request whose prefix one replica holds
    goes to that replica; with no prefix held anywhere the default picker's rotation
    decides.
    """

    def __init__(self, max_imbalance: int = 16) -> None:
        self.max_imbalance = check_int("max_imbalance", max_imbalance, minimum=0)

    @hookimpl
    def schedkit_router_filter(self, replicas: Sequence[ReplicaState]) -> list[ReplicaState] | None:
        if not self.max_imbalance:
            return None
        floor = min(r.num_outstanding for r in replicas) + self.max_imbalance
        return [r for r in replicas if r.num_outstanding <= floor]

    @hookimpl
    def schedkit_router_score(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> list[float]:
        return prefix_scores(request, replicas)


class SessionAffinity:
    """Keep a conversation (``key: session``) or a tenant (``key: tenant``) on the
    replica it went to last: that replica scores 1, the others 0. A request without a
    session id has no opinion. When the replica dies, the next request of the session
    goes where the other plugins say and sticks there.

    Settings:
        key: ``session`` (default) or ``tenant``.
        max_entries: Sessions remembered (the least recently routed are forgotten).
    """

    def __init__(self, key: str = "session", max_entries: int = 100_000) -> None:
        if key not in ("session", "tenant"):
            raise ValueError(f"key must be 'session' or 'tenant', got {key!r}")
        self.key = key
        self.max_entries = check_int("max_entries", max_entries, minimum=1)
        self.home: OrderedDict[str, int] = OrderedDict()

    def _key(self, request: RouteRequest, stage: RouteStage) -> str | None:
        """The session (or tenant); a prefill stage's home is kept apart from the other's."""
        key = request.session_id if self.key == "session" else request.tenant
        return f"prefill:{key}" if key is not None and _is_prefill(stage) else key

    @hookimpl
    def schedkit_router_score(self, request: RouteRequest,
                              replicas: Sequence[ReplicaState]) -> list[float] | None:
        key = self._key(request, request.stage)
        home = self.home.get(key) if key is not None else None
        if home is None:
            return None
        return [1.0 if r.index == home else 0.0 for r in replicas]

    @hookimpl
    def schedkit_on_route_event(self, event: RouteEvent) -> None:
        if event.kind is not RouteEventKind.ROUTED:
            return
        key = self._key(event.request, event.stage)
        if key is None:
            return
        self.home[key] = event.replica.index
        self.home.move_to_end(key)
        if len(self.home) > self.max_entries:
            self.home.popitem(last=False)


class Weighted:
    """llm-d's default in one plugin: a weighted sum of queue depth (least outstanding),
    prefix-cache hits and, optionally, free KV cache; every part is 0..1, and so is the
    total (divided by the sum of the weights).

    Settings:
        queue_weight: Weight of the least-outstanding score (default 1).
        prefix_weight: Weight of the prefix-hit fraction (default 1).
        kv_weight: Weight of the free-KV fraction (default 0).
    """

    def __init__(self, queue_weight: float = 1.0, prefix_weight: float = 1.0,
                 kv_weight: float = 0.0) -> None:
        self.queue_weight = check_number("queue_weight", queue_weight)
        self.prefix_weight = check_number("prefix_weight", prefix_weight)
        self.kv_weight = check_number("kv_weight", kv_weight)
        if not self.queue_weight + self.prefix_weight + self.kv_weight > 0:
            raise ValueError("at least one of queue_weight, prefix_weight, kv_weight must be > 0")

    @hookimpl
    def schedkit_router_score(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> list[float]:
        total = [0.0] * len(replicas)
        parts = ((self.queue_weight, least_outstanding_scores),
                 (self.prefix_weight, lambda rs: prefix_scores(request, rs)),
                 (self.kv_weight, free_kv_scores))
        for weight, scorer in parts:
            if weight:
                for i, s in enumerate(scorer(replicas)):
                    total[i] += weight * s
        norm = self.queue_weight + self.prefix_weight + self.kv_weight
        return [t / norm for t in total]


class SelectivePD:
    """Selective prefill/decode disaggregation, as llm-d's: a request is disaggregated
    when the part of its prompt that no decode candidate holds (the best candidate's
    prefix-cache hit, from the router's view) is longer than ``threshold`` tokens. A
    short or mostly cached prompt is served whole: moving its KV would cost more than
    computing it where it decodes. Always on with ``replicas.roles`` (``trylast``: a
    plugin's answer wins); its settings go under ``router.plugins``.

    Settings:
        threshold: Uncached prompt tokens above which a request is disaggregated
            (default 256; 0: every request with an uncached token; ``.inf``: none).
    """

    def __init__(self, threshold: float = 256) -> None:
        self.threshold = check_number("threshold", threshold, allow_inf=True)

    @hookimpl(trylast=True)
    def schedkit_router_disaggregate(self, request: RouteRequest, decode_replicas: Sequence[ReplicaState]) -> bool:
        return num_uncached_tokens(request, decode_replicas) > self.threshold


def _decode_targets(replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    """The replicas a running request may move to: healthy, not draining, decoding."""
    return [r for r in replicas if r.healthy and not r.draining and r.role.can_decode]


class Rebalance:
    """Live migration for load balance, as Llumnix's: when the replica with the least
    free KV cache and the one with the most differ in usage by more than ``min_gap``,
    move up to ``max_moves`` of the busier one's requests there, the shortest prompts
    first (the least KV to send). Usage is what the replicas last reported, so a move
    is seen in it a report later: ``router.migration_interval_s`` paces it.

    Settings:
        min_gap: KV usage difference (0..1) above which requests move (default 0.2).
        max_moves: Requests moved per round (default 1).
    """

    def __init__(self, min_gap: float = 0.2, max_moves: int = 1) -> None:
        self.min_gap = check_number("min_gap", min_gap)
        self.max_moves = check_int("max_moves", max_moves, minimum=1)

    @hookimpl
    def schedkit_router_migrate(self, replicas: Sequence[ReplicaState],
                                requests: dict[int, Sequence[RouteRequest]]) -> list[Migration]:
        targets = _decode_targets(replicas)
        sources = [r for r in targets if requests.get(r.index)]
        if not sources or len(targets) < 2:
            return []
        source = max(sources, key=lambda r: (r.kv_cache_usage, r.num_outstanding))
        target = min((r for r in targets if r is not source), key=lambda r: (r.kv_cache_usage, r.num_outstanding))
        if source.kv_cache_usage - target.kv_cache_usage <= self.min_gap:
            return []
        movable = sorted(requests[source.index], key=lambda q: q.num_prompt_tokens)[:self.max_moves]
        gap = f"KV usage {source.kv_cache_usage:.2f} vs {target.kv_cache_usage:.2f}"
        return [Migration(q.request_id, target.index, f"rebalance: {gap}") for q in movable]


class Drain:
    """Live migration off draining replicas (``ClusterClient.drain(index)``, e.g. before
    a shutdown): each of their requests moves to the open replica with the fewest
    outstanding requests, counting the moves already planned.

    Settings:
        max_moves: Requests moved per round, all draining replicas together (default 64).
    """

    def __init__(self, max_moves: int = 64) -> None:
        self.max_moves = check_int("max_moves", max_moves, minimum=1)

    @hookimpl
    def schedkit_router_migrate(self, replicas: Sequence[ReplicaState],
                                requests: dict[int, Sequence[RouteRequest]]) -> list[Migration] | None:
        draining = [r for r in replicas if r.draining and requests.get(r.index)]
        targets = _decode_targets(replicas)
        if not draining or not targets:
            return None  # nothing to drain: another plugin may move something
        load = {r.index: r.num_outstanding for r in targets}
        moves: list[Migration] = []
        for r in draining:
            for q in requests[r.index]:
                if len(moves) == self.max_moves:
                    return moves
                target = min(load, key=lambda i: (load[i], i))
                load[target] += 1
                moves.append(Migration(q.request_id, target, f"drain {r.name}"))
        return moves


class SLOHeadroom:
    """Route by SLO headroom: each candidate's predicted TTFT and TPOT for the request
    (the router's ``latency``, from the cost model; the router then requires
    ``router.latency_profile`` or the simulated runner's profile) against the targets of
    the request's SLO class (``slo_classes``). A replica *meets* the class when every
    target the class sets holds with ``margin`` to spare. Replicas that meet it score
    0.5 to 1: by default the least loaded of them (outstanding requests) highest; with
    ``prefer: least-headroom`` the one closest to its targets (packing: a loose class
    fills the replicas a tight class could not use, leaving the others free for it). The
    others score below 0.5, the closer to their targets the higher (best effort). A
    request without an SLO class, or of a class without TTFT or TPOT targets, is scored
    as by ``least-outstanding``.

    Admission (``schedkit_router_admit``): when the class sets a TTFT target that no
    candidate is predicted to meet, the request is refused (``on_miss: refuse``: the
    client gets ``RouteRefusedError``, HTTP 429, naming the class) or routed best effort
    (``on_miss: downgrade``); the router counts either per class (``num_refused``,
    ``num_downgraded`` in its stats).

    Settings:
        on_miss: ``downgrade`` (default) or ``refuse``.
        prefer: Among the replicas that meet the class: ``least-loaded`` (default) or
            ``least-headroom``.
        margin: Fraction of each target kept in reserve: a replica meets a target when
            its prediction times ``1 + margin`` is within it (default 0).
    """

    def __init__(self, on_miss: str = "downgrade", prefer: str = "least-loaded", margin: float = 0.0) -> None:
        if on_miss not in ("downgrade", "refuse"):
            raise ValueError(f"on_miss must be 'downgrade' or 'refuse', got {on_miss!r}")
        if prefer not in ("least-loaded", "least-headroom"):
            raise ValueError(f"prefer must be 'least-loaded' or 'least-headroom', got {prefer!r}")
        self.on_miss = RouteVerdict.REFUSE if on_miss == "refuse" else RouteVerdict.DOWNGRADE
        self.packs = prefer == "least-headroom"
        self.margin = check_number("margin", margin)

    def _ratio(self, slo: SLOTargets, estimate: LatencyEstimate) -> float:
        """The prediction over the target, the worst of TTFT and TPOT (margin included):
        at most 1 when the replica meets the class."""
        ratio = 0.0
        for target, value in ((slo.ttft_s, estimate.ttft_s), (slo.tpot_s, estimate.tpot_s)):
            if target is not None:
                ratio = max(ratio, value * (1.0 + self.margin) / target)
        return ratio

    @hookimpl
    def schedkit_router_admit(self, request: RouteRequest, replicas: Sequence[ReplicaState],
                              latency: RouteLatency | None) -> RouteAdmission | None:
        slo = request.slo
        if slo is None or slo.ttft_s is None or latency is None or not replicas:
            return None
        best = min(latency.estimate(request, r).ttft_s for r in replicas)
        if best * (1.0 + self.margin) <= slo.ttft_s:
            return None
        margin = f" with a {self.margin:.0%} margin" if self.margin else ""
        return RouteAdmission(self.on_miss, f"no replica is predicted to meet SLO class "
                                            f"{request.hints.slo_class!r}'s TTFT target of {slo.ttft_s:g} s{margin} "
                                            f"(the best of {len(replicas)} predicts {best:.3g} s)")

    @hookimpl
    def schedkit_router_score(self, request: RouteRequest, replicas: Sequence[ReplicaState],
                              latency: RouteLatency | None) -> list[float]:
        slo = request.slo
        if slo is None or latency is None or (slo.ttft_s is None and slo.tpot_s is None):
            return least_outstanding_scores(replicas)
        ratios = [self._ratio(slo, latency.estimate(request, r)) for r in replicas]
        meeting = [r for r, x in zip(replicas, ratios, strict=True) if x <= 1.0]
        scores = [0.0] * len(replicas)
        if meeting:
            met = [x for x in ratios if x <= 1.0]
            lo, hi = min(met), max(met)
            ranks = iter([(x - lo) / (hi - lo) if hi > lo else 1.0 for x in met] if self.packs
                         else least_outstanding_scores(meeting))
            for i, x in enumerate(ratios):
                if x <= 1.0:
                    scores[i] = 0.5 + 0.5 * next(ranks)
        missing = [x for x in ratios if x > 1.0]
        if missing:
            closest = min(missing)
            for i, x in enumerate(ratios):
                if x > 1.0:
                    scores[i] = 0.49 * closest / x
        return scores
