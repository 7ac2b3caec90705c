"""Test kit for plugin authors (also used by schedkit's own tests).

Installed as a pytest plugin (entry point ``pytest11``), so with schedkit installed the
fixtures ``make_scheduler``, ``registered_plugin`` and ``fake_runner`` are available in
any test suite. The plain functions are importable too, with the names and keywords of
vLLM's own test helpers (``tests/v1/core/utils.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pytest

from schedkit.config import CacheConfig, SchedulerConfig
from schedkit.core.grammar import StructuredOutputsParams
from schedkit.core.hints import NO_HINTS, RequestHints
from schedkit.core.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    KVConnectorOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from schedkit.core.request import Request, SamplingParams
from schedkit.core.scheduler import Scheduler
from schedkit.core.structured_output import StructuredOutputManager
from schedkit.plugins.facade import HookFacade
from schedkit.plugins.manager import get_plugin_manager

_last_arrival = [0.0]


def _next_arrival_time() -> float:
    t = max(time.monotonic(), _last_arrival[0] + 1e-6)
    _last_arrival[0] = t
    return t


def make_scheduler(*, policy: str = "fcfs", block_size: int = 16, num_blocks: int = 10000,
                   max_num_batched_tokens: int = 8192, max_num_seqs: int = 16,
                   max_model_len: int = 2048, enable_prefix_caching: bool = False,
                   enable_chunked_prefill: bool = True, long_prefill_token_threshold: int = 0,
                   num_speculative_tokens: int = 0, async_scheduling: bool = False, plugins: Iterable[Any] = (),
                   plugin_settings: Mapping[str, Mapping[str, Any]] | None = None,
                   scheduler_reserve_full_isl: bool = True, watermark: float = 0.0,
                   kv_load_failure_policy: Literal["recompute", "fail"] = "fail",
                   clock: Callable[[], float] = time.monotonic,
                   log_stats: bool = True, max_voluntary_preemptions: int = 4,
                   structured_output_manager: StructuredOutputManager | None = None) -> Scheduler:
    """A Scheduler with vLLM's test-harness defaults and the real plugin manager.

    ``plugins`` are plugin objects registered after the built-ins (so they win);
    ``plugin_settings`` switches on installed entry-point plugins by name;
    ``structured_output_manager`` serves requests with ``structured_outputs``.
    """
    sched_cfg = SchedulerConfig(
        policy=policy, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        max_model_len=max_model_len, long_prefill_token_threshold=long_prefill_token_threshold,
        enable_chunked_prefill=enable_chunked_prefill, num_speculative_tokens=num_speculative_tokens,
        scheduler_reserve_full_isl=scheduler_reserve_full_isl, async_scheduling=async_scheduling,
        max_voluntary_preemptions=max_voluntary_preemptions)
    cache_cfg = CacheConfig(block_size=block_size, num_blocks=num_blocks,
                            enable_prefix_caching=enable_prefix_caching, watermark=watermark,
                            kv_load_failure_policy=kv_load_failure_policy)
    pm = get_plugin_manager(scheduler_config=sched_cfg, plugin_settings=plugin_settings,
                            extra_plugins=plugins)
    return Scheduler(sched_cfg, cache_cfg, HookFacade(pm), clock=clock, log_stats=log_stats,
                     structured_output_manager=structured_output_manager)


def make_request(request_id: str, prompt_token_ids: Sequence[int], *, max_tokens: int = 16,
                 priority: int = 0, arrival_time: float | None = None,
                 eos_token_id: int | None = 50256, stop_token_ids: Sequence[int] = (),
                 min_tokens: int = 0, ignore_eos: bool = False, client_index: int = 0,
                 tenant: str = "default", cache_salt: str | None = None,
                 structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None,
                 hints: RequestHints | None = None) -> Request:
    """One request; ``arrival_time=None`` takes a strictly increasing clock."""
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens,
                            stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos,
                            eos_token_id=eos_token_id,
                            structured_outputs=structured_outputs)  # type: ignore[arg-type]
    return Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                   sampling_params=params, priority=priority,
                   arrival_time=_next_arrival_time() if arrival_time is None else arrival_time,
                   client_index=client_index, tenant=tenant, cache_salt=cache_salt,
                   hints=NO_HINTS if hints is None else hints)


def make_requests(n: int, *, num_tokens: int = 10, max_tokens: int = 16,
                  prompts: Sequence[Sequence[int]] | None = None,
                  priorities: Sequence[int] | None = None,
                  arrival_times: Sequence[float] | None = None, same_prompt: bool = False,
                  eos_token_id: int | None = 50256) -> list[Request]:
    """Requests "0".."n-1" with prompt ``[i] * num_tokens`` unless ``prompts`` is given."""
    reqs = []
    for i in range(n):
        prompt = prompts[i] if prompts is not None else [0 if same_prompt else i] * num_tokens
        reqs.append(make_request(
            str(i), prompt, max_tokens=max_tokens,
            priority=priorities[i] if priorities is not None else 0,
            arrival_time=arrival_times[i] if arrival_times is not None else None,
            eos_token_id=eos_token_id))
    return reqs


def runner_output(scheduler_output: SchedulerOutput,
                  sampled: Mapping[str, Sequence[int]]) -> ModelRunnerOutput:
    """A ModelRunnerOutput for every scheduled request; missing ids sample nothing."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[list(sampled.get(r, ())) for r in req_ids])


