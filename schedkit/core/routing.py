"""What the router hooks see: the request being routed, the replicas, routing outcomes.

The router itself (:mod:`schedkit.cluster.router`) keeps these up to date; router
plugins read them and must not mutate them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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
        num_prompt_tokens: ``len(prompt_token_ids)``.
        attempt: 0 when first routed; 1, 2... when re-routed after its replica died.
        block_size: Tokens per block of :attr:`block_hashes` (the replicas' KV block
            size; 0 without prefix caching).
        stage: The part being placed by the decision under way: ``WHOLE``, or for a
            disaggregated request ``PREFILL`` then ``DECODE`` (the router sets it before
            each decision; filters, scorers and pickers may read it).
    """

    __slots__ = ("request_id", "prompt_token_ids", "tenant", "priority", "max_tokens", "session_id",
                 "hints", "num_prompt_tokens", "attempt", "block_size", "stage", "_hashes", "_hash_fn")

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], *, tenant: str = "default",
                 priority: int = 0, max_tokens: int | None = None, session_id: str | None = None,
                 hash_fn: Callable[[Sequence[int]], list[bytes]] | None = None,
                 block_size: int = 0, hints: RequestHints = NO_HINTS) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.tenant = tenant
        self.priority = priority
        self.max_tokens = max_tokens
        self.session_id = session_id if session_id is not None else hints.session_id
        self.hints = hints
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
    """

    index: int
    name: str = ""
    healthy: bool = True
    num_outstanding: int = 0
    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0
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
