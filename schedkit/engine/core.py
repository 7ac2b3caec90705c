"""EngineCore: schedule -> runner.execute -> update_from_output, in-process.

With ``scheduler.async_scheduling`` the engine keeps two steps in flight: it schedules
and launches step t+1 before it collects step t's sampled tokens, so the host's
scheduling work overlaps the device's forward pass (a runner that offers
``execute_async`` returns a handle at once; any other runner simply runs the step).

The engine owns the scheduler clock: with a runner that reports step durations (the
fake runner and the simulator) time is virtual and advances by each step's duration,
so a long workload replays in seconds; otherwise it is wall-clock time. Requests may be
added ahead of their arrival (``arrival_offset`` seconds after ``start_time``, the moment
the engine was ready: its runner built and initialized); the engine holds them until its
clock reaches that time, jumping over idle gaps when virtual.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from schedkit.config import Config
from schedkit.core.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    SchedulerOutput,
)
from schedkit.core.request import FinishReason, Request, RequestStatus, check_arrival_offset
from schedkit.core.scheduler import PauseState, Scheduler
from schedkit.core.structured_output import StructuredOutputBackend, StructuredOutputManager
from schedkit.engine.logs import RateLimitedLog
from schedkit.engine.tokenizer import load_tokenizer, model_eos_ids
from schedkit.errors import ConfigError, EngineBusyError, PluginError, RequestError
from schedkit.kv.connector import KVConnectorRole
from schedkit.plugins.facade import HookFacade
from schedkit.plugins.manager import describe_plugins, get_plugin_manager
from schedkit.runners import configured_runner_class

log = logging.getLogger("schedkit.engine")


def _add_output(outputs: dict[int, EngineCoreOutputs], client: int, out: EngineCoreOutput) -> None:
    group = outputs.get(client)
    if group is None:
        outputs[client] = group = EngineCoreOutputs()
    group.outputs.append(out)


def _merge(first: dict[int, EngineCoreOutputs], second: dict[int, EngineCoreOutputs]) -> dict[int, EngineCoreOutputs]:
    for client, group in second.items():
        if client in first:
            first[client].outputs.extend(group.outputs)
            first[client].scheduler_stats = group.scheduler_stats
        else:
            first[client] = group
    return first


STALL_STEPS = 1000
STALL_S = 5.0
OBSERVER_LOG_INTERVAL_S = 10.0
"""An observer hook that raises every step is logged at most once per this many seconds."""
"""A scheduler that let nothing run for this many steps and seconds is stalled."""


class StepHandle(Protocol):
    """A launched step; ``result()`` waits for its sampled tokens."""

    def result(self) -> ModelRunnerOutput: ...


@dataclass(slots=True)
class _Done:
    output: ModelRunnerOutput

    def result(self) -> ModelRunnerOutput:
        return self.output


def refusal_stop_reason(err: BaseException) -> str:
    """The stop reason of a request refused on arrival: "busy" when a bounded queue of
    the engine was full (:class:`EngineBusyError`, retry later), else "refused"."""
    return "busy" if isinstance(err, EngineBusyError) else "refused"


class EngineCore:
    """Args:
        config: The whole validated config.
        runner: A ready runner; by default one is built from ``config.runner``.
        extra_plugins: Plugin objects registered after the configured ones.
    """

    def __init__(self, config: Config, *, runner: Any = None, extra_plugins: Iterable[Any] = ()) -> None:
        self.config = config
        self.plugin_manager = get_plugin_manager(config, extra_plugins=extra_plugins)
        self.runner = runner if runner is not None else self._build_runner(config)
        self._owns_runner = runner is None
        sc = config.scheduler
        if sc.async_scheduling and sc.num_speculative_tokens and not getattr(self.runner, "drafts_in_step", False):
            raise ConfigError(f"scheduler.async_scheduling with num_speculative_tokens needs a runner that proposes "
                              f"drafts inside the step; {type(self.runner).__name__} does not (its drafts_in_step "
                              "is false): turn one of them off")
        self._virtual = bool(getattr(self.runner, "is_virtual_clock", False))
        self._now = 0.0
        self._future: list[tuple[float, int, Request]] = []
        self._seq = itertools.count()
        num_blocks = self.runner.initialize(config.cache.num_blocks, config.cache.block_size)
        cache_cfg = config.cache.model_copy(update={"num_blocks": num_blocks})
        so_cfg = config.structured_outputs
        self.structured_output_manager = StructuredOutputManager(
            self._structured_output_backend, num_workers=so_cfg.num_workers,
            cache_size=so_cfg.cache_size, max_rollback_tokens=config.scheduler.num_speculative_tokens,
            jump_forward=so_cfg.jump_forward, limits=so_cfg)
        lookahead = int(getattr(self.runner, "num_lookahead_tokens", 0) or 0)
        self._drafts_from_hidden = bool(getattr(self.runner, "drafts_from_hidden_states", False))
        self.scheduler = Scheduler(config.scheduler, cache_cfg, HookFacade(self.plugin_manager),
                                   clock=self.now, structured_output_manager=self.structured_output_manager,
                                   num_lookahead_tokens=lookahead, drop_last_hit_block=self._drafts_from_hidden)
        if so_cfg.jump_forward and config.scheduler.async_scheduling:
            log.warning("structured_outputs.jump_forward has no effect with scheduler.async_scheduling: "
                        "a request decoding steadily always has a token in flight, and a request "
                        "never jumps then")
        if hasattr(self.runner, "set_kv_connector"):  # a runner with a worker side
            worker = self.scheduler.hooks.create_kv_connector(role=KVConnectorRole.WORKER, config=cache_cfg)
            if worker is not None:
                self.runner.set_kv_connector(worker)
        self.num_steps = 0
        self.num_busy_steps = 0
        """Steps that scheduled at least one token."""
        self.last_step_s = 0.0
        """Engine-clock seconds the last executed step took, scheduling and output
        processing included (wall time with a real runner; what calibration fits). With
        steps in flight: the time since the previous step's output was processed."""
        self._consecutive_step_failures = 0
        self._num_draft_failures = 0
        self._draft_log = RateLimitedLog(log, OBSERVER_LOG_INTERVAL_S)
        self._hook_logs: dict[tuple[str | None, str | None], RateLimitedLog] = {}
        self._empty_steps = 0
        self._empty_since = 0.0
        self._last_step_empty = False
        self._depth = 2 if config.scheduler.async_scheduling else 1
        self._in_flight: deque[tuple[SchedulerOutput, StepHandle, float]] = deque()
        self._last_done = float("-inf")
        self._launch_async = self._depth > 1 and hasattr(self.runner, "execute_async")
        self._drafts_in_step = self._depth > 1 and bool(config.scheduler.num_speculative_tokens)
        """Asynchronous scheduling with speculation: the runner drafts inside each step
        (the scheduler plans placeholders), not between steps."""
        self._vocab_size: int | None = getattr(self.runner, "vocab_size", None) if getattr(
            self.runner, "checks_token_ids", False) else None
        """Prompt token ids must be below it (runners that index embeddings with them)."""
        self.start_time = self.now()
        """The engine clock when the engine became ready to serve: after the runner was
        built and initialized (model load, KV cache, warm-up, CUDA graphs), so arrival
        offsets count from the moment a request can first be scheduled."""

    def _structured_output_backend(self) -> StructuredOutputBackend:
        """The structured-output backend, built when the first structured request arrives.

        Raises:
            RequestError: No tokenizer, the backend's library is missing, or no plugin
                answers to ``structured_outputs.backend``.
        """
        name = self.config.structured_outputs.backend
        why_none = ""
        try:
            tokenizer = getattr(self.runner, "tokenizer", None) or load_tokenizer(self.config)
        except ConfigError as e:  # a plugin's backend may not need one: let the hook decide
            tokenizer, why_none = None, f" ({e})"
        vocab = max(int(getattr(self.runner, "vocab_size", 0) or 0), len(tokenizer) if tokenizer is not None else 0)
        eos = [*model_eos_ids(self.config), getattr(tokenizer, "eos_token_id", None),
               self.config.runner.eos_token_id]
        eos_ids = list(dict.fromkeys(t for t in eos if type(t) is int and 0 <= t < vocab))
        try:
            backend = self.scheduler.hooks.create_structured_output_backend(
                config=self.config.structured_outputs, tokenizer=tokenizer, vocab_size=vocab,
                eos_token_ids=eos_ids)
        except PluginError as e:
            if isinstance(e.__cause__, RequestError):  # the backend's own refusal
                raise RequestError(f"{e.__cause__}{why_none}") from None
            raise RequestError(f"the structured-output backend {name!r} could not be created: {e}") from None
        if backend is None:
            raise RequestError(f"no structured-output backend answers to structured_outputs.backend = "
                               f"{name!r} (built in: auto, xgrammar, python; others come from plugins)")
        log.info("structured outputs: backend %s, vocabulary %d", backend.name, backend.vocab_size)
        return backend

    @staticmethod
    def _build_runner(config: Config) -> Any:
        cls = configured_runner_class(config)
        return cls.from_config(config)

    @property
    def num_draft_failures(self) -> int:
        """Steps whose drafts the runner failed to propose (each cost one step its
        drafts): after the step before, or inside the step (asynchronous scheduling)."""
        return self._num_draft_failures + int(getattr(self.runner, "num_draft_failures", 0))

    # -- clock ---------------------------------------------------------------------------
    @property
    def is_virtual(self) -> bool:
        """True when time advances by the runner's reported step durations."""
        return self._virtual

    def now(self) -> float:
        return self._now if self._virtual else time.monotonic()

    def advance_to(self, t: float) -> None:
        """Move the virtual clock forward (idle time before the next arrival)."""
        if self._virtual and t > self._now:
            self._now = t

    # -- requests ------------------------------------------------------------------------
    def add_request(self, request: Request, arrival_offset: float | None = None) -> None:
        """Add now, or hold until ``start_time + arrival_offset`` (then stamped as arrival).

        Raises:
            RequestError: Invalid request (checked at once, even for a future arrival):
                besides the scheduler's checks, a prompt token id outside the model's
                vocabulary, or an arrival offset that is not a finite number of seconds
                in [0, MAX_ARRIVAL_OFFSET_S].
        """
        check_arrival_offset(request.request_id, arrival_offset)
        self._check_token_ids(request)
        self._apply_slo_class(request)
        if arrival_offset is None or self.start_time + arrival_offset <= self.now():
            # The engine owns the clock (virtual with the fake runner and the simulator):
            # a request arrives when the engine receives it.
            request.arrival_time = self.now()
            self.scheduler.add_request(request)
            return
        if request.request_id in self.scheduler.requests or any(
                r.request_id == request.request_id for _, _, r in self._future):
            self.scheduler.add_request(request)  # raises the duplicate-id error
        request.arrival_time = self.start_time + arrival_offset
        heapq.heappush(self._future, (request.arrival_time, next(self._seq), request))

    def add_request_at(self, request: Request, arrival_time: float) -> None:
        """Add a request that arrives at ``arrival_time`` on this engine's clock (absolute,
        not an offset). Ahead of the clock it is held until then, as :meth:`add_request`
        with an offset holds it; at or behind the clock it is added now but keeps that
        arrival time: a request that arrived while the current step ran joins the next
        step, its wait counted from its true arrival. (The cluster simulation routes each
        request at its arrival on a clock shared by every replica, so a busy replica's
        clock may be past it.)

        Raises:
            RequestError: As :meth:`add_request`.
        """
        offset = arrival_time - self.start_time
        if arrival_time > self.now():
            self.add_request(request, offset)
            return
        check_arrival_offset(request.request_id, offset)
        self._check_token_ids(request)
        self._apply_slo_class(request)
        request.arrival_time = arrival_time
        self.scheduler.add_request(request)

    def _check_token_ids(self, request: Request) -> None:
        vocab = self._vocab_size
        if vocab is not None and max(request.all_token_ids) >= vocab:
            bad = next(t for t in request.all_token_ids if t >= vocab)
            what = "prompt" if bad in request.prompt_token_ids else "resumed output"
            raise RequestError(f"request {request.request_id!r}: {what} token id {bad} is outside "
                               f"the model's vocabulary of {vocab} tokens", request_id=request.request_id)

    def _apply_slo_class(self, request: Request) -> None:
        """A request of an SLO class gets the class's TTFT and TPOT targets where it set
        none; a class the config does not name is refused."""
        name = request.hints.slo_class
        if name is None:
            return
        targets = self.config.slo_classes.get(name)
        if targets is None:
            known = ", ".join(sorted(self.config.slo_classes)) or "none: the config names no slo_classes"
            raise RequestError(f"request {request.request_id!r}: slo_class {name!r} is not one of the "
                               f"config's slo_classes ({known})", request_id=request.request_id)
        if request.ttft_slo_s is None:
            request.ttft_slo_s = targets.ttft_s
        if request.tpot_slo_s is None:
            request.tpot_slo_s = targets.tpot_s

    @property
    def last_step_empty(self) -> bool:
        """True when the last step scheduled no token (a virtual clock then jumps to the
        next held arrival rather than stepping at the same time again)."""
        return self._last_step_empty

    def next_arrival_in(self) -> float | None:
        """Seconds until the next held request arrives (None if none is held)."""
        return max(self._future[0][0] - self.now(), 0.0) if self._future else None

    def _release_arrivals(self) -> list[tuple[Request, Exception]]:
        # A virtual clock moves only with the steps that run: when nothing is there to
        # run, or the last step ran nothing, it jumps to the next arrival.
        if self._future and self._virtual and (self._last_step_empty or not self.scheduler.has_requests()):
            self.advance_to(self._future[0][0])
        failed = []
        now = self.now()
        while self._future and self._future[0][0] <= now:
            req = heapq.heappop(self._future)[2]
            try:
                self.scheduler.add_request(req)
            except Exception as e:  # e.g. became a duplicate while held
                failed.append((req, e))
        return failed

    def abort_requests(self, request_ids: str | Iterable[str]) -> list[Request]:
        """Abort requests (held, waiting or running); their KV blocks are freed now. One
        id may be passed as a plain string."""
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        held = [r for _, _, r in self._future if r.request_id in ids]
        if held:
            self._future = [e for e in self._future if e[2].request_id not in ids]
            heapq.heapify(self._future)
            for req in held:
                req.status = RequestStatus.FINISHED_ABORTED
        return held + self._finish(list(ids), RequestStatus.FINISHED_ABORTED)

    def _finish(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        try:
            return self.scheduler.finish_requests(request_ids, status)
        except PluginError as e:  # an observer raised; the requests did finish
            log.error("%s", e)
            return list(e.finished_requests or ())

    def has_requests(self) -> bool:
        return bool(self._future) or self.scheduler.has_requests() or bool(self._in_flight)

    @property
    def num_steps_in_flight(self) -> int:
        """Steps launched whose output has not been processed yet."""
        return len(self._in_flight)

    # -- stepping ------------------------------------------------------------------------
    def step(self) -> dict[int, EngineCoreOutputs]:
        """Run one step; returns outputs per client index (empty when idle).

        Failures never escape and never lose a request silently: a plugin that raises
        while deciding about one request fails that request; a plugin that fails the
        whole step three times in a row (no step scheduled, no request failed in
        between) fails every unfinished request; a runner error
        fails the requests of that step. Each failed request gets an output with
        finish_reason "error" and a message naming the plugin and hook (or the runner).
        """
        sched = self.scheduler
        failed_arrivals = self._release_arrivals()
        outputs: dict[int, EngineCoreOutputs] = {}
        for req, err in failed_arrivals:
            _add_output(outputs, req.client_index, EngineCoreOutput(
                req.request_id, [], FinishReason.ERROR, refusal_stop_reason(err), error=str(err)))
        queue = self._in_flight
        if len(queue) < self._depth and sched.has_requests():
            t0 = self.now()
            if self._drafts_in_step:  # from the outputs processed so far
                self._plan_draft_placeholders()
            try:
                scheduler_output = sched.schedule()
            except PluginError as e:
                _merge(outputs, self._on_plugin_error(e))
            except Exception as e:  # the step was undone; this is a bug, but never fatal
                log.exception("schedule() failed; the step was undone")
                _merge(outputs, self._on_plugin_error(PluginError(
                    f"scheduling failed: {type(e).__name__}: {e}")))
            else:
                self._consecutive_step_failures = 0
                _merge(outputs, self._watch_progress(scheduler_output))
                if scheduler_output.structured_output_request_ids:
                    if scheduler_output.pending_structured_output_tokens and queue:
                        # Its grammars must first see the tokens of the step in flight.
                        _merge(outputs, self._collect_oldest())
                    _merge(outputs, self._fill_grammar_bitmask(scheduler_output))
                try:
                    handle = self._launch(scheduler_output)
                except Exception as e:
                    return _merge(outputs, self._on_runner_error(scheduler_output, e))
                queue.append((scheduler_output, handle, t0))
                if len(queue) < self._depth and scheduler_output.total_num_scheduled_tokens:
                    return outputs  # keep the pipeline full: collect it next call
        if not queue:
            return outputs
        return _merge(outputs, self._collect_oldest())

    def _fill_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> dict[int, EngineCoreOutputs]:
        """The step's grammar bitmask; a backend that fails fails the structured requests
        of the step, and a request over its per-step grammar budget fails alone (the step
        runs without their bitmask; their tokens are dropped)."""
        try:
            outputs: dict[int, EngineCoreOutputs] = {}
            for rid, failure in self.scheduler.fill_grammar_bitmask(scheduler_output).items():
                _merge(outputs, self.fail_requests([rid], failure.why, failure.stop_reason))
            return outputs
        except Exception as e:
            log.exception("the structured-output backend failed filling the bitmask")
            return self.fail_requests(list(scheduler_output.structured_output_request_ids),
                                      f"the structured-output backend failed: {type(e).__name__}: {e}")

    def _collect_oldest(self) -> dict[int, EngineCoreOutputs]:
        """Wait for the oldest step in flight and process its output."""
        sched = self.scheduler
        scheduler_output, handle, t0 = self._in_flight.popleft()
        try:
            runner_output = handle.result()
        except Exception as e:
            return self._on_runner_error(scheduler_output, e)
        self._consecutive_step_failures = 0
        if self._virtual and runner_output.step_duration is not None:
            self._now += runner_output.step_duration
        try:
            step_outputs = sched.update_from_output(scheduler_output, runner_output)
        except PluginError as e:  # an observer raised after the step was applied
            self._hook_log(e).error("%s", e)
            step_outputs = e.outputs or {}
        except Exception as e:  # a bug; fail this step's requests rather than the engine
            log.exception("update_from_output failed")
            return self.fail_requests(
                list(scheduler_output.num_scheduled_tokens), f"output processing failed: {type(e).__name__}: {e}")
        if sched.num_spec_tokens and not self._drafts_in_step:
            self._propose_drafts()
        self.num_steps += 1
        if scheduler_output.total_num_scheduled_tokens:
            self.num_busy_steps += 1
        done = self.now()
        self.last_step_s = done - max(t0, self._last_done)
        self._last_done = done
        return step_outputs

    def _propose_drafts(self) -> None:
        """Ask the speculation policy how many drafts each running request gets, the
        runner to propose them, and hand them to the scheduler. A raising or wrongly
        answering policy costs the next step its drafts, nothing else."""
        sched = self.scheduler
        try:
            plan = sched.plan_speculation()
        except PluginError as e:
            self._hook_log(e).error("%s; no draft tokens for the next step", e)
            plan = {}
        # An EAGLE head reads each step's hidden states: it catches up every step.
        if plan or self._drafts_from_hidden:
            try:
                drafts = self.runner.propose_draft_token_ids(plan)
            except Exception as e:  # the drafter's failure costs the next step its drafts only
                self._num_draft_failures += 1
                self._draft_log.error("the runner failed proposing drafts (%s: %s); no drafts for the "
                                      "next step", type(e).__name__, e)
                drafts = {}
            sched.update_draft_token_ids(drafts)

    def _plan_draft_placeholders(self) -> None:
        """Asynchronous scheduling: the speculation policy's plan for the step about to
        be scheduled, as placeholders the runner fills inside that step. A raising
        policy costs that step its drafts, nothing else."""
        try:
            self.scheduler.plan_draft_placeholders()
        except PluginError as e:
            self._hook_log(e).error("%s; no draft tokens for the next step", e)

    def _hook_log(self, e: PluginError) -> RateLimitedLog:
        """One rate-limited log per raising (plugin, hook): an observer that raises every
        step, or a hook that raises for every request, writes a line every
        OBSERVER_LOG_INTERVAL_S, not one per step or request."""
        key = (e.plugin, e.hook)
        limited = self._hook_logs.get(key)
        if limited is None:
            limited = self._hook_logs[key] = RateLimitedLog(log, OBSERVER_LOG_INTERVAL_S)
        return limited

    def _watch_progress(self, scheduler_output: SchedulerOutput) -> dict[int, EngineCoreOutputs]:
        """Fail the waiting requests when the plugins let nothing run for good: at least
        STALL_STEPS steps in a row and STALL_S seconds (wall time) scheduled no token while
        requests waited and nothing else could end the wait (no step in flight, no KV
        load in progress, no pause). Returns their error outputs ({} otherwise)."""
        sched = self.scheduler
        self._last_step_empty = not scheduler_output.total_num_scheduled_tokens
        if (scheduler_output.total_num_scheduled_tokens or self._in_flight
                or (self._future and not self._virtual) or sched.pause_state is not PauseState.UNPAUSED
                or not sched.get_num_unfinished_requests()
                or any(r.status is RequestStatus.WAITING_FOR_REMOTE_KVS for r in sched.kv_holding)
                or self.waiting_for_grammars()):
            self._empty_steps = 0
            return {}
        if self._empty_steps == 0:
            self._empty_since = time.monotonic()
        self._empty_steps += 1
        if self._empty_steps < STALL_STEPS or time.monotonic() - self._empty_since < STALL_S:
            return {}
        self._empty_steps = 0
        message = (f"no progress: {STALL_STEPS}+ steps in a row scheduled nothing for "
                   f"{sched.get_num_unfinished_requests()} unfinished requests (a step budget of 0, "
                   "an admission hook that always skips, or a KV connector that never lets a "
                   "request run)")
        log.error("%s; failing the waiting requests", message)
        return self.fail_requests(list(sched.requests), message)

    def waiting_for_grammars(self) -> bool:
        """Whether a waiting request's grammar is still compiling (the engine then waits
        a little between empty steps instead of spinning)."""
        compiling = self.structured_output_manager.compiling
        return any(compiling(r) for r in self.scheduler.waiting_for_fsm())

    def close(self) -> None:
        """Release what the engine holds: the grammar compile threads, the structured-output
        backend, and the runner's memory (its ``close``, e.g. the paged runner's KV cache)
        when the engine built the runner itself; a runner passed in stays its owner's.
        Without it the memory waits for a garbage collection of the engine's reference
        cycles, which a loop of runs in one process can outpace."""
        self.structured_output_manager.shutdown()
        close = getattr(self.runner, "close", None) if self._owns_runner else None
        if close is not None:
            close()

    def _launch(self, scheduler_output: SchedulerOutput) -> StepHandle:
        if self._launch_async:
            handle: StepHandle = self.runner.execute_async(scheduler_output)
            return handle
        return _Done(self.runner.execute(scheduler_output))

    def _on_runner_error(self, scheduler_output: SchedulerOutput, e: Exception) -> dict[int, EngineCoreOutputs]:
        log.exception("runner failed; failing the requests of this step")
        return self.fail_requests(list(scheduler_output.num_scheduled_tokens),
                                  f"runner failed: {type(e).__name__}: {e}")

    def _on_plugin_error(self, e: PluginError) -> dict[int, EngineCoreOutputs]:
        # Every failed request carries the message; the log gets a line per plugin and hook
        # every OBSERVER_LOG_INTERVAL_S (a hook that raises for each request must not flood it).
        self._hook_log(e).error("%s", e)
        ids = [r for r in e.request_ids if r in self.scheduler.requests]
        if ids:  # progress: these requests leave; the step-failure count starts over
            self._consecutive_step_failures = 0
            return self.fail_requests(ids, str(e))
        self._consecutive_step_failures += 1
        if self._consecutive_step_failures < 3:
            return {}
        self._consecutive_step_failures = 0
        outputs = self.fail_requests(list(self.scheduler.requests), str(e))
        if not self.scheduler.get_num_unfinished_requests():
            # No step may ever succeed to hand the runner these ids; forget them so
            # the engine goes idle (the runner drops a request's state when it sees it
            # again or never).
            self.scheduler.finished_req_ids = set()
        return outputs

    def fail_requests(self, request_ids: list[str], message: str,
                      stop_reason: str | None = None) -> dict[int, EngineCoreOutputs]:
        """Finish requests with an error (and ``stop_reason``, saying whose); returns their
        error outputs per client."""
        outputs: dict[int, EngineCoreOutputs] = {}
        for req in self._finish(request_ids, RequestStatus.FINISHED_ERROR):
            _add_output(outputs, req.client_index, EngineCoreOutput(
                req.request_id, [], FinishReason.ERROR, stop_reason, req.num_cached_tokens, error=message))
        return outputs

    # -- utility calls -------------------------------------------------------------------
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop the prefix cache; with ``reset_running_requests`` preempt every running
        request first (their outputs still in flight are discarded, then recomputed).

        Returns:
            False if blocks are still in use, so nothing was reset.
        """
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    def set_pause_state(self, state: str) -> None:
        """"paused_new": running requests go on, nothing new is admitted (requests whose
        KV is loaded still are); "paused_all": nothing is scheduled; "unpaused".

        Raises:
            ConfigError: Another value.
        """
        try:
            pause = PauseState(state)
        except ValueError:
            raise ConfigError(f"pause state must be one of {', '.join(p.value for p in PauseState)}, "
                              f"got {state!r}") from None
        self.scheduler.set_pause_state(pause)

    def list_plugins(self) -> list[tuple[str, list[str]]]:
        return describe_plugins(self.plugin_manager)

    def stats(self) -> dict[str, Any]:
        sched = self.scheduler
        kv = sched.kv_cache_manager
        totals = kv.prefix_cache_totals
        hooks = sched.hooks
        return {
            "num_running": len(sched.running), "num_waiting": len(sched.waiting),
            "kv_cache_usage": kv.usage, "num_preemptions": sched.num_preemptions_total,
            "voluntary_preemptions": dict(sched.voluntary_preemptions),
            "prefix_cache_hit_rate": kv.prefix_cache_hit_rate, "num_steps": self.num_steps,
            "num_busy_steps": self.num_busy_steps,
            "num_waiting_for_grammar": len(sched.waiting_for_fsm()),
            "grammars_compiled": self.structured_output_manager.num_compiled,
            "grammar_compile_failures": self.structured_output_manager.num_failed,
            "grammar_cache_hits": self.structured_output_manager.num_cache_hits,
            "grammar_compile_timeouts": self.structured_output_manager.num_timeouts,
            "grammar_compiles_cancelled": self.structured_output_manager.num_cancelled,
            "grammar_refusals": self.structured_output_manager.num_refused,
            "grammar_step_budget_failures": self.structured_output_manager.num_over_budget,
            "jump_forward_tokens": sched.num_jump_forward_tokens,
            "num_free_blocks": kv.num_free_blocks, "num_held_arrivals": len(self._future),
            "pause_state": sched.pause_state.value, "now": self.now(),
            "prefix_cache_queries": totals.queries + totals.preempted_queries,
            "prefix_cache_hits": totals.hits + totals.preempted_hits,
            "num_rejected_by_plugin": dict(getattr(hooks, "rejections", {})),
            "num_hook_errors": [[p, h, n] for (p, h), n in getattr(hooks, "errors", {}).items()],
        }
