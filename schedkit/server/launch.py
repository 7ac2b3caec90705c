"""``schedkit serve``: the engine process and the HTTP server from one YAML.

uvicorn on uvloop and httptools serves the app, through :class:`FrontDoorProtocol` (the
request line and headers bounded in size, count and time). SIGTERM (or Ctrl-C) drains: the
listening socket closes, ``/health`` answers 503, new requests on open connections get
503, in-flight requests have ``server.drain_grace_s`` to finish and are then aborted
(streams end with finish_reason "abort"); then the engine shuts down and the process
exits 0. With ``server.exit_on_engine_death`` an engine that dies ends the open streams
with their error event and the process exits 1.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from schedkit.config import Config
from schedkit.server.app import build_app
from schedkit.server.front_door import HeadLimits, front_door_protocol
from schedkit.server.serving import Server

log = logging.getLogger("schedkit.server")

API_KEY_ENV = "SCHEDKIT_API_KEY"


def served_model_name(config: Config) -> str:
    return config.server.served_model_name or Path(config.model.name).name


def resolve_api_key(config: Config, cli_key: str | None) -> str | None:
    """``--api-key``, else ``$SCHEDKIT_API_KEY``, else ``server.api_key`` (None: open)."""
    return cli_key or os.environ.get(API_KEY_ENV) or config.server.api_key


async def start_server(config: Config) -> Server:
    """Start the engine process and everything the endpoints share."""
    from schedkit.engine.tokenizer import load_tokenizer, model_eos_ids
    from schedkit.llm import AsyncLLM
    from schedkit.server.metrics import ServerMetrics

    if config.runner.kind == "simulated" or getattr(config.runner, "clock", "wall") == "virtual":
        log.warning("runner %s runs on a virtual clock: the engine's times (queue time, "
                    "ttft_slo_s deadlines) are virtual seconds while the HTTP latencies are "
                    "wall time (runner.clock: wall makes the fake runner real-time)", config.runner.kind)
    tokenizer = await asyncio.to_thread(load_tokenizer, config)
    eos_ids = await asyncio.to_thread(model_eos_ids, config)
    llm = await AsyncLLM.create(config)
    try:
        plugins = await llm.call_utility("list_plugins")
        name = served_model_name(config)
        metrics = ServerMetrics(name, config.scheduler.policy, plugins, config.server.max_tenant_labels,
                                config.scheduler.max_model_len, config.slo_classes)
        llm.tokenizer = tokenizer
        return Server(config, llm, tokenizer, metrics, name, eos_ids)
    except BaseException:
        await llm.close()
        raise


def serve(config: Config, *, host: str | None = None, port: int | None = None,
          api_key: str | None = None, log_level: str = "warning") -> int:
    """Run the server until SIGTERM / SIGINT; returns the exit code (0 after a drain,
    1 when it could not start or, with ``server.exit_on_engine_death``, when the engine
    died)."""

    sc = config.server
    host = sc.host if host is None else host
    port = sc.port if port is None else port
    key = resolve_api_key(config, api_key)
    app, get_server = build_app(lambda: start_server(config), max_body_bytes=sc.max_body_bytes,
                                api_key=key, body_timeout_s=sc.body_timeout_s)
    protocol = front_door_protocol(HeadLimits.from_config(sc), app.on_error)
    ucfg = uvicorn.Config(app, host=host, port=port, loop="uvloop", http=protocol,
                          lifespan="on", log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=int(sc.drain_grace_s) + 5,
                          timeout_keep_alive=max(1, round(sc.keep_alive_s)))
    server = DrainingServer(ucfg, get_server, sc.drain_grace_s, key is not None,
                            exit_on_engine_death=sc.exit_on_engine_death)
    try:
        server.run()
    except SystemExit as e:
        # uvicorn exits (3) when the lifespan (the engine's start) fails or the address
        # cannot be bound; ours is the code documented, 1, after closing what started.
        if e.code in (None, 0):
            raise
        log.error("schedkit serve could not start (see above)")
        return 1
    if server.engine_died:
        return 1
    if server.started_ok:
        return 0
    # SIGTERM / SIGINT while the engine was starting: a requested stop, not a failure
    # (the engine finished starting, served nothing and was shut down) -- unless the
    # start itself failed.
    return 0 if server.signalled and not server.startup_failed else 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server with schedkit's drain (a timer aborts what the grace did not
    finish) and a startup line naming where it listens."""

    ENGINE_POLL_S = 0.25
    """How often ``exit_on_engine_death`` asks whether the engine still runs."""

    def __init__(self, config: uvicorn.Config, get_server: Callable[[], Server | None],
                 grace: float, with_key: bool, *, exit_on_engine_death: bool = False) -> None:
        super().__init__(config)
        self.get_server = get_server
        self.grace = grace
        self.with_key = with_key
        self.exit_on_engine_death = exit_on_engine_death
        self.started_ok = False
        self.signalled = False
        self.startup_failed = False
        self.engine_died = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watcher: asyncio.Task[None] | None = None  # held: the loop keeps tasks only weakly

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        srv = self.get_server()
        if self.should_exit or srv is None:
            self.startup_failed = srv is None or bool(getattr(self.lifespan, "startup_failed", False))
            return
        self.started_ok = True
        bound = [s.getsockname() for server in self.servers for s in server.sockets]
        h, p = bound[0][:2] if bound else (self.config.host, self.config.port)
        print(f"schedkit serve: listening on http://{h}:{p} (model {srv.model_name!r}, "
              f"policy {srv.config.scheduler.policy!r}, "
              f"{'API key required' if self.with_key else 'no API key'})", flush=True)
        if self.exit_on_engine_death:
            self._watcher = asyncio.create_task(self._exit_when_engine_dies(srv))

    async def _exit_when_engine_dies(self, srv: Server) -> None:
        while not self.should_exit:
            if not srv.llm_alive():
                # The open streams already hold their error event (the engine client
                # failed them when it saw the death); uvicorn's shutdown lets their
                # connections finish sending it.
                self.engine_died = True
                srv.draining = True
                print("schedkit serve: the engine died; exiting (server.exit_on_engine_death)",
                      file=sys.stderr, flush=True)
                self.should_exit = True
                return
            await asyncio.sleep(self.ENGINE_POLL_S)

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, less its last step: re-raising the signal that stopped the server
        once it has shut down, which would kill the process with SIGTERM after the drain
        instead of letting it exit 0."""
        with super().capture_signals():
            yield
            self._captured_signals.clear()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signalled = True
        srv = self.get_server()
        loop = self._loop
        if srv is not None and not srv.draining:
            srv.draining = True
            print(f"schedkit serve: draining ({srv.num_pending} requests in flight, "
                  f"{self.grace:g} s grace)", file=sys.stderr, flush=True)
            if loop is not None:
                loop.call_soon_threadsafe(loop.call_later, self.grace, srv.abort_all)
        super().handle_exit(sig, frame)
