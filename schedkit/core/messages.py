"""Wire messages between clients and the engine-core process (msgspec, no pickle).

Client -> engine (input socket): ``AddRequests``, ``AbortRequests``, ``UtilityCall``.
Engine -> client (output socket): ``OutputBatch`` (token deltas, finishes with metrics,
per-request errors, utility results) and ``Heartbeat``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from schedkit.core.outputs import EngineCoreOutput, RequestMetricsData


class WireSamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    eos_token_id: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None

    @classmethod
    def from_params(cls, params: Any) -> WireSamplingParams:
        """The wire form of a SamplingParams (same field names)."""
        fields = {f: getattr(params, f) for f in cls.__struct_fields__}
        fields["stop_token_ids"] = tuple(fields["stop_token_ids"])
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__struct_fields__}


class WireRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: WireSamplingParams
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
