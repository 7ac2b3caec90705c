"""The scheduler's second half: applying a step's sampled tokens (update_from_output).

A mixin of :class:`schedkit.core.scheduler.Scheduler`, kept apart because it owns a
different concern: appending tokens, rolling back rejected drafts, stop checks,
finishing and freeing requests, statistics, and the observer hooks at the end of a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from schedkit.core.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
    SpecDecodingStats,
)
from schedkit.core.request import FINISH_REASONS, EventType, Request, RequestStatus
from schedkit.core.stop import check_stop
from schedkit.errors import PluginError

if TYPE_CHECKING:
    from schedkit.config import CacheConfig
    from schedkit.core.hooks import SchedulerHooks
    from schedkit.core.queues import RequestQueue
    from schedkit.kv.connector import KVConnectorBase
    from schedkit.kv.kv_cache_manager import KVCacheManager

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED


def connector_error(connector: Any, method: str, e: Exception, req: Request | None) -> PluginError:
    """A PluginError for an exception raised by a KV connector method."""
    name = type(connector).__name__
    return PluginError(f"KV connector {name!r} raised in {method}: {type(e).__name__}: {e}",
                       plugin=name, hook=f"KVConnector.{method}",
                       request_id=req.request_id if req is not None else None)


class OutputProcessorMixin:
    """update_from_output() and its helpers; state lives on the Scheduler."""

    # Provided by Scheduler (declared for type checkers).
    requests: dict[str, Request]
    running: list[Request]
    waiting: RequestQueue
    kv_cache_manager: KVCacheManager
    connector: KVConnectorBase
    hooks: SchedulerHooks
    clock: Callable[[], float]
    log_stats: bool
    max_model_len: int
    num_preemptions_total: int
    _pending_outputs: list[tuple[Request, EngineCoreOutput]]
    _pending_finished: list[Request]
    _deferred_errors: list[PluginError]
    finished_req_ids: set[str]
    deferred_ids: set[str]
    take_connector_prefix_cache_stats: Callable[[], Any]
    finished_recving_ids: set[str]
    failed_recving_ids: set[str]
    _held_for_load: set[str]
    kv_holding: RequestQueue
    cache_config: CacheConfig


    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> dict[int, EngineCoreOutputs]:
        """Apply one step's sampled tokens. Returns the outputs grouped by client index."""
        sampled = runner_output.sampled_token_ids
        index = runner_output.req_id_to_index
        requests = self.requests
        spec_sched = scheduler_output.scheduled_spec_decode_tokens
        spec_stats = SpecDecodingStats() if spec_sched and self.log_stats else None
        max_model_len = self.max_model_len
        by_client: dict[int, list[EngineCoreOutput]] = {}
        stopped: list[Request] = []
        stopped_waiting: list[Request] = []
        kv_out = runner_output.kv_connector_output
        if kv_out is not None and kv_out.failed_recving:
            self._on_failed_loads(kv_out.failed_recving)
        bad_loads: list[Request] = []
        if kv_out is not None and kv_out.invalid_block_ids:
            bad_loads = self._on_invalid_blocks(kv_out.invalid_block_ids, scheduler_output)
        skip = {r.request_id for r in bad_loads}
        for req, out in self._pending_outputs:
            by_client.setdefault(req.client_index, []).append(out)
        self._pending_outputs = []
        kv = self.kv_cache_manager
        cache_after_placeholders = kv.enable_caching
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            maybe = requests.get(rid)
            if maybe is None:
                continue  # finished while the step ran
            req = maybe
            req.num_in_flight_tokens -= n
            stale = req.num_stale_output_tokens > 0
            if stale:  # scheduled before the request's last preemption
                req.num_stale_output_tokens -= n
                if req.stale_drop:
                    continue
            status = req.status
            if (status is not _RUNNING and not (stale and status is _PREEMPTED)) or rid in skip:
                continue  # finished while the step ran, or read bad KV: void
            i = index.get(rid)
            gen = sampled[i] if i is not None else None
            if not gen:
                continue  # a prefill chunk that sampled nothing
            if spec_sched and not stale:
                drafts = spec_sched.get(rid)
                if drafts:
                    self._apply_spec_result(req, drafts, len(gen), spec_stats)
            had_outputs = bool(req.output_token_ids)
            if len(gen) == 1:
                req.append_output_token_ids(gen[0])
                is_stopped = check_stop(req, max_model_len)
                new_ids = gen
            else:
                new_ids, is_stopped = self._append_tokens(req, gen)
            if req.num_output_placeholders and not stale:
                req.num_output_placeholders -= len(new_ids)
                if cache_after_placeholders and status is _RUNNING and not is_stopped:
                    # Blocks filled by tokens that were placeholders at allocation.
                    kv.cache_blocks(req, req.num_computed_tokens - req.num_output_placeholders)
            if not had_outputs:
                req.record_event(EventType.FIRST_TOKEN, self.clock())
            if is_stopped:
                stopped.append(req)
                if status is _PREEMPTED:
                    stopped_waiting.append(req)
                out = EngineCoreOutput(rid, new_ids, FINISH_REASONS[req.status], req.stop_reason,
                                       req.num_cached_tokens)
            else:
                out = EngineCoreOutput(rid, new_ids, None, None, req.num_cached_tokens)
            lst = by_client.get(req.client_index)
            if lst is None:
                by_client[req.client_index] = lst = []
            lst.append(out)
        now = self.clock()
        if bad_loads and self.cache_config.kv_load_failure_policy == "fail":
            assert kv_out is not None
            for req, out in self._fail_bad_loads(bad_loads, kv_out.invalid_block_ids, now):
                by_client.setdefault(req.client_index, []).append(out)
        if stopped:
            gone = {id(r) for r in stopped}
            self.running = [r for r in self.running if id(r) not in gone]
            if stopped_waiting:  # preempted, stopped by a stale output delivered while waiting
                self.waiting.remove_requests(stopped_waiting)
            for req in stopped:
                params = self._free_request(req, now)
                if params is not None:
                    self._attach_transfer_params(by_client, req, params)
        self.connector.update_connector_output(kv_out)
        if kv_out is not None and kv_out.finished_recving:
            self._on_finished_loads(kv_out.finished_recving)
        if kv_out is not None and kv_out.finished_sending:
            self._release_held_requests(kv_out.finished_sending)
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
            e.outputs = outputs  # type: ignore[attr-defined]  # the step itself succeeded
            raise
        return outputs

    def _apply_spec_result(self, req: Request, drafts: list[int], num_gen: int,
                           spec_stats: SpecDecodingStats | None) -> None:
        num_accepted = num_gen - 1
        num_rejected = len(drafts) - num_accepted
        if num_rejected > 0 and req.num_computed_tokens > 0:
            req.num_computed_tokens -= num_rejected
        if spec_stats is not None and drafts[0] != -1:
            spec_stats.observe(len(drafts), num_accepted)

    def _append_tokens(self, req: Request, gen: list[int]) -> tuple[list[int], bool]:
        max_model_len = self.max_model_len
        for j, tok in enumerate(gen):
            req.append_output_token_ids(tok)
            if check_stop(req, max_model_len):
                return gen[: j + 1], True
        return gen, False

    @staticmethod
    def _attach_transfer_params(by_client: dict[int, list[EngineCoreOutput]], req: Request,
                                params: dict) -> None:
        for out in reversed(by_client[req.client_index]):
            if out.request_id == req.request_id:
                out.kv_transfer_params = params
                return


    def _on_failed_loads(self, request_ids: Iterable[str]) -> None:
        """Whole asynchronous loads failed: the requests start over (their blocks are
        dropped at promotion) or finish with an error, per kv_load_failure_policy.
        Observers hear of the failed ones at the end of the step, like every finish."""
        now = self.clock()
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:
                self._release_load_blocks(req)  # aborted while loading
                continue
            if self.cache_config.kv_load_failure_policy == "recompute":
                self.finished_recving_ids.add(rid)  # the worker is done with its blocks
                self.failed_recving_ids.add(rid)
                req.num_computed_tokens = 0
                continue
            self.kv_holding.remove_request(req)
            self.finished_recving_ids.discard(rid)
            req.status = RequestStatus.FINISHED_ERROR
            req.stop_reason = "kv_load_failed"
            self._free_request(req, now)
            self._pending_finished.append(req)
            self._pending_outputs.append((req, EngineCoreOutput(
                rid, [], FINISH_REASONS[req.status], None,
                error=f"request {rid!r}: the KV connector failed to load its KV cache")))

    def _on_invalid_blocks(self, invalid: set[int], scheduler_output: SchedulerOutput) -> list[Request]:
        """Find the requests that read blocks whose load failed (spec 5.5): loading
        requests first, then running ones in order. Each is truncated to its first bad
        block not already claimed by an earlier request (which recomputes it), or keeps
        its count before the steps in flight if all were claimed; running ones drop the
        outputs of those steps (computed on bad KV). Returns them; under "recompute"
        loading ones are marked failed (retried at promotion)."""
        bs = self.kv_cache_manager.block_size
        claimed: set[int] = set()
        affected = []
        loading = [r for r in self.kv_holding if r.status is RequestStatus.WAITING_FOR_REMOTE_KVS]
        for req in loading + list(self.running):
            rid = req.request_id
            table = self.kv_cache_manager.get_block_ids(rid)
            before = req.num_computed_tokens - req.num_in_flight_tokens  # before every step in flight
            bad = [i for i in range(min(-(-before // bs), len(table))) if table[i] in invalid]
            if not bad:
                continue
            first = next((i for i in bad if table[i] not in claimed), None)
            claimed.update(table[i] for i in bad)
            req.num_computed_tokens = before if first is None else first * bs
            req.spec_token_ids = []
            if req.status is _RUNNING:  # its outputs in flight were computed on bad KV
                req.num_stale_output_tokens = req.num_in_flight_tokens
                req.stale_drop = True
                req.num_output_placeholders = 0
            affected.append(req)
            if (req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
                    and self.cache_config.kv_load_failure_policy == "recompute"):
                self.failed_recving_ids.add(rid)
        return affected

    def _fail_bad_loads(self, reqs: list[Request], invalid: set[int],
                        now: float) -> list[tuple[Request, EngineCoreOutput]]:
        """Policy "fail": drop the bad blocks (and what follows them) of the running
        requests from the prefix cache, then finish every affected request with an error."""
        kv = self.kv_cache_manager
        gone = {id(r) for r in reqs}
        self.running = [r for r in self.running if id(r) not in gone]
        outputs = []
        for req in reqs:
            rid = req.request_id
            hold = False
            if req.status is _RUNNING:
                table = kv.get_block_ids(rid)
                first = next(i for i, b in enumerate(table) if b in invalid)
                kv.evict_blocks(table[first:])
            else:  # still loading: the worker may write into its blocks until it ends
                self.kv_holding.remove_request(req)
                hold = rid not in self.finished_recving_ids
                if hold:
                    self._held_for_load.add(rid)
            self.finished_recving_ids.discard(rid)
            self.failed_recving_ids.discard(rid)
            req.status = RequestStatus.FINISHED_ERROR
            req.stop_reason = "kv_load_failed"
            self._free_request(req, now, hold_blocks=hold)
            self._pending_finished.append(req)
            outputs.append((req, EngineCoreOutput(
                rid, [], FINISH_REASONS[req.status], None,
                error=f"request {rid!r}: the KV connector failed to load part of its KV cache")))
        return outputs

    def _on_finished_loads(self, request_ids: Iterable[str]) -> None:
        """Loads the worker finished: loading requests become admissible; aborted ones
        that kept their blocks for the load are freed now."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_ids.add(rid)
            else:
                self._release_load_blocks(req)

    def _release_load_blocks(self, req: Request) -> None:
        """Free a request aborted while loading, now that its load has ended."""
        rid = req.request_id
        if rid in self._held_for_load:
            self._held_for_load.discard(rid)
            self.kv_cache_manager.free(req)
            del self.requests[rid]

    def _release_held_requests(self, request_ids: Iterable[str]) -> None:
        """Free finished requests whose blocks the connector held until sent."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and req.is_finished:
                self.kv_cache_manager.free(req)
                del self.requests[rid]

    def _make_stats(self, spec_stats: SpecDecodingStats | None) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.kv_holding) - len(self.deferred_ids),
            num_skipped_waiting_reqs=len(self.deferred_ids),
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
            self._deferred_errors.append(connector_error(self.connector, "request_finished", e, req))
            delay, params = False, None
        self.finished_req_ids.add(rid)
        self.deferred_ids.discard(rid)
        req.record_event(EventType.FINISHED, now)
        if not (delay or hold_blocks):
            self.kv_cache_manager.free(req)
            del self.requests[rid]
        return params

    def _notify_finished(self, reqs: list[Request], now: float) -> None:
        for req in reqs:
            self.hooks.on_request_finished(request=req, now=now)
