"""The scheduler: vLLM V1's continuous-batching rules, with every policy decision a hook.

``schedule()`` hands out tokens so that each request's ``num_computed_tokens`` catches up
with its tokens (prompt, outputs, drafts); there is no prefill/decode split. Running
requests go first, in admission order; waiting requests are admitted only in a step
that preempted nobody. ``update_from_output()`` appends sampled tokens, rolls back
rejected drafts, checks stops and frees finished requests.
"""

from __future__ import annotations

import copy
import enum
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from schedkit.config import CacheConfig, SchedulerConfig
from schedkit.core.hooks import AdmissionDecision, Preemption, SchedulerHooks
from schedkit.core.kv_loads import KVLoads
from schedkit.core.outputs import (
    DRAFT_PADDING,
    DRAFT_PLACEHOLDER,
    EngineCoreOutput,
    EngineCoreOutputs,
    KVConnectorOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
    SpecDecodingStats,
)
from schedkit.core.queues import RequestQueue
from schedkit.core.request import FINISH_REASONS, EventType, Request, RequestStatus
from schedkit.core.scheduler_output import build_scheduler_output
from schedkit.core.step_state import UNDO_FIELDS, StepState, StepUndo
from schedkit.core.stop import check_stop
from schedkit.core.structured_output import GrammarFailure, StructuredOutputManager
from schedkit.errors import PluginError, RequestError
from schedkit.kv.connector import KVConnectorBase, KVConnectorRole, NoOpConnector
from schedkit.kv.hashing import BlockHasher
from schedkit.kv.kv_cache_manager import KVCacheManager
from schedkit.kv.metrics import PrefixCacheStats

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_WAITING = RequestStatus.WAITING
_LOADING = RequestStatus.WAITING_FOR_REMOTE_KVS
_FSM = RequestStatus.WAITING_FOR_FSM
_ADMIT = AdmissionDecision.ADMIT
_SKIP = AdmissionDecision.SKIP

log = logging.getLogger("schedkit.scheduler")

class Lookup(NamedTuple):
    """What a waiting request already has computed when it is considered for admission
    (:meth:`Scheduler._lookup`)."""

    hit_blocks: list[int]
    """Its prefix-cache hit blocks."""
    num_local_tokens: int
    """The tokens those blocks hold."""
    num_external_tokens: int
    """The tokens the KV connector loads for it."""
    load_async: bool
    """The connector loads them asynchronously: the request waits for the load."""
    num_computed_tokens: int
    """Where its admission starts: the hits plus the external tokens, or, for a request
    that holds its computed tokens already, its own count."""
    looked_up: bool
    """False for a request that holds its computed tokens already (loaded ones): nothing
    was looked up, so no prefix-cache statistics are recorded."""


class _Head(enum.Enum):
    """What the waiting phase did with the request at the head of a queue
    (:meth:`Scheduler._take_head`): the phase goes on with the next head, or stops."""

    LEFT = "left"
    """Admitted, rejected by the policy, or dropped (it had finished in the queue)."""
    TO_WAITING = "to_waiting"
    """Passed over (not ready, skipped by the policy, the connector asks again): back
    into ``waiting`` at the end of the phase."""
    TO_KV_HOLDING = "to_kv_holding"
    """Passed over while holding KV blocks, or its asynchronous load started: back into
    ``kv_holding`` at the end of the phase."""
    NO_ROOM = "no_room"
    """Stop: the budget has no room for its tokens (it blocks the queue's head), or the
    KV cache none for its blocks."""


class PauseState(enum.Enum):
    """What the scheduler still runs (vLLM's pause states)."""

    UNPAUSED = "unpaused"
    PAUSED_NEW = "paused_new"
    """Running requests go on; only waiting requests that hold KV blocks are admitted."""
    PAUSED_ALL = "paused_all"
    """Nothing is scheduled; requests keep their state and blocks."""


