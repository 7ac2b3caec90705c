"""Typed calls into the plugin layer; implements :class:`schedkit.core.hooks.SchedulerHooks`.

Each method calls one pluggy hook with keyword arguments, checks the answer, and turns
any exception raised inside a plugin into a :class:`PluginError` that names the plugin
and the hook. Finding the plugin walks the traceback only after a failure, so the
success path costs one extra Python call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pluggy

from schedkit.config import SchedulerConfig
from schedkit.core.hooks import AdmissionDecision
from schedkit.core.outputs import EngineCoreOutputs, SchedulerOutput, SchedulerStats
from schedkit.core.queues import RequestQueue
from schedkit.core.request import Request, RequestStatus
from schedkit.errors import PluginError
from schedkit.kv.connector import KVConnectorBase, KVConnectorRole

_QUEUE_METHODS = ("add", "peek", "pop", "prepend_request", "prepend_requests",
                  "remove_request", "remove_requests", "__len__", "__iter__")


class HookFacade:
    """The scheduler's typed door to the plugins of one PluginManager."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm
        h = pm.hook
        self._queue = h.schedkit_create_waiting_queue
        self._victim = h.schedkit_select_preemption_victim
        self._chunk = h.schedkit_prefill_chunk_limit
        self._budget = h.schedkit_step_token_budget
        self._admit = h.schedkit_admit_request
        self._connector = h.schedkit_create_kv_connector
        self._step_end = h.schedkit_on_step_end
        self._finished = h.schedkit_on_request_finished

    # -- failure reporting ---------------------------------------------------------------
    def _plugin_of(self, hook_name: str, exc: BaseException) -> str | None:
        codes = {getattr(impl.function, "__code__", None): impl.plugin_name
                 for impl in getattr(self.pm.hook, hook_name).get_hookimpls()}
        tb = exc.__traceback__
        while tb is not None:
            name = codes.get(tb.tb_frame.f_code)
            if name is not None:
                return name
            tb = tb.tb_next
        return None

    def _error(self, hook_name: str, exc: BaseException) -> PluginError:
        plugin = self._plugin_of(hook_name, exc)
        return PluginError(f"plugin {plugin!r} raised in hook {hook_name}: "
                           f"{type(exc).__name__}: {exc}", plugin=plugin, hook=hook_name)

    def _bad_answer(self, hook_name: str, answer: Any, why: str) -> PluginError:
        impls = getattr(self.pm.hook, hook_name).get_hookimpls()
        names = [i.plugin_name for i in reversed(impls)]
        return PluginError(f"hook {hook_name} returned {answer!r}: {why} "
                           f"(implemented by {names})", plugin=names[0] if names else None,
                           hook=hook_name)

    # -- hooks ---------------------------------------------------------------------------
    def create_waiting_queue(self, *, scheduler_config: SchedulerConfig) -> RequestQueue:
        try:
            queue = self._queue(scheduler_config=scheduler_config)
        except Exception as e:
            raise self._error("schedkit_create_waiting_queue", e) from e
        missing = [m for m in _QUEUE_METHODS if not hasattr(queue, m)]
        if queue is None or missing:
            raise self._bad_answer("schedkit_create_waiting_queue", queue,
                                   f"not a waiting queue (missing {missing})")
        return queue

    def select_preemption_victim(self, *, running: Sequence[Request], request: Request) -> Request:
        try:
            victim = self._victim(running=running, request=request)
        except Exception as e:
            raise self._error("schedkit_select_preemption_victim", e) from e
        if victim is None or victim.status is not RequestStatus.RUNNING or victim not in running:
            raise self._bad_answer("schedkit_select_preemption_victim", victim,
                                   "the victim must be one of the running requests")
        return victim

    def prefill_chunk_limit(self, *, request: Request, num_new_tokens: int, threshold: int) -> int | None:
        try:
            cap = self._chunk(request=request, num_new_tokens=num_new_tokens, threshold=threshold)
        except Exception as e:
            raise self._error("schedkit_prefill_chunk_limit", e) from e
        if cap is not None and (type(cap) is not int or cap < 1):
            raise self._bad_answer("schedkit_prefill_chunk_limit", cap, "a cap must be an int >= 1")
        return cap

    def step_token_budget(self, *, max_num_batched_tokens: int, running: Sequence[Request],
                          waiting: RequestQueue, kv_cache_usage: float, step: int) -> int:
        try:
            budget = self._budget(max_num_batched_tokens=max_num_batched_tokens, running=running,
                                  waiting=waiting, kv_cache_usage=kv_cache_usage, step=step)
        except Exception as e:
            raise self._error("schedkit_step_token_budget", e) from e
        if type(budget) is not int or not 0 <= budget <= max_num_batched_tokens:
            raise self._bad_answer("schedkit_step_token_budget", budget,
                                   f"must be an int in [0, {max_num_batched_tokens}]")
        return budget

    def admit_request(self, *, request: Request, num_running: int, kv_cache_usage: float,
                      now: float) -> AdmissionDecision:
        try:
            decision = self._admit(request=request, num_running=num_running,
                                   kv_cache_usage=kv_cache_usage, now=now)
        except Exception as e:
            raise self._error("schedkit_admit_request", e) from e
        if not isinstance(decision, AdmissionDecision):
            raise self._bad_answer("schedkit_admit_request", decision,
                                   "must be an AdmissionDecision")
        return decision

    def create_kv_connector(self, *, role: KVConnectorRole, config: Any) -> KVConnectorBase | None:
        try:
            connector = self._connector(role=role, config=config)
        except Exception as e:
            raise self._error("schedkit_create_kv_connector", e) from e
        if connector is not None and not isinstance(connector, KVConnectorBase):
            raise self._bad_answer("schedkit_create_kv_connector", connector,
                                   "must be a KVConnectorBase")
        return connector

    def on_step_end(self, *, scheduler_output: SchedulerOutput,
                    outputs: dict[int, EngineCoreOutputs], stats: SchedulerStats | None,
                    now: float) -> None:
        try:
            self._step_end(scheduler_output=scheduler_output, outputs=outputs, stats=stats, now=now)
        except Exception as e:
            raise self._error("schedkit_on_step_end", e) from e

    def on_request_finished(self, *, request: Request, now: float) -> None:
        try:
            self._finished(request=request, now=now)
        except Exception as e:
            raise self._error("schedkit_on_request_finished", e) from e
