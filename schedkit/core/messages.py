"""Wire messages between clients and the engine-core process (msgspec, no pickle).

Client -> engine (input socket): ``AddRequests``, ``AbortRequests``, ``UtilityCall``.
Engine -> client (output socket): ``OutputBatch`` (token deltas, finishes with metrics,
per-request errors, utility results) and ``Heartbeat``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from schedkit.core.outputs import EngineCoreOutput, RequestMetricsData
from schedkit.core.request import SamplingParams
from schedkit.errors import RequestError


def sampling_to_wire(params: SamplingParams) -> dict[str, Any]:
    """The fields of ``params`` that differ from their defaults (the wire form)."""
    return {f.name: value for f in dataclasses.fields(params)
            if (value := getattr(params, f.name)) != f.default}


def sampling_from_wire(fields: dict[str, Any], request_id: str) -> SamplingParams:
    """Rebuild (and validate) sampling parameters from their wire form.

    Raises:
        RequestError: An unknown field or an invalid value.
    """
    try:
        return SamplingParams(**fields)
    except TypeError as e:
        raise RequestError(f"request {request_id!r}: invalid sampling parameters: {e}",
                           request_id=request_id) from None


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


class AddRequests(msgspec.Struct, tag="add", frozen=True):
    requests: list[WireRequest]


class AbortRequests(msgspec.Struct, tag="abort", frozen=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility", frozen=True):
    call_id: int
    method: str
    args: list[Any] = []


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """Sent on the output socket by a client so the engine learns its identity."""


ClientMessage = AddRequests | AbortRequests | UtilityCall | Hello


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


EngineMessage = OutputBatch | Heartbeat | Ready

client_encoder = msgspec.msgpack.Encoder()
client_decoder = msgspec.msgpack.Decoder(ClientMessage)
engine_encoder = msgspec.msgpack.Encoder()
engine_decoder = msgspec.msgpack.Decoder(EngineMessage)
