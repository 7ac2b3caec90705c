"""The plugin contract: every policy decision schedkit makes is one of these hooks.

Plugins implement hooks with ``@schedkit.hookimpl`` on functions or methods whose names
are exactly the spec names below; they may accept any subset of the arguments. Every
call passes keyword arguments only, and hooks are called once per step or once per
decision with whole lists, never per token or per block.

Each hook's docstring is its whole contract, in these sections: a summary and what the
hook is for, then ``Called`` (when, how often, in which process), ``Args``, ``Returns``,
``Errors`` (what an exception or an answer the caller refuses does), ``Built-in`` (what
answers when no plugin does) and the version it appeared in. Whether the first answer
wins is the marker's ``firstresult``. docs/hooks.md's reference is generated from this
module by ``scripts/gen_hooks_reference.py``: edit here, then regenerate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from schedkit.config import SchedulerConfig, StructuredOutputsConfig
    from schedkit.core.flow import TenantQueue
    from schedkit.core.hooks import AdmissionDecision, Preemption, Rejection
    from schedkit.core.outputs import EngineCoreOutputs, SchedulerOutput, SchedulerStats
    from schedkit.core.queues import RequestQueue
    from schedkit.core.request import Request
    from schedkit.core.routing import (
        Migration,
        ReplicaState,
        RouteAdmission,
        RouteEvent,
        RouteLatency,
        RouteRequest,
    )
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

    The scheduler only ever ``add``s new requests, ``peek``s and ``pop``s the head, puts
    preempted requests back with ``prepend_request`` and the requests it skipped this
    step with ``prepend_requests``, and removes aborted ones. Ready-made queues:
    ``FCFSQueue`` (a deque) and ``KeyedQueue(key)`` (a heap on ``key(request)``, ties in
    insertion order; "prepend" re-inserts by key), both ``from schedkit import ...``.
    ``pop`` must return the request the last ``peek`` returned, even when the clock moved
    in between (the whole contract: "Waiting queues" in docs/hooks.md).

    Called:
        Once, in the engine-core process, when the Scheduler is built.

    Args:
        scheduler_config: The scheduler section of the config. Do not mutate.
        kv_cache_manager: The scheduler's KV cache manager, for queues that rank by
            prefix-cache hits (``get_computed_blocks(request)`` has no side effects).
            Do not allocate or free through it.
        clock: The scheduler clock (seconds; virtual in the simulator), for queues whose
            order changes with waiting time.

    Returns:
        An object with the :class:`schedkit.RequestQueue` methods (``add``, ``peek``,
        ``pop``, ``prepend_request``, ``prepend_requests``, ``remove_request``,
        ``remove_requests``, ``__len__``, ``__iter__`` in serving order), or None to let
        the next plugin decide. The scheduler holds it behind a guard:
        ``scheduler.waiting.policy_queue`` is your object, other attributes read
        through, and the guard counts its requests itself, so ``len()`` of the
        scheduler's queue never calls yours.

    Errors:
        An answer without those methods raises PluginError. Anything a queue method
        raises later, or a key function a ``KeyedQueue`` calls, becomes a PluginError
        whose hook reads ``schedkit_create_waiting_queue (KeyedQueue.add)`` (the queue's
        class and method) and whose ``request_id`` is the request the call was about. A
        raising ``add`` rejects that request (nothing is registered); a raise inside a
        step undoes the step like any hook.

    Built-in:
        ``fcfs`` returns a FIFO whose ``prepend_request`` puts a preempted request at the
        head; ``priority`` returns a ``KeyedQueue`` on ``(priority, arrival_time,
        request_id)`` (smaller priority first).

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def schedkit_select_preemption_victim(running: Sequence[Request],
                                      request: Request) -> Request | Preemption | None:
    """Choose the running request that loses its KV blocks when ``request`` cannot get
    the blocks it needs this step (recompute preemption).

    Called:
        In the engine-core process, while running requests are scheduled, at most once
        per failed block allocation; after each preemption the allocation is retried and
        the hook is asked again until it fits or ``request`` itself is chosen. Not called
        while the KV connector reports pending block frees, never for waiting requests (a
        waiting request that does not fit simply waits) and never per token. A step that
        preempted anyone this way admits no waiting request.

    Args:
        running: Running requests in admission order, possibly including requests
            already scheduled in this step (their tokens are given back). Do not mutate.
        request: The running request that needs blocks; it may itself be the victim,
            which ends scheduling of running requests for this step.

    Returns:
        A member of ``running``: the scheduler frees its blocks, resets its computed
        tokens, keeps its outputs and re-queues it with ``prepend_request``; it appears
        in the step's ``preempted_req_ids``. Or the victim as ``Preemption(victim,
        reason, save_kv)``, where ``save_kv`` True or False says whether a KV connector
        that keeps KV (``cpu-offload``) swaps it out instead of letting it recompute (a
        bare request, or None, leaves that to the connector's ``save_on_preemption``;
        the reason is not counted). Or None to let the next plugin decide.

    Errors:
        An answer that is not a running request (None from every plugin included), or a
        ``save_kv`` that is not True, False or None, raises PluginError naming the
        request that needed blocks, and the step is undone.

    Built-in:
        ``fcfs`` returns ``running[-1]`` (the newest); ``priority`` returns the first
        request with the largest ``(priority, arrival_time)``.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def schedkit_select_voluntary_preemptions(running: Sequence[Request], waiting: RequestQueue,
                                          max_num_running: int, kv_cache_usage: float,
                                          now: float, max_preemptions: int,
                                          ) -> Sequence[Preemption] | None:
    """Preempt running requests voluntarily (not for KV blocks), before the step schedules
    anything, so that waiting requests the policy ranks higher get their seats, budget and
    blocks now.

    For MLFQ demotion, preemptive shortest-remaining-first, priority with preemption, a
    deadline that must be met now, a tenant over its quota. Without it, as in vLLM, a
    running request is preempted only when the KV cache runs out, and running requests
    are always scheduled before waiting ones, so no waiting order can overtake a running
    request.

    Called:
        In the engine-core process, once at the start of every schedule() in which
        requests are running and waiting, the scheduler is not paused, the step has a
        token budget, ``scheduler.max_voluntary_preemptions`` (default 4) is above 0 and
        some plugin implements the hook (with none, it is never called and costs
        nothing); never per token. Its cost is one call with whole lists per such step:
        iterate ``waiting`` only as far as needed (it yields in serving order, head
        first).

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
        Up to ``max_preemptions`` distinct running requests, each as
        ``Preemption(request, reason)`` (``from schedkit import Preemption``) or bare
        (the reason is then the plugin's name); None or an empty sequence preempts
        nobody. Each victim is preempted exactly as on KV pressure (its blocks freed,
        those in the prefix cache staying reusable; its outputs kept; its computed tokens
        reset, and counted as recomputed when computed again; ``num_preemptions`` and the
        step's ``preempted_req_ids`` as usual), then queued with ``add``, so the policy's
        order places it, and it is not admitted again in the same step. Unlike a
        KV-pressure preemption, the step still admits waiting requests; the seats freed
        go to whichever waiting requests the admission phase takes, so if the request a
        policy made room for is not admitted this step (its admission hook skips it, the
        budget or the KV cache runs out), another may take its seat.
        ``Preemption(request, reason, save_kv=True)`` asks a KV connector that keeps KV
        (``cpu-offload``) to swap the victim out instead of letting it recompute
        (False: let it recompute; None, the default: the connector's own setting).
        Voluntary preemptions are counted by reason in
        ``Scheduler.voluntary_preemptions`` and the engine's stats
        (``voluntary_preemptions``).

    Errors:
        An answer that is not a sequence, names a request that is not running or names
        one twice, holds more than ``max_preemptions`` items, a reason that is not a
        ``str`` or a ``save_kv`` that is not True, False or None raises PluginError (with
        no ``request_id``: the answer is step-wide), and the step is undone.

    Built-in:
        None: ``fcfs`` and ``priority`` never preempt voluntarily, which keeps them
        identical to vLLM.

    .. versionadded:: 0.3
    """


