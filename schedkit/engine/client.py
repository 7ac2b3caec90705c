"""Front-end clients of the engine process: ``LLM`` (offline batches) and ``AsyncLLM``
(async streaming), both started from the same YAML.

Each client connects two DEALER sockets (one identity) to the engine's input and output
ROUTER sockets, over ``ipc://`` by default or ``tcp://127.0.0.1``. A dead engine surfaces
as :class:`EngineDeadError` within a few seconds (process exit or missing heartbeats),
never as a hang. Heartbeats that arrive while a client is idle count: they wait on the
socket and are read before the client decides the engine is silent.

Requests are validated here (:func:`schedkit.engine.messages.check_request`) before they
are sent, so a badly typed field raises :class:`RequestError` naming the field and the
request instead of reaching the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from schedkit.config import Config, load_config
from schedkit.core.request import SamplingParams
from schedkit.engine.messages import (
    AbortRequests,
    AddRequests,
    Heartbeat,
    Hello,
    OutputBatch,
    Ready,
    UtilityCall,
    WireMetrics,
    WireOutput,
    WireRequest,
    check_request,
    client_encoder,
    engine_decoder,
    sampling_to_wire,
)
from schedkit.engine.process import START_TIMEOUT_S, EngineProcess
from schedkit.errors import ConfigError, EngineDeadError, PluginError, RequestError, SchedkitError

DEAD_AFTER_S = 3.0
"""No message (not even a heartbeat) for this long means the engine is gone."""

_UTILITY_ERRORS: dict[str, type[SchedkitError]] = {
    "ConfigError": ConfigError, "RequestError": RequestError, "PluginError": PluginError}
"""Typed errors a utility call reports that the client raises as the same type."""


def _abort_ids(request_ids: object) -> list[str]:
    if isinstance(request_ids, str):
        return [request_ids]
    if not isinstance(request_ids, Iterable):
        raise RequestError(f"abort: request ids must be a string or a list of strings, got {request_ids!r}")
    ids = list(request_ids)
    bad = [i for i in ids if not isinstance(i, str)]
    if bad:
        raise RequestError(f"abort: request ids must be strings, got {bad[0]!r}")
    return ids


def utility_error(method: str, error: str) -> SchedkitError:
    """The client-side error for a utility call that failed in the engine with ``error``
    ("Type: message"): the same type where it is one of ours, else SchedkitError."""
    kind, _, message = error.partition(": ")
    typed = _UTILITY_ERRORS.get(kind)
    return typed(f"utility {method}: {message}") if typed else SchedkitError(f"utility {method}: {error}")


def wire_request(request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                 priority: int = 0, tenant: str = "default", arrival_offset: float | None = None,
                 cache_salt: str | None = None, final_only: bool = False,
                 ttft_slo_s: float | None = None) -> WireRequest:
    """The wire form of one request, validated.

    Raises:
        RequestError: A badly typed or out-of-range field (named in the message).
    """
    if not isinstance(params, SamplingParams):
        raise RequestError(f"request {request_id!r}: sampling_params must be a SamplingParams, "
                           f"got {type(params).__name__}", request_id=request_id)
    ids: Any = prompt_token_ids
    if isinstance(ids, Sequence) and not isinstance(ids, str | bytes):
        ids = list(ids)  # anything else (an ndarray, an int) fails the check below
    w = WireRequest(request_id, ids, sampling_to_wire(params), priority=priority, tenant=tenant,
                    cache_salt=cache_salt, arrival_offset=arrival_offset, final_only=final_only,
                    ttft_slo_s=ttft_slo_s)
    check_request(w)
    return w


class EngineClient:
    """A synchronous connection to an engine process (one identity, two sockets)."""

    def __init__(self, input_addr: str, output_addr: str, *, engine: EngineProcess | None = None) -> None:
        self.engine = engine
        self.ctx = zmq.Context()
        identity = uuid.uuid4().bytes
        self.in_sock = self._connect(input_addr, identity)
        self.out_sock = self._connect(output_addr, identity)
        self._call_ids = itertools.count()
        self._last_seen = time.monotonic()
        self._inbox: deque[Any] = deque()
        """Messages read off the socket by :meth:`check_alive`, not yet returned."""
        self.out_sock.send(client_encoder.encode(Hello()))
        while True:
            msg = self._recv_one(START_TIMEOUT_S)
            if isinstance(msg, Ready):
                self.client_index = msg.client_index
                break

    @staticmethod
    def _connect_opts(sock: zmq.Socket, identity: bytes) -> None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)

    def _connect(self, addr: str, identity: bytes) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        self._connect_opts(sock, identity)
        sock.connect(addr)
        return sock

    def check_alive(self) -> None:
        """Raise EngineDeadError if the engine process exited or has sent nothing, not
        even a heartbeat, for ``DEAD_AFTER_S`` (heartbeats queued while idle count)."""
        if self.engine is not None and not self.engine.is_alive():
            raise EngineDeadError(f"the engine process exited (code {self.engine.exitcode})")
        if time.monotonic() - self._last_seen > DEAD_AFTER_S:
            self._drain()
            if time.monotonic() - self._last_seen > DEAD_AFTER_S:
                raise EngineDeadError(f"no message from the engine for {DEAD_AFTER_S:.0f} s")

    def _take(self) -> Any:
        """Decode the next message (the socket is readable); any message proves liveness."""
        self._last_seen = time.monotonic()
        return engine_decoder.decode(self.out_sock.recv(copy=False).buffer)

    def _drain(self) -> None:
        """Read what arrived while nobody listened: heartbeats are dropped, anything else
        waits in the inbox for the next receive."""
        while self.out_sock.poll(0):
            msg = self._take()
            if not isinstance(msg, Heartbeat):
                self._inbox.append(msg)

    def _recv_one(self, timeout: float) -> Any:
        if self._inbox:
            return self._inbox.popleft()
        deadline = time.monotonic() + timeout
        while True:
            if self.out_sock.poll(100):
                return self._take()
            self.check_alive()
            if self._inbox:
                return self._inbox.popleft()
            if time.monotonic() > deadline:
                return None

    def recv(self, timeout: float = 1.0) -> OutputBatch | None:
        """The next output batch (None after ``timeout`` seconds without one)."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self._recv_one(max(deadline - time.monotonic(), 0.0))
            if msg is None or isinstance(msg, OutputBatch):
                return msg

    def add_requests(self, requests: list[WireRequest]) -> None:
        self.check_alive()
        self.in_sock.send(client_encoder.encode(AddRequests(requests)))

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests by id (one id may be a plain string).

        Raises:
            RequestError: An id that is not a string (nothing is sent).
        """
        self.in_sock.send(client_encoder.encode(AbortRequests(_abort_ids(request_ids))))

    def abort_quietly(self, request_ids: Iterable[str]) -> None:
        """Abort without blocking or raising (cleanup on the way out of a failed call)."""
        try:
            self.in_sock.send(client_encoder.encode(AbortRequests(list(request_ids))), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def call_utility(self, method: str, *args: Any, timeout: float = 30.0,
                     pending: list[OutputBatch] | None = None) -> Any:
        """Run a utility method in the engine; outputs received meanwhile go to ``pending``."""
        call_id = next(self._call_ids)
        self.in_sock.send(client_encoder.encode(UtilityCall(call_id, method, list(args))))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            batch = self.recv(deadline - time.monotonic())
            if batch is None:
                continue
            for res in batch.utility_results:
                if res.call_id == call_id:
                    if res.error is not None:
                        raise utility_error(method, res.error)
                    if pending is not None and batch.outputs:
                        pending.append(OutputBatch(outputs=batch.outputs))
                    return res.result
            if pending is not None:
                pending.append(batch)
        raise EngineDeadError(f"utility {method} got no answer in {timeout:.0f} s")

    def close(self) -> None:
        self.in_sock.close(0)
        self.out_sock.close(0)
        self.ctx.term()


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _prompt_ids(prompt: str | Sequence[int], owner: Any) -> Sequence[int]:
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


def load_tokenizer(config: Config) -> Any:
    """The model's tokenizer (transformers), or None for runners without a real model.

    Raises:
        ConfigError: The tokenizer cannot be loaded.
    """
    if config.model.tokenizer is None and config.runner.kind != "paged":
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ConfigError("text needs the tokenizer library: pip install 'schedkit[demo]'") from e
    path = config.model.tokenizer
    if path is None:
        from schedkit.runners.paged.loader import resolve_model_path

        path = str(resolve_model_path(config.model.name, config.model.seed))
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load a tokenizer from {path}: {e}") from e


def _resolve(config: Config | str | os.PathLike[str]) -> Config:
    return config if isinstance(config, Config) else load_config(config)


class LLM:
    """Offline batch generation through an engine process started from a config."""

    def __init__(self, config: Config | str | os.PathLike[str], *, transport: str = "ipc",
                 tokenizer: Any = None) -> None:
        """Args:
            config: A Config or the path of a YAML file.
            transport: ``"ipc"`` (default) or ``"tcp"`` (loopback).
            tokenizer: For text prompts; by default the model's own, loaded on first use.
        """
        self.config = _resolve(config)
        self.tokenizer: Any = tokenizer
        self.engine = EngineProcess(self.config, transport=transport)
        try:
            self.client = EngineClient(self.engine.input_addr, self.engine.output_addr, engine=self.engine)
        except BaseException:
            self.engine.shutdown()
            raise
        self._ids = itertools.count()

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 priorities: Sequence[int] | None = None,
                 arrival_offsets: Sequence[float] | None = None,
                 tenants: Sequence[str] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order.

        A request that fails in the engine (too long, a plugin error) has
        ``finish_reason == "error"`` and ``error`` set; the others are unaffected. If the
        call ends early (an exception, KeyboardInterrupt), its unfinished requests are
        aborted, so they do not keep the engine busy.

        Raises:
            RequestError: A badly typed or out-of-range input (a token id that is not a
                non-negative int, a priority that is not an int, a non-finite arrival
                offset...), naming the prompt and the field; nothing is sent.
        """
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
        for name, values in (("sampling params", params), ("priorities", priorities),
                             ("arrival offsets", arrival_offsets), ("tenants", tenants)):
            if values is not None and len(values) != len(prompts):
                raise RequestError(f"{len(prompts)} prompts but {len(values)} {name}")
        results: dict[str, RequestOutput] = {}
        wire = []
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            rid = f"{self.client.client_index}-{next(self._ids)}"
            try:
                w = wire_request(rid, _prompt_ids(prompt, self), sp,
                                 priority=priorities[i] if priorities else 0,
                                 tenant=tenants[i] if tenants else "default",
                                 arrival_offset=arrival_offsets[i] if arrival_offsets else None,
                                 final_only=True)
            except RequestError as e:
                raise RequestError(f"prompts[{i}]: {e}", request_id=rid) from None
            results[rid] = RequestOutput(rid, w.prompt_token_ids)
            wire.append(w)
        try:
            self.client.add_requests(wire)
            self._collect(results, use_tqdm)
        except EngineDeadError:
            raise
        except BaseException:  # KeyboardInterrupt included: free the engine of our requests
            self.client.abort_quietly([rid for rid, r in results.items() if not r.finished])
            raise
        return list(results.values())

    def _collect(self, results: dict[str, RequestOutput], use_tqdm: bool) -> None:
        remaining = len(results)
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=remaining, desc="requests", unit="req", dynamic_ncols=True)
        try:
            while remaining:
                batch = self.client.recv(timeout=1.0)
                if batch is None:
                    continue
                done = _apply(batch.outputs, results)
                remaining -= done
                if bar is not None and done:
                    bar.update(done)
        finally:
            if bar is not None:
                bar.close()

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.client.call_utility(method, *args)

    def close(self) -> None:
        self.client.close()
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _apply(outputs: list[WireOutput], results: dict[str, RequestOutput]) -> int:
    """Fold output deltas into results; returns how many requests finished."""
    done = 0
    for o in outputs:
        res = results.get(o.request_id)
        if res is None or res.finished:
            continue
        res.output_token_ids.extend(o.new_token_ids)
        if o.finish_reason is not None:
            res.finish_reason, res.stop_reason, res.error, res.metrics = (
                o.finish_reason, o.stop_reason, o.error, o.metrics)
            done += 1
    return done


