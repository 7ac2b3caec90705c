"""The HTTP application: routes, authentication, body limits, disconnects, errors.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``POST /tokenize``, ``POST /detokenize`` (vLLM's), ``GET /health``, ``GET /metrics``.
With an API key, ``/v1/*``, ``/tokenize`` and ``/detokenize`` need
``Authorization: Bearer KEY`` (compared in constant time); ``/health`` and ``/metrics``
stay open for probes and scrapers.

A client that goes away is noticed while its request waits, runs or streams: its
engine requests are aborted at once (the engine drops them at its next step).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from schedkit.engine.gc_heap import freeze_startup_heap
from schedkit.server.body import decode_json
from schedkit.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    apply_hint_headers,
    parse_body,
)
from schedkit.server.serving import Generation, Server, request_id_from_header

log = logging.getLogger("schedkit.server")

ASGIApp = Callable[..., Awaitable[None]]
_PROTECTED = ("/v1/", "/tokenize", "/detokenize")
METRICS_REFRESH_TIMEOUT_S = 2.0
INLINE_BODY_BYTES = 64 * 1024
"""Bodies up to this size are decoded on the event loop (it takes microseconds); larger
ones on the body thread."""


def _error_response(e: APIError, request_id: str | None = None) -> JSONResponse:
    headers = dict(e.headers)
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _valid_request_id(value: str | None) -> str | None:
    """The client's X-Request-Id to echo on an error, unless it is itself what was wrong."""
    try:
        return None if value is None else request_id_from_header(value, "")
    except APIError:
        return None


