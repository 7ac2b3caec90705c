"""Typed calls into the plugin layer; implements :class:`schedkit.core.hooks.SchedulerHooks`.

Each method calls one hook with keyword arguments, checks the answer (the answers a
hook may give are stated in its spec, ``schedkit/hookspecs.py``), and turns any
exception raised inside a plugin into a :class:`PluginError` that names the plugin and
the hook. The facade walks the registered implementations itself (in pluggy's call
order: tryfirst, then normal, then trylast; later registrations first within a class),
so it knows exactly which plugin raised or gave a bad answer. A hook that has
``wrapper=True`` implementations is called through pluggy instead, and blame is then
found from the traceback. The plugin set is read once, when the facade is built.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pluggy

from schedkit.config import SchedulerConfig, StructuredOutputsConfig
from schedkit.core.hooks import MAX_REJECTION_REASON, AdmissionDecision, Preemption, Rejection
from schedkit.core.outputs import EngineCoreOutputs, SchedulerOutput, SchedulerStats
from schedkit.core.queues import RequestQueue
from schedkit.core.request import Request, RequestStatus
from schedkit.core.structured_output import StructuredOutputBackend
from schedkit.errors import PluginError
from schedkit.hookspecs import HOOK_NAMES
from schedkit.kv.connector import KVConnectorBase, KVConnectorRole
from schedkit.kv.kv_cache_manager import KVCacheManager
from schedkit.plugins.queue_guard import GuardedQueue

_QUEUE_METHODS = ("add", "peek", "pop", "prepend_request", "prepend_requests",
                  "remove_request", "remove_requests", "__len__", "__iter__")

_Impl = tuple[Any, tuple[str, ...], str]



def _request_id(kwargs: dict[str, Any]) -> str | None:
    req = kwargs.get("request")
    return getattr(req, "request_id", None)


class HookFacade:
    """The scheduler's typed door to the plugins of one PluginManager."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self.pm = pm
        self.errors: Counter[tuple[str, str]] = Counter()
        """Hook errors so far by ``(plugin, hook)``: raises and impossible answers,
        its waiting queue's included (the server exports them as a metric)."""
        self.rejections: Counter[str] = Counter()
        """Requests each plugin's ``schedkit_admit_request`` rejected so far."""
        self._impls: dict[str, tuple[_Impl, ...] | None] = {}
        for name in HOOK_NAMES:
            impls = getattr(pm.hook, name).get_hookimpls()
            if any(i.hookwrapper or i.wrapper for i in impls):
                self._impls[name] = None
            else:
                self._impls[name] = tuple((i.function, tuple(i.argnames), i.plugin_name)
                                          for i in reversed(impls))
        self._chunk_impls = self._impls["schedkit_prefill_chunk_limit"]
        self.has_voluntary_preemptions = self._impls["schedkit_select_voluntary_preemptions"] != ()

    # -- calling -------------------------------------------------------------------------
    def _call(self, name: str, kwargs: dict[str, Any], first: bool) -> tuple[Any, str | None]:
        """Call a hook; for firstresult hooks return (answer, plugin that gave it)."""
        impls = self._impls[name]
        if impls is None:
            return self._call_via_pluggy(name, kwargs)
        for fn, argnames, plugin in impls:
            try:
                result = fn(*[kwargs[a] for a in argnames])
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # a plugin calling sys.exit() must not end the engine
                self.errors[(plugin, name)] += 1
                raise PluginError(f"plugin {plugin!r} raised in hook {name}: "
                                  f"{type(e).__name__}: {e}", plugin=plugin, hook=name,
                                  request_id=_request_id(kwargs)) from e
            if first and result is not None:
                return result, plugin
        return None, None

    def _call_via_pluggy(self, name: str, kwargs: dict[str, Any]) -> tuple[Any, str | None]:
        caller = getattr(self.pm.hook, name)
        try:
            return caller(**kwargs), None
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # a plugin calling sys.exit() must not end the engine
            codes = {getattr(i.function, "__code__", None): i.plugin_name
                     for i in caller.get_hookimpls()}
            plugin, tb = None, e.__traceback__
            while tb is not None and plugin is None:
                plugin = codes.get(tb.tb_frame.f_code)
                tb = tb.tb_next
            self.errors[(plugin or "unknown", name)] += 1
            raise PluginError(f"plugin {plugin!r} raised in hook {name}: "
                              f"{type(e).__name__}: {e}", plugin=plugin, hook=name,
                              request_id=_request_id(kwargs)) from e

    def _bad_answer(self, name: str, plugin: str | None, answer: Any, why: str,
                    request: Request | None = None) -> PluginError:
        self.errors[(plugin or "unknown", name)] += 1
        about = f" for request {request.request_id!r}" if request is not None else ""
        return PluginError(f"plugin {plugin!r}: hook {name} returned {answer!r}{about}: {why}",
                           plugin=plugin, hook=name,
                           request_id=request.request_id if request is not None else None)

    # -- hooks ---------------------------------------------------------------------------
    def create_waiting_queue(self, *, scheduler_config: SchedulerConfig,
                             kv_cache_manager: KVCacheManager,
                             clock: Callable[[], float]) -> RequestQueue:
        name = "schedkit_create_waiting_queue"
        queue, plugin = self._call(name, {"scheduler_config": scheduler_config,
                                          "kv_cache_manager": kv_cache_manager, "clock": clock}, True)
        missing = [m for m in _QUEUE_METHODS if not hasattr(queue, m)]
        if queue is None or missing:
            raise self._bad_answer(name, plugin, queue, f"not a waiting queue (missing {missing})")
        return GuardedQueue(queue, plugin, self.errors)

    def select_preemption_victim(self, *, running: Sequence[Request],
                                 request: Request) -> Request | Preemption:
        name = "schedkit_select_preemption_victim"
        answer, plugin = self._call(name, {"running": running, "request": request}, True)
        victim = answer.request if isinstance(answer, Preemption) else answer
        if (not isinstance(victim, Request) or victim.status is not RequestStatus.RUNNING
                or not any(r is victim for r in running)):
            raise self._bad_answer(name, plugin, answer, "the victim must be one of the running requests",
                                   request)
        if isinstance(answer, Preemption) and answer.save_kv is not None and not isinstance(answer.save_kv, bool):
            raise self._bad_answer(name, plugin, answer, "save_kv must be true, false or None", request)
        return answer

    def select_voluntary_preemptions(self, *, running: Sequence[Request], waiting: RequestQueue,
                                     max_num_running: int, kv_cache_usage: float, now: float,
                                     max_preemptions: int) -> Sequence[Preemption]:
        name = "schedkit_select_voluntary_preemptions"
        answer, plugin = self._call(name, {
            "running": running, "waiting": waiting, "max_num_running": max_num_running,
            "kv_cache_usage": kv_cache_usage, "now": now, "max_preemptions": max_preemptions}, True)
        if answer is None:
            return []
        if isinstance(answer, (str, bytes, Request)) or not isinstance(answer, Sequence):
            raise self._bad_answer(name, plugin, answer, "must be a sequence of running requests")
        if len(answer) > max_preemptions:
            raise self._bad_answer(name, plugin, answer, f"at most {max_preemptions} preemptions "
                                   "per step (scheduler.max_voluntary_preemptions)")
        # A step-wide answer: whatever is wrong in it, no request named in it is to blame
        # (the step is undone; docs/failure-semantics.md).
        chosen: list[Preemption] = []
        seen: set[int] = set()
        live = {id(r) for r in running}
        for item in answer:
            p = item if isinstance(item, Preemption) else Preemption(item, plugin or "unknown")
            req = p.request
            if (not isinstance(req, Request) or req.status is not RequestStatus.RUNNING
                    or id(req) not in live):
                raise self._bad_answer(name, plugin, item, "each must be one of the running requests")
            if id(req) in seen:
                raise self._bad_answer(name, plugin, item, "a request is named twice")
            if not isinstance(p.reason, str):
                raise self._bad_answer(name, plugin, item, "a reason must be a string")
            if p.save_kv is not None and not isinstance(p.save_kv, bool):
                raise self._bad_answer(name, plugin, item, "save_kv must be true, false or None")
            seen.add(id(req))
            chosen.append(p)
        return chosen

    def prefill_chunk_limit(self, *, request: Request, num_new_tokens: int, threshold: int) -> int | None:
        name = "schedkit_prefill_chunk_limit"
        cap, plugin = self._call(name, {"request": request, "num_new_tokens": num_new_tokens,
                                        "threshold": threshold}, True)
        if cap is not None and (type(cap) is not int or cap < 1):
            raise self._bad_answer(name, plugin, cap, "a cap must be an int >= 1", request)
        return cap

    def step_token_budget(self, *, max_num_batched_tokens: int, running: Sequence[Request],
                          waiting: RequestQueue, kv_cache_usage: float, step: int) -> int:
        name = "schedkit_step_token_budget"
        budget, plugin = self._call(name, {
            "max_num_batched_tokens": max_num_batched_tokens, "running": running,
            "waiting": waiting, "kv_cache_usage": kv_cache_usage, "step": step}, True)
        if type(budget) is not int or not 0 <= budget <= max_num_batched_tokens:
            raise self._bad_answer(name, plugin, budget,
                                   f"must be an int in [0, {max_num_batched_tokens}]")
        return budget

    def num_speculative_tokens(self, *, running: Sequence[Request], num_speculative_tokens: int,
                               step: int) -> Mapping[str, int]:
        name = "schedkit_num_speculative_tokens"
        answer, plugin = self._call(name, {"running": running, "num_speculative_tokens": num_speculative_tokens,
                                           "step": step}, True)
        if answer is None:
            return {}
        if not isinstance(answer, Mapping):
            raise self._bad_answer(name, plugin, answer, "must be a mapping from request id to draft tokens")
        # A step-wide answer: whatever is wrong in it, no request named in it is to blame.
        ids = {r.request_id for r in running}
        for rid, k in answer.items():
            if rid not in ids:
                raise self._bad_answer(name, plugin, answer, f"{rid!r} is not a running request")
            if type(k) is not int or not 0 <= k <= num_speculative_tokens:
                raise self._bad_answer(name, plugin, answer, f"the count for {rid!r} must be an int in "
                                       f"[0, {num_speculative_tokens}], got {k!r}")
        return answer

    def admit_request(self, *, request: Request, num_running: int, kv_cache_usage: float,
                      now: float) -> AdmissionDecision:
        name = "schedkit_admit_request"
        decision, plugin = self._call(name, {"request": request, "num_running": num_running,
                                             "kv_cache_usage": kv_cache_usage, "now": now}, True)
        reason = None
        if isinstance(decision, Rejection):
            reason = decision.reason
            if type(reason) is not str or not reason.strip() or len(reason) > MAX_REJECTION_REASON:
                raise self._bad_answer(name, plugin, decision, "a Rejection's reason must be a "
                                       f"non-empty str of at most {MAX_REJECTION_REASON} characters",
                                       request)
            decision = AdmissionDecision.REJECT
        elif not isinstance(decision, AdmissionDecision):
            raise self._bad_answer(name, plugin, decision, "must be an AdmissionDecision or a Rejection",
                                   request)
        if decision is AdmissionDecision.REJECT:
            self.rejections[plugin or "unknown"] += 1
            request.rejected_by = plugin
            request.rejection_reason = reason
        return decision

    def create_kv_connector(self, *, role: KVConnectorRole, config: Any) -> KVConnectorBase | None:
        name = "schedkit_create_kv_connector"
        connector, plugin = self._call(name, {"role": role, "config": config}, True)
        if connector is not None and not isinstance(connector, KVConnectorBase):
            raise self._bad_answer(name, plugin, connector, "must be a KVConnectorBase")
        return connector

    def create_structured_output_backend(self, *, config: StructuredOutputsConfig, tokenizer: Any,
                                         vocab_size: int,
                                         eos_token_ids: Sequence[int]) -> StructuredOutputBackend | None:
        name = "schedkit_create_structured_output_backend"
        backend, plugin = self._call(name, {"config": config, "tokenizer": tokenizer, "vocab_size": vocab_size,
                                            "eos_token_ids": eos_token_ids}, True)
        if backend is not None and not isinstance(backend, StructuredOutputBackend):
            raise self._bad_answer(name, plugin, backend, "must be a StructuredOutputBackend")
        return backend

    def on_step_end(self, *, scheduler_output: SchedulerOutput,
                    outputs: dict[int, EngineCoreOutputs], stats: SchedulerStats | None,
                    now: float) -> None:
        self._call("schedkit_on_step_end", {"scheduler_output": scheduler_output,
                                            "outputs": outputs, "stats": stats, "now": now}, False)

    def on_request_finished(self, *, request: Request, now: float) -> None:
        self._call("schedkit_on_request_finished", {"request": request, "now": now}, False)
