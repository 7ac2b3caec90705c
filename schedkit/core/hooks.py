"""The scheduler's view of the plugin layer: a Protocol, never pluggy itself.

``schedkit.plugins.facade.HookFacade`` implements this over a pluggy PluginManager;
tests and the overhead benchmark may pass any other implementation. What each hook is
asked, when, and which answers it may give is stated once, in ``schedkit/hookspecs.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    from schedkit.config import SchedulerConfig, StructuredOutputsConfig
    from schedkit.core.outputs import EngineCoreOutputs, SchedulerOutput, SchedulerStats
    from schedkit.core.queues import RequestQueue
    from schedkit.core.request import Request
    from schedkit.core.structured_output import StructuredOutputBackend
    from schedkit.kv.connector import KVConnectorBase, KVConnectorRole
    from schedkit.kv.kv_cache_manager import KVCacheManager


class AdmissionDecision(enum.Enum):
    """Answer of ``schedkit_admit_request`` for the request at the head of the queue."""

    ADMIT = "admit"
    """Try to schedule it now (it may still wait for blocks or budget)."""
    SKIP = "skip"
    """Pass over it this step (it stays waiting, back at its place); the scheduler looks
    at the next request. Not to be confused with returning None, which leaves the
    decision to the next plugin."""
    REJECT = "reject"
    """Finish it (at the end of this schedule()) with finish reason "abort" and
    stop_reason "rejected"."""


class Rejection(NamedTuple):
    """A ``schedkit_admit_request`` answer: REJECT, with the reason the client is told.

    The scheduler treats it as ``AdmissionDecision.REJECT``; ``reason`` travels with the
    request's end (``Request.rejection_reason``, the output's ``rejection_reason``) and
    ``schedkit serve`` puts it in the 429's message.
    """

    reason: str
    """One sentence for the client, e.g. "the TTFT deadline cannot be met: ...". Not
    empty; at most ``MAX_REJECTION_REASON`` characters."""


MAX_REJECTION_REASON = 512


class Preemption(NamedTuple):
    """One answer of ``schedkit_select_voluntary_preemptions``: whom to preempt, and why."""

    request: Request
    """A running request."""
    reason: str = "policy"
    """Why (counted per reason in the engine's stats: ``voluntary_preemptions``)."""
    save_kv: bool | None = None
    """Keep the victim's KV with the KV connector (a swap to host memory, loaded back on
    resumption) rather than recompute it: True or False, or None to leave it to the
    connector (``cpu-offload``'s ``save_on_preemption``). Without such a connector the
    victim recomputes."""


class SchedulerHooks(Protocol):
    """One method per engine hook (``schedkit_<method>`` in ``schedkit/hookspecs.py``,
    whose docstring is its contract); keyword arguments only."""

    def create_waiting_queue(self, *, scheduler_config: SchedulerConfig,
                             kv_cache_manager: KVCacheManager,
                             clock: Callable[[], float]) -> RequestQueue: ...

    def select_preemption_victim(self, *, running: Sequence[Request],
                                 request: Request) -> Request | Preemption: ...

    has_voluntary_preemptions: bool
    """Whether ``select_voluntary_preemptions`` can ever answer (a plugin implements it):
    the scheduler skips the call otherwise."""

    def select_voluntary_preemptions(self, *, running: Sequence[Request], waiting: RequestQueue,
                                     max_num_running: int, kv_cache_usage: float, now: float,
                                     max_preemptions: int) -> Sequence[Preemption]: ...

    def prefill_chunk_limit(self, *, request: Request, num_new_tokens: int, threshold: int) -> int | None: ...

    def step_token_budget(self, *, max_num_batched_tokens: int, running: Sequence[Request],
                          waiting: RequestQueue, kv_cache_usage: float, step: int) -> int: ...

    def num_speculative_tokens(self, *, running: Sequence[Request], num_speculative_tokens: int,
                               step: int) -> Mapping[str, int]: ...

    def admit_request(self, *, request: Request, num_running: int, kv_cache_usage: float,
                      now: float) -> AdmissionDecision: ...

    def create_kv_connector(self, *, role: KVConnectorRole, config: Any) -> KVConnectorBase | None: ...

    def create_structured_output_backend(self, *, config: StructuredOutputsConfig, tokenizer: Any,
                                         vocab_size: int,
                                         eos_token_ids: Sequence[int]) -> StructuredOutputBackend | None: ...

    def on_step_end(self, *, scheduler_output: SchedulerOutput,
                    outputs: dict[int, EngineCoreOutputs], stats: SchedulerStats | None,
                    now: float) -> None: ...

    def on_request_finished(self, *, request: Request, now: float) -> None: ...