class LimitsMiddleware:
    """API-key check (401), body size limit (413 naming it) and body time limit (408,
    closing the connection), before any route runs."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, api_key: str | None,
                 on_error: Callable[[int], None], body_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key.encode() if api_key else None
        self.on_error = on_error
        self.body_timeout_s = body_timeout_s

    async def _reject(self, send: Any, e: APIError) -> None:
        self.on_error(e.status)
        body = json.dumps(e.body(), separators=(",", ":")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
        await send({"type": "http.response.start", "status": e.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        if self.api_key is not None and scope["path"].startswith(_PROTECTED):
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                await self._reject(send, APIError(401, "missing or wrong API key (send "
                                                  "Authorization: Bearer KEY)",
                                                  headers={"WWW-Authenticate": "Bearer"}))
                return
        limit = self.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None:
            try:
                too_long = int(length) > limit
            except ValueError:
                await self._reject(send, APIError(400, "Content-Length is not a number"))
                return
            if too_long:
                await self._reject(send, APIError(413, f"the request body has {int(length)} bytes; "
                                                  f"the limit is {limit} (server.max_body_bytes)"))
                return
        # Read the whole body here (it is bounded in size and time), then hand it to the app
        # in one piece.
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await self._read_body(receive)
        except TimeoutError:
            body = APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s "
                            "(server.body_timeout_s)", headers={"Connection": "close"})
        if isinstance(body, APIError):
            await self._reject(send, body)
            return
        if body is None:
            return  # the client left before sending its body
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Any) -> bytearray | APIError | None:
        """The whole body, a 413 past the limit, or None when the client left."""
        body = bytearray()
        more = True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return None
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return APIError(413, f"the request body exceeds {self.max_body_bytes} bytes "
                                "(server.max_body_bytes)")
        return body


async def _request_of(request: Request, model: type[Any], server: Server) -> Any:
    """The request body decoded and validated as ``model`` (see :func:`_parse`): a large
    body on the body thread, not the event loop."""
    raw = await request.body()
    if len(raw) <= INLINE_BODY_BYTES:
        return _parse(raw, model, server)
    return await server.in_body_thread(_parse, raw, model, server)


def _parse(raw: bytes, model: type[Any], server: Server) -> Any:
    """Decode (:func:`decode_json`), refuse by length what the limits refuse anyway
    (:meth:`Server.refuse_by_length`), then validate (:func:`parse_body`).

    Raises:
        APIError: 400 naming what is wrong.
    """
    body = decode_json(raw)
    if isinstance(body, dict):
        server.refuse_by_length(model, body)
    return parse_body(model, body)


async def _until_disconnect(request: Request) -> None:
    """Return when the client has gone (the body must have been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; if the client disconnects first, cancel it (aborting its requests)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        return Response(status_code=499)
    return task.result()


class EventStream(Response):
    """Server-sent events from an async iterator; a disconnect cancels the iterator at once
    (whatever the ASGI server's spec version), which aborts its requests."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        super().__init__(status_code=200, headers=headers | {"Cache-Control": "no-cache"},
                         media_type=self.media_type)
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.chunks = chunks

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        pumping, watching = asyncio.ensure_future(pump()), asyncio.ensure_future(watch())
        try:
            await asyncio.wait({pumping, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (pumping, watching):
                t.cancel()
            for t in (pumping, watching):
                try:
                    await t
                except (asyncio.CancelledError, OSError):
                    pass
                except Exception:  # a stream that failed: log it, still close what it holds
                    log.exception("a response stream failed")
            aclose = getattr(self.chunks, "aclose", None)
            if aclose is not None:
                await aclose()


def _refuse_logprobs(req: Any) -> None:
    """Logprobs cannot be served: a request asking for them is refused (400 naming the
    field)."""
    wants_logprobs = req.logprobs is not None and req.logprobs is not False
    if wants_logprobs or getattr(req, "top_logprobs", None) is not None:
        param = "logprobs" if wants_logprobs else "top_logprobs"
        raise APIError(400, f"{param}: logprobs are not available, schedkit's runners return "
                       "sampled token ids only", param=param)


async def _chat_prompts(s: Server, req: ChatCompletionRequest) -> tuple[list[list[int]], int | None, str]:
    """The chat request's one prompt, its output limit and the limit's field name."""
    s.check_capacity(req.n, 1, "n")
    prompts = [await s.chat_prompt(req.messages, req.add_generation_prompt)]
    if req.max_completion_tokens is not None:
        return prompts, req.max_completion_tokens, "max_completion_tokens"
    return prompts, req.max_tokens, "max_tokens"


async def _completion_prompts(s: Server, req: CompletionRequest) -> tuple[list[list[int]], int | None, str]:
    """The completion request's prompts (one or a batch), its output limit and the
    limit's field name."""
    texts = req.prompts()
    # before any work per prompt: a batch the pending limit can never take is refused whole
    s.check_capacity(req.n, len(texts), "prompt" if len(texts) > 1 else "n")
    prompts = [await s.encode(p, f"prompt[{i}]" if len(texts) > 1 else "prompt")
               for i, p in enumerate(texts)]
    return prompts, req.max_tokens, "max_tokens"


async def _answer(request: Request, gen: Generation, stream: bool, headers: dict[str, str]) -> Response:
    """The generation's response: a stream of events, or the whole answer; 499 when the
    client left before there was anything to send."""
    if stream:
        gone = await _unless_disconnected(request, gen.first())
        if isinstance(gone, Response):  # the client left before the first token
            gen.cancel()
            return gone
        if gen.open == 0 and not gen.pending:
            return Response(status_code=499)
        return EventStream(gen.stream(), headers)
    answer = await _unless_disconnected(request, gen.collect())
    if isinstance(answer, Response):  # the client left: cancelling collect() stops no choice
        gen.cancel()
        return answer
    return JSONResponse(answer, headers=headers)


class ServerRoutes:
    """The HTTP routes and error handlers, bound to the :class:`Server` they serve.
    ``router`` carries the routes; :meth:`lifespan` starts the server (with
    ``server_factory``) before the first request and closes it at shutdown."""

    def __init__(self, server_factory: Callable[[], Awaitable[Server]]) -> None:
        self.server_factory = server_factory
        self.server: Server | None = None
        """The server, once the lifespan started it (it stays after shutdown)."""
        self.router = APIRouter()
        add = self.router.add_api_route
        add("/v1/completions", self.completions, methods=["POST"])
        add("/v1/chat/completions", self.chat_completions, methods=["POST"])
        add("/v1/models", self.models, methods=["GET", "HEAD"])
        add("/tokenize", self.tokenize, methods=["POST"])
        add("/detokenize", self.detokenize, methods=["POST"])
        add("/health", self.health, methods=["GET", "HEAD"])
        add("/metrics", self.metrics, methods=["GET"])
        add("/v1/replicas/{index}/drain", self.drain_replica, methods=["POST"])

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """Start the server; at shutdown, drain it: abort what runs, close the engine."""
        self.server = await self.server_factory()
        freeze_startup_heap()  # imports, tokenizer, app: never garbage, so no GC pass walks them
        try:
            yield
        finally:
            srv = self.server
            srv.draining = True
            srv.abort_all()
            await asyncio.sleep(0)
            await srv.llm.close()
            srv.close()

    def _srv(self) -> Server:
        """The server, which the lifespan started before any request came."""
        assert self.server is not None
        return self.server

    def count_error(self, status: int) -> None:
        """Count an error response of the limits in front of the app (no server yet: none)."""
        if self.server is not None:
            self.server.metrics.http_error(status)

    # -- error handlers ------------------------------------------------------------------
    async def api_error(self, request: Request, e: APIError) -> JSONResponse:
        """An :class:`APIError`, counted, in OpenAI's error shape."""
        self._srv().metrics.http_error(e.status)
        return _error_response(e, _valid_request_id(request.headers.get("x-request-id")))

    async def http_error(self, request: Request, e: StarletteHTTPException) -> JSONResponse:
        """An unknown route (404) or method (405): OpenAI's error shape, like every other error."""
        return await self.api_error(request, APIError(e.status_code, f"{request.method} {request.url.path}: "
                                                      f"{e.detail}", headers=dict(e.headers or {})))

    async def internal_error(self, request: Request, e: Exception) -> JSONResponse:
        """Any other exception: logged, and a 500 naming its type."""
        log.exception("unhandled error on %s", request.url.path)
        return await self.api_error(request, APIError(500, f"internal error: {type(e).__name__}"))

    # -- routes --------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, request: Request, kind: str) -> Response:
        """A completion or chat request: decoded and checked, its prompts encoded, then
        generated and answered (:func:`_answer`)."""
        arrival = time.perf_counter()  # the latencies recorded count from here
        s = self._srv()
        is_chat = kind == "chat"
        req: Any = await _request_of(request, ChatCompletionRequest if is_chat else CompletionRequest, s)
        apply_hint_headers(req, request.headers)
        s.check_model(req.model)
        s.check_hints(req)
        _refuse_logprobs(req)
        rid = request_id_from_header(request.headers.get("x-request-id"), "chatcmpl" if is_chat else "cmpl")
        prompts, max_tokens, param = await (_chat_prompts(s, req) if is_chat else _completion_prompts(s, req))
        choices = s.make_choices(req, rid, prompts, max_tokens, param)
        gen = Generation(s, kind, rid, req, prompts, choices, arrival)
        try:
            return await _answer(request, gen, req.stream, {"X-Request-Id": rid})
        except asyncio.CancelledError:  # uvicorn gave up on this request (shutdown timeout)
            gen.cancel()
            raise

    async def models(self) -> dict[str, Any]:
        s = self._srv()
        return {"object": "list", "data": [{
            "id": s.model_name, "object": "model", "created": int(time.time()), "owned_by": "schedkit",
            "root": s.config.model.name, "max_model_len": s.max_model_len}]}

    async def tokenize(self, request: Request) -> dict[str, Any]:
        s = self._srv()
        req = await _request_of(request, TokenizeRequest, s)
        s.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            ids = await s.chat_prompt(req.messages, req.add_generation_prompt)
        else:
            ids = await s.tokenize(req.prompt, what="tokenize", add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        s = self._srv()
        req = await _request_of(request, DetokenizeRequest, s)
        s.check_model(req.model)
        tok = s._need_tokenizer("detokenize", "tokens")
        ids = await s.encode(list(req.tokens), "tokens") if req.tokens else []
        return {"prompt": await s.off_loop(tok.decode, ids, size=len(ids))}

    async def health(self) -> Response:
        s = self._srv()
        if not s.llm_alive():
            return JSONResponse(APIError(503, "the engine is not running").body(), status_code=503)
        if s.draining:
            return JSONResponse(APIError(503, "the server is shutting down").body(), status_code=503)
        return Response(status_code=200)

    async def drain_replica(self, index: str, timeout_s: str = "60") -> Response:
        """Take replica ``index`` out of rotation and wait up to ``timeout_s`` (query,
        0-3600) for it to empty: a ``drain`` router plugin moves its requests away,
        without one they finish there. 200 once nothing is left on it, 202 when some
        still are (it stays out of rotation; ask again)."""
        from schedkit.cluster.front import ClusterClient

        s = self._srv()
        core = s.llm.core
        if not isinstance(core, ClusterClient):
            raise APIError(400, "the server runs one engine (replicas.count 1): there is no replica to drain")
        count = len(core.router.replicas)
        if not index.isdigit() or int(index) >= count:
            raise APIError(404, f"no replica {index!r}: the server has replicas 0 to {count - 1}", param="index")
        try:
            wait = float(timeout_s)
        except ValueError:
            wait = math.nan
        if not 0 <= wait <= 3600:
            raise APIError(400, f"timeout_s must be seconds from 0 to 3600, got {timeout_s!r}", param="timeout_s")
        replica = core.router.replicas[int(index)]
        try:
            await core.drain(replica.index, wait)
        except TimeoutError:
            pass
        left = replica.num_outstanding if replica.healthy else 0
        return JSONResponse({"replica": replica.index, "drained": left == 0, "num_outstanding": left,
                             "healthy": replica.healthy}, status_code=202 if left else 200)

    async def metrics(self) -> Response:
        s = self._srv()
        collector = s.metrics.engine
        if s.llm_alive():
            try:
                collector.stats = await asyncio.wait_for(s.llm.call_utility("stats"),
                                                         METRICS_REFRESH_TIMEOUT_S)
            except (TimeoutError, Exception) as e:  # a slow or dead engine: last snapshot
                log.warning("metrics: engine stats unavailable: %s", e)
        else:
            collector.stats = collector.stats | {"dead": True}
        return Response(s.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def build_app(server_factory: Callable[[], Awaitable[Server]], *, max_body_bytes: int,
              api_key: str | None, body_timeout_s: float,
              ) -> tuple[LimitsMiddleware, Callable[[], Server | None]]:
    """The ASGI app: a FastAPI app with :class:`ServerRoutes`' routes and error handlers,
    behind :class:`LimitsMiddleware`. ``server_factory`` starts the engine (at startup),
    returning the :class:`Server`. Returns the app and a getter for the server (None
    until it started)."""
    routes = ServerRoutes(server_factory)
    app = FastAPI(title="schedkit", lifespan=routes.lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(routes.router)
    app.exception_handler(APIError)(routes.api_error)
    app.exception_handler(StarletteHTTPException)(routes.http_error)
    app.exception_handler(Exception)(routes.internal_error)
    return (LimitsMiddleware(app, max_body_bytes, api_key, routes.count_error, body_timeout_s),
            lambda: routes.server)
