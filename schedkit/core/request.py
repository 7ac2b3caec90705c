"""Requests, their status and sampling parameters.

A :class:`Request` is hot-path state: a slotted dataclass whose counters are plain
attributes (``num_tokens`` is kept up to date on append instead of being a property).
"""

from __future__ import annotations

import enum
import math
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from schedkit.core.grammar import StructuredOutputRequest, StructuredOutputsParams
from schedkit.core.hints import NO_HINTS, RequestHints
from schedkit.errors import RequestError


class RequestStatus(enum.IntEnum):
    """Lifecycle state; a request is finished iff its status is above PREEMPTED."""

    WAITING = 0
    WAITING_FOR_FSM = 1
    """Its structured-output grammar is compiling (vLLM's
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR): it waits in the queue, passed over."""
    WAITING_FOR_REMOTE_KVS = 2
    RUNNING = 3
    PREEMPTED = 4
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


class FinishReason(enum.StrEnum):
    """Why a request ended, as reported to clients (compares equal to its string)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class EventType(enum.Enum):
    """Timestamped request events that the metrics read."""

    QUEUED = "queued"
    SCHEDULED = "scheduled"
    FIRST_TOKEN = "first_token"
    PREEMPTED = "preempted"
    FINISHED = "finished"


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Integers cross the engine boundary as signed 64-bit (msgpack); wider ones are refused."""

MAX_ARRIVAL_OFFSET_S = 1e9
"""The latest arrival offset a request may ask for, in seconds (about 31 years): later
ones would cost the engine clock its microsecond resolution for good once reached."""


def check_arrival_offset(request_id: str, arrival_offset: object) -> None:
    """Raise RequestError unless the offset is None or finite seconds in
    [0, MAX_ARRIVAL_OFFSET_S] (NaN fails the range test)."""
    if arrival_offset is None:
        return
    if not _is_number(arrival_offset) or not 0.0 <= arrival_offset <= MAX_ARRIVAL_OFFSET_S:  # type: ignore[operator]
        raise RequestError(f"request {request_id!r}: arrival_offset must be None or a finite "
                           f"number of seconds in [0, {MAX_ARRIVAL_OFFSET_S:g}], got {arrival_offset!r}",
                           request_id=request_id)


def check_ttft_slo(request_id: str, ttft_slo_s: object, name: str = "ttft_slo_s") -> None:
    """Raise RequestError unless the SLO is None or a finite number of seconds > 0."""
    if ttft_slo_s is None:
        return
    if not _is_number(ttft_slo_s) or not 0.0 < ttft_slo_s < math.inf:  # type: ignore[operator]
        raise RequestError(f"request {request_id!r}: {name} must be None or a finite number "
                           f"of seconds > 0, got {ttft_slo_s!r}", request_id=request_id)


