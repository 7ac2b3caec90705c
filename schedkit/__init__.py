"""schedkit: a pluggable scheduling-policy framework for LLM inference serving.

The names exported here are the stable surface, the one plugins (policies, KV
connectors, observers) and applications import (``from schedkit import KeyedQueue,
hookimpl``), as pytest exposes ``pytest.*`` over ``_pytest``. The submodules they come
from may move between versions; docs/reference.md ("The public surface") lists these
names, and tests/test_public_surface.py holds the list, the docs and ``__all__`` equal.

``import schedkit`` needs neither torch nor pyzmq: the clients (``LLM``, ``AsyncLLM``)
are imported on first use.
"""

import typing

from schedkit.config import CacheConfig, Config, SchedulerConfig, load_config
from schedkit.core.grammar import StructuredOutputGrammar, StructuredOutputsParams
from schedkit.core.hints import RequestHints
from schedkit.core.hooks import AdmissionDecision, Preemption, Rejection
from schedkit.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    KVConnectorOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
    SpecDecodingStats,
)
from schedkit.core.queues import BaseRequestQueue, FCFSQueue, KeyedQueue, RequestQueue
from schedkit.core.request import EventType, FinishReason, Request, RequestStatus, SamplingParams
from schedkit.core.routing import (
    LatencyEstimate,
    Migration,
    ReplicaState,
    RouteAdmission,
    RouteEvent,
    RouteEventKind,
    RouteLatency,
    RouteRequest,
    RouteVerdict,
)
from schedkit.core.structured_output import GrammarBitmask, StructuredOutputBackend
from schedkit.errors import (
    ConfigError,
    EngineBusyError,
    EngineDeadError,
    PluginError,
    RequestError,
    RouteRefusedError,
    SchedkitError,
)
from schedkit.hookspecs import hookimpl
from schedkit.kv.connector import KVConnectorBase, KVConnectorRole, NoOpConnector
from schedkit.kv.kv_cache_manager import KVCacheManager
from schedkit.kv.metrics import PrefixCacheStats

if typing.TYPE_CHECKING:  # what type checkers see of the clients, imported on first use below
    from schedkit.llm import LLM, AsyncLLM

__all__ = [
    # writing a plugin
    "hookimpl",
    "AdmissionDecision",
    "Rejection",
    "Preemption",
    # routing between replicas
    "RouteRequest",
    "ReplicaState",
    "RouteEvent",
    "RouteEventKind",
    "Migration",
    "RouteAdmission",
    "RouteVerdict",
    "RouteLatency",
    "LatencyEstimate",
    # requests
    "Request",
    "RequestStatus",
    "FinishReason",
    "EventType",
    "SamplingParams",
    "RequestHints",
    "StructuredOutputsParams",
    # waiting queues
    "RequestQueue",
    "BaseRequestQueue",
    "FCFSQueue",
    "KeyedQueue",
    # KV connectors and the KV cache
    "KVConnectorBase",
    "KVConnectorRole",
    "NoOpConnector",
    "KVCacheManager",
    # structured-output backends
    "StructuredOutputBackend",
    "StructuredOutputGrammar",
    "GrammarBitmask",
    # what hooks and connectors are handed each step
    "SchedulerOutput",
    "NewRequestData",
    "CachedRequestData",
    "ModelRunnerOutput",
    "KVConnectorOutput",
    "EngineCoreOutputs",
    "EngineCoreOutput",
    "SchedulerStats",
    "PrefixCacheStats",
    "SpecDecodingStats",
    # configuration
    "Config",
    "SchedulerConfig",
    "CacheConfig",
    "load_config",
    # errors
    "SchedkitError",
    "ConfigError",
    "PluginError",
    "RequestError",
    "EngineBusyError",
    "RouteRefusedError",
    "EngineDeadError",
    # clients (imported on first use)
    "LLM",
    "AsyncLLM",
]

__version__ = "0.1.0"

_LAZY = ("LLM", "AsyncLLM")
"""Names whose module (schedkit.llm) pulls in pyzmq: imported on first use."""


def __getattr__(name: str) -> typing.Any:
    if name in _LAZY:
        from schedkit import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'schedkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
