"""EngineCoreProc: EngineCore in its own process, fed over ZMQ.

Threads of the engine process:

- input thread: receives ``[identity, payload]`` on a ROUTER socket, decodes the msgspec
  payload and puts it on the input queue; a malformed message is counted, logged (at most
  one line per ``MALFORMED_LOG_INTERVAL_S``) and dropped. The requests of an add message
  stay encoded until the busy loop decodes them one by one: a badly typed request fails
  alone, with an error output.
- busy loop (main thread): blocks on the input queue only while there is no work;
  otherwise drains it without blocking (ADD / ABORT / UTILITY), runs one step and puts
  each client's outputs on the output queue.
- output thread: owns a second ROUTER socket; answers ``Hello`` with ``Ready``, encodes and
  sends output batches, and sends a heartbeat every 0.5 s so clients can tell a dead
  engine from a slow one.

A client whose ``Hello`` asks for load reports (the cluster front end) also gets a
``LoadReport`` (queue lengths, KV usage, the prefill work queued and the decode context
held, :mod:`schedkit.engine.load`; the KV cache events since the last one) from the
busy loop, at most every ``LOAD_REPORT_INTERVAL_S`` and only when something changed;
reports share the output queue with the outputs, so nothing is lost or reordered.

- guard thread (:class:`~schedkit.engine.auth.EngineGuard`): both ROUTER sockets are
  CurveZMQ servers; it admits only the client key of this launch and counts the
  handshakes refused (``num_refused_connections`` in ``stats``).

Each socket is used by one thread only (ZMQ sockets are not thread-safe).

The process leaves (removing its socket files) when its parent goes: stdin EOF, the
parent's death signal (Linux ``PR_SET_PDEATHSIG``, asked for when the parent started us
from its main thread), or a changed parent pid, checked every ``PARENT_CHECK_S``. The last
two also work when the parent forked children that inherited our stdin pipe.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import logging
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from schedkit.config import Config
from schedkit.core.hints import hints_from_wire
from schedkit.core.outputs import EngineCoreOutputs
from schedkit.core.request import Request
from schedkit.engine.auth import EngineGuard, EngineKeys
from schedkit.engine.core import EngineCore, refusal_stop_reason
from schedkit.engine.gc_heap import freeze_startup_heap
from schedkit.engine.kv_handoff import KV_METHODS, KVHandoffs
from schedkit.engine.load import LoadFigures, load_figures
from schedkit.engine.logs import RateLimitedLog
from schedkit.engine.messages import (
    AbortRequests,
    Heartbeat,
    Hello,
    LoadReport,
    OutputBatch,
    RawAddRequests,
    Ready,
    UtilityCall,
    UtilityResult,
    WireMetrics,
    WireOutput,
    WireRequest,
    check_request,
    client_decoder,
    decode_request,
    engine_encoder,
    hello_decoder,
    kv_events_to_wire,
)
from schedkit.errors import ConfigError, EngineDeadError, PluginError, RequestError, SchedkitError

log = logging.getLogger("schedkit.engine")

HEARTBEAT_INTERVAL_S = 0.5
MALFORMED_LOG_INTERVAL_S = 10.0
"""At most one log line per this many seconds about malformed messages."""
GRAMMAR_POLL_S = 0.002
"""How long the idle loop waits for input while only grammars are compiling."""
PARENT_CHECK_S = 0.25
"""How often the engine process checks that its parent is still its parent."""
LOAD_REPORT_INTERVAL_S = 0.05
"""Load reports go out at most this often (each carries every KV event since the last)."""
UTILITY_METHODS = ("stats", "reset_prefix_cache", "set_pause_state", "list_plugins", "shutdown",
                   "num_unfinished", "migrate_out", *KV_METHODS)


def request_from_wire(w: WireRequest, client_index: int, now: float) -> Request:
    """Build a Request (validating it) from its wire form."""
    params = check_request(w)
    req = Request(w.request_id, w.prompt_token_ids, params, arrival_time=now,
                  priority=w.priority, client_index=client_index, tenant=w.tenant,
                  cache_salt=w.cache_salt, ttft_slo_s=w.ttft_slo_s, hints=hints_from_wire(w.hints, w.request_id))
    if w.resume_token_ids:
        if len(w.resume_token_ids) >= req.max_tokens:
            raise RequestError(f"request {w.request_id!r}: resume_token_ids has {len(w.resume_token_ids)} "
                               f"tokens, not fewer than max_tokens ({req.max_tokens}): nothing is left to "
                               "generate", request_id=w.request_id)
        for t in w.resume_token_ids:
            req.append_output_token_ids(t)
    return req


def metrics_of(req: Request) -> WireMetrics:
    return WireMetrics.of(req)


class EngineCoreProc:
    """Args:
        config: The validated config (plugins are loaded here, in the engine process).
        input_addr: ZMQ address the input ROUTER binds (``ipc://...`` or ``tcp://127.0.0.1:N``).
        output_addr: ZMQ address the output ROUTER binds.
        keys: This launch's keys (the engine's part): only their client may connect.
    """

    def __init__(self, config: Config, input_addr: str, output_addr: str, keys: EngineKeys, *,
                 runner: Any = None) -> None:
        self.engine = EngineCore(config, runner=runner)
        self.handoffs = KVHandoffs(self.engine)
        self.input_queue: queue.Queue[tuple[bytes, Any]] = queue.Queue()
        self.output_queue: queue.Queue[tuple[int, OutputBatch | LoadReport]] = queue.Queue()
        self.ctx = zmq.Context()
        self.guard = EngineGuard(self.ctx, keys, log)
        self._stop = threading.Event()
        self._identities: list[bytes] = []
        self._index_of: dict[bytes, int] = {}
        self._lock = threading.Lock()
        self._live: dict[str, Request] = {}
        self._final_only: set[str] = set()
        self._subscribers: tuple[int, ...] = ()
        """Clients that asked for load reports (replaced whole, never mutated: the output
        thread adds, the busy loop reads)."""
        self._kv_events: list[Any] = []
        self._report_seq = 0
        self._last_report_t = float("-inf")
        self._last_load: LoadFigures | None = None
        self.num_malformed = 0
        self._malformed_log = RateLimitedLog(log, MALFORMED_LOG_INTERVAL_S)
        self._in_sock = self._bind(input_addr, "input")
        self._out_sock = self._bind(output_addr, "output")
        self._threads = [threading.Thread(target=self._input_loop, name="schedkit-input", daemon=True),
                         threading.Thread(target=self._output_loop, name="schedkit-output", daemon=True),
                         threading.Thread(target=self.guard.run, args=(self._stop,), name="schedkit-guard",
                                          daemon=True)]

    def _bind(self, addr: str, name: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        self.guard.protect(sock, name)
        sock.bind(addr)
        return sock

    def client_index(self, identity: bytes) -> int:
        with self._lock:
            idx = self._index_of.get(identity)
            if idx is None:
                idx = self._index_of[identity] = len(self._identities)
                self._identities.append(identity)
            return idx

    # -- threads -------------------------------------------------------------------------
    def _input_loop(self) -> None:
        sock = self._in_sock
        while not self._stop.is_set():
            if not sock.poll(100):
                continue
            frames = sock.recv_multipart(copy=False)
            if len(frames) != 2:
                self._malformed(f"{len(frames)} frames")
                continue
            identity, payload = frames[0].bytes, frames[1].buffer
            try:
                msg = client_decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self._malformed(str(e))
                continue
            self.input_queue.put((identity, msg))
        sock.close(0)

    def _malformed(self, why: str) -> None:
        self.num_malformed += 1
        self._malformed_log.warning("dropped a malformed message on the input socket: %s", why)

    def _output_loop(self) -> None:
        sock = self._out_sock
        encode = engine_encoder.encode
        next_beat = time.monotonic()
        while True:
            while sock.poll(0):
                frames = sock.recv_multipart()
                hello = self._hello(frames)
                if hello is not None:
                    idx = self.client_index(frames[0])
                    if hello.load_reports and idx not in self._subscribers:
                        with self._lock:
                            self._subscribers = (*self._subscribers, idx)
                    sock.send_multipart([frames[0], encode(Ready(client_index=idx))])
            try:
                client, batch = self.output_queue.get(timeout=0.05)
                sock.send_multipart([self._identities[client], encode(batch)], copy=False)
                continue
            except queue.Empty:
                if self._stop.is_set():
                    break
            now = time.monotonic()
            if now >= next_beat:
                beat = encode(Heartbeat(engine_time=self.engine.now()))
                for identity in list(self._identities):
                    sock.send_multipart([identity, beat])
                next_beat = now + HEARTBEAT_INTERVAL_S
        sock.close(0)

    @staticmethod
    def _hello(frames: list[bytes]) -> Hello | None:
        if len(frames) != 2:
            return None
        try:
            return hello_decoder.decode(frames[1])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    # -- busy loop -----------------------------------------------------------------------
    def run_busy_loop(self) -> None:
        for t in self._threads:
            t.start()
        engine = self.engine
        try:
            while not self._stop.is_set():
                self._wait_for_work()
                while True:
                    try:
                        identity, msg = self.input_queue.get_nowait()
                    except queue.Empty:
                        break
                    self._handle(identity, msg)
                if engine.has_requests():
                    self._dispatch(engine.step())
                if self._subscribers:
                    self._report_load()
        finally:
            self._stop.set()
            for t in self._threads:
                t.join(timeout=2)
            self.ctx.term()
            engine.close()

    def _report_load(self) -> None:
        """Queue a LoadReport for the subscribed clients if one is due and something
        changed (the KV events are collected at every call, so none is dropped)."""
        sched = self.engine.scheduler
        kv = sched.kv_cache_manager
        self._kv_events.extend(kv.take_events())
        now = time.monotonic()
        if now - self._last_report_t < LOAD_REPORT_INTERVAL_S:
            return
        load = load_figures(sched)
        if not self._kv_events and load == self._last_load:
            return
        report = LoadReport(self._report_seq, load.num_waiting, load.num_running, load.kv_cache_usage,
                            kv_events_to_wire(self._kv_events), load.num_prefill_tokens,
                            load.num_prefill_requests, load.prefill_attention, load.num_context_tokens,
                            list(load.decode_tokens_left), list(load.prefill_queue))
        self._report_seq += 1
        self._kv_events = []
        self._last_load, self._last_report_t = load, now
        for client in self._subscribers:
            self.output_queue.put((client, report))

    def _wait_for_work(self) -> None:
        engine = self.engine
        if engine.num_steps_in_flight:
            return
        if engine.scheduler.has_requests():
            if engine.last_step_empty and engine.waiting_for_grammars():
                # Nothing runs until a grammar compiles: wait a little, but not for new work.
                with contextlib.suppress(queue.Empty):
                    self._handle(*self.input_queue.get(timeout=GRAMMAR_POLL_S))
            return
        delay = engine.next_arrival_in()
        if delay is not None and (delay == 0 or engine.is_virtual):
            return
        try:
            item = self.input_queue.get(timeout=min(delay, 0.1) if delay is not None else 0.1)
        except queue.Empty:
            return
        self._handle(*item)

    def _handle(self, identity: bytes, msg: Any) -> None:
        client = self.client_index(identity)
        if isinstance(msg, RawAddRequests):
            self._add(client, msg.requests)
        elif isinstance(msg, AbortRequests):
            aborted = self.engine.abort_requests(msg.request_ids)
            outs = []
            for r in aborted:
                out = WireOutput(r.request_id, finish_reason="abort")
                self._finalize(out, r)
                outs.append(out)
            self._send_by_client(outs)
            for r in aborted:
                self._live.pop(r.request_id, None)
        elif isinstance(msg, UtilityCall):
            self.output_queue.put((client, OutputBatch(utility_results=[self._utility(msg)])))
        elif isinstance(msg, Hello):
            pass  # hellos belong on the output socket; harmless here
        else:  # a type the decoder knows but we do not handle is a bug
            raise AssertionError(type(msg))

    def _add(self, client: int, requests: list[msgspec.Raw]) -> None:
        errors = []
        engine = self.engine
        for raw in requests:
            w, rid, why = decode_request(raw)
            if w is None:
                if not isinstance(rid, str):  # no id to answer to
                    self._malformed(f"a request without a readable id: {why}")
                    continue
                errors.append(WireOutput(rid, finish_reason="error", stop_reason="refused",
                                         error=f"request {rid!r}: malformed request: {why}"))
                continue
            try:
                req = request_from_wire(w, client, engine.now())
                if w.request_id in self._live:
                    raise SchedkitError(f"duplicate request id {w.request_id!r}")
                if w.kv_send:
                    self.handoffs.send_when_finished(w.request_id)
                engine.add_request(req, w.arrival_offset)
            except (SchedkitError, ValueError) as e:
                errors.append(WireOutput(w.request_id, finish_reason="error", stop_reason=refusal_stop_reason(e),
                                         error=str(e)))
                continue
            self._live[w.request_id] = req
            if w.final_only:
                self._final_only.add(w.request_id)
        if errors:
            self.output_queue.put((client, OutputBatch(outputs=errors)))

    def _utility(self, call: UtilityCall) -> UtilityResult:
        method = call.method
        try:
            if method == "stats":
                result: Any = self.engine.stats() | {"num_malformed_messages": self.num_malformed,
                                                     "num_refused_connections": self.guard.num_refused,
                                                     "num_gc_frozen_objects": gc.get_freeze_count()
                                                     } | self.handoffs.stats()
            elif method == "reset_prefix_cache":
                if len(call.args) > 1 or not all(isinstance(x, bool) for x in call.args):
                    return UtilityResult(call.call_id, error="reset_prefix_cache takes one optional "
                                         f"bool (reset_running_requests), got {call.args!r}")
                result = self.engine.reset_prefix_cache(*call.args)
            elif method == "set_pause_state":
                if len(call.args) != 1:
                    return UtilityResult(call.call_id, error="set_pause_state takes one state")
                self.engine.set_pause_state(call.args[0])
                result = self.engine.scheduler.pause_state.value
            elif method == "list_plugins":
                result = self.engine.list_plugins()
            elif method == "num_unfinished":
                result = len(self._live)
            elif method in KV_METHODS:
                result = self.handoffs.call(method, call.args)
            elif method == "migrate_out":
                result = self._migrate_out(call.args)
            elif method == "shutdown":
                self._stop.set()
                result = True
            else:
                return UtilityResult(call.call_id, error=f"unknown utility method {method!r}; "
                                                         f"known: {', '.join(UTILITY_METHODS)}")
        except SchedkitError as e:  # the caller's mistake (a bad argument): no traceback
            log.warning("utility %s: %s", method, e)
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")
        except Exception as e:  # a utility failing must not take the engine down
            log.exception("utility %s failed", method)
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")
        return UtilityResult(call.call_id, result=result)

    def _migrate_out(self, args: list[Any]) -> bool:
        """Stop a request for its move to another engine: its stream here ends with
        finish_reason "migrated" and its state in ``kv_transfer_params`` (queued before
        the utility's answer, after every delta it had). False: a step is in flight."""
        moved = self.handoffs.migrate_out(args)
        if moved is None:
            return False
        req, state = moved
        rid = req.request_id
        self._live.pop(rid, None)
        self._final_only.discard(rid)
        self.output_queue.put((req.client_index, OutputBatch(outputs=[
            WireOutput(rid, finish_reason="migrated", kv_transfer_params=state, metrics=metrics_of(req))])))
        return True

    def _dispatch(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        live, final_only = self._live, self._final_only
        only_ends = len(final_only) == len(live)  # an offline batch: only finishes go out
        for client, group in outputs.items():
            if only_ends:
                send = [o for o in group.outputs if o.finish_reason is not None]
                for o in send:
                    self._finalize(o, live.pop(o.request_id, None))
            else:
                send = []
                for o in group.outputs:
                    if o.finish_reason is None:
                        if not final_only or o.request_id not in final_only:
                            send.append(o)
                        continue
                    self._finalize(o, live.pop(o.request_id, None))
                    send.append(o)
            if send:
                self.output_queue.put((client, OutputBatch(outputs=send)))

    def _finalize(self, out: WireOutput, req: Request | None) -> None:
        """Attach the finished request's metrics (and, for final-only, all its tokens)."""
        if req is None:
            return
        out.metrics = metrics_of(req)
        if req.request_id in self._final_only:
            self._final_only.discard(req.request_id)
            out.new_token_ids = list(req.output_token_ids)

    def _send_by_client(self, outs: list[WireOutput]) -> None:
        by_client: dict[int, list[WireOutput]] = {}
        for o in outs:
            req = self._live.get(o.request_id)
            client = req.client_index if req is not None else 0
            by_client.setdefault(client, []).append(o)
        for client, group in by_client.items():
            self.output_queue.put((client, OutputBatch(outputs=group)))


START_TIMEOUT_S = 120.0


def _free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EngineProcess:
    """Starts (and owns) one engine-core process for a validated config.

    The config and its plugins are checked in this process first, so a bad YAML or a
    plugin that is not installed stops the launch before any process starts.

    Only the holder of :attr:`keys` can talk to the engine: its sockets are CurveZMQ
    servers that admit this launch's client key alone (:mod:`schedkit.engine.auth`). The
    engine gets its part of the keys on stdin, with the config. ipc socket files live in
    a directory of their own that only this user can enter (mode 0700), removed at
    shutdown.

    Args:
        transport: ``ipc`` (socket files) or ``tcp``.
        host: With tcp, the address the engine's sockets bind (default loopback; a Ray
            replica on another node binds its node's IP, see ``replicas.engine_host``).
        wait: Wait for the engine's ``ready`` here; False leaves it to :meth:`wait_ready`
            (so that a caller can spawn from its own thread and wait in another).
        keys: The launch's keys (default: new ones); a Ray replica's come from its front end.
    """

    def __init__(self, config: Config, *, transport: str = "ipc", log_level: str = "WARNING",
                 wait: bool = True, host: str = "127.0.0.1", keys: EngineKeys | None = None) -> None:
        from schedkit.plugins.manager import get_plugin_manager
        from schedkit.runners import configured_runner_class

        get_plugin_manager(config)  # raises ConfigError / PluginError before spawning
        configured_runner_class(config)
        self.keys = keys if keys is not None else EngineKeys.generate()
        self._paths: list[Path] = []
        if transport == "ipc":
            private = Path(tempfile.mkdtemp(prefix="schedkit-"))  # mode 0700
            self._paths = [private / "in.sock", private / "out.sock"]
            self.input_addr, self.output_addr = (f"ipc://{p}" for p in self._paths)
        elif transport == "tcp":
            self.input_addr = f"tcp://{host}:{_free_tcp_port(host)}"
            self.output_addr = f"tcp://{host}:{_free_tcp_port(host)}"
        else:
            raise SchedkitError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        # A fresh interpreter (not multiprocessing): no re-import of the caller's __main__,
        # so scripts need no ``if __name__ == "__main__"`` guard.
        argv = [sys.executable, "-m", "schedkit.engine.process", "--input", self.input_addr,
                "--output", self.output_addr, "--log-level", log_level,
                "--parent-pid", str(os.getpid())]
        if threading.current_thread() is threading.main_thread():
            # The kernel's parent-death signal fires when the spawning *thread* exits:
            # safe only from the main thread, which lives as long as the process.
            argv.append("--parent-death-signal")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        assert self.proc.stdin is not None and self.proc.stdout is not None
        start = {"config": config.model_dump(mode="json"), "keys": self.keys.engine_part()}
        self.proc.stdin.write(json.dumps(start) + "\n")
        self.proc.stdin.flush()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until the engine answers ``ready``.

        Raises:
            EngineDeadError: It answered an error, exited, or said nothing in START_TIMEOUT_S.
        """
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        line = self.proc.stdout.readline().strip() if ready else ""
        if not line.startswith("ready"):
            self.shutdown()
            detail = line.removeprefix("error ") or f"no answer (exit code {self.proc.returncode})"
            kind, _, message = detail.partition(": ")
            typed = START_ERRORS.get(kind)
            if typed is not None:  # the user's mistake, not a dead engine: keep its type
                raise typed(message)
            raise EngineDeadError(f"the engine process failed to start: {detail}")

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def death_reason(self) -> str:
        """Why :meth:`is_alive` is False, for error messages."""
        return f"the engine process exited (code {self.exitcode})"

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the process (SIGTERM, then SIGKILL), reap it and remove the socket files
        and their directory."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        _remove_ipc_files(self.input_addr, self.output_addr)


def _remove_ipc_files(*addrs: str) -> None:
    """Remove the socket files of ``addrs``, then their directory if that is left empty."""
    for addr in addrs:
        if addr.startswith("ipc://"):
            path = Path(addr[len("ipc://"):])
            path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # not empty (the other socket's file), or gone
                path.parent.rmdir()


def _exit_when_parent_goes(stdin: Any, addrs: tuple[str, ...]) -> None:
    """The parent keeps our stdin open; EOF means it closed it or died: leave at once,
    taking our socket files with us. (A child the parent forked keeps the pipe open too:
    :func:`_watch_parent_pid` covers that case.)"""
    while stdin.read(4096):
        pass
    _remove_ipc_files(*addrs)
    os._exit(0)


def _watch_parent_pid(parent_pid: int, addrs: tuple[str, ...]) -> None:
    """Leave once we are no longer ``parent_pid``'s child (it died; we were reparented)."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_S)
    _remove_ipc_files(*addrs)
    os._exit(0)


PR_SET_PDEATHSIG = 1

START_ERRORS: dict[str, type[SchedkitError]] = {"ConfigError": ConfigError, "PluginError": PluginError}
"""Typed errors an engine reports when it fails to start, raised as the same type."""
"""Errors the engine process reports at start-up that the client raises as they are."""


def _ask_for_parent_death_signal(sig: int) -> bool:
    """Linux: have the kernel send ``sig`` when the thread that spawned us exits. Unlike a
    pipe, this is not inherited by the parent's forks. False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def main(argv: list[str] | None = None) -> None:
    """Entry point of the engine process, started by :class:`~schedkit.engine.client.EngineProcess`
    as ``python -m schedkit.engine.process --input ADDR --output ADDR``. The config and
    the engine's part of the launch's keys come as one JSON line on stdin (``{"config":
    ..., "keys": ...}``); one line on stdout answers ``ready PID`` or ``error MSG``."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--log-level", default="WARNING")
    ap.add_argument("--parent-pid", type=int, default=None,
                    help="exit when no longer this process's child (default: the parent now)")
    ap.add_argument("--parent-death-signal", action="store_true",
                    help="ask the kernel for SIGTERM when the spawning thread exits (Linux)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s engine %(levelname)s %(message)s")
    addrs = (args.input, args.output)

    def on_sigterm(*_: Any) -> None:
        _remove_ipc_files(*addrs)
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    if args.parent_death_signal:
        _ask_for_parent_death_signal(signal.SIGTERM)
    parent_pid = os.getppid() if args.parent_pid is None else args.parent_pid
    # Started after the death signal was asked for: a parent gone before is seen here.
    threading.Thread(target=_watch_parent_pid, args=(parent_pid, addrs), daemon=True).start()
    try:
        start = json.loads(sys.stdin.readline())
        config = Config.model_validate(start["config"])
        proc = EngineCoreProc(config, args.input, args.output, EngineKeys.from_engine_part(start["keys"]))
    except Exception as e:
        print(f"error {type(e).__name__}: {e}".replace("\n", " "), flush=True)
        return
    freeze_startup_heap()  # the model and imports: never garbage, so no GC pass walks them
    threading.Thread(target=_exit_when_parent_goes, args=(sys.stdin, addrs), daemon=True).start()
    print(f"ready {os.getpid()}", flush=True)
    try:
        proc.run_busy_loop()
    finally:
        _remove_ipc_files(*addrs)


if __name__ == "__main__":
    main()
