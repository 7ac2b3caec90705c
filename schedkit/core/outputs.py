"""Data passed between the scheduler, the model runner and the clients."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from schedkit.core.request import EventType, Request, SamplingParams

if TYPE_CHECKING:
    from schedkit.core.structured_output import GrammarBitmask


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (or has dropped): everything it needs."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    """The request's whole block table."""
    num_computed_tokens: int
    """Tokens already in the KV cache at admission (prefix hits)."""
    output_token_ids: list[int] = field(default_factory=list)
    """Outputs it has already (a request moved here from another engine mid-stream):
    they follow the prompt in its tokens; empty for every other new request."""
    tenant: str = "default"
    """The request's tenant (a fake or simulated runner's drafts are right with the
    tenant's chance, ``workload.tenants[].draft_acceptance``)."""


@dataclass(slots=True)
class CachedRequestData:
    """Requests the runner already knows, as parallel lists (running, then resumed)."""

    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[list[int] | None] = field(default_factory=list)
    """Running: only newly allocated blocks (None if none). Resumed: the whole table."""
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    resumed_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Prompt plus outputs of each resumed request (the runner recomputes them)."""
    appended_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Running requests' output tokens the runner did not sample: appended by jump-forward
    decoding (``structured_outputs.jump_forward``); this step computes their KV."""

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


DRAFT_PADDING = -1
"""A scheduled draft slot with no draft in it (a resumed request's padded admission):
the runner computes it and never accepts it."""
DRAFT_PLACEHOLDER = -2
"""A scheduled draft the runner proposes itself, inside the step (asynchronous
scheduling: the tokens the drafts continue are not on the host when the step is
planned). A runner that proposes fewer fills the rest with :data:`DRAFT_PADDING`."""


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan: which requests run, with how many tokens and which blocks."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]
    """Per request, the drafts this step verifies (:data:`DRAFT_PADDING` and
    :data:`DRAFT_PLACEHOLDER` entries are no tokens yet)."""
    num_common_prefix_blocks: list[int]
    preempted_req_ids: set[str]
    finished_req_ids: set[str]
    kv_connector_metadata: Any = None
    step: int = 0
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    """Structured requests that sample this step -> their first row in ``grammar_bitmask``
    (one row per sampled position: the next token, then one after each scheduled draft)."""
    grammar_bitmask: GrammarBitmask | None = None
    """The allowed tokens of those rows; set by the engine just before the step runs
    (``Scheduler.fill_grammar_bitmask``), None when no structured request samples."""
    pending_structured_output_tokens: bool = False
    """A structured request of this step still has a token in flight (async scheduling):
    its bitmask can be filled only once that earlier step's output is processed."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class KVConnectorOutput:
    """What the worker-side connector reports after a step."""

    finished_sending: set[str] = field(default_factory=set)
    """Finished requests whose blocks the connector held (delay_free) and now releases."""
    finished_recving: set[str] = field(default_factory=set)
    """Requests whose asynchronous KV load completed (they become admissible)."""
    failed_recving: set[str] = field(default_factory=set)
    """Requests whose asynchronous KV load failed as a whole; the worker is done with
    their blocks. ``cache.kv_load_failure_policy`` decides: start over or finish with
    an error."""
    invalid_block_ids: set[int] = field(default_factory=set)
    """Blocks whose load failed (asynchronous loads in progress, or synchronous loads of
    this step); the requests reading them recompute from the first bad block, or finish
    with an error, per ``cache.kv_load_failure_policy``."""


@dataclass(slots=True)
class ModelRunnerOutput:
    """What the runner returns for one step.

    ``sampled_token_ids[i]`` belongs to ``req_ids[i]``: empty for a prefill chunk that
    sampled nothing, one token normally, up to 1 + k with k drafts (accepted drafts then
    the bonus token).
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: Any = None
    step_duration: float | None = None
    """Seconds the step took (simulator: modelled; real runners: measured)."""
    kv_connector_output: KVConnectorOutput | None = None
    num_proposed_drafts: dict[str, int] = field(default_factory=dict)
    """Requests whose :data:`DRAFT_PLACEHOLDER` drafts the runner proposed inside the
    step -> how many it proposed (the rest of their slots were :data:`DRAFT_PADDING`);
    the acceptance counts count those alone."""


