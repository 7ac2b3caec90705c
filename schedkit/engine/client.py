"""The engine process's clients: :class:`EngineClient` (synchronous sockets) and
:class:`AsyncEngineClient` (asyncio, the one :mod:`schedkit.llm`'s ``LLM`` and
``AsyncLLM`` stream through; with replicas, one per replica under the cluster front end).

Each client connects two DEALER sockets (one identity) to the engine's input and output
ROUTER sockets, over ``ipc://`` by default or ``tcp://127.0.0.1``, as a CurveZMQ client
holding the engine launch's client key (:mod:`schedkit.engine.auth`): the engine refuses
anyone else. A dead engine surfaces
as :class:`EngineDeadError` within a few seconds (process exit or missing heartbeats),
never as a hang. Heartbeats that arrive while a client is idle count: they wait on the
socket and are read before the client decides the engine is silent.

Requests are validated (:func:`wire_request`, :func:`schedkit.engine.messages.check_request`)
before they are sent, so a badly typed field raises :class:`RequestError` naming the field
and the request instead of reaching the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from typing import Any, Protocol

import zmq

from schedkit.core.hints import RequestHints
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
    WireOutput,
    WireRequest,
    check_request,
    client_encoder,
    engine_decoder,
    sampling_to_wire,
)
from schedkit.engine.process import START_TIMEOUT_S, EngineProcess
from schedkit.errors import (
    ConfigError,
    EngineDeadError,
    PluginError,
    RequestError,
    SchedkitError,
)

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
                 ttft_slo_s: float | None = None, hints: RequestHints | None = None) -> WireRequest:
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
    if hints is not None and not isinstance(hints, RequestHints):
        raise RequestError(f"request {request_id!r}: hints must be a RequestHints, got {type(hints).__name__}",
                           request_id=request_id)
    w = WireRequest(request_id, ids, sampling_to_wire(params), priority=priority, tenant=tenant,
                    cache_salt=cache_salt, arrival_offset=arrival_offset, final_only=final_only,
                    ttft_slo_s=ttft_slo_s, hints=hints.to_wire() if hints else {})
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
        self._calls: dict[int, tuple[str, asyncio.Future[Any]]] = {}
        """Utility calls waiting for their answer: call id -> (method, future)."""
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
                call = self._calls.pop(res.call_id, None)
                if call is not None and not call[1].done():
                    method, fut = call
                    if res.error is not None:
                        fut.set_exception(utility_error(method, res.error))
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
        for _, fut in self._calls.values():
            if not fut.done():
                fut.set_exception(dead)

    def is_alive(self) -> bool:
        """The engine process runs and answers (False once it died or went silent)."""
        return self._dead is None and self.engine.is_alive()

    def stream(self, request: WireRequest, *,
               session_id: str | None = None) -> AsyncGenerator[WireOutput, None]:
        """:meth:`stream_many` of one request (``session_id`` is for routers; one engine
        ignores it)."""
        return self.stream_many([request])

    async def stream_many(self, requests: Sequence[WireRequest]) -> AsyncGenerator[WireOutput, None]:
        """Send (validated) requests in one message and yield their outputs as they come,
        until each has finished (its last output has ``finish_reason`` set). Leaving
        early aborts the unfinished ones in the engine.

        Raises:
            EngineDeadError: The engine died (at once, or while the requests ran).
            RequestError: An id is already streaming in this client.
            RuntimeError: Called on an event loop other than the client's, which still
                runs (another thread).
        """
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        self._follow_loop()
        ids = [w.request_id for w in requests]
        for rid in ids:
            if rid in self._queues:
                raise RequestError(f"request {rid!r} is already streaming in this client "
                                   "(request ids must be unique)", request_id=rid)
        q: asyncio.Queue[WireOutput | BaseException] = asyncio.Queue()
        for rid in ids:
            self._queues[rid] = q
        unfinished = set(ids)
        try:
            await self._send(self.in_sock, client_encoder.encode(AddRequests(list(requests))))
            while unfinished:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    unfinished.discard(item.request_id)
                yield item
        finally:
            for rid in ids:
                self._queues.pop(rid, None)
            if unfinished and self._dead is None and not self.in_sock.closed:
                await self._send(self.in_sock, client_encoder.encode(AbortRequests(list(unfinished))))

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Run a utility method (stats, reset_prefix_cache, list_plugins...) in the engine."""
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        self._follow_loop()
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (method, fut)
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