def _fit_max_model_len(scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> int:
    """``max_model_len``, capped (with a warning) at what the whole KV cache holds: a
    longer sequence could never finish and would be preempted forever."""
    capacity = (cache_config.num_blocks - 1) * cache_config.block_size
    if scheduler_config.max_model_len <= capacity:
        return scheduler_config.max_model_len
    log.warning("scheduler.max_model_len = %d does not fit in the KV cache (cache.num_blocks - 1 "
                "= %d usable blocks of cache.block_size = %d tokens = %d tokens): sequences are "
                "capped at %d tokens", scheduler_config.max_model_len, cache_config.num_blocks - 1,
                cache_config.block_size, capacity, capacity)
    return capacity


class Scheduler:
    """Owns the requests, the waiting queue, the running list and the KV cache manager.

    Args:
        scheduler_config: Limits and the policy name.
        cache_config: KV block size, pool size, prefix caching.
        hooks: The policy layer (usually a HookFacade over the plugin manager).
        clock: Time source for request events (the simulator passes a virtual clock).
        log_stats: Attach SchedulerStats to each step's outputs.
        structured_output_manager: Compiles and follows the grammars of requests with
            ``structured_outputs`` (None: such requests are refused).
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 hooks: SchedulerHooks, *, clock: Callable[[], float] = time.monotonic,
                 log_stats: bool = True,
                 structured_output_manager: StructuredOutputManager | None = None,
                 num_lookahead_tokens: int = 0, drop_last_hit_block: bool = False) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.hooks = hooks
        self.clock = clock
        self.log_stats = log_stats
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_active_seqs = scheduler_config.max_num_active_seqs or self.max_num_seqs
        self.pause_state = PauseState.UNPAUSED
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = _fit_max_model_len(scheduler_config, cache_config)
        self.num_spec_tokens = scheduler_config.num_speculative_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        """Slots allocated past each scheduled request's tokens, never cached: where a
        draft model writes the KV of its own drafts before the next step schedules them
        (the runner's ``num_lookahead_tokens``; 0 for model-free proposers)."""
        self._spec_plan: dict[str, int] | None = None
        """The draft tokens :meth:`plan_speculation` planned per request, until
        :meth:`update_draft_token_ids` applies them."""
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.async_scheduling = scheduler_config.async_scheduling
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            block_size=cache_config.block_size, num_blocks=cache_config.num_blocks,
            max_model_len=self.max_model_len, enable_caching=cache_config.enable_prefix_caching,
            watermark=cache_config.watermark, enable_kv_events=cache_config.enable_kv_events,
            drop_last_hit_block=drop_last_hit_block)
        self._hasher = (BlockHasher(cache_config.block_size, cache_config.hash_algo)
                        if cache_config.enable_prefix_caching else None)
        connector = hooks.create_kv_connector(role=KVConnectorRole.SCHEDULER, config=cache_config)
        self.connector = connector if connector is not None else NoOpConnector(KVConnectorRole.SCHEDULER)
        heard = getattr(type(self.connector), "request_preempted", None)
        self._connector_hears_preemptions = heard is not None and heard is not KVConnectorBase.request_preempted
        """Only a connector that overrides ``request_preempted`` is told of victims (their
        block tables are copied for it)."""
        self._connector_stats = PrefixCacheStats() if connector is not None else None
        """This step's lookups answered by the connector (None without a connector)."""
        self.connector.bind_kv_cache_manager(self.kv_cache_manager)
        self.requests: dict[str, Request] = {}
        self.waiting = hooks.create_waiting_queue(scheduler_config=scheduler_config,
                                                  kv_cache_manager=self.kv_cache_manager,
                                                  clock=clock)
        self.kv_loads = KVLoads(self.kv_cache_manager, self.requests,
                                recompute_failed=cache_config.kv_load_failure_policy == "recompute")
        """Asynchronous KV loads: the requests holding loaded blocks, and their state."""
        self.kv_holding: RequestQueue = self.kv_loads.holding
        """Waiting requests that hold KV blocks (an asynchronous load in progress or
        done), in the order their loads started; served before ``waiting``."""
        self.finished_recving_ids = self.kv_loads.finished
        """Requests whose asynchronous load the worker reported complete (vLLM's name)."""
        self.failed_recving_ids = self.kv_loads.failed
        """Requests whose asynchronous load failed: they start over at promotion."""
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.skipped_ids: set[str] = set()
        """Waiting requests the last schedule() passed over (vLLM's deferred_waiting)."""
        self._preempted_ids: set[str] = set()
        self._pending_outputs: list[tuple[Request, EngineCoreOutput]] = []
        self._pending_finished: list[Request] = []
        self._deferred_errors: list[PluginError] = []
        self.current_step = 0
        self.num_preemptions_total = 0
        self._preempted_kv: list[tuple[Request, list[int], int, bool | None]] = []
        """This step's victims for the connector's ``request_preempted``: blocks, computed
        tokens, the policy's wish to save their KV."""
        self.voluntary_preemptions: Counter[str] = Counter()
        """Voluntary preemptions so far, by reason (``schedkit_select_voluntary_preemptions``)."""
        self._max_voluntary = scheduler_config.max_voluntary_preemptions if hooks.has_voluntary_preemptions else 0
        self.structured_output_manager = structured_output_manager
        self.jump_forward = structured_output_manager is not None and structured_output_manager.jump_forward
        self.num_jump_forward_tokens = 0
        """Output tokens appended by jump-forward decoding (not sampled by the runner)."""
        self._num_compile_failures_seen = 0
        self._structured: dict[str, Request] = {}
        """Unfinished requests with ``structured_outputs``: the scheduler's own list, so
        finding them never iterates the policy's queue, and a step without any skips the
        structured-output work."""
        self.grammar_compile_error_reqs: dict[str, Request] = {}
        """Waiting requests whose grammar did not compile: the next update_from_output
        finishes them with an error (vLLM's grammar_compile_error_reqs)."""

    # ------------------------------------------------------------------ entry points
    def add_request(self, request: Request) -> None:
        """Validate and enqueue a new request.

        Raises:
            RequestError: Duplicate id, prompt too long for max_model_len, or a prompt
                that could never fit in the whole KV cache.
        """
        rid = request.request_id
        if rid in self.requests:
            raise RequestError(f"duplicate request id {rid!r}", request_id=rid)
        if request.num_prompt_tokens >= self.max_model_len:
            raise RequestError(
                f"request {rid!r}: prompt has {request.num_prompt_tokens} tokens; it must be "
                f"shorter than max_model_len ({self.max_model_len}"
                f"{', what the KV cache holds' if self.max_model_len < self.scheduler_config.max_model_len else ''})",
                request_id=rid)
        usable = self.kv_cache_manager.num_blocks - 1
        needed = -(-request.num_prompt_tokens // self.block_size)
        if needed > usable:
            raise RequestError(
                f"request {rid!r}: prompt needs {needed} KV blocks but the cache has only "
                f"{usable}; it could never be scheduled", request_id=rid)
        if request.status is not _WAITING or request.num_computed_tokens:
            raise RequestError(f"request {rid!r} was already used (status {request.status.name})",
                               request_id=rid)
        if request.structured_output is not None:
            if self.structured_output_manager is None:
                raise RequestError(f"request {rid!r}: structured outputs are not available in this "
                                   "scheduler (it was built without a structured-output manager)",
                                   request_id=rid)
            self.structured_output_manager.add_request(request)  # compiles in the background
            request.status = _FSM
            self._structured[rid] = request
        if self._hasher is not None and not request.block_hashes:
            extend = self._hasher.extend
            if request.cache_salt is not None:
                extend = functools.partial(extend, cache_salt=request.cache_salt)
            request.set_block_hasher(extend, self.block_size)
        self.requests[rid] = request
        request.record_event(EventType.QUEUED, self.clock())  # before add: queues may read it
        try:
            self.waiting.add(request)
        except BaseException:  # the queue's own error (a PluginError), nothing registered
            del self.requests[rid]
            request.events.clear()
            request.status = _WAITING
            self._forget_structured(request)
            raise
        try:
            self._connector_call("on_new_request", request)
        except PluginError:
            del self.requests[rid]
            request.events.clear()
            self._remove_queued([request])
            request.status = _WAITING
            self._forget_structured(request)
            raise

    def _forget_structured(self, request: Request) -> None:
        """A structured request leaves (refused after its compile was queued, or
        finished): release its compile, which stops if nobody else waits for it."""
        if self._structured.pop(request.request_id, None) is not None:
            assert self.structured_output_manager is not None
            self.structured_output_manager.release(request)

    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus) -> list[Request]:
        """Finish requests from outside (abort, stop string). Unknown or finished ids are ignored.

        Returns:
            The requests that were finished by this call.
        """
        assert finished_status.is_finished, finished_status
        if request_ids is None:
            ids: Iterable[str] = list(self.requests)
        elif isinstance(request_ids, str):
            ids = (request_ids,)
        else:
            ids = request_ids
        reqs = [r for r in (self.requests.get(i) for i in ids) if r is not None and not r.is_finished]
        if not reqs:
            return []
        gone = {id(r) for r in reqs}
        if any(r.status is _RUNNING for r in reqs):
            self.running = [r for r in self.running if id(r) not in gone]
        queued = [r for r in reqs if r.status is not _RUNNING]
        if queued:
            self._remove_queued(queued)
        now = self.clock()
        for req in reqs:
            # A load may still be writing into a loading request's blocks: they are
            # kept until the worker reports the load ended.
            hold = req.status is _LOADING and self.kv_loads.end(req)
            req.status = finished_status
            self._free_request(req, now, hold_blocks=hold)
        try:
            self._notify_finished(reqs, now)
        except PluginError as e:
            e.finished_requests = reqs  # they did finish
            raise
        return reqs

    def has_requests(self) -> bool:
        """Whether a step has work: unfinished requests the pause state lets run, finished
        ids or outputs to hand out, or finished requests whose blocks a connector or a
        load still holds."""
        return bool(self.get_num_unfinished_requests() or self.has_finished_requests()
                    or self._pending_outputs or self._pending_finished)

    def has_finished_requests(self) -> bool:
        return bool(self.finished_req_ids) or len(self.requests) > (
            len(self.running) + len(self.waiting) + len(self.kv_holding))

    def get_num_unfinished_requests(self) -> int:
        """Requests running or waiting that the pause state lets run (finished ones held
        by a connector excluded)."""
        if self.pause_state is PauseState.UNPAUSED:
            return len(self.running) + len(self.waiting) + len(self.kv_holding)
        if self.pause_state is PauseState.PAUSED_NEW:
            return len(self.running) + len(self.kv_holding)
        return 0

    def set_pause_state(self, state: PauseState) -> None:
        """Pause admissions of new work (PAUSED_NEW) or everything (PAUSED_ALL), or resume."""
        self.pause_state = state

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting); waiting includes requests holding loaded KV blocks."""
        return len(self.running), len(self.waiting) + len(self.kv_holding)

    def get_kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop every cached block hash; optionally preempt all running requests first.

        Returns:
            False if blocks are still in use (and running requests were not reset).
        """
        if reset_running_requests:
            while self.running:  # their in-flight outputs are discarded
                self._preempt(self.running.pop(), drop_stale=True)
        return self.kv_cache_manager.reset_prefix_cache()

    def plan_speculation(self) -> dict[str, int]:
        """How many draft tokens to propose for each running request for the next step:
        the ``schedkit_num_speculative_tokens`` policy's answer, the configured
        ``num_speculative_tokens`` for the requests it leaves out. Only requests that get
        at least one are listed (none still prefilling). Drafts left from the last plan
        are dropped; :meth:`update_draft_token_ids` holds the proposer's drafts to the plan.

        Raises:
            PluginError: The policy raised or gave an answer it may not (nothing is
                planned: no drafts for the next step).
        """
        k = self.num_spec_tokens
        self._spec_plan = {}
        for req in self.running:  # the last plan's, left by a request no step scheduled since
            req.spec_token_ids = []
        if not k or not self.running:
            return {}
        answer = self.hooks.num_speculative_tokens(running=self.running, num_speculative_tokens=k,
                                                   step=self.current_step)
        plan = {}
        for req in self.running:
            n = answer.get(req.request_id, k)
            if n and not req.is_prefill_chunk:
                plan[req.request_id] = n
        self._spec_plan = plan
        return plan

    def plan_draft_placeholders(self) -> None:
        """Asynchronous scheduling: give each request :meth:`plan_speculation` plans
        drafts that many :data:`DRAFT_PLACEHOLDER` drafts for its next step, which the
        runner proposes inside that step (vLLM's in-step drafter). Structured requests
        get none: their grammar must see a draft before the step's bitmask is built.

        Raises:
            PluginError: The speculation policy raised (no drafts for the next step).
        """
        plan = self.plan_speculation()
        self._spec_plan = None
        requests = self.requests
        for rid, k in plan.items():
            req = requests[rid]
            if req.structured_output is None:
                req.spec_token_ids = [DRAFT_PLACEHOLDER] * k

    def update_draft_token_ids(self, draft_token_ids: Mapping[str, list[int]]) -> None:
        """Set next step's draft tokens; drafts for a request still prefilling are dropped,
        and after :meth:`plan_speculation` each request keeps at most its planned number
        (none if it was planned none)."""
        plan, self._spec_plan = self._spec_plan, None
        for rid, drafts in draft_token_ids.items():
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            limit = self.num_spec_tokens if plan is None else plan.get(rid, 0)
            if len(drafts) > limit:
                drafts = list(drafts[:limit])
            if not drafts or req.is_prefill_chunk or (
                    req.structured_output is not None and req.structured_output.jump_forward):
                req.spec_token_ids = []
            elif req.structured_output is not None and self.structured_output_manager is not None \
                    and not req.num_output_placeholders:  # the grammar has seen every token
                try:
                    req.spec_token_ids = self.structured_output_manager.validate_drafts(req, drafts)
                except Exception:  # the backend's bug: no drafts this step
                    log.exception("request %r: its grammar failed validating drafts", rid)
                    req.spec_token_ids = []
            else:
                req.spec_token_ids = list(drafts)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first, then admissions if nobody was preempted."""
        undo = StepUndo(len(self.running), self.current_step, self.num_preemptions_total)
        self.current_step += 1
        st = StepState(budget=0, threshold=self._prefill_threshold(), undo=undo)
        kv = self.kv_cache_manager
        kv.begin()
        try:
            if self.pause_state is not PauseState.PAUSED_ALL:
                st.budget = self._step_token_budget()
            self._preempt_on_purpose(st)
            self._schedule_running(st)
            if not st.preempted and st.budget > 0:
                self._schedule_waiting(st)
            output = build_scheduler_output(st, self.kv_cache_manager, self.running, self._preempted_ids,
                                            self.finished_req_ids, self.current_step)
            self._tell_connector_of_preemptions()
            output.kv_connector_metadata = self._connector_call("build_connector_meta", output)
        except BaseException as e:
            self._preempted_kv.clear()
            lost = self._rollback(st)
            if lost and isinstance(e, PluginError):
                e.lost_request_ids += [r.request_id for r in lost]
            raise
        kv.commit()
        self._finish_rejected(st.rejected)
        self._update_after_schedule(st)
        if self._structured:
            self._list_structured_requests(st, output)
        return output

    def _list_structured_requests(self, st: StepState, output: SchedulerOutput) -> None:
        """The step's structured requests that sample, each with its first bitmask row
        (one row per sampled position: the next token, then one per scheduled draft)."""
        rows = output.structured_output_request_ids
        requests = self.requests
        spec = st.spec_tokens
        row = 0
        pending = False
        for rid in st.num_scheduled:
            req = requests[rid]
            so = req.structured_output
            if so is None or so.grammar is None or req.is_prefill_chunk:
                continue
            rows[rid] = row
            row += 1 + len(spec.get(rid, ()))
            pending = pending or req.num_output_placeholders > 1
        output.pending_structured_output_tokens = pending

    def fill_grammar_bitmask(self, output: SchedulerOutput) -> dict[str, GrammarFailure]:
        """Set ``output.grammar_bitmask`` from the grammars' current states. Call it once
        the tokens of every earlier step are processed (with async scheduling, after the
        step in flight when ``output.pending_structured_output_tokens``).

        Returns:
            The requests to fail, with why and their stop reason: their grammar raised
            filling its rows, or went over its per-step budget (their rows allow every
            token; the caller fails them).
        """
        rows = output.structured_output_request_ids
        if not rows or self.structured_output_manager is None:
            return {}
        spec = output.scheduled_spec_decode_tokens
        num_rows = sum(1 + len(spec.get(rid, ())) for rid in rows)
        output.grammar_bitmask, failed = self.structured_output_manager.grammar_bitmask(
            self.requests, rows, spec, num_rows)
        return failed

    def _prefill_threshold(self) -> int:
        """This step's long-prefill cap: off for a request alone in the scheduler, and
        at least an equal share of the budget when adaptive."""
        cfg = self.scheduler_config
        num_reqs = len(self.running) + len(self.waiting) + len(self.kv_holding)
        threshold = cfg.long_prefill_token_threshold if num_reqs > 1 else 0
        if threshold and cfg.long_prefill_token_threshold_adaptive:
            threshold = max(threshold, self.max_num_batched_tokens // num_reqs)
        return threshold

    def _step_token_budget(self) -> int:
        budget = self.hooks.step_token_budget(
            max_num_batched_tokens=self.max_num_batched_tokens, running=self.running,
            waiting=self.waiting, kv_cache_usage=self.kv_cache_manager.usage, step=self.current_step)
        return min(budget, self.max_num_batched_tokens)

    def _schedule_running(self, st: StepState) -> None:
        running = self.running
        allocate = self.kv_cache_manager.allocate_slots
        lookahead = self.num_lookahead_tokens
        chunk_limit = self.hooks.prefill_chunk_limit
        num_scheduled = st.num_scheduled
        last_pos = self.max_model_len - 1
        threshold = st.threshold
        idx = 0
        while idx < len(running) and st.budget > 0:
            req = running[idx]
            computed = req.num_computed_tokens
            placeholders = req.num_output_placeholders
            if placeholders and computed + 2 - placeholders >= req.num_prompt_tokens + req.max_tokens:
                idx += 1  # the steps in flight already sample its last allowed token
                continue
            n = req.num_tokens + len(req.spec_token_ids) + placeholders - computed
            if n > 1:
                cap = chunk_limit(request=req, num_new_tokens=n, threshold=threshold)
                if cap is not None and cap < n:
                    n = cap
            n = min(n, st.budget, last_pos - computed)
            if n <= 0:
                idx += 1
                continue
            new_blocks = allocate(req, n, 0, (), lookahead)
            if new_blocks is None:
                new_blocks, idx = self._preempt_until_fits(req, n, idx, st)
                if new_blocks is None:
                    break
            rid = req.request_id
            num_scheduled[rid] = n
            st.running_reqs.append(req)
            st.running_new_blocks.append(new_blocks)
            st.budget -= n
            if req.is_prefill_chunk:
                st.has_running_prefill = True
            if req.spec_token_ids:
                k = n + computed - req.num_tokens - placeholders
                if k > 0:
                    st.spec_tokens[rid] = req.spec_token_ids[:k]
                st.undo.save(req)
                req.spec_token_ids = []
            idx += 1

    def _preempt_until_fits(self, req: Request, n: int, idx: int, st: StepState) -> tuple[list[int] | None, int]:
        """Preempt victims chosen by the policy until ``req`` gets its blocks or is itself
        preempted. Returns the new blocks (or None) and the corrected scan index."""
        running = self.running
        while True:
            if self._connector_call("has_pending_block_frees"):
                return None, idx
            answer = self.hooks.select_preemption_victim(running=running, request=req)
            victim, save_kv = (answer.request, answer.save_kv) if isinstance(answer, Preemption) else (answer, None)
            if st.undo.running is None:
                st.undo.running = list(running)
            vidx = len(running) - 1 if running[-1] is victim else running.index(victim)
            del running[vidx]
            if vidx < idx:
                idx -= 1
            if victim.request_id in st.num_scheduled:
                self._unschedule(victim, st)
            undo = st.undo
            undo.save(victim)
            if undo.preempted_before is None:
                undo.preempted_before = set(self._preempted_ids)
            st.preempted.append(victim)
            self._preempt(victim, save_kv=save_kv)
            if victim is req:
                return None, idx
            new_blocks = self.kv_cache_manager.allocate_slots(req, n, num_lookahead_tokens=self.num_lookahead_tokens)
            if new_blocks is not None:
                return new_blocks, idx

    def _unschedule(self, req: Request, st: StepState) -> None:
        """Give back the tokens of a request scheduled earlier in this step."""
        st.budget += st.num_scheduled.pop(req.request_id)
        i = st.running_reqs.index(req)
        del st.running_reqs[i]
        del st.running_new_blocks[i]
        st.spec_tokens.pop(req.request_id, None)

    def _preempt_on_purpose(self, st: StepState) -> None:
        """The policy's voluntary preemptions at the start of the step: each victim is
        preempted as on KV pressure, then queued with ``add`` (the policy's order), and
        sits out this step's admissions."""
        if (not self._max_voluntary or not self.running or not self.waiting or st.budget <= 0
                or self.pause_state is not PauseState.UNPAUSED):
            return
        # Requests whose KV load finished are admitted before ``waiting``: their seats
        # are not the waiting requests' to take.
        loaded = sum(1 for r in self.kv_holding if r.status is not _LOADING or self.kv_loads.is_done(r))
        chosen = self.hooks.select_voluntary_preemptions(
            running=self.running, waiting=self.waiting,
            max_num_running=self.max_num_active_seqs - loaded,
            kv_cache_usage=self.kv_cache_manager.usage, now=self.clock(),
            max_preemptions=self._max_voluntary)
        if not chosen:
            return
        undo = st.undo
        if undo.running is None:
            undo.running = list(self.running)
        if undo.preempted_before is None:
            undo.preempted_before = set(self._preempted_ids)
        if undo.voluntary is None:
            undo.voluntary = self.voluntary_preemptions.copy()
        gone = {id(p.request) for p in chosen}
        self.running = [r for r in self.running if id(r) not in gone]
        for p in chosen:
            undo.save(p.request)
            st.preempted_on_purpose.append(p.request)
            self._preempt(p.request, front=False, save_kv=p.save_kv)
            self.voluntary_preemptions[p.reason] += 1

    def _tell_connector_of_preemptions(self) -> None:
        victims, self._preempted_kv = self._preempted_kv, []
        for req, block_ids, computed, save_kv in victims:
            self._connector_call("request_preempted", req, block_ids, computed, save_kv)

    def _preempt(self, req: Request, drop_stale: bool = False, front: bool = True,
                 save_kv: bool | None = None) -> None:
        """Recompute preemption: drop its KV, keep its outputs, queue it again (at the
        head, or with ``add`` when not ``front``). The
        outputs of its steps in flight become stale: delivered when they arrive (it is
        not resumed before), or discarded with ``drop_stale``."""
        assert req.status is _RUNNING, req.status
        if self._connector_hears_preemptions and not drop_stale:  # a cache reset keeps nothing
            self._preempted_kv.append((req, self.kv_cache_manager.get_block_ids(req.request_id),
                                       req.num_computed_tokens, save_kv))
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        high = req.num_computed_high
        req.num_computed_high = max(high, req.num_computed_tokens)
        # Positions of steps in flight count as computed; their rejected drafts will not be.
        req.num_unconfirmed_high = min(req.num_computed_high - high, req.num_in_flight_tokens)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.stale_drop = drop_stale or (req.stale_drop and req.num_stale_output_tokens > 0)
        req.num_stale_output_tokens = req.num_in_flight_tokens
        req.num_output_placeholders = 0
        req.num_preemptions += 1
        req.record_event(EventType.PREEMPTED, self.clock())
        if front:
            self.waiting.prepend_request(req)
        else:
            self.waiting.add(req)
        self._preempted_ids.add(req.request_id)
        self.num_preemptions_total += 1

    def _schedule_waiting(self, st: StepState) -> None:
        """Admit waiting requests: those holding KV blocks (``kv_holding``) first, then
        ``waiting``, each in its policy's order, until there is no queue to serve
        (:meth:`_admission_queue`) or the head request finds no room (:class:`_Head`).
        The requests passed over go back to the front of their queues, in order."""
        to_waiting: list[Request] = []
        to_kv_holding: list[Request] = []
        now = self.clock()
        while (queue := self._admission_queue(st)) is not None:
            req = queue.peek()
            head = self._take_head(queue, req, st, now)
            if head is _Head.LEFT:
                continue
            if head is _Head.TO_WAITING:
                to_waiting.append(req)
            elif head is _Head.TO_KV_HOLDING:
                to_kv_holding.append(req)
            else:  # NO_ROOM
                break
        self._put_back(to_kv_holding, to_waiting, st)

    def _admission_queue(self, st: StepState) -> RequestQueue | None:
        """The queue whose head is considered next: ``kv_holding`` while it has requests,
        then ``waiting`` (unless paused). None once the budget or ``max_num_seqs`` is
        spent, or there is no request left to consider."""
        if st.budget <= 0 or len(self.running) >= self.max_num_active_seqs:
            return None
        if self.kv_holding:
            return self.kv_holding
        if self.waiting and self.pause_state is PauseState.UNPAUSED:
            return self.waiting
        return None

    def _take_head(self, queue: RequestQueue, req: Request, st: StepState, now: float) -> _Head:
        """Consider ``req``, the head of ``queue``: is it ready (:meth:`_ready`), does the
        policy admit it, what is already computed (:meth:`_lookup`); then
        :meth:`_allocate_head`. A request that leaves the head is popped from ``queue``."""
        if req.is_finished:  # its queue failed to remove it when it finished
            queue.pop()
            return _Head.LEFT
        if not self._ready(req, st):
            st.popped.append(queue.pop())
            return _Head.TO_KV_HOLDING if req.status is _LOADING else _Head.TO_WAITING
        decision = self.hooks.admit_request(request=req, num_running=len(self.running),
                                            kv_cache_usage=self.kv_cache_manager.usage, now=now)
        if decision is not _ADMIT:
            st.popped.append(queue.pop())
            if decision is not _SKIP:
                st.rejected.append(req)
                return _Head.LEFT
            return _Head.TO_KV_HOLDING if self._holds_blocks(req) else _Head.TO_WAITING
        lookup = self._lookup(req)
        if lookup is None:  # the connector asks to be asked again later
            st.popped.append(queue.pop())
            return _Head.TO_WAITING
        return self._allocate_head(queue, req, lookup, st, now)

    def _allocate_head(self, queue: RequestQueue, req: Request, lookup: Lookup, st: StepState,
                       now: float) -> _Head:
        """Give the head request its tokens and blocks, then admit it, or start its
        asynchronous load (it gets blocks for the loaded tokens, consumes no budget and
        waits in ``kv_holding`` until the worker reports the load finished)."""
        kv = self.kv_cache_manager
        running = self.running
        computed = lookup.num_computed_tokens
        if lookup.load_async:
            n, reserved = 0, self.kv_loads.blocks_reserved(running, self.max_model_len, self.num_spec_tokens,
                                                         self.num_lookahead_tokens)
        else:
            n, reserved = self._num_tokens_to_admit(req, computed, st), 0
            if n == 0:
                return _Head.NO_ROOM
        new_blocks = kv.allocate_slots(
            req, n, lookup.num_local_tokens, lookup.hit_blocks,
            num_lookahead_tokens=0 if lookup.load_async else self.num_lookahead_tokens,
            num_external_computed_tokens=lookup.num_external_tokens,
            delay_cache_blocks=lookup.load_async, reserved_blocks=reserved,
            full_sequence_must_fit=self.scheduler_config.scheduler_reserve_full_isl,
            apply_watermark=bool(running))
        if new_blocks is None:
            return _Head.NO_ROOM
        self._connector_call("update_state_after_alloc", req, kv.get_block_ids(req.request_id),
                             lookup.num_external_tokens)
        if lookup.looked_up:
            self._record_lookup(req, lookup.num_local_tokens, lookup.num_external_tokens, st)
        st.popped.append(queue.pop())
        if lookup.load_async:
            self._start_load(req, computed, st)
            return _Head.TO_KV_HOLDING
        self._admit(req, n, computed, st, now)
        return _Head.LEFT

    def _start_load(self, req: Request, computed: int, st: StepState) -> None:
        """The request's asynchronous KV load begins: it waits in ``kv_holding``."""
        st.loads_started.append(req)
        st.undo.save(req)
        req.status = _LOADING
        req.num_computed_tokens = computed

    def _put_back(self, to_kv_holding: list[Request], to_waiting: list[Request], st: StepState) -> None:
        """The requests the waiting phase passed over return to the front of their queues,
        in their order, and are marked skipped."""
        st.returned = to_kv_holding + to_waiting
        self._skip(st.returned, st)
        if to_kv_holding:
            self.kv_holding.prepend_requests(to_kv_holding)
        if to_waiting:
            self.waiting.prepend_requests(to_waiting)

    def _ready(self, req: Request, st: StepState) -> bool:
        """Whether the head request may be considered now: a load still in progress, a
        preempted request whose outputs from before its preemption are still in flight,
        or one preempted voluntarily in this very step, waits. A finished load is
        promoted here."""
        if req.status is _LOADING:
            if not self.kv_loads.is_done(req):
                return False
            st.undo.save(req)
            st.undo.promoted.append((req.request_id, *self.kv_loads.promote(req)))
            return True
        if req.status is _FSM:
            return self._grammar_ready(req, st)
        if st.preempted_on_purpose and req.request_id in self._preempted_ids:
            return False
        return not (req.num_stale_output_tokens and not req.stale_drop)

    def _grammar_ready(self, req: Request, st: StepState) -> bool:
        """A request waiting for its grammar: promoted to WAITING once it compiled; one
        whose grammar failed stays (the next update finishes it with an error)."""
        assert self.structured_output_manager is not None and req.structured_output is not None
        if self.structured_output_manager.check_ready(req):
            st.undo.save(req)
            req.status = _WAITING
            return True
        if req.structured_output.error is not None:
            self.grammar_compile_error_reqs[req.request_id] = req
        return False

    def _lookup(self, req: Request) -> Lookup | None:
        """What a new (or preempted) request holding no blocks already has computed: its
        prefix-cache hits, then the tokens the connector will load. A request that holds
        blocks (loaded ones) looks nothing up (``looked_up`` False). None when the
        connector says "ask again".

        Raises:
            PluginError: The connector's answer is impossible.
        """
        if req.num_computed_tokens or self._holds_blocks(req):
            return Lookup([], 0, 0, False, req.num_computed_tokens, looked_up=False)
        hit_blocks, num_local = self.kv_cache_manager.get_computed_blocks(req)
        answer = self._connector_call("get_num_new_matched_tokens", req, num_local)
        if (not isinstance(answer, tuple) or len(answer) != 2 or type(answer[1]) is not bool
                or not (answer[0] is None or type(answer[0]) is int)):
            num_ext, load_async, limit = answer, False, -1  # reported below
        else:
            num_ext, load_async = answer
            if req.skip_reading_prefix_cache:
                num_ext, load_async = 0, False
            if num_ext is None:
                return None
            limit = req.num_tokens - num_local - (0 if load_async else 1)
        if limit < 0 or num_ext < 0 or num_ext > limit or (load_async and not num_ext):
            raise PluginError(
                f"KV connector {type(self.connector).__name__!r} answered "
                f"get_num_new_matched_tokens(request {req.request_id!r}, {num_local}) with "
                f"{answer!r}: the answer is (external tokens: int or None, load "
                f"asynchronously: bool), the tokens >= 0, at most "
                f"{max(limit, 0)} (a synchronous load leaves one token to compute), and > 0 "
                "for an asynchronous load", plugin=type(self.connector).__name__,
                hook="KVConnector.get_num_new_matched_tokens", request_id=req.request_id)
        return Lookup(hit_blocks, num_local, num_ext, load_async, num_local + num_ext, looked_up=True)

    def _skip(self, reqs: list[Request], st: StepState) -> None:
        skipped = self.skipped_ids
        newly = st.undo.newly_skipped
        for req in reqs:
            rid = req.request_id
            if rid not in skipped:
                skipped.add(rid)
                newly.append(rid)

    def _record_lookup(self, req: Request, num_local: int, num_ext: int, st: StepState) -> None:
        """Prefix-cache statistics of an admission (or load start) that looked up hits:
        the local cache's, then the connector's for the tokens the cache did not have."""
        preempted = req.num_preemptions > 0
        if not req.skip_reading_prefix_cache:
            self.kv_cache_manager.record_prefix_cache_hits(req.num_tokens, num_local, preempted)
        queries = req.num_tokens - num_local
        stats = self._connector_stats
        if stats is not None and queries:
            if st.undo.connector_stats is None:
                st.undo.connector_stats = copy.copy(stats)
            stats.record(queries, num_ext, preempted)

    def take_connector_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """This step's connector lookups, then start new ones (None without a connector)."""
        stats = self._connector_stats
        if stats is not None:
            self._connector_stats = PrefixCacheStats()
        return stats

    def _num_tokens_to_admit(self, req: Request, computed: int, st: StepState) -> int:
        """Tokens for a waiting request this step; 0 means stop admitting (head-of-line)."""
        n = req.num_tokens - computed
        k = self.num_spec_tokens
        if (k and n == 1 and not st.has_running_prefill and (st.running_reqs or computed > 0)
                and computed + k + 2 <= self.max_model_len):
            # Pad a one-token admission with placeholder drafts so the batch stays uniform.
            if 1 + k > st.budget:
                return 0
            return 1 + k
        if n > 1:
            cap = self.hooks.prefill_chunk_limit(request=req, num_new_tokens=n, threshold=st.threshold)
            if cap is not None and cap < n:
                n = cap
        if not self.enable_chunked_prefill and n > st.budget:
            return 0
        return min(n, st.budget)

    def _admit(self, req: Request, n: int, computed: int, st: StepState, now: float) -> None:
        rid = req.request_id
        st.undo.save(req)
        if rid in self.skipped_ids:
            self.skipped_ids.discard(rid)
            st.undo.unskipped.append(rid)
        self.running.append(req)
        (st.new_reqs if req.status is _WAITING else st.resumed_reqs).append(req)
        req.status = _RUNNING
        req.num_computed_tokens = computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = computed
        req.record_event(EventType.SCHEDULED, now)
        st.num_scheduled[req.request_id] = n
        st.budget -= n
        if n > 1 and req.num_tokens - computed == 1:
            st.spec_tokens[rid] = [DRAFT_PADDING] * (n - 1)  # padded admission

    def _remove_queued(self, reqs: list[Request]) -> None:
        """Take finished requests out of the queues. If the policy's queue raises, they
        stay in it and are dropped when they reach its head."""
        try:
            self.waiting.remove_requests(reqs)
        except PluginError as e:
            log.error("%s; the finished requests leave the queue when they reach its head", e)
        self.kv_holding.remove_requests(reqs)

    def _rollback(self, st: StepState) -> list[Request]:
        """Undo a step a plugin failed part-way: the scheduler and the KV cache return to
        their state before ``schedule()`` (see ``core/step_state.py``); requests go back
        to their queues in their original order. Returns the requests that could not be
        put back (their queue raised again): the caller fails them."""
        undo = st.undo
        lost: list[Request] = []
        if st.returned:
            lost += _remove_or_lose(self.kv_holding, st.returned)
            lost += _remove_or_lose(self.waiting, st.returned)
        if st.preempted or st.preempted_on_purpose:
            lost += _remove_or_lose(self.waiting, st.preempted + st.preempted_on_purpose)
        self.kv_cache_manager.rollback()
        for req, values, num_events in undo.saved.values():
            for name, value in zip(UNDO_FIELDS, values, strict=True):
                setattr(req, name, value)
            del req.events[num_events:]
        if undo.running is not None:
            self.running = undo.running
        else:
            del self.running[undo.num_running:]
        self.current_step = undo.current_step
        self.num_preemptions_total = undo.num_preemptions_total
        if undo.voluntary is not None:
            self.voluntary_preemptions = undo.voluntary
        if undo.preempted_before is not None:
            self._preempted_ids = undo.preempted_before
        self.skipped_ids.update(undo.unskipped)
        self.skipped_ids.difference_update(undo.newly_skipped)
        for rid, in_finished, in_failed in undo.promoted:
            self.kv_loads.restore(rid, in_finished, in_failed)
        if undo.connector_stats is not None:
            self._connector_stats = undo.connector_stats
        lost = list({id(r): r for r in lost}.values())
        gone = {id(r) for r in lost}
        gone |= {id(r) for r in st.preempted_on_purpose}  # running again (undo.running)
        for req in reversed(st.popped):
            if id(req) in gone:
                continue
            try:
                self._enqueue(req, front=True)
            except PluginError as e:
                log.error("%s; request %r cannot be put back and fails", e, req.request_id)
                lost.append(req)
                gone.add(id(req))
        return lost

    def _holds_blocks(self, req: Request) -> bool:
        return self.kv_cache_manager.get_num_blocks(req.request_id) > 0

    def _enqueue(self, req: Request, front: bool = False) -> None:
        """Into ``kv_holding`` if the request holds KV blocks (an asynchronous load, or
        loaded tokens not yet admitted), else into ``waiting``."""
        queue = self.kv_holding if self._holds_blocks(req) else self.waiting
        if front:
            queue.prepend_request(req)
        else:
            queue.add(req)

    def _update_after_schedule(self, st: StepState) -> None:
        requests = self.requests
        placeholders = self.async_scheduling
        for rid, n in st.num_scheduled.items():
            req = requests[rid]
            done = req.num_computed_tokens
            if done < req.num_computed_high:  # work a preemption threw away, done again
                req.num_recomputed_tokens += min(n, req.num_computed_high - done)
            req.num_computed_tokens = done + n
            req.num_in_flight_tokens += n
            req.is_prefill_chunk = req.num_computed_tokens < req.num_tokens + req.num_output_placeholders
            if placeholders and not req.is_prefill_chunk:  # the token this step samples, and its drafts
                req.num_output_placeholders += 1 + len(st.spec_tokens.get(rid, ()))
            so = req.structured_output
            if so is not None and so.jump_forward:
                so.jump_forward = []  # the runner has them (appended or resumed tokens)
        self.finished_req_ids = set()
        self._preempted_ids = set()

    def _finish_rejected(self, rejected: list[Request]) -> None:
        if not rejected:
            return
        now = self.clock()
        for req in rejected:
            req.status = RequestStatus.FINISHED_ABORTED
            req.stop_reason = "rejected"
            self._free_request(req, now)
            self._pending_outputs.append((req, EngineCoreOutput(
                req.request_id, [], FINISH_REASONS[req.status], req.stop_reason,
                rejected_by=req.rejected_by, rejection_reason=req.rejection_reason)))
        # Observers hear of them in update_from_output, so a raising observer cannot
        # lose this step's output (its admissions must reach the runner).
        self._pending_finished.extend(rejected)

    # ------------------------------------------------------------------ update
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> dict[int, EngineCoreOutputs]:
        """Apply one step's sampled tokens. Returns the outputs grouped by client index.

        Phases: the worker's load failures (before tokens, which bad KV voids), the
        sampled tokens, the requests that finished, the loads and sends the worker
        completed, statistics, then the observers.

        Raises:
            PluginError: An observer (or a connector's ``request_finished``) raised; the
                step itself was applied and its outputs are ``error.outputs``.
        """
        kv_out = runner_output.kv_connector_output
        bad_loads = self._apply_failed_loads(kv_out, scheduler_output)
        by_client: dict[int, list[EngineCoreOutput]] = {}
        mgr = self.structured_output_manager
        if mgr is not None and mgr.num_failure_events != self._num_compile_failures_seen:
            self._find_compile_failures(mgr)
        if self.grammar_compile_error_reqs:
            self._fail_grammar_errors()
        for req, out in self._pending_outputs:
            by_client.setdefault(req.client_index, []).append(out)
        self._pending_outputs = []
        spec_stats = (SpecDecodingStats() if scheduler_output.scheduled_spec_decode_tokens
                      and self.log_stats else None)
        stopped, stopped_waiting = self._append_sampled(
            scheduler_output, runner_output, {r.request_id for r in bad_loads}, by_client, spec_stats)
        now = self.clock()
        if bad_loads and not self.kv_loads.recompute_failed:
            assert kv_out is not None
            self._fail_bad_loads(bad_loads, kv_out.invalid_block_ids, now, by_client)
        if stopped:
            self._finish_stopped(stopped, stopped_waiting, now, by_client)
        self._apply_finished_transfers(kv_out)
        outputs = {c: EngineCoreOutputs(outputs=o) for c, o in by_client.items()}
        stats = self._make_stats(spec_stats) if self.log_stats else None
        if stats is not None:
            outputs.setdefault(0, EngineCoreOutputs()).scheduler_stats = stats
        if self._pending_finished:
            stopped = self._pending_finished + stopped
            self._pending_finished = []
        try:
            self._notify_finished(stopped, now)
            self.hooks.on_step_end(scheduler_output=scheduler_output, outputs=outputs,
                                   stats=stats, now=now)
            if self._deferred_errors:
                err, self._deferred_errors = self._deferred_errors[0], []
                raise err
        except PluginError as e:
            e.outputs = outputs  # the step itself succeeded
            raise
        return outputs

    def _find_compile_failures(self, mgr: StructuredOutputManager) -> None:
        """A compilation failed since the last update: find its requests wherever they
        wait in the queue (not only those a schedule() reached)."""
        self._num_compile_failures_seen = mgr.num_failure_events
        for req in self.waiting_for_fsm():
            so = req.structured_output
            if so is not None and not mgr.check_ready(req) and so.error:
                self.grammar_compile_error_reqs[req.request_id] = req

    def waiting_for_fsm(self) -> list[Request]:
        """The requests in WAITING_FOR_FSM (their grammar compiling, or failed and not yet
        finished)."""
        return [r for r in self._structured.values() if r.status is _FSM]

    def _fail_grammar_errors(self) -> None:
        """Finish the waiting requests whose grammar did not compile (error outputs)."""
        reqs = [r for r in self.grammar_compile_error_reqs.values() if not r.is_finished]
        self.grammar_compile_error_reqs = {}
        if not reqs:
            return
        self._remove_queued(reqs)
        now = self.clock()
        for req in reqs:
            assert req.structured_output is not None
            req.status = RequestStatus.FINISHED_ERROR
            req.stop_reason = "grammar_compile_failed"
            self._free_request(req, now)
            self._pending_finished.append(req)
            self._pending_outputs.append((req, EngineCoreOutput(
                req.request_id, [], FINISH_REASONS[req.status], req.stop_reason,
                error=req.structured_output.error)))

    def _apply_failed_loads(self, kv_out: KVConnectorOutput | None,
                            scheduler_output: SchedulerOutput) -> list[Request]:
        """Whole loads that failed, and blocks whose load failed; returns the requests
        that read bad blocks (their tokens of this step are void)."""
        if kv_out is None:
            return []
        if kv_out.failed_recving:
            fail, release = self.kv_loads.on_failed(kv_out.failed_recving)
            for req in release:
                self._release_blocks(req)
            now = self.clock()
            for req in fail:  # their outputs go out with this step's
                self._pending_outputs.append((req, self._fail_request(
                    req, now, "the KV connector failed to load its KV cache")))
        if kv_out.invalid_block_ids:
            return self.kv_loads.on_invalid_blocks(kv_out.invalid_block_ids, self.running)
        return []

    def _append_sampled(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                        skip: set[str], by_client: dict[int, list[EngineCoreOutput]],
                        spec_stats: SpecDecodingStats | None) -> tuple[list[Request], list[Request]]:
        """Apply each request's sampled tokens: leave out void ones, roll back rejected
        drafts (:meth:`_apply_spec_result`), append the tokens and check stops (through
        the grammar: :meth:`_append_constrained`), count the placeholders they fill
        (:meth:`_fill_placeholders`), append what the grammar forces (:meth:`_jump_forward`),
        then the output. This runs for every request in every step: the plain case (one
        token, no grammar) stays inline. Returns the requests that stopped, and those of
        them that were waiting."""
        sampled = runner_output.sampled_token_ids
        index = runner_output.req_id_to_index
        requests = self.requests
        spec_sched = scheduler_output.scheduled_spec_decode_tokens
        max_model_len = self.max_model_len
        jump_forward = self.jump_forward
        stopped: list[Request] = []
        stopped_waiting: list[Request] = []
        client = -1
        outs: list[EngineCoreOutput] = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            req = requests.get(rid)
            if req is None:
                continue  # finished while the step ran
            req.num_in_flight_tokens -= n
            stale = req.num_stale_output_tokens > 0
            i = index.get(rid)
            gen = sampled[i] if i is not None else None
            if stale:  # scheduled before the request's last preemption
                req.num_stale_output_tokens -= n
                if gen and spec_sched and (drafts := spec_sched.get(rid)):
                    self._forget_stale_drafts(req, len(drafts), len(gen))
                if req.stale_drop:
                    continue
            status = req.status
            if not gen or (status is not _RUNNING and not (stale and status is _PREEMPTED)) or rid in skip:
                continue  # a prefill chunk that sampled nothing, finished while the step ran, read bad KV
            if spec_sched and not stale and (drafts := spec_sched.get(rid)):
                self._apply_spec_result(req, drafts, len(gen), spec_stats, runner_output.num_proposed_drafts.get(rid))
            # The tokens.
            is_first = not req.output_token_ids
            error = None
            so = req.structured_output
            if so is not None and so.grammar is not None:
                new_ids, is_stopped, error = self._append_constrained(req, gen)
            elif len(gen) == 1:
                req.append_output_token_ids(gen[0])
                is_stopped = check_stop(req, max_model_len)
                new_ids = gen
            else:
                new_ids, is_stopped = self._append_tokens(req, gen)
            if req.num_output_placeholders and not stale:
                self._fill_placeholders(req, len(new_ids), status is _RUNNING and not is_stopped)
            if (jump_forward and not is_stopped and status is _RUNNING and not stale
                    and not req.num_output_placeholders):
                new_ids, is_stopped = self._jump_forward(req, new_ids)
            if is_first:
                req.record_event(EventType.FIRST_TOKEN, self.clock())
            # The output.
            if is_stopped:
                stopped.append(req)
                if status is _PREEMPTED:
                    stopped_waiting.append(req)
                out = EngineCoreOutput(rid, new_ids, FINISH_REASONS[req.status], req.stop_reason,
                                       req.num_cached_tokens, error=error)
            else:
                out = EngineCoreOutput(rid, new_ids, None, None, req.num_cached_tokens)
            if req.client_index != client:  # consecutive requests mostly share a client
                client = req.client_index
                outs = by_client.setdefault(client, [])
            outs.append(out)
        return stopped, stopped_waiting

    def _append_constrained(self, req: Request, gen: list[int]) -> tuple[list[int], bool, str | None]:
        """Append a structured request's tokens as far as its grammar takes them
        (:meth:`_advance_grammar`). A token the grammar rejected, once appended, fails
        the request; a grammar that terminated stops it. Returns the tokens appended,
        whether the request stopped, and its error (None unless it failed)."""
        so = req.structured_output
        assert so is not None and so.grammar is not None
        kept, error = self._advance_grammar(req, gen)
        new_ids, is_stopped = self._append_tokens(req, kept)
        if error is not None and len(new_ids) == len(kept):  # the rejected token was kept
            req.status, req.stop_reason = RequestStatus.FINISHED_ERROR, "grammar_rejected"
            return new_ids, True, error
        if not is_stopped and so.grammar.is_terminated():
            req.status = RequestStatus.FINISHED_STOPPED
            return new_ids, True, None
        return new_ids, is_stopped, None

    def _fill_placeholders(self, req: Request, num_new: int, cache: bool) -> None:
        """The step's ``num_new`` tokens take the place of the output placeholders counted
        for them at scheduling (asynchronous scheduling). With ``cache`` (the request
        runs on), the blocks they filled enter the prefix cache."""
        req.num_output_placeholders -= num_new
        kv = self.kv_cache_manager
        if cache and kv.enable_caching:
            kv.cache_blocks(req, req.num_computed_tokens - req.num_output_placeholders)

    def _jump_forward(self, req: Request, new_ids: list[int]) -> tuple[list[int], bool]:
        """Append the tokens the request's grammar forces next, without sampling them:
        they are output tokens whose KV the next step computes (the runner learns them
        from ``CachedRequestData.appended_token_ids``). Returns the step's new tokens
        and whether the request stopped."""
        so = req.structured_output
        if so is None or so.grammar is None:
            return new_ids, False
        room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens)
        if room <= 0 or so.grammar.is_terminated():
            return new_ids, False
        t0 = time.perf_counter()
        try:
            forced = so.grammar.validate_tokens(so.grammar.jump_forward_tokens()[:room])
            if not forced or not so.grammar.accept_tokens(req.request_id, forced):
                return new_ids, False
        except Exception:  # the backend's bug: no jump this time
            log.exception("request %r: jump-forward failed in its grammar", req.request_id)
            return new_ids, False
        finally:
            so.matcher_s += time.perf_counter() - t0  # counted against its step budget
        appended, stopped = self._append_tokens(req, forced)  # a stop ends the request: no rollback
        if not stopped and so.grammar.is_terminated():
            req.status = RequestStatus.FINISHED_STOPPED
            stopped = True
        so.jump_forward.extend(appended)
        self.num_jump_forward_tokens += len(appended)
        return new_ids + appended, stopped

    @staticmethod
    def _advance_grammar(req: Request, gen: list[int]) -> tuple[list[int], str | None]:
        """Feed a step's tokens to the request's grammar one by one, before they are
        appended. Returns the tokens to keep, cut after the one that ends the grammar (a
        verified draft may end it before the step's last token), or after the first
        one it rejects (a bug in the runner or the backend: then the error, and the
        request fails keeping that token). A grammar that raises fails the request too."""
        so = req.structured_output
        assert so is not None and so.grammar is not None
        rid = req.request_id
        t0 = time.perf_counter()
        try:
            for j, tok in enumerate(gen):
                try:
                    if so.grammar.is_terminated():
                        return gen[:j], None
                    ok = so.grammar.accept_tokens(rid, (tok,))
                except Exception as e:  # the backend's bug: this request fails, not the step
                    log.exception("request %r: its grammar raised accepting token %d", rid, tok)
                    why = f"the structured-output backend raised accepting token {tok}: {type(e).__name__}: {e}"
                    return gen[: j + 1], f"request {rid!r}: {why}"
                if not ok:
                    log.error("request %r: its grammar rejected the sampled token %d (position %d of the "
                              "step's %s)", rid, tok, j, gen)
                    return gen[: j + 1], (f"request {rid!r}: the sampled token {tok} (position "
                                          f"{req.num_output_tokens + j} of its output) is not allowed by its "
                                          f"{so.params.describe()}")
            return gen, None
        finally:
            so.matcher_s += time.perf_counter() - t0  # counted against its step budget

    @staticmethod
    def _forget_stale_drafts(req: Request, num_drafts: int, num_gen: int) -> None:
        """A step in flight when ``req`` was preempted verified ``num_drafts`` drafts and
        kept ``num_gen - 1`` of them: the rejected ones' positions, counted in its mark of
        work done (``num_computed_high``) at the preemption, were never computed."""
        cut = min(max(num_drafts - (num_gen - 1), 0), req.num_unconfirmed_high)
        req.num_computed_high -= cut
        req.num_unconfirmed_high -= cut

    def _apply_spec_result(self, req: Request, drafts: list[int], num_gen: int,
                           spec_stats: SpecDecodingStats | None, num_proposed: int | None = None) -> None:
        """Take back the rejected drafts' tokens and count the request's acceptance
        (``num_proposed``: the drafts the runner proposed in the step, the rest of the
        scheduled slots being padding; None: every slot held a draft)."""
        num_accepted = num_gen - 1
        num_rejected = len(drafts) - num_accepted
        if num_rejected > 0 and req.num_computed_tokens > 0:
            req.num_computed_tokens -= num_rejected
        if num_rejected > 0 and req.num_output_placeholders:  # the drafts were counted as placeholders
            req.num_output_placeholders = max(req.num_output_placeholders - num_rejected, 0)
        real = len(drafts) if num_proposed is None else num_proposed
        if drafts[0] != DRAFT_PADDING and real:
            req.num_draft_tokens += real
            req.num_accepted_tokens += num_accepted
            req.num_draft_misses += int(num_accepted < real)
            if spec_stats is not None:
                spec_stats.observe(real, num_accepted)

    def _append_tokens(self, req: Request, gen: list[int]) -> tuple[list[int], bool]:
        max_model_len = self.max_model_len
        for j, tok in enumerate(gen):
            req.append_output_token_ids(tok)
            if check_stop(req, max_model_len):
                return gen[: j + 1], True
        return gen, False

    def _finish_stopped(self, stopped: list[Request], stopped_waiting: list[Request], now: float,
                        by_client: dict[int, list[EngineCoreOutput]]) -> None:
        gone = {id(r) for r in stopped}
        self.running = [r for r in self.running if id(r) not in gone]
        if stopped_waiting:  # preempted, stopped by a stale output delivered while waiting
            self._remove_queued(stopped_waiting)
        for req in stopped:
            params = self._free_request(req, now)
            if params is not None:
                for out in reversed(by_client[req.client_index]):
                    if out.request_id == req.request_id:
                        out.kv_transfer_params = params
                        break

    def _fail_bad_loads(self, reqs: list[Request], invalid: set[int], now: float,
                        by_client: dict[int, list[EngineCoreOutput]]) -> None:
        """Policy "fail": the requests that read blocks whose load failed finish with an
        error, the bad blocks dropped from the prefix cache."""
        gone = {id(r) for r in reqs}
        self.running = [r for r in self.running if id(r) not in gone]
        for req, hold in zip(reqs, self.kv_loads.drop_bad(reqs, invalid), strict=True):
            out = self._fail_request(req, now, "the KV connector failed to load part of its KV cache",
                                     hold_blocks=hold)
            by_client.setdefault(req.client_index, []).append(out)

    def _fail_request(self, req: Request, now: float, why: str, hold_blocks: bool = False) -> EngineCoreOutput:
        """Finish a request whose KV load failed (observers hear of it at the end of the
        step); returns its error output."""
        rid = req.request_id
        req.status = RequestStatus.FINISHED_ERROR
        req.stop_reason = "kv_load_failed"
        self._free_request(req, now, hold_blocks=hold_blocks)
        self._pending_finished.append(req)
        return EngineCoreOutput(rid, [], FINISH_REASONS[req.status], None, error=f"request {rid!r}: {why}")

    def _apply_finished_transfers(self, kv_out: KVConnectorOutput | None) -> None:
        """The connector's view of the step, then the loads and sends the worker finished:
        loaded requests become admissible; blocks held for them are freed."""
        try:
            self.connector.update_connector_output(kv_out)
        except Exception as e:  # reported once the step's state is complete
            self._deferred_errors.append(self._connector_error("update_connector_output", e, None))
        if kv_out is None:
            return
        if kv_out.finished_recving:
            for req in self.kv_loads.on_finished(kv_out.finished_recving):
                self._release_blocks(req)
        for rid in kv_out.finished_sending or ():
            sent = self.requests.get(rid)
            if sent is not None and sent.is_finished:
                self._release_blocks(sent)

    def _release_blocks(self, req: Request) -> None:
        """Free a finished request whose blocks a load or a send kept until it ended."""
        self.kv_cache_manager.free(req)
        del self.requests[req.request_id]

    def _make_stats(self, spec_stats: SpecDecodingStats | None) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.kv_holding) - len(self.skipped_ids),
            num_skipped_waiting_reqs=len(self.skipped_ids),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preempted_reqs=self.num_preemptions_total,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats(),
            connector_prefix_cache_stats=self.take_connector_prefix_cache_stats(),
            spec_decoding_stats=spec_stats if spec_stats and spec_stats.num_drafts else None)

    def _free_request(self, req: Request, now: float, hold_blocks: bool = False) -> dict | None:
        """Tell the connector, then free the blocks unless it (or ``hold_blocks``: a load
        still writing into them) keeps them until the worker reports the transfer done."""
        rid = req.request_id
        try:
            delay, params = self.connector.request_finished(req, self.kv_cache_manager.get_block_ids(rid))
        except Exception as e:  # free normally; report once the step's state is complete
            self._deferred_errors.append(self._connector_error("request_finished", e, req))
            delay, params = False, None
        self.finished_req_ids.add(rid)
        self.skipped_ids.discard(rid)
        self._forget_structured(req)  # its compile too, if nobody else waits
        req.record_event(EventType.FINISHED, now)
        if not (delay or hold_blocks):
            self.kv_cache_manager.free(req)
            del self.requests[rid]
        return params

    def _notify_finished(self, reqs: list[Request], now: float) -> None:
        for req in reqs:
            self.hooks.on_request_finished(request=req, now=now)

    def _connector_call(self, method: str, *args: Any) -> Any:
        """Call a scheduler-side connector method; its exceptions become PluginErrors."""
        try:
            return getattr(self.connector, method)(*args)
        except Exception as e:
            req = args[0] if args and isinstance(args[0], Request) else None
            raise self._connector_error(method, e, req) from e

    def _connector_error(self, method: str, e: Exception, req: Request | None) -> PluginError:
        """The PluginError for a connector method that raised, counted with the hooks'
        errors (``stats()["num_hook_errors"]``, the server's hook-error metric)."""
        err = connector_error(self.connector, method, e, req)
        errors = getattr(self.hooks, "errors", None)
        if errors is not None:
            errors[(err.plugin, err.hook)] += 1
        return err


def connector_error(connector: Any, method: str, e: Exception, req: Request | None) -> PluginError:
    """A PluginError for an exception raised by a KV connector method."""
    name = type(connector).__name__
    return PluginError(f"KV connector {name!r} raised in {method}: {type(e).__name__}: {e}",
                       plugin=name, hook=f"KVConnector.{method}",
                       request_id=req.request_id if req is not None else None)


def _remove_or_lose(queue: RequestQueue, reqs: list[Request]) -> list[Request]:
    """Take ``reqs`` out of ``queue`` while undoing a step. If the queue refuses the
    batch, each request it holds is removed alone; those it refuses again are lost (the
    caller fails them)."""
    try:
        queue.remove_requests(reqs)
        return []
    except PluginError as e:
        log.error("%s; removing its requests one by one", e)
    lost = []
    for req in reqs:
        if req in queue:  # type: ignore[operator]  # the guard knows its members
            try:
                queue.remove_request(req)
            except PluginError as e:
                log.error("%s; request %r fails", e, req.request_id)
                lost.append(req)
    return lost
