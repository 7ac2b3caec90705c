"""The plugin contract: every policy decision schedkit makes is one of these hooks.

Plugins implement hooks with ``@schedkit.hookimpl`` on functions or methods whose names
are exactly the spec names below; they may accept any subset of the arguments. All hooks
run in the engine-core process (the process that owns the Scheduler). Every call passes
keyword arguments only, and hooks are called once per step or once per decision with
whole lists, never per token or per block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from schedkit.config import SchedulerConfig, StructuredOutputsConfig
    from schedkit.core.hooks import AdmissionDecision, Preemption, Rejection
    from schedkit.core.outputs import EngineCoreOutputs, SchedulerOutput, SchedulerStats
    from schedkit.core.queues import RequestQueue
    from schedkit.core.request import Request
    from schedkit.core.routing import ReplicaState, RouteEvent, RouteRequest
    from schedkit.core.structured_output import StructuredOutputBackend
    from schedkit.kv.connector import KVConnectorBase, KVConnectorRole
    from schedkit.kv.kv_cache_manager import KVCacheManager

PROJECT = "schedkit"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec(firstresult=True)
def schedkit_create_waiting_queue(scheduler_config: SchedulerConfig,
                                  kv_cache_manager: KVCacheManager,
                                  clock: Callable[[], float]) -> RequestQueue | None:
    """Create the waiting queue, which fixes the order in which requests are admitted.

    Stops at first non-None result. Called in the engine-core process, once, when the
    Scheduler is built.

    Args:
        scheduler_config: The scheduler section of the config. Do not mutate.
        kv_cache_manager: The scheduler's KV cache manager, for queues that rank by
            prefix-cache hits (``get_computed_blocks(request)`` has no side effects).
            Do not allocate or free through it.
        clock: The scheduler clock (seconds; virtual in the simulator), for queues whose
            order changes with waiting time.

    Returns:
        An object with the :class:`schedkit.core.queues.RequestQueue` methods (``add``,
        ``peek``, ``pop``, ``prepend_request``, ``prepend_requests``, ``remove_request(s)``,
        ``__len__``, ``__iter__`` in serving order), or None to defer to the next plugin.
        The built-in ``fcfs`` plugin returns a FIFO whose ``prepend_request`` puts a
        preempted request at the head; ``priority`` returns a heap keyed by
        ``(priority, arrival_time, request_id)`` (smaller priority first).

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def schedkit_select_preemption_victim(running: Sequence[Request],
                                      request: Request) -> Request | Preemption | None:
    """Choose the running request to preempt when ``request`` cannot get its KV blocks.

    Stops at first non-None result. Called in the engine-core process, at most once per
    failed block allocation (then again after each preemption until the allocation fits
    or ``request`` itself is chosen). Never called per token.

    Args:
        running: Running requests in admission order, possibly including requests
            already scheduled in this step (their tokens are given back). Do not mutate.
        request: The running request that needs blocks; it may itself be the victim,
            which ends scheduling of running requests for this step.

    Returns:
        A member of ``running`` (the scheduler frees its blocks, resets its computed
        tokens, keeps its outputs and re-queues it with ``prepend_request``), or one as
        ``Preemption(request, reason, save_kv)`` to say whether a KV connector that keeps
        KV (``cpu-offload``) swaps it out (``save_kv``; the reason is not counted), or
        None to defer. Built-ins: ``fcfs`` returns ``running[-1]``; ``priority`` returns the first
        request with the largest ``(priority, arrival_time)``. Returning an object that is
        not running raises PluginError.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def schedkit_select_voluntary_preemptions(running: Sequence[Request], waiting: RequestQueue,
                                          max_num_running: int, kv_cache_usage: float,
                                          now: float, max_preemptions: int,
                                          ) -> Sequence[Preemption] | None:
    """Preempt running requests on purpose, at the start of a step, to make room for
    waiting ones the policy ranks higher (MLFQ demotion, preemptive SRPT, priority with
    preemption, a deadline that must be met now, a quota).

    Stops at first non-None result. Called in the engine-core process, once at the start
    of every schedule() in which requests are running, requests are waiting, waiting
    requests are served (the scheduler is not paused), the step has a token budget,
    ``scheduler.max_voluntary_preemptions``
    is above 0 and at least one plugin implements the hook; never per token. Its cost is
    one call with whole lists per such step: a plugin should look at the head of
    ``waiting`` (it iterates in serving order) rather than at all of it.

    Args:
        running: Running requests in admission order. Do not mutate.
        waiting: The waiting queue, iterable in serving order. Do not mutate (a plugin
            may reorder its own queue through its own methods).
        max_num_running: The seats for running requests (``scheduler.max_num_active_seqs``,
            by default ``max_num_seqs``) less those that requests with a finished KV load
            take first: ``max_num_running - len(running)`` waiting requests get a seat
            without any preemption.
        kv_cache_usage: Fraction of usable KV blocks in use, in [0, 1].
        now: The scheduler clock.
        max_preemptions: The most requests this step may preempt
            (``scheduler.max_voluntary_preemptions``).

    Returns:
        Up to ``max_preemptions`` :class:`schedkit.core.hooks.Preemption` ``(request,
        reason)`` of distinct running requests (the reason is counted in the engine's
        stats; a bare request is taken as ``Preemption(request, <plugin name>)``);
        an empty sequence or None preempts nobody. Each is preempted exactly as on KV
        pressure: its blocks are freed (those cached stay reusable), its outputs kept, its
        computed tokens reset and counted as recomputed when computed again; then it goes
        back into the waiting queue with ``add``, so the policy's order places it, and it
        is not admitted again in the same step. The step then goes on as usual, admissions
        included. Anything else (a request that is not running, a duplicate, too many)
        raises PluginError and the step is undone. No built-in implements it, so fcfs and
        priority behave exactly as vLLM.

    .. versionadded:: 0.3
    """


@hookspec(firstresult=True)
def schedkit_prefill_chunk_limit(request: Request, num_new_tokens: int, threshold: int) -> int | None:
    """Cap how many tokens ``request`` gets this step (chunked-prefill threshold).

    Stops at first non-None result. Called in the engine-core process, once per
    scheduling decision for a request that would get more than one token this step
    (a prompt chunk, a resumed request, or a decode with drafts); plain one-token decodes
    never call it.

    Args:
        request: The running or waiting request being scheduled. Do not mutate.
        num_new_tokens: Tokens it would get before the step budget is applied.
        threshold: The configured ``long_prefill_token_threshold``, or 0 when the request
            is alone in the scheduler (a lone request is never capped) or when it is off.

    Returns:
        A cap >= 1 (values >= num_new_tokens change nothing), or None for no cap. The
        built-in default returns ``threshold`` when it is positive, else None.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def schedkit_step_token_budget(max_num_batched_tokens: int, running: Sequence[Request],
                               waiting: RequestQueue, kv_cache_usage: float, step: int) -> int | None:
    """Set this step's token budget.

    Stops at first non-None result. Called in the engine-core process, once at the start
    of every schedule().

    Args:
        max_num_batched_tokens: The configured budget (an upper bound for the answer).
        running: Running requests in admission order. Do not mutate.
        waiting: The waiting queue. Do not mutate.
        kv_cache_usage: Fraction of usable KV blocks in use, in [0, 1].
        step: The step number (1 for the first schedule()).

    Returns:
        A budget in ``[0, max_num_batched_tokens]`` (0 schedules nothing this step), or
        None to defer. The built-in default returns ``max_num_batched_tokens``.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def schedkit_admit_request(request: Request, num_running: int, kv_cache_usage: float,
                           now: float) -> AdmissionDecision | Rejection | None:
    """Decide whether the request at the head of the waiting queue may be admitted now.

    Stops at first non-None result. Called in the engine-core process, once per waiting
    request examined in a step (only in steps that preempted nobody, while budget and
    running slots remain).

    Args:
        request: The request at the head of the waiting queue. Do not mutate.
        num_running: Requests running now.
        kv_cache_usage: Fraction of usable KV blocks in use, in [0, 1].
        now: The scheduler clock (seconds; virtual in the simulator).

    Returns:
        ``AdmissionDecision.ADMIT`` to try to schedule it (it may still wait for blocks
        or budget, which blocks the queue head as in vLLM), ``SKIP`` to pass over it this
        step (it goes back to the head afterwards), ``REJECT`` to finish it with finish
        reason "abort" and stop_reason "rejected" (or ``Rejection(reason)``: the same, with
        the reason the client is told), or None to leave the decision to the next plugin. The
        built-in default admits.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def schedkit_create_kv_connector(role: KVConnectorRole, config: Any) -> KVConnectorBase | None:
    """Create the KV connector for one side (scheduler or worker).

    Stops at first non-None result. Called once per role: in the engine-core process
    when the Scheduler is built (role SCHEDULER) and in the runner's process when the
    runner starts (role WORKER).

    Args:
        role: ``KVConnectorRole.SCHEDULER`` or ``KVConnectorRole.WORKER``.
        config: The cache section of the config. Do not mutate.

    Returns:
        A :class:`schedkit.kv.connector.KVConnectorBase`, or None; when every plugin
        returns None the scheduler uses a no-op connector.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def schedkit_create_structured_output_backend(config: StructuredOutputsConfig, tokenizer: Any,
                                              vocab_size: int,
                                              eos_token_ids: Sequence[int]) -> StructuredOutputBackend | None:
    """Create the backend that compiles structured-output constraints into grammars.

    Stops at first non-None result. Called in the engine-core process, once, when the
    first request with ``structured_outputs`` arrives (so engines that never see one
    never import a grammar library).

    Args:
        config: The ``structured_outputs`` section; ``config.backend`` names the backend
            wanted (a plugin answers for its own name and returns None for others).
        tokenizer: The model's tokenizer (a transformers tokenizer), or None when the
            engine has none (the fake runner without ``model.tokenizer``).
        vocab_size: Width of the model's logits, which the bitmask covers (at least the
            tokenizer's vocabulary).
        eos_token_ids: The model's end-of-sequence ids (its config's ``eos_token_id``s,
            the tokenizer's, ``runner.eos_token_id``): a grammar's stop tokens, allowed
            once the output is complete.

    Returns:
        A :class:`schedkit.core.structured_output.StructuredOutputBackend`, or None. The
        built-in ``structured-outputs`` plugin (trylast) answers ``auto``, ``xgrammar``
        and ``python``. Raise :class:`schedkit.errors.RequestError` when the backend
        cannot serve (its message goes back to the request); when every plugin returns
        None, structured requests are refused naming ``config.backend``.

    .. versionadded:: 0.1
    """


@hookspec
def schedkit_on_step_end(scheduler_output: SchedulerOutput, outputs: dict[int, EngineCoreOutputs],
                         stats: SchedulerStats | None, now: float) -> None:
    """Observe a finished step (accounting for fair share, MLFQ levels, metrics).

    Called on every plugin that implements it, in the engine-core process, once at the
    end of every update_from_output(), after all state changes of the step.

    Args:
        scheduler_output: The step's plan. Do not mutate.
        outputs: New tokens and finishes per client index. Do not mutate.
        stats: Scheduler statistics of the step (None when stats are off).
        now: The scheduler clock.

    Returns:
        Nothing; return values are ignored.

    .. versionadded:: 0.1
    """


@hookspec
def schedkit_on_request_finished(request: Request, now: float) -> None:
    """Observe a request that just finished (stop, length, abort, error, rejected).

    Called on every plugin that implements it, in the engine-core process, once per
    finished request, after its blocks were released.

    Args:
        request: The finished request (its events hold the timeline). Do not mutate.
        now: The scheduler clock.

    Returns:
        Nothing; return values are ignored.

    .. versionadded:: 0.1
    """


# -- the router (front-end process, in front of replicas.count engines) -------------------
# A router plugin is switched on by ``router.policy`` / ``router.plugins`` and lives in the
# process that runs the router (the front end, or the cluster simulation), not in the
# engines. The router never fails a request because a router plugin raised: the raising
# plugin's answer is dropped for that decision (counted and logged) and the rest decide.


@hookspec
def schedkit_router_filter(request: RouteRequest,
                           replicas: Sequence[ReplicaState]) -> Sequence[ReplicaState] | None:
    """Narrow the replicas that may take ``request``.

    Called on every router plugin that implements it, once per routing decision, in
    turn: each sees what the ones before it left.

    Args:
        request: The request to place. Do not mutate.
        replicas: The candidates: healthy replicas, in index order. Do not mutate.

    Returns:
        The members of ``replicas`` that may take it, or None for no opinion. An empty
        answer is ignored (counted as the plugin's error): a filter cannot leave a
        request nowhere to go.

    .. versionadded:: 0.2
    """


@hookspec
def schedkit_router_score(request: RouteRequest, replicas: Sequence[ReplicaState]) -> Sequence[float] | None:
    """Score each candidate replica for ``request`` (higher is better).

    Called on every router plugin that implements it, once per routing decision, after
    the filters. The router multiplies each plugin's scores by its ``router.weights``
    entry (default 1) and adds them up per replica.

    Args:
        request: The request to place. Do not mutate.
        replicas: The candidates left by the filters, in index order. Do not mutate.

    Returns:
        One finite score per candidate, in order (the built-ins give 0..1), or None for
        no opinion.

    .. versionadded:: 0.2
    """


@hookspec(firstresult=True)
def schedkit_router_pick(request: RouteRequest, replicas: Sequence[ReplicaState],
                         scores: Sequence[float]) -> ReplicaState | None:
    """Choose the replica that gets ``request``.

    Stops at first non-None result. Called once per routing decision, after the scorers.

    Args:
        request: The request to place. Do not mutate.
        replicas: The candidates left by the filters, in index order. Do not mutate.
        scores: Their weighted total scores, in the same order (all 0 without scorers).

    Returns:
        A member of ``replicas``, or None to defer. The built-in default picks the
        highest score; among equal scores, the first candidate after the replica that
        got the previous request (so with no scorer it is round-robin). An answer that
        is not a candidate is counted as the plugin's error and the default decides.

    .. versionadded:: 0.2
    """


@hookspec
def schedkit_on_route_event(event: RouteEvent) -> None:
    """Observe a routing outcome: routed, finished, failed, re-routed (its replica died
    before it produced a token).

    Called on every router plugin that implements it, once per outcome.

    Args:
        event: What happened, to which request and replica. Do not mutate.

    Returns:
        Nothing; return values are ignored.

    .. versionadded:: 0.2
    """


ROUTER_HOOK_NAMES: tuple[str, ...] = (
    "schedkit_router_filter", "schedkit_router_score", "schedkit_router_pick", "schedkit_on_route_event")
"""The hooks a router plugin implements (they run in the router's process)."""
HOOK_NAMES: tuple[str, ...] = tuple(
    name for name in list(globals()) if name.startswith("schedkit_") and name not in ROUTER_HOOK_NAMES)
"""The engine's hooks (they run in the engine-core process)."""
ALL_HOOK_NAMES: tuple[str, ...] = HOOK_NAMES + ROUTER_HOOK_NAMES
"""Every hook name a plugin may implement."""