class RequestMetricsData(msgspec.Struct, frozen=True):
    """Timeline and counters of a finished request (engine clock, seconds)."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int
    num_cached_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int
    first_scheduled_time: float | None = None
    """When the request was first scheduled (its queueing delay ends there)."""
    num_recomputed_tokens: int = 0
    longest_wait_s: float | None = None
    """The longest stretch the request spent queued: from arrival, or from a preemption,
    to being scheduled (or to its end, if it ended queued); None while the first wait lasts."""
    queued_spans: list[tuple[float, float]] = []
    """Every stretch it spent queued, ``(start, end)`` in order (engine clock)."""
    num_draft_tokens: int = 0
    """Speculative draft tokens verified for it (padding left out)."""
    num_accepted_tokens: int = 0
    """Of those, the ones accepted."""

    @classmethod
    def of(cls, req: Request) -> RequestMetricsData:
        """The timeline and counters of ``req`` (the engine process sends these to clients;
        the policy lab reads the same fields in process)."""
        spans = queued_spans(req)
        return cls(
            arrival_time=req.arrival_time,
            first_token_time=req.first_event_time(EventType.FIRST_TOKEN),
            finish_time=req.first_event_time(EventType.FINISHED),
            num_preemptions=req.num_preemptions, num_cached_tokens=max(req.num_cached_tokens, 0),
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
            first_scheduled_time=req.first_event_time(EventType.SCHEDULED),
            num_recomputed_tokens=req.num_recomputed_tokens,
            longest_wait_s=max((b - a for a, b in spans), default=None), queued_spans=spans,
            num_draft_tokens=req.num_draft_tokens, num_accepted_tokens=req.num_accepted_tokens)


def queued_spans(req: Request) -> list[tuple[float, float]]:
    """The stretches ``req`` spent queued, read from its events: from arrival, and from
    each preemption, to being scheduled (or to its end, if it ended queued). A stretch
    still going on is left out."""
    spans = []
    since: float | None = req.arrival_time
    for kind, t in req.events:
        if kind is EventType.PREEMPTED:
            since = t
        elif since is not None and kind in (EventType.SCHEDULED, EventType.FINISHED):
            spans.append((since, max(t, since)))
            since = None
    return spans


def longest_wait(req: Request) -> float | None:
    """The longest queued stretch of ``req`` (see ``RequestMetricsData.longest_wait_s``);
    None while its first wait lasts."""
    return max((b - a for a, b in queued_spans(req)), default=None)


class EngineCoreOutput(msgspec.Struct, omit_defaults=True):
    """New tokens (and the end, if any) of one request in one step.

    A msgspec Struct: built once per request per step on the hot path, and sent to
    clients as it is (the engine process attaches ``metrics`` when the request ends).
    """

    request_id: str
    new_token_ids: list[int] = []
    finish_reason: str | None = None
    """A FinishReason value ("stop", "length", "abort", "error") or None while running."""
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None
    """Why the request failed (finish_reason "error"): a plugin, the runner, bad input."""
    metrics: RequestMetricsData | None = None
    rejected_by: str | None = None
    """With stop_reason "rejected": the plugin whose admission hook rejected it."""
    rejection_reason: str | None = None
    """With stop_reason "rejected": the reason that plugin gave, if it gave one."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class SpecDecodingStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted_tokens):
            per_pos[i] += 1


@dataclass(slots=True)
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    """Waiting requests (``kv_holding`` included) not skipped by the last step."""
    num_skipped_waiting_reqs: int = 0
    """Waiting requests the last schedule() passed over (blocked: a load in progress, a
    stale output pending, an admission hook's SKIP, a connector's "ask again")."""
    kv_cache_usage: float = 0.0
    num_preempted_reqs: int = 0
    prefix_cache_stats: Any = None
    connector_prefix_cache_stats: Any = None
    """Lookups a KV connector answered: queries = tokens the local cache did not have,
    hits = tokens the connector has (None without a connector)."""
    spec_decoding_stats: SpecDecodingStats | None = None


@dataclass(slots=True)
class EngineCoreOutputs:
    """All outputs of one step for one client."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    finished_requests: set[str] | None = None
