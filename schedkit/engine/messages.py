"""Wire messages between clients and the engine-core process (msgspec, no pickle).

Client -> engine (input socket): ``AddRequests``, ``AbortRequests``, ``UtilityCall``.
Engine -> client (output socket): ``OutputBatch`` (token deltas, finishes with metrics,
per-request errors, utility results) and ``Heartbeat``; to a client whose ``Hello`` asked
for them (the cluster front end), ``LoadReport`` too: the engine's queue lengths, KV usage
and KV cache events, for the router.

:func:`check_request` validates one request's wire form; the client runs it before
sending, and the engine again on every request it decodes (the engine decodes the
requests of an ``AddRequests`` one by one, so a bad one fails alone).
"""

from __future__ import annotations

import dataclasses
from array import array
from typing import Any

import msgspec

from schedkit.core.hints import hints_from_wire
from schedkit.core.outputs import EngineCoreOutput, RequestMetricsData
from schedkit.core.request import (
    INT64_MAX,
    INT64_MIN,
    SamplingParams,
    check_arrival_offset,
    check_ttft_slo,
)
from schedkit.errors import RequestError
from schedkit.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


def sampling_to_wire(params: SamplingParams) -> dict[str, Any]:
    """The fields of ``params`` that differ from their defaults (the wire form)."""
    return {f.name: value for f in dataclasses.fields(params)
            if (value := getattr(params, f.name)) != f.default}



def _is_int64(value: Any) -> bool:
    return type(value) is int and INT64_MIN <= value <= INT64_MAX


def _describe(value: Any) -> str:
    """``repr (type)``, the repr cut to 40 characters."""
    kind = type(value)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
    text = repr(value)
    return f"{text if len(text) <= 40 else text[:37] + '...'} ({name})"


def _bad(request_id: Any, field: str, value: Any, want: str) -> RequestError:
    rid = request_id if isinstance(request_id, str) else None
    return RequestError(f"request {request_id!r}: {field} must be {want}, got {_describe(value)}",
                        request_id=rid)


def sampling_from_wire(fields: dict[str, Any], request_id: str) -> SamplingParams:
    """Rebuild (and validate) sampling parameters from their wire form.

    Raises:
        RequestError: An unknown field, a badly typed or an invalid value (SamplingParams'
            own checks).
    """
    if not isinstance(fields, dict) or not all(isinstance(k, str) for k in fields):
        raise _bad(request_id, "sampling_params", fields, "a map of field names to values")
    try:
        return SamplingParams(**fields)
    except TypeError as e:
        raise RequestError(f"request {request_id!r}: invalid sampling parameters: {e}",
                           request_id=request_id) from None
    except RequestError as e:
        raise RequestError(f"request {request_id!r}: {e}", request_id=request_id) from None


def _check_token_ids(ids: Any, request_id: str, name: str = "prompt_token_ids") -> None:
    if not isinstance(ids, list):
        raise _bad(request_id, name, ids, "a list of token ids")
    if not ids and name == "prompt_token_ids":
        raise RequestError(f"request {request_id!r}: the prompt is empty (no token ids)",
                           request_id=request_id)
    try:  # fast path: exact ints, and array("q") checks the 64-bit range at C speed
        if all(type(t) is int for t in ids) and (not ids or min(array("q", ids)) >= 0):
            return
    except OverflowError:
        pass
    for i, t in enumerate(ids):
        if not (_is_int64(t) and t >= 0):
            raise _bad(request_id, f"{name}[{i}]", t, "a non-negative 64-bit integer")