@hookspec(firstresult=True)
def schedkit_prefill_chunk_limit(request: Request, num_new_tokens: int, threshold: int) -> int | None:
    """Cap how many tokens ``request`` gets this step (the chunked-prefill threshold),
    before the step's budget is applied.

    Called:
        In the engine-core process, once per scheduling decision for a running or
        waiting request that would get more than one token this step: a prompt chunk, a
        resumed request, or a decode with draft tokens. Plain one-token decodes never
        call it.

    Args:
        request: The running or waiting request being scheduled. Do not mutate.
        num_new_tokens: Tokens it would get without a cap.
        threshold: This step's threshold: ``scheduler.long_prefill_token_threshold``,
            raised with ``scheduler.long_prefill_token_threshold_adaptive`` to at least
            ``max_num_batched_tokens`` divided by the requests in the scheduler (running,
            waiting and loading KV); 0 when it is off or when the request is alone in the
            scheduler (a lone request is never capped by the built-in).

    Returns:
        A cap >= 1 (a cap >= ``num_new_tokens`` changes nothing), or None for no cap
        from this plugin (the next plugin decides).

    Errors:
        Any other answer (0, a negative number, a float, a bool) raises PluginError
        naming the request, and the step is undone.

    Built-in:
        ``defaults`` returns ``threshold`` when it is positive, else None.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def schedkit_step_token_budget(max_num_batched_tokens: int, running: Sequence[Request],
                               waiting: RequestQueue, kv_cache_usage: float, step: int) -> int | None:
    """Set how many tokens this step may schedule in total, for adaptive policies (back
    off under KV pressure, warm up, leave room for latency-critical requests).

    Called:
        In the engine-core process, exactly once at the start of every schedule(), also
        when nothing is waiting or running; not while the scheduler is paused with
        ``PAUSED_ALL`` (the step's budget is then 0).

    Args:
        max_num_batched_tokens: The configured budget (an upper bound for the answer).
        running: Running requests in admission order. Do not mutate.
        waiting: The waiting queue. Do not mutate.
        kv_cache_usage: Fraction of usable KV blocks in use, in [0, 1].
        step: The step number (1 for the first schedule()).

    Returns:
        A budget in ``[0, max_num_batched_tokens]`` (0 schedules nothing this step), or
        None to let the next plugin decide.

    Errors:
        Any other answer (a number outside the range, a float, a bool) raises
        PluginError, and the step is undone.

    Built-in:
        ``defaults`` returns ``max_num_batched_tokens``.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def schedkit_num_speculative_tokens(running: Sequence[Request], num_speculative_tokens: int,
                                    step: int) -> Mapping[str, int] | None:
    """Decide how many draft tokens each running request gets proposed for its next
    step: speculation pays when a request's drafts are accepted and the batch has
    compute to spare, and wastes it otherwise (a large batch, a request whose drafts
    keep failing). 0 turns speculation off for that request this step.

    Called:
        In the engine-core process, once after each step's output is processed while
        requests run, with ``scheduler.num_speculative_tokens`` > 0, before the runner
        proposes drafts; never without speculation configured. Under
        ``scheduler.async_scheduling`` instead once before each step is scheduled (the
        step in flight not yet processed), the runner proposing the drafts inside the
        step; answers for structured requests are then not used (they get no drafts).

    Args:
        running: Running requests in admission order (those still prefilling get no
            drafts whatever the answer). Each carries its own record:
            ``num_draft_tokens`` (drafts verified so far), ``num_accepted_tokens``
            (those the target model accepted) and ``num_draft_misses`` (steps in which
            one was rejected). Do not mutate.
        num_speculative_tokens: The configured most per request and step (the answer's
            upper bound).
        step: The step just finished (the next one will verify the drafts); under
            asynchronous scheduling the step in flight.

    Returns:
        A mapping from request id to draft tokens in ``[0, num_speculative_tokens]``;
        requests it leaves out get ``num_speculative_tokens``. None lets the next
        plugin decide (no plugin: every request gets ``num_speculative_tokens``).

    Errors:
        A raise, or any other answer (not a mapping, an id that is not running, a
        count outside the range, a float, a bool), raises PluginError: the engine logs
        it and proposes no drafts for the next step (outputs are unchanged: drafts
        only save steps), then asks again after it.

    Built-in:
        None: every request gets ``num_speculative_tokens``, as in vLLM.
        ``speculate-by-batch`` speculates only while at most ``max_batch`` requests
        run. ``speculate-by-acceptance`` gives each request the longest run of drafts
        whose last one is still accepted with probability ``min_acceptance`` by its
        own record, probing a request cut to 0 with one draft every ``probe_every``
        steps, and speculates only up to ``max_batch`` requests if set.

    .. versionadded:: 0.4
    """


@hookspec(firstresult=True)
def schedkit_admit_request(request: Request, num_running: int, kv_cache_usage: float,
                           now: float) -> AdmissionDecision | Rejection | None:
    """Decide whether the request at the head of the waiting queue may be admitted now:
    SLO admission control, quotas, load shedding.

    Called:
        In the engine-core process, once per waiting request examined in a step, only in
        steps that preempted nobody for KV blocks, and only while token budget and
        running seats (``scheduler.max_num_active_seqs``, by default ``max_num_seqs``)
        remain. Requests whose KV load finished are examined first, then the waiting
        queue (not while the scheduler is paused). Preempted requests waiting to resume
        are examined too; a request that is not ready (its KV load or grammar compile
        still running, preempted voluntarily in this very step, outputs from before its
        preemption still in flight) is passed over without a call.

    Args:
        request: The request at the head of the waiting queue. Do not mutate.
        num_running: Requests running now.
        kv_cache_usage: Fraction of usable KV blocks in use, in [0, 1].
        now: The scheduler clock (seconds; virtual in the simulator).

    Returns:
        An ``AdmissionDecision`` (``from schedkit import AdmissionDecision``), a
        ``Rejection``, or None to leave the decision to the next plugin:

        * ``ADMIT``: try to schedule it; it may still wait for KV blocks or budget,
          which blocks the queue head as in vLLM (no request behind it is examined this
          step).
        * ``SKIP``: pass over it this step; the scheduler examines the next request, and
          at the end of the step puts the skipped requests back with
          ``prepend_requests`` (for a FIFO queue: at the head, in their order; a keyed
          queue re-inserts them by key).
        * ``REJECT``: finish it at the end of this schedule() with status
          ``FINISHED_ABORTED`` (finish reason "abort") and stop_reason "rejected",
          freeing whatever it held; the next update_from_output() delivers its output
          (no tokens) and calls ``schedkit_on_request_finished`` for it. Rejections are
          counted per plugin and the request's ``rejected_by`` names the plugin.
        * ``Rejection(reason)`` (``from schedkit import Rejection``): the same as
          ``REJECT``, with a sentence for the client; it travels as the request's
          ``rejection_reason`` (on ``Request``, ``EngineCoreOutput`` and the clients'
          ``RequestOutput``), and ``schedkit serve`` puts it in the 429's message after
          the plugin's name. Don't put secrets in it: the client reads it.

    Errors:
        An answer that is not an ``AdmissionDecision`` or a ``Rejection``, or a
        ``Rejection`` whose reason is not a non-empty ``str`` of at most 512 characters
        (``MAX_REJECTION_REASON``), raises PluginError naming the request, and the step
        is undone.

    Built-in:
        ``defaults`` admits.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def schedkit_create_kv_connector(role: KVConnectorRole, config: Any) -> KVConnectorBase | None:
    """Create the KV connector that moves KV blocks between this engine and somewhere
    else (host memory, disk, another engine), for one side: scheduler or worker.

    A connector subclasses ``schedkit.KVConnectorBase`` and overrides only what it
    needs; the "KV connectors" section of docs/hooks.md says which process calls each
    method and how often.

    Called:
        Once per role, in the engine-core process: role SCHEDULER when the Scheduler is
        built, and role WORKER right after it, when the engine core is built, only if its
        runner has a worker side (the paged runner, which runs in the engine-core
        process; the fake runner and the simulator have none).

    Args:
        role: ``KVConnectorRole.SCHEDULER`` or ``KVConnectorRole.WORKER``.
        config: The cache section of the config. Do not mutate.

    Returns:
        A :class:`schedkit.KVConnectorBase`, or None to let the next plugin decide; when
        every plugin returns None the scheduler uses ``NoOpConnector`` (and a runner
        gets no worker-side connector).

    Errors:
        An answer that is not a ``KVConnectorBase`` raises PluginError, and the engine
        does not start.

    Built-in:
        None (the no-op connector is the fallback). Bundled, switched on under
        ``plugins``: ``kv-storage`` and ``cpu-offload``; ``kv-transfer`` (prefill/decode
        disaggregation), which a cluster with ``replicas.roles`` switches on itself.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def schedkit_create_structured_output_backend(config: StructuredOutputsConfig, tokenizer: Any,
                                              vocab_size: int,
                                              eos_token_ids: Sequence[int]) -> StructuredOutputBackend | None:
    """Create the backend that turns the constraints of structured requests (a JSON
    schema, any JSON object, a regular expression, a choice of strings, an EBNF grammar)
    into the grammars that mask each step's logits.

    A backend subclasses ``schedkit.core.structured_output.StructuredOutputBackend``:
    ``validate`` checks a constraint (raise ``ValueError``) and ``compile`` builds the
    grammar, both on the manager's compile workers, under
    ``structured_outputs.compile_timeout_s`` (threads, so ``compile`` must be
    thread-safe; or worker processes, which can be stopped, when the backend's
    ``process_compiler`` says how), and ``new_grammar`` returns one request's matcher, a
    ``StructuredOutputGrammar`` that accepts and rolls back tokens and fills its row of
    the step's bitmask. docs/structured-outputs.md describes the interface and the
    built-in backends.

    Called:
        In the engine-core process, once, when the first request with
        ``structured_outputs`` arrives, so an engine that never sees one never calls it
        (nor imports a grammar library). Once built, the backend serves the engine for
        good; a hook that raised or refused is asked again by the next structured
        request.

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
        A ``StructuredOutputBackend``, or None to leave the choice to the next plugin.
        When every plugin returns None, structured requests are refused with a
        RequestError that names ``config.backend``.

    Errors:
        Raise :class:`schedkit.errors.RequestError` when the backend cannot serve at all
        (a missing package, no tokenizer): the structured request that asked fails with
        its message. Any other exception, or an answer that is not a
        ``StructuredOutputBackend``, becomes a PluginError that the engine turns into a
        RequestError for that request ("the structured-output backend ... could not be
        created: ..."); the engine keeps serving.

    Built-in:
        ``structured-outputs`` (trylast) answers ``auto`` (xgrammar when it is
        installed, else ``python``), ``xgrammar`` and ``python``, and needs the tokenizer
        for each of them.

    .. versionadded:: 0.1
    """


@hookspec
def schedkit_on_step_end(scheduler_output: SchedulerOutput, outputs: dict[int, EngineCoreOutputs],
                         stats: SchedulerStats | None, now: float) -> None:
    """Observe a finished step: accounting for fair-share and multi-level-feedback
    policies, metrics, tracing.

    Called:
        On every plugin that implements it, in the engine-core process, once at the end
        of every update_from_output(), after all state changes of the step (finished
        requests are already freed and ``schedkit_on_request_finished`` has been called
        for them). With ``scheduler.async_scheduling`` a step's output is processed
        while the next step is in flight, so ``scheduler_output`` is then the older of
        the two.

    Args:
        scheduler_output: The step's plan (its ``step`` field is the step number). Do
            not mutate.
        outputs: The step's new tokens and finishes by client index, requests rejected
            by ``schedkit_admit_request`` included. Do not mutate.
        stats: The step's scheduler statistics (None when the scheduler was built with
            ``log_stats=False``).
        now: The scheduler clock.

    Returns:
        Nothing; return values are ignored.

    Errors:
        An exception becomes a PluginError naming the plugin; the step itself has
        already been applied, so the error carries the step's outputs as
        ``error.outputs``, and the observer calls of that step that had not run yet are
        skipped.

    Built-in:
        None.

    .. versionadded:: 0.1
    """


@hookspec
def schedkit_on_request_finished(request: Request, now: float) -> None:
    """Observe a request that just finished, for any reason: stop (EOS or stop token),
    length, abort by the client (``finish_requests``), error, or rejection by
    ``schedkit_admit_request`` (status ``FINISHED_ABORTED``, ``stop_reason ==
    "rejected"``).

    Called:
        On every plugin that implements it, in the engine-core process, once per
        finished request, after its blocks were released (unless the KV connector asked
        to delay the free): from update_from_output() for stops, length caps and
        requests rejected by the step's schedule(), and from finish_requests() for
        aborts. Within one update_from_output() it fires for the step's finished
        requests before that step's ``schedkit_on_step_end``, so a plugin that accounts
        per step should keep a finished request's state until its next
        ``schedkit_on_step_end``.

    Args:
        request: The finished request (``request.get_finished_reason()``,
            ``request.stop_reason``; ``request.events`` hold the timeline). Do not
            mutate.
        now: The scheduler clock.

    Returns:
        Nothing; return values are ignored.

    Errors:
        An exception becomes a PluginError naming the plugin and the request; the
        request has finished all the same. Raised from update_from_output(), the error
        carries the step's outputs as ``error.outputs`` and the step's later observer
        calls are skipped; raised from finish_requests(), it carries the finished
        requests as ``error.finished_requests``.

    Built-in:
        None.

    .. versionadded:: 0.1
    """


# -- the router (front-end process, in front of replicas.count engines) -------------------
# A router plugin is switched on by ``router.policy`` / ``router.plugins`` and lives in the
# process that runs the router (the front end, or the cluster simulation), not in the
# engines. Each router hook's Errors section says what a raise or a wrong answer does: the
# router never fails a request because of a router plugin.


@hookspec(firstresult=True)
def schedkit_router_disaggregate(request: RouteRequest, prefill_replicas: Sequence[ReplicaState],
                                 decode_replicas: Sequence[ReplicaState]) -> bool | None:
    """Decide whether ``request`` is disaggregated: prefilled on a prefill replica, its
    KV then sent to a decode replica that produces its tokens; or served whole on one
    replica. Selective disaggregation: a short or mostly cached prompt gains nothing
    from the move and pays for the transfer.

    Called:
        In the router's process, once per routing decision, before the replicas are
        chosen, and only with ``replicas.roles`` configured and a healthy replica for
        each stage (without roles no request is disaggregated and this hook is never
        called). When it answers True, the filters, scorers and picker then run twice:
        ``request.stage`` PREFILL over ``prefill_replicas``, then DECODE over
        ``decode_replicas`` less the chosen prefill replica; when False, once, stage
        WHOLE, over ``decode_replicas``.

    Args:
        request: The request to place (``num_prompt_tokens``, ``block_hashes``,
            ``block_size``, ...). Do not mutate.
        prefill_replicas: The healthy replicas that may prefill it (roles ``prefill``
            and ``both``), in index order. Do not mutate.
        decode_replicas: The healthy replicas that may decode it or serve it whole
            (roles ``decode`` and ``both``), in index order; their ``cached_blocks``
            say how much of the prompt each would not need to receive. Do not mutate.

    Returns:
        True to disaggregate, False to serve it whole, None to leave it to the next
        plugin.

    Errors:
        An exception or an answer that is not a bool is ignored: counted in the router's
        ``num_hook_errors``, logged (at most a line per 10 s), and the next plugin is
        asked (the built-in last). Should every plugin fail, the request is served whole.

    Built-in:
        ``selective-pd`` (on whenever ``replicas.roles`` is set, trylast; its settings
        under ``router.plugins``), as llm-d's selective P/D: True when the prompt's
        tokens not in the best decode candidate's prefix cache number more than
        ``threshold`` (default 256; ``.inf``: never).

    .. versionadded:: 0.3
    """


@hookspec(firstresult=True)
def schedkit_router_migrate(replicas: Sequence[ReplicaState],
                            requests: Mapping[int, Sequence[RouteRequest]]) -> Sequence[Migration] | None:
    """Move running requests between replicas: rebalance KV pressure, empty a replica for
    shutdown, bring a high-priority request to a quiet replica (Llumnix's live
    migration).

    Called:
        In the router's process, every ``router.migration_interval_s`` while requests
        are outstanding, on real replicas (``LLM``, ``AsyncLLM``, ``schedkit serve``)
        with at least one plugin implementing it. Each move happens at the source
        replica's next step boundary: the request stops there with the full blocks of
        its computed tokens kept, those its target does not hold go over like a
        disaggregated prefill's (and under the same backpressure), and it goes on at the
        target with its outputs so far (its grammar and n-gram drafts follow from them;
        seeded sampling draws by position). Its stream goes on without a lost or
        repeated token.

    Args:
        replicas: Every replica (healthy or not: ``healthy``, ``draining``, ``role``,
            ``num_running``, ``num_waiting``, ``kv_cache_usage`` as last reported), in
            index order. Do not mutate.
        requests: The outstanding requests of each healthy replica, by index: served
            whole there or decoded there, not at a prefill stage and not already being
            moved. Do not mutate.

    Returns:
        The moves to make now (``schedkit.Migration(request_id, target, reason)``), an
        empty sequence for none, or None to leave it to the next plugin.

    Errors:
        An exception or an answer that is not a sequence of ``Migration`` is ignored
        whole: counted in the router's ``num_hook_errors``, logged (at most a line per
        10 s), and the next plugin is asked. A single move naming a request that is not
        in ``requests``, a target that is unhealthy, draining, a prefill-only replica or
        the request's own, or a request named twice is dropped and counted the same way;
        the others go ahead. A move whose request finished or whose target died in the
        meantime is dropped quietly.

    Built-in:
        None. Bundled router plugins: ``rebalance`` (Llumnix's: from the replica with the
        least free KV to the one with the most, when their usage differs by more than
        ``min_gap``) and ``drain`` (every request off a draining replica:
        ``ClusterClient.drain(index)``).

    .. versionadded:: 0.3
    """


@hookspec(firstresult=True)
def schedkit_router_admit(request: RouteRequest, replicas: Sequence[ReplicaState],
                          latency: RouteLatency | None) -> RouteAdmission | None:
    """Decide whether the router takes ``request`` at all: SLO-aware admission. When no
    replica can give the request what its SLO class asks, refuse it at once (the client
    retries, or goes elsewhere) or take it best effort, counted.

    Called:
        In the router's process, once per request, before its routing decision (with
        ``replicas.roles``: after ``schedkit_router_disaggregate``), never for a request
        routed again because its replica died.

    Args:
        request: The request to place (``hints.slo_class``, and ``slo``: its class's
            targets from the config's ``slo_classes``, None without a class). Do not
            mutate.
        replicas: The replicas that may take it, in index order. Do not mutate.
        latency: The router's latency predictions for this decision
            (``latency.estimate(request, replica)`` -> ``LatencyEstimate(ttft_s,
            tpot_s)``: the request's predicted TTFT and TPOT there, from the cost model
            and what the replica last reported), or None when the router has no cost
            model (``router.latency_profile``; a plugin that takes ``latency`` makes the
            router require one).

    Returns:
        ``RouteAdmission(verdict, reason)``: ADMIT to route it, DOWNGRADE to route it
        best effort (counted in the router's ``num_downgraded``, by SLO class), REFUSE
        to refuse it (``num_refused``): ``Router.route`` raises ``RouteRefusedError``,
        naming the plugin and its ``reason``, and the HTTP server answers 429 with
        Retry-After. None leaves it to the next plugin; with no answer it is admitted.

    Errors:
        An exception or an answer that is not a ``RouteAdmission`` (with a
        ``RouteVerdict`` and a string reason) is ignored: counted in the router's
        ``num_hook_errors``, logged (at most a line per 10 s), and the next plugin is
        asked. Should every plugin fail, the request is admitted.

    Built-in:
        None. Bundled: ``slo-headroom``, which refuses (``on_miss: refuse``) or
        downgrades (``on_miss: downgrade``, the default) a request of an SLO class with a
        TTFT target that no candidate is predicted to meet.

    .. versionadded:: 0.4
    """


@hookspec
def schedkit_router_filter(request: RouteRequest, replicas: Sequence[ReplicaState],
                           latency: RouteLatency | None) -> Sequence[ReplicaState] | None:
    """Narrow the replicas that may take ``request``: keep requests off overloaded
    replicas, pin a tenant to a subset, drain a replica.

    Called:
        On every router plugin that implements it, in the router's process, once per
        routing decision (twice for a disaggregated request: its PREFILL stage, then
        its DECODE stage), in turn: each filter sees what the ones before it left.

    Args:
        request: The request to place (``RouteRequest``: id, prompt, tenant, priority,
            ``max_tokens``, session id, ``hints`` (SLO class, deadline, expected output
            length), ``block_hashes``, and ``stage``, the part being placed: WHOLE,
            PREFILL or DECODE). Do not mutate.
        replicas: The candidates: healthy replicas whose role takes ``request.stage``,
            in index order, less those earlier filters dropped. Do not mutate.
        latency: The router's latency predictions for this decision
            (``latency.estimate(request, replica)`` -> ``LatencyEstimate(ttft_s,
            tpot_s)``: the request's predicted TTFT and TPOT there, from the cost model
            and what the replica last reported), or None when the router has no cost
            model (``router.latency_profile``; a plugin that takes ``latency`` makes the
            router require one).

    Returns:
        The members of ``replicas`` that may take it, or None for no opinion.

    Errors:
        An exception, an answer that is not an iterable of replicas, one naming a replica
        that is not a candidate, or an empty one (a filter cannot leave a request nowhere
        to go) is ignored: that answer is dropped, counted in the router's
        ``num_hook_errors`` and logged (at most a line per 10 s), and the other plugins
        decide.

    Built-in:
        ``prefix-affinity`` drops replicas with more than ``max_imbalance`` requests
        outstanding above the least loaded candidate.

    .. versionadded:: 0.2
    """


@hookspec
def schedkit_router_score(request: RouteRequest, replicas: Sequence[ReplicaState],
                          latency: RouteLatency | None) -> Sequence[float] | None:
    """Score each candidate replica for ``request``, higher is better; the router weighs
    and adds the scores of every scoring plugin.

    Called:
        On every router plugin that implements it and whose ``router.weights`` entry
        (default 1) is not 0, in the router's process, once per routing decision (per
        stage of a disaggregated request), after the filters. The router multiplies each plugin's scores by its weight and adds
        them up per replica.

    Args:
        request: The request to place (``request.stage``: the part being placed). Do
            not mutate.
        replicas: The candidates left by the filters, in index order. Do not mutate.
        latency: The router's latency predictions for this decision
            (``latency.estimate(request, replica)`` -> ``LatencyEstimate(ttft_s,
            tpot_s)``: the request's predicted TTFT and TPOT there, from the cost model
            and what the replica last reported), or None when the router has no cost
            model (``router.latency_profile``; a plugin that takes ``latency`` makes the
            router require one).

    Returns:
        One finite number per candidate, in order (the built-ins give 0 to 1), or None
        for no opinion.

    Errors:
        An exception, an answer that is not numbers, of the wrong length, or with a NaN
        or infinite score is ignored: dropped, counted in the router's
        ``num_hook_errors`` and logged, and the other scorers decide.

    Built-in:
        ``least-outstanding``, ``kv-usage``, ``prefix-affinity``, ``session-affinity``,
        ``weighted``, ``slo-headroom``; with none of them on every score is 0 and the
        picker's rotation decides.

    .. versionadded:: 0.2
    """


@hookspec(firstresult=True)
def schedkit_router_pick(request: RouteRequest, replicas: Sequence[ReplicaState], scores: Sequence[float],
                         latency: RouteLatency | None) -> ReplicaState | None:
    """Choose the replica that gets ``request``.

    Called:
        In the router's process, once per routing decision (per stage of a
        disaggregated request), after the scorers.

    Args:
        request: The request to place (``request.stage``: the part being placed). Do
            not mutate.
        replicas: The candidates left by the filters, in index order. Do not mutate.
        scores: Their weighted total scores, in the same order (all 0 without scorers).
        latency: The router's latency predictions for this decision
            (``latency.estimate(request, replica)`` -> ``LatencyEstimate(ttft_s,
            tpot_s)``: the request's predicted TTFT and TPOT there, from the cost model
            and what the replica last reported), or None when the router has no cost
            model (``router.latency_profile``; a plugin that takes ``latency`` makes the
            router require one).

    Returns:
        A member of ``replicas``, or None to leave the choice to the next picker.

    Errors:
        An exception or an answer that is not a candidate is ignored: counted in the
        router's ``num_hook_errors``, logged, and the next picker is asked (the built-in
        last). Should every picker fail, the request goes to the first candidate.

    Built-in:
        ``best-score`` (always on, trylast): the highest total; among equal totals the
        first candidate after the replica that got the previous request (of the same
        kind: prefill stages rotate apart from whole requests and decode stages), so
        with no scorer it is round-robin. ``round-robin`` answers the next replica in
        turn, whatever the scores.

    .. versionadded:: 0.2
    """


@hookspec
def schedkit_on_route_event(event: RouteEvent) -> None:
    """Observe a routing outcome: a request (or one stage of a disaggregated request, as
    ``event.stage`` says) routed (``ROUTED``, with every candidate's total score),
    finished (``FINISHED``; for a PREFILL stage: its prefill is done, its KV on its
    way), failed (``FAILED``: an error, or its replica died after it produced tokens) or
    moved because its replica died before it produced a token (``REROUTED``, followed
    by a ``ROUTED`` to the new replica).

    Called:
        On every router plugin that implements it, in the router's process, once per
        outcome.

    Args:
        event: What happened (``kind``, ``request``, ``replica``, ``scores``,
            ``stage``). Do not mutate.

    Returns:
        Nothing; return values are ignored.

    Errors:
        An exception is counted in the router's ``num_hook_errors`` and logged; the
        request and the other plugins' calls go on.

    Built-in:
        ``best-score`` remembers the last replica routed to (its tie rotation);
        ``session-affinity`` remembers where each session went.

    .. versionadded:: 0.2
    """


@hookspec(firstresult=True)
def schedkit_flow_saturated(replicas: Sequence[ReplicaState], num_outstanding: int, num_queued: int,
                            max_num_seqs: int) -> bool | None:
    """Say whether the engines are full: while they are, flow control holds new
    requests at the front door instead of sending them on.

    Called:
        In the front end's process (the server's, or the cluster front end's), with
        ``flow_control.enabled``, before each dispatch from the front door's queues and
        when a request arrives with nothing held.

    Args:
        replicas: Every replica (one for a single engine): ``healthy``, ``draining``,
            ``num_waiting``, ``num_running`` and ``kv_cache_usage`` as last reported (up
            to ``LOAD_REPORT_INTERVAL_S``, 50 ms, old). Do not mutate.
        num_outstanding: Requests the front door sent on that have not finished: exact
            at every call (a burst dispatched in one instant counts at once, before any
            report shows it).
        num_queued: Requests held at the front door now.
        max_num_seqs: ``scheduler.max_num_seqs``: the most requests one replica runs.

    Returns:
        True (saturated: hold), False (dispatch), or None for no opinion.

    Errors:
        An exception or an answer that is not a bool is ignored: counted in the flow
        controller's ``num_hook_errors`` and logged; the next detector decides, the
        built-in last.

    Built-in:
        ``queue-depth`` (trylast): saturated when the requests sent on reach what the
        live replicas can run plus ``max_waiting`` each, or when every live replica
        reports more than ``max_waiting`` queued or its KV cache at ``max_kv_usage``.

    .. versionadded:: 0.3
    """


@hookspec(firstresult=True)
def schedkit_flow_pick_tenant(band: int, queues: Sequence[TenantQueue], now: float) -> str | None:
    """Pick the tenant whose oldest held request of priority band ``band`` is dispatched
    next: fairness between tenants at the front door.

    Called:
        In the front end's process, with ``flow_control.enabled``, once per dispatch
        from the front door's queues, for the most urgent band holding requests (the
        smallest ``priority``).

    Args:
        band: The priority band.
        queues: Each tenant holding requests in that band (``TenantQueue``: ``tenant``,
            ``num_queued``, ``oldest_wait_s``, ``num_outstanding``, ``head_cost``,
            ``service``, ``backlog_id``: a new id each time the tenant starts holding
            requests in the band again), in the order the tenants first queued. Do not
            mutate.
        now: The front end's clock (seconds, ``time.monotonic``).

    Returns:
        The ``tenant`` of one of ``queues``, or None to leave the choice to the next
        plugin.

    Errors:
        An exception or an answer that is not one of the tenants is ignored: counted in
        the flow controller's ``num_hook_errors`` and logged; the next plugin is asked,
        the built-in last.

    Built-in:
        ``tenant-round-robin`` (trylast): the tenants in turn. ``tenant-weighted``: the
        tenant with the least service per weight (``weights``), its counter lifted to the
        least of the backlogged ones when it returns after an idle spell (VTC's rule), so
        no tenant banks credit while away.

    .. versionadded:: 0.3
    """


ROUTER_HOOK_NAMES: tuple[str, ...] = (
    "schedkit_router_disaggregate", "schedkit_router_migrate", "schedkit_router_admit", "schedkit_router_filter",
    "schedkit_router_score", "schedkit_router_pick", "schedkit_on_route_event")
"""The hooks a router plugin implements (they run in the router's process)."""
FLOW_HOOK_NAMES: tuple[str, ...] = ("schedkit_flow_saturated", "schedkit_flow_pick_tenant")
"""The hooks a flow-control plugin implements (they run in the front end's process)."""
HOOK_NAMES: tuple[str, ...] = tuple(
    name for name in list(globals())
    if name.startswith("schedkit_") and name not in ROUTER_HOOK_NAMES and name not in FLOW_HOOK_NAMES)
"""The engine's hooks (they run in the engine-core process)."""
ALL_HOOK_NAMES: tuple[str, ...] = HOOK_NAMES + ROUTER_HOOK_NAMES + FLOW_HOOK_NAMES
"""Every hook name a plugin may implement."""
