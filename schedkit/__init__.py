"""schedkit: a pluggable scheduling-policy framework for LLM inference serving."""

from schedkit.config import Config, load_config
from schedkit.core.hooks import AdmissionDecision
from schedkit.core.request import FinishReason, Request, RequestStatus, SamplingParams
from schedkit.errors import ConfigError, EngineDeadError, PluginError, RequestError
from schedkit.hookspecs import hookimpl

__all__ = [
    "LLM",
    "AsyncLLM",
    "AdmissionDecision",
    "Config",
    "ConfigError",
    "EngineDeadError",
    "FinishReason",
    "PluginError",
    "Request",
    "RequestError",
    "RequestStatus",
    "SamplingParams",
    "hookimpl",
    "load_config",
]

__version__ = "0.1.0"


def __getattr__(name: str):  # the clients pull in pyzmq: import them on first use
    if name in ("LLM", "AsyncLLM"):
        from schedkit.engine import client

        return getattr(client, name)
    raise AttributeError(f"module 'schedkit' has no attribute {name!r}")
