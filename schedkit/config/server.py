"""The ``server`` section: the HTTP server of ``schedkit serve``."""

from __future__ import annotations

from pydantic import Field

from schedkit.config.base import StrictModel


class ServerConfig(StrictModel):
    host: str = "127.0.0.1"
    """Address ``schedkit serve`` binds (loopback unless told otherwise)."""
    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port (0: any free port, printed at start)."""
    api_key: str | None = Field(default=None, min_length=1)
    """With a key every ``/v1`` route needs ``Authorization: Bearer KEY`` (also from
    ``--api-key`` or the ``SCHEDKIT_API_KEY`` environment variable)."""
    served_model_name: str | None = Field(default=None, min_length=1)
    """The model name clients send and ``/v1/models`` lists (None: the last part of
    ``model.name``)."""
    max_pending_requests: int = Field(default=1024, ge=1)
    """Generation requests in flight at once (each of ``n`` choices counts); beyond it a
    request is answered 503 with ``Retry-After``. Requests held at the front door
    (``flow_control``) do not count: ``flow_control.max_queued`` bounds them."""
    retry_after_s: int = Field(default=1, ge=0)
    """The ``Retry-After`` seconds of a 503 (too many pending requests) or 429 (rejected)."""
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    """Largest request body; a longer one is answered 413."""
    max_n: int = Field(default=16, ge=1, le=1024)
    """Largest ``n`` (choices per request)."""
    keep_alive_s: float = Field(default=10.0, ge=1)
    """Seconds an idle keep-alive connection stays open. Longer than the 5 s after which
    httpx (and so the openai client) drops an idle pooled connection, so the client always
    closes first: a request sent on a connection the server is closing would fail."""
    drain_grace_s: float = Field(default=30.0, ge=0)
    """On SIGTERM: seconds in-flight requests get to finish before they are aborted."""
    exit_on_engine_death: bool = False
    """When the engine dies (every replica, with ``replicas.count`` > 1): False keeps the
    server up with ``/health`` answering 503 (a liveness probe restarts it); True ends the
    open streams with their error event, then exits 1 (vLLM's default), for a supervisor
    that restarts processes rather than probing them."""
    max_tenant_labels: int = Field(default=64, ge=1, le=10000)
    """Tenants (the ``user`` field) with their own label on the per-tenant metrics; the
    others are counted under ``other``."""
    max_request_line_bytes: int = Field(default=8 * 1024, ge=256, le=1024 * 1024)
    """Longest request target (the URL of the request line); a longer one is answered 414
    and its connection closed, before authentication and before the rest is read."""
    max_header_line_bytes: int = Field(default=16 * 1024, ge=256, le=1024 * 1024)
    """Longest header (name and value); a longer one is answered 431."""
    max_header_bytes: int = Field(default=64 * 1024, ge=1024, le=16 * 1024 * 1024)
    """Most bytes of all the headers of one request together; more is answered 431 (the
    server stops reading at the limit)."""
    max_headers: int = Field(default=100, ge=8, le=10000)
    """Most headers in one request; more is answered 431."""
    header_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    """Seconds a request's line and headers may take to arrive, from the connection's
    opening or the request's first byte; a client still sending them then is answered 408
    and its connection closed (one that sent nothing is closed)."""
    body_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    """Seconds a request body may take to arrive in full once its headers have; a client
    still sending it then is answered 408 and its connection closed."""
    tokenizer_threads: int = Field(default=2, ge=1, le=64)
    """Threads that tokenize long texts (over 4,096 characters); short texts have a thread
    of their own, so they never wait behind long ones."""
