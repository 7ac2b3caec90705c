"""The entry points: ``LLM`` (offline batches) and ``AsyncLLM`` (async streaming), both
started from the same YAML, over one engine process or, with ``replicas.count`` > 1,
the cluster front end (the router and one connection per replica; docs/cluster.md).

``AsyncLLM`` streams through a core (:class:`AsyncCore`): one engine's
:class:`~schedkit.engine.client.AsyncEngineClient` or the
:class:`~schedkit.cluster.front.ClusterClient`. ``LLM`` is a synchronous facade over an
``AsyncLLM`` running on a background event-loop thread: one path for one engine and for
replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import threading
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from schedkit.cluster.flow import FlowController
from schedkit.cluster.front import ClusterClient
from schedkit.config import Config, load_config
from schedkit.config.plugins import first_repeat
from schedkit.core.hints import RequestHints
from schedkit.core.request import SamplingParams
from schedkit.core.routing import ReplicaState
from schedkit.engine.client import AsyncEngineClient, EngineHandle, wire_request
from schedkit.engine.messages import (
    LoadReport,
    WireMetrics,
    WireOutput,
    WireRequest,
    wire_max_tokens,
)
from schedkit.engine.process import EngineProcess
from schedkit.engine.tokenizer import load_tokenizer
from schedkit.errors import EngineBusyError, EngineDeadError, RequestError

_T = TypeVar("_T")

UTILITY_TIMEOUT_S = 30.0
"""How long ``LLM.call_utility`` waits for an answer before it calls the engine dead."""


@dataclass(slots=True)
class RequestOutput:
    """A request's result (or, when streaming, the tokens of one delta)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    metrics: WireMetrics | None = None
    text: str | None = None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache or a KV connector (known from the
    first delta on)."""
    rejected_by: str | None = None
    """With stop_reason "rejected": the plugin whose admission hook rejected it."""
    rejection_reason: str | None = None
    """With stop_reason "rejected": the reason that plugin gave, if it gave one."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class AsyncCore(Protocol):
    """What :class:`AsyncLLM` streams through: one engine (:class:`AsyncEngineClient`) or
    the cluster front end (:class:`ClusterClient`, with ``replicas.count`` > 1)."""

    @property
    def dead(self) -> EngineDeadError | None: ...

    def stream(self, request: WireRequest, *, session_id: str | None = None) -> AsyncGenerator[WireOutput, None]: ...

    def stream_many(self, requests: Sequence[WireRequest]) -> AsyncGenerator[WireOutput, None]: ...

    async def call_utility(self, method: str, *args: Any) -> Any: ...

    def is_alive(self) -> bool: ...

    async def close(self) -> None: ...


def _prompt_ids(prompt: str | Sequence[int], owner: LLM | AsyncLLM) -> Sequence[int]:
    """Token ids of a prompt; text goes through the owner's tokenizer (loaded on first use).
    Anything else is returned as it is, for :func:`wire_request` to check."""
    if not isinstance(prompt, str):
        return prompt
    if owner.tokenizer is None:
        owner.tokenizer = load_tokenizer(owner.config)
        if owner.tokenizer is None:
            raise RequestError("text prompts need a model with a tokenizer (runner.kind paged, "
                               "or model.tokenizer); pass token ids instead")
    return list(owner.tokenizer.encode(prompt))


def _resolve(config: Config | str | os.PathLike[str]) -> Config:
    return config if isinstance(config, Config) else load_config(config)


