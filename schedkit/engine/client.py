"""Front-end clients of the engine process: ``LLM`` (offline batches) and ``AsyncLLM``
(async streaming), both started from the same YAML.

Each client connects two DEALER sockets (one identity) to the engine's input and output
ROUTER sockets, over ``ipc://`` by default or ``tcp://127.0.0.1``, as a CurveZMQ client
holding the engine launch's client key (:mod:`schedkit.engine.auth`): the engine refuses
anyone else. A dead engine surfaces
as :class:`EngineDeadError` within a few seconds (process exit or missing heartbeats),
never as a hang. Heartbeats that arrive while a client is idle count: they wait on the
socket and are read before the client decides the engine is silent.

Requests are validated here (:func:`schedkit.engine.messages.check_request`) before they
are sent, so a badly typed field raises :class:`RequestError` naming the field and the
request instead of reaching the engine.

``AsyncLLM`` streams through a core: one engine's :class:`AsyncEngineClient`, or, with
``replicas.count`` > 1, the cluster front end (:mod:`schedkit.cluster.front`: the router
and one AsyncEngineClient per replica). ``LLM`` with replicas runs that replicated
AsyncLLM on a background event loop; with one engine it keeps its synchronous sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import logging
import os
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec
import zmq

from schedkit.config import Config, load_config
from schedkit.core.request import SamplingParams
from schedkit.engine.auth import EngineKeys
from schedkit.engine.logs import RateLimitedLog
from schedkit.engine.messages import (
    AbortRequests,
    AddRequests,
    Heartbeat,
    Hello,
    LoadReport,
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
from schedkit.engine.tokenizer import load_tokenizer
from schedkit.errors import (
    ConfigError,
    EngineBusyError,
    EngineDeadError,
    PluginError,
    RequestError,
    SchedkitError,
)

_T = TypeVar("_T")

log = logging.getLogger("schedkit.engine")

DEAD_AFTER_S = 3.0
"""No message (not even a heartbeat) for this long means the engine is gone."""

WATCH_INTERVAL_S = 0.1
"""How often an asyncio client checks, between messages, that its engine still lives."""

READ_BUDGET = 32
"""Request outputs (a message carries one step's, for many requests) an asyncio client
hands out per turn of the event loop; the rest wait for the next turn. Each wakes a
stream, whose work runs in the loop's next iteration: a flood of outputs must not make
that iteration hold the loop, its other streams and its probes, for long."""

STALL_GRACE_S = 1.0
"""A watch timer this late means the client's own process stood still (see _watch_engine)."""

SEND_RETRY_S = 0.001
"""An asyncio send that would block (it cannot with unbounded queues) retries this often."""

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


def _remove_readers(readers: list[tuple[asyncio.AbstractEventLoop, int]]) -> None:
    """Take each (loop, descriptor) off its loop, emptying ``readers``."""
    while readers:
        loop, fd = readers.pop()
        with contextlib.suppress(RuntimeError, ValueError, OSError):  # a loop closed or elsewhere
            if not loop.is_closed():
                loop.remove_reader(fd)


def _close_zmq(ctx: zmq.Context[Any], sockets: tuple[zmq.Socket[Any], ...],
               readers: list[tuple[asyncio.AbstractEventLoop, int]] | None = None) -> None:
    """Take the sockets' descriptors off the event loops watching them (``readers``),
    close the sockets, then end their context. Run from :func:`weakref.finalize`, so a
    client dropped without ``close()`` (even inside a reference cycle) still closes its
    sockets first: left to the garbage collector, pyzmq may end a context before its
    sockets are closed, and that waits forever."""
    _remove_readers(readers or [])
    for sock in sockets:
        with contextlib.suppress(RuntimeError):
            sock.close(0)
    ctx.term()


class EngineClient:
    """A synchronous connection to an engine process (one identity, two sockets).

    Args:
        input_addr, output_addr: The engine's sockets.
        engine: The engine process (its death is seen at once; its ``keys`` are used).
        keys: The engine launch's keys, when ``engine`` is not given.
    """

    def __init__(self, input_addr: str, output_addr: str, *, engine: EngineProcess | None = None,
                 keys: EngineKeys | None = None) -> None:
        self.engine = engine
        if keys is None:
            if engine is None:
                raise SchedkitError("EngineClient needs the engine launch's keys (engine= or keys=)")
            keys = engine.keys
        self.ctx = zmq.Context()
        identity = uuid.uuid4().bytes
        self.in_sock = self._connect(input_addr, identity, keys)
        self.out_sock = self._connect(output_addr, identity, keys)
        self._close = weakref.finalize(self, _close_zmq, self.ctx, (self.in_sock, self.out_sock))
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
    def _connect_opts(sock: zmq.Socket, identity: bytes, keys: EngineKeys) -> None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        keys.secure_client(sock)

    def _connect(self, addr: str, identity: bytes, keys: EngineKeys) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        self._connect_opts(sock, identity, keys)
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
        self._close()


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


def _resolve(config: Config | str | os.PathLike[str]) -> Config:
    return config if isinstance(config, Config) else load_config(config)


class LLM:
    """Offline batch generation through an engine process started from a config.

    With ``replicas.count`` > 1 the requests go through the router to the replicas: a
    replicated :class:`AsyncLLM` runs on a background event-loop thread and every request
    streams through it (so a replica's death re-routes the requests that had produced
    no token and fails the others, as with AsyncLLM; docs/cluster.md).

    Threads may share one LLM: with one engine their calls take turns (a ``generate``
    runs to its end before the next starts; for concurrent streams use AsyncLLM).
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
        self._replicated: tuple[_LoopThread, AsyncLLM] | None = None
        self._closed = False
        self._turn = threading.Lock()
        """Held by each call on the one engine's synchronous sockets (not thread-safe)."""
        if self.config.replicas.count > 1:
            loop = _LoopThread()
            try:
                self._replicated = (loop, loop.run(AsyncLLM.create(self.config)))
            except BaseException:
                loop.stop()
                raise
            return
        self.engine = EngineProcess(self.config, transport=transport)
        try:
            self.client = EngineClient(self.engine.input_addr, self.engine.output_addr, engine=self.engine)
        except BaseException:
            self.engine.shutdown()
            raise

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

        With replicas, a replica's death re-routes its requests that had produced no
        token yet; those that had end with ``finish_reason == "error"`` and an error
        naming the replica.

        Raises:
            RequestError: A badly typed or out-of-range input (a token id that is not a
                non-negative int, a priority that is not an int, a non-finite arrival
                offset...), naming the prompt and the field; nothing is sent.
            EngineDeadError: The engine died (with replicas: no replica is left).
        """
        if isinstance(sampling_params, SamplingParams) or sampling_params is None:
            params = [sampling_params or SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, (str, bytes, dict)) or not isinstance(sampling_params, Sequence):
            raise RequestError("sampling_params must be a SamplingParams or a list of them (one per "
                               f"prompt), got {type(sampling_params).__name__}")
        else:
            params = list(sampling_params)
        for name, values in (("sampling params", params), ("priorities", priorities),
                             ("arrival offsets", arrival_offsets), ("tenants", tenants)):
            if values is not None and len(values) != len(prompts):
                raise RequestError(f"{len(prompts)} prompts but {len(values)} {name}")
        results: dict[str, RequestOutput] = {}
        wire = []
        replicated = self._replicated
        prefix = "r" if replicated is not None else self.client.client_index
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            rid = f"{prefix}-{next(self._ids)}"
            try:
                w = wire_request(rid, _prompt_ids(prompt, self), sp,
                                 priority=priorities[i] if priorities else 0,
                                 tenant=tenants[i] if tenants else "default",
                                 arrival_offset=arrival_offsets[i] if arrival_offsets else None,
                                 final_only=replicated is None)
            except RequestError as e:
                raise RequestError(f"prompts[{i}]: {e}", request_id=rid) from None
            results[rid] = RequestOutput(rid, w.prompt_token_ids)
            wire.append(w)
        if replicated is not None:
            if self._closed:
                raise EngineDeadError("this LLM was closed")
            self._generate_replicated(replicated, wire, results, use_tqdm)
            return list(results.values())
        with self._turn:
            if self._closed:
                raise EngineDeadError("this LLM was closed")
            try:
                self.client.add_requests(wire)
                self._collect(results, use_tqdm)
            except EngineDeadError:
                raise
            except BaseException:  # KeyboardInterrupt included: free the engine of our requests
                self.client.abort_quietly([rid for rid, r in results.items() if not r.finished])
                raise
        return list(results.values())

    @staticmethod
    def _generate_replicated(replicated: tuple[_LoopThread, AsyncLLM], wire: list[WireRequest],
                             results: dict[str, RequestOutput], use_tqdm: bool) -> None:
        """Stream every request through the replicated AsyncLLM (streamed, not final-only:
        whether a request produced a token decides what a replica's death does to it)."""
        loop, allm = replicated
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(results), desc="requests", unit="req", dynamic_ncols=True)
        try:
            loop.run(_stream_batch(allm.core, wire, results, bar))
        finally:
            if bar is not None:
                bar.close()

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
        if self._replicated is not None:
            if self._closed:
                raise EngineDeadError("this LLM was closed")
            loop, allm = self._replicated
            return loop.run(allm.call_utility(method, *args))
        with self._turn:
            if self._closed:
                raise EngineDeadError("this LLM was closed")
            return self.client.call_utility(method, *args)

    def close(self) -> None:
        if self._replicated is not None:
            if self._closed:
                return
            self._closed = True
            loop, allm = self._replicated
            try:
                loop.run(allm.close())
            finally:
                loop.stop()
            return
        with self._turn:  # after the generate another thread runs
            if self._closed:
                return
            self._closed = True
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
            res.rejected_by, res.rejection_reason = o.rejected_by, o.rejection_reason
            done += 1
    return done


class EngineHandle(Protocol):
    """What a connection needs of the engine it talks to: an :class:`EngineProcess`, or a
    cluster replica (a local process or a Ray actor's engine)."""

    input_addr: str
    output_addr: str
    keys: EngineKeys
    """The engine launch's keys (the client part connects)."""

    def is_alive(self) -> bool: ...

    def death_reason(self) -> str: ...

    def shutdown(self, timeout: float = 5.0) -> None: ...


def _has_input(sock: zmq.Socket[bytes]) -> bool:
    events = sock.getsockopt(zmq.EVENTS)
    return isinstance(events, int) and bool(events & zmq.POLLIN)


def _call_weakly(ref: weakref.ReferenceType[Any], method: str) -> None:
    """Call ``method`` of what ``ref`` points to, if it still lives: the loop's callbacks
    must not keep a client dropped without ``close()`` alive (its finalizer cleans up)."""
    obj = ref()
    if obj is not None:
        getattr(obj, method)()


class AsyncEngineClient:
    """One asyncio connection to an engine: two DEALER sockets (one identity), the output
    socket read by the event loop itself, which hands each request's outputs to its stream.

    The output socket's descriptor is registered with the loop (``add_reader``): when it
    signals, the messages waiting are read and dispatched in that callback, with no task
    or future between the socket and the streams' queues (pyzmq's asyncio sockets cost
    about twice the CPU and latency per message). ZeroMQ signals that descriptor on
    edges, so each callback reads until the socket is empty or READ_BUDGET outputs are
    handed out (then it calls itself again on the loop's next turn), and a timer every
    ``WATCH_INTERVAL_S`` reads again (nothing can wait longer than that) and checks that
    the engine lives. Sends never block: the sockets' queues are unbounded.

    Args:
        engine: The engine to connect to.
        owns_engine: :meth:`close` also shuts the engine down.
        on_load: With it, the engine sends this client its load reports
            (``Hello.load_reports``) and the reader calls ``on_load(report)`` for each.
        on_dead: Called once, from the reader, with the EngineDeadError when the engine
            is found dead (before any stream or utility call hears of it).
    """

    def __init__(self, engine: EngineHandle, *, owns_engine: bool = True,
                 on_load: Callable[[LoadReport], None] | None = None,
                 on_dead: Callable[[EngineDeadError], None] | None = None) -> None:
        self.engine = engine
        self.owns_engine = owns_engine
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        identity = uuid.uuid4().bytes
        self.in_sock = self.ctx.socket(zmq.DEALER)
        self.out_sock = self.ctx.socket(zmq.DEALER)
        for sock, addr in ((self.in_sock, engine.input_addr), (self.out_sock, engine.output_addr)):
            EngineClient._connect_opts(sock, identity, engine.keys)
            sock.connect(addr)
        fd = self.out_sock.getsockopt(zmq.FD)
        assert isinstance(fd, int)
        self._fd = fd
        self._readers: list[tuple[asyncio.AbstractEventLoop, int]] = []
        """The loop watching ``_fd`` once connected (for the finalizer)."""
        self._close = weakref.finalize(self, _close_zmq, self.ctx, (self.in_sock, self.out_sock),
                                       self._readers)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch: asyncio.TimerHandle | None = None
        self._watch_due = 0.0
        self._more_scheduled = False
        self._last_seen = time.monotonic()
        self._weak = weakref.ref(self)
        """What the loop's callbacks hold (see _call_weakly)."""
        self._on_load = on_load
        self._on_dead = on_dead
        self._load_error_log = RateLimitedLog(log, 10.0)
        self._queues: dict[str, asyncio.Queue[WireOutput | BaseException]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._dead: EngineDeadError | None = None
        self._ready = asyncio.Event()
        self.client_index: int | None = None
        """Set by the engine's ``Ready``, which :meth:`connect` waits for."""

    async def connect(self) -> None:
        """Say hello and wait for the engine's ``Ready``.

        Raises:
            EngineDeadError: The engine died or did not answer in START_TIMEOUT_S.
        """
        await self._send(self.out_sock, client_encoder.encode(Hello(load_reports=self._on_load is not None)))
        self._start_reading(asyncio.get_running_loop())  # after the send, which may take the edge
        # The engine's output socket drops messages to a client it does not know yet;
        # its Ready (the answer to our Hello) says it knows us.
        await asyncio.wait_for(self._ready.wait(), START_TIMEOUT_S)
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))

    @property
    def dead(self) -> EngineDeadError | None:
        """Why the engine is considered dead (None while it answers)."""
        return self._dead

    def _start_reading(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._last_seen = time.monotonic()
        loop.add_reader(self._fd, _call_weakly, self._weak, "_read_outputs")
        self._readers.append((loop, self._fd))
        self._arm_watch(loop)
        self._read_outputs()  # what arrived before the descriptor was watched

    def _arm_watch(self, loop: asyncio.AbstractEventLoop) -> None:
        self._watch_due = time.monotonic() + WATCH_INTERVAL_S
        self._watch = loop.call_later(WATCH_INTERVAL_S, _call_weakly, self._weak, "_watch_engine")

    def _follow_loop(self) -> None:
        """Streams and calls run on the loop that reads the socket. A client whose loop
        has ended (``asyncio.run(AsyncLLM.create(...))``, then another ``asyncio.run``)
        moves its reader to the running loop; a loop that still runs elsewhere (another
        thread) cannot share it, since its streams' queues belong to that loop.

        Raises:
            RuntimeError: The client's loop still runs, in another thread.
        """
        loop = asyncio.get_running_loop()
        if loop is self._loop or self._dead is not None:
            return
        if self._loop is not None and self._loop.is_running():
            raise RuntimeError("this AsyncLLM belongs to the event loop it was created on, which is "
                               "still running (in another thread): create one AsyncLLM per event loop")
        self._stop_reading()
        self._start_reading(loop)

    def _read_outputs(self) -> None:
        """Read and dispatch the messages waiting on the output socket, READ_BUDGET
        outputs' worth per turn of the loop (the loop calls this when the socket's
        descriptor signals, the watch timer between, and itself while some are left)."""
        self._more_scheduled = False
        if self._dead is not None:
            return
        sock = self.out_sock
        try:
            spent = 0
            while spent < READ_BUDGET:
                if not _has_input(sock):
                    return
                try:
                    frame = sock.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
                self._last_seen = time.monotonic()
                spent += self._dispatch(engine_decoder.decode(frame.buffer))
            # Budget spent with messages left: the descriptor will not signal for them
            # (edges), so come back on the loop's next turn, after what else is ready.
            if self._loop is not None and not self._more_scheduled:
                self._more_scheduled = True
                self._loop.call_soon(_call_weakly, self._weak, "_read_outputs")
        except Exception as e:  # a bug here, or a closed socket: either way no stream may hang
            self._die(e)

    def _dispatch(self, msg: Any) -> int:
        """Hand one message to whom it concerns; returns its weight (outputs, at least 1)."""
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
        elif isinstance(msg, LoadReport):
            if self._on_load is not None:
                try:
                    self._on_load(msg)
                except Exception as e:  # the router's bug, not a dead engine
                    self._load_error_log.error("handling a load report failed: %s: %s",
                                               type(e).__name__, e)
        elif isinstance(msg, Ready):
            self.client_index = msg.client_index
            self._ready.set()
        return max(1, len(msg.outputs)) if isinstance(msg, OutputBatch) else 1

    def _watch_engine(self) -> None:
        """Every WATCH_INTERVAL_S: read what waits, then, after a quiet interval, check
        that the engine process lives and has spoken (a heartbeat) within DEAD_AFTER_S.

        A timer that fires far behind time means this process itself stood still (a
        paused container or VM, a stopped process, a swapped-out loop): the engine's
        heartbeats of that time may not even have crossed ZeroMQ's threads yet, so the
        silence is measured again from now rather than judged."""
        self._watch = None
        now = time.monotonic()
        if now - self._watch_due > STALL_GRACE_S:
            self._last_seen = max(self._last_seen, now)
        self._read_outputs()
        if self._dead is not None or self._loop is None:
            return
        quiet = time.monotonic() - self._last_seen
        try:
            if quiet >= WATCH_INTERVAL_S and not self.engine.is_alive():
                raise EngineDeadError(self.engine.death_reason())
            if quiet > DEAD_AFTER_S:
                raise EngineDeadError(f"no message from the engine for {DEAD_AFTER_S:.0f} s")
        except Exception as e:
            self._die(e)
            return
        self._arm_watch(self._loop)

    def _stop_reading(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        _remove_readers(self._readers)

    def _die(self, e: Exception) -> None:
        """The engine is dead (``EngineDeadError``) or its connection broke (anything
        else): stop reading, fail every stream and call, shut an owned engine down if
        its process still runs, tell ``on_dead`` once."""
        dead = e if isinstance(e, EngineDeadError) else EngineDeadError(
            f"the connection to the engine failed: {type(e).__name__}: {e}")
        self._stop_reading()
        if self._dead is not None:
            return
        self._fail_all(dead)
        if self.owns_engine and self.engine.is_alive():
            # Silent but running (stopped, wedged): this client is done with it, and its
            # requests would run on for nobody. Stopped off the loop (it may take seconds).
            threading.Thread(target=self.engine.shutdown, name="schedkit-engine-shutdown",
                             daemon=True).start()
        if self._on_dead is not None:
            try:
                self._on_dead(dead)
            except Exception:
                log.exception("the on_dead callback failed")

    async def _send(self, sock: zmq.Socket[bytes], data: bytes) -> None:
        """Send without blocking the loop (a full queue, impossible with unbounded queues,
        retries every SEND_RETRY_S until the engine is found dead)."""
        while True:
            try:
                sock.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:
                if self._dead is not None:
                    raise EngineDeadError(str(self._dead)) from None
                await asyncio.sleep(SEND_RETRY_S)

    def _fail_all(self, dead: EngineDeadError) -> None:
        self._dead = dead
        self._ready.set()
        for q in self._queues.values():
            q.put_nowait(dead)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(dead)

    def is_alive(self) -> bool:
        """The engine process runs and answers (False once it died or went silent)."""
        return self._dead is None and self.engine.is_alive()

    async def stream(self, request: WireRequest, *,
                     session_id: str | None = None) -> AsyncGenerator[WireOutput, None]:
        """Send one (validated) request and yield its outputs as they come; the last has
        ``finish_reason`` set. Leaving early aborts it in the engine. ``session_id`` is
        for routers; one engine ignores it.

        Raises:
            EngineDeadError: The engine died (at once, or while the request ran).
            RequestError: Its id is already streaming in this client.
            RuntimeError: Called on an event loop other than the client's, which still
                runs (another thread).
        """
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        self._follow_loop()
        rid = request.request_id
        if rid in self._queues:
            raise RequestError(f"request {rid!r} is already streaming in this client "
                               "(request ids must be unique)", request_id=rid)
        q: asyncio.Queue[WireOutput | BaseException] = asyncio.Queue()
        self._queues[rid] = q
        finished = False
        try:
            await self._send(self.in_sock, client_encoder.encode(AddRequests([request])))
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            self._queues.pop(rid, None)
            if not finished and self._dead is None and not self.in_sock.closed:
                await self._send(self.in_sock, client_encoder.encode(AbortRequests([rid])))

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run a utility method (stats, reset_prefix_cache, list_plugins...) in the engine."""
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        self._follow_loop()
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            await self._send(self.in_sock, client_encoder.encode(UtilityCall(call_id, method, list(args))))
            return await fut
        finally:  # answered, failed, or given up on (a caller's timeout): forget it
            self._calls.pop(call_id, None)

    async def close(self) -> None:
        """Stop reading (streams still waiting get EngineDeadError, none hangs), close the
        sockets and, with ``owns_engine``, shut the engine down."""
        self._stop_reading()
        if self._dead is None:
            self._fail_all(EngineDeadError("the client was closed"))
        self._close()
        if self.owns_engine:
            await asyncio.to_thread(self.engine.shutdown)


class AsyncCore(Protocol):
    """What :class:`AsyncLLM` streams through: one engine (:class:`AsyncEngineClient`) or
    the cluster front end (:class:`schedkit.cluster.front.ClusterClient`, with
    ``replicas.count`` > 1)."""

    @property
    def dead(self) -> EngineDeadError | None: ...

    def stream(self, request: WireRequest, *, session_id: str | None = None) -> AsyncGenerator[WireOutput, None]: ...

    async def call_utility(self, method: str, *args: Any) -> Any: ...

    def is_alive(self) -> bool: ...

    async def close(self) -> None: ...


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

    def __init__(self, config: Config, core: AsyncCore) -> None:
        self.config = config
        self.core = core
        """The connection the requests go through."""
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
        if cfg.replicas.count > 1:
            # The cluster front end lives above the engine layer (cluster/ imports
            # engine/); resolved by name here so that engine/ does not import it.
            front = importlib.import_module("schedkit.cluster.front")
            return cls(cfg, await front.ClusterClient.start(cfg))
        # Spawned from the loop's thread (the engine's parent-death signal follows the
        # spawning thread; see EngineProcess); the slow wait for ready runs off the loop.
        engine = EngineProcess(cfg, transport=transport, wait=False)
        await asyncio.to_thread(engine.wait_ready)
        conn = AsyncEngineClient(engine)
        try:
            await conn.connect()
        except BaseException:
            await conn.close()
            raise
        return cls(cfg, conn)

    def is_alive(self) -> bool:
        """The engine runs and answers (a cluster: at least one replica does)."""
        return self.core.is_alive()

    async def generate(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None,
                       *, request_id: str | None = None, priority: int = 0,
                       tenant: str = "default", ttft_slo_s: float | None = None,
                       session_id: str | None = None, cache_salt: str | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs.

        Leaving the iteration early aborts the request when the generator closes: at once
        on cancellation or ``await gen.aclose()``; after ``break``, only once the generator
        is garbage collected (never while you still hold a reference to it).

        ``session_id`` (a conversation's id) is for the router's session affinity;
        ``cache_salt`` keeps the request's prefix-cache blocks apart from other salts'.

        Raises:
            RequestError: Invalid input (naming the field), an id already streaming in
                this client, or the engine rejected the request.
            EngineDeadError: The engine died (with replicas: every replica died, or the
                request's replica died before it produced a token and none is left).
        """
        dead = self.core.dead
        if dead is not None:
            raise EngineDeadError(str(dead))
        rid = f"a{next(self._ids)}-{uuid.uuid4().hex[:8]}" if request_id is None else request_id
        req = wire_request(rid, _prompt_ids(prompt, self), sampling_params or SamplingParams(),
                           priority=priority, tenant=tenant, ttft_slo_s=ttft_slo_s,
                           cache_salt=cache_salt)
        ids = req.prompt_token_ids
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
        (a cluster: in every replica, answers combined; see ClusterClient.call_utility)."""
        return await self.core.call_utility(method, *args)

    async def close(self) -> None:
        await self.core.close()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class _LoopThread:
    """An asyncio event loop on a daemon thread, for the synchronous :class:`LLM` over a
    replicated :class:`AsyncLLM`."""

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


async def _stream_batch(core: AsyncCore, requests: list[WireRequest], results: dict[str, RequestOutput],
                        bar: Any) -> None:
    """Stream every request through ``core`` at once, folding outputs into ``results``.

    A request with an arrival offset is sent when it arrives (offset seconds after the
    batch started), not before: the router places it with the replicas' load at that
    moment, as the cluster simulation does, instead of placing a whole trace at once."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def one(w: WireRequest) -> None:
        if w.arrival_offset is not None:
            await asyncio.sleep(max(t0 + w.arrival_offset - loop.time(), 0.0))
            w = msgspec.structs.replace(w, arrival_offset=None)
        async with contextlib.aclosing(core.stream(w)) as outputs:
            async for o in outputs:
                if _apply([o], results) and bar is not None:
                    bar.update(1)

    tasks = [asyncio.create_task(one(w)) for w in requests]
    try:
        await asyncio.gather(*tasks)
    finally:  # one failed (no replica left) or we were cancelled: abort the others
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