def check_request(w: WireRequest) -> SamplingParams:
    """Validate the types and wire ranges of one request; returns its sampling parameters.

    Semantic checks that need the engine (prompt length, duplicate ids) happen there.

    Raises:
        RequestError: Naming the request and the field that is wrong.
    """
    rid = w.request_id
    if not isinstance(rid, str) or not rid:
        raise _bad(rid, "request_id", rid, "a non-empty string")
    _check_token_ids(w.prompt_token_ids, rid)
    if not _is_int64(w.priority):
        raise _bad(rid, "priority", w.priority, "a 64-bit integer")
    if not isinstance(w.tenant, str):
        raise _bad(rid, "tenant", w.tenant, "a string")
    if w.cache_salt is not None and not isinstance(w.cache_salt, str):
        raise _bad(rid, "cache_salt", w.cache_salt, "a string or None")
    check_arrival_offset(rid, w.arrival_offset)
    check_ttft_slo(rid, w.ttft_slo_s)
    if type(w.final_only) is not bool:
        raise _bad(rid, "final_only", w.final_only, "a bool")
    if w.resume_token_ids != []:
        _check_token_ids(w.resume_token_ids, rid, "resume_token_ids")
    if type(w.kv_send) is not bool:
        raise _bad(rid, "kv_send", w.kv_send, "a bool")
    hints_from_wire(w.hints, rid)
    return sampling_from_wire(w.sampling_params, rid)


class WireRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    """Sampling fields that differ from their defaults (:func:`sampling_to_wire`)."""
    priority: int = 0
    tenant: str = "default"
    cache_salt: str | None = None
    arrival_offset: float | None = None
    """Seconds after the engine's start at which the request arrives (None: now).
    Lets a workload replay on the engine's (possibly virtual) clock."""
    final_only: bool = False
    """Send nothing until the request ends, then all its tokens at once (offline batches,
    like vLLM's FINAL_ONLY output kind); False streams a delta every step."""
    ttft_slo_s: float | None = None
    """The client's TTFT target in seconds (``Request.ttft_slo_s``; None: the policy's)."""
    resume_token_ids: list[int] = []
    """Outputs the request has already produced on another engine (a request moved
    mid-stream, :mod:`schedkit.cluster.migration`): they follow its prompt, count
    toward ``max_tokens``, advance its grammar, and are not sent again."""
    hints: dict[str, Any] = {}
    """Its hints (:meth:`RequestHints.to_wire <schedkit.core.hints.RequestHints.to_wire>`):
    SLO class, deadline, expected output length, session."""
    kv_send: bool = False
    """A disaggregated request's prefill: the engine keeps its prompt's KV blocks when it
    finishes, for the front end to send to its decode replica
    (:mod:`schedkit.engine.kv_handoff`); needs the ``kv-transfer`` connector."""


_DEFAULT_MAX_TOKENS = SamplingParams().max_tokens


def wire_max_tokens(request: WireRequest) -> int | None:
    """The ``max_tokens`` a wire request asks for (the default when it sends none); None
    when the value sent is not a whole number (the engine refuses the request then)."""
    fields = request.sampling_params
    value = fields.get("max_tokens", _DEFAULT_MAX_TOKENS) if isinstance(fields, dict) else None
    return value if type(value) is int else None


class AddRequests(msgspec.Struct, tag="add", frozen=True):
    requests: list[WireRequest]


class RawAddRequests(msgspec.Struct, tag="add", frozen=True):
    """``AddRequests`` as the engine decodes it: each request stays encoded until
    :func:`decode_request`, so one badly typed request fails alone."""

    requests: list[msgspec.Raw]