def _is_int(value: object) -> bool:
    """An int that is not a bool (``True`` is no token count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


GREEDY_BELOW_TEMPERATURE = 1e-5
"""A temperature below this samples greedily (vLLM's ``_SAMPLING_EPS``): dividing float32
logits by, say, 1e-40 overflows, and such a temperature means "the top token" anyway."""


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to sample and when to stop. Validated at construction.

    Args:
        max_tokens: Most output tokens (>= 1).
        min_tokens: Fewest output tokens before repetition checks apply (<= max_tokens).
        stop_token_ids: Token ids that end the request (the stop token is kept); None is
            taken as none, as vLLM does.
        ignore_eos: Do not stop at ``eos_token_id``.
        eos_token_id: End-of-sequence id; None means no EOS stop.
        temperature: 0 means greedy, and so does anything below
            ``GREEDY_BELOW_TEMPERATURE`` (1e-5, vLLM's threshold), which is stored as 0.
        top_p: Nucleus mass in (0, 1].
        top_k: Keep the k most likely tokens; -1 or 0 means all.
        seed: Per-request sampling seed.
        structured_outputs: A constraint on the output (a JSON schema, any JSON object,
            a regex, a choice, an EBNF grammar); a dict of its fields is accepted.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    eos_token_id: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> RequestError:
            return RequestError(f"invalid sampling value {name}={getattr(self, name)!r}: {why}")

        so = self.structured_outputs
        if isinstance(so, dict):  # its wire form (and a convenience)
            try:
                so = StructuredOutputsParams(**so)
            except TypeError as e:
                raise RequestError(f"invalid structured_outputs: {e}") from None
            object.__setattr__(self, "structured_outputs", so)
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams, a dict of its fields or None")

        if self.stop_token_ids is None:  # vLLM's default spelling of "none"
            object.__setattr__(self, "stop_token_ids", ())
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", "must be an integer in [0, max_tokens]")
        if (isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Iterable)
                or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids)):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.eos_token_id is not None and (not _is_int(self.eos_token_id) or self.eos_token_id < 0):
            raise bad("eos_token_id", "must be a non-negative integer or None")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be a bool")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise bad("temperature", "must be a finite number >= 0")
        if self.temperature < GREEDY_BELOW_TEMPERATURE:
            # 1e-40 would overflow float32 logits (logit / t = inf, NaN after the softmax)
            object.__setattr__(self, "temperature", 0.0)
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (off) or a positive integer")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "must be an integer or None")
        for name in ("max_tokens", "min_tokens", "top_k", "seed", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not INT64_MIN <= value <= INT64_MAX:
                raise bad(name, "must fit in 64 bits")
        if any(t > INT64_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must fit in 64 bits")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


BlockHasherFn = Callable[[list[int], list[bytes]], None]


@dataclass(slots=True, eq=False, repr=False)
class Request:
    """One generation request and its scheduling state.

    ``num_computed_tokens`` counts leading tokens whose KV is (or, once the current step
    runs, will be) in the cache; it is advanced at schedule time and rolled back for
    rejected drafts. Under async scheduling it also covers ``num_output_placeholders``:
    positions of tokens that steps in flight are sampling. ``spec_token_ids`` are drafts proposed for the next step and are
    not part of ``num_tokens``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    client_index: int = 0
    tenant: str = "default"
    cache_salt: str | None = None
    ttft_slo_s: float | None = None
    """The client's time-to-first-token target in seconds (None: the policy's default);
    deadline policies and admission plugins read it (``arrival_time + ttft_slo_s``)."""
    tpot_slo_s: float | None = None
    """Its time-per-output-token target in seconds (None: none given); set from its SLO
    class by the engine."""
    hints: RequestHints = NO_HINTS
    """What the client told about it beyond its tokens (:mod:`schedkit.core.hints`): SLO
    class, deadline, expected output length, session."""
    skip_reading_prefix_cache: bool = False
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = -1
    """Prompt tokens served from the prefix cache at first admission (-1 before)."""
    num_recomputed_tokens: int = 0
    """Tokens computed again after preemptions: those scheduled again below
    ``num_computed_high`` (prefix-cache hits on resumption are not recomputed)."""
    num_computed_high: int = 0
    """The most leading tokens whose KV had been computed when the request was preempted."""
    num_unconfirmed_high: int = 0
    """Of ``num_computed_high``, the positions above the mark before its last preemption
    that steps still in flight had scheduled (asynchronous scheduling): their rejected
    drafts, once the stale output arrives, are taken back from the mark."""
    is_prefill_chunk: bool = True
    num_output_placeholders: int = 0
    """Async scheduling: tokens sampled by steps in flight, not yet appended."""
    num_in_flight_tokens: int = 0
    """Tokens scheduled in steps whose output has not been processed yet."""
    num_stale_output_tokens: int = 0
    """In-flight tokens scheduled before the request's last preemption: their output is
    stale (delivered, or dropped when ``stale_drop``)."""
    stale_drop: bool = False
    """Discard stale outputs instead of appending them (forced preemptions, e.g. a
    prefix-cache reset of running requests)."""
    stop_reason: int | str | None = None
    rejected_by: str | None = None
    """The plugin whose ``schedkit_admit_request`` answered REJECT (set by the hook facade)."""
    rejection_reason: str | None = None
    """The reason that plugin gave (it answered a ``Rejection``), else None."""
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    """Draft tokens the target model verified for it so far (padding left out)."""
    num_accepted_tokens: int = 0
    """Of those, the ones it accepted (speculation policies read the ratio)."""
    num_draft_misses: int = 0
    """Verification steps in which one of its drafts was rejected."""
    structured_output: StructuredOutputRequest | None = field(default=None, init=False)
    """Its constraint and grammar state (None for an unconstrained request)."""
    all_token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list, init=False)
    num_tokens: int = field(init=False)
    num_prompt_tokens: int = field(init=False)
    max_tokens: int = field(init=False)
    eos_token_id: int | None = field(init=False)
    stop_token_ids: frozenset[int] = field(init=False)
    block_hashes: list[bytes] = field(default_factory=list, init=False)
    events: list[tuple[EventType, float]] = field(default_factory=list, init=False)
    _hasher: BlockHasherFn | None = field(default=None, init=False, repr=False)
    _hash_every: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise RequestError(f"request id must be a non-empty string, got {self.request_id!r}",
                               request_id=str(self.request_id))
        prompt = self.prompt_token_ids
        if not isinstance(prompt, Sequence) or isinstance(prompt, (str, bytes)) or len(prompt) == 0:
            raise RequestError(f"request {self.request_id!r}: prompt must be a non-empty list of "
                               "token ids", request_id=self.request_id)
        try:  # C-speed type and range checks (bools and numpy ints are not token ids)
            ok = set(map(type, prompt)) == {int} and min(array("q", prompt)) >= 0
        except (TypeError, OverflowError):
            ok = False
        if not ok:
            raise RequestError(f"request {self.request_id!r}: prompt token ids must be "
                               "non-negative integers", request_id=self.request_id)
        self.prompt_token_ids = list(prompt)
        self._check_fields()
        sp = self.sampling_params
        self.all_token_ids = list(prompt)
        self.num_tokens = self.num_prompt_tokens = len(prompt)
        self.max_tokens = sp.max_tokens
        self.eos_token_id = None if sp.ignore_eos else sp.eos_token_id
        self.stop_token_ids = frozenset(sp.stop_token_ids)
        if sp.structured_outputs is not None:
            self.structured_output = StructuredOutputRequest(sp.structured_outputs)

    def _check_fields(self) -> None:
        rid = self.request_id
        checks = (
            ("sampling_params", isinstance(self.sampling_params, SamplingParams), "a SamplingParams"),
            ("priority", _is_int(self.priority) and INT64_MIN <= self.priority <= INT64_MAX,
             "an integer (64-bit)"),
            ("client_index", _is_int(self.client_index) and self.client_index >= 0, "an integer >= 0"),
            ("tenant", isinstance(self.tenant, str), "a string"),
            ("cache_salt", self.cache_salt is None or isinstance(self.cache_salt, str), "a string or None"),
            ("skip_reading_prefix_cache", isinstance(self.skip_reading_prefix_cache, bool), "a bool"),
            ("arrival_time", _is_number(self.arrival_time) and math.isfinite(self.arrival_time),
             "a finite number"),
        )
        for name, ok, what in checks:
            if not ok:
                raise RequestError(f"request {rid!r}: {name} must be {what}, got "
                                   f"{getattr(self, name)!r}", request_id=rid)
        if not isinstance(self.hints, RequestHints):
            raise RequestError(f"request {rid!r}: hints must be a RequestHints, got {self.hints!r}",
                               request_id=rid)
        if self.hints is not NO_HINTS:
            self.hints.check(rid)
        check_ttft_slo(rid, self.tpot_slo_s, "tpot_slo_s")

    # -- block hashes ------------------------------------------------------------------
    def set_block_hasher(self, hasher: BlockHasherFn, block_size: int) -> None:
        """Attach the prefix-cache hasher; hashes every full block present so far."""
        self._hasher = hasher
        self._hash_every = block_size
        hasher(self.all_token_ids, self.block_hashes)

    # -- tokens ------------------------------------------------------------------------
    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.num_tokens += 1
        if self._hasher is not None and self.num_tokens >= (len(self.block_hashes) + 1) * self._hash_every:
            self._hasher(self.all_token_ids, self.block_hashes)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def get_finished_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self.status)

    # -- events ------------------------------------------------------------------------
    def record_event(self, kind: EventType, timestamp: float | None = None) -> None:
        self.events.append((kind, time.monotonic() if timestamp is None else timestamp))

    def first_event_time(self, kind: EventType) -> float | None:
        for k, t in self.events:
            if k is kind:
                return t
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"priority={self.priority})")

    def __lt__(self, other: Request) -> bool:
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority, other.arrival_time, other.request_id)

    def __hash__(self) -> int:
        return id(self)