class AsyncLLM:
    """Async streaming generation through an engine process.

    Use ``await AsyncLLM.create(config)``; then ``async for out in llm.generate(...)``
    yields one :class:`RequestOutput` delta per engine step (new tokens only); the last
    one has ``finish_reason`` set. Cancelling the iteration aborts the request, and so
    does closing the generator: ``break`` out of an ``async for`` over
    ``llm.generate(...)`` aborts once the generator is garbage collected, but a generator
    you keep a reference to keeps its request running until you ``await gen.aclose()``.
    """

    def __init__(self, config: Config, engine: EngineProcess) -> None:
        self.config = config
        self.engine = engine
        self.ctx = zmq.asyncio.Context()
        identity = uuid.uuid4().bytes
        self.in_sock = self.ctx.socket(zmq.DEALER)
        self.out_sock = self.ctx.socket(zmq.DEALER)
        for sock, addr in ((self.in_sock, engine.input_addr), (self.out_sock, engine.output_addr)):
            EngineClient._connect_opts(sock, identity)
            sock.connect(addr)
        self._queues: dict[str, asyncio.Queue[WireOutput | BaseException]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._ready = asyncio.Event()
        self.client_index: int | None = None
        """Set by the engine's ``Ready``, which :meth:`create` waits for."""
        self.tokenizer: Any = None

    @classmethod
    async def create(cls, config: Config | str | os.PathLike[str], *, transport: str = "ipc") -> AsyncLLM:
        cfg = _resolve(config)
        # Spawned from the loop's thread (the engine's parent-death signal follows the
        # spawning thread; see EngineProcess); the slow wait for ready runs off the loop.
        engine = EngineProcess(cfg, transport=transport, wait=False)
        await asyncio.to_thread(engine.wait_ready)
        llm = cls(cfg, engine)
        await llm.out_sock.send(client_encoder.encode(Hello()))
        llm._reader = asyncio.create_task(llm._read_outputs())
        try:
            # The engine's output socket drops messages to a client it does not know yet;
            # its Ready (the answer to our Hello) says it knows us.
            await asyncio.wait_for(llm._ready.wait(), START_TIMEOUT_S)
            if llm._dead is not None:
                raise EngineDeadError(str(llm._dead))
        except BaseException:
            await llm.close()
            raise
        return llm

    async def _read_outputs(self) -> None:
        last_seen = time.monotonic()
        try:
            while True:
                if await self.out_sock.poll(100):
                    msg = engine_decoder.decode(await self.out_sock.recv())
                    last_seen = time.monotonic()
                    if isinstance(msg, OutputBatch):
                        for o in msg.outputs:
                            q = self._queues.get(o.request_id)
                            if q is not None:
                                q.put_nowait(o)
                        for res in msg.utility_results:
                            fut = self._calls.pop(res.call_id, None)
                            if fut is not None and not fut.done():
                                if res.error is not None:
                                    fut.set_exception(utility_error("call", res.error))
                                else:
                                    fut.set_result(res.result)
                    elif isinstance(msg, Ready):
                        self.client_index = msg.client_index
                        self._ready.set()
                    continue
                if not self.engine.is_alive():
                    raise EngineDeadError(f"the engine process exited (code {self.engine.exitcode})")
                # A loop blocked for a while can time the poll out with messages queued.
                if time.monotonic() - last_seen > DEAD_AFTER_S and not self._readable():
                    raise EngineDeadError(f"no message from the engine for {DEAD_AFTER_S:.0f} s")
        except EngineDeadError as e:
            self._dead = e
            self._ready.set()
            for q in self._queues.values():
                q.put_nowait(e)
            for fut in self._calls.values():
                if not fut.done():
                    fut.set_exception(e)

    def is_alive(self) -> bool:
        """The engine process runs and answers (False once it died or went silent)."""
        return self._dead is None and self.engine.is_alive()

    def _readable(self) -> bool:
        """A message waits on the output socket (read without awaiting)."""
        events = self.out_sock.get(zmq.EVENTS)
        return isinstance(events, int) and bool(events & zmq.POLLIN)

    async def generate(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None,
                       *, request_id: str | None = None, priority: int = 0,
                       tenant: str = "default", ttft_slo_s: float | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs.

        Leaving the iteration early aborts the request when the generator closes: at once
        on cancellation or ``await gen.aclose()``; after ``break``, only once the generator
        is garbage collected (never while you still hold a reference to it).

        Raises:
            RequestError: Invalid input (naming the field), an id already streaming in
                this client, or the engine rejected the request.
        """
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        rid = f"a{next(self._ids)}-{uuid.uuid4().hex[:8]}" if request_id is None else request_id
        req = wire_request(rid, _prompt_ids(prompt, self), sampling_params or SamplingParams(),
                           priority=priority, tenant=tenant, ttft_slo_s=ttft_slo_s)
        if rid in self._queues:
            raise RequestError(f"request {rid!r} is already streaming in this client "
                               "(request ids must be unique)", request_id=rid)
        ids = req.prompt_token_ids
        q: asyncio.Queue[WireOutput | BaseException] = asyncio.Queue()
        self._queues[rid] = q
        finished = False
        try:
            await self.in_sock.send(client_encoder.encode(AddRequests([req])))
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None and not item.new_token_ids and item.metrics is None:
                    finished = True
                    raise RequestError(f"request {rid!r} failed: {item.error}", request_id=rid)
                finished = item.finish_reason is not None
                yield RequestOutput(rid, ids, list(item.new_token_ids), item.finish_reason,
                                    item.stop_reason, item.error, item.metrics,
                                    num_cached_tokens=item.num_cached_tokens,
                                    rejected_by=item.rejected_by)
        finally:
            self._queues.pop(rid, None)
            if not finished and self._dead is None:
                await self.in_sock.send(client_encoder.encode(AbortRequests([rid])))

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run a utility method (stats, reset_prefix_cache, list_plugins...) in the engine."""
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        call_id = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            await self.in_sock.send(client_encoder.encode(UtilityCall(call_id, method, list(args))))
            return await fut
        finally:  # answered, failed, or given up on (a caller's timeout): forget it
            self._calls.pop(call_id, None)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
        self.in_sock.close(0)
        self.out_sock.close(0)
        self.ctx.term()
        await asyncio.to_thread(self.engine.shutdown)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

