"""What the router hooks see: the request being routed, the replicas, routing outcomes.

The router itself (:mod:`schedkit.cluster.router`) keeps these up to date; router
plugins read them and must not mutate them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from schedkit.config.workload import SLOTargets
from schedkit.core.hints import NO_HINTS, RequestHints
from schedkit.kv.prefix_index import CachedPrefixIndex


class ReplicaRole(enum.Enum):
    """What a replica does (``replicas.roles``; every replica is BOTH without it)."""

    BOTH = "both"
    """Whole requests, and either stage of a disaggregated one."""
    PREFILL = "prefill"
    """Only the prefill of disaggregated requests."""
    DECODE = "decode"
    """Whole requests and the decode of disaggregated ones."""

    @property
    def can_prefill(self) -> bool:
        """May take a disaggregated request's prefill stage."""
        return self is not ReplicaRole.DECODE

    @property
    def can_decode(self) -> bool:
        """May take a whole request or a disaggregated request's decode stage."""
        return self is not ReplicaRole.PREFILL


class RouteStage(enum.Enum):
    """Which part of a request a routing decision places."""

    WHOLE = "whole"
    """The whole request on one replica (always, without ``replicas.roles``)."""
    PREFILL = "prefill"
    """A disaggregated request's prefill (its prompt and first token), whose KV then goes
    to its decode replica."""
    DECODE = "decode"
    """A disaggregated request's decode: the replica that receives its prompt's KV and
    produces its tokens."""


class RouteRequest:
    """One request to place on a replica.

    Attributes:
        request_id: The request's id.
        prompt_token_ids: Its prompt.
        tenant: ``Request.tenant`` (the OpenAI ``user``).
        priority: ``Request.priority``.
        max_tokens: The most output tokens it asks for (``SamplingParams.max_tokens``:
            the job's size as the client states it, for size-aware routing); None when
            unknown.
        session_id: A conversation id when the client gave one
            (``AsyncLLM.generate(session_id=...)``, ``session_id`` in an HTTP body), else
            None (the cluster simulation's traces carry none).
        hints: The request's hints (:class:`~schedkit.core.hints.RequestHints`: SLO
            class, deadline, expected output length, session).
        slo: The targets of its SLO class (the config's ``slo_classes`` entry named by
            ``hints.slo_class``), or None when it has no class the config names.
        num_prompt_tokens: ``len(prompt_token_ids)``.
        attempt: 0 when first routed; 1, 2... when re-routed after its replica died.
        block_size: Tokens per block of :attr:`block_hashes` (the replicas' KV block
            size; 0 without prefix caching).
        stage: The part being placed by the decision under way: ``WHOLE``, or for a
            disaggregated request ``PREFILL`` then ``DECODE`` (the router sets it before
            each decision; filters, scorers and pickers may read it).
    """

    __slots__ = ("request_id", "prompt_token_ids", "tenant", "priority", "max_tokens", "session_id",
                 "hints", "slo", "num_prompt_tokens", "attempt", "block_size", "stage", "_hashes",
                 "_hash_fn")

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], *, tenant: str = "default",
                 priority: int = 0, max_tokens: int | None = None, session_id: str | None = None,
                 hash_fn: Callable[[Sequence[int]], list[bytes]] | None = None,
                 block_size: int = 0, hints: RequestHints = NO_HINTS, slo: SLOTargets | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.tenant = tenant
        self.priority = priority
        self.max_tokens = max_tokens
        self.session_id = session_id if session_id is not None else hints.session_id
        self.hints = hints
        self.slo = slo
        self.num_prompt_tokens = len(prompt_token_ids)
        self.attempt = 0
        self.block_size = block_size if hash_fn is not None else 0
        self.stage = RouteStage.WHOLE
        self._hashes: list[bytes] | None = None
        self._hash_fn = hash_fn

    @property
    def block_hashes(self) -> list[bytes]:
        """The prompt's full-block hashes, as the replicas' prefix caches compute them
        (computed on first use; empty when the router has no hasher)."""
        if self._hashes is None:
            self._hashes = self._hash_fn(self.prompt_token_ids) if self._hash_fn is not None else []
        return self._hashes

    def __repr__(self) -> str:
        return f"RouteRequest({self.request_id!r}, {self.num_prompt_tokens} tokens)"