@dataclass(frozen=True)
class StepResult:
    """What one ``step`` did: the batch it planned and what the update returned."""

    scheduler_output: SchedulerOutput
    engine_outputs: dict[int, EngineCoreOutputs]
    """``update_from_output``'s return value: the outputs grouped per client."""

    @property
    def outputs(self) -> list[EngineCoreOutput]:
        """Every request output of the step, all clients, in order."""
        return [o for group in self.engine_outputs.values() for o in group.outputs]

    @property
    def finished(self) -> list[EngineCoreOutput]:
        """The outputs of the requests that finished in this step."""
        return finished_in(self.engine_outputs)


def step(sched: Scheduler, runner: Any = None, *,
         sampled: Mapping[str, Sequence[int]] | int | None = None,
         kv_connector_output: KVConnectorOutput | None = None,
         check: bool = True) -> StepResult:
    """One engine step, as ``EngineCore.step`` runs it: schedule, execute, update.

    Args:
        sched: The scheduler to step.
        runner: Anything with ``execute(scheduler_output) -> ModelRunnerOutput`` (a
            ``FakeRunner``, the simulator). Without one the runner's answer is made by
            ``runner_output`` from ``sampled``.
        sampled: Without a runner: the tokens each request id samples (ids left out sample
            nothing), or one token id that every scheduled request samples. None: nothing
            is sampled.
        kv_connector_output: Attached to the runner's answer (finished sends and
            receives, failed loads, invalid blocks), as a worker-side connector reports.
        check: Call ``assert_scheduler_consistent`` after the update.

    Returns:
        The planned batch and the update's outputs, as a ``StepResult``.

    Raises:
        PluginError: From ``schedule()`` or ``update_from_output``, as the engine would
            see it (the scheduler has rolled back or applied the step, as documented
            there).
    """
    if runner is not None and sampled is not None:
        raise TypeError("step(): pass a runner or sampled tokens, not both")
    so = sched.schedule()
    sched.fill_grammar_bitmask(so)
    if runner is not None:
        ro = runner.execute(so)
    elif isinstance(sampled, int):
        ro = runner_output(so, {r: [sampled] for r in so.num_scheduled_tokens})
    else:
        ro = runner_output(so, sampled or {})
    if kv_connector_output is not None:
        ro.kv_connector_output = kv_connector_output
    outs = sched.update_from_output(so, ro)
    if check:
        assert_scheduler_consistent(sched)
    return StepResult(so, outs)


def finished_in(outputs: Mapping[int, EngineCoreOutputs]) -> list[EngineCoreOutput]:
    """The finishing outputs among per-client outputs (``update_from_output``'s return
    value, or the ``outputs`` a ``PluginError`` carries), in order."""
    return [o for group in outputs.values() for o in group.outputs if o.finished]


def serve(sched: Scheduler, runner: Any, *, max_steps: int = 1000,
          check: bool = True) -> list[EngineCoreOutput]:
    """``step`` until the scheduler has nothing left (``has_requests()`` is false).

    Returns:
        The outputs of the requests that finished, in the order they finished.

    Raises:
        AssertionError: Requests are still there after ``max_steps`` steps.
    """
    done: list[EngineCoreOutput] = []
    for _ in range(max_steps):
        if not sched.has_requests():
            return done
        done += step(sched, runner, check=check).finished
    raise AssertionError(f"not done after {max_steps} steps: {sorted(sched.requests)} left")


