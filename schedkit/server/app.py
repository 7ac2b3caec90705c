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
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
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
                 on_error: Callable[[int], None], body_timeout_s: float = 30.0) -> None:
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


def build_app(server_factory: Callable[[], Awaitable[Server]], *, max_body_bytes: int,
              api_key: str | None, body_timeout_s: float = 30.0,
              ) -> tuple[LimitsMiddleware, Callable[[], Server | None]]:
    """The ASGI app; ``server_factory`` starts the engine (at startup), returning the
    :class:`Server`. Returns the app (behind the limits) and a getter for the server."""
    state: dict[str, Server] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state["server"] = await server_factory()
        freeze_startup_heap()  # imports, tokenizer, app: never garbage, so no GC pass walks them
        try:
            yield
        finally:
            srv = state["server"]
            srv.draining = True
            srv.abort_all()
            await asyncio.sleep(0)
            await srv.llm.close()
            srv.close()

    app = FastAPI(title="schedkit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def srv() -> Server:
        return state["server"]

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        state["server"].metrics.http_error(e.status)
        return _error_response(e, _valid_request_id(request.headers.get("x-request-id")))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # an unknown route (404) or method (405): OpenAI's error shape, like every other error
        return await _api_error(request, APIError(e.status_code, f"{request.method} {request.url.path}: "
                                                  f"{e.detail}", headers=dict(e.headers or {})))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return await _api_error(request, APIError(500, f"internal error: {type(e).__name__}"))

    async def _generate(request: Request, kind: str) -> Response:
        arrival = time.perf_counter()  # the latencies recorded count from here
        s = srv()
        if kind == "chat":
            req: Any = await _request_of(request, ChatCompletionRequest, s)
            prefix = "chatcmpl"
        else:
            req = await _request_of(request, CompletionRequest, s)
            prefix = "cmpl"
        s.check_model(req.model)
        wants_logprobs = req.logprobs is not None and req.logprobs is not False
        if wants_logprobs or getattr(req, "top_logprobs", None) is not None:
            param = "logprobs" if wants_logprobs else "top_logprobs"
            raise APIError(400, f"{param}: logprobs are not available, schedkit's runners return "
                           "sampled token ids only", param=param)
        rid = request_id_from_header(request.headers.get("x-request-id"), prefix)
        if kind == "chat":
            s.check_capacity(req.n, 1, "n")
            prompts = [await s.chat_prompt(req.messages, req.add_generation_prompt)]
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        else:
            texts = req.prompts()
            # before any work per prompt: a batch the pending limit can never take is refused whole
            s.check_capacity(req.n, len(texts), "prompt" if len(texts) > 1 else "n")
            prompts = [await s.encode(p, f"prompt[{i}]" if len(texts) > 1 else "prompt")
                       for i, p in enumerate(texts)]
            max_tokens, param = req.max_tokens, "max_tokens"
        choices = s.make_choices(req, rid, prompts, max_tokens, param)
        gen = Generation(s, kind, rid, req, prompts, choices, arrival)
        try:
            return await _answer(request, gen, req.stream, {"X-Request-Id": rid})
        except asyncio.CancelledError:  # uvicorn gave up on this request (shutdown timeout)
            gen.cancel()
            raise

    async def _answer(request: Request, gen: Generation, stream: bool,
                      headers: dict[str, str]) -> Response:
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

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, "chat")

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> dict[str, Any]:
        s = srv()
        return {"object": "list", "data": [{
            "id": s.model_name, "object": "model", "created": int(time.time()), "owned_by": "schedkit",
            "root": s.config.model.name, "max_model_len": s.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        s = srv()
        req = await _request_of(request, TokenizeRequest, s)
        s.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            ids = await s.chat_prompt(req.messages, req.add_generation_prompt)
        else:
            ids = await s.tokenize(req.prompt, what="tokenize", add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        s = srv()
        req = await _request_of(request, DetokenizeRequest, s)
        s.check_model(req.model)
        tok = s._need_tokenizer("detokenize", "tokens")
        ids = await s.encode(list(req.tokens), "tokens") if req.tokens else []
        return {"prompt": await s.off_loop(tok.decode, ids, size=len(ids))}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        s = srv()
        if not s.llm_alive():
            return JSONResponse(APIError(503, "the engine is not running").body(), status_code=503)
        if s.draining:
            return JSONResponse(APIError(503, "the server is shutting down").body(), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        s = srv()
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

    def count_error(status: int) -> None:
        if "server" in state:
            state["server"].metrics.http_error(status)

    return (LimitsMiddleware(app, max_body_bytes, api_key, count_error, body_timeout_s),
            lambda: state.get("server"))