@dataclass(slots=True, eq=False)
class ReplicaState:
    """The router's view of one replica.

    Attributes:
        index: 0..N-1, fixed for the replica's life.
        name: ``replica-<index>``.
        healthy: False once the replica died or was taken out of rotation; an unhealthy
            replica is never offered to the hooks.
        num_outstanding: Requests routed here that have not finished (the router's own
            count: exact at every decision).
        num_waiting, num_running: As the replica last reported (its scheduler's queue
            and running list).
        kv_cache_usage: Fraction of its KV blocks in use, as last reported.
        cached_blocks: The block hashes its prefix cache holds, from its KV events.
        num_routed: Decisions that placed a request (or a stage of one) here so far.
        role: What it does (``replicas.roles``); the router offers a replica only for
            the stages its role takes.
        draining: Being emptied for shutdown: offered to no new request, and the
            migration hook is asked to move its requests away.
        num_prefill_tokens: Prompt tokens its waiting and running requests have still
            to compute, as last reported (a waiting request's prefix-cache hit is not
            known before it is scheduled: counted whole).
        num_prefill_requests: The requests those tokens belong to.
        prefill_attention: Their prefill's attention work left, as the cost model counts
            it: the sum over those requests of ``left * (computed + left / 2)``.
        num_context_tokens: KV positions held by its running requests that are past
            their prompt (what a decode step's attention reads), as last reported.
        decode_tokens_left: For each of those requests, the most output tokens it may
            still make (``max_tokens``, or the ``expected_output_tokens`` hint within it,
            less those made), ascending, as last reported.
        prefill_queue: The requests still in their prompt, in the order its scheduler
            takes them (running ones first), as last reported: ``(prompt tokens left,
            tokens computed, output tokens to make)`` each (the first
            256 of them; the totals above count every one).
        reported_at: When its last load report arrived, on the router's clock (None
            before the first).
    """

    index: int
    name: str = ""
    healthy: bool = True
    num_outstanding: int = 0
    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0
    num_prefill_tokens: int = 0
    num_prefill_requests: int = 0
    prefill_attention: float = 0.0
    num_context_tokens: int = 0
    decode_tokens_left: tuple[int, ...] = ()
    prefill_queue: tuple[tuple[int, int, int], ...] = ()
    reported_at: float | None = None
    cached_blocks: CachedPrefixIndex = field(default_factory=CachedPrefixIndex)
    num_routed: int = 0
    role: ReplicaRole = ReplicaRole.BOTH
    draining: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            self.name = f"replica-{self.index}"


class RouteEventKind(enum.Enum):
    ROUTED = "routed"
    """The request (its ``stage``) was sent to ``replica``."""
    FINISHED = "finished"
    """It finished there (any finish reason but an error); for stage ``PREFILL``: its
    prefill is done, its KV on its way to the decode replica."""
    FAILED = "failed"
    """It failed there (an error, or its replica died after it produced tokens)."""
    REROUTED = "rerouted"
    """Its replica died before it produced a token; it is routed again (a ROUTED event
    follows, with the new replica)."""
    MIGRATED = "migrated"
    """It moved, running, from ``replica`` to another (``schedkit_router_migrate``); the
    event's ``target`` is where it runs now."""


@dataclass(slots=True, frozen=True)
class RouteEvent:
    """One routing outcome, for ``schedkit_on_route_event``.

    Attributes:
        kind: What happened.
        request: The request.
        replica: The replica it concerns.
        scores: With ROUTED: the weighted total score of each candidate the picker saw,
            by replica index (empty when nothing scored).
        stage: The stage it concerns (``WHOLE`` unless the request is disaggregated).
    """

    kind: RouteEventKind
    request: RouteRequest
    replica: ReplicaState
    scores: dict[int, float] = field(default_factory=dict)
    stage: RouteStage = RouteStage.WHOLE
    target: ReplicaState | None = None
    """With MIGRATED: the replica it moved to."""


@dataclass(slots=True, frozen=True)
class Migration:
    """A move a migration plugin asks for (``schedkit_router_migrate``): the outstanding
    request ``request_id`` goes, at its replica's next step boundary, to replica
    ``target`` with its KV and its state, its stream going on from there.

    Attributes:
        request_id: An outstanding request (served whole, or at its decode stage).
        target: The index of a healthy replica that decodes, other than its own.
        reason: Why, for the log and the stats (``stats()["router"]["migrations"]``).
    """

    request_id: str
    target: int
    reason: str = ""


@dataclass(slots=True, frozen=True)
class Placement:
    """Where a request goes: ``replica`` serves it (the whole request, or its decode
    when disaggregated); ``prefill`` is its prefill replica when it is disaggregated."""

    replica: ReplicaState
    prefill: ReplicaState | None = None

    @property
    def is_disaggregated(self) -> bool:
        return self.prefill is not None


class LatencyEstimate(NamedTuple):
    """What a replica is predicted to give a request: its time to first token and its
    time per output token, in seconds."""

    ttft_s: float
    """From now (the routing decision) to its first token, if it goes there now."""
    tpot_s: float
    """Mean time between its later tokens, at the batch it would join."""


class RouteLatency(Protocol):
    """The router's latency predictions for the decision under way: the router hooks'
    ``latency`` argument (None when the router has no cost model:
    ``router.latency_profile``). Router plugins call it; it never raises."""

    def estimate(self, request: RouteRequest, replica: ReplicaState) -> LatencyEstimate:
        """The TTFT and TPOT ``request`` is predicted to get on ``replica`` if it is sent
        there now, from what the replica last reported, the requests routed there since,
        and how much of the prompt its prefix cache holds. Computed once per replica and
        decision (later calls return the same answer); mutates nothing."""
        ...


class RouteVerdict(enum.Enum):
    """A router admission plugin's decision (``schedkit_router_admit``)."""

    ADMIT = "admit"
    """Route it (the plugins after this one are not asked)."""
    DOWNGRADE = "downgrade"
    """Route it best effort: its SLO class cannot be met now (counted per class in the
    router's stats, ``num_downgraded``)."""
    REFUSE = "refuse"
    """Refuse it: the client gets :class:`~schedkit.errors.RouteRefusedError` (HTTP 429
    with Retry-After) with the reason; counted per class (``num_refused``)."""


class RouteAdmission(NamedTuple):
    """A ``schedkit_router_admit`` answer: the verdict and why (one sentence for the
    client and the log; the plugin names the SLO class it could not meet)."""

    verdict: RouteVerdict
    reason: str = ""