def drive_engine(engine: Any, requests: Iterable[Request] = ()) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Add ``requests`` to an EngineCore and step until nothing is left.

    Returns:
        Tokens per request id, and the error message of each request that failed.
    """
    for req in requests:
        engine.add_request(req)
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    while engine.has_requests():
        for group in engine.step().values():
            for out in group.outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.error:
                    errors[out.request_id] = out.error
    return tokens, errors


def assert_scheduler_consistent(sched: Scheduler, requests: Iterable[Request] = ()) -> None:
    """Assert the scheduler's invariants; call between steps in plugin tests.

    Every known request is in exactly one place (running, waiting, holding KV blocks in
    ``kv_holding``, or finished and held by a connector or a load); statuses match
    places; running fits max_num_seqs; each block's reference count equals the number
    of block tables holding it, and no table holds the null block; free + used blocks
    add up to the pool.

    Args:
        sched: The scheduler to check.
        requests: Requests the test added: each one that is not finished must still be
            known to the scheduler (a request the scheduler dropped is otherwise
            invisible to this check).
    """
    from collections import Counter

    from schedkit.core.request import RequestStatus

    running_ids = [r.request_id for r in sched.running]
    queued = list(sched.waiting)
    assert len(queued) == len(sched.waiting), "the waiting queue lost or duplicated a request"
    # A finished request whose removal the policy's queue refused stays until it
    # reaches the head, where the scheduler drops it.
    waiting_ids = [r.request_id for r in queued if not r.is_finished]
    holding = list(sched.kv_holding)
    holding_ids = [r.request_id for r in holding]
    assert len(set(running_ids)) == len(running_ids), "a request is twice in running"
    assert len(set(waiting_ids)) == len(waiting_ids), "a request is twice in waiting"
    assert len(set(holding_ids)) == len(holding_ids), "a request is twice in kv_holding"
    assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
    assert not set(holding_ids) & (set(running_ids) | set(waiting_ids)), "a kv_holding request is elsewhere too"
    for req in holding:  # (a promoted request whose failed load left nothing may stay)
        assert req.status is not RequestStatus.WAITING_FOR_REMOTE_KVS or sched.kv_cache_manager.get_num_blocks(
            req.request_id), f"{req.request_id} is loading without KV blocks"
    for req in queued:
        assert not sched.kv_cache_manager.get_num_blocks(req.request_id), (
            f"{req.request_id} holds KV blocks but is in waiting")
    waiting_ids += holding_ids
    assert sched.skipped_ids <= set(waiting_ids), "a skipped request is not waiting"
    assert len(running_ids) <= sched.max_num_seqs
    for rid, req in sched.requests.items():
        if req.is_finished:
            continue
        where = rid in running_ids, rid in waiting_ids
        assert where in ((True, False), (False, True)), f"request {rid} is lost ({req.status.name})"
        assert (req.status is RequestStatus.RUNNING) == where[0], f"{rid}: {req.status.name}"
    assert set(running_ids) | set(waiting_ids) <= set(sched.requests)
    for req in requests:
        assert req.is_finished or sched.requests.get(req.request_id) is req, (
            f"{req.request_id} is {req.status.name} but the scheduler no longer knows it")
    kv = sched.kv_cache_manager
    held: Counter[int] = Counter()
    for rid in sched.requests:
        table = kv.get_block_ids(rid)
        assert 0 not in table, f"{rid}: the null block is in its block table"
        held.update(table)
    pool = kv.block_pool
    for b in range(1, kv.num_blocks):
        assert pool.ref_cnt(b) == held[b], f"block {b}: ref_cnt {pool.ref_cnt(b)} != {held[b]} tables"
    used = sum(1 for b in range(1, kv.num_blocks) if held[b])
    assert kv.num_free_blocks + used == kv.num_blocks - 1
    assert kv.num_tracked_requests == sum(1 for rid in sched.requests if kv.get_num_blocks(rid)), (
        "the KV cache manager tracks a block table of no request")


# ---------------------------------------------------------------------- pytest fixtures
@pytest.fixture
def registered_plugin() -> Iterator[Callable[[Any], Any]]:
    """Register plugin objects for every ``make_scheduler`` fixture call in this test.

    Usage: ``registered_plugin(MyPolicy())`` then ``make_scheduler()``; unregistered at
    teardown, even if the test fails.
    """
    _registered.clear()

    def register(plugin: Any) -> Any:
        _registered.append(plugin)
        return plugin

    try:
        yield register
    finally:
        _registered.clear()


_registered: list[Any] = []


@pytest.fixture(name="make_scheduler")
def make_scheduler_fixture() -> Callable[..., Scheduler]:
    """``make_scheduler(**kwargs)`` with the test's ``registered_plugin`` objects added."""

    def factory(**kwargs: Any) -> Scheduler:
        plugins = list(kwargs.pop("plugins", ())) + list(_registered)
        return make_scheduler(plugins=plugins, **kwargs)

    return factory


@pytest.fixture
def fake_runner() -> Callable[..., Any]:
    """Factory of deterministic FakeRunners: ``fake_runner(vocab_size=..., eos_token_id=...)``."""
    from schedkit.runners.fake import FakeRunner

    return FakeRunner