class AsyncLLM:
    """Async streaming generation through an engine process, or through the router to
    ``replicas.count`` engines (docs/cluster.md): the same API either way.

    Use ``await AsyncLLM.create(config)``; then ``async for out in llm.generate(...)``
    yields one :class:`RequestOutput` delta per engine step (new tokens only); the last
    one has ``finish_reason`` set. Cancelling the iteration aborts the request, and so
    does closing the generator: ``break`` out of an ``async for`` over
    ``llm.generate(...)`` aborts once the generator is garbage collected, but a generator
    you keep a reference to keeps its request running until you ``await gen.aclose()``.
    """

    def __init__(self, config: Config, core: AsyncCore, flow: FlowController | None = None) -> None:
        self.config = config
        self.core = core
        """The connection the requests go through."""
        self.flow = flow
        """The front door's flow controller (``flow_control.enabled``), else None."""
        self._ids = itertools.count()
        self.tokenizer: Any = None

    @property
    def engine(self) -> EngineHandle:
        """The engine process (one engine only; a cluster's are ``core.replicas``)."""
        if not isinstance(self.core, AsyncEngineClient):
            raise AttributeError("a replicated AsyncLLM has no single engine: see .core.replicas")
        return self.core.engine

    @property
    def client_index(self) -> int | None:
        return self.core.client_index if isinstance(self.core, AsyncEngineClient) else None

    @property
    def _ready(self) -> asyncio.Event:
        assert isinstance(self.core, AsyncEngineClient)
        return self.core._ready

    @classmethod
    async def create(cls, config: Config | str | os.PathLike[str], *, transport: str = "ipc") -> AsyncLLM:
        """Start the engine (or, with ``replicas.count`` > 1, the replicas and the router)
        and connect.

        Raises:
            ConfigError, PluginError: A bad config or plugin (nothing keeps running).
            EngineDeadError: An engine failed to start.
        """
        cfg = _resolve(config)
        # Built first: a bad flow plugin fails before any engine starts.
        flow = FlowController(cfg, []) if cfg.flow_control.enabled else None
        if cfg.replicas.count > 1:
            client = await ClusterClient.start(cfg)
            if flow is not None:
                flow.replicas = client.router.replicas
                client.load_listeners.append(flow.pump)
            return cls(cfg, client, flow)
        # Spawned from the loop's thread (the engine's parent-death signal follows the
        # spawning thread; see EngineProcess); the slow wait for ready runs off the loop.
        engine = EngineProcess(cfg, transport=transport, wait=False)
        await asyncio.to_thread(engine.wait_ready)
        on_load = None
        if flow is not None:
            replica = ReplicaState(0, name="engine")
            flow.replicas = [replica]

            def on_load(report: LoadReport) -> None:
                replica.num_waiting, replica.num_running = report.num_waiting, report.num_running
                replica.kv_cache_usage = report.kv_cache_usage
                flow.pump()

        conn = AsyncEngineClient(engine, on_load=on_load)
        try:
            await conn.connect()
        except BaseException:
            await conn.close()
            raise
        return cls(cfg, conn, flow)

    def is_alive(self) -> bool:
        """The engine runs and answers (a cluster: at least one replica does)."""
        return self.core.is_alive()

    async def generate(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None,
                       *, request_id: str | None = None, priority: int = 0,
                       tenant: str = "default", ttft_slo_s: float | None = None,
                       session_id: str | None = None, cache_salt: str | None = None,
                       hints: RequestHints | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs.

        Leaving the iteration early aborts the request when the generator closes: at once
        on cancellation or ``await gen.aclose()``; after ``break``, only once the generator
        is garbage collected (never while you still hold a reference to it).

        ``session_id`` (a conversation's id) is for the router's session affinity;
        ``cache_salt`` keeps the request's prefix-cache blocks apart from other salts'.
        ``hints`` (:class:`~schedkit.core.hints.RequestHints`: SLO class, deadline,
        expected output length, session) reach every hook as ``request.hints``.

        Raises:
            RequestError: Invalid input (naming the field), an id already streaming in
                this client, or the engine rejected the request; ``EngineBusyError`` when
                it may succeed later (a full queue; ``RouteRefusedError``: the router
                found no replica that can meet its SLO class now).
            EngineDeadError: The engine died (with replicas: every replica died, or the
                request's replica died before it produced a token and none is left).
        """
        dead = self.core.dead
        if dead is not None:
            raise EngineDeadError(str(dead))
        rid = f"a{next(self._ids)}-{uuid.uuid4().hex[:8]}" if request_id is None else request_id
        if session_id is not None and hints is not None and hints.session_id not in (None, session_id):
            raise RequestError(f"request {rid!r}: session_id {session_id!r} and hints.session_id "
                               f"{hints.session_id!r} differ", request_id=rid)
        if session_id is not None and hints is not None and hints.session_id is None:
            hints = dataclasses.replace(hints, session_id=session_id)
        req = wire_request(rid, _prompt_ids(prompt, self), sampling_params or SamplingParams(),
                           priority=priority, tenant=tenant, ttft_slo_s=ttft_slo_s,
                           cache_salt=cache_salt, hints=hints)
        ids = req.prompt_token_ids
        ticket = None
        if self.flow is not None:
            ticket = await self.flow.enter(rid, tenant, priority, len(ids) + (wire_max_tokens(req) or 0))
        session = session_id if session_id is not None else hints.session_id if hints is not None else None
        try:
            async with contextlib.aclosing(self._stream(req, rid, ids, session)) as outs:
                async for out in outs:
                    yield out
        finally:
            if ticket is not None:
                self.flow.leave(ticket)  # type: ignore[union-attr]

    async def _stream(self, req: WireRequest, rid: str, ids: list[int],
                      session_id: str | None) -> AsyncGenerator[RequestOutput, None]:
        produced = False
        async with contextlib.aclosing(self.core.stream(req, session_id=session_id)) as outputs:
            async for item in outputs:
                if (item.error is not None and not item.new_token_ids and item.metrics is None
                        and not produced):
                    error = EngineBusyError if item.stop_reason == "busy" else RequestError
                    raise error(f"request {rid!r} failed: {item.error}", request_id=rid)
                produced = produced or bool(item.new_token_ids)
                yield RequestOutput(rid, ids, list(item.new_token_ids), item.finish_reason,
                                    item.stop_reason, item.error, item.metrics,
                                    num_cached_tokens=item.num_cached_tokens,
                                    rejected_by=item.rejected_by,
                                    rejection_reason=item.rejection_reason)

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run a utility method (stats, reset_prefix_cache, list_plugins...) in the engine
        (a cluster: in every replica, answers combined; see ClusterClient.call_utility).
        With flow control, ``stats`` adds the front door's (``flow_control``)."""
        answer = await self.core.call_utility(method, *args)
        if method == "stats" and self.flow is not None and isinstance(answer, dict):
            answer = answer | {"flow_control": self.flow.stats()}
        return answer

    async def close(self) -> None:
        await self.core.close()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class LLM:
    """Offline batch generation through an engine process started from a config, or,
    with ``replicas.count`` > 1, through the router to the replicas.

    A synchronous facade over an :class:`AsyncLLM` that runs on a background event-loop
    thread: each call runs there and waits for its answer. With replicas, a replica's
    death re-routes the requests that had produced no token and fails the others, as
    with AsyncLLM (docs/cluster.md).

    Threads may share one LLM: their calls take turns (a ``generate`` runs to its end
    before the next starts; for concurrent streams use AsyncLLM).
    """

    def __init__(self, config: Config | str | os.PathLike[str], *, transport: str = "ipc",
                 tokenizer: Any = None) -> None:
        """Args:
            config: A Config or the path of a YAML file.
            transport: ``"ipc"`` (default) or ``"tcp"`` (loopback).
            tokenizer: For text prompts; by default the model's own, loaded on first use.
        """
        self.config = _resolve(config)
        self.tokenizer: Any = tokenizer
        self._ids = itertools.count()
        self._closed = False
        self._turn = threading.Lock()
        """Held by each call while it runs, and by close."""
        self._loop = _LoopThread()
        try:
            self._async = self._loop.run(AsyncLLM.create(self.config, transport=transport))
        except BaseException:
            self._loop.stop()
            raise
        index = self._async.client_index
        self._id_prefix = "r" if index is None else str(index)

    @property
    def engine(self) -> EngineHandle:
        """The engine process (one engine only)."""
        return self._async.engine

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 priorities: Sequence[int] | None = None,
                 arrival_offsets: Sequence[float] | None = None,
                 tenants: Sequence[str] | None = None,
                 hints: Sequence[RequestHints | None] | None = None,
                 request_ids: Sequence[str] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order. ``request_ids``
        names the requests (distinct strings; default: this LLM's own numbering), e.g. a
        workload's ids, so that a run names each request as a recording of it does.

        A request that fails in the engine (too long, a plugin error) has
        ``finish_reason == "error"`` and ``error`` set; the others are unaffected. If the
        call ends early (an exception, KeyboardInterrupt), its unfinished requests are
        aborted, so they do not keep the engine busy.

        With replicas, a replica's death re-routes its requests that had produced no
        token yet; those that had end with ``finish_reason == "error"`` and an error
        naming the replica.

        Raises:
            RequestError: A badly typed or out-of-range input (a token id that is not a
                non-negative int, a priority that is not an int, a non-finite arrival
                offset...), naming the prompt and the field; nothing is sent.
            EngineDeadError: The engine died (with replicas: no replica is left).
        """
        requests = self._wire_requests(prompts, sampling_params, priorities, arrival_offsets, tenants, hints,
                                       request_ids)
        results = {w.request_id: RequestOutput(w.request_id, w.prompt_token_ids) for w in requests}
        self._run(self._collect(requests, results, use_tqdm))
        return list(results.values())

    def _wire_requests(self, prompts: Sequence[str | Sequence[int]],
                       sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                       priorities: Sequence[int] | None, arrival_offsets: Sequence[float] | None,
                       tenants: Sequence[str] | None,
                       hints: Sequence[RequestHints | None] | None = None,
                       request_ids: Sequence[str] | None = None) -> list[WireRequest]:
        """One validated, final-only request per prompt (the errors name the prompt)."""
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params = [sampling_params or SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, (str, bytes, dict)) or not isinstance(sampling_params, Sequence):
            raise RequestError("sampling_params must be a SamplingParams or a list of them (one per "
                               f"prompt), got {type(sampling_params).__name__}")
        else:
            params = list(sampling_params)
        for name, values in (("sampling params", params), ("priorities", priorities),
                             ("arrival offsets", arrival_offsets), ("tenants", tenants), ("hints", hints),
                             ("request ids", request_ids)):
            if values is not None and len(values) != len(prompts):
                raise RequestError(f"{len(prompts)} prompts but {len(values)} {name}")
        if request_ids is not None:
            bad = next((i for i, r in enumerate(request_ids) if not isinstance(r, str) or not r), None)
            if bad is not None:
                raise RequestError(f"request_ids[{bad}] must be a non-empty string, got {request_ids[bad]!r}")
            twice = first_repeat(request_ids)
            if twice is not None:
                raise RequestError(f"request_ids: {request_ids[twice]!r} is given twice",
                                   request_id=request_ids[twice])
        requests = []
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            rid = request_ids[i] if request_ids is not None else f"{self._id_prefix}-{next(self._ids)}"
            try:
                requests.append(wire_request(
                    rid, _prompt_ids(prompt, self), sp, priority=priorities[i] if priorities else 0,
                    tenant=tenants[i] if tenants else "default",
                    arrival_offset=arrival_offsets[i] if arrival_offsets else None, final_only=True,
                    hints=hints[i] if hints else None))
            except RequestError as e:
                raise RequestError(f"prompts[{i}]: {e}", request_id=rid) from None
        return requests

    async def _collect(self, requests: list[WireRequest], results: dict[str, RequestOutput],
                       use_tqdm: bool) -> None:
        """Stream every request through the core at once, folding outputs into
        ``results``; leaving early aborts the unfinished ones (see stream_many)."""
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(requests), desc="requests", unit="req", dynamic_ncols=True)
        try:
            async with contextlib.aclosing(self._async.core.stream_many(requests)) as outputs:
                async for o in outputs:
                    if _apply(o, results) and bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()

    def call_utility(self, method: str, *args: Any) -> Any:
        """Run a utility method (stats, reset_prefix_cache, list_plugins...) in the engine
        (a cluster: in every replica, answers combined; see ClusterClient.call_utility).

        Raises:
            EngineDeadError: The engine died, or gave no answer in UTILITY_TIMEOUT_S.
        """
        return self._run(self._call_utility(method, args))

    async def _call_utility(self, method: str, args: tuple[Any, ...]) -> Any:
        try:
            return await asyncio.wait_for(self._async.call_utility(method, *args), UTILITY_TIMEOUT_S)
        except TimeoutError:
            raise EngineDeadError(f"utility {method} got no answer in {UTILITY_TIMEOUT_S:.0f} s") from None

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coro`` on the loop, in this call's turn, and wait for it.

        Raises:
            EngineDeadError: This LLM was closed.
        """
        with self._turn:
            if self._closed:
                coro.close()
                raise EngineDeadError("this LLM was closed")
            return self._loop.run(coro)

    def close(self) -> None:
        """Shut the engine (the replicas) down, after the call another thread runs;
        closing twice is harmless."""
        with self._turn:
            if self._closed:
                return
            self._closed = True
            try:
                self._loop.run(self._async.close())
            finally:
                self._loop.stop()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _apply(o: WireOutput, results: dict[str, RequestOutput]) -> bool:
    """Fold one output delta into ``results``; True if it finished its request."""
    res = results.get(o.request_id)
    if res is None or res.finished:
        return False
    res.output_token_ids.extend(o.new_token_ids)
    if o.finish_reason is None:
        return False
    res.finish_reason, res.stop_reason, res.error, res.metrics = (
        o.finish_reason, o.stop_reason, o.error, o.metrics)
    res.rejected_by, res.rejection_reason = o.rejected_by, o.rejection_reason
    return True


class _LoopThread:
    """An asyncio event loop on a daemon thread, for the synchronous :class:`LLM`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="schedkit-llm-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coro`` on the loop and wait for it. If the wait is interrupted
        (KeyboardInterrupt), the coroutine is cancelled and its clean-up awaited (a few
        seconds at most) before the interruption goes on."""
        done = threading.Event()

        async def wrapped() -> _T:
            try:
                return await coro
            finally:
                done.set()

        fut = asyncio.run_coroutine_threadsafe(wrapped(), self.loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            done.wait(10)
            raise

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()