class AbortRequests(msgspec.Struct, tag="abort", frozen=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility", frozen=True):
    call_id: int
    method: str
    args: list[Any] = []


class Hello(msgspec.Struct, tag="hello", frozen=True, omit_defaults=True):
    """Sent on the output socket by a client so the engine learns its identity."""

    load_reports: bool = False
    """Also send this client a :class:`LoadReport` after steps that changed the engine's
    load or KV cache (the router's view of a replica)."""


ClientMessage = AddRequests | AbortRequests | UtilityCall | Hello
EngineInput = RawAddRequests | AbortRequests | UtilityCall | Hello
"""What the engine decodes: the client messages, with requests left encoded."""


WireMetrics = RequestMetricsData
WireOutput = EngineCoreOutput
"""Outputs travel as the scheduler built them (msgspec Structs, no conversion)."""


class UtilityResult(msgspec.Struct, frozen=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None


class OutputBatch(msgspec.Struct, tag="outputs", frozen=True, omit_defaults=True):
    outputs: list[WireOutput] = []
    utility_results: list[UtilityResult] = []


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    engine_time: float


class Ready(msgspec.Struct, tag="ready", frozen=True):
    client_index: int


# KV cache events on the wire: arrays tagged by a small int, without the token ids
# (the router's prefix index needs only the hashes).
class WireBlockStored(msgspec.Struct, tag=0, array_like=True, frozen=True):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    block_size: int


class WireBlockRemoved(msgspec.Struct, tag=1, array_like=True, frozen=True):
    block_hashes: list[bytes]


class WireAllBlocksCleared(msgspec.Struct, tag=2, array_like=True, frozen=True):
    pass


WireKVEvent = WireBlockStored | WireBlockRemoved | WireAllBlocksCleared


def kv_events_to_wire(events: list[KVCacheEvent]) -> list[WireKVEvent]:
    out: list[WireKVEvent] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            out.append(WireBlockStored(ev.block_hashes, ev.parent_block_hash, ev.block_size))
        elif isinstance(ev, BlockRemoved):
            out.append(WireBlockRemoved(ev.block_hashes))
        else:
            out.append(WireAllBlocksCleared())
    return out


def kv_events_from_wire(events: list[WireKVEvent]) -> list[KVCacheEvent]:
    """The events as :mod:`schedkit.kv.events` types (``BlockStored.token_ids`` empty:
    they do not travel)."""
    out: list[KVCacheEvent] = []
    for ev in events:
        if isinstance(ev, WireBlockStored):
            out.append(BlockStored(ev.block_hashes, ev.parent_block_hash, [], ev.block_size))
        elif isinstance(ev, WireBlockRemoved):
            out.append(BlockRemoved(ev.block_hashes))
        else:
            out.append(AllBlocksCleared())
    return out


class LoadReport(msgspec.Struct, tag="load", frozen=True, omit_defaults=True):
    """The engine's load and its KV cache events since the previous report, sent to the
    clients that asked for them (``Hello.load_reports``) at most every
    ``process.LOAD_REPORT_INTERVAL_S`` while something changes. Reports go out in order on the
    output socket, so events are never lost or reordered; ``seq`` counts them from 0."""

    seq: int
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    kv_events: list[WireKVEvent] = []
    num_prefill_tokens: int = 0
    """Prompt tokens its waiting and running requests have still to compute."""
    num_prefill_requests: int = 0
    """Requests with such tokens."""
    prefill_attention: float = 0.0
    """Their prefill attention work left (:class:`~schedkit.engine.load.LoadFigures`)."""
    num_context_tokens: int = 0
    """KV positions its running requests past their prompt hold."""
    decode_tokens_left: list[int] = []
    """For each of those requests, the most output tokens it may still make, ascending."""
    prefill_queue: list[tuple[int, int, int]] = []
    """The first requests still in their prompt, in the order the scheduler takes them:
    (prompt tokens left, tokens computed, output tokens to make)."""


EngineMessage = OutputBatch | Heartbeat | Ready | LoadReport

client_encoder = msgspec.msgpack.Encoder()
client_decoder = msgspec.msgpack.Decoder(EngineInput)
hello_decoder = msgspec.msgpack.Decoder(Hello)
request_decoder = msgspec.msgpack.Decoder(WireRequest)


class _RequestId(msgspec.Struct):
    request_id: Any = None


_request_id_decoder = msgspec.msgpack.Decoder(_RequestId)


def decode_request(raw: msgspec.Raw) -> tuple[WireRequest | None, Any, str | None]:
    """Decode one request of a :class:`RawAddRequests`.

    Returns ``(request, request_id, None)``, or ``(None, request_id, why)`` when the request
    does not decode (``request_id`` is then whatever id could be read, or None).
    """
    try:
        w = request_decoder.decode(raw)
        return w, w.request_id, None
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        why = str(e)
    try:
        rid = _request_id_decoder.decode(raw).request_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        rid = None
    return None, rid, why
engine_encoder = msgspec.msgpack.Encoder()
engine_decoder = msgspec.msgpack.Decoder(EngineMessage)
